//! Duplicates while the first request runs: 409 with `Retry-After`, one
//! execution, then the replay; a client that gives up and retries, with
//! the handler detached (it runs on and records) and not (it is cut off
//! and its key held until the lease ends).

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idemkit::Idempotency;
use serde_json::{json, Value};

use super::{api_key, layer_on, pg_store, post_json, post_until_done, serve, spawn_server};

/// Posts `body` for tenant `t1` with `key` from a client that gives up
/// after 500 ms, in a task of its own.
fn post_and_give_up(
    url: &str,
    key: &str,
    body: &Value,
) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(500))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let request = impatient
        .post(url)
        .header("idempotency-key", key)
        .header("x-api-key", "t1")
        .json(body);
    tokio::spawn(request.send())
}

/// 16 identical requests at once: one runs, the 15 others get 409 with
/// `Retry-After` while it runs, and a retry after it finished gets its
/// replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_identical_requests_run_once() {
    let server = serve().await;
    let slow = format!("{}/slow", server.url);
    let body = json!({ "amount": 500 });
    let requests: Vec<_> = (0..16)
        .map(|_| {
            let (slow, body) = (slow.clone(), body.clone());
            tokio::spawn(async move { post_json(&slow, Some("same"), "t1", &body).await })
        })
        .collect();
    // Every request but the one running waits for nothing: they come back
    // 409 while the handler holds the gate closed.
    let mut replies = Vec::new();
    let mut pending = requests;
    while replies.len() < 15 {
        let (done, _, rest) = futures::future::select_all(pending).await;
        replies.push(done.unwrap_or_else(|e| panic!("{e}")));
        pending = rest;
    }
    for r in &replies {
        assert_eq!(r.status, 409, "{:?}", r.body);
        assert_eq!(r.content_type(), "application/problem+json");
        assert!(
            r.headers.get("retry-after").is_some(),
            "409 says when to retry"
        );
    }
    server.app.gate.add_permits(1);
    let last = pending
        .pop()
        .unwrap_or_else(|| panic!("one request is left"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((last.status, last.replayed()), (201, false));
    assert_eq!(
        server.app.effects.load(Ordering::SeqCst),
        1,
        "one execution"
    );
    server.app.gate.add_permits(16);
    let r = post_json(&slow, Some("same"), "t1", &body).await;
    assert_eq!((r.status, r.replayed()), (201, true));
    assert_eq!(r.body, last.body);
}

/// A client that times out while its request runs, then retries with
/// the same key: the handler runs once, the retry gets 409 while it runs,
/// then the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_and_retries_does_not_run_the_handler_twice() {
    let executions = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let handler = {
        let (executions, gate) = (executions.clone(), gate.clone());
        move |axum::Extension(context): axum::Extension<idemkit::Context>,
              Json(body): Json<Value>| async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            let _ = started_tx.send(());
            let _permit = gate.acquire().await;
            (
                StatusCode::CREATED,
                Json(json!({
                    "execution": n,
                    "amount": body["amount"],
                    "attempt": context.attempt,
                    "fence": context.fence,
                })),
            )
        }
    };
    // A short lease: a handler cut off with its client would be taken
    // over (and run again) 2 s later.
    let idem = Idempotency::new(pg_store().await).lease(std::time::Duration::from_secs(2));
    let url = spawn_server(
        Router::new()
            .route("/slow", post(handler))
            .layer(layer_on(idem)),
    )
    .await;
    let url = format!("{url}/slow");
    let body = json!({ "amount": 42 });

    let first = post_and_give_up(&url, "gives-up", &body);
    started_rx
        .recv()
        .await
        .unwrap_or_else(|| panic!("the handler started"));
    let gave_up = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        gave_up.as_ref().is_err_and(|e| e.is_timeout()),
        "the client timed out: {gave_up:?}"
    );

    let r = post_json(&url, Some("gives-up"), "t1", &body).await;
    assert_eq!(r.status, 409, "still running: {:?}", r.body);
    assert!(r.headers.get("retry-after").is_some());

    // Enough permits for a second execution, so that one would show.
    gate.add_permits(100);
    let r = post_until_done(&url, "gives-up", "t1", &body).await;
    assert_eq!(
        (r.status, r.replayed()),
        (201, true),
        "the retry gets the replay: {:?}",
        r.body
    );
    assert_eq!(r.body["execution"], 1);
    assert_eq!(r.body["attempt"], 1, "the handler sees the idem Context");
    // The fence the store gave the run (its value is the store's).
    assert!(r.body["fence"].is_u64());
    assert_eq!(executions.load(Ordering::SeqCst), 1, "one execution");
}

/// `.detached(false)`: the handler runs in the request's future, so a
/// client that gives up cuts it off; its key is not released, but held
/// until its lease ends, and only then does a retry run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_detached_a_cut_off_handler_holds_its_key_until_the_lease_ends() {
    let executions = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let handler = {
        let (executions, gate) = (executions.clone(), gate.clone());
        move || async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            let _ = started_tx.send(());
            let _permit = gate.acquire().await;
            (StatusCode::CREATED, Json(json!({ "execution": n })))
        }
    };
    let idem = Idempotency::new(pg_store().await).lease(std::time::Duration::from_secs(2));
    let url = spawn_server(
        Router::new()
            .route("/slow", post(handler))
            .layer(layer_on(idem).detached(false)),
    )
    .await;
    let url = format!("{url}/slow");
    let body = json!({});
    let first = post_and_give_up(&url, "cut-off", &json!({}));
    started_rx
        .recv()
        .await
        .unwrap_or_else(|| panic!("the handler started"));
    let gave_up = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(gave_up.as_ref().is_err_and(|e| e.is_timeout()));
    let r = post_json(&url, Some("cut-off"), "t1", &body).await;
    assert_eq!(r.status, 409, "not released: {:?}", r.body);
    gate.add_permits(100);
    let r = post_until_done(&url, "cut-off", "t1", &body).await;
    assert_eq!(
        (r.status, r.replayed()),
        (201, false),
        "after the lease, a takeover runs it again"
    );
    assert_eq!(r.body["execution"], 2);
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

/// The executor waits on in-progress keys (`idemkit::InProgressPolicy::Wait`, the
/// configuration the layer's docs show). Request R1 runs; its completions
/// fail (the store stays reachable, as in `outages::a_different_body_...`)
/// until its 1 s lease ends: `Unrecorded`, the key goes into the layer's
/// finishing set and its finisher keeps trying. R2, the same request sent
/// while R1 ran, passed the finishing check before the key was held and
/// is in the executor's wait: it waits without asking the store while the
/// key is held (its first poll after the lease took the key over and ran
/// the handler a second time, on the same instance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_on_a_key_being_finished_gets_its_replay_never_a_second_run() {
    let redis = idemkit::redis::RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = Arc::new(idemkit::testkit::Tap::new(redis));
    let idem = Idempotency::from_arc(store.clone())
        .lease(std::time::Duration::from_secs(1))
        .on_in_progress(idemkit::InProgressPolicy::Wait {
            max_wait: std::time::Duration::from_secs(10),
            poll: std::time::Duration::from_millis(100),
        });
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, store) = (effects.clone(), store.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                // Every completion fails from now on (until the test ends).
                store.fail_completes(usize::MAX);
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new().route("/payments", post(handler)).layer(
        idemkit::http::IdempotencyLayer::new(idem.clone())
            .scope(format!("http.{:08x}", fastrand::u32(..)))
            .unwrap_or_else(|e| panic!("{e}"))
            .tenant(api_key),
    );
    let url = format!("{}/payments", spawn_server(router).await);
    let first = tokio::spawn({
        let url = url.clone();
        async move { post_json(&url, Some("k-wait"), "t1", &json!({"amount": 1})).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let second = post_json(&url, Some("k-wait"), "t1", &json!({"amount": 1})).await;
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    store.fail_completes(0);
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the handler ran twice on one instance: first {} {:?}, second {} {:?}",
        first.status,
        first.body,
        second.status,
        second.body
    );
}

/// `Retry-After` on a 409 is the running request's remaining lease (most
/// of the 60 s default, the heartbeat renewing it) unless the layer caps
/// it: with `max_retry_after(1 s)` it says 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_the_remaining_lease_unless_capped() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let handler = {
        let gate = gate.clone();
        move || async move {
            let _ = started_tx.send(());
            // One permit lets one run end (it is not given back).
            if let Ok(permit) = gate.acquire().await {
                permit.forget();
            }
            StatusCode::CREATED
        }
    };
    let store = pg_store().await;
    let router = Router::new().route("/slow", post(handler));
    let uncapped = spawn_server(
        router
            .clone()
            .layer(layer_on(Idempotency::new(store.clone()))),
    )
    .await;
    let capped = spawn_server(router.layer(
        layer_on(Idempotency::new(store)).max_retry_after(std::time::Duration::from_secs(1)),
    ))
    .await;
    let body = json!({ "amount": 1 });
    let key = format!("retry-after-{:08x}", fastrand::u32(..));
    for (url, key, want) in [
        (uncapped, format!("{key}-a"), None),
        (capped, format!("{key}-b"), Some("1")),
    ] {
        let url = format!("{url}/slow");
        let first = {
            let (url, key, body) = (url.clone(), key.clone(), body.clone());
            tokio::spawn(async move { post_json(&url, Some(&key), "t1", &body).await })
        };
        started_rx
            .recv()
            .await
            .unwrap_or_else(|| panic!("the handler started"));
        let r = post_json(&url, Some(&key), "t1", &body).await;
        assert_eq!(r.status, 409, "{:?}", r.body);
        let after = r
            .headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("409 says when to retry"))
            .to_owned();
        match want {
            Some(want) => assert_eq!(after, want, "capped"),
            None => {
                let seconds: u64 = after.parse().unwrap_or_else(|e| panic!("{after}: {e}"));
                assert!(
                    (50..=60).contains(&seconds),
                    "the remaining lease: {seconds}"
                );
            }
        }
        gate.add_permits(1);
        let done = first.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(done.status, 201);
    }
}
