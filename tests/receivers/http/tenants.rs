//! Tenants: the same key from two tenants never shares a record, and a
//! caller whose tenant cannot be determined is refused unless anonymous
//! use is turned on (then anonymous callers share one key space, apart
//! from every known tenant). Tenant isolation under load: `isolation`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::routing::post;
use axum::{Json, Router};
use idemkit::http::IdempotencyLayer;
use idemkit::Idempotency;
use serde_json::json;

use super::{layer_on, pg_store, post_json, post_raw, scope, serve, spawn_server};

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

/// A request whose tenant cannot be determined is refused with 401,
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

/// A tenant function that panics is answered with a clean 500 problem
/// (before, the panic killed the connection: the client saw an incomplete
/// message); the handler never runs, and the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_tenant_function_is_a_500_and_runs_nothing() {
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let effects = effects.clone();
        move || async move {
            effects.fetch_add(1, Ordering::SeqCst);
            "ran"
        }
    };
    let layer = IdempotencyLayer::new(Idempotency::new(idemkit::MemoryStore::new())).tenant(
        |parts: &axum::http::request::Parts| -> Option<String> {
            if parts.headers.contains_key("x-boom") {
                panic!("the tenant lookup failed");
            }
            Some("t1".to_owned())
        },
    );
    let url = format!(
        "{}/payments",
        spawn_server(Router::new().route("/payments", post(handler)).layer(layer)).await
    );
    let client = reqwest::Client::new();
    let r = client
        .post(&url)
        .header("idempotency-key", "k-boom")
        .header("x-boom", "1")
        .body("{}")
        .send()
        .await
        .unwrap_or_else(|e| panic!("the connection was cut: {e}"));
    assert_eq!(r.status().as_u16(), 500);
    let text = r.text().await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !text.contains("tenant lookup"),
        "the panic is not echoed: {text}"
    );
    assert_eq!(effects.load(Ordering::SeqCst), 0);
    let r = client
        .post(&url)
        .header("idempotency-key", "k-ok")
        .body("{}")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}
