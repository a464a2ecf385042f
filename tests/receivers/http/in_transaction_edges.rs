//! The in-transaction form at its edges: what a handler, a client or a
//! configuration can do to it (a statement error the handler answers, a
//! response the store refuses, a body that panics, a handler that ends the
//! transaction itself, two instances racing, a client that goes away, a
//! pool with session settings of its own, responses kept but not
//! replayable). What must hold: one committed row per key, the handler's
//! own answer for its caller, never a hang, never a connection cut.

use super::*;

use std::time::Duration;

use axum::body::Body;
use axum::Extension;
use idemkit::http::RequestTx;
use idemkit::postgres::sqlx;
use idemkit::Context;

use super::in_transaction::{create_ledger, rows, store_of};

#[derive(Clone)]
struct EdgeApp {
    ledger: String,
    runs: Arc<AtomicU64>,
    gate: Arc<tokio::sync::Semaphore>,
    inserted: Arc<tokio::sync::Notify>,
}

#[derive(serde::Deserialize)]
struct Pay {
    id: String,
}

async fn insert_on(app: &EdgeApp, tx: &mut sqlx::PgConnection, id: &str, fence: u64) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (id, fence) VALUES ($1, $2) RETURNING n",
        app.ledger
    )))
    .bind(id)
    .bind(fence as i64)
    .fetch_one(tx)
    .await
    .unwrap_or_else(|e| panic!("insert: {e}"))
}

/// Inserts the ledger row, then inserts `id` into `{ledger}_u` (a
/// primary key): when it is already there, the handler answers 409 with
/// its own body ("this payment exists"), as a handler that maps a
/// unique violation to a conflict does.
async fn unique(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    insert_on(&app, &mut tx, &body.id, context.fence).await;
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}_u (id) VALUES ($1)",
        app.ledger
    )))
    .bind(&body.id)
    .execute(&mut *tx)
    .await;
    match done {
        Ok(_) => (StatusCode::CREATED, Json(json!({ "created": body.id }))).into_response(),
        Err(_) => (
            StatusCode::CONFLICT,
            Json(json!({ "error": "payment exists", "id": body.id })),
        )
            .into_response(),
    }
}

/// Inserts, then answers 201 with a 2 KiB body.
async fn big(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    insert_on(&app, &mut tx, &body.id, context.fence).await;
    (
        StatusCode::CREATED,
        Json(json!({ "id": body.id, "pad": "x".repeat(2048) })),
    )
        .into_response()
}

/// Inserts, then answers 201 with a body that panics when read.
async fn body_panics(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    insert_on(&app, &mut tx, &body.id, context.fence).await;
    let stream = futures::stream::poll_fn(
        |_| -> std::task::Poll<Option<Result<bytes::Bytes, std::io::Error>>> {
            panic!("the response body fails")
        },
    );
    (StatusCode::CREATED, Body::from_stream(stream)).into_response()
}

/// Against the rules (documented): runs ROLLBACK on the request's
/// transaction, then inserts (now outside any transaction).
async fn rolls_back(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("ROLLBACK")
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    insert_on(&app, &mut tx, &body.id, context.fence).await;
    (StatusCode::CREATED, Json(json!({ "id": body.id }))).into_response()
}

/// Inserts, says so, waits for the gate.
async fn hold(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let n = {
        let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
        insert_on(&app, &mut tx, &body.id, context.fence).await
    };
    app.inserted.notify_one();
    let _permit = app.gate.acquire().await;
    (
        StatusCode::CREATED,
        Json(json!({ "row": n, "id": body.id })),
    )
        .into_response()
}

/// Inserts and answers at once.
async fn pay(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    let n = insert_on(&app, &mut tx, &body.id, context.fence).await;
    (
        StatusCode::CREATED,
        Json(json!({ "row": n, "id": body.id })),
    )
        .into_response()
}

/// Inserts and answers 500 (recorded, says DESIGN 5b).
async fn fails(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    insert_on(&app, &mut tx, &body.id, context.fence).await;
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({ "failed": body.id })),
    )
        .into_response()
}

/// Inserts, answers with `Vary: *`.
async fn vary_star(
    State(app): State<EdgeApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> axum::response::Response {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    insert_on(&app, &mut tx, &body.id, context.fence).await;
    (
        StatusCode::CREATED,
        [("vary", "*")],
        Json(json!({ "id": body.id })),
    )
        .into_response()
}

/// Answers the session's lock_timeout and the isolation, as the handler
/// sees them.
async fn settings(Extension(tx): Extension<RequestTx>) -> axum::response::Response {
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    let (lock, iso): (String, String) = sqlx::query_as(
        "SELECT current_setting('lock_timeout'), current_setting('transaction_isolation')",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    (
        StatusCode::OK,
        Json(json!({ "lock_timeout": lock, "isolation": iso })),
    )
        .into_response()
}

async fn edge_ledger(pool: &sqlx::PgPool) -> String {
    let ledger = create_ledger(pool).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {ledger}_u (id text PRIMARY KEY)"
    )))
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    ledger
}

fn edge_app(ledger: &str) -> EdgeApp {
    EdgeApp {
        ledger: ledger.to_owned(),
        runs: Arc::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
        inserted: Arc::default(),
    }
}

async fn edge_server(
    store: PgStore,
    scope: &str,
    app: &EdgeApp,
    wait: Option<Duration>,
    max_response: Option<usize>,
) -> String {
    let mut layer = IdempotencyLayer::new(Idempotency::new(store))
        .scope(scope)
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
        .in_transaction();
    if let Some(wait) = wait {
        layer = layer.transaction_wait(wait);
    }
    if let Some(max) = max_response {
        layer = layer.max_response_bytes(max);
    }
    let router = Router::new()
        .route("/unique", post(unique))
        .route("/big", post(big))
        .route("/body-panics", post(body_panics))
        .route("/rolls-back", post(rolls_back))
        .route("/hold", post(hold))
        .route("/pay", post(pay))
        .route("/fails", post(fails))
        .route("/vary-star", post(vary_star))
        .route("/settings", post(settings))
        .layer(layer)
        .with_state(app.clone());
    spawn_server(router).await
}

/// A handler whose statement failed (a unique violation it maps to its
/// own 409) leaves the transaction aborted: its caller must get the
/// handler's answer (recorded or passed on), never a 500 of the layer's
/// that replaces it on every retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_error_the_handler_answers_reaches_its_caller_and_keeps_nothing() {
    let store = store_of(4).await;
    let ledger = edge_ledger(store.pool()).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {ledger}_u (id) VALUES ('p-exists')"
    )))
    .execute(store.pool())
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let app = edge_app(&ledger);
    let url = edge_server(store.clone(), &scope(), &app, None, None).await;
    let r = post_json(
        &format!("{url}/unique"),
        Some("k-u"),
        "t1",
        &json!({ "id": "p-exists" }),
    )
    .await;
    assert_eq!(
        r.status, 409,
        "the handler answered 409 {{\"error\":\"payment exists\"}}; the caller got {} {:?}",
        r.status, r.body
    );
    assert_eq!(r.body["error"], "payment exists", "{:?}", r.body);
    assert_eq!(
        rows(store.pool(), &ledger, "p-exists").await,
        0,
        "the aborted transaction kept nothing"
    );
    assert!(!r.replayed());
}

/// The store refuses the recorded copy's size (PgStore max_response_bytes
/// below the layer's): DESIGN 4 says a result that cannot be recorded
/// "is not released: ... completed with a marker ..., the caller gets its
/// value"; here the handler's row and 201 must reach the caller, a
/// duplicate gets 409 "not recorded", never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_store_refuses_is_kept_not_replayable_and_never_run_again() {
    let pool = support::pg::pool(support::pg::shared_url(), 4).await;
    let store = PgStore::builder(pool)
        .max_response_bytes(512)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let ledger = edge_ledger(store.pool()).await;
    let app = edge_app(&ledger);
    let url = edge_server(store.clone(), &scope(), &app, None, None).await;
    let body = json!({ "id": "p-big" });
    let first = post_json(&format!("{url}/big"), Some("k-big"), "t1", &body).await;
    let second = post_json(&format!("{url}/big"), Some("k-big"), "t1", &body).await;
    let runs = app.runs.load(Ordering::SeqCst);
    let kept = rows(store.pool(), &ledger, "p-big").await;
    assert_eq!(
        (first.status, kept, runs),
        (201, 1, 1),
        "first {} {:?}; second {} {:?}; rows {kept}, runs {runs}",
        first.status,
        first.body,
        second.status,
        second.body
    );
    assert_eq!(second.status, 409, "the duplicate: {:?}", second.body);
    assert!(
        second.headers.get("retry-after").is_none(),
        "not recorded, never retried"
    );
}

/// A response body that panics while the layer reads it (before the
/// commit): a clean 500, nothing kept, the server still serving - as a
/// panic of the handler itself is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_body_that_panics_is_a_clean_500_and_keeps_nothing() {
    let store = store_of(4).await;
    let ledger = edge_ledger(store.pool()).await;
    let app = edge_app(&ledger);
    let url = edge_server(store.clone(), &scope(), &app, None, None).await;
    let sent = client()
        .post(format!("{url}/body-panics"))
        .header("x-api-key", "t1")
        .header("idempotency-key", "k-bp")
        .json(&json!({ "id": "p-bp" }))
        .send()
        .await;
    let status = sent.as_ref().map(|r| r.status().as_u16());
    assert_eq!(rows(store.pool(), &ledger, "p-bp").await, 0);
    assert!(
        matches!(status, Ok(500)),
        "the caller got {status:?} (a connection cut instead of the layer's clean 500)"
    );
}

/// Misuse the docs forbid (ROLLBACK on the request's transaction, then an
/// INSERT, which commits on its own): the claim is gone, so the layer
/// marks the key "not replayable" in a new transaction; the retry gets
/// 409 "not recorded" and never adds a second row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_ends_the_transaction_itself_never_runs_again() {
    let store = store_of(4).await;
    let ledger = edge_ledger(store.pool()).await;
    let app = edge_app(&ledger);
    let url = edge_server(store.clone(), &scope(), &app, None, None).await;
    let body = json!({ "id": "p-rb" });
    let first = post_json(&format!("{url}/rolls-back"), Some("k-rb"), "t1", &body).await;
    let second = post_json(&format!("{url}/rolls-back"), Some("k-rb"), "t1", &body).await;
    let kept = rows(store.pool(), &ledger, "p-rb").await;
    assert_eq!(
        kept, 1,
        "{kept} rows for one key (first {} {:?}, second {} {:?})",
        first.status, first.body, second.status, second.body
    );
    assert_eq!(first.status, 201, "its answer passed on: {:?}", first.body);
    assert_eq!(
        second.status, 409,
        "not recorded, never run again: {:?}",
        second.body
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

/// Two app instances (two layers, two gates, two pools) with 12
/// duplicates each at once, and a duplicate with another body: one row,
/// one run, every 201 the same body, the other body 409/422, never a
/// replay of the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_racing_duplicates_keep_one_row() {
    let store = store_of(4).await;
    let ledger = edge_ledger(store.pool()).await;
    let scope = scope();
    let a = edge_app(&ledger);
    let b = edge_app(&ledger);
    let url_a = edge_server(store.clone(), &scope, &a, None, None).await;
    let url_b = edge_server(store_of(4).await, &scope, &b, None, None).await;
    let inserted = a.inserted.notified();
    let first = {
        let url = format!("{url_a}/hold");
        tokio::spawn(
            async move { post_json(&url, Some("k-2i"), "t1", &json!({ "id": "p-2i" })).await },
        )
    };
    inserted.await;
    let mut dups = Vec::new();
    for i in 0..24 {
        let url = format!("{}/hold", if i % 2 == 0 { &url_a } else { &url_b });
        dups.push(tokio::spawn(async move {
            post_json(&url, Some("k-2i"), "t1", &json!({ "id": "p-2i" })).await
        }));
    }
    let other_body = {
        let url = format!("{url_b}/hold");
        tokio::spawn(async move {
            post_json(&url, Some("k-2i"), "t1", &json!({ "id": "p-other" })).await
        })
    };
    let other_tenant = {
        let url = format!("{url_b}/pay");
        tokio::spawn(
            async move { post_json(&url, Some("k-2i"), "t2", &json!({ "id": "p-t2" })).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.gate.add_permits(1);
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{:?}", first.body);
    for dup in dups {
        let dup = tokio::time::timeout(Duration::from_secs(30), dup)
            .await
            .unwrap_or_else(|_| panic!("a duplicate hangs"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dup.status, 201, "{:?}", dup.body);
        assert!(dup.replayed());
        assert_eq!(dup.body, first.body);
    }
    let other = other_body.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(other.status, 422, "another body: {:?}", other.body);
    let t2 = other_tenant.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(t2.status, 201, "{:?}", t2.body);
    assert!(!t2.replayed(), "another tenant's key is its own");
    assert_eq!(t2.body["id"], "p-t2");
    assert_eq!(rows(store.pool(), &ledger, "p-2i").await, 1);
    assert_eq!(rows(store.pool(), &ledger, "p-other").await, 0);
    assert_eq!(
        a.runs.load(Ordering::SeqCst) + b.runs.load(Ordering::SeqCst),
        2
    );
}

/// A client that goes away while its handler holds the transaction
/// open: whatever became of it, the retry ends in one row and does not
/// hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_handler_then_retries_keeps_one_row() {
    let store = store_of(4).await;
    let ledger = edge_ledger(store.pool()).await;
    let app = edge_app(&ledger);
    let url = edge_server(
        store.clone(),
        &scope(),
        &app,
        Some(Duration::from_secs(3)),
        None,
    )
    .await;
    let inserted = app.inserted.notified();
    let gone = {
        let url = format!("{url}/hold");
        tokio::spawn(async move {
            client()
                .post(url)
                .header("x-api-key", "t1")
                .header("idempotency-key", "k-gone")
                .json(&json!({ "id": "p-gone" }))
                .send()
                .await
        })
    };
    inserted.await;
    gone.abort();
    let _ = gone.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // If the server dropped the request, this permit stays unused.
    let retry = tokio::time::timeout(
        Duration::from_secs(20),
        post_json(
            &format!("{url}/pay"),
            Some("k-gone"),
            "t1",
            &json!({ "id": "p-gone" }),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("the retry hangs"));
    app.gate.add_permits(1);
    assert!(
        retry.status == 201 || retry.status == 409,
        "{} {:?}",
        retry.status,
        retry.body
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(rows(store.pool(), &ledger, "p-gone").await <= 1);
    let again = post_json(
        &format!("{url}/pay"),
        Some("k-gone"),
        "t1",
        &json!({ "id": "p-gone" }),
    )
    .await;
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert_eq!(rows(store.pool(), &ledger, "p-gone").await, 1);
}

/// A pool whose sessions set lock_timeout and REPEATABLE READ (after
/// connect): the handler sees its own lock_timeout back after the claim,
/// and a duplicate during the open transaction still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_its_own_session_settings_keeps_them_for_the_handler() {
    use sqlx::Executor;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(
                    "SET lock_timeout = '4321ms'; \
                     SET default_transaction_isolation = 'repeatable read'",
                )
                .await?;
                Ok(())
            })
        })
        .connect(support::pg::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::new(pool);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let ledger = edge_ledger(store.pool()).await;
    let app = edge_app(&ledger);
    let url = edge_server(store.clone(), &scope(), &app, None, None).await;
    let s = post_json(&format!("{url}/settings"), Some("k-s"), "t1", &json!({})).await;
    assert_eq!(s.status, 200, "{:?}", s.body);
    assert_eq!(s.body["lock_timeout"], "4321ms", "{:?}", s.body);
    let inserted = app.inserted.notified();
    let first = {
        let url = format!("{url}/hold");
        tokio::spawn(
            async move { post_json(&url, Some("k-rr"), "t1", &json!({ "id": "p-rr" })).await },
        )
    };
    inserted.await;
    let dup = {
        let url = format!("{url}/hold");
        tokio::spawn(
            async move { post_json(&url, Some("k-rr"), "t1", &json!({ "id": "p-rr" })).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    app.gate.add_permits(1);
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    let dup = dup.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(dup.status, 201, "{:?}", dup.body);
    assert!(dup.replayed());
    assert_eq!(rows(store.pool(), &ledger, "p-rr").await, 1);
}

/// Responses that are kept but not replayable (over max_response_bytes,
/// `Vary: *`) and a 500: each runs once and commits once; the 500 is
/// replayed; the others answer 409 "not recorded" to a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_replayable_responses_and_a_500_run_once() {
    let store = store_of(4).await;
    let ledger = edge_ledger(store.pool()).await;
    let app = edge_app(&ledger);
    let url = edge_server(store.clone(), &scope(), &app, None, Some(256)).await;
    for (path, id) in [
        ("/big", "p-over"),
        ("/vary-star", "p-vary"),
        ("/fails", "p-500"),
    ] {
        let body = json!({ "id": id });
        let first = post_json(&format!("{url}{path}"), Some(id), "t1", &body).await;
        let second = post_json(&format!("{url}{path}"), Some(id), "t1", &body).await;
        assert_eq!(rows(store.pool(), &ledger, id).await, 1, "{path}");
        if path == "/fails" {
            assert_eq!(first.status, 500);
            assert_eq!(second.status, 500);
            assert!(second.replayed(), "{path}");
        } else {
            assert_eq!(first.status, 201, "{path} {:?}", first.body);
            assert_eq!(second.status, 409, "{path} {:?}", second.body);
        }
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 3);
}
