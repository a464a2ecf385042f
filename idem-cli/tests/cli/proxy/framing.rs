//! How bodies are framed both ways: an upstream's `Content-Length` beside
//! `Transfer-Encoding`, a client's `Expect: 100-continue`, chunked
//! requests with trailers, a client's `Content-Length` beside chunked,
//! `HEAD`, `204` and `101` answers, on keep-alive connections.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::wire::{body_text, memory, raw_post, raw_settled, raw_upstream, read_request, response};
use super::{anonymous, curl, raw_exchange, raw_exchanges, scope, Proxy, RawAnswer, Upstream};

/// The body of the upstream answer below: chunked, 36 bytes.
const CHUNKED_BODY: &str = "0123456789abcdefghijklmnopqrstuvwxyz";

/// An upstream answer with `Content-Length: 5` beside `Transfer-Encoding:
/// chunked`: the chunks frame it (RFC 9112 section 6.3), and a next hop
/// that kept the length would cut the body after 5 bytes and read the
/// rest as the next answer on the connection.
fn length_beside_chunked(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    )
    .into_bytes()
}

fn sha256_hex(bytes: &[u8]) -> String {
    idem_core::Fingerprint::of_bytes(bytes).to_hex()
}

fn shown(answers: &[RawAnswer]) -> Vec<(u16, String)> {
    answers.iter().map(|a| (a.status, body_text(a))).collect()
}

/// The upstream answers `/both` with a length beside chunks, its chunked
/// body holding what reads as a whole HTTP answer. A client (a load
/// balancer pooling its connections) sends that request and another one
/// on one connection: the first answer is the whole chunked body, the
/// second is the second request's own, never the rest of the first; for
/// a protected request as for a passed one. The protected one's retry
/// replays the whole body.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_length_beside_chunks_is_dropped_and_the_next_answer_is_its_own() {
    let smuggled = "HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nSMUGGLED";
    let first_body = format!("hello{smuggled}");
    let chunked = first_body.clone();
    let (url, count) = raw_upstream(true, move |n, seen| {
        Some((
            if seen.head.contains(" /both") {
                length_beside_chunked("201 Created", &chunked)
            } else {
                response("200 OK", &format!("own-{n}"))
            },
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "framing-both", &[]));
    let protected = "POST /both HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: both-1\r\n\
                     Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let passed = "GET /both HTTP/1.1\r\nHost: shop.test\r\n\r\n";
    let next = "GET /next HTTP/1.1\r\nHost: shop.test\r\nConnection: close\r\n\r\n";
    for first in [protected, passed] {
        let answers = raw_exchanges(&proxy.addr(), format!("{first}{next}").as_bytes()).await;
        assert_eq!(answers.len(), 2, "{first:?}: {:?}", shown(&answers));
        assert_eq!(body_text(&answers[0]), first_body, "{first:?}");
        assert!(
            body_text(&answers[1]).starts_with("own-"),
            "after {first:?}, the next request on the connection read {:?}",
            shown(&answers)
        );
    }
    let again = raw_settled(&proxy.addr(), &raw_post("/both", "both-1", "{}")).await;
    assert_eq!(again.values("idempotent-replayed"), vec!["true"]);
    assert_eq!(body_text(&again), first_body);
    assert_eq!(
        count.load(std::sync::atomic::Ordering::SeqCst),
        4,
        "the protected request once, the passed one, and two others"
    );
}

/// The same answer to an HTTP/2 client (h2c with prior knowledge): it
/// gets the upstream's body whole, not a stream reset for a length its
/// data does not match.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_length_beside_chunks_reaches_an_http2_caller_whole() {
    let (url, _count) = raw_upstream(true, |_, _| {
        Some((length_beside_chunked("201 Created", CHUNKED_BODY), false))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "framing-h2", &[]));
    let at = proxy.at("/pay");
    let answer = curl(&[
        "--http2-prior-knowledge",
        "-X",
        "POST",
        "-H",
        "Idempotency-Key: h2-1",
        "-H",
        "Content-Type: application/json",
        "--data",
        "{}",
        &at,
    ])
    .await
    .unwrap_or_else(|e| panic!("the HTTP/2 caller got no answer: {e}"));
    assert_eq!(
        (answer.status, answer.text()),
        (201, CHUNKED_BODY.to_owned())
    );
}

/// `Expect: 100-continue` on a protected request: the client gets `100
/// Continue`, sends its body, and gets the upstream's answer; its retry
/// (with `Expect` too) is the replay; the upstream ran once, with the
/// whole body.
#[tokio::test(flavor = "multi_thread")]
async fn expect_100_continue_on_a_protected_request_runs_once_and_replays() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("expect"), &[]));
    let body = r#"{"amount":77}"#;
    let head = format!(
        "POST /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: ex-1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    let mut answers = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(proxy.addr()).await.expect("connect");
        stream.write_all(head.as_bytes()).await.expect("head");
        // The interim answer comes before the body is sent.
        let mut interim = Vec::new();
        while !interim.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte))
                .await
                .unwrap_or_else(|_| panic!("no 100 Continue within 10 s: {interim:?}"));
            match read {
                Ok(1) => interim.push(byte[0]),
                other => panic!("the connection ended before 100 Continue: {other:?}"),
            }
        }
        assert!(
            interim.starts_with(b"HTTP/1.1 100"),
            "{:?}",
            String::from_utf8_lossy(&interim)
        );
        stream.write_all(body.as_bytes()).await.expect("body");
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(15), stream.read_to_end(&mut rest))
            .await
            .unwrap_or_else(|_| panic!("no final answer within 15 s"))
            .expect("read");
        let answers_here = super::parse_answers(&rest);
        answers.push(answers_here.into_iter().next().expect("a final answer"));
    }
    assert_eq!(answers[0].status, 201, "{}", body_text(&answers[0]));
    assert_eq!(
        answers[1].values("idempotent-replayed"),
        vec!["true"],
        "the retry is the replay: {} {}",
        answers[1].status,
        body_text(&answers[1])
    );
    assert_eq!(answers[0].body, answers[1].body);
    let seen = upstream.seen("ex-1").await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0]["body_sha256"], sha256_hex(body.as_bytes()));
}

/// A chunked protected request with a trailer; its retry cut into other
/// chunks (the same bytes) is the replay; the upstream ran once, with the
/// bytes.
#[tokio::test(flavor = "multi_thread")]
async fn a_chunked_request_with_trailers_runs_once_and_its_rechunked_retry_replays() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("chunked"), &[]));
    let body = r#"{"amount":12,"note":"chunked"}"#;
    let chunked = |cut: usize| {
        let (a, b) = body.split_at(cut);
        format!(
            "POST /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: ch-1\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\
             Connection: close\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\nX-Sum: 1\r\n\r\n",
            a.len(),
            b.len()
        )
        .into_bytes()
    };
    let first = raw_exchange(&proxy.addr(), &chunked(5)).await;
    assert_eq!(first.status, 201, "{}", body_text(&first));
    let again = raw_settled(&proxy.addr(), &chunked(17)).await;
    assert_eq!(
        again.values("idempotent-replayed"),
        vec!["true"],
        "{}",
        body_text(&again)
    );
    assert_eq!(again.body, first.body);
    let seen = upstream.seen("ch-1").await;
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["body_sha256"], sha256_hex(body.as_bytes()));
}

/// A client's `Content-Length` beside `Transfer-Encoding: chunked`, in
/// both orders, with a request of its own (another key) after the chunked
/// body: the chunks frame the body (RFC 9112 section 6.3), the request
/// runs once with it, and the connection is closed after its answer, so
/// what follows is never read as a request (no desync).
#[tokio::test(flavor = "multi_thread")]
async fn a_client_length_beside_chunks_is_framed_by_the_chunks_and_smuggles_nothing() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&anonymous(&upstream, &scope("smuggle"), &[]));
    let smuggled = "POST /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: smuggled-1\r\n\
                    Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    for (i, framing) in [
        "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
    ]
    .iter()
    .enumerate()
    {
        let body = r#"{"amount":1}"#;
        let raw = format!(
            "POST /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: smuggle-{i}\r\n\
             Content-Type: application/json\r\n{framing}\r\n{:x}\r\n{body}\r\n0\r\n\r\n{smuggled}",
            body.len()
        );
        let answers = raw_exchanges(&proxy.addr(), raw.as_bytes()).await;
        assert_eq!(
            answers.iter().map(|a| a.status).collect::<Vec<_>>(),
            vec![201],
            "{framing:?}: {:?}",
            shown(&answers)
        );
        let seen = upstream.seen(&format!("smuggle-{i}")).await;
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0]["body_sha256"], sha256_hex(body.as_bytes()));
    }
    assert!(upstream.seen("smuggled-1").await.is_empty());
}

/// With `--protect "* /"`, a `HEAD` with a key: the replay says what the
/// first answer said, its `Content-Length` (the size of the resource, all
/// a `HEAD` answer is for) included.
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_head_keeps_the_content_length_its_caller_got() {
    let (url, count) = raw_upstream(true, |_, _| {
        Some((
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1234\r\nETag: \"v1\"\r\n\r\n"
                .to_vec(),
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "head", &["--protect", "* /"]));
    let raw = b"HEAD /doc HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: hd-1\r\nConnection: close\r\n\r\n";
    let first = raw_exchange(&proxy.addr(), raw).await;
    let again = raw_settled(&proxy.addr(), raw).await;
    assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(again.values("idempotent-replayed"), vec!["true"]);
    assert_eq!(first.values("content-length"), vec!["1234"]);
    assert_eq!(
        again.values("content-length"),
        vec!["1234"],
        "the caller got {:?}, the replay {:?}",
        first.headers,
        again.headers
    );
    assert!(again.body.is_empty());
}

/// A recorded `204` and its replay, each followed by another request on
/// the same keep-alive connection: every answer framed right, no stray
/// byte read as the next answer.
#[tokio::test(flavor = "multi_thread")]
async fn a_recorded_204_and_its_replay_keep_a_keep_alive_connection_in_step() {
    let (url, count) = raw_upstream(true, |_, seen| {
        Some((
            if seen.head.starts_with("POST") {
                b"HTTP/1.1 204 No Content\r\nX-Done: yes\r\n\r\n".to_vec()
            } else {
                response("200 OK", "after")
            },
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "nocontent", &[]));
    let post = "POST /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: nc-1\r\n\
                Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let after = "GET /after HTTP/1.1\r\nHost: shop.test\r\nConnection: close\r\n\r\n";
    let first = raw_exchanges(&proxy.addr(), format!("{post}{after}").as_bytes()).await;
    assert_eq!(
        shown(&first),
        vec![(204, String::new()), (200, "after".to_owned())]
    );
    // Once recorded, the same again: the replay, then the next answer.
    raw_settled(&proxy.addr(), &raw_post("/pay", "nc-1", "{}")).await;
    let again = raw_exchanges(&proxy.addr(), format!("{post}{after}").as_bytes()).await;
    assert_eq!(
        shown(&again),
        vec![(204, String::new()), (200, "after".to_owned())]
    );
    assert_eq!(again[0].values("idempotent-replayed"), vec!["true"]);
    assert_eq!(again[0].values("x-done"), vec!["yes"]);
    assert_eq!(
        count.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "one POST, two GETs"
    );
}

/// An upstream that answers a protected `POST` (which asked for no
/// upgrade) with `101 Switching Protocols`: the proxy keeps serving and
/// the upstream never runs the key again.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_101_to_a_protected_request_never_runs_it_again() {
    let (url, count) = raw_upstream(true, |n, _| {
        Some((
            if n == 1 {
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n".to_vec()
            } else {
                response("201 Created", &format!("run-{n}"))
            },
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "switching", &["--upstream-timeout", "3s"]));
    let raw = raw_post("/pay", "up-1", r#"{"a":1}"#);
    let first = raw_exchange(&proxy.addr(), &raw).await;
    let again = raw_settled(&proxy.addr(), &raw).await;
    let other = raw_exchange(&proxy.addr(), &raw_post("/pay", "up-2", r#"{"a":2}"#)).await;
    assert_eq!(other.status, 201, "the proxy still serves");
    assert_eq!(
        count.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "up-1 ran again: first {} {:?}, retry {} {:?}",
        first.status,
        body_text(&first),
        again.status,
        body_text(&again)
    );
}

/// A raw upstream whose every answer is `head` then `first` at once, then
/// `rest` after `pause` (a body that comes in two parts), on keep-alive
/// connections. Counts the requests it reads.
async fn two_part_upstream(
    head: &'static str,
    first: &'static str,
    rest: &'static str,
    pause: Duration,
) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicUsize::new(0));
    let counted = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(_seen) = read_request(&mut stream, &mut buf, true).await {
                    counted.fetch_add(1, Ordering::SeqCst);
                    if stream
                        .write_all(format!("{head}{first}").as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                    let _ = stream.flush().await;
                    tokio::time::sleep(pause).await;
                    if stream.write_all(rest.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), count)
}

/// Writes `raw` on a fresh connection and reads until the proxy closes
/// it (20 s at most): all the bytes.
async fn read_all(addr: &str, raw: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let _ = stream.write_all(raw).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut out)).await;
    out
}

/// The upstream answers a protected `POST` with `Content-Length: 5, 5`
/// (one length, said twice in one field: hyper's client takes it as 5)
/// and a body that comes in two parts. The caller whose request ran must
/// get its answer: `201` and `hello`.
#[tokio::test(flavor = "multi_thread")]
async fn a_length_listed_twice_on_a_body_in_two_parts_reaches_the_caller_that_ran() {
    let (url, count) = two_part_upstream(
        "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 5, 5\r\n\r\n",
        "he",
        "llo",
        Duration::from_millis(500),
    )
    .await;
    let proxy = Proxy::start(&memory(&url, "cl-list-h1", &[]));
    let raw = raw_post("/pay", "cll-1", "{}");
    let first = read_all(&proxy.addr(), &raw).await;
    let first_text = String::from_utf8_lossy(&first).into_owned();
    let again = raw_settled(&proxy.addr(), &raw).await;
    let logs = proxy.logs();
    assert_eq!(count.load(Ordering::SeqCst), 1, "ran once");
    assert!(
        first_text.starts_with("HTTP/1.1 201") && first_text.ends_with("hello"),
        "the caller whose request ran got {first_text:?} (its retry got {} {:?} {:?})\n{}",
        again.status,
        again.headers,
        body_text(&again),
        logs.lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("panicked"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The same answer (`Content-Length: 5, 5`) to a passed `GET` from an
/// HTTP/2 caller (h2c, prior knowledge): it gets `hello`, not a stream
/// reset for a `content-length` that is not a number.
#[tokio::test(flavor = "multi_thread")]
async fn a_length_listed_twice_reaches_an_http2_caller_of_a_passed_get() {
    let (url, _count) = raw_upstream(true, |_, _| {
        Some((
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5, 5\r\n\r\nhello"
                .to_vec(),
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "cl-list-h2", &[]));
    let at = proxy.at("/page");
    let answer = curl(&["--http2-prior-knowledge", &at]).await;
    // What an HTTP/1.1 caller gets, for the report.
    let h1 = raw_exchange(
        &proxy.addr(),
        b"GET /page HTTP/1.1\r\nHost: shop.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    match answer {
        Ok(a) => assert_eq!((a.status, a.text()), (200, "hello".to_owned())),
        Err(e) => panic!(
            "the HTTP/2 caller got no answer: {e}\n(an HTTP/1.1 caller gets content-length {:?})",
            h1.values("content-length")
        ),
    }
}

/// A protected `POST` from an HTTP/2 caller, the upstream answering
/// `Content-Length: 5, 5` with a body in two parts: the caller gets its
/// `201` and `hello`.
#[tokio::test(flavor = "multi_thread")]
async fn a_length_listed_twice_reaches_an_http2_caller_that_ran() {
    let (url, count) = two_part_upstream(
        "HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 5, 5\r\n\r\n",
        "he",
        "llo",
        Duration::from_millis(500),
    )
    .await;
    let proxy = Proxy::start(&memory(&url, "cl-list-h2p", &[]));
    let at = proxy.at("/pay");
    let answer = curl(&[
        "--http2-prior-knowledge",
        "-X",
        "POST",
        "-H",
        "Idempotency-Key: h2l-1",
        "-H",
        "Content-Type: application/json",
        "--data",
        "{}",
        &at,
    ])
    .await;
    assert_eq!(count.load(Ordering::SeqCst), 1);
    match answer {
        Ok(a) => assert_eq!((a.status, a.text()), (201, "hello".to_owned())),
        Err(e) => panic!("the HTTP/2 caller whose request ran got no answer: {e}"),
    }
}

/// `HEAD` under `* /`, the resource longer than `--max-response-bytes`:
/// the replay keeps the length its caller got, and the next answer on
/// the connection is its own.
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_head_of_a_large_resource_keeps_its_length() {
    let (url, count) = raw_upstream(true, |_, seen| {
        Some((
            if seen.head.starts_with("HEAD") {
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5000\r\n\r\n"
                    .to_vec()
            } else {
                response("200 OK", "after")
            },
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(
        &url,
        "head-big",
        &["--protect", "* /", "--max-response-bytes", "100"],
    ));
    let head = "HEAD /doc HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: hb-1\r\n\r\n";
    let after = "GET /after HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: hb-after\r\nConnection: close\r\n\r\n";
    let alone = "HEAD /doc HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: hb-1\r\nConnection: close\r\n\r\n";
    let first = raw_exchange(&proxy.addr(), alone.as_bytes()).await;
    let again = raw_exchange(&proxy.addr(), alone.as_bytes()).await;
    assert_eq!(first.values("content-length"), vec!["5000"], "{first:?}");
    assert_eq!(
        again.values("idempotent-replayed"),
        vec!["true"],
        "{again:?}"
    );
    assert_eq!(again.values("content-length"), vec!["5000"], "{again:?}");
    // The replay of the HEAD then a GET on one connection: two answers,
    // the second its own.
    let both = read_all(&proxy.addr(), format!("{head}{after}").as_bytes()).await;
    let text = String::from_utf8_lossy(&both).into_owned();
    assert_eq!(text.matches("HTTP/1.1 ").count(), 2, "{text:?}");
    assert!(text.ends_with("after"), "{text:?}");
    assert_eq!(count.load(Ordering::SeqCst), 2, "HEAD once, GET once");
}

/// An upstream answering in HTTP/1.0 without a length (the body runs to
/// the close) a protected request sent on a keep-alive connection with
/// another after it: the caller gets the whole body, then the next
/// answer its own; the retry replays the body.
#[tokio::test(flavor = "multi_thread")]
async fn an_http10_answer_without_a_length_keeps_the_connection_in_step() {
    let (url, count) = raw_upstream(true, |_, seen| {
        if seen.head.starts_with("POST") {
            Some((
                b"HTTP/1.0 201 Created\r\nContent-Type: text/plain\r\n\r\nold-style".to_vec(),
                true,
            ))
        } else {
            Some((response("200 OK", "after"), false))
        }
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "http10", &[]));
    let post = "POST /pay HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: h10-1\r\n\
                Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let after = "GET /after HTTP/1.1\r\nHost: shop.test\r\nConnection: close\r\n\r\n";
    let raw = read_all(&proxy.addr(), format!("{post}{after}").as_bytes()).await;
    let first = super::parse_answers(&raw);
    let shown: Vec<(u16, String)> = first.iter().map(|a| (a.status, body_text(a))).collect();
    assert_eq!(
        shown,
        vec![(201, "old-style".to_owned()), (200, "after".to_owned())],
        "raw: {:?}",
        String::from_utf8_lossy(&raw)
    );
    let again = raw_settled(&proxy.addr(), &raw_post("/pay", "h10-1", "{}")).await;
    assert_eq!(again.values("idempotent-replayed"), vec!["true"]);
    assert_eq!(body_text(&again), "old-style");
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

/// An upstream that answers a `HEAD` with a body anyway (its length's
/// worth), then a protected `POST` on the proxy's pooled connection: the
/// `POST` runs once and its caller gets the upstream's answer, never a
/// `502` read from the `HEAD`'s leftover bytes (which would burn the key:
/// it ran, and no retry would ever get its answer).
#[tokio::test(flavor = "multi_thread")]
async fn a_head_answered_with_a_body_leaves_the_next_protected_request_whole() {
    let (url, count) = raw_upstream(true, |n, seen| {
        Some((
            if seen.head.starts_with("HEAD") {
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"
                    .to_vec()
            } else {
                response("201 Created", &format!("run-{n}"))
            },
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "head-body", &["--protect", "* /"]));
    let mut report = Vec::new();
    for i in 0..3 {
        let head = format!(
            "HEAD /doc HTTP/1.1\r\nHost: shop.test\r\nIdempotency-Key: hbb-{i}\r\nConnection: close\r\n\r\n"
        );
        let h = raw_exchange(&proxy.addr(), head.as_bytes()).await;
        let p = raw_exchange(&proxy.addr(), &raw_post("/pay", &format!("hbp-{i}"), "{}")).await;
        report.push(format!(
            "HEAD {} {:?} / POST {} {:?}",
            h.status,
            h.values("content-length"),
            p.status,
            body_text(&p)
        ));
    }
    let logs = proxy.logs();
    assert!(
        report.iter().all(|r| r.contains("POST 201")),
        "{}\nupstream saw {} requests\n{}",
        report.join("\n"),
        count.load(Ordering::SeqCst),
        logs.lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A protected `HEAD` (`* /`) from an HTTP/2 caller, and its replay: both
/// answered, both with the upstream's `Content-Length`.
#[tokio::test(flavor = "multi_thread")]
async fn a_head_and_its_replay_reach_an_http2_caller() {
    let (url, count) = raw_upstream(true, |_, _| {
        Some((
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1234\r\n\r\n".to_vec(),
            false,
        ))
    })
    .await;
    let proxy = Proxy::start(&memory(&url, "head-h2", &["--protect", "* /"]));
    let at = proxy.at("/doc");
    let mut seen = Vec::new();
    for _ in 0..2 {
        let a = curl(&[
            "--http2-prior-knowledge",
            "-I",
            "-H",
            "Idempotency-Key: h2h-1",
            &at,
        ])
        .await;
        seen.push(a.map(|a| (a.status, a.header("content-length"), a.replayed())));
    }
    assert_eq!(count.load(Ordering::SeqCst), 1, "{seen:?}");
    assert_eq!(
        seen,
        vec![
            Ok((200, Some("1234".to_owned()), false)),
            Ok((200, Some("1234".to_owned()), true))
        ]
    );
}
