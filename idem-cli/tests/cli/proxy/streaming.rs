//! Bodies larger than the limits.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::memory;
use super::{anonymous, client, post, scope, send, settled, Proxy, Upstream};

/// What `upstream.py`'s `/stream` sends: byte `i` is `i % 251`.
fn check_pattern(from: usize, chunk: &[u8]) -> Result<(), String> {
    for (i, b) in chunk.iter().enumerate() {
        if *b != ((from + i) % 251) as u8 {
            return Err(format!(
                "byte {} is {b}, not {}",
                from + i,
                (from + i) % 251
            ));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_5_mb_streamed_response_passes_through_whole_and_its_retry_gets_409_not_recorded() {
    const BYTES: usize = 5 * 1024 * 1024;
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("stream"), &[]));
    let url = proxy.at(&format!("/stream?bytes={BYTES}"));
    let body = json!({"report": "all"});

    let mut response = post(&url, "big-1", &body)
        .send()
        .await
        .expect("the streamed request");
    assert_eq!(response.status(), 200);
    let mut read = 0;
    while let Some(chunk) = response.chunk().await.unwrap_or_else(|e| {
        panic!("the stream broke after {read} bytes: {e}");
    }) {
        if let Err(e) = check_pattern(read, &chunk) {
            panic!("not the upstream's bytes: {e}");
        }
        read += chunk.len();
    }
    assert_eq!(read, BYTES, "the whole body");

    let retry = settled(post(&url, "big-1", &body)).await;
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert!(
        retry.text().to_lowercase().contains("not recorded"),
        "{}",
        retry.text()
    );
    assert!(
        retry.header("retry-after").is_none(),
        "it will never run again: no Retry-After ({:?})",
        retry.headers
    );
    let seen = upstream.seen("big-1").await;
    assert_eq!(seen.len(), 1, "the upstream saw: {seen:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_small_chunked_response_is_recorded_and_replayed_byte_exact() {
    const BYTES: usize = 100_000;
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("small"), &[]));
    let url = proxy.at(&format!("/stream?bytes={BYTES}"));
    let body = json!({"report": "small"});

    let first = send(post(&url, "small-1", &body)).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.body.len(), BYTES);
    check_pattern(0, &first.body).unwrap_or_else(|e| panic!("{e}"));

    let retry = settled(post(&url, "small-1", &body)).await;
    assert_eq!(retry.status, 200, "{}", retry.text());
    assert!(retry.replayed(), "{:?}", retry.headers);
    assert!(retry.body == first.body, "the replay is byte-exact");
    assert_eq!(
        retry.header("content-type").as_deref(),
        Some("application/octet-stream")
    );
    assert_eq!(upstream.seen("small-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_body_over_max_body_bytes_gets_413_and_never_reaches_the_upstream() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(
        &upstream,
        &scope("413"),
        &["--max-body-bytes", "1024"],
    ));
    let url = proxy.at("/pay");
    let big = "x".repeat(2048);

    let refused = send(
        client()
            .post(&url)
            .header("Idempotency-Key", "huge-1")
            .header("Content-Type", "text/plain")
            .body(big),
    )
    .await;
    assert_eq!(refused.status, 413, "{}", refused.text());
    assert!(upstream.seen("huge-1").await.is_empty());

    let fits = send(post(&url, "huge-1", &json!({"small": true}))).await;
    assert_eq!(fits.status, 201, "the key was not taken: {}", fits.text());
    assert_eq!(upstream.seen("huge-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_body_reaches_the_upstream_byte_exact_with_content_length_or_chunked() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("reqbody"), &[]));
    let bytes: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let binary = |url: String, key: &str| {
        client()
            .post(url)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/octet-stream")
            .body(bytes.clone())
    };

    // Its hash as the upstream computes it, the body sent directly.
    let direct = send(binary(format!("{}/pay", upstream.url()), "direct")).await;
    let want = direct.json()["body_sha256"].clone();

    let sized = send(binary(proxy.at("/pay"), "body-1")).await;
    assert_eq!(sized.status, 201, "{}", sized.text());
    assert_eq!(sized.json()["body_sha256"], want, "through the proxy");

    // The same body, chunked on a raw connection.
    let mut request = b"POST /pay HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: body-2\r\n\
        Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\
        Connection: close\r\n\r\n"
        .to_vec();
    for chunk in bytes.chunks(70_001) {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(chunk);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    let chunked = super::raw_exchange(&proxy.addr(), &request).await;
    assert_eq!(
        chunked.status,
        201,
        "{}",
        String::from_utf8_lossy(&chunked.body)
    );
    let doc: serde_json::Value = serde_json::from_slice(&chunked.body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&chunked.body)));
    assert_eq!(doc["body_sha256"], want, "chunked through the proxy");

    // Chunked or not, the same bytes are the same request: a replay.
    let again = settled(binary(proxy.at("/pay"), "body-2")).await;
    assert!(again.replayed(), "{} {}", again.status, again.text());
    assert_eq!(upstream.seen("body-1").await.len(), 1);
    assert_eq!(upstream.seen("body-2").await.len(), 1);
}

/// `--upstream-timeout` bounds one upstream call, head and body: a client
/// that reads the head of a large protected answer and then stops reading
/// (its connection open) loses the body at that bound, and the call's
/// `--max-running` slot is free again for a fresh request.
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_reader_of_a_streamed_protected_answer_frees_its_slot_at_the_upstream_timeout() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "stallslot",
        &["--max-running", "1", "--upstream-timeout", "2s"],
    ));
    let total: usize = 64 << 20;
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    let head = format!(
        "POST /stream?bytes={total} HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: ss-1\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 65536];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut chunk))
            .await
            .expect("a head within 20 s")
            .expect("read");
        assert!(n > 0, "closed before the head");
        got.extend_from_slice(&chunk[..n]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&got[..64.min(got.len())])
    );
    // Three times the upstream timeout, the connection open, nothing read.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let fresh = send(post(&proxy.at("/pay"), "ss-2", &json!({"amount": 1}))).await;
    let seen = upstream.seen("ss-2").await.len();
    // Control: once the stalled client closes, the slot comes back.
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    let after_close = loop {
        let again = send(post(&proxy.at("/pay"), "ss-3", &json!({"amount": 1}))).await;
        if again.status != 503 || Instant::now() >= deadline {
            break again.status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        fresh.status,
        201,
        "6 s after a stalled reader's head (--upstream-timeout 2s, --max-running 1) a fresh \
         request got {} (upstream saw it {seen} time(s)): {}; once the stalled client closed: {after_close}",
        fresh.status,
        fresh.text()
    );
}

/// `--optional-key`: a request without a key on a protected route is
/// forwarded unprotected, its body streamed, and `--body-timeout` (which
/// bounds the body a protected request buffers) does not cut it: a keyless
/// upload slower than the body timeout reaches the upstream whole.
#[tokio::test(flavor = "multi_thread")]
async fn an_unprotected_keyless_upload_is_not_cut_by_the_body_timeout() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "optbody",
        &["--optional-key", "--body-timeout", "1s"],
    ));
    let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
    stream
        .write_all(
            b"POST /pay HTTP/1.1\r\nHost: shop.test\r\nContent-Type: application/json\r\n\
              Content-Length: 12\r\nConnection: close\r\n\r\n{\"amou",
        )
        .await
        .expect("write");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let _ = stream.write_all(b"nt\":8}").await;
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut raw)).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    assert!(
        text.starts_with("HTTP/1.1 201"),
        "a keyless (unprotected) upload that took 2.5 s (--body-timeout 1s) got: {}",
        &text[..text.len().min(400)]
    );
}

/// With `--max-running 1`, a protected streamed answer gives its permit
/// back when it is read whole, and when its reader stalls, at
/// `--upstream-timeout`: the next protected call is never 503.
#[tokio::test(flavor = "multi_thread")]
async fn max_running_permits_come_back_after_streamed_answers_read_or_stalled() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(
        &upstream.url(),
        "probe-permit",
        &[
            "--protect",
            "POST /stream",
            "--protect",
            "POST /pay",
            "--max-running",
            "1",
            "--upstream-timeout",
            "3s",
        ],
    ));
    let c = client();
    for i in 0..3 {
        let r = c
            .post(proxy.at("/stream?bytes=5000000"))
            .header("Idempotency-Key", format!("probe-permit-s{i}"))
            .body("{}")
            .send()
            .await
            .expect("send");
        let status = r.status();
        let n = r.bytes().await.map(|b| b.len()).unwrap_or(0);
        assert_eq!(status, 200, "stream {i}: {status}");
        assert_eq!(n, 5000000, "stream {i}: {n} bytes");
        let r = c
            .post(proxy.at("/pay"))
            .header("Idempotency-Key", format!("probe-permit-p{i}"))
            .body("{}")
            .send()
            .await
            .expect("send");
        assert!(
            r.status().is_success(),
            "pay {i} after a read stream: {} {:?}",
            r.status(),
            r.text().await
        );
    }
    // A reader that stalls: the permit comes back at the upstream timeout.
    let stalled = c
        .post(proxy.at("/stream?bytes=67108864"))
        .header("Idempotency-Key", "probe-permit-stall")
        .body("{}")
        .send()
        .await
        .expect("send");
    assert_eq!(stalled.status(), 200);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let r = c
        .post(proxy.at("/pay"))
        .header("Idempotency-Key", "probe-permit-after-stall")
        .body("{}")
        .send()
        .await
        .expect("send");
    let status = r.status();
    assert!(
        status.is_success(),
        "pay 5 s after a stalled reader (timeout 3s): {status} {:?}",
        r.text().await
    );
    drop(stalled);
}
