//! Tenant isolation under load: 8 tenants use the same idempotency keys
//! (and the same payloads) through two app instances, each with its own
//! in-process moka tier, sharing a Redis cache tier and the PostgreSQL
//! source of truth; over HTTP, and through the executor with no layer (a
//! tenant as a scope). Every response carries its author's tag; no tenant
//! may ever get another's response, whatever tier answers.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idemkit::http::IdempotencyLayer;
use idemkit::postgres::PgStore;
use idemkit::tiered::{MokaCache, RedisCache, TieredStore};
use idemkit::{IdemError, Idempotency, IdempotencyKey, Processed};
use serde_json::{json, Value};

use super::{api_key, spawn_server};

const TENANTS: usize = 8;
const KEYS: usize = 50;
const REQUESTS: usize = 10_000;
const CONCURRENCY: usize = 64;

/// An app instance's store: its own moka, the shared Redis cache tier and
/// the shared PostgreSQL source.
async fn tiered_store() -> TieredStore<PgStore> {
    let pool = support::pg::pool(support::pg::shared_url(), 16).await;
    let source = PgStore::builder(pool)
        .connections(16)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    source.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    TieredStore::new(source)
        .with_cache(MokaCache::new(100_000, 64 << 20))
        .with_cache(
            RedisCache::connect(support::redis_server::shared_url())
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        )
}

/// Effects per (tenant, key), counted by the handler.
type Effects = Arc<Mutex<HashMap<(String, String), u64>>>;

#[derive(Clone)]
struct App {
    effects: Effects,
    serial: Arc<AtomicU64>,
}

/// The handler: its response names the tenant that sent the request.
async fn charge(
    State(app): State<App>,
    headers: HeaderMap,
    Json(_body): Json<Value>,
) -> impl IntoResponse {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (tenant, key) = (header("x-api-key"), header("idempotency-key"));
    *app.effects
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((tenant.clone(), key.clone()))
        .or_default() += 1;
    let serial = app.serial.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        Json(json!({ "tenant": tenant, "key": key, "serial": serial })),
    )
}

async fn spawn_instance(app: App, scope: &str) -> String {
    let layer = IdempotencyLayer::new(Idempotency::new(tiered_store().await))
        .scope(scope)
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key);
    let router = Router::new()
        .route("/charges", post(charge))
        .layer(layer)
        .with_state(app);
    format!("{}/charges", spawn_server(router).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_tenants_sharing_keys_over_http_never_see_each_others_responses() {
    let scope = format!("iso.{:08x}", fastrand::u32(..));
    let app = App {
        effects: Arc::default(),
        serial: Arc::default(),
    };
    let instances = [
        spawn_instance(app.clone(), &scope).await,
        spawn_instance(app.clone(), &scope).await,
    ];
    let client = reqwest::Client::new();
    let next = Arc::new(AtomicUsize::new(0));
    let in_progress = Arc::new(AtomicUsize::new(0));
    // The first response each (tenant, key) got: every later one must equal it.
    let first: Arc<Mutex<HashMap<(String, String), Value>>> = Arc::default();
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..CONCURRENCY {
        let (client, next, in_progress, first, instances) = (
            client.clone(),
            next.clone(),
            in_progress.clone(),
            first.clone(),
            instances.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(w as u64);
            while next.fetch_add(1, Ordering::SeqCst) < REQUESTS {
                let tenant = format!("tenant-{}", rng.usize(..TENANTS));
                let key = format!("order-{}", rng.usize(..KEYS));
                let deadline = Instant::now() + Duration::from_secs(30);
                let body = loop {
                    let url = &instances[rng.usize(..instances.len())];
                    let response = client
                        .post(url)
                        .header("x-api-key", &tenant)
                        .header("idempotency-key", &key)
                        .json(&json!({ "amount": 100, "currency": "EUR" }))
                        .send()
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    let status = response.status().as_u16();
                    let body: Value = response.json().await.unwrap_or(Value::Null);
                    if status == 409 {
                        in_progress.fetch_add(1, Ordering::SeqCst);
                        assert!(
                            Instant::now() < deadline,
                            "{tenant} {key}: in progress for 30 s"
                        );
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                    assert_eq!(status, 201, "{tenant} {key}: {body}");
                    break body;
                };
                assert_eq!(
                    body["tenant"], tenant,
                    "{tenant} got another tenant's response for {key}: {body}"
                );
                assert_eq!(body["key"], key, "{tenant} got the response of another key");
                let mut first = first.lock().unwrap_or_else(|p| p.into_inner());
                let seen = first
                    .entry((tenant.clone(), key.clone()))
                    .or_insert(body.clone());
                assert_eq!(*seen, body, "{tenant} {key}: a replay differs from the run");
            }
        }));
    }
    for w in workers {
        w.await.unwrap_or_else(|e| panic!("{e}"));
    }
    let effects = app
        .effects
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let pairs = first.lock().unwrap_or_else(|p| p.into_inner()).len();
    assert_eq!(effects.len(), pairs, "every (tenant, key) asked ran");
    for ((tenant, key), n) in &effects {
        assert_eq!(*n, 1, "{tenant} {key} ran {n} times");
    }
    support::report::report(
        "tenant_isolation_http",
        "tiered",
        &[
            ("tenants", TENANTS.to_string()),
            ("shared_keys", KEYS.to_string()),
            ("requests", REQUESTS.to_string()),
            ("instances", "2".into()),
            ("executions", effects.len().to_string()),
            (
                "in_progress_409",
                in_progress.load(Ordering::SeqCst).to_string(),
            ),
            ("foreign_responses", "0".into()),
        ],
        started,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_tenants_sharing_ids_in_the_tiered_store_never_see_each_others_results() {
    let run = format!("{:08x}", fastrand::u32(..));
    let instances = [
        Idempotency::new(tiered_store().await),
        Idempotency::new(tiered_store().await),
    ];
    let effects: Effects = Arc::default();
    let next = Arc::new(AtomicUsize::new(0));
    let first: Arc<Mutex<HashMap<(String, String), String>>> = Arc::default();
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..CONCURRENCY {
        let (instances, effects, next, first, run) = (
            instances.clone(),
            effects.clone(),
            next.clone(),
            first.clone(),
            run.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(1000 + w as u64);
            while next.fetch_add(1, Ordering::SeqCst) < REQUESTS {
                // A tenant is a scope; every tenant uses the same ids.
                let tenant = format!("tenant{}.charge", rng.usize(..TENANTS));
                let id = format!("{run}-order-{}", rng.usize(..KEYS));
                let key = IdempotencyKey::new(&tenant, &id).unwrap_or_else(|e| panic!("{e}"));
                let deadline = Instant::now() + Duration::from_secs(30);
                let value = loop {
                    let idem = &instances[rng.usize(..instances.len())];
                    let (effects, tag) = (effects.clone(), (tenant.clone(), id.clone()));
                    match idem
                        .process(&key, "same payload", |_| async move {
                            *effects
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .entry(tag.clone())
                                .or_default() += 1;
                            Ok::<_, std::io::Error>(format!("{} {}", tag.0, tag.1))
                        })
                        .await
                    {
                        Ok(Processed::Executed(v)) | Ok(Processed::Replayed(v)) => break v,
                        Err(IdemError::InProgress { .. }) => {
                            assert!(Instant::now() < deadline, "{tenant} {id}: in progress");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        other => panic!("{tenant} {id}: {other:?}"),
                    }
                };
                assert_eq!(
                    value,
                    format!("{tenant} {id}"),
                    "{tenant} got another tenant's result"
                );
                first
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert((tenant, id), value);
            }
        }));
    }
    for w in workers {
        w.await.unwrap_or_else(|e| panic!("{e}"));
    }
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(
        effects.len(),
        first.lock().unwrap_or_else(|p| p.into_inner()).len()
    );
    for ((tenant, id), n) in &effects {
        assert_eq!(*n, 1, "{tenant} {id} ran {n} times");
    }
    support::report::report(
        "tenant_isolation_tiered",
        "tiered",
        &[
            ("tenants", TENANTS.to_string()),
            ("shared_ids", KEYS.to_string()),
            ("calls", REQUESTS.to_string()),
            ("instances", "2".into()),
            ("executions", effects.len().to_string()),
            ("foreign_results", "0".into()),
        ],
        started,
    );
}
