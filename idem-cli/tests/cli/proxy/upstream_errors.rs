//! What the upstream's failures do to the key.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::net::TcpStream;

use super::wire::{body_text, memory, raw_post, raw_upstream, response, serve_raw};
use super::{
    anonymous, options, post, raw_exchange, redis_url, scope, send, settled, support, Proxy,
    Upstream,
};

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_503_is_passed_through_and_releases_the_key_so_a_retry_runs_again() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("503"), &[]));
    let (url, body) = (proxy.at("/status/503"), json!({"amount": 3}));

    let first = send(post(&url, "busy-1", &body)).await;
    assert_eq!(first.status, 503, "{}", first.text());
    assert_eq!(first.json()["count"], 1, "the upstream's own body");
    let retry = settled(post(&url, "busy-1", &body)).await;
    assert_eq!(retry.status, 503, "{}", retry.text());
    assert!(!retry.replayed(), "a 503 is never replayed");
    assert_eq!(retry.json()["count"], 2, "{}", retry.text());
    assert_eq!(upstream.seen("busy-1").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_500_is_recorded_and_replayed() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("500"), &[]));
    let (url, body) = (proxy.at("/status/500"), json!({"amount": 5}));

    let first = send(post(&url, "boom-1", &body)).await;
    assert_eq!(first.status, 500, "{}", first.text());
    let retry = settled(post(&url, "boom-1", &body)).await;
    assert_eq!(retry.status, 500, "{}", retry.text());
    assert!(retry.replayed(), "{:?}", retry.headers);
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.seen("boom-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_is_not_listening_gets_502_and_a_retry_once_it_is_up_runs() {
    let port = support::free_port();
    let upstream_url = format!("http://127.0.0.1:{port}");
    let proxy = Proxy::start(&options(
        &upstream_url,
        &redis_url(),
        &scope("down"),
        &["--allow-anonymous"],
    ));
    let (url, body) = (proxy.at("/pay"), json!({"amount": 12}));

    let refused = send(post(&url, "down-1", &body)).await;
    assert_eq!(refused.status, 502, "{}", refused.text());

    let upstream = Upstream::start_on(port);
    let retry = settled(post(&url, "down-1", &body)).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.replayed(), "{:?}", retry.headers);
    assert_eq!(retry.json()["count"], 1, "{}", retry.text());
    let again = settled(post(&url, "down-1", &body)).await;
    assert!(again.replayed(), "{} {:?}", again.status, again.headers);
    assert_eq!(again.body, retry.body);
    assert_eq!(upstream.seen("down-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_times_out_gets_504_and_its_key_never_runs_again() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("timeout"),
        &["--upstream-timeout", "1s"],
    ));
    let (url, body) = (proxy.at("/pay?delay_ms=3000"), json!({"amount": 13}));

    let started = std::time::Instant::now();
    let late = send(post(&url, "late-1", &body)).await;
    let took = started.elapsed();
    assert_eq!(late.status, 504, "{}", late.text());
    assert!(
        took < std::time::Duration::from_millis(2_500),
        "answered after {took:?}, not at the 1 s timeout"
    );
    let retry = settled(post(&url, "late-1", &body)).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(
        retry.text().to_lowercase().contains("not recorded"),
        "{}",
        retry.text()
    );
    assert_eq!(upstream.seen("late-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_drops_the_connection_after_the_request_gets_502_and_its_key_never_runs_again(
) {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("drop"), &[]));
    let (url, body) = (proxy.at("/drop"), json!({"amount": 14}));

    let cut = send(post(&url, "cut-1", &body)).await;
    assert_eq!(cut.status, 502, "{}", cut.text());
    let retry = settled(post(&url, "cut-1", &body)).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(
        retry.text().to_lowercase().contains("not recorded"),
        "{}",
        retry.text()
    );
    assert!(retry.header("retry-after").is_none(), "{:?}", retry.headers);
    assert_eq!(upstream.seen("cut-1").await.len(), 1);
}

/// The upstream answers tenant A's request with a body longer than its
/// `Content-Length` (the tail is a whole second response). The proxy's
/// pooled connection never hands that tail to the next request (tenant
/// B's, another key) as its answer, nor records it for B.
#[tokio::test(flavor = "multi_thread")]
async fn bytes_past_an_upstream_content_length_never_become_another_tenants_answer() {
    let (url, count) = raw_upstream(true, |n, _| {
        Some((
            if n == 1 {
                let mut bytes = response("201 Created", "for-a");
                bytes.extend(response("201 Created", "SMUGGLED-FOR-A"));
                bytes
            } else {
                response("201 Created", &format!("genuine-{n}"))
            },
            false,
        ))
    })
    .await;
    let args = options(
        &url,
        "memory",
        &scope("smuggle"),
        &["--tenant-header", "x-api-key"],
    );
    let proxy = Proxy::start(&args);
    let body = json!({"amount": 3});
    let a = send(post(&proxy.at("/pay"), "k-a", &body).header("x-api-key", "tenant-a")).await;
    assert_eq!(a.text(), "for-a");
    let mut answers = Vec::new();
    for i in 0..3 {
        let b = send(
            post(&proxy.at("/pay"), &format!("k-b-{i}"), &body).header("x-api-key", "tenant-b"),
        )
        .await;
        answers.push((b.status, b.text()));
    }
    assert!(
        answers.iter().all(|(_, t)| !t.contains("SMUGGLED")),
        "tenant B got bytes the upstream sent on A's request: {answers:?} (upstream saw {} requests)",
        count.load(Ordering::SeqCst)
    );
}

/// The upstream cannot be reached at all (connection refused): the proxy
/// says "the request was not sent; a retry may help", and releases the
/// key whatever `--release-status` lists (its own 502 is not an upstream
/// 502). Here the operator records upstream 502s (`--release-status
/// 503`); once the upstream is up, the retry runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_connection_releases_the_key_whatever_release_status_says() {
    let port = super::support::free_port();
    let args = options(
        &format!("http://127.0.0.1:{port}"),
        "memory",
        &scope("refused"),
        &["--allow-anonymous", "--release-status", "503"],
    );
    let proxy = Proxy::start(&args);
    let body = json!({"amount": 13});
    let first = send(post(&proxy.at("/pay"), "refused-1", &body)).await;
    assert_eq!(first.status, 502, "{}", first.text());
    eprintln!("upstream down: {} {}", first.status, first.text());
    let upstream = Upstream::start_on(port);
    let retry = settled(post(&proxy.at("/pay"), "refused-1", &body)).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, false),
        "nothing was sent the first time, yet the retry got {} (replayed: {}): {}",
        retry.status,
        retry.replayed(),
        retry.text()
    );
    assert_eq!(upstream.seen("refused-1").await.len(), 1);
}

/// A connect that never completes (the upstream's accept queue is full,
/// its SYNs dropped) with `--upstream-timeout 1s`: the call's timeout
/// fires before any connection was made, so nothing was sent: `502` and
/// the key released, never "it may have acted". Once the upstream
/// accepts, every retry runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_connect_that_hangs_past_a_short_upstream_timeout_is_nothing_sent_and_releases_the_key() {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let listener = socket.listen(1).expect("listen");
    let addr = listener.local_addr().expect("addr");
    // Fill the accept queue: later SYNs are dropped, connects hang.
    let mut fillers = Vec::new();
    for _ in 0..8 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr)).await
        {
            fillers.push(s);
        }
    }
    let hung = tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr)).await;
    assert!(
        hung.is_err(),
        "the accept queue is not full: a connect completed"
    );
    let args = options(
        &format!("http://{addr}"),
        "memory",
        &scope("hang"),
        &["--allow-anonymous", "--upstream-timeout", "1s"],
    );
    let proxy = Proxy::start(&args);
    let body = json!({"amount": 14});
    let keys: Vec<String> = (0..16).map(|i| format!("hang-{i}")).collect();
    let mut firsts = Vec::new();
    for key in &keys {
        let first = send(post(&proxy.at("/pay"), key, &body)).await;
        firsts.push(format!("{} {}", first.status, first.text()));
    }
    // Now the upstream accepts (the fillers' connections are served too).
    drop(fillers);
    let (_, count) = serve_raw(listener, true, |n, _| {
        Some((response("201 Created", &format!("ran-{n}")), false))
    });
    let mut burnt = Vec::new();
    for (key, first) in keys.iter().zip(&firsts) {
        let retry = settled(post(&proxy.at("/pay"), key, &body)).await;
        if retry.status != 201 {
            burnt.push(format!(
                "{key}: first {first}\n  retry {} {}",
                retry.status,
                retry.text()
            ));
        }
    }
    assert!(
        burnt.is_empty(),
        "no connection was ever made, yet {} of {} keys were burnt (upstream ran {} times):\n{}",
        burnt.len(),
        keys.len(),
        count.load(Ordering::SeqCst),
        burnt.join("\n")
    );
}

/// The upstream acts, then answers with a head the proxy's client cannot
/// parse (150 headers; a 1 MiB header). The key must not run again.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_upstream_head_never_runs_the_key_twice() {
    for (tag, head) in [
        (
            "many",
            (0..150)
                .map(|i| format!("X-H{i}: v\r\n"))
                .collect::<String>(),
        ),
        ("huge", format!("X-Big: {}\r\n", "a".repeat(1 << 20))),
    ] {
        let count = Arc::new(AtomicUsize::new(0));
        let counted = count.clone();
        let (url, _) = raw_upstream(true, move |_, seen| {
            let n =
                if seen.head.contains("Idempotency-Key") || seen.head.contains("idempotency-key") {
                    counted.fetch_add(1, Ordering::SeqCst) + 1
                } else {
                    0
                };
            Some((
                format!("HTTP/1.1 201 Created\r\n{head}Content-Length: 4\r\n\r\nr-{n:02}")
                    .into_bytes(),
                false,
            ))
        })
        .await;
        let proxy = Proxy::start(&memory(&url, tag, &[]));
        let raw = raw_post("/pay", &format!("{tag}-1"), r#"{"a":1}"#);
        let first = raw_exchange(&proxy.addr(), &raw).await;
        let again = raw_exchange(&proxy.addr(), &raw).await;
        assert_eq!(first.status, 502, "{tag}: {}", body_text(&first));
        assert_eq!(
            (again.status, count.load(Ordering::SeqCst)),
            (409, 1),
            "{tag}: the retry got {} {} (the upstream may have acted: never again)",
            again.status,
            body_text(&again)
        );
    }
}
