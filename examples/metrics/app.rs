//! The `metrics` example's app: the Prometheus recorder, an idempotent
//! `POST /payments` on PostgreSQL, `GET /metrics`, and the `idem_records`
//! gauge. `tests/stores/metrics_export.rs` includes this file, so the test
//! that checks the Grafana dashboard (`docs/grafana/idem.json`) reads the
//! exposition of this very app.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use idemkit::http::IdempotencyLayer;
use idemkit::postgres::{PgStore, ScopeCounts};
use idemkit::{Idempotency, KeyError, StoreError, STORE_DURATION_SECONDS};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};

/// The upper bounds, in seconds, of the buckets of
/// `idem_store_duration_seconds` (0.5 ms to 10 s). Without buckets the
/// exporter writes a histogram as a summary, whose quantiles can be
/// neither aggregated across instances nor computed by
/// `histogram_quantile`.
pub(crate) const STORE_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The gauge of the store's records, labelled `scope` and `state`
/// (`in_progress`, `stuck`, `completed`, `expired`, `corrupt`), as
/// [`PgStore::counts`] counts them.
pub(crate) const RECORDS: &str = "idem_records";

/// The values of the `state` label of [`RECORDS`], in the order of
/// [`counts_by_state`].
const STATES: [&str; 5] = ["in_progress", "stuck", "completed", "expired", "corrupt"];

fn counts_by_state(c: &ScopeCounts) -> [u64; 5] {
    [c.in_progress, c.stuck, c.completed, c.expired, c.corrupt]
}

/// Installs the Prometheus recorder for the whole process (once: a second
/// call is an error), with buckets for the store-latency histogram, and
/// describes idem's metrics and [`RECORDS`]. The handle renders the
/// exposition text; call its `run_upkeep` every few seconds.
pub(crate) fn install_recorder() -> Result<PrometheusHandle, BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(STORE_DURATION_SECONDS.into()), &STORE_BUCKETS)?
        .install_recorder()?;
    idemkit::describe_metrics();
    metrics::describe_gauge!(
        RECORDS,
        metrics::Unit::Count,
        "Records in the PostgreSQL store by scope and state (in_progress, stuck: in progress with \
         its lease over, completed, expired: not purged yet, corrupt), from PgStore::counts."
    );
    Ok(handle)
}

/// Sets [`RECORDS`] from [`PgStore::counts`]. A scope whose rows are all
/// gone (purged, deleted) is set to zero rather than left at its last
/// count.
#[derive(Debug, Default)]
pub(crate) struct RecordGauges {
    /// The scopes set by the last update.
    scopes: BTreeSet<String>,
}

impl RecordGauges {
    /// Counts the store's rows by scope and state and sets the gauges; the
    /// counts are returned. A count that fails sets the gauges of every
    /// scope it knows to NaN (no value: a panel shows a gap, never a count
    /// that is no longer true) and returns the error. One statement that reads the whole table (no
    /// index serves it): every few seconds, not on a request's path.
    pub(crate) async fn update(&mut self, store: &PgStore) -> Result<Vec<ScopeCounts>, StoreError> {
        let counts = match store.counts().await {
            Ok(counts) => counts,
            Err(e) => {
                for scope in &self.scopes {
                    for state in STATES {
                        set_records(scope, state, f64::NAN);
                    }
                }
                return Err(e);
            }
        };
        let mut scopes = BTreeSet::new();
        for c in &counts {
            for (state, n) in STATES.into_iter().zip(counts_by_state(c)) {
                set_records(&c.scope, state, n as f64);
            }
            scopes.insert(c.scope.clone());
        }
        for gone in self.scopes.difference(&scopes) {
            for state in STATES {
                set_records(gone, state, 0.0);
            }
        }
        self.scopes = scopes;
        Ok(counts)
    }
}

fn set_records(scope: &str, state: &'static str, n: f64) {
    metrics::gauge!(RECORDS, "scope" => scope.to_owned(), "state" => state).set(n);
}

/// The app: `POST /payments` behind the `Idempotency-Key` layer (scope
/// `payments.api`, the tenant from the `x-api-key` header) over `store`,
/// and `GET /metrics` rendering `metrics`.
pub(crate) fn app(store: PgStore, metrics: PrometheusHandle) -> Result<Router, KeyError> {
    let layer = IdempotencyLayer::new(Idempotency::new(store))
        .scope("payments.api")?
        // Who is calling: here an API key header; in a real API the
        // principal an auth layer verified.
        .tenant(|req| {
            req.headers
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    let payments = Router::new()
        .route("/payments", post(create_payment))
        .layer(layer)
        .with_state(Arc::new(AtomicU64::new(0)));
    let exposition = Router::new()
        .route("/metrics", get(render_metrics))
        .with_state(metrics);
    Ok(payments.merge(exposition))
}

#[derive(Debug, Deserialize)]
struct NewPayment {
    amount_cents: i64,
}

#[derive(Debug, Serialize)]
struct Payment {
    payment_id: u64,
    amount_cents: i64,
}

/// The business handler: takes the payment (here: gives it a number) and
/// answers 201.
async fn create_payment(
    State(last): State<Arc<AtomicU64>>,
    Json(p): Json<NewPayment>,
) -> impl IntoResponse {
    let payment_id = last.fetch_add(1, Ordering::Relaxed) + 1;
    (
        StatusCode::CREATED,
        Json(Payment {
            payment_id,
            amount_cents: p.amount_cents,
        }),
    )
}

/// `GET /metrics`: the Prometheus text exposition format.
async fn render_metrics(State(metrics): State<PrometheusHandle>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics.render(),
    )
}
