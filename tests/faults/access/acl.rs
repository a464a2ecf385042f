//! ACLs: the Redis store runs as an ACL user with exactly the rules of
//! `idem_redis::acl_rules` (no command to spare, no key outside its
//! pattern), for every prefix the store accepts; a prefix that no ACL key
//! pattern can name is refused with a typed error, and odd prefixes work
//! or are refused, never a panic.

use std::time::{Duration, Instant};

use idemkit::redis::{redis, RedisStore};
use idemkit::{IdempotencyStore, StoreError};

use super::{
    acl_user, certs, chain, expect_refused, key, redis_acl, redis_admin, report, round, trusted,
    ACL_PASSWORD,
};
use crate::support;
use support::tls::{TlsRedis, HOW_TO};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_runs_as_a_minimal_acl_user() {
    let server = TlsRedis::shared();
    acl_user(server.port, "idem", ACL_PASSWORD, &redis_acl()).await;
    let url = format!("rediss://idem:{ACL_PASSWORD}@127.0.0.1:{}/", server.port);
    let store = RedisStore::connect_tls(&url, &trusted())
        .await
        .unwrap_or_else(|e| panic!("connect_tls as the ACL user: {}", chain(&e)));
    // CONFIG GET is not in the ACL: the eviction check degrades (a warning).
    assert_eq!(store.check_eviction_policy().await, None);
    round(store.clone()).await;

    // With WAIT: three commands more.
    acl_user(
        server.port,
        "idem-wait",
        ACL_PASSWORD,
        &format!("on {}", idemkit::redis::acl_rules("idem:", true)),
    )
    .await;
    let waiting = RedisStore::connect_tls(
        &format!(
            "rediss://idem-wait:{ACL_PASSWORD}@127.0.0.1:{}/",
            server.port
        ),
        &trusted(),
    )
    .await
    .unwrap_or_else(|e| panic!("{}", chain(&e)))
    .wait_for_replicas(0, Duration::from_millis(100));
    round(waiting).await;

    // Without the WAIT commands, wait_for_replicas is refused: not retryable.
    let refused = store
        .clone()
        .wait_for_replicas(0, Duration::from_millis(100));
    let started = Instant::now();
    let result = refused
        .acquire(&key("access.acl"), None, Duration::from_secs(5))
        .await;
    expect_refused(
        "acl_command_refused",
        "redis",
        result,
        started,
        &["permission", "noperm"],
    );

    // A key outside the pattern: refused to the store (another prefix) and
    // to the user's own commands.
    let outside = store.clone().prefix("other:");
    let started = Instant::now();
    let result = outside
        .acquire(&key("access.acl"), None, Duration::from_secs(5))
        .await;
    expect_refused(
        "acl_key_outside_pattern",
        "redis",
        result,
        started,
        &["permission", "noperm"],
    );
    let client = redis::Client::build_with_tls(
        url.as_str(),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(certs().ca_pem("a")),
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    idemkit::redis::install_crypto_provider();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for cmd in [
        redis::cmd("SET").arg("other:key").arg("1").clone(),
        redis::cmd("GET").arg("other:key").clone(),
        redis::cmd("DEL").arg("other:key").clone(),
        redis::cmd("KEYS").arg("*").clone(),
        redis::cmd("FLUSHALL").clone(),
        redis::cmd("EVAL").arg("return 1").arg(0).clone(),
    ] {
        let reply: Result<redis::Value, _> = cmd.query_async(&mut conn).await;
        match reply {
            Err(e) if e.code() == Some("NOPERM") => {}
            other => panic!("the ACL user ran {:?}: {other:?}", cmd.args_iter().count()),
        }
    }
    // Its own keys: allowed.
    let _: Option<String> = redis::cmd("GET")
        .arg("idem:access.acl/x")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_acl_has_no_command_to_spare() {
    // A server of its own: no script is loaded yet, so SCRIPT LOAD is needed.
    let server = TlsRedis::start("a");
    let started = Instant::now();
    let acl = redis_acl();
    let rules: Vec<&str> = acl.split_whitespace().collect();
    let commands: Vec<&str> = rules
        .iter()
        .copied()
        .filter(|r| r.starts_with('+'))
        .collect();
    for (n, left_out) in commands.iter().enumerate() {
        let fewer: Vec<&str> = rules.iter().copied().filter(|r| r != left_out).collect();
        let user = format!("idem-less-{n}");
        acl_user(server.port, &user, ACL_PASSWORD, &fewer.join(" ")).await;
        let url = format!("rediss://{user}:{ACL_PASSWORD}@127.0.0.1:{}/", server.port);
        let store = RedisStore::connect_tls(&url, &trusted())
            .await
            .unwrap_or_else(|e| panic!("{}", chain(&e)));
        let round = tokio::spawn(round(store));
        match round.await {
            Ok(()) => {
                panic!("the store works without {left_out}: acl_rules has a command to spare")
            }
            Err(panicked) => {
                let text = panicked
                    .into_panic()
                    .downcast::<String>()
                    .map(|s| *s)
                    .unwrap_or_default();
                eprintln!("without {left_out}: {text}");
                assert!(
                    text.contains("permission denied by the ACL"),
                    "without {left_out}: {text}"
                );
            }
        }
        // The admin flushes the scripts between users (one loaded by an
        // earlier user would hide a missing SCRIPT LOAD).
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut redis_admin(server.port).await)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    report(
        "acl_minimal",
        "redis",
        &[
            ("commands", commands.len().to_string()),
            ("each_needed", "true".into()),
        ],
        started,
    );
}

/// `acl_rules(prefix, ..)` is documented as the ACL to give the store's
/// user ("ACL SETUSER idem on >secret <rules>"): pasted as documented (one
/// rule per argument, as redis-cli and `redis_store_runs_as_a_minimal_acl_user`
/// split them), the rules must let the store work for every prefix it
/// accepts. A prefix with whitespace cannot be named by any rule (Redis 7
/// answers "Syntax error" to a `~pattern` holding whitespace), so the store
/// refuses such a prefix with `InvalidArgument` instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acl_rules_work_for_every_prefix_the_store_accepts() {
    let started = Instant::now();
    let server = tokio::task::block_in_place(|| support::redis_server::RedisServer::start(&[]));
    let client =
        idemkit::redis::redis::Client::open(server.url.as_str()).unwrap_or_else(|e| panic!("{e}"));
    let mut admin = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut rows = Vec::new();
    let prefixes = [
        "idem:",
        "billing app:",
        "tab\tprefix:",
        "{tag}app:",
        "glob*?[x]\\:",
        "quote\"d'app:",
    ];
    for (n, prefix) in prefixes.iter().enumerate() {
        // Redis refuses an ACL key pattern with whitespace, so no rule can
        // name such a prefix exactly: the store refuses the prefix (a typed
        // error, never a panic) instead; the rules must work for every
        // prefix it accepts.
        let probe = RedisStore::connect(&server.url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if let Err(e) = probe.clone().try_prefix(*prefix) {
            let call = probe
                .prefix(*prefix)
                .acquire(&key("access.acl"), None, Duration::from_secs(30))
                .await;
            let outcome = match (&e, call) {
                (StoreError::InvalidArgument { .. }, Err(StoreError::InvalidArgument { .. })) => {
                    "refused".to_owned()
                }
                (_, call) => format!("try_prefix: {e:?}, a call: {call:?}"),
            };
            rows.push((format!("{prefix:?}"), String::new(), outcome));
            continue;
        }
        let rules = idemkit::redis::acl_rules(prefix, false);
        let user = format!("u{n}");
        let mut cmd = idemkit::redis::redis::cmd("ACL");
        cmd.arg("SETUSER")
            .arg(&user)
            .arg("reset")
            .arg("on")
            .arg(">pw");
        for rule in rules.split_whitespace() {
            cmd.arg(rule);
        }
        let set: Result<(), _> = cmd.query_async(&mut admin).await;
        let outcome = match set {
            Err(e) => format!("ACL SETUSER refused: {e}"),
            Ok(()) => {
                let url = format!("redis://{user}:pw@127.0.0.1:{}/", server.port);
                match RedisStore::connect(&url).await {
                    Err(e) => format!("connect: {e}"),
                    Ok(store) => {
                        let store = store.prefix(*prefix);
                        match store
                            .acquire(&key("access.acl"), None, Duration::from_secs(30))
                            .await
                        {
                            Ok(_) => "ok".to_owned(),
                            Err(e) => format!("acquire: {e}"),
                        }
                    }
                }
            }
        };
        rows.push((format!("{prefix:?}"), rules, outcome));
    }
    report(
        "redis-acl-rules-prefix",
        "redis",
        &rows
            .iter()
            .map(|(p, _, o)| {
                (
                    "prefix",
                    format!("{p}->{:?}", o.chars().take(80).collect::<String>()),
                )
            })
            .collect::<Vec<_>>(),
        started,
    );
    for (prefix, rules, outcome) in rows {
        if prefix.contains(' ') || prefix.contains("\\t") {
            assert_eq!(
                outcome, "refused",
                "prefix {prefix}: the store must refuse it with InvalidArgument"
            );
        } else {
            assert_eq!(outcome, "ok", "prefix {prefix}: rules {rules:?}");
        }
    }
}

/// `prefix("")`, a 10 KB prefix, and prefixes made of glob characters
/// work (no panic, a full round) or are refused with a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_prefix_edge_cases_never_panic() {
    let started = Instant::now();
    let server = support::redis_server::RedisServer::start(&[]);
    let base = RedisStore::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("connect: {e}. {HOW_TO}"));
    let long = "p".repeat(10 * 1024);
    let mut rounds = 0;
    for prefix in ["", long.as_str(), "*", "[", "\\", "{", "}{", "é\u{200b}:"] {
        let store = base
            .clone()
            .try_prefix(prefix)
            .unwrap_or_else(|e| panic!("{prefix:?} refused: {e}"));
        let k = key("access.prefix");
        let lease = match store.acquire(&k, None, Duration::from_secs(30)).await {
            Ok(idemkit::Acquisition::Acquired(lease)) => lease,
            other => panic!(
                "acquire with prefix {:?}: {other:?}",
                &prefix[..prefix.len().min(20)]
            ),
        };
        store
            .complete(&lease, b"ok", Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("complete: {e}"));
        assert!(store
            .get(&k)
            .await
            .unwrap_or_else(|e| panic!("get: {e}"))
            .is_some());
        assert!(store
            .delete(&k)
            .await
            .unwrap_or_else(|e| panic!("delete: {e}")));
        let _ = idemkit::redis::acl_rules(prefix, true);
        rounds += 1;
    }
    for bad in ["a b", "\u{85}", "\u{2028}", "\u{3000}x"] {
        let r = base.clone().try_prefix(bad);
        assert!(
            matches!(r, Err(StoreError::InvalidArgument { .. })),
            "{bad:?}: {:?}",
            r.err()
        );
        let store = base.clone().prefix(bad);
        let r = store.get(&key("access.prefix")).await;
        assert!(
            matches!(r, Err(StoreError::InvalidArgument { .. })),
            "{bad:?}: {r:?}"
        );
    }
    report(
        "prefix_edge_cases",
        "redis",
        &[("rounds", rounds.to_string())],
        started,
    );
}
