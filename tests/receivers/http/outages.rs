//! The store failing: unreachable before a run (503 with `Retry-After`,
//! nothing runs), down or refusing completions after the handler ran (the
//! response still reaches its caller, is recorded once the store is back
//! with the run's own lease, and no retry runs the handler again), and
//! store errors never echoed to the client.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idemkit::http::{IdempotencyLayer, Problem, ProblemKind};
use idemkit::postgres::PgStore;
use idemkit::testkit::Tap;
use idemkit::Idempotency;
use serde_json::json;

use super::{api_key, layer_on, post_json, post_raw, spawn_server};

/// The store unreachable: 503 with `Retry-After` and a detail that names
/// nothing of the store, and the handler never runs; once the store is
/// back, the request runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_down_is_503_with_retry_after_and_runs_nothing() {
    let redis = support::redis_server::RedisServer::start(&[]);
    let store = idemkit::redis::RedisStore::connect(&redis.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(std::time::Duration::from_millis(300));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let effects = effects.clone();
        move || async move {
            effects.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "created")
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(Idempotency::new(store)).tenant(api_key));
    let url = format!("{}/payments", spawn_server(router).await);
    redis.kill();
    let r = post_json(&url, Some("k-down"), "t1", &json!({})).await;
    assert_eq!(
        (r.status, r.content_type()),
        (503, "application/problem+json"),
        "{:?}",
        r.body
    );
    assert!(r.headers.get("retry-after").is_some());
    let detail = r.body["detail"].as_str().unwrap_or("").to_lowercase();
    for internal in [
        "unavailable:",
        "redis",
        "connection",
        "timed out",
        "os error",
        "refused",
    ] {
        assert!(
            !detail.contains(internal),
            "the store's error is not echoed: {detail}"
        );
    }
    assert_eq!(
        effects.load(Ordering::SeqCst),
        0,
        "nothing runs without a reservation"
    );
    redis.start_again();
    // The client honours Retry-After: the store's connection comes back
    // in the background, and until it has, the answer is still 503.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    let r = loop {
        let r = post_json(&url, Some("k-down"), "t1", &json!({})).await;
        if r.status != 503 || tokio::time::Instant::now() > deadline {
            break r;
        }
        assert_eq!(effects.load(Ordering::SeqCst), 0, "a 503 ran the handler");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(r.status, 201, "after the outage the request runs");
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

/// The store goes away right after the handler's effect, for 3 s, three
/// times the 1 s lease: the executor gives up recording the response
/// (`IdemError::Unrecorded`). The client still gets the handler's 201; a
/// retry meanwhile gets 409 from the layer itself; the layer writes the
/// completion with the same lease once the store is back, so a retry then
/// gets the replay, and the effect ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_past_the_lease_while_recording_never_runs_the_handler_twice() {
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let idem = Idempotency::new(store).lease(std::time::Duration::from_secs(1));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                support::flaky::outage(&down, std::time::Duration::from_secs(3));
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let url = format!("{}/payments", spawn_server(router).await);
    let first = post_json(&url, Some("k-outage"), "t1", &json!({})).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // A retry while the response is still to be written: 409 from the
    // layer itself, the store not asked (after the lease it would let the
    // retry take the key over).
    let during = post_json(&url, Some("k-outage"), "t1", &json!({})).await;
    assert_eq!(during.status, 409, "{:?}", during.body);
    // Once the store is back, the completion is written (awaited, 20 s).
    let key = idemkit::http::request_key("http", "t1", "POST", "/payments", "k-outage")
        .unwrap_or_else(|e| panic!("{e}"));
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        if !down.load(Ordering::SeqCst) {
            if let Ok(Some(record)) = idem.get(&key).await {
                if record.is_completed() {
                    break;
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the response was never recorded after the store came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let again = post_json(&url, Some("k-outage"), "t1", &json!({})).await;
    assert_eq!(
        (again.status, effects.load(Ordering::SeqCst)),
        (201, 1),
        "{:?}",
        again.body
    );
    assert_eq!(again.body, first.body, "the retry gets the first response");
}

/// The same outage, but the client gives up after 200 ms, long before the
/// executor does: its request's future is dropped while the handler's
/// detached task still tries to record. The task itself holds the key
/// finishing and writes the completion once the store is back, so every
/// retry afterwards gets 409 or the replay of the one run, never a second
/// run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_an_unrecorded_response_never_gets_the_handler_run_twice() {
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let idem = Idempotency::new(store).lease(std::time::Duration::from_secs(1));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                support::flaky::outage(&down, std::time::Duration::from_secs(3));
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let url = format!("{}/payments", spawn_server(router).await);
    let gone = tokio::time::timeout(
        std::time::Duration::from_millis(200),
        post_json(&url, Some("k-gone"), "t1", &json!({})),
    )
    .await;
    assert!(
        gone.is_err(),
        "the client was to give up first: {:?}",
        gone.map(|r| r.status)
    );
    // Retries as a client would, through the outage and after it, until
    // one is answered with the run's response.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let replay = loop {
        let r = post_json(&url, Some("k-gone"), "t1", &json!({})).await;
        assert_eq!(
            effects.load(Ordering::SeqCst),
            1,
            "a retry ran the handler again: {} {:?}",
            r.status,
            r.body
        );
        if r.status == 201 {
            break r;
        }
        assert!(
            matches!(r.status, 409 | 503),
            "a retry while finishing: {} {:?}",
            r.status,
            r.body
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the response was never recorded after the store came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(
        replay.body,
        json!("payment 1"),
        "the replay is the one run's"
    );
}

/// The store stays away past the 1 s lease after the handler ran, and
/// once it is back it refuses the completion for good (a non-retryable
/// error): the layer gives up recording the response. The handler ran, so
/// every retry at this instance afterwards gets 409 "not recorded" from
/// the layer itself, never a takeover of the expired lease that runs it
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_store_refuses_after_an_outage_is_never_run_again() {
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(std::time::Duration::from_secs(1));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                refuse.store(true, Ordering::SeqCst);
                support::flaky::outage(&down, std::time::Duration::from_millis(2500));
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let url = format!("{}/payments", spawn_server(router).await);
    let first = post_json(&url, Some("k-refused"), "t1", &json!({})).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // Retries through the outage and after it, until the layer stops
    // answering "in progress" (its finisher was refused).
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let settled = loop {
        let r = post_json(&url, Some("k-refused"), "t1", &json!({})).await;
        assert_eq!(
            effects.load(Ordering::SeqCst),
            1,
            "a retry ran the handler again: {} {:?}",
            r.status,
            r.body
        );
        let in_progress = Problem::new(ProblemKind::InProgress).title;
        if !(r.status == 409 && r.body["title"] == json!(in_progress)) {
            break r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still in progress 20 s later: {:?}",
            r.body
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(
        (settled.status, &settled.body["title"]),
        (409, &json!(Problem::new(ProblemKind::NotRecorded).title)),
        "{:?}",
        settled.body
    );
    // And it stays so, the store answering and the lease long over.
    let again = post_json(&url, Some("k-refused"), "t1", &json!({})).await;
    assert_eq!(
        (again.status, effects.load(Ordering::SeqCst)),
        (409, 1),
        "{:?}",
        again.body
    );
}

/// A request waits (`InProgressPolicy::Wait`) on a key whose response the
/// layer is finishing after an outage; the store then refuses that
/// completion for good. The waiting request is answered 409 "not
/// recorded" (and so is a later one): it never takes the expired lease
/// over to run the handler again. On MemoryStore and on Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_never_runs_a_key_whose_response_was_given_up() {
    waiting_on_a_refused_key(idemkit::MemoryStore::new(), "k-wait-refused").await;
    let redis = idemkit::redis::RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let key = format!("k-wait-refused-{:08x}", fastrand::u32(..));
    waiting_on_a_refused_key(redis, &key).await;
}

async fn waiting_on_a_refused_key<S: idemkit::IdempotencyStore>(inner: S, key: &str) {
    let (flaky, _down) = support::flaky::FlakyStore::new(inner);
    let refuse = flaky.refuse_completes.clone();
    let store = Arc::new(Tap::new(flaky));
    let idem = Idempotency::from_arc(store.clone())
        .lease(std::time::Duration::from_secs(1))
        .on_in_progress(idemkit::InProgressPolicy::Wait {
            max_wait: std::time::Duration::from_secs(20),
            poll: std::time::Duration::from_millis(100),
        });
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, store) = (effects.clone(), store.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                // Completions fail (retryably) until the test says.
                store.fail_completes(usize::MAX);
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let url = format!("{}/payments", spawn_server(router).await);
    let first = tokio::spawn({
        let (url, key) = (url.clone(), key.to_owned());
        async move { post_json(&url, Some(&key), "t1", &json!({})).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let second = tokio::spawn({
        let (url, key) = (url.clone(), key.to_owned());
        async move { post_json(&url, Some(&key), "t1", &json!({})).await }
    });
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{:?}", first.body);
    // The lease is over; the completion is now refused for good.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    refuse.store(true, Ordering::SeqCst);
    store.fail_completes(0);
    let second = second.await.unwrap_or_else(|e| panic!("{e}"));
    let third = post_json(&url, Some(key), "t1", &json!({})).await;
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the handler ran twice at one instance: first {} {:?}, waiting second {} {:?}, third {} {:?}",
        first.status,
        first.body,
        second.status,
        second.body,
        third.status,
        third.body
    );
    let not_recorded = json!(Problem::new(ProblemKind::NotRecorded).title);
    for (which, r) in [("the waiting request", &second), ("a later one", &third)] {
        assert_eq!(
            (r.status, &r.body["title"]),
            (409, &not_recorded),
            "{which}: {:?}",
            r.body
        );
    }
}

/// A key whose response the layer gave up recording (refused after an
/// outage) and that an operator then deletes (`Idempotency::delete`, as
/// `idem delete`) to have the request run again: the layer reads the
/// record before answering 409 "not recorded", so once the store no
/// longer holds it, the request runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_key_deleted_by_an_operator_runs_again() {
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(std::time::Duration::from_secs(1));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                refuse.store(true, Ordering::SeqCst);
                support::flaky::outage(&down, std::time::Duration::from_millis(2500));
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let url = format!("{}/payments", spawn_server(router).await);
    let first = post_json(&url, Some("k-deleted"), "t1", &json!({})).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let not_recorded = json!(Problem::new(ProblemKind::NotRecorded).title);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let r = post_json(&url, Some("k-deleted"), "t1", &json!({})).await;
        if r.status == 409 && r.body["title"] == not_recorded {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never given up: {:?}",
            r.body
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    refuse.store(false, Ordering::SeqCst);
    let key = idemkit::http::request_key("http", "t1", "POST", "/payments", "k-deleted")
        .unwrap_or_else(|e| panic!("{e}"));
    let deleted = idem.delete(&key).await;
    assert!(matches!(deleted, Ok(true)), "{deleted:?}");
    let after = post_json(&url, Some("k-deleted"), "t1", &json!({})).await;
    assert_eq!(
        (after.status, effects.load(Ordering::SeqCst)),
        (201, 2),
        "after the operator's delete: {:?}",
        after.body
    );
}

/// Two instances of a service over one store. Instance A's handler runs
/// and the store goes away for 3.2 s, past the 1 s lease: A answers its
/// client and writes the completion once the store is back. A retry
/// that reaches instance B 250 ms after the store came back (B's layer
/// knows nothing of A's finishing) finds the completion written and gets
/// the replay: A's finisher pauses at most 100 ms between tries (it paused
/// up to 500 ms, and B took the expired lease over and ran it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_at_another_instance_soon_after_the_store_is_back_gets_the_replay() {
    let records = idemkit::MemoryStore::new();
    let (store_a, down) = support::flaky::FlakyStore::new(records.clone());
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                support::flaky::outage(&down, std::time::Duration::from_millis(3200));
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let instance = |idem| {
        Router::new()
            .route("/payments", post(handler.clone()))
            .layer(IdempotencyLayer::new(idem).tenant(api_key))
    };
    let lease = std::time::Duration::from_secs(1);
    let a = spawn_server(instance(
        Idempotency::new(Arc::new(store_a) as Arc<dyn idemkit::IdempotencyStore>).lease(lease),
    ))
    .await;
    let b = spawn_server(instance(
        Idempotency::new(Arc::new(records) as Arc<dyn idemkit::IdempotencyStore>).lease(lease),
    ))
    .await;
    let first = post_json(&format!("{a}/payments"), Some("k-two"), "t1", &json!({})).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while down.load(Ordering::SeqCst) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the outage never ended"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    let retry = post_json(&format!("{b}/payments"), Some("k-two"), "t1", &json!({})).await;
    assert_eq!(
        (retry.status, effects.load(Ordering::SeqCst)),
        (201, 1),
        "the retry at instance B: {:?}",
        retry.body
    );
    assert_eq!(retry.body, first.body, "the replay of the one run");
}

/// The first request's response cannot be recorded before the executor
/// gives up (`Unrecorded`; its completions fail, the store stays
/// reachable): the layer keeps the key finishing and answers its retries
/// 409 itself. A request with the same key and a *different* body is not a
/// retry: DESIGN 2 ("a later acquire of a live record with a different
/// fingerprint is Mismatch, whatever the record's state") makes it a 422,
/// which the layer answers without asking the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_body_while_the_response_is_finishing_is_422_not_409() {
    let store = Arc::new(Tap::new(idemkit::MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone()).lease(std::time::Duration::from_secs(1));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, store) = (effects.clone(), store.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            // Every completion fails from now on.
            store.fail_completes(usize::MAX);
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let url = format!("{}/payments", spawn_server(router).await);
    let first = post_json(&url, Some("k-rv16b"), "t1", &json!({ "amount": 1 })).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // What the store itself says to the other body (control).
    let key = idemkit::http::request_key("http", "t1", "POST", "/payments", "k-rv16b")
        .unwrap_or_else(|e| panic!("{e}"));
    let record = idem.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        record.as_ref().is_some_and(|r| !r.is_completed()),
        "the record is live and in progress: {record:?}"
    );
    let other = post_json(&url, Some("k-rv16b"), "t1", &json!({ "amount": 2 })).await;
    store.fail_completes(0);
    assert_eq!(
        (other.status, effects.load(Ordering::SeqCst)),
        (422, 1),
        "a different body with the key of a response being finished: {:?}",
        other.body
    );
}

/// A 500 from the layer never echoes the store's error text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_errors_are_not_echoed_to_the_client() {
    let pool = support::pg::pool(support::pg::shared_url(), 8).await;
    // A table that was never migrated: every call fails with a database
    // error naming it.
    let store = PgStore::builder(pool)
        .table("idem_secret_missing_table")
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let url = spawn_server(
        Router::new()
            .route("/x", post(|| async { "ran" }))
            .layer(layer_on(Idempotency::new(store))),
    )
    .await;
    let r = post_raw(&format!("{url}/x"), "k", Some("t1"), "text/plain", "").await;
    let text = String::from_utf8_lossy(&r.body);
    assert!(r.status == 500 || r.status == 503, "{} {text}", r.status);
    assert!(
        !text.contains("idem_secret_missing_table") && !text.contains("relation"),
        "internal text echoed: {text}"
    );
}
