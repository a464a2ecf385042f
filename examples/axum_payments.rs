//! A `POST /payments` API made idempotent by the `Idempotency-Key` layer,
//! on PostgreSQL or on the tiered store (moka -> Redis -> PostgreSQL).
//!
//! ```text
//! cargo run --features http,postgres,tiered,redis --example axum_payments -- --postgres-url postgres://... [--backend tiered --redis-url redis://...]
//! ```
//!
//! Without `--serve` it starts the API on a free port, plays a client that
//! retries, reuses a key with another body, races 16 identical requests and
//! uses one key from two tenants, then checks the `payments` table: one row
//! per payment, whatever the retries. It exits with status 1 if not.
//!
//! With `--serve 127.0.0.1:3000` it only serves (for a load tool);
//! `--no-idempotency` serves the same handler without the layer.
//!
//! `--backend in-transaction` runs the layer's in-transaction form: the
//! handler inserts its row on the request's transaction (`RequestTx`),
//! which commits with the recorded response.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Extension, Json, Router};
use clap::{Parser, ValueEnum};
use idemkit::http::{IdempotencyLayer, RequestTx};
use idemkit::postgres::PgStore;
use idemkit::{Idempotency, IdempotencyStore};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    /// PgStore.
    Postgres,
    /// moka, then Redis (--redis-url), then PostgreSQL.
    Tiered,
    /// PgStore, the layer's in-transaction form: the INSERT commits with
    /// the recorded response.
    InTransaction,
}

#[derive(Debug, Parser)]
#[command(about = "An idempotent POST /payments API, and a client that proves it")]
struct Args {
    #[arg(long, value_enum, default_value = "postgres")]
    backend: Backend,
    #[arg(long, env = "IDEM_POSTGRES_URL")]
    postgres_url: String,
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: Option<String>,
    /// Only serve on this address.
    #[arg(long)]
    serve: Option<String>,
    /// Serve the handler without the idempotency layer (with --serve).
    #[arg(long)]
    no_idempotency: bool,
}

#[derive(Debug, Deserialize)]
struct NewPayment {
    order_id: i64,
    amount_cents: i64,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Payment {
    payment_id: i64,
    order_id: i64,
    amount_cents: i64,
}

const INSERT: &str = "INSERT INTO payments (order_id, amount_cents) VALUES ($1, $2) RETURNING id";

/// The business handler: charges (here: inserts a row) and answers 201.
async fn create_payment(
    State(pool): State<PgPool>,
    Json(p): Json<NewPayment>,
) -> axum::response::Response {
    let row: Result<(i64,), _> = sqlx::query_as(INSERT)
        .bind(p.order_id)
        .bind(p.amount_cents)
        .fetch_one(&pool)
        .await;
    answer(&p, row)
}

/// The same handler in the in-transaction form: the row is inserted on
/// the request's transaction, which commits with the recorded response.
async fn create_payment_in_tx(
    Extension(tx): Extension<RequestTx>,
    Json(p): Json<NewPayment>,
) -> axum::response::Response {
    let row: Result<(i64,), sqlx::Error> = match tx.lock().await {
        Ok(mut tx) => {
            sqlx::query_as(INSERT)
                .bind(p.order_id)
                .bind(p.amount_cents)
                .fetch_one(&mut *tx)
                .await
        }
        Err(e) => Err(sqlx::Error::Protocol(e.to_string())),
    };
    answer(&p, row)
}

fn answer(p: &NewPayment, row: Result<(i64,), sqlx::Error>) -> axum::response::Response {
    match row {
        Ok((payment_id,)) => (
            StatusCode::CREATED,
            Json(serde_json::json!(Payment {
                payment_id,
                order_id: p.order_id,
                amount_cents: p.amount_cents
            })),
        ),
        Err(e) => {
            // Logged, not sent: a client never sees internal error text.
            eprintln!("payment insert failed: {e}");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(serde_json::json!({ "error": "try again later" })),
            )
        }
    }
    .into_response()
}

/// What the layer runs on.
enum Layered {
    /// A store the layer holds leases in.
    Store(Arc<dyn IdempotencyStore>),
    /// The in-transaction form on PostgreSQL.
    InTransaction(PgStore),
}

async fn store(args: &Args, pool: PgPool) -> Result<Layered, Box<dyn std::error::Error>> {
    let pg = PgStore::builder(pool).connections(32).build()?;
    pg.migrate().await?;
    Ok(match args.backend {
        Backend::Postgres => Layered::Store(Arc::new(pg)),
        Backend::InTransaction => Layered::InTransaction(pg),
        Backend::Tiered => {
            use idemkit::tiered::{MokaCache, RedisCache, TieredStore};
            let url = args
                .redis_url
                .as_deref()
                .ok_or("--backend tiered needs --redis-url (or IDEM_REDIS_URL)")?;
            Layered::Store(Arc::new(
                TieredStore::new(pg)
                    .with_cache(MokaCache::new(100_000, 64 << 20))
                    .with_cache(RedisCache::connect(url).await?),
            ))
        }
    })
}

/// Who is calling: here an API key header; in a real API the principal
/// an auth layer verified.
fn tenant(req: &axum::http::request::Parts) -> Option<String> {
    req.headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn app(pool: PgPool, layered: Option<Layered>) -> Result<Router, idemkit::KeyError> {
    let router = match layered {
        Some(Layered::Store(store)) => Router::new()
            .route("/payments", post(create_payment))
            .layer(
                IdempotencyLayer::new(
                    Idempotency::from_arc(store).retention(Duration::from_secs(86_400)),
                )
                .scope("payments.api")?
                .tenant(tenant),
            ),
        Some(Layered::InTransaction(store)) => Router::new()
            .route("/payments", post(create_payment_in_tx))
            .layer(
                IdempotencyLayer::new(
                    Idempotency::new(store).retention(Duration::from_secs(86_400)),
                )
                .scope("payments.api")?
                .tenant(tenant)
                .in_transaction(),
            ),
        None => Router::new().route("/payments", post(create_payment)),
    };
    Ok(router.with_state(pool))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(32)
        .connect(&args.postgres_url)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments (id bigserial PRIMARY KEY, order_id int8 NOT NULL, amount_cents int8 NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let store = if args.no_idempotency {
        None
    } else {
        Some(store(&args, pool.clone()).await?)
    };
    let addr = args
        .serve
        .clone()
        .unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let url = format!("http://{}/payments", listener.local_addr()?);
    let server = tokio::spawn(axum::serve(listener, app(pool.clone(), store)?).into_future());
    if args.serve.is_some() {
        println!("serving POST {url}");
        server.await??;
        return Ok(());
    }
    let ok = demo(&url, &pool).await?;
    server.abort();
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// Plays a client and checks the payments table.
async fn demo(url: &str, pool: &PgPool) -> Result<bool, Box<dyn std::error::Error>> {
    let client = reqwest::Client::new();
    let order = i64::from(fastrand::u32(..));
    let post = |key: &str, tenant: &str, amount: i64| {
        client
            .post(url)
            .header("idempotency-key", key)
            .header("x-api-key", tenant)
            .json(&serde_json::json!({ "order_id": order, "amount_cents": amount }))
            .send()
    };
    let rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments WHERE order_id = $1")
            .bind(order)
            .fetch_one(pool)
            .await
    };
    let key = format!("pay-{order}");
    let mut ok = true;
    let mut check = |what: &str, pass: bool| {
        println!("  {} {what}", if pass { "ok  " } else { "FAIL" });
        ok &= pass;
    };
    println!("POST {url}, order {order}");

    let first = post(&key, "shop-a", 1200).await?;
    let first_status = first.status();
    let first_body: serde_json::Value = first.json().await?;
    check(
        &format!("first request: {first_status} {first_body}"),
        first_status == 201,
    );
    let retry = post(&key, "shop-a", 1200).await?;
    let replayed = retry.headers().get("idempotent-replayed").is_some();
    let retry_status = retry.status();
    let retry_body: serde_json::Value = retry.json().await?;
    check(
        &format!(
            "retry with the same key: {retry_status}, Idempotent-Replayed: {replayed}, same body"
        ),
        retry_status == 201 && replayed && retry_body == first_body,
    );
    let other = post(&key, "shop-a", 9999).await?;
    check(
        &format!(
            "same key, another amount: {} (application/problem+json)",
            other.status()
        ),
        other.status() == 422,
    );
    let racing: Vec<_> = (0..16)
        .map(|_| post(&format!("{key}-race"), "shop-a", 500))
        .collect();
    let statuses: Vec<u16> = futures::future::join_all(racing)
        .await
        .into_iter()
        .map(|r| r.map(|r| r.status().as_u16()).unwrap_or(0))
        .collect();
    let created = statuses.iter().filter(|&&s| s == 201).count();
    let conflicts = statuses.iter().filter(|&&s| s == 409).count();
    check(
        &format!("16 identical requests at once: {created} x 201 (1 ran, the rest replayed), {conflicts} x 409 in progress"),
        created + conflicts == 16 && created >= 1,
    );
    let other_tenant = post(&key, "shop-b", 1200).await?;
    check(
        &format!(
            "the same key from another tenant: {} (its own payment)",
            other_tenant.status()
        ),
        other_tenant.status() == 201 && other_tenant.headers().get("idempotent-replayed").is_none(),
    );
    let n = rows().await?;
    check(
        &format!(
            "payments table: {n} rows for the order (shop-a once, shop-a's race once, shop-b once)"
        ),
        n == 3,
    );
    println!("check: {}", if ok { "PASS" } else { "FAIL" });
    Ok(ok)
}
