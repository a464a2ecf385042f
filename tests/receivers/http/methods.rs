//! Which methods the layer applies to, how a method is keyed, and `HEAD` answers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::{HeaderMap, Method, StatusCode};
use axum::routing::get;
use axum::Router;
use idemkit::http::IdempotencyLayer;
use idemkit::Idempotency;

use super::{api_key, client, layer_on, pg_store, scope, spawn_server};

/// A handler that reads methods without regard to case (a fallback, as
/// a case-blind router or a forwarding handler would be) and counts its
/// runs.
fn counting(runs: &Arc<AtomicU64>) -> Router {
    let counted = runs.clone();
    Router::new().fallback(move || {
        let runs = counted.clone();
        async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("run-{run}"))
        }
    })
}

async fn call(url: &str, method: &str, key: &str) -> (u16, bool, String) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let reply = client()
        .request(method, format!("{url}/pay"))
        .header("idempotency-key", key)
        .header("x-api-key", "t1")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let replayed = reply.headers().contains_key("idempotent-replayed");
    let status = reply.status().as_u16();
    (status, replayed, reply.text().await.unwrap_or_default())
}

/// The default layer (`POST`, `PATCH`): the docs say a method is keyed in
/// upper case, `post` and `POST` under one key being one key. `post`
/// after `POST` with the same key must not run the handler again.
#[tokio::test(flavor = "multi_thread")]
async fn default_methods_post_after_post_with_one_key_never_runs_twice() {
    let runs = Arc::new(AtomicU64::new(0));
    let url = spawn_server(
        counting(&runs).layer(layer_on(Idempotency::new(idemkit::MemoryStore::new()))),
    )
    .await;
    let first = call(&url, "POST", "pk-1").await;
    let lower = call(&url, "post", "pk-1").await;
    let listed = {
        // `.methods([POST])` said in so many words: the same.
        let runs2 = Arc::new(AtomicU64::new(0));
        let url2 = spawn_server(counting(&runs2).layer(
            layer_on(Idempotency::new(idemkit::MemoryStore::new())).methods([Method::POST]),
        ))
        .await;
        let a = call(&url2, "POST", "pk-2").await;
        let b = call(&url2, "post", "pk-2").await;
        (a, b, runs2.load(Ordering::SeqCst))
    };
    assert_eq!(first, (201, false, "run-1".to_owned()));
    assert!(
        runs.load(Ordering::SeqCst) == 1 && listed.2 == 1,
        "one key ran twice: POST got {first:?}, then post got {lower:?} \
         (with .methods([POST]): {:?} then {:?}, {} runs)",
        listed.0,
        listed.1,
        listed.2
    );
}

/// `HEAD` on an axum `get` route under a layer that covers `HEAD`
/// (`Router::layer`, so the layer sees the GET handler's body): the first
/// answer and the replay say the same `Content-Length`, and the body is
/// never sent.
#[tokio::test(flavor = "multi_thread")]
async fn head_on_a_get_route_replays_the_length_its_caller_got() {
    let runs = Arc::new(AtomicU64::new(0));
    let counted = runs.clone();
    let route = get(move || {
        let runs = counted.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            "hello world"
        }
    });
    let url = spawn_server(
        Router::new()
            .route("/doc", route)
            .layer(layer_on(Idempotency::new(idemkit::MemoryStore::new())).every_method()),
    )
    .await;
    let mut seen = Vec::new();
    for _ in 0..2 {
        let reply = client()
            .head(format!("{url}/doc"))
            .header("idempotency-key", "hd-1")
            .header("x-api-key", "t1")
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        seen.push((
            reply.status().as_u16(),
            reply.headers().contains_key("idempotent-replayed"),
            reply
                .headers()
                .get("content-length")
                .map(|v| v.to_str().unwrap_or("").to_owned()),
        ));
    }
    assert_eq!(
        seen,
        vec![
            (200, false, Some("11".to_owned())),
            (200, true, Some("11".to_owned()))
        ]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The in-transaction layer on `HEAD`: the replay keeps the handler's
/// `Content-Length`.
#[tokio::test(flavor = "multi_thread")]
async fn in_transaction_head_replay_keeps_its_length() {
    let store = pg_store().await;
    let layer = IdempotencyLayer::new(Idempotency::new(store))
        .scope(scope())
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
        .every_method()
        .in_transaction();
    let handler = || async {
        let mut headers = HeaderMap::new();
        headers.insert(
            "content-length",
            "1234".parse().unwrap_or_else(|e| panic!("{e}")),
        );
        (StatusCode::OK, headers)
    };
    let url = spawn_server(Router::new().fallback(handler).layer(layer)).await;
    let mut seen = Vec::new();
    for _ in 0..2 {
        let reply = client()
            .head(format!("{url}/doc"))
            .header("idempotency-key", "txh-1")
            .header("x-api-key", "t1")
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        seen.push((
            reply.headers().contains_key("idempotent-replayed"),
            reply
                .headers()
                .get("content-length")
                .map(|v| v.to_str().unwrap_or("").to_owned()),
        ));
    }
    assert_eq!(
        seen,
        vec![
            (false, Some("1234".to_owned())),
            (true, Some("1234".to_owned()))
        ]
    );
}
