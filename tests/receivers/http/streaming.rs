//! Responses whose body is still coming when the handler returns (the
//! detached layer streams them to their caller while it copies them): a
//! caller that stops reading holds up neither the recording nor the lease,
//! a body at the limit is recorded, one over it or one that fails is not
//! replayable and never runs again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idemkit::postgres::PgStore;
use idemkit::Idempotency;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{layer_on, pg_store};

/// Frames of the body and their size: 225 x 4 KiB = 900 KiB, within the
/// default max_response_bytes (1 MiB).
const FRAMES: usize = 225;
const FRAME: usize = 4096;

/// A server whose `/big` handler counts its runs and answers 200 with a
/// body whose first frame comes 20 ms after the head (so it streams), and
/// every other frame at once: the whole body is there within ms.
/// The listening socket has a small send buffer (accepted sockets inherit
/// it), so a caller that does not read holds the server's writes soon.
async fn serve(idem: Idempotency<PgStore>) -> (String, Arc<AtomicU64>) {
    serve_with(idem, usize::MAX, (FRAMES, FRAME), None).await
}

/// As [`serve`], the layer's max_response_bytes `limit` (`usize::MAX`: the
/// default), `frames` frames of `frame` bytes, and a failure in place of
/// frame `fail_at`.
async fn serve_with(
    idem: Idempotency<PgStore>,
    limit: usize,
    (frames, frame): (usize, usize),
    fail_at: Option<usize>,
) -> (String, Arc<AtomicU64>) {
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move || async move {
            executions.fetch_add(1, Ordering::SeqCst);
            let first = futures::stream::once(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'a'; frame]))
            });
            let rest = futures::stream::iter((1..frames).map(move |i| {
                if Some(i) == fail_at {
                    Err(std::io::Error::other("upstream failed"))
                } else {
                    Ok(bytes::Bytes::from(vec![b'b'; frame]))
                }
            }));
            use futures::StreamExt;
            (
                StatusCode::OK,
                [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
                axum::body::Body::from_stream(first.chain(rest)),
            )
        }
    };
    let mut layer = layer_on(idem);
    if limit != usize::MAX {
        layer = layer.max_response_bytes(limit);
    }
    let router = Router::new().route("/big", post(handler)).layer(layer);
    let socket = tokio::net::TcpSocket::new_v4().unwrap_or_else(|e| panic!("{e}"));
    socket
        .set_send_buffer_size(4096)
        .unwrap_or_else(|e| panic!("{e}"));
    socket
        .bind("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")))
        .unwrap_or_else(|e| panic!("{e}"));
    let listener = socket.listen(64).unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    (format!("{addr}"), executions)
}

/// Sends the request on a raw connection with a small receive buffer,
/// reads the response head (and a little of the body), then stops reading
/// while keeping the connection open (a stalled client: a phone in a
/// tunnel, a client whose reader is stuck).
async fn stalled_caller(addr: &str, key: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap_or_else(|e| panic!("{e}"));
    socket
        .set_recv_buffer_size(4096)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut conn = socket
        .connect(addr.parse().unwrap_or_else(|e| panic!("{e}")))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let request = format!(
        "POST /big HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\nx-api-key: t1\r\n\
         content-type: text/plain\r\ncontent-length: 0\r\n\r\n"
    );
    conn.write_all(request.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut head = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut head))
        .await
        .unwrap_or_else(|_| panic!("no response head within 10 s"))
        .unwrap_or_else(|e| panic!("{e}"));
    let head = String::from_utf8_lossy(&head[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "first response: {head}");
    conn
}

/// A duplicate on a fresh connection (reqwest): its status, whether it is a
/// replay, and its body's length.
async fn duplicate(addr: &str, key: &str) -> (u16, bool, usize) {
    let (status, _, replayed, len) = duplicate_answer(addr, key).await;
    (status, replayed, len)
}

/// [`duplicate`], and whether the answer has a `Retry-After`.
async fn duplicate_answer(addr: &str, key: &str) -> (u16, bool, bool, usize) {
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/big"))
        .header("idempotency-key", key)
        .header("x-api-key", "t1")
        .header("content-type", "text/plain")
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let status = response.status().as_u16();
    let retry = response.headers().contains_key("retry-after");
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = response.bytes().await.unwrap_or_else(|e| panic!("{e}"));
    (status, retry, replayed, body.len())
}

/// With the heartbeat off (a lease of 2 s, for handlers that take well
/// under it), the handler returns at once with a body that is all there
/// within ms (900 KiB, within max_response_bytes). Its caller stalls after
/// the head. The copy goes at the body's pace, not the caller's: the
/// response is recorded at once, and a duplicate 3 s later (the lease
/// over) gets the replay, never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_never_lets_the_handler_run_twice() {
    let idem = Idempotency::new(pg_store().await)
        .lease(Duration::from_secs(2))
        .heartbeat(false);
    let (addr, executions) = serve(idem).await;
    let stalled = stalled_caller(&addr, "stall-1").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, replayed, len) = duplicate(&addr, "stall-1").await;
    let runs = executions.load(Ordering::SeqCst);
    drop(stalled);
    assert_eq!(
        runs, 1,
        "the handler ran {runs} times: the duplicate got {status} (replayed {replayed}, {len} bytes)"
    );
}

/// With the default heartbeat: the body is all there within ms, but its
/// caller stalls after the head (a zero-window TCP connection stays open
/// as long as its client answers the server's window probes). The key is
/// recorded anyway: a duplicate gets the replay within 8 s, not 409 "in
/// progress" for as long as that connection stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_stops_reading_does_not_hold_the_key_in_progress() {
    let idem = Idempotency::new(pg_store().await).lease(Duration::from_secs(2));
    let (addr, executions) = serve(idem).await;
    let stalled = stalled_caller(&addr, "stall-2").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    let mut last = (0, false, 0);
    while std::time::Instant::now() < deadline {
        last = duplicate(&addr, "stall-2").await;
        if last.0 != 409 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let runs = executions.load(Ordering::SeqCst);
    drop(stalled);
    assert_eq!(runs, 1);
    assert_eq!(
        (last.0, last.1, last.2),
        (200, true, FRAMES * FRAME),
        "8 s after a handler whose body was all there within ms, a duplicate still gets {} \
         (replayed {}): the key is held in progress by a caller that stopped reading",
        last.0,
        last.1
    );
}

/// This process's resident memory, in KiB.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_else(|e| panic!("{e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/self/status"))
}

/// A 1 MiB body in 1-byte frames (within a 1 MiB limit) to a caller that
/// stops reading: the data waiting for the caller is kept joined, so the
/// process holds about the body (and its copy), not a frame's allocation
/// and queue slot per byte (2 MiB held 430 MiB more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_frames_to_a_caller_that_stops_reading_hold_about_the_body() {
    const BODY: usize = 1 << 20;
    let idem = Idempotency::new(pg_store().await);
    let (addr, executions) = serve_with(idem, BODY, (BODY, 1), None).await;
    let before = resident_kib();
    let stalled = stalled_caller(&addr, "tiny-frames").await;
    let again = settled(&addr, "tiny-frames").await;
    let during = resident_kib();
    drop(stalled);
    assert_eq!(
        again,
        (200, true, BODY),
        "the copy is recorded and replayed"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    let grown = during.saturating_sub(before);
    assert!(
        grown < 48 * 1024,
        "1 MiB in 1-byte frames to a caller that stopped reading grew the process by {grown} KiB"
    );
}

/// Retries a duplicate while it gets 409 with a Retry-After ("in
/// progress"), for 10 s at most: its last answer.
async fn settled(addr: &str, key: &str) -> (u16, bool, usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, retry, replayed, len) = duplicate_answer(addr, key).await;
        if status != 409 || !retry || std::time::Instant::now() > deadline {
            return (status, replayed, len);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A streamed body of exactly `max_response_bytes` is recorded and
/// replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_at_the_limit_is_recorded() {
    let idem = Idempotency::new(pg_store().await);
    let (addr, executions) = serve_with(idem, 3 * FRAME, (3, FRAME), None).await;
    let first = duplicate(&addr, "at-limit").await;
    assert_eq!(first, (200, false, 3 * FRAME));
    let again = settled(&addr, "at-limit").await;
    assert_eq!(again, (200, true, 3 * FRAME));
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// A streamed body over the limit whose caller goes away after the head:
/// the key completes as not replayable (409 without Retry-After), the
/// handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_over_the_limit_whose_caller_is_gone_is_not_replayable() {
    let idem = Idempotency::new(pg_store().await).lease(Duration::from_secs(2));
    let (addr, executions) = serve_with(idem, 2 * FRAME, (FRAMES, FRAME), None).await;
    let stalled = stalled_caller(&addr, "over-gone").await;
    drop(stalled);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = settled(&addr, "over-gone").await;
    assert_eq!(again.0, 409, "{again:?}");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// A streamed body that fails midway: its caller sees the failure, the key
/// is not replayable and never runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_that_fails_is_never_run_again() {
    let idem = Idempotency::new(pg_store().await).lease(Duration::from_secs(2));
    let (addr, executions) = serve_with(idem, usize::MAX, (4, FRAME), Some(2)).await;
    let first = reqwest::Client::new()
        .post(format!("http://{addr}/big"))
        .header("idempotency-key", "fails")
        .header("x-api-key", "t1")
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status().as_u16(), 200);
    assert!(first.bytes().await.is_err(), "the caller sees the failure");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = settled(&addr, "fails").await;
    assert_eq!(again.0, 409, "{again:?}");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}
