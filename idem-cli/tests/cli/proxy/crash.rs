//! The proxy SIGKILLed while the upstream handles a request, then started
//! again on the same store.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{
    header_values, options, post, postgres_url, redis_url, scope, settled, try_send, until_not_409,
    Proxy, Upstream,
};

const LEASE: Duration = Duration::from_secs(2);

/// The clocks (the store's, ours) may differ by this much.
const SLACK: Duration = Duration::from_millis(150);

async fn killed_mid_request_then_taken_over_after_the_lease(store: &str, tag: &str) {
    let upstream = Upstream::start();
    let args = options(
        &upstream.url(),
        store,
        &scope(tag),
        &["--allow-anonymous", "--lease", "2s"],
    );
    let mut first = Proxy::start(&args);
    let (key, body) = ("crash-1", json!({"amount": 99}));
    let url = first.at("/block?id=crash");

    let sent = Instant::now();
    let pending = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { try_send(post(&url, key, &body)).await })
    };
    upstream.until_seen(key, 1).await;
    first.kill();
    let killed = sent.elapsed();
    let outcome = pending.await.expect("the request task");
    assert!(
        outcome.is_err(),
        "a proxy killed before the upstream answered cannot answer: {outcome:?}"
    );
    // The first call answers into a closed connection; the next ones at once.
    upstream.release("crash").await;

    let second = Proxy::start(&args);
    let url = second.at("/block?id=crash");
    let (conflicts, answer) = until_not_409(sent, || post(&url, key, &body)).await;
    let ran_at = sent.elapsed();

    // The lease began after the request was sent, and was not renewed
    // after the kill: it ended between `sent + LEASE` and `killed + LEASE`.
    for (at, conflict) in &conflicts {
        assert!(
            conflict.header("retry-after").is_some(),
            "409 at {at:?} without Retry-After: {:?}",
            conflict.headers
        );
    }
    let first_retry = conflicts.first().map(|(at, _)| *at).unwrap_or(ran_at);
    if first_retry + SLACK < LEASE {
        assert!(
            !conflicts.is_empty(),
            "the retry at {first_retry:?} (lease {LEASE:?}) ran instead of getting 409"
        );
    }
    assert!(
        ran_at + SLACK >= LEASE,
        "the retry ran at {ran_at:?}, before the {LEASE:?} lease could end"
    );
    assert!(
        ran_at <= killed + LEASE + Duration::from_secs(2),
        "the retry ran only at {ran_at:?}; the proxy was killed at {killed:?}, lease {LEASE:?}"
    );
    assert_eq!(
        answer.status,
        200,
        "{} (409s: {})",
        answer.text(),
        conflicts.len()
    );
    assert!(!answer.replayed(), "the takeover ran: {:?}", answer.headers);
    assert_eq!(answer.json()["count"], 2, "{}", answer.text());

    let seen = upstream.seen(key).await;
    assert_eq!(seen.len(), 2, "the upstream saw: {seen:?}");
    let attempts: Vec<Vec<String>> = seen
        .iter()
        .map(|r| header_values(r, "idem-attempt"))
        .collect();
    assert_eq!(
        attempts,
        vec![vec!["1".to_owned()], vec!["2".to_owned()]],
        "idem-attempt of each call"
    );
    let fences: Vec<u64> = seen
        .iter()
        .map(|r| {
            let values = header_values(r, "idem-fence");
            assert_eq!(values.len(), 1, "one idem-fence: {values:?}");
            values[0]
                .parse()
                .unwrap_or_else(|e| panic!("idem-fence {:?} is not a u64: {e}", values[0]))
        })
        .collect();
    assert!(
        fences[0] < fences[1],
        "the fence strictly increases: {fences:?}"
    );

    // Recorded now: the next duplicate is its replay.
    let again = settled(post(&url, key, &body)).await;
    assert_eq!(again.status, 200, "{}", again.text());
    assert!(again.replayed(), "{:?}", again.headers);
    assert_eq!(again.body, answer.body);
    assert_eq!(upstream.seen(key).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn on_redis_a_killed_proxys_lease_blocks_retries_until_it_ends_then_the_upstream_runs_once_more(
) {
    killed_mid_request_then_taken_over_after_the_lease(&redis_url(), "crash-redis").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn on_postgres_a_killed_proxys_lease_blocks_retries_until_it_ends_then_the_upstream_runs_once_more(
) {
    killed_mid_request_then_taken_over_after_the_lease(&postgres_url(), "crash-pg").await;
}
