//! HTTP/2 on both sides: to the upstream (`--upstream-http2`, h2c) and
//! from clients (h2c with prior knowledge).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::wire::{error_lines, h2c_going_away, h2c_refusing_its_second_stream, memory};
use super::{curl, options, post as post_key, scope, send, settled, support, Proxy, Upstream};

/// An upstream that answers on HTTP/1.1 and h2c: every `POST /pay` gets
/// its count and the HTTP version it came on.
async fn h2c_upstream() -> (String, Arc<AtomicU64>) {
    let count = Arc::new(AtomicU64::new(0));
    let router = Router::new()
        .route(
            "/pay",
            post(
                |State(count): State<Arc<AtomicU64>>, request: Request| async move {
                    let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                    (
                        axum::http::StatusCode::CREATED,
                        Json(json!({ "count": n, "version": format!("{:?}", request.version()) })),
                    )
                },
            ),
        )
        .with_state(count.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    (format!("http://{addr}"), count)
}

#[tokio::test(flavor = "multi_thread")]
async fn with_upstream_http2_requests_reach_the_upstream_over_h2c_once_per_key() {
    let (upstream, count) = h2c_upstream().await;
    let proxy = Proxy::start(&options(
        &upstream,
        "memory",
        &scope("h2c"),
        &["--allow-anonymous", "--upstream-http2"],
    ));
    let body = json!({ "amount": 70 });
    let ran = send(post_key(&proxy.at("/pay"), "h2-1", &body)).await;
    assert_eq!(ran.status, 201, "{}", ran.text());
    assert_eq!(ran.json()["version"], "HTTP/2.0", "{}", ran.text());
    let again = settled(post_key(&proxy.at("/pay"), "h2-1", &body)).await;
    assert!(again.replayed(), "{} {}", again.status, again.text());
    assert_eq!(again.body, ran.body);

    // Many keys at once share the multiplexed connection.
    let answers = futures::future::join_all((0..32).map(|i| {
        let url = proxy.at("/pay");
        async move { send(post_key(&url, &format!("h2-many-{i}"), &json!({ "i": i }))).await }
    }))
    .await;
    for a in &answers {
        assert_eq!(a.status, 201, "{}", a.text());
        assert_eq!(a.json()["version"], "HTTP/2.0");
    }
    assert_eq!(count.load(Ordering::SeqCst), 33, "one run per key");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_on_http2_gets_the_same_run_and_replay() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&options(
        &upstream.url(),
        "memory",
        &scope("h2-client"),
        &["--allow-anonymous"],
    ));
    let url = proxy.at("/pay");
    let args = [
        "--http2-prior-knowledge",
        "-H",
        "Idempotency-Key: h2c-1",
        "-H",
        "content-type: application/json",
        "--data",
        r#"{"amount":71}"#,
        &url,
    ];
    let pay = || curl(&args);
    let ran = pay().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ran.status, 201, "{}", ran.text());
    let mut again = pay().await.unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..100 {
        if again.status != 409 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        again = pay().await.unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(again.replayed(), "{} {}", again.status, again.text());
    assert_eq!(again.body, ran.body);
    let first: Value = ran.json();
    assert_eq!(first["count"], 1);
    assert_eq!(upstream.seen("h2c-1").await.len(), 1);
}

/// `--upstream-http2` in front of an upstream that speaks only HTTP/1.1
/// (a configuration slip): a request sent to it would fail after it was
/// sent, its key burnt although nothing ran. The proxy checks at start
/// and refuses to run (exit 2, usage), saying why.
#[test]
fn with_upstream_http2_in_front_of_an_http1_upstream_the_proxy_refuses_to_start() {
    let upstream = Upstream::start();
    let args = options(
        &upstream.url(),
        "memory",
        &scope("h2slip"),
        &["--allow-anonymous", "--upstream-http2"],
    );
    let (code, _, stderr) = super::run_to_exit(&args);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("does not speak HTTP/2"), "{stderr}");
}

/// An h2c client that is killed while the upstream works (its stream is
/// reset): the run goes on, is recorded, and the retry is the replay.
#[tokio::test(flavor = "multi_thread")]
async fn an_http2_client_killed_mid_request_leaves_a_recorded_run_and_its_retry_is_the_replay() {
    let upstream = Upstream::start();
    let proxy = Proxy::start(&memory(&upstream.url(), "h2gone", &[]));
    let url = proxy.at("/block?id=h2gone");
    let body = json!({"amount": 12}).to_string();
    let mut curl = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "30",
            "--noproxy",
            "*",
            "--http2-prior-knowledge",
            "-H",
            "Idempotency-Key: h2gone-1",
            "-H",
            "Content-Type: application/json",
            "--data",
            &body,
            &url,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("curl");
    upstream.until_seen("h2gone-1", 1).await;
    let _ = curl.kill();
    let _ = curl.wait();
    upstream.release("h2gone").await;
    let (_, answer) = super::until_not_409(std::time::Instant::now(), || {
        super::client()
            .post(&url)
            .header("Idempotency-Key", "h2gone-1")
            .header("Content-Type", "application/json")
            .body(body.clone())
    })
    .await;
    assert!(answer.replayed(), "{} {}", answer.status, answer.text());
    assert_eq!(upstream.seen("h2gone-1").await.len(), 1);
}

/// The h2c upstream refuses the first request's stream (it was not
/// processed: RFC 9113 8.7 makes that a guarantee the client may retry
/// on). The proxy releases the key, never "it may have acted": the retry
/// runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_the_h2_upstream_refused_was_not_processed_and_its_key_runs_on_retry() {
    let (url, answered) = h2c_refusing_its_second_stream().await;
    let proxy = Proxy::start(&memory(&url, "refused-stream", &["--upstream-http2"]));
    let body = json!({"amount": 17});
    let first = send(post_key(&proxy.at("/pay"), "rs-1", &body)).await;
    let retry = settled(post_key(&proxy.at("/pay"), "rs-1", &body)).await;
    assert!(
        first.status == 200 || (retry.status == 200 && !retry.replayed()),
        "the upstream refused the stream unprocessed; first {} {}, retry {} {} (streams answered: {})\n{}",
        first.status,
        first.text(),
        retry.status,
        retry.text(),
        answered.load(Ordering::SeqCst),
        proxy
            .logs()
            .lines()
            .filter(|l| l.contains("ERROR"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// `--upstream-http2` with an upstream down at start: the check is
/// inconclusive, so the first protected request checks again; when the
/// upstream comes up speaking HTTP/1.1, that request gets 502 and its key is
/// released (nothing was sent), never burnt.
#[tokio::test(flavor = "multi_thread")]
async fn with_upstream_http2_an_upstream_that_comes_up_in_http1_burns_no_key() {
    let port = support::free_port();
    let proxy = Proxy::start(&memory(
        &format!("http://127.0.0.1:{port}"),
        "h2late",
        &["--upstream-http2"],
    ));
    let upstream = Upstream::start_on(port);
    let body = json!({"amount": 9});
    let first = send(post_key(&proxy.at("/pay"), "hl-1", &body)).await;
    let retry = settled(post_key(&proxy.at("/pay"), "hl-1", &body)).await;
    let seen = upstream.seen("hl-1").await;
    assert!(
        !(retry.status == 409 && seen.is_empty()),
        "first {} {}; retry {} {}; the upstream saw {} request(s)\n{}",
        first.status,
        first.text(),
        retry.status,
        retry.text(),
        seen.len(),
        error_lines(&proxy)
    );
}

/// The h2 upstream acts on the request's stream, then sends `GOAWAY`
/// whose last stream id is that stream ("might have taken some action on",
/// RFC 9113 6.8) with the error code REFUSED_STREAM, and closes: the stream
/// fails with that code, but a connection's GOAWAY is not the stream's
/// `RST_STREAM(REFUSED_STREAM)`, and the key is not released (its retry
/// never runs the request again).
#[tokio::test(flavor = "multi_thread")]
async fn a_goaway_naming_the_stream_as_processed_does_not_release_the_key() {
    let (url, answered) = h2c_going_away(true).await;
    let proxy = Proxy::start(&memory(&url, "goaway-done", &["--upstream-http2"]));
    let body = json!({"amount": 22});
    let first = send(post_key(&proxy.at("/pay"), "gd-1", &body)).await;
    let retry = settled(post_key(&proxy.at("/pay"), "gd-1", &body)).await;
    assert!(
        answered.load(Ordering::SeqCst) <= 2,
        "the upstream processed the stream and said so (GOAWAY last = it); first {} {}, retry {} {}: streams processed {} (the check at start is one)\n{}",
        first.status,
        first.text(),
        retry.status,
        retry.text(),
        answered.load(Ordering::SeqCst),
        error_lines(&proxy)
    );
}
