//! The metrics idem emits, their descriptions, and the store-call timer.
//!
//! idem records through the [`metrics`] facade: nothing is kept or exported
//! until the application installs a recorder (for example
//! `metrics-exporter-prometheus`). Call [`describe_metrics`] once after
//! installing it, so the exporter knows each metric's help text and unit.

use std::future::Future;
// tokio's clock: the same as std's unless a test paused time, where a
// sample then measures the paused clock, as the executor's deadlines do.
use tokio::time::Instant;

use metrics::{Key, Label, Metadata};

use crate::error::StoreError;

/// The histogram of store-call latency, in seconds, labelled `backend`
/// ([`IdempotencyStore::backend_name`](crate::IdempotencyStore::backend_name)),
/// `operation` ([`StoreOperation::as_str`]) and `outcome` (`ok` or
/// `error`).
pub const STORE_DURATION_SECONDS: &str = "idem_store_duration_seconds";

/// The counters of the executor, labelled `scope`, with their help texts.
const EXECUTOR_COUNTERS: [(&str, &str); 11] = [
    (
        "idem_acquired_total",
        "Keys acquired: the handler ran (first delivery, or a takeover after a lease ended).",
    ),
    (
        "idem_replayed_total",
        "Duplicates answered with the recorded result; the handler did not run.",
    ),
    (
        "idem_in_progress_total",
        "Acquires that found the key held by another worker with a live lease.",
    ),
    (
        "idem_mismatch_total",
        "Acquires of a live key with a different payload fingerprint (key reused).",
    ),
    (
        "idem_lease_lost_total",
        "Completions refused because another worker took the key over.",
    ),
    (
        "idem_released_total",
        "Keys released after a handler error or panic, so a retry runs again.",
    ),
    (
        "idem_not_replayable_total",
        "Results that could not be recorded for replay; the key is completed all the same.",
    ),
    (
        "idem_result_unavailable_total",
        "Duplicates of a key whose result could not be recorded.",
    ),
    (
        "idem_unrecorded_total",
        "Handlers that ran whose completion the store did not take before the lease ended (to finish).",
    ),
    (
        "idem_finished_total",
        "Completions written later by Idempotency::finish after an unrecorded result.",
    ),
    (
        "idem_finish_lost_total",
        "Unrecorded results whose finish got LeaseLost: another worker took the key over after the lease (its handler may have run again).",
    ),
];

/// A store operation, the `operation` label of [`STORE_DURATION_SECONDS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(usize)]
pub enum StoreOperation {
    /// [`IdempotencyStore::acquire`](crate::IdempotencyStore::acquire).
    Acquire,
    /// [`IdempotencyStore::complete`](crate::IdempotencyStore::complete).
    Complete,
    /// [`IdempotencyStore::release`](crate::IdempotencyStore::release).
    Release,
    /// [`IdempotencyStore::extend`](crate::IdempotencyStore::extend).
    Extend,
    /// [`IdempotencyStore::get`](crate::IdempotencyStore::get).
    Get,
    /// [`IdempotencyStore::delete`](crate::IdempotencyStore::delete).
    Delete,
    /// [`IdempotencyStore::purge_expired`](crate::IdempotencyStore::purge_expired).
    PurgeExpired,
    /// [`IdempotencyStore::acquire_many`](crate::IdempotencyStore::acquire_many).
    AcquireMany,
    /// [`IdempotencyStore::complete_many`](crate::IdempotencyStore::complete_many).
    CompleteMany,
}

impl StoreOperation {
    /// Every operation.
    pub const ALL: [StoreOperation; 9] = [
        StoreOperation::Acquire,
        StoreOperation::Complete,
        StoreOperation::Release,
        StoreOperation::Extend,
        StoreOperation::Get,
        StoreOperation::Delete,
        StoreOperation::PurgeExpired,
        StoreOperation::AcquireMany,
        StoreOperation::CompleteMany,
    ];

    /// The label value: the method's name (`"acquire"`, `"purge_expired"`,
    /// `"acquire_many"`...).
    pub const fn as_str(self) -> &'static str {
        match self {
            StoreOperation::Acquire => "acquire",
            StoreOperation::Complete => "complete",
            StoreOperation::Release => "release",
            StoreOperation::Extend => "extend",
            StoreOperation::Get => "get",
            StoreOperation::Delete => "delete",
            StoreOperation::PurgeExpired => "purge_expired",
            StoreOperation::AcquireMany => "acquire_many",
            StoreOperation::CompleteMany => "complete_many",
        }
    }
}

/// Registers the description (and unit) of every metric the idem crates
/// emit with the installed recorder: the executor's counters, the
/// store-call histogram, `idem-tiered`'s tier counters and `idem-postgres`'s
/// connection gauge. Call it once, after installing the recorder (a
/// description given to no recorder is lost); calling it again is harmless.
///
/// ```
/// // After e.g. metrics_exporter_prometheus::PrometheusBuilder::new().install()?
/// idem_core::describe_metrics();
/// ```
pub fn describe_metrics() {
    for (name, help) in EXECUTOR_COUNTERS {
        metrics::describe_counter!(name, metrics::Unit::Count, help);
    }
    metrics::describe_histogram!(
        STORE_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Latency of one store call made by idem, by backend, operation and outcome (ok, error, or cancelled: dropped before it finished)."
    );
    metrics::describe_histogram!(
        crate::batching::STORE_BATCH_SIZE,
        metrics::Unit::Count,
        "Single calls served by one batched store call (natural batching), by backend and operation (acquire, complete)."
    );
    metrics::describe_counter!(
        "idem_tier_hits_total",
        metrics::Unit::Count,
        "idem-tiered: duplicates answered by a tier (tier=moka, redis, or source)."
    );
    metrics::describe_counter!(
        "idem_tier_fills_total",
        metrics::Unit::Count,
        "idem-tiered: completed records copied into a cache tier."
    );
    metrics::describe_counter!(
        "idem_tier_errors_total",
        metrics::Unit::Count,
        "idem-tiered: cache-tier failures, skipped (the source of truth answered)."
    );
    metrics::describe_gauge!(
        "idem_postgres_connections",
        metrics::Unit::Count,
        "idem-postgres: open connections of a PgStore's pool, by table."
    );
}

/// Runs one store call and records its latency in
/// [`STORE_DURATION_SECONDS`]. For the stores of the idem crates the key
/// is a prebuilt static one (no allocation per call, recorder or not);
/// another backend name builds its labels per call. A call dropped before
/// it finished (a heartbeat stopped when its handler ended, a dropped
/// `process` future) is recorded too, with outcome `cancelled`, for the
/// time it ran: the slow calls are the ones a timeout or a caller cuts off,
/// and leaving them out would make the latency read low.
pub(crate) async fn timed<T, F>(
    backend: &'static str,
    operation: StoreOperation,
    call: F,
) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>>,
{
    timed_since(Instant::now(), backend, operation, call).await
}

/// [`timed`], for a call that started at `started` (an instant the caller
/// read anyway: one clock read less on the hot path).
pub(crate) async fn timed_since<T, F>(
    started: Instant,
    backend: &'static str,
    operation: StoreOperation,
    call: F,
) -> Result<T, StoreError>
where
    F: Future<Output = Result<T, StoreError>>,
{
    let mut sample = Sample {
        backend,
        operation,
        started,
        outcome: Outcome::Cancelled,
    };
    let result = call.await;
    sample.outcome = if result.is_ok() {
        Outcome::Ok
    } else {
        Outcome::Error
    };
    result
}

#[derive(Clone, Copy)]
enum Outcome {
    Ok = 0,
    Error = 1,
    Cancelled = 2,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// One store call's sample, recorded when the call ends or is dropped.
struct Sample {
    backend: &'static str,
    operation: StoreOperation,
    started: Instant,
    outcome: Outcome,
}

impl Drop for Sample {
    fn drop(&mut self) {
        let seconds = self.started.elapsed().as_secs_f64();
        let labels = static_labels(self.backend)
            .and_then(|table| table.get(self.operation as usize))
            .map(|by_outcome| &by_outcome[self.outcome as usize]);
        match labels {
            Some(labels) => {
                let key = Key::from_static_parts(STORE_DURATION_SECONDS, labels);
                metrics::with_recorder(|r| r.register_histogram(&key, &METADATA)).record(seconds);
            }
            None => metrics::histogram!(
                STORE_DURATION_SECONDS,
                "backend" => self.backend,
                "operation" => self.operation.as_str(),
                "outcome" => self.outcome.as_str()
            )
            .record(seconds),
        }
    }
}

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The labels of one backend: `[operation][ok, error, cancelled]`, in the
/// order of [`StoreOperation`]'s variants.
type LabelTable = [[[Label; 3]; 3]; 9];

macro_rules! labels {
    ($backend:literal, $op:literal) => {
        [
            [
                Label::from_static_parts("backend", $backend),
                Label::from_static_parts("operation", $op),
                Label::from_static_parts("outcome", "ok"),
            ],
            [
                Label::from_static_parts("backend", $backend),
                Label::from_static_parts("operation", $op),
                Label::from_static_parts("outcome", "error"),
            ],
            [
                Label::from_static_parts("backend", $backend),
                Label::from_static_parts("operation", $op),
                Label::from_static_parts("outcome", "cancelled"),
            ],
        ]
    };
}

macro_rules! label_table {
    ($($name:ident = $backend:literal),*) => {$(
        static $name: LabelTable = [
            labels!($backend, "acquire"),
            labels!($backend, "complete"),
            labels!($backend, "release"),
            labels!($backend, "extend"),
            labels!($backend, "get"),
            labels!($backend, "delete"),
            labels!($backend, "purge_expired"),
            labels!($backend, "acquire_many"),
            labels!($backend, "complete_many"),
        ];
    )*};
}

label_table!(
    MEMORY = "memory",
    REDIS = "redis",
    POSTGRES = "postgres",
    TIERED = "tiered",
    CUSTOM = "custom"
);

fn static_labels(backend: &str) -> Option<&'static LabelTable> {
    match backend {
        "memory" => Some(&MEMORY),
        "redis" => Some(&REDIS),
        "postgres" => Some(&POSTGRES),
        "tiered" => Some(&TIERED),
        "custom" => Some(&CUSTOM),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prebuilt labels say what the per-call ones would.
    #[test]
    fn the_static_label_tables_match_the_names() {
        for backend in ["memory", "redis", "postgres", "tiered", "custom"] {
            let table = static_labels(backend).unwrap_or_else(|| panic!("{backend}"));
            for op in StoreOperation::ALL {
                for (i, outcome) in ["ok", "error", "cancelled"].into_iter().enumerate() {
                    let labels: Vec<(&str, &str)> = table[op as usize][i]
                        .iter()
                        .map(|l| (l.key(), l.value()))
                        .collect();
                    assert_eq!(
                        labels,
                        [
                            ("backend", backend),
                            ("operation", op.as_str()),
                            ("outcome", outcome)
                        ]
                    );
                }
            }
        }
        assert!(static_labels("dynamo").is_none());
    }

    /// A backend without a prebuilt table gets the same labels, built per
    /// call.
    #[test]
    fn other_backends_are_labelled_alike() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            futures::executor::block_on(async {
                let ok = timed("dynamo", StoreOperation::Get, async { Ok(1) }).await;
                let err: Result<(), _> = timed("memory", StoreOperation::Delete, async {
                    Err(StoreError::unavailable("down"))
                })
                .await;
                assert!(ok.is_ok() && err.is_err());
            });
        });
        let mut seen: Vec<Vec<(String, String)>> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                assert!(matches!(value, DebugValue::Histogram(ref v) if v.len() == 1));
                key.key()
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect()
            })
            .collect();
        seen.sort();
        let want = |b: &str, o: &str, r: &str| {
            vec![
                ("backend".to_owned(), b.to_owned()),
                ("operation".to_owned(), o.to_owned()),
                ("outcome".to_owned(), r.to_owned()),
            ]
        };
        assert_eq!(
            seen,
            [
                want("dynamo", "get", "ok"),
                want("memory", "delete", "error")
            ]
        );
    }

    #[test]
    fn operation_labels_are_the_method_names_and_distinct() {
        let names: std::collections::HashSet<&str> =
            StoreOperation::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(names.len(), StoreOperation::ALL.len());
        assert!(names.contains("purge_expired") && names.contains("complete_many"));
    }
}
