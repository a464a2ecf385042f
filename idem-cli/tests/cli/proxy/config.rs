//! The options from a TOML file, and the options the proxy refuses.

use std::time::{Duration, Instant};

use serde_json::json;

use super::wire::{memory, run_to_exit_or_started};
use super::{
    anonymous, client, options, post, redis_url, run_to_exit, scope, send, settled, support,
    try_send, until_not_409, Proxy, Upstream,
};

fn write_config(text: &str) -> String {
    let path = support::temp_dir("proxy-config").join("idem-proxy.toml");
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    path.display().to_string()
}

fn strings(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_toml_config_file_sets_the_scope_the_routes_and_the_lease_and_flags_win_over_it() {
    let upstream = Upstream::start();
    let scope = scope("toml");
    let file = write_config(&format!(
        r#"# idem proxy for the shop
listen = "127.0.0.1:0"
upstream = "{upstream}"
store = "{store}"
scope = "{scope}"
lease = "2s"
allow_anonymous = true
protect = ["POST /payments", "POST /block"]
pass = ["/payments/health"]
"#,
        upstream = upstream.url(),
        store = redis_url(),
    ));
    let mut proxy = Proxy::start(&strings(&["--config", &file]));
    let body = json!({"amount": 40});

    // Protected by the file's first rule.
    let url = proxy.at("/payments/new");
    let first = send(post(&url, "cfg-1", &body)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = settled(post(&url, "cfg-1", &body)).await;
    assert!(again.replayed(), "{} {:?}", again.status, again.headers);
    assert_eq!(upstream.seen("cfg-1").await.len(), 1);

    // Passed (checked before the rules), and matched by no rule: both run.
    for path in ["/payments/health", "/other"] {
        let key = format!("cfg-pass{}", path.replace('/', "-"));
        for n in 1..=2 {
            let answer = send(post(&proxy.at(path), &key, &json!({ "n": n }))).await;
            assert_eq!(answer.status, 201, "{path}: {}", answer.text());
            assert!(!answer.replayed(), "{path}");
        }
        assert_eq!(upstream.seen(&key).await.len(), 2, "{path}");
    }

    // The file's scope: a proxy given that scope by flag replays; the
    // same file with another --scope does not.
    let by_flags = Proxy::start(&options(
        &upstream.url(),
        &redis_url(),
        &scope,
        &["--allow-anonymous", "--protect", "POST /payments"],
    ));
    let shared = settled(post(&by_flags.at("/payments/new"), "cfg-1", &body)).await;
    assert!(
        shared.replayed(),
        "the file's scope is {scope}: {} {}",
        shared.status,
        shared.text()
    );
    let other_scope = format!("{scope}.flag");
    let overridden = Proxy::start(&strings(&["--config", &file, "--scope", &other_scope]));
    let own = send(post(&overridden.at("/payments/new"), "cfg-1", &body)).await;
    assert_eq!(own.status, 201, "{}", own.text());
    assert!(!own.replayed(), "--scope wins over the file's");
    assert_eq!(upstream.seen("cfg-1").await.len(), 2);

    // The file's 2 s lease: a proxy killed mid-request holds the key 2 s
    // (not the default 60 s), then another runs it.
    let block = proxy.at("/block?id=cfg");
    let sent = Instant::now();
    let pending = {
        let (block, body) = (block.clone(), body.clone());
        tokio::spawn(async move { try_send(post(&block, "cfg-lease", &body)).await })
    };
    upstream.until_seen("cfg-lease", 1).await;
    proxy.kill();
    let _ = pending.await;
    upstream.release("cfg").await;
    let restarted = Proxy::start(&strings(&["--config", &file]));
    let (conflicts, answer) = until_not_409(sent, || {
        post(&restarted.at("/block?id=cfg"), "cfg-lease", &body)
    })
    .await;
    let ran_at = sent.elapsed();
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert!(
        ran_at < Duration::from_secs(10),
        "taken over after {ran_at:?} ({} 409s): not the file's 2 s lease",
        conflicts.len()
    );
    assert!(ran_at >= Duration::from_millis(1_850), "{ran_at:?}");
    assert_eq!(upstream.seen("cfg-lease").await.len(), 2);
}

/// Runs the proxy with `args`: whether it exited 2 with a message on
/// stderr that mentions one of `words`, and no panic (else what it did).
fn refused(args: Vec<String>, words: &[&str]) -> Result<(), String> {
    let (code, _, stderr) = run_to_exit(&args);
    let lower = stderr.to_lowercase();
    if code != Some(2) || stderr.contains("panicked") || !words.iter().any(|w| lower.contains(w)) {
        return Err(format!(
            "idem proxy {args:?}: exit {code:?} (expected 2, a message naming one of {words:?}, \
             no panic); stderr: {stderr}"
        ));
    }
    Ok(())
}

#[test]
fn bad_options_exit_2_with_a_message_on_stderr_and_never_a_panic() {
    let store = redis_url();
    let good = |more: &[&str]| {
        let mut args = options(
            "http://127.0.0.1:9",
            &store,
            "proxy.bad",
            &["--allow-anonymous"],
        );
        args.extend(more.iter().map(|s| s.to_string()));
        args
    };
    let unknown = write_config(&format!(
        "upstream = \"http://127.0.0.1:9\"\nstore = \"{store}\"\nleese = \"2s\"\n"
    ));
    let not_toml = write_config("upstream = http://127.0.0.1:9\n[[[\n");
    let wrong_type = write_config(&format!(
        "upstream = \"http://127.0.0.1:9\"\nstore = \"{store}\"\nmax_body_bytes = \"many\"\n"
    ));
    let protects_nothing = write_config(&format!(
        "upstream = \"http://127.0.0.1:9\"\nstore = \"{store}\"\nallow_anonymous = true\nprotect = []\n"
    ));
    let cases: Vec<(Vec<String>, &[&str])> = vec![
        (
            strings(&["--config", &protects_nothing]),
            &["protect", "empty"],
        ),
        (good(&["--lease", "0s"]), &["lease"]),
        (good(&["--lease", "soon"]), &["lease", "soon"]),
        (good(&["--retention", "forever"]), &["retention", "forever"]),
        (
            good(&["--max-body-bytes", "lots"]),
            &["max-body-bytes", "lots"],
        ),
        (
            good(&["--listen", "not an address"]),
            &["listen", "address"],
        ),
        (good(&["--scope", "a b"]), &["scope"]),
        (good(&["--release-status", "200"]), &["release-status"]),
        (good(&["--key-header", "connection"]), &["key-header"]),
        (good(&["--protect", "POST payments"]), &["protect"]),
        (good(&["--no-such-flag"]), &["no-such-flag"]),
        (
            options("ftp://x", &store, "proxy.bad", &["--allow-anonymous"]),
            &["upstream", "ftp"],
        ),
        (
            options(
                "http://127.0.0.1:9",
                "nope://x",
                "proxy.bad",
                &["--allow-anonymous"],
            ),
            &["store", "nope"],
        ),
        (
            strings(&["--store", &store, "--listen", "127.0.0.1:0"]),
            &["upstream"],
        ),
        (strings(&["--config", &unknown]), &["leese"]),
        (
            strings(&["--config", &not_toml]),
            &["toml", "config", "expected", "parse", "idem-proxy.toml"],
        ),
        (
            strings(&["--config", &wrong_type]),
            &["max_body_bytes", "max-body-bytes"],
        ),
        (
            strings(&["--config", "/nonexistent/idem-proxy.toml"]),
            &["/nonexistent/idem-proxy.toml"],
        ),
    ];
    let total = cases.len();
    let failures: Vec<String> = cases
        .into_iter()
        .filter_map(|(args, words)| refused(args, words).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {total} bad options were not refused as a usage error:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn a_store_that_is_down_at_start_exits_3() {
    let port = support::free_port();
    let (code, stdout, stderr) = run_to_exit(&options(
        "http://127.0.0.1:9",
        &format!("redis://127.0.0.1:{port}/"),
        "proxy.down",
        &["--allow-anonymous"],
    ));
    assert_eq!(code, Some(3), "stdout: {stdout}\nstderr: {stderr}");
    assert!(
        !stdout.contains("listening on"),
        "it said it was ready: {stdout}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A far `--upstream-timeout` (`1e300s`) is taken as ten years: the proxy
/// still answers protected and passed requests.
#[tokio::test(flavor = "multi_thread")]
async fn a_far_upstream_timeout_still_answers_protected_and_passed_requests() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "far-timeout",
        &["--upstream-timeout", "1e300s"],
    ));
    let body = json!({"amount": 1});
    let url = proxy.at("/pay");
    let first = super::try_send(post(&url, "far-1", &body)).await;
    let passed = super::try_send(super::client().get(proxy.at("/pay"))).await;
    let again = super::try_send(post(&url, "far-1", &body)).await;
    let shown = |r: &Result<super::Answer, reqwest::Error>| match r {
        Ok(a) => format!("{} {}", a.status, a.text()),
        Err(e) => format!("transport error: {e}"),
    };
    assert!(
        matches!(&first, Ok(a) if a.status == 201)
            && matches!(&passed, Ok(a) if a.status == 201)
            && matches!(&again, Ok(a) if a.replayed()),
        "protected: {}\npassed: {}\nretry: {}\nproxy stderr:\n{}",
        shown(&first),
        shown(&passed),
        shown(&again),
        proxy.logs()
    );
}

/// A far `--upstream-idle-timeout` is taken as ten years: pooled
/// connections keep working.
#[tokio::test(flavor = "multi_thread")]
async fn a_far_upstream_idle_timeout_still_serves_requests_on_pooled_connections() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "far-idle",
        &["--upstream-idle-timeout", "1e300s"],
    ));
    let mut shown = Vec::new();
    for i in 0..3 {
        let r = super::try_send(post(
            &proxy.at("/pay"),
            &format!("far-i-{i}"),
            &json!({"i": i}),
        ))
        .await;
        shown.push(match r {
            Ok(a) => format!("{} {}", a.status, a.text()),
            Err(e) => format!("transport error: {e}"),
        });
    }
    let logs = proxy.logs();
    assert!(
        shown.iter().all(|s| s.starts_with("201")) && !logs.contains("panicked"),
        "answers: {shown:#?}\nproxy stderr:\n{logs}"
    );
}

/// A fence or attempt header named `Content-Length` is refused: the proxy
/// would put the fence in place of the client's body length, and the
/// upstream would read the body wrong.
#[test]
fn a_fence_or_attempt_header_named_content_length_is_refused() {
    let mut failures = Vec::new();
    for flag in ["--fence-header", "--attempt-header"] {
        let args = options(
            "http://127.0.0.1:9",
            "memory",
            "proxy.cl",
            &["--allow-anonymous", flag, "content-length"],
        );
        let (code, _, stderr) = run_to_exit_or_started(&args);
        if code != Some(2) {
            failures.push(format!(
                "{flag} content-length: exit {code:?}; stderr: {stderr}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A lease under a second (`1ms`, a slip for `1m`) is refused: the
/// heartbeat could not renew it in time and every duplicate would take a
/// running request over. At the shortest lease taken (1 s, on Redis) a
/// request that runs three leases long still runs once: every duplicate
/// meanwhile gets 409.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_under_a_second_is_refused_and_the_shortest_still_runs_the_upstream_once() {
    let upstream = Upstream::start();
    for tiny in ["1ms", "999ms"] {
        let args = memory(&upstream.url(), "tiny-lease", &["--lease", tiny]);
        let (code, _, stderr) = run_to_exit_or_started(&args);
        assert_eq!(code, Some(2), "--lease {tiny}: {stderr}");
        assert!(stderr.contains("--lease"), "{stderr}");
    }
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("short-lease"),
        &["--lease", "1s"],
    ));
    let url = proxy.at("/block?id=short");
    let body = json!({"amount": 15});
    let first = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { super::try_send(post(&url, "short-1", &body)).await })
    };
    upstream.until_seen("short-1", 1).await;
    let held_until = std::time::Instant::now() + Duration::from_secs(3);
    let mut statuses = Vec::new();
    while std::time::Instant::now() < held_until {
        statuses.push(send(post(&url, "short-1", &body)).await.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let seen = upstream.seen("short-1").await.len();
    upstream.release("short").await;
    let ran = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        seen, 1,
        "the upstream ran {seen} times for one key while the first was running; duplicates got {statuses:?}"
    );
    assert!(statuses.iter().all(|s| *s == 409), "{statuses:?}");
    assert!(
        ran.is_ok_and(|a| a.status == 200),
        "the first request's answer"
    );
}

/// Settings that cannot work are refused with exit 2: a fence or attempt
/// header that is the tenant's header (the proxy would remove the client's
/// value and put the fence number in its place, so the upstream would
/// take the caller for API key `1`), and an upstream URL with no host;
/// the message for a bad cache tier names `--cache`.
#[test]
fn settings_that_clobber_the_tenant_header_or_name_no_upstream_host_are_refused() {
    let base = |upstream: &str, more: &[&str]| {
        let mut args = options(upstream, "memory", "proxy.clobber", &[]);
        args.extend(more.iter().map(|s| s.to_string()));
        args
    };
    let cases: Vec<(&str, Vec<String>)> = vec![
        (
            "--fence-header = --tenant-header",
            base(
                "http://127.0.0.1:9",
                &[
                    "--tenant-header",
                    "x-api-key",
                    "--fence-header",
                    "x-api-key",
                ],
            ),
        ),
        (
            "--attempt-header authorization with --tenant-jwt",
            base(
                "http://127.0.0.1:9",
                &["--tenant-jwt", "--attempt-header", "authorization"],
            ),
        ),
        (
            "--upstream http://:80",
            base("http://:80", &["--allow-anonymous"]),
        ),
    ];
    let mut failures = Vec::new();
    for (name, args) in cases {
        let (code, _, stderr) = run_to_exit_or_started(&args);
        if code != Some(2) {
            failures.push(format!("{name}: exit {code:?} {stderr}"));
        }
    }
    let (code, _, stderr) = run_to_exit_or_started(&base(
        "http://127.0.0.1:9",
        &["--allow-anonymous", "--cache", "nope"],
    ));
    if code != Some(2) || !stderr.contains("--cache") {
        failures.push(format!("--cache nope: exit {code:?}, message: {stderr}"));
    }
    // An in-process tier with no Redis to hear deletes on.
    let (code, _, stderr) = run_to_exit_or_started(&base(
        "http://127.0.0.1:9",
        &["--allow-anonymous", "--cache", "moka"],
    ));
    if code != Some(2) || !stderr.contains("--cache") {
        failures.push(format!(
            "--cache moka on memory: exit {code:?}, message: {stderr}"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// In the TOML file a duration may be a number of seconds (`lease = 30`);
/// values of wrong types exit 2 naming the file, never a crash.
#[test]
fn toml_durations_may_be_numbers_and_wrong_types_exit_2() {
    let dir = support::temp_dir("probe-toml");
    let file = dir.join("proxy.toml");
    std::fs::write(
        &file,
        "upstream = \"http://127.0.0.1:9\"\nstore = \"memory\"\nallow_anonymous = true\n\
         listen = \"127.0.0.1:0\"\nlease = 30\n",
    )
    .expect("write");
    let (code, out, err) =
        super::wire::run_to_exit_or_started(&["--config".to_owned(), file.display().to_string()]);
    let mut wrong = Vec::new();
    for bad in [
        "max_body_bytes = -1",
        "protect = \"POST /pay\"",
        "upstream_http2 = \"yes\"",
        "max_running = 1e3",
        "cache = \"moka\"",
    ] {
        let f = dir.join("bad.toml");
        std::fs::write(
            &f,
            format!("upstream = \"http://127.0.0.1:9\"\nstore = \"memory\"\nlisten = \"127.0.0.1:0\"\n{bad}\n"),
        )
        .expect("write");
        let (c, _, e) = super::run_to_exit(&["--config".to_owned(), f.display().to_string()]);
        if c != Some(2) {
            wrong.push(format!("{bad}: exit {c:?} {e}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
    assert_eq!(
        code, None,
        "`lease = 30` in the file: exit {code:?}\n{out}\n{err}"
    );
}

/// Odd values in the TOML file: each is refused with exit 2 naming the
/// problem, or taken; none panics.
#[tokio::test(flavor = "multi_thread")]
async fn odd_config_file_values_are_refused_or_taken_never_a_panic() {
    let upstream = Upstream::start();
    let dir = support::temp_dir("probe-config");
    let cases = [
        "max_body_bytes = -1",
        "max_body_bytes = 1.5",
        "max_body_bytes = 99999999999999999999999",
        "max_body_bytes = 9223372036854775807",
        "max_response_bytes = 9223372036854775807",
        "max_running = 9223372036854775807",
        "upstream_idle_connections = 9223372036854775807",
        "lease = nan",
        "lease = inf",
        "lease = -inf",
        "lease = -1",
        "lease = 1e308",
        "lease = 9223372036854775807",
        "lease = \"1e-400s\"",
        "retention = 1e-9",
        "wait = 1e308",
        "retry_after = 1e308",
        "header_timeout = 1e-9",
        "body_timeout = 1e-9",
        "upstream_timeout = 1e-9",
        "upstream_idle_timeout = 0",
        "shutdown_wait = -0.0",
        "release_status = []",
        "release_status = [65535]",
        "release_status = [-1]",
        "release_status = [100, 101, 199]",
        "fingerprint_pointer = []",
        "fingerprint_pointer = [\"\"]",
        "fingerprint_pointer = [\"no-slash\"]",
        "pass = []",
        "pass = [\"\"]",
        "cache = []",
        "cache = [\"\"]",
        "cache = [\"moka\", \"moka\"]",
        "protect = [\"\"]",
        "protect = [\" \"]",
        "protect = [\"* \"]",
        "protect = [\", /\"]",
        "listen = 80",
        "listen = \"\"",
        "unknown_key = 1",
        "scope = \"\"",
        "key_header = \"\"",
        "tenant_header = \"\"",
        "health_path = \"/\"",
        "metrics_path = \"/healthz\"",
        "max_body_bytes = 0",
        "max_response_bytes = 0",
        "store_connections = 0",
        "[table]\nx = 1",
    ];
    let mut report = Vec::new();
    let mut panics = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let file = dir.join(format!("case-{i}.toml"));
        // The case first: a table header would swallow what follows.
        let text = format!("{case}\n",);
        let text = if case.starts_with('[') {
            format!("upstream = \"{}\"\nstore = \"memory\"\nlisten = \"127.0.0.1:0\"\nallow_anonymous = true\n{text}", upstream.url())
        } else {
            let mut t = text;
            for (k, v) in [
                ("upstream", format!("\"{}\"", upstream.url())),
                ("store", "\"memory\"".to_owned()),
                ("listen", "\"127.0.0.1:0\"".to_owned()),
                ("allow_anonymous", "true".to_owned()),
            ] {
                if !case.starts_with(&format!("{k} ")) {
                    t.push_str(&format!("{k} = {v}\n"));
                }
            }
            t
        };
        std::fs::write(&file, &text).expect("write");
        let args = vec!["--config".to_owned(), file.display().to_string()];
        let (code, _out, err) = run_to_exit_or_started(&args);
        let outcome = match code {
            None => "started".to_owned(),
            Some(c) => format!("exit {c}: {}", err.lines().last().unwrap_or("")),
        };
        if err.contains("panicked") || matches!(code, Some(c) if c != 2) {
            panics.push(format!("{case}: {outcome}\n{err}"));
        }
        report.push(format!("{case:50} {outcome}"));
    }
    assert!(
        panics.is_empty(),
        "{}\n\nall cases:\n{}",
        panics.join("\n---\n"),
        report.join("\n")
    );
}

const EXTREMES: &[&str] = &[
    "--lease",
    "1e308",
    "--retention",
    "1e308",
    "--wait",
    "1e308",
    "--retry-after",
    "1e308",
    "--max-body-bytes",
    "9223372036854775807",
    "--max-response-bytes",
    "9223372036854775807",
    "--max-running",
    "9223372036854775807",
    "--upstream-idle-connections",
    "9223372036854775807",
    "--upstream-idle-timeout",
    "0",
    "--shutdown-wait",
    "1e308",
    "--body-timeout",
    "1e308",
    "--header-timeout",
    "1e308",
    "--upstream-timeout",
    "1e308",
];

async fn extremes_on(store: &str, extra: &[&str], tag: &str) {
    let upstream = Upstream::start();
    let mut more: Vec<&str> = vec!["--allow-anonymous"];
    more.extend_from_slice(EXTREMES);
    more.extend_from_slice(extra);
    let proxy = Proxy::start(&options(&upstream.url(), store, &scope(tag), &more));
    let body = json!({"amount": 1});
    let key = format!("{tag}-x");
    let ran = send(post(&proxy.at("/pay"), &key, &body)).await;
    let again = settled(post(&proxy.at("/pay"), &key, &body)).await;
    let other = settled(post(&proxy.at("/pay"), &key, &json!({"amount": 2}))).await;
    let get = send(client().get(proxy.at("/page"))).await;
    let get2 = send(client().get(proxy.at("/page"))).await;
    let logs = proxy.logs();
    assert!(
        ran.status == 201
            && again.replayed()
            && other.status == 422
            && get.status == 201
            && get2.status == 201
            && !logs.contains("panicked"),
        "{tag}: ran {} {} / again {} {} / other {} / get {} {}\n{logs}",
        ran.status,
        ran.text(),
        again.status,
        again.text(),
        other.status,
        get.status,
        get2.status
    );
    assert_eq!(upstream.seen(&key).await.len(), 1, "{tag}");
}

#[tokio::test(flavor = "multi_thread")]
async fn extreme_settings_serve_on_redis() {
    extremes_on(&super::redis_url(), &[], "xredis").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn extreme_settings_serve_on_postgres_with_moka_and_redis_tiers() {
    let pg = super::postgres_url();
    let redis = super::redis_url();
    extremes_on(&pg, &["--cache", "moka", "--cache", &redis], "xtier").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn extreme_settings_serve_on_dynamodb() {
    let table = format!("idem_proxy_{:08x}", fastrand::u32(..));
    let url = format!(
        "dynamodb://{table}?region=us-east-1&endpoint={}",
        support::moto::shared_url()
    );
    extremes_on(&url, &[], "xdyn").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn extreme_settings_serve_on_memory() {
    extremes_on("memory", &[], "xmem").await;
}
