//! The layer's hooks: the replay hook (replays only; a panic in it is a
//! clean 500) and a custom problem rendering (every problem with its kind,
//! `Retry-After` kept, the default rendering when it panics).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idemkit::Idempotency;
use serde_json::json;

use super::{layer_on, pg_store, send, serve_counting, spawn_server, RawReply};

/// The replay hook runs on replays only, never on the response of the
/// request that ran nor on problems; a panicking hook answers a 500
/// problem (no half-edited replay, no panic text) and never runs the
/// handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replay_hook_sees_replays_only_and_a_panic_is_a_clean_500() {
    use axum::http::HeaderValue;
    let runs = Arc::new(AtomicU64::new(0));
    let hooked = Arc::new(AtomicU64::new(0));
    let layer = {
        let hooked = hooked.clone();
        layer_on(Idempotency::new(pg_store().await)).on_replay(move |response, key| {
            hooked.fetch_add(1, Ordering::SeqCst);
            assert!(key.id().ends_with("/k") || key.id().ends_with("/boom"));
            response
                .headers_mut()
                .insert("x-replay-hook", HeaderValue::from_static("yes"));
            if key.id().ends_with("/boom") {
                *response.status_mut() = StatusCode::OK;
                panic!("secret-hook-text");
            }
        })
    };
    let url = serve_counting(layer, &runs).await;
    let t1 = |key| [("x-api-key", "t1"), ("idempotency-key", key)];

    let first = send(&url, &t1("k"), "text/plain", "a").await;
    assert_eq!(
        (first.status, first.headers.get("x-replay-hook")),
        (201, None)
    );
    assert_eq!(
        hooked.load(Ordering::SeqCst),
        0,
        "not on the executed response"
    );
    let again = send(&url, &t1("k"), "text/plain", "a").await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(
        again.headers.get("x-replay-hook").map(|v| v.as_bytes()),
        Some(&b"yes"[..])
    );
    let mismatch = send(&url, &t1("k"), "text/plain", "b").await;
    assert_eq!(
        (mismatch.status, mismatch.headers.get("x-replay-hook")),
        (422, None)
    );
    assert_eq!(hooked.load(Ordering::SeqCst), 1);

    let boom = send(&url, &t1("boom"), "text/plain", "a").await;
    assert_eq!(boom.status, 201, "the executed response: no hook");
    for _ in 0..2 {
        let r = send(&url, &t1("boom"), "text/plain", "a").await;
        let text = String::from_utf8_lossy(&r.body);
        assert_eq!(r.status, 500, "{text}");
        assert!(
            r.headers.get("x-replay-hook").is_none(),
            "nothing of the edited replay"
        );
        assert!(!r.replayed());
        assert!(
            !text.contains("secret-hook-text") && !text.contains("\"run\""),
            "{text}"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the handler ran once per key"
    );
}

/// A custom problem rendering gets every problem with its kind; the
/// layer keeps `Retry-After` on an in-progress 409; a panicking renderer
/// falls back to the default; a store error's text never reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_problem_rendering_gets_every_problem_and_falls_back_when_it_panics() {
    use axum::response::IntoResponse;
    use idemkit::http::Problem;
    let render = |problem: &Problem| {
        if problem.kind == idemkit::http::ProblemKind::CallerUnknown {
            panic!("renderer bug");
        }
        let body = json!({
            "code": problem.kind.as_str(),
            "message": problem.detail,
            "status": problem.status.as_u16(),
        });
        (problem.status, Json(body)).into_response()
    };
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(tokio::sync::Semaphore::new(0));
    let slow = {
        let (gate, entered) = (gate.clone(), entered.clone());
        post(move || {
            let (gate, entered) = (gate.clone(), entered.clone());
            async move {
                entered.add_permits(1);
                let _permit = gate.acquire().await;
                "done"
            }
        })
    };
    let layer = layer_on(Idempotency::new(pg_store().await))
        .max_body_bytes(8)
        .problem_response(render);
    let url = spawn_server(Router::new().route("/slow", slow).layer(layer)).await;
    let url = format!("{url}/slow");
    let code = |r: &RawReply| r.json()["code"].as_str().unwrap_or("").to_owned();

    let r = send(&url, &[("x-api-key", "t1")], "text/plain", "").await;
    assert_eq!((r.status, code(&r).as_str()), (400, "key_missing"));
    let r = send(
        &url,
        &[("x-api-key", "t1"), ("idempotency-key", "a b")],
        "text/plain",
        "",
    )
    .await;
    assert_eq!((r.status, code(&r).as_str()), (400, "key_malformed"));
    let r = send(
        &url,
        &[("x-api-key", "t1"), ("idempotency-key", "k")],
        "text/plain",
        "123456789",
    )
    .await;
    assert_eq!((r.status, code(&r).as_str()), (413, "body_too_large"));
    let r = send(&url, &[("idempotency-key", "k")], "text/plain", "").await;
    assert_eq!(
        r.status, 401,
        "the renderer panicked: the default rendering"
    );
    assert_eq!(
        r.headers.get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/problem+json"[..])
    );

    let h = [("x-api-key", "t1"), ("idempotency-key", "running")];
    let running = tokio::spawn({
        let url = url.clone();
        async move { send(&url, &h, "text/plain", "").await }
    });
    // The first request is in the handler: a duplicate now is in progress.
    let _entered = entered.acquire().await;
    let busy = send(&url, &h, "text/plain", "").await;
    assert_eq!(busy.status, 409);
    assert_eq!(code(&busy), "in_progress");
    assert!(
        busy.headers.get("retry-after").is_some(),
        "Retry-After is kept"
    );
    gate.add_permits(1);
    let done = running.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(done.status, 200);
    let r = send(&url, &h, "text/plain", "other").await;
    assert_eq!((r.status, code(&r).as_str()), (422, "mismatch"));
}
