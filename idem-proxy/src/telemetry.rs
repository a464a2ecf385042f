//! The proxy's metrics (Prometheus text at `/metrics`) and logs.

use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::config::LogFormat;

/// Requests answered, by `route` (`protected`, `passed`) and `status`.
pub const REQUESTS: &str = "idem_proxy_requests_total";
/// Protected requests answered from the record (`idempotent-replayed`).
pub const REPLAYS: &str = "idem_proxy_replays_total";
/// Upstream calls that failed, by `kind` (`connect`: nothing was sent;
/// `timeout`, `broken`: the upstream may have acted).
pub const UPSTREAM_FAILURES: &str = "idem_proxy_upstream_failures_total";
/// Seconds from a request's arrival to its answer's head, by `route`.
pub const REQUEST_SECONDS: &str = "idem_proxy_request_duration_seconds";
/// Seconds the upstream took to answer a head.
pub const UPSTREAM_SECONDS: &str = "idem_proxy_upstream_duration_seconds";
/// Detached runs still going (the layer's `DetachedTasks`).
pub const DETACHED: &str = "idem_proxy_detached_tasks";

const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

/// Installs the process's Prometheus recorder and describes the metrics;
/// `None` (logged) when another recorder is installed already.
pub fn install_recorder() -> Option<PrometheusHandle> {
    let builder = PrometheusBuilder::new()
        .set_buckets(&BUCKETS)
        .expect("the buckets are not empty");
    match builder.install_recorder() {
        Ok(handle) => {
            idem_core::describe_metrics();
            metrics::describe_counter!(
                REQUESTS,
                "Requests answered by the proxy, by route and status."
            );
            metrics::describe_counter!(REPLAYS, "Protected requests answered from their record.");
            metrics::describe_counter!(UPSTREAM_FAILURES, "Upstream calls that failed, by kind.");
            metrics::describe_histogram!(
                REQUEST_SECONDS,
                metrics::Unit::Seconds,
                "Time to a request's answer head, by route."
            );
            metrics::describe_histogram!(
                UPSTREAM_SECONDS,
                metrics::Unit::Seconds,
                "Time for the upstream to answer a head."
            );
            metrics::describe_gauge!(
                DETACHED,
                "Detached runs still going (handlers and recordings)."
            );
            Some(handle)
        }
        Err(e) => {
            tracing::warn!(error = %e, "idem proxy: a metrics recorder is installed already; /metrics answers 503");
            None
        }
    }
}

pub(crate) fn upstream_answered(took: Duration) {
    metrics::histogram!(UPSTREAM_SECONDS).record(took.as_secs_f64());
}

pub(crate) fn upstream_failed(kind: &'static str) {
    metrics::counter!(UPSTREAM_FAILURES, "kind" => kind).increment(1);
}

pub(crate) fn answered(route: &'static str, status: u16, replayed: bool, took: Duration) {
    metrics::counter!(REQUESTS, "route" => route, "status" => status.to_string()).increment(1);
    if replayed {
        metrics::counter!(REPLAYS).increment(1);
    }
    metrics::histogram!(REQUEST_SECONDS, "route" => route).record(took.as_secs_f64());
}

/// Logs to stderr as text or JSON lines, filtered by `RUST_LOG` (default
/// `info`). Does nothing if a subscriber is set already.
pub fn init_logs(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
