//! A client that goes away mid-request.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{closed_within, memory};
use super::{anonymous, post, scope, send, settled, until_not_409, Proxy, Upstream};

fn request(path: &str, key: &str, body: &str, declared_length: usize) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {declared_length}\r\n\r\n{body}"
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_does_not_stop_the_upstream_call_and_its_retry_gets_the_replay() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("gone"), &[]));
    let body = json!({"amount": 7});
    let text = body.to_string();

    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(&request("/block?id=gone", "gone-1", &text, text.len()))
        .await
        .expect("write");
    upstream.until_seen("gone-1", 1).await;
    let mut early = [0u8; 64];
    let early = stream.try_read(&mut early);
    assert!(
        matches!(early, Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing may come back before the upstream answers: {early:?}"
    );
    drop(stream);

    // While the upstream still holds the call: in progress.
    let url = proxy.at("/block?id=gone");
    let during = send(post(&url, "gone-1", &body)).await;
    assert_eq!(during.status, 409, "{}", during.text());
    // The lease is 60 s; `--retry-after` (1 s by default) caps the hint.
    assert_eq!(
        during.header("retry-after").as_deref(),
        Some("1"),
        "{:?}",
        during.headers
    );

    upstream.release("gone").await;
    let (_, answer) = until_not_409(Instant::now(), || post(&url, "gone-1", &body)).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    assert!(
        answer.replayed(),
        "the retry is the replay: {:?}",
        answer.headers
    );
    assert_eq!(answer.json()["count"], 1, "{}", answer.text());
    let seen = upstream.seen("gone-1").await;
    assert_eq!(seen.len(), 1, "the upstream saw: {seen:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_before_its_body_is_complete_never_reaches_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("half"), &[]));
    let body = json!({"amount": 8, "note": "a body long enough to cut in half"});
    let text = body.to_string();

    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(&request("/pay", "half-1", &text[..10], text.len()))
        .await
        .expect("write");
    stream.flush().await.expect("flush");
    drop(stream);

    // The whole request afterwards runs once (a 409 would mean the torn
    // one took the key: it may, briefly, until it is released).
    let url = proxy.at("/pay");
    let started = Instant::now();
    let (conflicts, answer) = until_not_409(started, || post(&url, "half-1", &body)).await;
    assert_eq!(answer.status, 201, "{}", answer.text());
    assert!(!answer.replayed(), "{:?}", answer.headers);
    assert!(
        conflicts.iter().all(|(at, _)| *at < Duration::from_secs(5)),
        "a torn request held the key for {:?}",
        conflicts.last().map(|(at, _)| *at)
    );
    let seen = upstream.seen("half-1").await;
    assert_eq!(seen.len(), 1, "only the whole request: {seen:?}");
    assert_eq!(answer.json()["body_sha256"], seen[0]["body_sha256"]);
}

/// The proxy closes a connection whose request head does not arrive
/// within `--header-timeout` (2 s here). A connection that sends nothing
/// at all, or a single byte, is closed as well: else every such
/// connection holds a file descriptor and a task for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_connection_that_never_sends_a_request_is_closed_like_a_slow_head() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "idle-conn",
        &["--header-timeout", "2s"],
    ));
    let mut slow_head = TcpStream::connect(proxy.addr()).await.expect("connect");
    slow_head
        .write_all(b"POST /pay HTTP/1.1\r\n")
        .await
        .expect("write");
    let mut silent = TcpStream::connect(proxy.addr()).await.expect("connect");
    let mut one_byte = TcpStream::connect(proxy.addr()).await.expect("connect");
    one_byte.write_all(b"P").await.expect("write");
    let within = Duration::from_secs(10);
    let (a, b, c) = tokio::join!(
        closed_within(&mut slow_head, within),
        closed_within(&mut silent, within),
        closed_within(&mut one_byte, within),
    );
    assert!(a, "control: a partial head is cut at 2 s");
    assert!(
        b && c,
        "after {within:?}: a silent connection closed: {b}; one that sent one byte closed: {c}"
    );
}

/// HTTP/1.1 lets a client shut its write side down after a whole request
/// and wait for the answer (RFC 9112 9.6). The proxy answers it, protected
/// route or not (else a passed-through request is cut off mid-call: the
/// upstream may act, nobody hears).
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_half_closes_after_its_request_still_gets_the_answer() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "halfclose", &[]));
    let mut got = Vec::new();
    for (method, key) in [("POST", "half-1"), ("PUT", "half-2")] {
        let raw = format!(
            "{method} /pay?delay_ms=200 HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: {key}\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        );
        let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
        stream.write_all(raw.as_bytes()).await.expect("write");
        stream.shutdown().await.expect("half-close");
        let mut out = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
        got.push(format!(
            "{method} ({}): {:?} upstream saw {}",
            if method == "POST" {
                "protected"
            } else {
                "passed"
            },
            match read {
                Ok(Ok(_)) => String::from_utf8_lossy(&out)
                    .chars()
                    .take(40)
                    .collect::<String>(),
                other => format!("{other:?}"),
            },
            upstream.seen(key).await.len()
        ));
    }
    assert!(
        got.iter().all(|g| g.contains("HTTP/1.1 201")),
        "{}",
        got.join("\n")
    );
}

/// Runs whose clients went away keep running, and `--max-running` bounds
/// them: with two running (both clients gone), a third protected request
/// gets 503 with `Retry-After` and never reaches the upstream; once they
/// end, it runs.
#[tokio::test(flavor = "multi_thread")]
async fn max_running_bounds_the_runs_whose_clients_went_away() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "max-running",
        &["--max-running", "2"],
    ));
    let text = json!({"amount": 9}).to_string();
    for key in ["held-1", "held-2"] {
        let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
        stream
            .write_all(&request("/block?id=held", key, &text, text.len()))
            .await
            .expect("write");
        upstream.until_seen(key, 1).await;
        drop(stream);
    }
    let url = proxy.at("/block?id=held");
    let body = json!({"amount": 9});
    let refused = send(post(&url, "third", &body)).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.header("retry-after").as_deref(), Some("1"));
    assert!(upstream.seen("third").await.is_empty(), "nothing was sent");

    upstream.release("held").await;
    let (_, ran) = until_not_409(Instant::now(), || post(&url, "third", &body)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut ran = ran;
    while ran.status == 503 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        ran = send(post(&url, "third", &body)).await;
    }
    assert_eq!(ran.status, 200, "{}", ran.text());
    assert_eq!(upstream.seen("third").await.len(), 1);
}

/// `--max-running 1` bounds the calls on the upstream, not the requests:
/// of four protected requests at once, one reaches the upstream and the
/// others get 503 with `Retry-After`, their keys released (nothing was
/// sent): once the first ends, a refused key's retry runs.
#[tokio::test(flavor = "multi_thread")]
async fn max_running_bounds_the_calls_on_the_upstream_and_releases_the_refused_keys() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("maxrun"),
        &["--max-running", "1"],
    ));
    let url = proxy.at("/block?id=maxrun");
    let body = json!({"amount": 1});
    let first = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move { send(post(&url, "mr-0", &body)).await })
    };
    upstream.until_seen("mr-0", 1).await;
    for i in 1..4 {
        let refused = send(post(&url, &format!("mr-{i}"), &body)).await;
        assert_eq!(refused.status, 503, "{}", refused.text());
        assert_eq!(refused.header("retry-after").as_deref(), Some("1"));
        assert!(upstream.seen(&format!("mr-{i}")).await.is_empty());
    }
    upstream.release("maxrun").await;
    let ran = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ran.status, 200, "{}", ran.text());
    let retry = send(post(&url, "mr-1", &body)).await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (200, false),
        "{}",
        retry.text()
    );
    assert_eq!(upstream.seen("mr-1").await.len(), 1);
}

/// A protected request whose body stalls after its head is cut at
/// `--body-timeout` (1 s here): nothing reaches the upstream, and the
/// connection is not held.
#[tokio::test(flavor = "multi_thread")]
async fn a_protected_request_whose_body_stalls_is_cut_at_the_body_timeout() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("stall"),
        &["--body-timeout", "1s"],
    ));
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(
            b"POST /pay HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: st-1\r\n\
              Content-Type: application/json\r\nContent-Length: 10\r\n\r\n{",
        )
        .await
        .expect("write");
    assert!(
        closed_within(&mut stream, Duration::from_secs(10)).await,
        "a body stalled after 1 byte is still held after 10 s (--body-timeout 1s)"
    );
    assert!(upstream.seen("st-1").await.is_empty(), "nothing was sent");
}

/// An HTTP/1.1 keep-alive connection idle after its first request is
/// closed within `--header-timeout`.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_keep_alive_connection_is_closed() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("idle"),
        &["--header-timeout", "1s"],
    ));
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(b"GET /pay HTTP/1.1\r\nHost: shop.test\r\n\r\n")
        .await
        .expect("write");
    assert!(
        closed_within(&mut stream, Duration::from_secs(8)).await,
        "an idle keep-alive connection is still open 8 s after its answer (header timeout 1s)"
    );
}

/// A client that reads the head of a large answer and then stops reading
/// does not hold the upstream call past `--upstream-timeout` ("the bound on
/// one upstream call, head and body").
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_does_not_hold_the_upstream_past_its_timeout() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("slowread"),
        &["--upstream-timeout", "2s"],
    ));
    let total: usize = 64 << 20;
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(
            format!("GET /stream?bytes={total} HTTP/1.1\r\nHost: shop.test\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .expect("write");
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 65536];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await.expect("read");
        assert!(n > 0, "closed before the head");
        got.extend_from_slice(&chunk[..n]);
    }
    // The client stops reading for twice the upstream timeout (the thing
    // under test is a time bound).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut rest = 0usize;
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => rest += n,
            }
        }
    })
    .await;
    assert!(read.is_ok(), "still reading after 60 s");
    assert!(
        rest + got.len() < total,
        "the whole {total}-byte body arrived although the client stopped reading past the 2 s upstream timeout"
    );
}

/// A duplicate waiting (`--wait`) for the replay runs nothing on the
/// upstream: it takes no `--max-running` slot from a fresh request.
#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_waiting_for_its_replay_takes_no_run_slot() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "waitslot",
        &["--max-running", "2", "--wait", "10s"],
    ));
    let url = proxy.at("/block?id=waitslot");
    let body = json!({"amount": 4});
    let first = tokio::spawn(send(post(&url, "wslot-a", &body)));
    upstream.until_seen("wslot-a", 1).await;
    let dup = tokio::spawn(send(post(&url, "wslot-a", &body)));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let fresh = send(post(&proxy.at("/pay"), "wslot-b", &json!({"amount": 5}))).await;
    upstream.release("waitslot").await;
    let first = first.await.expect("join");
    let dup = dup.await.expect("join");
    let runs = upstream.seen("wslot-a").await.len();
    assert_eq!(runs, 1, "the duplicate waited, it did not run");
    assert_eq!(
        fresh.status,
        201,
        "one request running on the upstream (--max-running 2) and its duplicate waiting: \
         a fresh request got {} {} (first {}, duplicate {} replayed={})",
        fresh.status,
        fresh.text(),
        first.status,
        dup.status,
        dup.replayed()
    );
}

/// A replay runs nothing on the upstream: with the one `--max-running` slot
/// taken, the recorded answer is still the answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_is_answered_while_the_run_slots_are_taken() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "replayslot",
        &["--max-running", "1"],
    ));
    let body = json!({"amount": 6});
    let done = settled(post(&proxy.at("/pay"), "rslot-done", &body)).await;
    assert_eq!(done.status, 201, "{}", done.text());
    let again = settled(post(&proxy.at("/pay"), "rslot-done", &body)).await;
    assert!(
        again.replayed(),
        "a replay with a slot free: {}",
        again.text()
    );
    let held = tokio::spawn(send(post(
        &proxy.at("/block?id=rslot"),
        "rslot-held",
        &body,
    )));
    upstream.until_seen("rslot-held", 1).await;
    let replay = send(post(&proxy.at("/pay"), "rslot-done", &body)).await;
    upstream.release("rslot").await;
    let _ = held.await;
    assert!(
        replay.status == 201 && replay.replayed(),
        "the replay of a completed key, while one request runs (--max-running 1), got {} {}",
        replay.status,
        replay.text()
    );
}
