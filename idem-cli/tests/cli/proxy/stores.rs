//! The stores behind the proxy: an outage, a cache tier, memory, DynamoDB
//! (moto) and Redis Cluster by URL.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{anonymous, options, post, redis_url, scope, send, settled, support, Proxy, Upstream};

/// The Redis of `IDEM_REDIS_URL`, as an address.
async fn redis_addr() -> SocketAddr {
    let url = redis_url();
    let host_port = url
        .trim_start_matches("redis://")
        .split(['/', '?'])
        .next()
        .unwrap_or_default()
        .rsplit('@')
        .next()
        .unwrap_or_default()
        .to_owned();
    tokio::net::lookup_host(&host_port)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| panic!("cannot resolve {host_port} (from {url})"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_goes_down_gets_503_with_retry_after_and_nothing_reaches_the_upstream() {
    let upstream = Upstream::start();
    let link = support::proxy::CountingProxy::start(redis_addr().await).await;
    let store = format!("redis://{}/", link.addr);
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &store,
        &scope("store-down"),
        &["--allow-anonymous"],
    ));
    let url = proxy.at("/pay");
    let body = json!({"amount": 60});
    let before = send(post(&url, "sd-1", &body)).await;
    assert_eq!(before.status, 201, "{}", before.text());

    link.cut(true);
    let started = Instant::now();
    let down = send(post(&url, "sd-2", &body)).await;
    assert_eq!(
        down.status,
        503,
        "after {:?}: {}",
        started.elapsed(),
        down.text()
    );
    assert!(down.header("retry-after").is_some(), "{:?}", down.headers);
    assert!(
        upstream.seen("sd-2").await.is_empty(),
        "the upstream ran without a key"
    );

    link.cut(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let answer = send(post(&url, "sd-2", &body)).await;
        if answer.status != 503 {
            break answer;
        }
        assert!(
            Instant::now() < deadline,
            "still 503 20 s after the store came back: {}",
            answer.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(after.status, 201, "{}", after.text());
    assert!(!after.replayed());
    assert_eq!(upstream.seen("sd-2").await.len(), 1);
    let replay = send(post(&url, "sd-1", &body)).await;
    assert!(replay.replayed(), "{} {}", replay.status, replay.text());
    assert_eq!(replay.body, before.body);
    assert_eq!(upstream.seen("sd-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_moka_cache_tier_the_redis_store_stays_the_source_of_truth_across_restarts() {
    let upstream = Upstream::start();
    let args = anonymous(&upstream, &scope("tiered"), &["--cache", "moka"]);
    let (url_of, body) = (|p: &Proxy| p.at("/pay"), json!({"amount": 61}));
    let first = Proxy::start(&args);
    let ran = send(post(&url_of(&first), "tier-1", &body)).await;
    assert_eq!(ran.status, 201, "{}", ran.text());
    let cached = settled(post(&url_of(&first), "tier-1", &body)).await;
    assert!(cached.replayed(), "{} {}", cached.status, cached.text());
    drop(first);

    // A new process: an empty cache, the record from Redis.
    let second = Proxy::start(&args);
    let from_store = send(post(&url_of(&second), "tier-1", &body)).await;
    assert!(
        from_store.replayed(),
        "{} {}",
        from_store.status,
        from_store.text()
    );
    assert_eq!(from_store.body, ran.body);
    assert_eq!(upstream.seen("tier-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_memory_store_replays_within_its_process() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        "memory",
        &scope("memory"),
        &["--allow-anonymous"],
    ));
    let (url, body) = (proxy.at("/pay"), json!({"amount": 62}));
    let ran = send(post(&url, "mem-1", &body)).await;
    assert_eq!(ran.status, 201, "{}", ran.text());
    let again = settled(post(&url, "mem-1", &body)).await;
    assert!(again.replayed(), "{} {}", again.status, again.text());
    assert_eq!(again.body, ran.body);
    assert_eq!(upstream.seen("mem-1").await.len(), 1);
}

/// A key run through one proxy is replayed by a new proxy process on the
/// same store: the record is in the store the URL names.
async fn replayed_across_a_restart(store: &str, tag: &str) {
    let upstream = Upstream::start();
    let args = options(&upstream.url(), store, &scope(tag), &["--allow-anonymous"]);
    let body = json!({"amount": 63});
    let key = format!("{tag}-1");
    let first = Proxy::start(&args);
    let ran = send(post(&first.at("/pay"), &key, &body)).await;
    assert_eq!(ran.status, 201, "{store}: {}", ran.text());
    let other = settled(post(&first.at("/pay"), &key, &json!({"amount": 64}))).await;
    assert_eq!(other.status, 422, "{store}: another body: {}", other.text());
    drop(first);
    let second = Proxy::start(&args);
    let again = settled(post(&second.at("/pay"), &key, &body)).await;
    assert!(
        again.replayed(),
        "{store}: {} {}",
        again.status,
        again.text()
    );
    assert_eq!(again.body, ran.body);
    assert_eq!(upstream.seen(&key).await.len(), 1, "{store}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dynamodb_store_url_keeps_the_record_across_restarts() {
    let table = format!("idem_proxy_{:08x}", fastrand::u32(..));
    let url = format!(
        "dynamodb://{table}?region=us-east-1&endpoint={}",
        support::moto::shared_url()
    );
    replayed_across_a_restart(&url, "dynamo").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redis_cluster_store_url_keeps_the_record_across_restarts() {
    let nodes: Vec<&str> = support::redis_server::shared_cluster()
        .iter()
        .map(|n| n.trim_start_matches("redis://").trim_end_matches('/'))
        .collect();
    let url = format!("redis+cluster://{}", nodes.join(","));
    replayed_across_a_restart(&url, "cluster").await;
}

/// `--store redis://... --cache moka`: the operator deletes a key's record
/// with `idem delete` (which promises "in every tier, and in the
/// applications' in-process tiers through the invalidation channel"), e.g.
/// to let a wrongly recorded answer run again. The proxy's moka tier hears
/// of it on the store's Redis (the invalidation channel `idem delete`
/// publishes on) and stops replaying the deleted record.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_deleted_with_idem_delete_is_not_replayed_from_the_proxys_moka_tier() {
    let upstream = Upstream::start();
    let redis = super::redis_url();
    let scope = scope("moka-del");
    let proxy = Proxy::start(&options(
        &upstream.url(),
        &redis,
        &scope,
        &["--allow-anonymous", "--cache", "moka"],
    ));
    let body = json!({"amount": 16});
    let url = proxy.at("/pay");
    let first = send(post(&url, "del-1", &body)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let replay = settled(post(&url, "del-1", &body)).await;
    assert!(replay.replayed(), "{} {}", replay.status, replay.text());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "--backend",
            "redis",
            "--redis-url",
            &redis,
            "delete",
            "--http-key",
            "--scope",
            &scope,
            "--tenant",
            "",
            "--method",
            "POST",
            "--path",
            "/pay",
            "--header",
            "del-1",
        ])
        .output()
        .expect("idem delete");
    assert!(
        out.status.success(),
        "idem delete: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The invalidation channel takes milliseconds; give it a second.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let after = loop {
        let after = send(post(&url, "del-1", &body)).await;
        if !after.replayed() || std::time::Instant::now() > deadline {
            break after;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        !after.replayed(),
        "3 s after `idem delete` ({}), the proxy still replays the deleted record: {} {}",
        String::from_utf8_lossy(&out.stdout).trim(),
        after.status,
        after.text()
    );
    assert_eq!(upstream.seen("del-1").await.len(), 2);
}

/// A Redis cache tier in front of a Redis store is refused (exit 2,
/// naming `--cache`): `idem delete --backend redis` deletes from the
/// store, and no operator command reaches such a tier, so a deleted record
/// would go on being replayed from it.
#[test]
fn a_redis_cache_tier_in_front_of_a_redis_store_is_refused() {
    let upstream = Upstream::start();
    let redis = redis_url();
    let args = options(
        &upstream.url(),
        &redis,
        &scope("rcache"),
        &["--allow-anonymous", "--cache", "moka", "--cache", &redis],
    );
    let (code, _, stderr) = super::run_to_exit(&args);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--cache"), "{stderr}");
}

async fn storm(store: &str, extra: &[&str], tag: &str) {
    let upstream = Upstream::start();
    let mut more = vec!["--allow-anonymous", "--wait", "20s"];
    more.extend_from_slice(extra);
    let proxy = Proxy::start(&options(&upstream.url(), store, &scope(tag), &more));
    let url = proxy.at("/pay?delay_ms=300");
    let body = json!({"amount": 5});
    let key = format!("{tag}-storm");
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let (url, body, key) = (url.clone(), body.clone(), key.clone());
            tokio::spawn(async move { send(post(&url, &key, &body)).await })
        })
        .collect();
    let mut answers = Vec::new();
    for c in calls {
        answers.push(c.await.expect("task"));
    }
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert!(statuses.iter().all(|s| *s == 201), "{tag}: {statuses:?}");
    assert!(answers.iter().all(|a| a.body == answers[0].body), "{tag}");
    assert_eq!(upstream.seen(&key).await.len(), 1, "{tag}");
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_duplicates_at_once_on_dynamodb_run_once() {
    let table = format!("idem_proxy_{:08x}", fastrand::u32(..));
    let url = format!(
        "dynamodb://{table}?region=us-east-1&endpoint={}",
        support::moto::shared_url()
    );
    storm(&url, &[], "dynstorm").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_duplicates_at_once_on_a_tiered_store_run_once() {
    let pg = super::postgres_url();
    let redis = super::redis_url();
    storm(&pg, &["--cache", "moka", "--cache", &redis], "tierstorm").await;
}
