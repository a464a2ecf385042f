//! The Idempotency-Key layer through a real axum server on 127.0.0.1 and a
//! real HTTP client (reqwest), on PostgreSQL.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idem::http::IdempotencyLayer;
use idem::postgres::PgStore;
use idem::Idempotency;
use serde_json::{json, Value};

#[derive(Clone)]
struct App {
    effects: Arc<AtomicU64>,
    flaky_calls: Arc<AtomicU64>,
    gate: Arc<tokio::sync::Semaphore>,
}

async fn create_payment(State(app): State<App>, Json(body): Json<Value>) -> impl IntoResponse {
    let id = app.effects.fetch_add(1, Ordering::SeqCst) + 1;
    let mut headers = HeaderMap::new();
    headers.insert(
        "location",
        format!("/payments/{id}")
            .parse()
            .unwrap_or_else(|e| panic!("{e}")),
    );
    (
        StatusCode::CREATED,
        headers,
        Json(json!({ "payment_id": id, "amount": body["amount"] })),
    )
}

async fn declined(State(app): State<App>) -> impl IntoResponse {
    app.effects.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::PAYMENT_REQUIRED,
        Json(json!({ "error": "card declined" })),
    )
}

/// 503 on its first call, 201 after: a 5xx is not recorded.
async fn flaky(State(app): State<App>) -> impl IntoResponse {
    if app.flaky_calls.fetch_add(1, Ordering::SeqCst) == 0 {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": "try again" })),
        )
    } else {
        app.effects.fetch_add(1, Ordering::SeqCst);
        (StatusCode::CREATED, Json(json!({ "ok": true })))
    }
}

/// Waits for the test to open the gate.
async fn slow(State(app): State<App>, Json(body): Json<Value>) -> impl IntoResponse {
    let id = app.effects.fetch_add(1, Ordering::SeqCst) + 1;
    let _permit = app.gate.acquire().await;
    (
        StatusCode::CREATED,
        Json(json!({ "payment_id": id, "amount": body["amount"] })),
    )
}

async fn get_payment() -> &'static str {
    "a GET passes through"
}

struct Server {
    url: String,
    app: App,
}

async fn serve() -> Server {
    let pool = support::pg::pool(support::pg::shared_url(), 8).await;
    let store = PgStore::new(pool);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let layer = IdempotencyLayer::new(Idempotency::new(store))
        .scope(scope())
        .unwrap_or_else(|e| panic!("{e}"))
        .max_body_bytes(1024)
        .tenant(|req| {
            req.headers
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    let app = App {
        effects: Arc::default(),
        flaky_calls: Arc::default(),
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let router = Router::new()
        .route("/payments", post(create_payment).get(get_payment))
        .route("/declined", post(declined))
        .route("/flaky", post(flaky))
        .route("/slow", post(slow))
        .layer(layer)
        .with_state(app.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    Server { url, app }
}

struct Reply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Reply {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    fn content_type(&self) -> &str {
        self.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

/// A client that shows redirects instead of following them.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn post_json(url: &str, key: Option<&str>, tenant: &str, body: &Value) -> Reply {
    let mut request = client().post(url).header("x-api-key", tenant).json(body);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("{e}"));
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.unwrap_or_else(|e| panic!("{e}"));
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Reply {
        status,
        headers,
        body,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_code_table() {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_with_the_same_key_never_collide() {
    let server = serve().await;
    let payments = format!("{}/payments", server.url);
    let body = json!({ "amount": 700 });
    let a = post_json(&payments, Some("shared-key"), "tenant-a", &body).await;
    let b = post_json(&payments, Some("shared-key"), "tenant-b", &body).await;
    assert_eq!(
        (a.status, a.replayed(), b.status, b.replayed()),
        (201, false, 201, false)
    );
    assert_ne!(
        a.body["payment_id"], b.body["payment_id"],
        "each tenant ran its own"
    );
    let a2 = post_json(&payments, Some("shared-key"), "tenant-a", &body).await;
    let b2 = post_json(&payments, Some("shared-key"), "tenant-b", &body).await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(
        (a2.body.clone(), b2.body.clone()),
        (a.body, b.body),
        "each reads only its own response"
    );
    assert_eq!(server.app.effects.load(Ordering::SeqCst), 2);
}

/// The store unreachable: 503 with Retry-After, and the handler never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_is_503_with_retry_after() {
    let redis = support::redis_server::RedisServer::start(&[]);
    let store = idem::redis::RedisStore::connect(&redis.url)
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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}/payments",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
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

// ---------------------------------------------------------------------------
// Issue findings: each test below goes through a real axum server and
// reqwest, on PostgreSQL.

fn scope() -> String {
    format!("http.{:08x}", fastrand::u32(..))
}

async fn pg_store() -> PgStore {
    let pool = support::pg::pool(support::pg::shared_url(), 8).await;
    let store = PgStore::new(pool);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

fn api_key(req: &axum::http::request::Parts) -> Option<String> {
    req.headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A layer on `idem` with a fresh scope and the `x-api-key` tenant.
fn layer_on<S: idem::IdempotencyStore>(idem: Idempotency<S>) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(idem)
        .scope(scope())
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
}

async fn spawn_server(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

struct RawReply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl RawReply {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

async fn post_raw(
    url: &str,
    key: &str,
    tenant: Option<&str>,
    content_type: &str,
    body: impl Into<reqwest::Body>,
) -> RawReply {
    let mut request = client()
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", content_type)
        .body(body);
    if let Some(tenant) = tenant {
        request = request.header("x-api-key", tenant);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("{e}"));
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .bytes()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .to_vec();
    RawReply {
        status,
        headers,
        body,
    }
}

/// Retries while the answer is 409 "in progress" (as a client honouring
/// Retry-After would), at most for 20 s.
async fn post_until_done(url: &str, key: &str, tenant: &str, body: &Value) -> Reply {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let r = post_json(url, Some(key), tenant, body).await;
        if r.status != 409 || r.headers.get("retry-after").is_none() {
            return r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still in progress after 20 s: {:?}",
            r.body
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

fn assert_not_replayable(r: &RawReply) {
    assert_eq!(
        r.status,
        409,
        "a duplicate of a not replayable key: {}",
        String::from_utf8_lossy(&r.body[..r.body.len().min(300)])
    );
    assert_eq!(
        r.headers.get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/problem+json"[..])
    );
    assert!(
        r.headers.get("retry-after").is_none(),
        "retrying will not help: no Retry-After"
    );
    let title = r.json()["title"].as_str().unwrap_or("").to_owned();
    assert!(title.contains("not recorded"), "title: {title}");
}

/// 1. A client that times out while its request runs, then retries with
/// the same key: the handler runs once, the retry gets 409 while it runs,
/// then the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_and_retries_does_not_run_the_handler_twice() {
    let executions = Arc::new(AtomicU64::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let handler = {
        let (executions, gate) = (executions.clone(), gate.clone());
        move |axum::Extension(context): axum::Extension<idem::Context>, Json(body): Json<Value>| async move {
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

    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(500))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let first = tokio::spawn({
        let (url, body) = (url.clone(), body.clone());
        async move {
            impatient
                .post(&url)
                .header("idempotency-key", "gives-up")
                .header("x-api-key", "t1")
                .json(&body)
                .send()
                .await
        }
    });
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
    // (PgStore on this branch does not set fences yet: 0.)
    assert!(r.body["fence"].is_u64());
    assert_eq!(executions.load(Ordering::SeqCst), 1, "one execution");
}

/// 1b. `.detached(false)`: the handler runs in the request's future, so a
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
    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(500))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let first = tokio::spawn({
        let url = url.clone();
        async move {
            impatient
                .post(&url)
                .header("idempotency-key", "cut-off")
                .header("x-api-key", "t1")
                .json(&json!({}))
                .send()
                .await
        }
    });
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

/// 2. The default recording policy: everything but 401, 408, 425, 429,
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

/// 2b. A recording policy that panics once the handler ran records (a
/// release could run the handler twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_record_policy_records() {
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

/// 3. A response the store refuses (over its size limit) is not released:
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

/// 4. A request whose tenant cannot be determined is refused with 401,
/// unless anonymous use is turned on; then all anonymous callers share one
/// key space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_callers_are_refused_unless_allowed() {
    let server = serve().await;
    let payments = format!("{}/payments", server.url);
    let body = br#"{"amount":1}"#.to_vec();
    for _ in 0..2 {
        let r = post_raw(&payments, "anon", None, "application/json", body.clone()).await;
        assert_eq!(
            (r.status, r.json()["status"].as_u64()),
            (401, Some(401)),
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    }
    let r = post_raw(
        &payments,
        "anon",
        Some(""),
        "application/json",
        body.clone(),
    )
    .await;
    assert_eq!(r.status, 401, "an empty tenant is no tenant");
    assert_eq!(server.app.effects.load(Ordering::SeqCst), 0);

    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move || async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            Json(json!({ "execution": n }))
        }
    };
    let store = pg_store().await;
    let no_tenant = IdempotencyLayer::new(Idempotency::new(store.clone()))
        .scope(scope())
        .unwrap_or_else(|e| panic!("{e}"));
    let anonymous = no_tenant.clone().allow_anonymous(true);
    let mixed = layer_on(Idempotency::new(store)).allow_anonymous(true);
    let url = spawn_server(
        Router::new()
            .route("/no-tenant", post(handler.clone()).layer(no_tenant))
            .route("/anonymous", post(handler.clone()).layer(anonymous))
            .route("/mixed", post(handler).layer(mixed)),
    )
    .await;
    let r = post_raw(
        &format!("{url}/no-tenant"),
        "k",
        Some("t1"),
        "text/plain",
        "",
    )
    .await;
    assert_eq!(r.status, 401, "no tenant function: nobody is known");
    assert_eq!(executions.load(Ordering::SeqCst), 0);

    let at = format!("{url}/anonymous");
    let a = post_raw(&at, "shared", None, "text/plain", "").await;
    let b = post_raw(&at, "shared", Some("t2"), "text/plain", "").await;
    assert_eq!((a.status, a.replayed()), (200, false));
    assert_eq!(
        (b.status, b.replayed(), &b.body),
        (200, true, &a.body),
        "allowed anonymous callers share one key space"
    );

    let at = format!("{url}/mixed");
    let anon = post_raw(&at, "k", None, "text/plain", "").await;
    let known = post_raw(&at, "k", Some("t1"), "text/plain", "").await;
    assert_eq!(
        (anon.replayed(), known.replayed()),
        (false, false),
        "a known tenant never shares keys with anonymous callers"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 3);
}

/// 5. The caller whose request ran gets the handler's response unchanged;
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

/// 6a. A body over the response limit (default 1 MiB) reaches its caller in
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

/// 6b. A `text/event-stream` response is streamed at once, never buffered:
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

/// 7. A builder method called on a clone of a layer does not panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_methods_work_on_a_clone() {
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

/// 8. An invalid scope is an error of the layer's construction, never a
/// 400 that blames the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_scope_is_refused_when_the_layer_is_built() {
    let layer = IdempotencyLayer::new(Idempotency::new(pg_store().await));
    for bad in ["not a valid scope!", "", &"s".repeat(65), "é"] {
        let refused = layer.clone().scope(bad);
        assert!(
            matches!(
                refused,
                Err(idem::KeyError::InvalidScopeChar { .. }
                    | idem::KeyError::EmptyScope
                    | idem::KeyError::ScopeTooLong { .. })
            ),
            "{bad:?}: {refused:?}"
        );
    }
    let layer = layer
        .scope(scope())
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key);
    let url = spawn_server(
        Router::new()
            .route("/x", post(|| async { "ran" }))
            .layer(layer),
    )
    .await;
    let r = post_raw(&format!("{url}/x"), "k", Some("t1"), "text/plain", "").await;
    assert_eq!((r.status, r.body.as_slice()), (200, &b"ran"[..]));
}

/// 9. A valid key on a long path (or for a long tenant) is never refused,
/// and two long paths (tenants) that differ only at the end never share a
/// key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_paths_and_tenants_never_refuse_a_valid_key_nor_collide() {
    let executions = Arc::new(AtomicU64::new(0));
    let handler = {
        let executions = executions.clone();
        move |uri: axum::http::Uri| async move {
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            Json(json!({ "execution": n, "path": uri.path() }))
        }
    };
    let url = spawn_server(
        Router::new()
            .route("/long/{*rest}", post(handler))
            .layer(layer_on(Idempotency::new(pg_store().await))),
    )
    .await;
    let path_a = format!("/long/{}a", "p".repeat(173));
    let path_b = format!("/long/{}b", "p".repeat(173));
    assert_eq!(path_a.len(), 180);
    for key in ["k".repeat(255), "/%".repeat(127) + "/"] {
        let a = post_raw(
            &format!("{url}{path_a}"),
            &key,
            Some("t1"),
            "text/plain",
            "",
        )
        .await;
        assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
        assert_eq!(a.json()["path"], path_a.as_str());
        let b = post_raw(
            &format!("{url}{path_b}"),
            &key,
            Some("t1"),
            "text/plain",
            "",
        )
        .await;
        assert_eq!(
            (b.status, b.replayed()),
            (200, false),
            "another path, its own key"
        );
        assert_eq!(b.json()["path"], path_b.as_str());
        let a2 = post_raw(
            &format!("{url}{path_a}"),
            &key,
            Some("t1"),
            "text/plain",
            "",
        )
        .await;
        assert_eq!((a2.status, a2.replayed()), (200, true));
        assert_eq!(a2.body, a.body);
    }
    let tenant_a = format!("{}a", "t".repeat(299));
    let tenant_b = format!("{}b", "t".repeat(299));
    let at = format!("{url}{path_a}");
    let a = post_raw(&at, "tenant-key", Some(&tenant_a), "text/plain", "").await;
    let b = post_raw(&at, "tenant-key", Some(&tenant_b), "text/plain", "").await;
    assert_eq!(
        (a.status, a.replayed(), b.status, b.replayed()),
        (200, false, 200, false)
    );
    assert_ne!(a.body, b.body, "each tenant ran its own");
    assert_eq!(executions.load(Ordering::SeqCst), 6);
}

/// 10. A 500 from the layer never echoes the store's error text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_errors_are_not_echoed_to_the_client() {
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

/// 11. The fingerprint of a JSON body is its canonical JSON: a retry with
/// reordered fields and other whitespace is a replay; numbers keep their
/// exact text, so two bodies with different big numbers never share one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_bodies_are_fingerprinted_canonically_with_exact_numbers() {
    let server = serve().await;
    let payments = format!("{}/payments", server.url);
    let json_ct = "application/json";
    let first = post_raw(
        &payments,
        "canon",
        Some("t1"),
        json_ct,
        r#"{"amount":1200,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(first.status, 201);
    let reordered = post_raw(
        &payments,
        "canon",
        Some("t1"),
        "application/json; charset=utf-8",
        "{ \"currency\" : \"EUR\",\n  \"amount\": 1200 }\n",
    )
    .await;
    assert_eq!(
        (reordered.status, reordered.replayed()),
        (201, true),
        "{}",
        String::from_utf8_lossy(&reordered.body)
    );
    assert_eq!(reordered.body, first.body);

    let big = post_raw(
        &payments,
        "big-number",
        Some("t1"),
        json_ct,
        r#"{"amount":12345678901234567890123}"#,
    )
    .await;
    assert_eq!(big.status, 201);
    let other = post_raw(
        &payments,
        "big-number",
        Some("t1"),
        json_ct,
        r#"{"amount":12345678901234567890124}"#,
    )
    .await;
    assert_eq!(other.status, 422, "another number is another request");
    let same = post_raw(
        &payments,
        "big-number",
        Some("t1"),
        json_ct,
        r#"{ "amount" : 12345678901234567890123 }"#,
    )
    .await;
    assert_eq!((same.status, same.replayed()), (201, true));

    // Deeper than any parser should recurse: hashed as bytes, no crash.
    let deep = format!("{}{}", "[".repeat(500), "]".repeat(500));
    let d1 = post_raw(&payments, "deep", Some("t1"), json_ct, deep.clone()).await;
    let d2 = post_raw(&payments, "deep", Some("t1"), json_ct, deep).await;
    assert_eq!(d1.status, d2.status);
    assert!(d2.replayed());
    let bad = post_raw(&payments, "not-json", Some("t1"), json_ct, "{not json").await;
    let bad2 = post_raw(&payments, "not-json", Some("t1"), json_ct, "{not json").await;
    assert_eq!(
        (bad.status, bad2.status, bad2.replayed()),
        (bad.status, bad.status, true)
    );
    assert_eq!(server.app.effects.load(Ordering::SeqCst), 2);
}

/// Review finding R2: a layer inside a nested router (`/accounts/{account}`)
/// sees the stripped path (`/transfer`); it keys and fingerprints by the
/// path the client sent, so one account's request is never answered with
/// another account's recorded response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_in_a_nested_router_keys_by_the_whole_path() {
    use axum::extract::Path;
    async fn transfer(
        State(done): State<Arc<std::sync::Mutex<Vec<String>>>>,
        Path(account): Path<String>,
        Json(body): Json<Value>,
    ) -> (StatusCode, Json<Value>) {
        done.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(account.clone());
        (
            StatusCode::CREATED,
            Json(json!({ "account": account, "amount": body["amount"] })),
        )
    }
    let pool = support::pg::pool(support::pg::shared_url(), 4).await;
    let store = PgStore::new(pool);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let layer = IdempotencyLayer::new(Idempotency::new(store))
        .scope(format!("http.nested.{:08x}", fastrand::u32(..)))
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(|req| {
            req.headers
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    let done: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let accounts = Router::new()
        .route("/transfer", post(transfer))
        .layer(layer);
    let router = Router::new()
        .nest("/accounts/{account}", accounts)
        .with_state(done.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    let client = reqwest::Client::new();
    let send = |account: &'static str| {
        client
            .post(format!("{url}/accounts/{account}/transfer"))
            .header("x-api-key", "tenant-1")
            .header("idempotency-key", "k-1")
            .json(&json!({ "amount": 100 }))
            .send()
    };
    for account in ["1", "2", "1"] {
        let response = send(account).await.unwrap_or_else(|e| panic!("{e}"));
        let replayed = response.headers().get("idempotent-replayed").is_some();
        let body: Value = response.json().await.unwrap_or_default();
        assert_eq!(body["account"], account, "account {account} got {body}");
        let _ = replayed;
    }
    let ran = done.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(ran, ["1", "2"], "each account's transfer ran once");
}

// ---------------------------------------------------------------------------
// Issue 15, item 10: the hooks (header name, key functions, route
// templates, the replay hook, problem rendering), each with its attacks.

/// A handler that counts its runs and answers with its run number and the
/// body it got.
fn counting_route(runs: &Arc<AtomicU64>) -> axum::routing::MethodRouter {
    let runs = runs.clone();
    post(move |body: String| {
        let runs = runs.clone();
        async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                Json(json!({ "run": run, "body": body })),
            )
        }
    })
}

async fn send(
    url: &str,
    headers: &[(&str, &str)],
    content_type: &str,
    body: impl Into<reqwest::Body>,
) -> RawReply {
    let mut request = client()
        .post(url)
        .header("content-type", content_type)
        .body(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("{e}"));
    RawReply {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response
            .bytes()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .to_vec(),
    }
}

/// The key from another header: `Idempotency-Key` is then ignored, and a
/// header that cannot carry a key (hop-by-hop, forbidden to browsers, a
/// credential) is refused when the layer is built.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_name_moves_the_key_and_refuses_hop_by_hop_and_credentials() {
    use axum::http::header::HeaderName;
    let base = layer_on(Idempotency::new(pg_store().await));
    for name in [
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "proxy-authorization",
        "content-length",
        "host",
        "expect",
        "origin",
        "sec-fetch-mode",
        "authorization",
        "cookie",
    ] {
        let refused = base
            .clone()
            .header_name(HeaderName::from_static(name))
            .map(|_| ());
        let error = refused.expect_err(name);
        assert_eq!(error.name(), name);
    }
    let layer = base
        .header_name(HeaderName::from_static("x-request-id"))
        .unwrap_or_else(|e| panic!("{e}"));
    let runs = Arc::new(AtomicU64::new(0));
    let url = spawn_server(
        Router::new()
            .route("/p", counting_route(&runs))
            .layer(layer),
    )
    .await;
    let url = format!("{url}/p");

    let old = send(
        &url,
        &[("x-api-key", "t1"), ("idempotency-key", "k")],
        "text/plain",
        "a",
    )
    .await;
    assert_eq!(
        old.status, 400,
        "the default header no longer carries a key"
    );
    assert!(String::from_utf8_lossy(&old.body).contains("x-request-id"));
    let first = send(
        &url,
        &[("x-api-key", "t1"), ("x-request-id", "r-1")],
        "text/plain",
        "a",
    )
    .await;
    let again = send(
        &url,
        &[("x-api-key", "t1"), ("x-request-id", "\"r-1\"")],
        "text/plain",
        "a",
    )
    .await;
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, first.body);
    // Two keys in one request: which one counts is ambiguous, so neither.
    let twice = client()
        .post(&url)
        .header("x-api-key", "t1")
        .header("x-request-id", "r-1")
        .header("x-request-id", "r-2")
        .body("a")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(twice.status(), 400);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A key function's result is checked like the header: a control
/// character or 10 KiB is a 400 (never a panic, never a run), also when
/// the key is not required; a panicking key function is a 500 without its
/// text; two tenants and two paths with one key never share a record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_functions_are_checked_and_scoped_like_the_header() {
    let runs = Arc::new(AtomicU64::new(0));
    let layer = layer_on(Idempotency::new(pg_store().await))
        .required(false)
        .key_from(|req| {
            let value = req.headers.get("x-key")?.to_str().ok()?;
            match value {
                "control" => Some("a\u{1}b".to_owned()),
                "huge" => Some("k".repeat(10 * 1024)),
                "empty" => Some(String::new()),
                "panic" => panic!("secret-extractor-text"),
                other => Some(other.to_owned()),
            }
        });
    let url = spawn_server(
        Router::new()
            .route("/a", counting_route(&runs))
            .route("/b", counting_route(&runs))
            .layer(layer),
    )
    .await;
    let a = format!("{url}/a");
    for bad in ["control", "huge", "empty"] {
        let r = send(
            &a,
            &[("x-api-key", "t1"), ("x-key", bad)],
            "text/plain",
            "x",
        )
        .await;
        assert_eq!(r.status, 400, "{bad}: {}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["status"], 400);
    }
    let r = send(
        &a,
        &[("x-api-key", "t1"), ("x-key", "panic")],
        "text/plain",
        "x",
    )
    .await;
    assert_eq!(r.status, 500);
    assert!(!String::from_utf8_lossy(&r.body).contains("secret-extractor-text"));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no bad key ran the handler");

    // No key and not required: passed through, every time.
    let r1 = send(&a, &[("x-api-key", "t1")], "text/plain", "x").await;
    let r2 = send(&a, &[("x-api-key", "t1")], "text/plain", "x").await;
    assert_eq!((r1.status, r2.status, r2.replayed()), (201, 201, false));
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // One key, two tenants and two paths: four records, four runs.
    let b = format!("{url}/b");
    let mut bodies = Vec::new();
    for (tenant, url) in [("t1", &a), ("t2", &a), ("t1", &b), ("t2", &b)] {
        let r = send(
            url,
            &[("x-api-key", tenant), ("x-key", "same")],
            "text/plain",
            "x",
        )
        .await;
        assert_eq!((r.status, r.replayed()), (201, false), "{tenant} {url}");
        bodies.push(r.json()["run"].clone());
    }
    assert_eq!(bodies, [json!(3), json!(4), json!(5), json!(6)]);
    for (tenant, url, run) in [("t1", &a, 3), ("t2", &b, 6)] {
        let r = send(
            url,
            &[("x-api-key", tenant), ("x-key", "same")],
            "text/plain",
            "x",
        )
        .await;
        assert_eq!(
            (r.status, r.replayed(), r.json()["run"].clone()),
            (201, true, json!(run))
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 6);
}

/// The key in a JSON body field: the body is buffered first (413 over the
/// limit), a request without the field passes through with its body
/// intact when the key is not required, and the same key with another
/// body is a mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_from_the_body() {
    let runs = Arc::new(AtomicU64::new(0));
    let layer = layer_on(Idempotency::new(pg_store().await))
        .required(false)
        .max_body_bytes(256)
        .key_from_body(|_, body| {
            let body: Value = serde_json::from_slice(body).ok()?;
            Some(body.get("request_id")?.as_str()?.to_owned())
        });
    let url = spawn_server(
        Router::new()
            .route("/p", counting_route(&runs))
            .layer(layer),
    )
    .await;
    let url = format!("{url}/p");
    let t1 = [("x-api-key", "t1")];
    let ct = "application/json";

    let first = send(&url, &t1, ct, r#"{"request_id":"r-1","amount":5}"#).await;
    let again = send(&url, &t1, ct, r#"{ "amount": 5, "request_id": "r-1" }"#).await;
    assert_eq!(
        (first.status, again.status, again.replayed()),
        (201, 201, true)
    );
    let other = send(&url, &t1, ct, r#"{"request_id":"r-1","amount":6}"#).await;
    assert_eq!(other.status, 422, "one key, another body");
    let bad = send(
        &url,
        &t1,
        ct,
        format!(r#"{{"request_id":"{}"}}"#, "k".repeat(300)),
    )
    .await;
    assert_eq!(
        bad.status, 413,
        "over max_body_bytes before the key is read"
    );
    let bad = send(&url, &t1, ct, r#"{"request_id":"has\ttab"}"#).await;
    assert_eq!(bad.status, 400);
    let unkeyed = send(&url, &t1, ct, r#"{"amount":7}"#).await;
    assert_eq!(unkeyed.status, 201);
    assert_eq!(
        unkeyed.json()["body"],
        r#"{"amount":7}"#,
        "the body reached the handler"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    let anonymous = send(&url, &[], ct, r#"{"request_id":"r-2"}"#).await;
    assert_eq!(anonymous.status, 401);
}

/// Route templates: two accounts share the route's record, so the same
/// key on another account is a 422 (its fingerprint has the concrete
/// path), never the other account's response and never a run;
/// `request_key` with the template finds the record. A layer outside the
/// router sees no `MatchedPath` and keys by the concrete path. On Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_templates_share_a_record_and_refuse_another_path() {
    use axum::extract::Path;
    let redis = support::redis_server::RedisServer::start(&[]);
    let store = Arc::new(
        idem::redis::RedisStore::connect(&redis.url)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let runs: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let transfer = {
        let runs = runs.clone();
        post(move |Path(id): Path<String>| {
            let runs = runs.clone();
            async move {
                runs.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(id.clone());
                (StatusCode::CREATED, Json(json!({ "account": id })))
            }
        })
    };
    let scope = scope();
    let layer = IdempotencyLayer::new(Idempotency::new(store.clone()))
        .scope(scope.clone())
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
        .route_template(true);
    let inside = spawn_server(
        Router::new()
            .route("/accounts/{id}/transfer", transfer.clone())
            .layer(layer.clone()),
    )
    .await;
    let outside_scope = format!("{scope}.out");
    let outside_layer = layer
        .scope(outside_scope.clone())
        .unwrap_or_else(|e| panic!("{e}"));
    // The layer wraps the whole router, which is served as a fallback (no
    // route of the outer router matches, so no MatchedPath).
    let outside = spawn_server(Router::new().fallback_service(tower::Layer::layer(
        &outside_layer,
        Router::new().route("/accounts/{id}/transfer", transfer),
    )))
    .await;
    let h = [("x-api-key", "t1"), ("idempotency-key", "k-1")];
    let ct = "application/json";

    let one = send(&format!("{inside}/accounts/1/transfer"), &h, ct, "{}").await;
    assert_eq!(
        (one.status, one.json()["account"].clone()),
        (201, json!("1"))
    );
    let two = send(&format!("{inside}/accounts/2/transfer"), &h, ct, "{}").await;
    assert_eq!(two.status, 422, "{}", String::from_utf8_lossy(&two.body));
    assert!(!String::from_utf8_lossy(&two.body).contains("\"1\""));
    let one_again = send(&format!("{inside}/accounts/1/transfer?"), &h, ct, "{}").await;
    assert_eq!(
        one_again.status, 422,
        "the query is part of the fingerprint"
    );
    let one_again = send(&format!("{inside}/accounts/1/transfer"), &h, ct, "{}").await;
    assert_eq!((one_again.status, one_again.replayed()), (201, true));
    assert_eq!(one_again.body, one.body);
    let template = idem::http::request_key(&scope, "t1", "POST", "/accounts/{id}/transfer", "k-1")
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        idem::IdempotencyStore::get(&*store, &template)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_some(),
        "request_key with the template finds the record"
    );

    // Outside the router: no MatchedPath, the concrete path.
    let one = send(&format!("{outside}/accounts/1/transfer"), &h, ct, "{}").await;
    let two = send(&format!("{outside}/accounts/2/transfer"), &h, ct, "{}").await;
    assert_eq!((one.status, two.status, two.replayed()), (201, 201, false));
    assert_eq!(two.json()["account"], "2");
    for path in ["/accounts/1/transfer", "/accounts/2/transfer"] {
        let key = idem::http::request_key(&outside_scope, "t1", "POST", path, "k-1")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            idem::IdempotencyStore::get(&*store, &key)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_some(),
            "{path}"
        );
    }
    let ran = runs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(ran, ["1", "1", "2"]);
}

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
    let url = spawn_server(
        Router::new()
            .route("/p", counting_route(&runs))
            .layer(layer),
    )
    .await;
    let url = format!("{url}/p");
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
async fn custom_problem_rendering() {
    use axum::response::IntoResponse;
    use idem::http::Problem;
    let render = |problem: &Problem| {
        if problem.kind == idem::http::ProblemKind::CallerUnknown {
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

/// The store goes away right after the handler's effect, for 3 s, three
/// times the 1 s lease: the executor gives up recording the response
/// (`IdemError::Unrecorded`). The client still gets the handler's 201. The
/// layer writes the completion with the same lease once the store is back
/// (before: nothing did, and a retry after the lease took the key over and
/// ran the handler again); the retry then gets the replay, and the effect
/// ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_past_the_lease_while_recording_never_runs_the_handler_twice() {
    let (store, down) = support::flaky::FlakyStore::new(idem::MemoryStore::new());
    let idem = Idempotency::new(store).lease(std::time::Duration::from_secs(1));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                down.store(true, Ordering::SeqCst);
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_secs(3));
                    down.store(false, Ordering::SeqCst);
                });
            }
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}/payments",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    let first = post_json(&url, Some("k-outage"), "t1", &json!({})).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // A retry while the response is still to be written: 409 from the
    // layer itself, the store not asked (after the lease it would let the
    // retry take the key over).
    let during = post_json(&url, Some("k-outage"), "t1", &json!({})).await;
    assert_eq!(during.status, 409, "{:?}", during.body);
    // Once the store is back, the completion is written (awaited, 20 s).
    let key = idem::http::request_key("http", "t1", "POST", "/payments", "k-outage")
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

// review16b
/// A store whose `complete` fails (`Unavailable`) while `fail` is set; every
/// other call reaches the inner store (a completion that times out while
/// acquires still go through).
struct NoComplete<S> {
    inner: S,
    fail: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl<S: idem::IdempotencyStore> idem::IdempotencyStore for NoComplete<S> {
    async fn acquire(
        &self,
        key: &idem::IdempotencyKey,
        fingerprint: Option<&idem::Fingerprint>,
        lease: std::time::Duration,
    ) -> Result<idem::Acquisition, idem::StoreError> {
        self.inner.acquire(key, fingerprint, lease).await
    }
    async fn complete(
        &self,
        lease: &idem::Lease,
        response: &[u8],
        retention: std::time::Duration,
    ) -> Result<(), idem::StoreError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(idem::StoreError::Unavailable(Box::new(
                support::flaky::Down,
            )));
        }
        self.inner.complete(lease, response, retention).await
    }
    async fn release(&self, lease: &idem::Lease) -> Result<(), idem::StoreError> {
        self.inner.release(lease).await
    }
    async fn extend(
        &self,
        lease: &idem::Lease,
        lease_for: std::time::Duration,
    ) -> Result<idem::Lease, idem::StoreError> {
        self.inner.extend(lease, lease_for).await
    }
    async fn get(
        &self,
        key: &idem::IdempotencyKey,
    ) -> Result<Option<idem::Record>, idem::StoreError> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &idem::IdempotencyKey) -> Result<bool, idem::StoreError> {
        self.inner.delete(key).await
    }
    async fn purge_expired(&self, max: usize) -> Result<u64, idem::StoreError> {
        self.inner.purge_expired(max).await
    }
}

// review16b
/// The first request's completion cannot be written before the executor
/// gives up (`Unrecorded`): the layer keeps its key in `Finishing` and
/// answers 409 itself. A request with the same key and a *different* body
/// is not a retry of that request: DESIGN 2 ("a later acquire of a live
/// record with a different fingerprint is Mismatch, whatever the record's
/// state", 422). The store is reachable for acquires (it would answer
/// Mismatch: the record is live, in progress), but the layer never asks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review16b_a_different_body_while_the_response_is_finishing_is_422_not_409() {
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store = NoComplete {
        inner: idem::MemoryStore::new(),
        fail: fail.clone(),
    };
    let idem = Idempotency::new(store).lease(std::time::Duration::from_secs(1));
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, fail) = (effects.clone(), fail.clone());
        move || async move {
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            fail.store(true, Ordering::SeqCst);
            (StatusCode::CREATED, format!("payment {n}"))
        }
    };
    let router = Router::new()
        .route("/payments", post(handler))
        .layer(IdempotencyLayer::new(idem.clone()).tenant(api_key));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}/payments",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    let first = post_json(&url, Some("k-rv16b"), "t1", &json!({ "amount": 1 })).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    // What the store itself says to the other body (control).
    let key = idem::http::request_key("http", "t1", "POST", "/payments", "k-rv16b")
        .unwrap_or_else(|e| panic!("{e}"));
    let record = idem.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        record.as_ref().is_some_and(|r| !r.is_completed()),
        "the record is live and in progress: {record:?}"
    );
    let other = post_json(&url, Some("k-rv16b"), "t1", &json!({ "amount": 2 })).await;
    fail.store(false, Ordering::SeqCst);
    assert_eq!(
        (other.status, effects.load(Ordering::SeqCst)),
        (422, 1),
        "a different body with the key of a response being finished: {:?}",
        other.body
    );
}
