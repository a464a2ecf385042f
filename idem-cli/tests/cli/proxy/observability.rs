//! The proxy's own endpoints: health and Prometheus metrics.

use serde_json::json;

use super::{anonymous, client, options, post, scope, send, settled, Proxy, Upstream};

#[tokio::test(flavor = "multi_thread")]
async fn healthz_answers_200_ok_without_calling_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("health"), &[]));
    let answer = send(client().get(proxy.at("/healthz"))).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(answer.text().trim(), "ok");
    assert!(upstream.seen_on("/healthz").await.is_empty());
}

/// One sample line: its name, labels and value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn parse_labels(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut labels = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let (name, after) = rest
            .split_once("=\"")
            .ok_or_else(|| format!("bad labels {text:?}"))?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => {
                    if let Some((_, c)) = chars.next() {
                        value.push(c);
                    }
                }
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => return Err(format!("unterminated label value in {text:?}")),
            }
        };
        let name = name.trim().trim_start_matches(',').trim();
        if !valid_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        labels.push((name.to_owned(), value));
        rest = after[end + 1..].trim_start_matches(',').trim();
    }
    Ok(labels)
}

/// Parses Prometheus text exposition format, failing on any line that is
/// not a comment, a `# HELP`/`# TYPE` line or a sample.
fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let mut samples = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.split_whitespace().collect();
            if words.first() == Some(&"TYPE") {
                let ok = words.len() == 3
                    && valid_name(words[1])
                    && ["counter", "gauge", "histogram", "summary", "untyped"].contains(&words[2]);
                if !ok {
                    return Err(format!("bad TYPE line {line:?}"));
                }
            }
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let close = line
                    .rfind('}')
                    .ok_or_else(|| format!("unclosed labels: {line:?}"))?;
                (
                    &line[..open],
                    parse_labels(&line[open + 1..close])?,
                    &line[close + 1..],
                )
            }
            None => {
                let (name, rest) = line
                    .split_once(' ')
                    .ok_or_else(|| format!("no value: {line:?}"))?;
                (name, Vec::new(), rest)
            }
        };
        if !valid_name(name) {
            return Err(format!("bad metric name in {line:?}"));
        }
        let value_text = rest
            .split_whitespace()
            .next()
            .ok_or_else(|| format!("no value: {line:?}"))?;
        let value = match value_text {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse()
                .map_err(|e| format!("bad value in {line:?}: {e}"))?,
        };
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    Ok(samples)
}

#[test]
fn the_prometheus_parser_reads_samples_and_refuses_garbage() {
    let samples = parse_prometheus(
        "# HELP a_total A.\n# TYPE a_total counter\na_total{scope=\"s\",x=\"q\\\"}\"} 3\nb 1.5e3\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(samples.len(), 2);
    assert_eq!(
        samples[0].labels,
        vec![("scope".into(), "s".into()), ("x".into(), "q\"}".into())]
    );
    assert_eq!(samples[1].value, 1500.0);
    assert!(parse_prometheus("<html>oops</html>").is_err());
    assert!(parse_prometheus("# TYPE a wat\n").is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_is_prometheus_text_that_counts_the_requests() {
    let upstream = Upstream::start();
    let scope = scope("metrics");
    let proxy = Proxy::start(&anonymous(&upstream, &scope, &[]));
    let url = proxy.at("/pay");
    let body = json!({"amount": 50});
    let first = send(post(&url, "m-1", &body)).await;
    assert_eq!(first.status, 201);
    for _ in 0..2 {
        assert!(settled(post(&url, "m-1", &body)).await.replayed());
    }
    let mismatch = send(post(&url, "m-1", &json!({"amount": 51}))).await;
    assert_eq!(mismatch.status, 422);

    let answer = send(client().get(proxy.at("/metrics"))).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let content_type = answer.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("text/plain"),
        "Content-Type: {content_type:?}"
    );
    let text = answer.text();
    let samples = parse_prometheus(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let ours = |name: &str| -> Option<f64> {
        samples
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| s.labels.iter().any(|(n, v)| n == "scope" && *v == scope))
            .map(|s| s.value)
            .reduce(|a, b| a + b)
    };
    assert_eq!(ours("idem_acquired_total"), Some(1.0), "{text}");
    assert_eq!(ours("idem_replayed_total"), Some(2.0), "{text}");
    assert_eq!(ours("idem_mismatch_total"), Some(1.0), "{text}");
    // The proxy's own request counter, by route and status.
    let requests = |status: &str| -> f64 {
        samples
            .iter()
            .filter(|s| s.name == "idem_proxy_requests_total")
            .filter(|s| {
                s.labels
                    .contains(&("route".to_owned(), "protected".to_owned()))
            })
            .filter(|s| s.labels.contains(&("status".to_owned(), status.to_owned())))
            .map(|s| s.value)
            .sum()
    };
    assert_eq!(
        (requests("201"), requests("422")),
        (3.0, 1.0),
        "protected requests by status:\n{text}"
    );
    assert!(upstream.seen_on("/metrics").await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn with_log_format_json_every_stderr_line_is_json_and_stdout_has_only_the_ready_line() {
    let upstream = Upstream::start();
    let mut proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("jsonlog"),
        &["--log-format", "json"],
    ));
    let url = proxy.at("/pay");
    let body = json!({"amount": 1});
    assert_eq!(send(post(&url, "log-1", &body)).await.status, 201);
    assert!(settled(post(&url, "log-1", &body)).await.replayed());
    assert_eq!(
        send(post(&proxy.at("/status/503"), "log-2", &body))
            .await
            .status,
        503
    );
    proxy.terminate();
    let status = proxy.wait_exit(std::time::Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "{status}");

    let logs = proxy.logs();
    let lines: Vec<&str> = logs.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "no log line at all");
    for line in &lines {
        let parsed: Result<serde_json::Value, _> = serde_json::from_str(line);
        assert!(
            parsed.as_ref().is_ok_and(|v| v.is_object()),
            "not a JSON object: {line:?}\nall of stderr:\n{logs}"
        );
    }
    let more = proxy.stdout_after_ready();
    assert!(
        more.is_empty(),
        "stdout holds more than the ready line: {more:?}"
    );
}

/// libpq URLs carry a password in the query as well as in the userinfo
/// (`postgres://u@h/db?password=...`): the ready line and the "store is
/// down" message leave it out as they leave out `u:pw@`.
#[tokio::test(flavor = "multi_thread")]
async fn a_password_in_the_store_urls_query_is_left_out_of_the_logs() {
    let upstream = Upstream::start();
    let secret = "s3cret-pw-probe";
    let pg = super::postgres_url();
    let joiner = if pg.contains('?') { '&' } else { '?' };
    let store = format!("{pg}{joiner}password={secret}");
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &store,
        &scope("redact"),
        &["--allow-anonymous"],
    ));
    let ready_logs = proxy.logs();
    drop(proxy);
    let port = super::support::free_port();
    let down = format!("postgres://idem@127.0.0.1:{port}/db?password={secret}");
    let (code, stdout, stderr) = super::run_to_exit(&options(
        &upstream.url(),
        &down,
        "proxy.redact",
        &["--allow-anonymous"],
    ));
    assert!(
        !ready_logs.contains(secret) && !stderr.contains(secret) && !stdout.contains(secret),
        "the password is in the logs.\nready:\n{ready_logs}\nstore down (exit {code:?}):\n{stderr}"
    );
}

/// `--protect "* /"`: `GET /healthz` and `GET /metrics` are still the
/// proxy's own (no key asked), and a `POST /healthz` with a key is a
/// protected request like any other.
#[tokio::test(flavor = "multi_thread")]
async fn health_and_metrics_stay_the_proxys_own_under_a_protect_everything_rule() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("ownpaths"),
        &["--protect", "* /"],
    ));
    let health = send(client().get(proxy.at("/healthz"))).await;
    assert_eq!((health.status, health.text()), (200, "ok\n".to_owned()));
    let metrics = send(client().get(proxy.at("/metrics"))).await;
    assert_eq!(metrics.status, 200);
    let body = json!({"x": 1});
    let ran = send(post(&proxy.at("/healthz"), "hz-1", &body)).await;
    assert_eq!(ran.status, 201, "{}", ran.text());
    let again = settled(post(&proxy.at("/healthz"), "hz-1", &body)).await;
    assert!(again.replayed());
    assert_eq!(upstream.seen("hz-1").await.len(), 1);
}
