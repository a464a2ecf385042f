//! SIGTERM: in-flight requests finish and are recorded, then exit 0.

use std::time::{Duration, Instant};

use serde_json::json;

use super::wire::memory;
use super::{anonymous, client, post, scope, send, try_send, Proxy, Upstream};

/// Waits (`within` at most) until `addr` refuses new connections: whether
/// it did.
async fn until_refused(addr: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_an_in_flight_request_finish_exits_0_and_after_a_restart_its_retry_is_the_replay(
) {
    let upstream = Upstream::start();
    let args = anonymous(&upstream, &scope("term"), &[]);
    let mut first = Proxy::start(&args);
    let (key, body) = ("term-1", json!({"amount": 21}));
    let url = first.at("/block?id=term");
    let pending = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { try_send(post(&url, key, &body)).await })
    };
    upstream.until_seen(key, 1).await;

    first.terminate();
    // The signal has landed once the listener is gone (or, at the latest,
    // after 5 s): only then may the upstream answer.
    until_refused(&first.addr(), Duration::from_secs(5)).await;
    upstream.release("term").await;

    let answer = pending
        .await
        .expect("the request task")
        .unwrap_or_else(|e| {
            panic!(
                "the in-flight request got no answer: {e}\nproxy stderr:\n{}",
                first.logs()
            )
        });
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert!(!answer.replayed());
    let status = first.wait_exit(Duration::from_secs(20));
    assert_eq!(
        status.code(),
        Some(0),
        "exit after SIGTERM: {status}\n{}",
        first.logs()
    );

    let second = Proxy::start(&args);
    let retry = send(post(&second.at("/block?id=term"), key, &body)).await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert_eq!(
        retry.header("idempotent-replayed").as_deref(),
        Some("true"),
        "{:?}",
        retry.headers
    );
    assert_eq!(retry.body, answer.body);
    assert_eq!(upstream.seen(key).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn after_sigterm_new_connections_are_refused_while_an_in_flight_request_finishes() {
    let upstream = Upstream::start();
    let mut proxy = Proxy::start(&anonymous(&upstream, &scope("term-refuse"), &[]));
    let (key, body) = ("refuse-1", json!({"amount": 22}));
    let url = proxy.at("/block?id=refuse");
    let pending = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { try_send(post(&url, key, &body)).await })
    };
    upstream.until_seen(key, 1).await;

    proxy.terminate();
    let refused = until_refused(&proxy.addr(), Duration::from_secs(5)).await;
    let still_running = !proxy.has_exited();
    upstream.release("refuse").await;
    let answer = pending.await.expect("the request task");
    assert!(
        refused,
        "5 s after SIGTERM the proxy still accepts connections"
    );
    assert!(
        still_running,
        "the proxy exited before its in-flight request finished"
    );
    let answer = answer.unwrap_or_else(|e| panic!("no answer: {e}"));
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert_eq!(proxy.wait_exit(Duration::from_secs(20)).code(), Some(0));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_waits_for_an_in_flight_request_at_most_shutdown_wait() {
    let upstream = Upstream::start();
    let mut proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("term-wait"),
        &["--shutdown-wait", "1s"],
    ));
    let (key, body) = ("stuck-1", json!({"amount": 23}));
    let url = proxy.at("/block?id=never");
    let pending = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { try_send(post(&url, key, &body)).await })
    };
    upstream.until_seen(key, 1).await;

    let signalled = Instant::now();
    proxy.terminate();
    let status = proxy.wait_exit(Duration::from_secs(15));
    let took = signalled.elapsed();
    upstream.release("never").await;
    assert!(
        took < Duration::from_secs(6),
        "exited {took:?} after SIGTERM with --shutdown-wait 1s"
    );
    assert!(
        took >= Duration::from_millis(900),
        "exited after {took:?}: it did not wait for the request in flight"
    );
    assert_eq!(status.code(), Some(0), "{status}\n{}", proxy.logs());
    let _ = pending.await;
}

/// A far `--shutdown-wait` is taken as ten years: SIGTERM still ends in
/// exit 0.
#[tokio::test(flavor = "multi_thread")]
async fn a_far_shutdown_wait_still_shuts_down_with_exit_0() {
    let upstream = Upstream::start();
    let mut proxy = Proxy::start(&memory(
        &upstream.url(),
        "far-wait",
        &["--shutdown-wait", "1e300s"],
    ));
    let ok = send(post(&proxy.at("/pay"), "far-w-1", &json!({"a": 1}))).await;
    assert_eq!(ok.status, 201, "{}", ok.text());
    proxy.terminate();
    let status = proxy.wait_exit(Duration::from_secs(15));
    assert_eq!(
        status.code(),
        Some(0),
        "exit after SIGTERM: {status}\nproxy stderr:\n{}",
        proxy.logs()
    );
}

/// SIGTERM while a protected request runs and a duplicate waits for it
/// (`--wait`): the run finishes and is recorded, the duplicate gets the
/// replay (or a 409), the upstream ran once, the proxy exits 0.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_with_a_run_in_flight_and_a_duplicate_waiting_records_the_run_once() {
    let upstream = Upstream::start();
    let mut proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("termwait"),
        &["--wait", "20s", "--shutdown-wait", "20s"],
    ));
    let url = proxy.at("/block?id=termwait");
    let body = json!({"amount": 2});
    let first = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { try_send(post(&url, "tw-1", &body)).await })
    };
    upstream.until_seen("tw-1", 1).await;
    let dup = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { try_send(post(&url, "tw-1", &body)).await })
    };
    // The duplicate is waiting once the store has told it "in progress".
    let waiting = Instant::now();
    loop {
        let metrics = send(client().get(proxy.at("/metrics"))).await.text();
        if metrics
            .lines()
            .any(|l| l.starts_with("idem_in_progress_total") && !l.ends_with(" 0"))
        {
            break;
        }
        assert!(
            waiting.elapsed() < Duration::from_secs(10),
            "the duplicate never waited:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.terminate();
    until_refused(&proxy.addr(), Duration::from_secs(5)).await;
    upstream.release("termwait").await;
    let first = first.await.expect("task");
    let dup = dup.await.expect("task");
    let status = proxy.wait_exit(Duration::from_secs(30));
    let first =
        first.unwrap_or_else(|e| panic!("the running request failed: {e}\n{}", proxy.logs()));
    assert_eq!(first.status, 200, "{}", first.text());
    match &dup {
        Ok(a) => assert!(
            (a.status == 200 && a.replayed()) || a.status == 409,
            "the duplicate: {} {}",
            a.status,
            a.text()
        ),
        Err(e) => panic!("the duplicate failed: {e}\n{}", proxy.logs()),
    }
    assert!(status.success(), "exit {status}\n{}", proxy.logs());
    assert_eq!(upstream.seen("tw-1").await.len(), 1);
}
