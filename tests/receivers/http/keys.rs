//! Where a key comes from and what it covers: the `Idempotency-Key`
//! header or another one (never a hop-by-hop or credential header), a key
//! function, a body field; every key checked like the header and scoped by
//! tenant and path (the whole path, also in a nested router; a route
//! template when asked); long paths and tenants never refused nor mixed
//! up; the JSON fingerprint canonical with exact numbers; invalid scopes
//! refused when the layer is built.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idemkit::http::IdempotencyLayer;
use idemkit::Idempotency;
use serde_json::{json, Value};

use super::{
    api_key, client, counting_route, layer_on, pg_store, post_raw, scope, send, serve,
    serve_counting, spawn_server,
};

/// The fingerprint of a JSON body is its canonical JSON: a retry with
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

/// With the fingerprint on the body's `/amount` and `/currency`, a retry
/// whose other fields differ (a timestamp the client sets on each try) is
/// the same request: replayed, the handler not run again; another amount
/// under the key is a 422; a body that is not JSON counts whole. On
/// PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_that_differs_outside_the_fingerprinted_parts_is_replayed() {
    let runs = Arc::new(AtomicU64::new(0));
    let parts = idemkit::PayloadFingerprint::json_pointers(["/amount", "/currency"])
        .unwrap_or_else(|e| panic!("{e}"));
    let layer = layer_on(Idempotency::new(pg_store().await)).fingerprint(parts);
    let url = serve_counting(layer, &runs).await;
    let json_ct = "application/json";
    let first = post_raw(
        &url,
        "parts",
        Some("t1"),
        json_ct,
        r#"{"amount":1200,"currency":"EUR","sent_at":"10:00:00"}"#,
    )
    .await;
    assert_eq!(first.status, 201);
    let retry = post_raw(
        &url,
        "parts",
        Some("t1"),
        json_ct,
        r#"{"sent_at":"10:00:07","currency":"EUR","amount":1200,"trace":"x"}"#,
    )
    .await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (201, true),
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    assert_eq!(retry.body, first.body);
    let other = post_raw(
        &url,
        "parts",
        Some("t1"),
        json_ct,
        r#"{"amount":1201,"currency":"EUR","sent_at":"10:00:09"}"#,
    )
    .await;
    assert_eq!(other.status, 422, "another amount is another request");
    // A field left out is another request too.
    let absent = post_raw(&url, "parts", Some("t1"), json_ct, r#"{"amount":1200}"#).await;
    assert_eq!(absent.status, 422, "a missing currency is another request");
    // Not JSON: the whole body, to the byte.
    let text = post_raw(&url, "text", Some("t1"), "text/plain", "pay 1200 EUR").await;
    assert_eq!(text.status, 201);
    let text_other = post_raw(&url, "text", Some("t1"), "text/plain", "pay 1200 EUR ").await;
    assert_eq!(text_other.status, 422);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the first payment and the text"
    );
}

/// A layer inside a nested router (`/accounts/{account}`) sees the
/// stripped path (`/transfer`); it keys and fingerprints by the path the
/// client sent, so one account's request is never answered with another
/// account's recorded response.
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
    let layer = IdempotencyLayer::new(Idempotency::new(pg_store().await))
        .scope(format!("http.nested.{:08x}", fastrand::u32(..)))
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key);
    let done: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let accounts = Router::new()
        .route("/transfer", post(transfer))
        .layer(layer);
    let router = Router::new()
        .nest("/accounts/{account}", accounts)
        .with_state(done.clone());
    let url = spawn_server(router).await;
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
    let url = serve_counting(layer, &runs).await;

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
async fn a_key_from_the_body_is_read_after_the_body_limit_and_checked() {
    let runs = Arc::new(AtomicU64::new(0));
    let layer = layer_on(Idempotency::new(pg_store().await))
        .required(false)
        .max_body_bytes(256)
        .key_from_body(|_, body| {
            let body: Value = serde_json::from_slice(body).ok()?;
            Some(body.get("request_id")?.as_str()?.to_owned())
        });
    let url = serve_counting(layer, &runs).await;
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
        idemkit::redis::RedisStore::connect(&redis.url)
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
    let template =
        idemkit::http::request_key(&scope, "t1", "POST", "/accounts/{id}/transfer", "k-1")
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        idemkit::IdempotencyStore::get(&*store, &template)
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
        let key = idemkit::http::request_key(&outside_scope, "t1", "POST", path, "k-1")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            idemkit::IdempotencyStore::get(&*store, &key)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_some(),
            "{path}"
        );
    }
    let ran = runs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(ran, ["1", "1", "2"]);
}

/// A valid key on a long path (or for a long tenant) is never refused,
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

/// An invalid scope is an error of the layer's construction, never a
/// 400 that blames the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_scope_is_refused_when_the_layer_is_built() {
    let layer = IdempotencyLayer::new(Idempotency::new(pg_store().await));
    for bad in ["not a valid scope!", "", &"s".repeat(65), "é"] {
        let refused = layer.clone().scope(bad);
        assert!(
            matches!(
                refused,
                Err(idemkit::KeyError::InvalidScopeChar { .. }
                    | idemkit::KeyError::EmptyScope
                    | idemkit::KeyError::ScopeTooLong { .. })
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

/// The method and the path are part of the key: the same `Idempotency-Key`
/// value on another method or another path (without route templates) is
/// another key and runs on its own, never a 422 and never a replay of the
/// other request; the same body under another media type is a 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_value_on_another_method_or_path_is_another_key() {
    let runs = Arc::new(AtomicU64::new(0));
    let handler = {
        let runs = runs.clone();
        move || async move {
            (
                StatusCode::CREATED,
                runs.fetch_add(1, Ordering::SeqCst).to_string(),
            )
        }
    };
    let router = Router::new()
        .route("/a", post(handler.clone()).patch(handler.clone()))
        .route("/b", post(handler))
        .layer(layer_on(Idempotency::new(idemkit::MemoryStore::new())));
    let url = spawn_server(router).await;
    let h = [("x-api-key", "t1"), ("idempotency-key", "same")];
    let ct = "application/json";
    let first = send(&format!("{url}/a"), &h, ct, "{}").await;
    let other_path = send(&format!("{url}/b"), &h, ct, "{}").await;
    let mut patch = client()
        .patch(format!("{url}/a"))
        .header("content-type", ct)
        .body("{}");
    for (name, value) in h {
        patch = patch.header(name, value);
    }
    let other_method = patch.send().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (
            first.status,
            other_path.status,
            other_method.status().as_u16()
        ),
        (201, 201, 201)
    );
    assert!(!other_path.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 3, "each ran on its own");
    let other_media = send(&format!("{url}/a"), &h, "text/plain", "{}").await;
    assert_eq!(other_media.status, 422);
    let again = send(&format!("{url}/a"), &h, ct, "{}").await;
    assert!(again.replayed() && again.body == first.body);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// A layer on the app and a clone of it on a nested router compute the
/// same key for one request. The inner layer passes the request through
/// (the outer one already holds the key): the handler runs once and its
/// response is recorded and replayed. (The inner one answered 409 "in
/// progress", which the outer recorded as the response for the whole
/// retention: the handler never ran.) An answer an idem layer makes
/// itself is never recorded by another: an inner layer of another scope
/// refusing a request (a missing key here) releases the outer key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_layers_run_the_handler_once_and_never_record_each_others_answers() {
    let runs = Arc::new(AtomicU64::new(0));
    let handler = {
        let runs = runs.clone();
        move || async move {
            (
                StatusCode::CREATED,
                format!("run {}", runs.fetch_add(1, Ordering::SeqCst) + 1),
            )
        }
    };
    let layer = layer_on(Idempotency::new(idemkit::MemoryStore::new()));
    let inner = Router::new()
        .route("/pay", post(handler.clone()))
        .layer(layer.clone());
    let other_scope = IdempotencyLayer::new(Idempotency::new(idemkit::MemoryStore::new()))
        .scope("http.inner")
        .unwrap_or_else(|e| panic!("{e}"))
        .tenant(api_key)
        .header_name(axum::http::HeaderName::from_static("x-inner-key"))
        .unwrap_or_else(|e| panic!("{e}"));
    let refusing = Router::new()
        .route("/pay", post(handler))
        .layer(other_scope);
    let app = Router::new()
        .nest("/v1", inner)
        .nest("/v2", refusing)
        .layer(layer);
    let url = spawn_server(app).await;
    let h = [("x-api-key", "t1"), ("idempotency-key", "k-nested")];
    let first = send(&format!("{url}/v1/pay"), &h, "application/json", "{}").await;
    assert_eq!(
        (
            first.status,
            String::from_utf8_lossy(&first.body).into_owned()
        ),
        (201, "run 1".to_owned())
    );
    let again = send(&format!("{url}/v1/pay"), &h, "application/json", "{}").await;
    assert!(
        again.replayed() && again.body == first.body,
        "{}",
        again.status
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The inner layer (its own scope and key header) refuses: 400, not
    // recorded by the outer one, so the request with the inner key runs.
    let refused = send(&format!("{url}/v2/pay"), &h, "application/json", "{}").await;
    assert_eq!(refused.status, 400);
    let h2 = [
        ("x-api-key", "t1"),
        ("idempotency-key", "k-nested"),
        ("x-inner-key", "i-1"),
    ];
    let ran = send(&format!("{url}/v2/pay"), &h2, "application/json", "{}").await;
    assert_eq!(
        (ran.status, ran.replayed()),
        (201, false),
        "{}",
        String::from_utf8_lossy(&ran.body)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Fingerprinted on `/order/amount`, a body that repeats `order` (the
/// second without an amount: the handler, where the last member wins,
/// reads no amount) counts whole: 422, never the first body's replay. On
/// PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_repeats_a_name_on_the_way_to_a_part_is_not_another_bodys_replay() {
    let runs = Arc::new(AtomicU64::new(0));
    let parts = idemkit::PayloadFingerprint::json_pointers(["/order/amount"])
        .unwrap_or_else(|e| panic!("{e}"));
    let layer = layer_on(Idempotency::new(pg_store().await)).fingerprint(parts);
    let r = runs.clone();
    // The handler charges what it reads at /order/amount (serde_json).
    let route = post(move |Json(body): Json<Value>| {
        let runs = r.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let amount = body.pointer("/order/amount").cloned();
            (StatusCode::CREATED, Json(json!({ "charged": amount })))
        }
    });
    let url = format!(
        "{}/p",
        spawn_server(Router::new().route("/p", route).layer(layer)).await
    );
    let json_ct = "application/json";
    let first = post_raw(
        &url,
        "dup-names",
        Some("t1"),
        json_ct,
        r#"{"order":{"amount":100}}"#,
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.json()["charged"], json!(100));
    let repeated = r#"{"order":{"amount":100},"order":{"amount_cents":5000}}"#;
    // What the handler would read in it: no amount.
    let read: Value = serde_json::from_str(repeated).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(read.pointer("/order/amount"), None);
    let second = post_raw(&url, "dup-names", Some("t1"), json_ct, repeated).await;
    assert!(
        !second.replayed(),
        "a body whose `order` the handler reads without an amount got the replay of `charged: 100` ({}, {})",
        second.status,
        String::from_utf8_lossy(&second.body)
    );
    assert_eq!(second.status, 422);
}

/// A `KeyPath` put in front of the layer (what `idem proxy` does with a
/// path in its normal form) keys two paths alike: the same key on the
/// other path finds the record and gets 422 (the fingerprint keeps each
/// request's own path), never the other path's replay nor a second run;
/// the first path's retry is its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_path_put_in_front_keys_two_paths_alike_and_the_fingerprint_tells_them_apart() {
    let runs = Arc::new(AtomicU64::new(0));
    let layer = layer_on(Idempotency::new(pg_store().await));
    let key_path = tower::util::MapRequestLayer::new(|mut request: axum::extract::Request| {
        request
            .extensions_mut()
            .insert(idemkit::http::KeyPath::new("/one-key"));
        request
    });
    let url = spawn_server(
        Router::new()
            .route("/a", counting_route(&runs))
            .route("/b", counting_route(&runs))
            .layer(layer)
            .layer(key_path),
    )
    .await;
    let (a, b) = (format!("{url}/a"), format!("{url}/b"));
    let first = post_raw(&a, "kp-1", Some("t1"), "application/json", "{}").await;
    assert_eq!(first.status, 201);
    let other = post_raw(&b, "kp-1", Some("t1"), "application/json", "{}").await;
    assert_eq!(other.status, 422, "another path under one key path");
    let again = post_raw(&a, "kp-1", Some("t1"), "application/json", "{}").await;
    assert!(again.replayed(), "{}", again.status);
    assert_eq!(again.body, first.body);
    // Another tenant is another key, whatever the key path.
    let t2 = post_raw(&b, "kp-1", Some("t2"), "application/json", "{}").await;
    assert_eq!((t2.status, t2.replayed()), (201, false));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// With `every_method`, the layer protects requests of any method,
/// extension methods included, and keys a method in any case as its upper
/// case: `post` and `POST` under one key are one key, told apart by the
/// fingerprint (`422`), so a server that reads methods without regard to
/// case never runs the key twice.
#[tokio::test(flavor = "multi_thread")]
async fn every_method_protects_extension_methods_and_keys_a_method_in_any_case() {
    let runs = Arc::new(AtomicU64::new(0));
    let counted = runs.clone();
    let handler = move || {
        let runs = counted.clone();
        async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("run-{run}"))
        }
    };
    let url = spawn_server(
        Router::new()
            .fallback(handler)
            .layer(layer_on(Idempotency::new(idemkit::MemoryStore::new())).every_method()),
    )
    .await;
    let call = |method: &'static str, key: &'static str| {
        let url = format!("{url}/pay");
        async move {
            let method =
                reqwest::Method::from_bytes(method.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
            let reply = client()
                .request(method, url)
                .header("idempotency-key", key)
                .header("x-api-key", "t1")
                .body("{}")
                .send()
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let replayed = reply.headers().contains_key("idempotent-replayed");
            let status = reply.status().as_u16();
            (status, replayed, reply.text().await.unwrap_or_default())
        }
    };
    assert_eq!(call("CHARGE", "m-1").await, (201, false, "run-1".into()));
    assert_eq!(call("CHARGE", "m-1").await, (201, true, "run-1".into()));
    assert_eq!(call("post", "m-2").await, (201, false, "run-2".into()));
    assert_eq!(call("POST", "m-2").await.0, 422, "one key, another method");
    assert_eq!(call("GET", "m-3").await, (201, false, "run-3".into()));
    assert_eq!(call("GET", "m-3").await, (201, true, "run-3".into()));
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}
