//! The `Idempotency-Key` layer through a real axum server on 127.0.0.1 and
//! a real HTTP client (reqwest), on PostgreSQL (a few on Redis):
//!
//! - `recording`: which responses are recorded and replayed, and what a
//!   replay carries (status policy, headers, bodies over the limits,
//!   streams);
//! - `keys`: where a key comes from (the header, another header, a key
//!   function, the body), how it is checked, scoped by tenant and path,
//!   and what the fingerprint covers;
//! - `in_progress`: duplicates while the first request runs, clients that
//!   give up, detached and not;
//! - `in_transaction`: the in-transaction form: a server killed between
//!   its INSERT and the commit, duplicates during the open transaction, a
//!   panic, a released status, a failed commit, 64 duplicates on a pool
//!   of 8; `in_transaction_edges`: what handlers, clients and settings
//!   can do to it;
//! - `outages`: the store unreachable or failing while a response is
//!   recorded, and what the client is told;
//! - `tenants`: tenants sharing keys, anonymous callers;
//! - `isolation`: tenant isolation under load, two app instances on a
//!   tiered store;
//! - `hooks`: the replay hook and a custom problem rendering;
//! - `streaming`: bodies still coming when the handler returns: streamed
//!   to their caller, copied and recorded whatever the caller does.
//!
//! `cargo test --all-features --test receivers http::` runs them.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idemkit::http::IdempotencyLayer;
use idemkit::postgres::PgStore;
use idemkit::Idempotency;
use serde_json::{json, Value};

mod hooks;
mod in_progress;
mod in_transaction;
mod in_transaction_edges;
#[cfg(feature = "tiered")]
mod isolation;
mod keys;
mod methods;
mod outages;
mod recording;
mod streaming;
mod tenants;

/// The payments app of [`serve`]: its handlers count their effects.
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

/// A server of the payments app behind a layer on PostgreSQL (a scope of
/// its own, the `x-api-key` tenant, bodies up to 1 KiB).
struct Server {
    url: String,
    app: App,
}

async fn serve() -> Server {
    let layer = layer_on(Idempotency::new(pg_store().await)).max_body_bytes(1024);
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
    Server {
        url: spawn_server(router).await,
        app,
    }
}

/// A reply, its body parsed as JSON (a JSON string of its text if it
/// is not JSON).
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

/// Posts `body` as JSON for `tenant`, with `key` as `Idempotency-Key`.
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

/// A scope of its own for a layer.
fn scope() -> String {
    format!("http.{:08x}", fastrand::u32(..))
}

/// A `PgStore` on the shared PostgreSQL, migrated.
async fn pg_store() -> PgStore {
    let pool = support::pg::pool(support::pg::shared_url(), 8).await;
    let store = PgStore::new(pool);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

/// The tenant: the `x-api-key` header.
fn api_key(req: &axum::http::request::Parts) -> Option<String> {
    req.headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A layer on `idem` with a fresh scope and the `x-api-key` tenant.
fn layer_on<S: idemkit::IdempotencyStore>(idem: Idempotency<S>) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(idem)
        .scope(scope())
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
}

/// Serves `router` on a free port; its `http://host:port`.
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

/// A reply, its body as it came.
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

/// Posts `body` as `content_type` with `key` as `Idempotency-Key`, for
/// `tenant` if any.
async fn post_raw(
    url: &str,
    key: &str,
    tenant: Option<&str>,
    content_type: &str,
    body: impl Into<reqwest::Body>,
) -> RawReply {
    let mut headers = vec![("idempotency-key", key)];
    if let Some(tenant) = tenant {
        headers.push(("x-api-key", tenant));
    }
    send(url, &headers, content_type, body).await
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

/// A duplicate of a key whose response was not recorded: a 409 problem
/// saying so, without `Retry-After`.
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

/// Serves `POST /p` (a [`counting_route`]) behind `layer`; its URL.
async fn serve_counting(layer: IdempotencyLayer<PgStore>, runs: &Arc<AtomicU64>) -> String {
    let url = spawn_server(Router::new().route("/p", counting_route(runs)).layer(layer)).await;
    format!("{url}/p")
}

/// Posts `body` with `headers`; the reply as it came.
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
