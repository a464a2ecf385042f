//! What the layer records and replays: the status code of each outcome,
//! the recording policy (a panicking one included), headers per caller,
//! responses over the store's or the layer's limit (delivered in full,
//! not replayable), event streams never buffered, and builder settings
//! that stay with the layer they were set on.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use idemkit::postgres::PgStore;
use idemkit::Idempotency;
use serde_json::json;

use super::{
    assert_not_replayable, layer_on, pg_store, post_json, post_raw, send, serve, spawn_server,
    RawReply,
};

/// Each outcome's status: 400 without a key or with a malformed one, the
/// handler's status and headers on the first run and on the replay (a
/// quoted key is the same key), 422 for another body with the same key,
/// 413 over the body limit (nothing stored), a 4xx recorded and replayed,
/// a 5xx passed through and released, a GET passed through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_outcome_gets_its_status_code_and_only_what_is_recorded_replays() {
    let server = serve().await;
    let payments = format!("{}/payments", server.url);
    let effects = || server.app.effects.load(Ordering::SeqCst);
    let body = json!({ "amount": 1200 });

    let r = post_json(&payments, None, "t1", &body).await;
    assert_eq!(
        (r.status, r.content_type()),
        (400, "application/problem+json"),
        "no key: {:?}",
        r.body
    );
    let r = post_json(&payments, Some("has space"), "t1", &body).await;
    assert_eq!(r.status, 400, "a malformed key");
    assert_eq!(effects(), 0);

    let first = post_json(&payments, Some("k-1"), "t1", &body).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(
        first.headers.get("location").map(|v| v.as_bytes()),
        Some(&b"/payments/1"[..])
    );
    let again = post_json(&payments, Some("\"k-1\""), "t1", &body).await;
    assert_eq!(again.status, 201, "a quoted key is the same key");
    assert!(again.replayed(), "Idempotent-Replayed: true");
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers.get("location"), first.headers.get("location"));
    assert_eq!(effects(), 1, "the retry did not run the handler");

    let other = post_json(&payments, Some("k-1"), "t1", &json!({ "amount": 9999 })).await;
    assert_eq!(
        (other.status, other.content_type()),
        (422, "application/problem+json")
    );
    assert_eq!(effects(), 1);

    let big = json!({ "amount": 1, "note": "x".repeat(2048) });
    let r = post_json(&payments, Some("k-big"), "t1", &big).await;
    assert_eq!(
        (r.status, r.content_type()),
        (413, "application/problem+json")
    );
    assert_eq!(effects(), 1, "a body over the limit runs nothing");
    let r = post_json(&payments, Some("k-big"), "t1", &body).await;
    assert_eq!(
        (r.status, r.replayed()),
        (201, false),
        "and stores nothing: the key is free"
    );
    assert_eq!(effects(), 2);

    let declined = format!("{}/declined", server.url);
    let r = post_json(&declined, Some("k-402"), "t1", &body).await;
    assert_eq!((r.status, r.replayed()), (402, false));
    let r = post_json(&declined, Some("k-402"), "t1", &body).await;
    assert_eq!(
        (r.status, r.replayed()),
        (402, true),
        "a 4xx is recorded and replayed"
    );
    assert_eq!(effects(), 3);

    let flaky = format!("{}/flaky", server.url);
    let r = post_json(&flaky, Some("k-503"), "t1", &body).await;
    assert_eq!(
        (r.status, r.replayed()),
        (503, false),
        "a 5xx is passed through"
    );
    let r = post_json(&flaky, Some("k-503"), "t1", &body).await;
    assert_eq!(
        (r.status, r.replayed()),
        (201, false),
        "and released: the retry runs"
    );
    let r = post_json(&flaky, Some("k-503"), "t1", &body).await;
    assert_eq!((r.status, r.replayed()), (201, true));

    let text = reqwest::get(&payments)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(text, "a GET passes through");
}

/// The default recording policy: everything but 401, 408, 425, 429,
/// 502, 503, 504 is recorded; a 500 and a 303 are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_policy_records_500_and_303_and_releases_429() {
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move |axum::extract::Path(code): axum::extract::Path<u16>| async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT);
            let mut headers = HeaderMap::new();
            headers.insert(
                "location",
                axum::http::HeaderValue::from_static("/elsewhere"),
            );
            (status, headers, Json(json!({ "execution": n })))
        }
    };
    let url = spawn_server(
        Router::new()
            .route("/status/{code}", post(handler))
            .layer(layer_on(Idempotency::new(pg_store().await))),
    )
    .await;
    let runs = || executions.load(Ordering::SeqCst);
    let body = json!({});
    for (code, recorded) in [
        (500, true),
        (303, true),
        (201, true),
        (404, true),
        (409, true),
        (401, false),
        (408, false),
        (425, false),
        (429, false),
        (502, false),
        (503, false),
        (504, false),
    ] {
        let at = format!("{url}/status/{code}");
        let key = format!("policy-{code}");
        let before = runs();
        let first = post_json(&at, Some(&key), "t1", &body).await;
        assert_eq!((first.status, first.replayed()), (code, false));
        let second = post_json(&at, Some(&key), "t1", &body).await;
        assert_eq!(second.status, code);
        if recorded {
            assert!(second.replayed(), "{code} is recorded and replayed");
            assert_eq!(second.body, first.body);
            assert_eq!(runs(), before + 1, "{code}: one execution");
        } else {
            assert!(!second.replayed(), "{code} releases the key");
            assert_eq!(runs(), before + 2, "{code}: the retry runs again");
        }
    }
}

/// A recording policy that panics once the handler ran records (a
/// release could run the handler twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_record_policy_records_the_response() {
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move || async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, Json(json!({ "execution": n })))
        }
    };
    let layer = layer_on(Idempotency::new(pg_store().await)).record_status(|status| {
        assert_ne!(status, StatusCode::CREATED, "a policy with a bug");
        true
    });
    let url = spawn_server(Router::new().route("/x", post(handler)).layer(layer)).await;
    let url = format!("{url}/x");
    let first = post_json(&url, Some("p"), "t1", &json!({})).await;
    let again = post_json(&url, Some("p"), "t1", &json!({})).await;
    assert_eq!(
        (first.status, again.status, again.replayed()),
        (201, 201, true)
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// A response the store refuses (over its size limit) is not released:
/// the caller gets it, a duplicate gets 409 "not recorded", the handler
/// runs once. A text body is recorded as text (no base64 inflation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_store_refuses_is_not_released_and_text_is_not_inflated() {
    let pool = support::pg::pool(support::pg::shared_url(), 8).await;
    let store = PgStore::builder(pool)
        .max_response_bytes(4096)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move |axum::extract::Path(size): axum::extract::Path<usize>| async move {
            executions.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "x".repeat(size))
        }
    };
    let url = spawn_server(
        Router::new()
            .route("/text/{size}", post(handler))
            .layer(layer_on(Idempotency::new(store))),
    )
    .await;

    // 3,500 bytes of text: 4,668 in base64, over the store's 4,096.
    let at = format!("{url}/text/3500");
    let first = post_raw(&at, "fits", Some("t1"), "text/plain", "").await;
    assert_eq!((first.status, first.body.len()), (201, 3500));
    let again = post_raw(&at, "fits", Some("t1"), "text/plain", "").await;
    assert_eq!(
        (again.status, again.replayed()),
        (201, true),
        "{}",
        String::from_utf8_lossy(&again.body)
    );
    assert_eq!(again.body, first.body);
    assert_eq!(executions.load(Ordering::SeqCst), 1);

    let at = format!("{url}/text/8000");
    let first = post_raw(&at, "too-big", Some("t1"), "text/plain", "").await;
    assert_eq!(
        (first.status, first.body.len()),
        (201, 8000),
        "the caller gets its response"
    );
    for _ in 0..2 {
        let again = post_raw(&at, "too-big", Some("t1"), "text/plain", "").await;
        assert_not_replayable(&again);
    }
    assert_eq!(executions.load(Ordering::SeqCst), 2, "never run twice");
}

/// The caller whose request ran gets the handler's response unchanged;
/// only the recorded copy drops per-caller headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_caller_gets_every_header_and_the_replay_drops_per_caller_ones() {
    let handler = || async {
        let mut headers = HeaderMap::new();
        let mut add = |name: &'static str, value: &[u8]| {
            headers.append(
                name,
                axum::http::HeaderValue::from_bytes(value).unwrap_or_else(|e| panic!("{e}")),
            );
        };
        add("set-cookie", b"session=abc; HttpOnly");
        add("set-cookie", b"theme=dark");
        add("x-multi", b"one");
        add("x-multi", b"two");
        add("x-latin1", b"caf\xe9");
        add("x-utf8", "café ☕".as_bytes());
        add("cache-control", b"no-store");
        (StatusCode::CREATED, headers, "created")
    };
    let url = spawn_server(
        Router::new()
            .route("/headers", post(handler))
            .layer(layer_on(Idempotency::new(pg_store().await))),
    )
    .await;
    let url = format!("{url}/headers");
    let all = |r: &RawReply, name: &str| -> Vec<Vec<u8>> {
        r.headers
            .get_all(name)
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect()
    };
    let first = post_raw(&url, "h", Some("t1"), "text/plain", "").await;
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!(
        all(&first, "set-cookie"),
        vec![b"session=abc; HttpOnly".to_vec(), b"theme=dark".to_vec()]
    );
    assert_eq!(
        all(&first, "x-multi"),
        vec![b"one".to_vec(), b"two".to_vec()]
    );
    assert_eq!(all(&first, "x-latin1"), vec![b"caf\xe9".to_vec()]);
    assert_eq!(all(&first, "x-utf8"), vec!["café ☕".as_bytes().to_vec()]);
    assert_eq!(all(&first, "cache-control"), vec![b"no-store".to_vec()]);

    let again = post_raw(&url, "h", Some("t1"), "text/plain", "").await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert!(
        all(&again, "set-cookie").is_empty(),
        "another caller's cookies are never replayed"
    );
    assert_eq!(
        all(&again, "x-multi"),
        vec![b"one".to_vec(), b"two".to_vec()]
    );
    assert_eq!(all(&again, "x-latin1"), vec![b"caf\xe9".to_vec()]);
    assert_eq!(all(&again, "x-utf8"), vec!["café ☕".as_bytes().to_vec()]);
    assert_eq!(again.body, b"created");
}

/// A body over the response limit (default 1 MiB) reaches its caller in
/// full, streamed; the key completes as not replayable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_the_limit_reaches_the_caller_in_full_and_is_not_replayable() {
    const SIZE: usize = 3 << 20;
    let pattern = |i: usize| (i % 251) as u8;
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move || async move {
            executions.fetch_add(1, Ordering::SeqCst);
            let chunks = (0..SIZE / 65536).map(move |c| {
                Ok::<_, std::io::Error>(
                    (c * 65536..(c + 1) * 65536)
                        .map(pattern)
                        .collect::<Vec<u8>>(),
                )
            });
            (
                StatusCode::CREATED,
                axum::body::Body::from_stream(futures::stream::iter(chunks)),
            )
        }
    };
    let url = spawn_server(
        Router::new()
            .route("/big", post(handler))
            .layer(layer_on(Idempotency::new(pg_store().await))),
    )
    .await;
    let url = format!("{url}/big");
    let first = post_raw(&url, "big", Some("t1"), "text/plain", "").await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), SIZE, "every byte");
    assert!(first.body.iter().enumerate().all(|(i, &b)| b == pattern(i)));
    let again = post_raw(&url, "big", Some("t1"), "text/plain", "").await;
    assert_not_replayable(&again);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// A `text/event-stream` response is streamed at once, never buffered:
/// its first event reaches the client while the stream is still open, and
/// the key is completed as not replayable at once (no lease held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_is_streamed_not_buffered() {
    use futures::StreamExt;
    let (rest_tx, rest_rx) = tokio::sync::oneshot::channel::<()>();
    let rest_rx = Arc::new(std::sync::Mutex::new(Some(rest_rx)));
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move || async move {
            executions.fetch_add(1, Ordering::SeqCst);
            let rest = rest_rx.lock().ok().and_then(|mut r| r.take());
            let first = futures::stream::once(async { Ok::<_, std::io::Error>("data: first\n\n") });
            let second = futures::stream::once(async move {
                if let Some(rest) = rest {
                    let _ = rest.await;
                }
                Ok("data: second\n\n")
            });
            (
                [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
                axum::body::Body::from_stream(first.chain(second)),
            )
        }
    };
    let url = spawn_server(
        Router::new()
            .route("/events", post(handler))
            .layer(layer_on(Idempotency::new(pg_store().await))),
    )
    .await;
    let url = format!("{url}/events");
    let wait = std::time::Duration::from_secs(10);
    let mut stream = tokio::time::timeout(
        wait,
        reqwest::Client::new()
            .post(&url)
            .header("idempotency-key", "sse")
            .header("x-api-key", "t1")
            .header("content-type", "text/plain")
            .send(),
    )
    .await
    .unwrap_or_else(|_| panic!("no response head within {wait:?}: the stream was buffered"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stream.status(), 200);
    let chunk = tokio::time::timeout(wait, stream.chunk())
        .await
        .unwrap_or_else(|_| panic!("no first event within {wait:?}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(chunk.as_deref(), Some(&b"data: first\n\n"[..]));

    // The stream is still open: its key is already completed.
    let again = post_raw(&url, "sse", Some("t1"), "text/plain", "").await;
    assert_not_replayable(&again);

    let _ = rest_tx.send(());
    let mut rest = Vec::new();
    while let Some(chunk) = stream.chunk().await.unwrap_or_else(|e| panic!("{e}")) {
        rest.extend_from_slice(&chunk);
    }
    assert_eq!(rest, b"data: second\n\n");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// A response whose body is still coming when the handler returns (NDJSON,
/// one line now and one later) reaches its caller as it comes: the head
/// and the first line while the second is not written yet. The key stays
/// in progress while the body streams (a duplicate gets 409), and once the
/// body ended within the limit, its copy is recorded: a duplicate gets
/// the whole body replayed. The handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_reaches_its_caller_as_it_comes_and_is_recorded() {
    use futures::StreamExt;
    let (rest_tx, rest_rx) = tokio::sync::oneshot::channel::<()>();
    let rest_rx = Arc::new(std::sync::Mutex::new(Some(rest_rx)));
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move || async move {
            executions.fetch_add(1, Ordering::SeqCst);
            let rest = rest_rx.lock().ok().and_then(|mut r| r.take());
            let first = futures::stream::once(async { Ok::<_, std::io::Error>("{\"line\":1}\n") });
            let second = futures::stream::once(async move {
                if let Some(rest) = rest {
                    let _ = rest.await;
                }
                Ok("{\"line\":2}\n")
            });
            (
                StatusCode::CREATED,
                [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
                axum::body::Body::from_stream(first.chain(second)),
            )
        }
    };
    let url = spawn_server(
        Router::new()
            .route("/lines", post(handler))
            .layer(layer_on(Idempotency::new(pg_store().await))),
    )
    .await;
    let url = format!("{url}/lines");
    let wait = std::time::Duration::from_secs(10);
    let mut stream = tokio::time::timeout(
        wait,
        reqwest::Client::new()
            .post(&url)
            .header("idempotency-key", "ndjson")
            .header("x-api-key", "t1")
            .header("content-type", "text/plain")
            .send(),
    )
    .await
    .unwrap_or_else(|_| panic!("no response head within {wait:?}: the stream was held back"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stream.status(), 201);
    let chunk = tokio::time::timeout(wait, stream.chunk())
        .await
        .unwrap_or_else(|_| panic!("no first line within {wait:?}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(chunk.as_deref(), Some(&b"{\"line\":1}\n"[..]));

    // Still streaming: the key is in progress.
    let during = post_raw(&url, "ndjson", Some("t1"), "text/plain", "").await;
    assert_eq!(during.status, 409, "a duplicate while the body streams");

    let _ = rest_tx.send(());
    let mut rest = Vec::new();
    while let Some(chunk) = stream.chunk().await.unwrap_or_else(|e| panic!("{e}")) {
        rest.extend_from_slice(&chunk);
    }
    assert_eq!(rest, b"{\"line\":2}\n");
    // Recorded once the body ended (its completion is one store call).
    let deadline = std::time::Instant::now() + wait;
    let replay = loop {
        let again = post_raw(&url, "ndjson", Some("t1"), "text/plain", "").await;
        if again.status != 409 {
            break again;
        }
        assert!(std::time::Instant::now() < deadline, "never recorded");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!(&replay.body[..], b"{\"line\":1}\n{\"line\":2}\n");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

/// A builder method called on a clone of a layer (here the recording
/// policy) does not panic and changes the clone only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_builder_method_on_a_clone_changes_the_clone_only() {
    let base = layer_on(Idempotency::new(pg_store().await));
    let strict = base.clone().record_status(|s| s.is_success());
    let handler = || async { (StatusCode::NOT_FOUND, "nothing here") };
    let url = spawn_server(
        Router::new()
            .route("/base", post(handler).layer(base))
            .route("/strict", post(handler).layer(strict)),
    )
    .await;
    let at = |p: &str| format!("{url}{p}");
    let _ = post_raw(&at("/base"), "c", Some("t1"), "text/plain", "").await;
    let r = post_raw(&at("/base"), "c", Some("t1"), "text/plain", "").await;
    assert_eq!(
        (r.status, r.replayed()),
        (404, true),
        "the original records 404"
    );
    let _ = post_raw(&at("/strict"), "c", Some("t1"), "text/plain", "").await;
    let r = post_raw(&at("/strict"), "c", Some("t1"), "text/plain", "").await;
    assert_eq!((r.status, r.replayed()), (404, false), "the clone does not");
}

/// A response that varies on a request header (`Vary: Accept-Encoding`)
/// is replayed only to a duplicate that sends the same value: one asking
/// for another encoding gets 422 (never a gzip body it cannot read), and
/// a response with `Vary: *` is not replayable (409, never run again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_varies_is_replayed_only_to_a_request_that_matches_it() {
    let runs = Arc::new(AtomicU64::new(0));
    let negotiated = {
        let runs = runs.clone();
        move |headers: HeaderMap| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let gzip = headers
                    .get("accept-encoding")
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.contains("gzip"));
                let encoding = if gzip { "gzip" } else { "identity" };
                (
                    StatusCode::CREATED,
                    [("vary", "Accept-Encoding"), ("x-encoding", encoding)],
                    encoding.to_owned(),
                )
            }
        }
    };
    let everything = {
        let runs = runs.clone();
        move || {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, [("vary", "*")], "any")
            }
        }
    };
    let router = Router::new()
        .route("/negotiated", post(negotiated))
        .route("/everything", post(everything))
        .layer(layer_on(Idempotency::new(idemkit::MemoryStore::new())));
    let url = spawn_server(router).await;
    let with = |encoding: &'static str| {
        [
            ("x-api-key", "t1"),
            ("idempotency-key", "k-vary"),
            ("accept-encoding", encoding),
        ]
    };
    let ct = "application/json";
    let first = send(&format!("{url}/negotiated"), &with("gzip"), ct, "{}").await;
    assert_eq!((first.status, first.body.as_slice()), (201, &b"gzip"[..]));
    let other = send(&format!("{url}/negotiated"), &with("identity"), ct, "{}").await;
    assert_eq!(
        other.status,
        422,
        "replayed to a caller that did not negotiate it: {}",
        String::from_utf8_lossy(&other.body)
    );
    let same = send(&format!("{url}/negotiated"), &with("gzip"), ct, "{}").await;
    assert!(same.replayed() && same.body == first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let first = send(&format!("{url}/everything"), &with("gzip"), ct, "{}").await;
    let again = send(&format!("{url}/everything"), &with("gzip"), ct, "{}").await;
    assert_eq!((first.status, again.status), (201, 409));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Markers a handler puts on its response decide over the status:
/// `NothingHappened` releases a 201 (the retry runs), `NotReplayable`
/// completes a 200 "not replayable" (the retry gets 409, never a run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_markers_release_or_complete_whatever_the_status() {
    use axum::response::IntoResponse;
    let runs = Arc::new(AtomicU64::new(0));
    let marked = |nothing: bool| {
        let runs = runs.clone();
        post(move || {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let mut response = if nothing {
                    StatusCode::CREATED.into_response()
                } else {
                    StatusCode::OK.into_response()
                };
                if nothing {
                    response
                        .extensions_mut()
                        .insert(idemkit::http::NothingHappened);
                } else {
                    response
                        .extensions_mut()
                        .insert(idemkit::http::NotReplayable::new(
                            "the effects' answer is lost",
                        ));
                }
                response
            }
        })
    };
    let url = spawn_server(
        Router::new()
            .route("/nothing", marked(true))
            .route("/lost", marked(false))
            .layer(layer_on(Idempotency::new(pg_store().await))),
    )
    .await;
    let nothing = format!("{url}/nothing");
    for run in 1..=2 {
        let r = post_raw(&nothing, "m-1", Some("t1"), "application/json", "{}").await;
        assert_eq!((r.status, r.replayed()), (201, false), "run {run}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "released: the retry ran");
    let lost = format!("{url}/lost");
    let r = post_raw(&lost, "m-2", Some("t1"), "application/json", "{}").await;
    assert_eq!(r.status, 200);
    let mut retry = post_raw(&lost, "m-2", Some("t1"), "application/json", "{}").await;
    for _ in 0..100 {
        if retry.headers.get("retry-after").is_none() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        retry = post_raw(&lost, "m-2", Some("t1"), "application/json", "{}").await;
    }
    assert_eq!(retry.status, 409, "not replayable");
    assert_eq!(runs.load(Ordering::SeqCst), 3, "never run again");
}

/// A handler whose `Content-Length` does not say its body's length: the
/// caller gets the body whole under its true length (never cut, never
/// left on the connection as the next answer), and so does the replay.
#[tokio::test(flavor = "multi_thread")]
async fn a_recorded_body_is_framed_by_its_length_whatever_the_handler_said() {
    let handler = || async {
        let mut headers = HeaderMap::new();
        headers.insert(
            "content-length",
            "3".parse().unwrap_or_else(|e| panic!("{e}")),
        );
        (StatusCode::CREATED, headers, "hello, world")
    };
    let url = spawn_server(
        Router::new()
            .route("/pay", post(handler))
            .layer(layer_on(Idempotency::new(idemkit::MemoryStore::new()))),
    )
    .await;
    let url = format!("{url}/pay");
    for replayed in [false, true] {
        let reply = post_raw(&url, "cl-1", Some("t1"), "application/json", "{}").await;
        assert_eq!(reply.replayed(), replayed);
        assert_eq!(reply.body, b"hello, world");
        assert_eq!(
            reply
                .headers
                .get("content-length")
                .map(|v| v.as_bytes().to_vec()),
            Some(b"12".to_vec())
        );
    }
}

/// The answer to a `HEAD` (a layer on every method): its replay keeps
/// the `Content-Length` its caller got, the length of what a `GET` would
/// get.
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_head_keeps_its_content_length() {
    let handler = || async {
        let mut headers = HeaderMap::new();
        headers.insert(
            "content-length",
            "1234".parse().unwrap_or_else(|e| panic!("{e}")),
        );
        (StatusCode::OK, headers)
    };
    let url = spawn_server(
        Router::new()
            .fallback(handler)
            .layer(layer_on(Idempotency::new(idemkit::MemoryStore::new())).every_method()),
    )
    .await;
    let client = reqwest::Client::new();
    for replayed in [false, true] {
        let reply = client
            .head(format!("{url}/doc"))
            .header("idempotency-key", "head-1")
            .header("x-api-key", "t1")
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            reply.headers().contains_key("idempotent-replayed"),
            replayed
        );
        assert_eq!(
            reply
                .headers()
                .get("content-length")
                .map(|v| v.as_bytes().to_vec()),
            Some(b"1234".to_vec()),
            "replayed: {replayed}"
        );
    }
}
