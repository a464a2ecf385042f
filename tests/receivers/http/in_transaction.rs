//! The layer's in-transaction form (`IdempotencyLayer::in_transaction`):
//! the claim, the handler's INSERT and the recorded response commit
//! together. A server killed (SIGKILL) between the INSERT and the commit
//! leaves nothing, so the retry runs once; a duplicate waits for the open
//! transaction and replays; a panic, a released status or a failed commit
//! keep nothing; 64 duplicates on a pool of 8 connections neither
//! deadlock nor hold the pool.

use super::*;

use std::collections::HashSet;
use std::time::Duration;

use axum::Extension;
use idemkit::http::RequestTx;
use idemkit::postgres::sqlx;
use idemkit::{Context, IdempotencyKey, IdempotencyStore};

/// Tells a child process of this binary to serve [`tx_router`] (its value:
/// the scope and the ledger) until it is killed.
const TX_SERVER: &str = "IDEM_TEST_HTTP_TX_SERVER";

/// What the handlers of one server share.
#[derive(Clone)]
struct TxApp {
    ledger: String,
    /// Handler entries (each a run, whether or not it commits).
    runs: Arc<AtomicU64>,
    /// Opened by the test to let `/hold` end.
    gate: Arc<tokio::sync::Semaphore>,
    /// Told when `/hold` has inserted its row.
    inserted: Arc<tokio::sync::Notify>,
    /// The fences the handlers were given.
    fences: Arc<std::sync::Mutex<Vec<u64>>>,
}

#[derive(serde::Deserialize)]
struct Pay {
    id: String,
}

/// Inserts the payment's row on the request's transaction.
async fn insert(app: &TxApp, tx: &RequestTx, context: &Context, id: &str) -> i64 {
    app.runs.fetch_add(1, Ordering::SeqCst);
    app.fences
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(context.fence);
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (id, fence) VALUES ($1, $2) RETURNING n",
        app.ledger
    )))
    .bind(id)
    .bind(context.fence as i64)
    .fetch_one(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("insert: {e}"))
}

async fn pay(
    State(app): State<TxApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> impl IntoResponse {
    let n = insert(&app, &tx, &context, &body.id).await;
    (
        StatusCode::CREATED,
        Json(json!({ "row": n, "fence": context.fence })),
    )
}

/// Inserts, says so (to the test, and on stdout for a parent process),
/// then waits for the gate.
async fn hold(
    State(app): State<TxApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> impl IntoResponse {
    let n = insert(&app, &tx, &context, &body.id).await;
    app.inserted.notify_one();
    println!("idem-inserted {}", body.id);
    let _permit = app.gate.acquire().await;
    (
        StatusCode::CREATED,
        Json(json!({ "row": n, "fence": context.fence })),
    )
}

async fn panics(
    State(app): State<TxApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> StatusCode {
    insert(&app, &tx, &context, &body.id).await;
    panic!("the handler fails after its INSERT");
}

/// Inserts, then answers 503 (a status the layer releases).
async fn busy(
    State(app): State<TxApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> StatusCode {
    insert(&app, &tx, &context, &body.id).await;
    StatusCode::SERVICE_UNAVAILABLE
}

/// Inserts, and breaks a deferred constraint: the commit fails.
async fn fails_at_commit(
    State(app): State<TxApp>,
    Extension(tx): Extension<RequestTx>,
    Extension(context): Extension<Context>,
    Json(body): Json<Pay>,
) -> StatusCode {
    insert(&app, &tx, &context, &body.id).await;
    let mut tx = tx.lock().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}_deferred (v) VALUES (1), (1)",
        app.ledger
    )))
    .execute(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    StatusCode::CREATED
}

/// The ledger tables: one row per run that committed.
pub(super) async fn create_ledger(pool: &sqlx::PgPool) -> String {
    let ledger = format!("http_tx_{:08x}", fastrand::u32(..));
    for statement in [
        format!("CREATE TABLE {ledger} (n bigserial PRIMARY KEY, id text NOT NULL, fence bigint NOT NULL)"),
        format!("CREATE TABLE {ledger}_deferred (v int UNIQUE DEFERRABLE INITIALLY DEFERRED)"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    ledger
}

/// The rows of `id` in the ledger.
pub(super) async fn rows(pool: &sqlx::PgPool, ledger: &str, id: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {ledger} WHERE id = $1"
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A store on the shared PostgreSQL with a pool of `connections`.
pub(super) async fn store_of(connections: u32) -> PgStore {
    let store = PgStore::new(support::pg::pool(support::pg::shared_url(), connections).await);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

/// The routes of the in-transaction app, behind `layer`.
fn tx_router(layer: IdempotencyLayer<PgStore>, app: &TxApp) -> Router {
    Router::new()
        .route("/pay", post(pay))
        .route("/hold", post(hold))
        .route("/panics", post(panics))
        .route("/busy", post(busy))
        .route("/fails-at-commit", post(fails_at_commit))
        .layer(layer)
        .with_state(app.clone())
}

fn tx_app(ledger: &str) -> TxApp {
    TxApp {
        ledger: ledger.to_owned(),
        runs: Arc::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
        inserted: Arc::default(),
        fences: Arc::default(),
    }
}

/// An in-transaction layer of scope `scope` over `store`.
fn tx_layer(store: PgStore, scope: &str) -> IdempotencyLayer<PgStore> {
    IdempotencyLayer::new(Idempotency::new(store))
        .scope(scope)
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
        .in_transaction()
}

/// The rest of the first line from the server process that holds
/// `prefix` (60 s at most).
async fn next_line(
    lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    prefix: &str,
) -> String {
    let found = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.recv().await {
            if let Some((_, rest)) = line.split_once(prefix) {
                return Some(rest.to_owned());
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(rest)) => rest,
        Ok(None) => panic!("the server process ended before {prefix:?}"),
        Err(_) => panic!("no {prefix:?} from the server process in 60 s"),
    }
}

/// A server of the in-transaction app: its URL and its app.
async fn tx_server(
    store: PgStore,
    scope: &str,
    ledger: &str,
    wait: Option<Duration>,
) -> (String, TxApp) {
    let app = tx_app(ledger);
    let mut layer = tx_layer(store, scope);
    if let Some(wait) = wait {
        layer = layer.transaction_wait(wait);
    }
    (spawn_server(tx_router(layer, &app)).await, app)
}

fn key_of(scope: &str, path: &str, client_key: &str) -> IdempotencyKey {
    idemkit::http::request_key(scope, "t1", "POST", path, client_key)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The first request runs and commits its row with its record; the retry
/// replays it: one row, one run, the fence the handler was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_and_its_retry_commit_one_row_and_replay() {
    let store = store_of(8).await;
    let ledger = create_ledger(store.pool()).await;
    let scope = scope();
    let (url, app) = tx_server(store.clone(), &scope, &ledger, None).await;
    let body = json!({ "id": "p-1" });
    let first = post_json(&format!("{url}/pay"), Some("k-1"), "t1", &body).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(!first.replayed());
    let retry = post_json(&format!("{url}/pay"), Some("k-1"), "t1", &body).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed(), "the retry is the replay");
    assert_eq!(retry.body, first.body);
    assert_eq!(rows(store.pool(), &ledger, "p-1").await, 1);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    let record = store
        .get(&key_of(&scope, "/pay", "k-1"))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("no record"));
    assert_eq!(first.body["fence"].as_u64(), Some(record.fence));
    let other = post_json(
        &format!("{url}/pay"),
        Some("k-1"),
        "t1",
        &json!({ "id": "p-2" }),
    )
    .await;
    assert_eq!(
        other.status, 422,
        "another body with the key: {:?}",
        other.body
    );
}

/// A server process killed (SIGKILL) after its handler's INSERT and
/// before the commit: the database rolls the INSERT back with the claim,
/// and the retry, on another server, runs once and commits one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_retry_runs_once()
{
    if let Ok(spec) = std::env::var(TX_SERVER) {
        let (scope, ledger) = spec.split_once(' ').unwrap_or_else(|| panic!("{spec}"));
        let (url, _app) = tx_server(store_of(4).await, scope, ledger, None).await;
        println!("idem-url {url}");
        return std::future::pending().await;
    }
    let store = store_of(8).await;
    let ledger = create_ledger(store.pool()).await;
    let scope = scope();
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("this test binary: {e}"));
    let child = std::process::Command::new(exe)
        .args([
            "http::in_transaction::a_server_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_retry_runs_once",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(TX_SERVER, format!("{scope} {ledger}"))
        .env("IDEM_POSTGRES_URL", support::pg::shared_url())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the server process: {e}"));
    let mut child = support::alone::Killed(child);
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    let out = child
        .0
        .stdout
        .take()
        .unwrap_or_else(|| panic!("its stdout"));
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let child_url = next_line(&mut lines, "idem-url ").await;
    let body = json!({ "id": "p-killed" });
    let first = {
        let (url, body) = (format!("{child_url}/hold"), body.clone());
        tokio::spawn(async move {
            client()
                .post(url)
                .header("x-api-key", "t1")
                .header("idempotency-key", "k-killed")
                .json(&body)
                .send()
                .await
        })
    };
    next_line(&mut lines, "idem-inserted ").await;
    child.kill();
    assert!(
        first.await.unwrap_or_else(|e| panic!("{e}")).is_err(),
        "the killed server answered"
    );
    // The retry, on a server of this process: it waits for the dead
    // session's rollback if it has not happened yet, then runs.
    let (url, app) = tx_server(store.clone(), &scope, &ledger, None).await;
    let retry = post_json(&format!("{url}/pay"), Some("k-killed"), "t1", &body).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(
        !retry.replayed(),
        "the killed request kept nothing to replay"
    );
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        rows(store.pool(), &ledger, "p-killed").await,
        1,
        "the killed server's INSERT was rolled back; the retry's committed"
    );
    let again = post_json(&format!("{url}/pay"), Some("k-killed"), "t1", &body).await;
    assert!(again.replayed());
    assert_eq!(rows(store.pool(), &ledger, "p-killed").await, 1);
}

/// A duplicate sent while the first request's transaction is open waits
/// for it and gets the replay, in the same process (at the layer's gate)
/// and from another server (on the claim, in the database); with a short
/// `transaction_wait`, the other server's duplicate gets 409 instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_during_the_open_transaction_waits_and_replays() {
    let store = store_of(8).await;
    let ledger = create_ledger(store.pool()).await;
    let scope = scope();
    let (url, app) = tx_server(store.clone(), &scope, &ledger, None).await;
    let (other_url, other_app) = tx_server(store_of(4).await, &scope, &ledger, None).await;
    let (impatient_url, _) = tx_server(
        store_of(2).await,
        &scope,
        &ledger,
        Some(Duration::from_millis(300)),
    )
    .await;
    let body = json!({ "id": "p-dup" });
    let inserted = app.inserted.notified();
    let first = {
        let (url, body) = (format!("{url}/hold"), body.clone());
        tokio::spawn(async move { post_json(&url, Some("k-dup"), "t1", &body).await })
    };
    inserted.await;
    let same_process = {
        let (url, body) = (format!("{url}/hold"), body.clone());
        tokio::spawn(async move { post_json(&url, Some("k-dup"), "t1", &body).await })
    };
    let other_server = {
        let (url, body) = (format!("{other_url}/hold"), body.clone());
        tokio::spawn(async move { post_json(&url, Some("k-dup"), "t1", &body).await })
    };
    let impatient = post_json(&format!("{impatient_url}/hold"), Some("k-dup"), "t1", &body).await;
    assert_eq!(impatient.status, 409, "{:?}", impatient.body);
    assert!(impatient.headers.get("retry-after").is_some());
    assert!(
        !same_process.is_finished() && !other_server.is_finished(),
        "they wait"
    );
    app.gate.add_permits(1);
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status, 201);
    for dup in [same_process, other_server] {
        let dup = dup.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dup.status, 201, "{:?}", dup.body);
        assert!(dup.replayed());
        assert_eq!(dup.body, first.body);
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(other_app.runs.load(Ordering::SeqCst), 0);
    assert_eq!(rows(store.pool(), &ledger, "p-dup").await, 1);
}

/// A handler that panics after its INSERT, and one that answers 503 (a
/// status the layer releases): nothing is kept, and the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_or_a_released_status_keeps_nothing_and_the_retry_runs() {
    let store = store_of(8).await;
    let ledger = create_ledger(store.pool()).await;
    let scope = scope();
    let (url, app) = tx_server(store.clone(), &scope, &ledger, None).await;
    let panicked = post_json(
        &format!("{url}/panics"),
        Some("k-p"),
        "t1",
        &json!({ "id": "p-panic" }),
    )
    .await;
    assert_eq!(panicked.status, 500, "{:?}", panicked.body);
    let busy = post_json(
        &format!("{url}/busy"),
        Some("k-b"),
        "t1",
        &json!({ "id": "p-busy" }),
    )
    .await;
    assert_eq!(busy.status, 503);
    assert!(!busy.replayed());
    for (id, path, key) in [("p-panic", "/panics", "k-p"), ("p-busy", "/busy", "k-b")] {
        assert_eq!(
            rows(store.pool(), &ledger, id).await,
            0,
            "{id}: rolled back"
        );
        let record = store
            .get(&key_of(&scope, path, key))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(record.is_none(), "{id}: no record: {record:?}");
    }
    // The retries run (on a handler that succeeds this time).
    let retry = post_json(
        &format!("{url}/pay"),
        Some("k-b"),
        "t1",
        &json!({ "id": "p-busy" }),
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(rows(store.pool(), &ledger, "p-busy").await, 1);
    assert_eq!(app.runs.load(Ordering::SeqCst), 3);
}

/// A commit that fails (a deferred constraint broken by the handler):
/// the response is withheld, nothing is kept, no record is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_withholds_the_response_and_keeps_nothing() {
    let store = store_of(8).await;
    let ledger = create_ledger(store.pool()).await;
    let scope = scope();
    let (url, _app) = tx_server(store.clone(), &scope, &ledger, None).await;
    let r = post_json(
        &format!("{url}/fails-at-commit"),
        Some("k-c"),
        "t1",
        &json!({ "id": "p-c" }),
    )
    .await;
    assert!(
        r.status == 500 || r.status == 503,
        "{} {:?}",
        r.status,
        r.body
    );
    assert_ne!(r.status, 201, "the handler's response is withheld");
    assert_eq!(rows(store.pool(), &ledger, "p-c").await, 0);
    let record = store
        .get(&key_of(&scope, "/fails-at-commit", "k-c"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(record.is_none(), "no record: {record:?}");
}

/// 64 concurrent duplicates of one key on a pool of 8 connections: the
/// duplicates wait without a connection (only the running request holds
/// one), then replay; one row, one run, no deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_duplicates_on_a_pool_of_eight_neither_deadlock_nor_hold_the_pool() {
    let store = store_of(8).await;
    let ledger = create_ledger(store.pool()).await;
    let scope = scope();
    let (url, app) = tx_server(store.clone(), &scope, &ledger, None).await;
    let body = json!({ "id": "p-64" });
    // The setup's connections (the migration, the ledger) back in the
    // pool first: the count below is of the requests' connections.
    let pool = store.pool();
    tokio::time::timeout(Duration::from_secs(10), async {
        while pool.size() as usize != pool.num_idle() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the setup's connections never went back to the pool"));
    let inserted = app.inserted.notified();
    let mut requests = Vec::new();
    for _ in 0..64 {
        let (url, body) = (format!("{url}/hold"), body.clone());
        requests.push(tokio::spawn(async move {
            post_json(&url, Some("k-64"), "t1", &body).await
        }));
    }
    inserted.await;
    // While the first holds its transaction, the others reach the gate;
    // the pool's connections in use stay the first's one.
    let mut most = 0;
    for _ in 0..100 {
        let pool = store.pool();
        most = most.max(pool.size() as usize - pool.num_idle());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(most <= 1, "{most} connections in use while duplicates wait");
    app.gate.add_permits(1);
    let replies =
        tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(requests))
            .await
            .unwrap_or_else(|_| panic!("the 64 requests did not end in 60 s"));
    let mut ran = 0;
    let mut bodies = HashSet::new();
    for reply in replies {
        let reply = reply.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        if !reply.replayed() {
            ran += 1;
        }
        bodies.insert(reply.body.to_string());
    }
    assert_eq!(ran, 1, "one request ran");
    assert_eq!(bodies.len(), 1, "every duplicate got its response");
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    assert_eq!(rows(store.pool(), &ledger, "p-64").await, 1);
}

/// An executor with a zero retention (refused by the lease form as
/// `InvalidConfig`: every duplicate would run the handler again): the
/// in-transaction form refuses it too, so a retry never runs the payment
/// again: one row at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_retention_never_runs_a_completed_request_twice() {
    let store = store_of(8).await;
    let ledger = create_ledger(store.pool()).await;
    let scope = scope();
    let app = tx_app(&ledger);
    let layer = IdempotencyLayer::new(Idempotency::new(store.clone()).retention(Duration::ZERO))
        .scope(&scope)
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
        .in_transaction();
    let url = spawn_server(tx_router(layer, &app)).await;
    let body = json!({ "id": "p-zero" });
    let first = post_json(&format!("{url}/pay"), Some("k-zero"), "t1", &body).await;
    let retry = post_json(&format!("{url}/pay"), Some("k-zero"), "t1", &body).await;
    assert!(
        rows(store.pool(), &ledger, "p-zero").await <= 1,
        "the payment committed {} times: first {} {:?}, retry {} {:?} (replayed: {})",
        rows(store.pool(), &ledger, "p-zero").await,
        first.status,
        first.body,
        retry.status,
        retry.body,
        retry.replayed()
    );
}
