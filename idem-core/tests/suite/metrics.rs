//! The metrics idem emits, read back with metrics-util's debugging
//! recorder: every store call the executor makes is one sample of
//! `idem_store_duration_seconds{backend, operation, outcome}`, and
//! `describe_metrics` gives every metric a description.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idem_core::testkit::Tap;
use idem_core::{
    describe_metrics, Idempotency, IdempotencyKey, IdempotencyStore, MemoryStore, StoreOperation,
    STORE_DURATION_SECONDS,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;

#[derive(Debug)]
struct Declined;

fn key(id: &str) -> IdempotencyKey {
    IdempotencyKey::new("metrics.test", id).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `body` on a paused current-thread runtime with `recorder` as the
/// local recorder.
fn recorded<F: std::future::Future<Output = ()>>(body: impl FnOnce() -> F) -> Snapshotter {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        runtime.block_on(body());
    });
    snapshotter
}

/// Samples of the store-call histogram by (backend, operation, outcome).
fn store_samples(snapshotter: &Snapshotter) -> HashMap<(String, String, String), Vec<f64>> {
    let mut out = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if key.key().name() != STORE_DURATION_SECONDS {
            continue;
        }
        assert_eq!(key.kind(), MetricKind::Histogram);
        let labels: HashMap<&str, &str> =
            key.key().labels().map(|l| (l.key(), l.value())).collect();
        assert_eq!(labels.len(), 3, "{labels:?}");
        let DebugValue::Histogram(samples) = value else {
            panic!("not a histogram: {value:?}");
        };
        let id = (
            labels["backend"].to_owned(),
            labels["operation"].to_owned(),
            labels["outcome"].to_owned(),
        );
        out.insert(id, samples.into_iter().map(|s| s.into_inner()).collect());
    }
    out
}

fn count(samples: &HashMap<(String, String, String), Vec<f64>>, op: &str, outcome: &str) -> usize {
    samples
        .get(&("memory".to_owned(), op.to_owned(), outcome.to_owned()))
        .map_or(0, Vec::len)
}

#[test]
fn every_store_call_is_one_sample_labelled_by_backend_operation_and_outcome() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let tap = store.clone();
    let snapshotter = recorded(|| async move {
        let idem = Idempotency::from_arc(store.clone())
            .lease(Duration::from_secs(3))
            .heartbeat_interval(Duration::from_secs(1));
        let ok = |_: u8| async { Ok::<_, Declined>(1u8) };
        // Fresh: acquire + complete. Duplicate: acquire.
        let _ = idem.process(&key("a"), 1u8, ok).await;
        let _ = idem.process(&key("a"), 1u8, ok).await;
        // A handler error: acquire + release.
        let _ = idem
            .process(&key("b"), 1u8, |_| async { Err::<u8, _>(Declined) })
            .await;
        // A slow handler: the heartbeat extends the lease twice.
        let _ = idem
            .process(&key("c"), 1u8, |_| async {
                tokio::time::sleep(Duration::from_millis(2500)).await;
                Ok::<_, Declined>(1u8)
            })
            .await;
        // The store refuses two completions: complete is retried, each
        // try is a sample, the failed ones with outcome=error.
        store.fail_completes(2);
        let _ = idem.process(&key("d"), 1u8, ok).await;
        // A batch: one acquire_many, one complete_many.
        let _ = idem
            .process_batch([(key("e1"), 1u8), (key("e2"), 2u8)], ok)
            .await;
        // Operator calls through the executor.
        let _ = idem.get(&key("a")).await;
        let _ = idem.delete(&key("a")).await;
        let _ = idem.purge_expired(10).await;
        // A direct call on the store is not timed.
        let _ = store.get(&key("a")).await;
    });
    let samples = store_samples(&snapshotter);

    // One sample per call the store saw.
    let completes = count(&samples, "complete", "ok") + count(&samples, "complete", "error");
    assert_eq!(count(&samples, "acquire", "ok"), 5, "{samples:?}");
    assert_eq!(completes, 3 + 2, "{samples:?}");
    assert_eq!(count(&samples, "complete", "error"), 2, "{samples:?}");
    assert_eq!(count(&samples, "release", "ok"), tap.releases());
    assert_eq!(count(&samples, "release", "ok"), 1);
    assert_eq!(count(&samples, "extend", "ok"), tap.extends());
    assert_eq!(count(&samples, "extend", "ok"), 2);
    assert_eq!(count(&samples, "acquire_many", "ok"), tap.acquire_batches());
    assert_eq!(count(&samples, "acquire_many", "ok"), 1);
    assert_eq!(
        count(&samples, "complete_many", "ok"),
        tap.complete_batches()
    );
    assert_eq!(count(&samples, "complete_many", "ok"), 1);
    // Single acquires and completes the store saw (a batch counts its items).
    assert_eq!(tap.acquires(), 5 + 2);
    assert_eq!(tap.completes(), 3 + 2 + 2);
    for op in ["get", "delete", "purge_expired"] {
        assert_eq!(count(&samples, op, "ok"), 1, "{op}: {samples:?}");
    }
    // Nothing else, and no other label values.
    let total: usize = samples.values().map(Vec::len).sum();
    assert_eq!(total, 5 + 5 + 1 + 2 + 1 + 1 + 3, "{samples:?}");
    let names: Vec<&str> = StoreOperation::ALL.iter().map(|o| o.as_str()).collect();
    for ((backend, op, outcome), values) in &samples {
        assert_eq!(backend, "memory");
        assert!(names.contains(&op.as_str()), "{op}");
        assert!(outcome == "ok" || outcome == "error", "{outcome}");
        assert!(
            values.iter().all(|v| v.is_finite() && *v >= 0.0),
            "{values:?}"
        );
    }
}

/// A store that does not name itself is `custom`; a wrapper (`Arc`, `Box`,
/// `Tap`) forwards the inner store's name.
#[test]
fn the_backend_label_comes_from_the_store() {
    struct Plain(MemoryStore);
    #[idem_core::async_trait]
    impl IdempotencyStore for Plain {
        async fn acquire(
            &self,
            key: &IdempotencyKey,
            fingerprint: Option<&idem_core::Fingerprint>,
            lease: Duration,
        ) -> Result<idem_core::Acquisition, idem_core::StoreError> {
            self.0.acquire(key, fingerprint, lease).await
        }
        async fn complete(
            &self,
            lease: &idem_core::Lease,
            response: &[u8],
            retention: Duration,
        ) -> Result<(), idem_core::StoreError> {
            self.0.complete(lease, response, retention).await
        }
        async fn release(&self, lease: &idem_core::Lease) -> Result<(), idem_core::StoreError> {
            self.0.release(lease).await
        }
        async fn extend(
            &self,
            lease: &idem_core::Lease,
            lease_for: Duration,
        ) -> Result<idem_core::Lease, idem_core::StoreError> {
            self.0.extend(lease, lease_for).await
        }
        async fn get(
            &self,
            key: &IdempotencyKey,
        ) -> Result<Option<idem_core::Record>, idem_core::StoreError> {
            self.0.get(key).await
        }
        async fn delete(&self, key: &IdempotencyKey) -> Result<bool, idem_core::StoreError> {
            self.0.delete(key).await
        }
        async fn purge_expired(&self, max: usize) -> Result<u64, idem_core::StoreError> {
            self.0.purge_expired(max).await
        }
    }
    assert_eq!(Plain(MemoryStore::new()).backend_name(), "custom");
    let dyn_store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    assert_eq!(dyn_store.backend_name(), "memory");
    let boxed: Box<dyn IdempotencyStore> = Box::new(Tap::new(MemoryStore::new()));
    assert_eq!(boxed.backend_name(), "memory");

    let snapshotter = recorded(|| async {
        let idem = Idempotency::new(Plain(MemoryStore::new()));
        let _ = idem
            .process(&key("p"), 1u8, |_| async { Ok::<_, Declined>(1u8) })
            .await;
    });
    let samples = store_samples(&snapshotter);
    let backends: Vec<&str> = samples.keys().map(|(b, _, _)| b.as_str()).collect();
    assert_eq!(backends, ["custom", "custom"], "{samples:?}");
}

#[test]
fn describe_metrics_describes_every_metric_with_a_unit() {
    let snapshotter = recorded(|| async {
        describe_metrics();
        let idem = Idempotency::new(MemoryStore::new());
        let _ = idem
            .process(&key("x"), 1u8, |_| async { Ok::<_, Declined>(1u8) })
            .await;
    });
    let described: HashMap<String, (Option<metrics::Unit>, String)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, unit, description, _)| {
            description.map(|d| (key.key().name().to_owned(), (unit, d.to_string())))
        })
        .collect();
    for name in ["idem_acquired_total", STORE_DURATION_SECONDS] {
        let (_, description) = described
            .get(name)
            .unwrap_or_else(|| panic!("{name} not described: {described:?}"));
        assert!(description.len() > 20, "{name}: {description}");
    }
    assert_eq!(
        described.get(STORE_DURATION_SECONDS).and_then(|d| d.0),
        Some(metrics::Unit::Seconds)
    );
}

/// The histogram is "the latency of each store call idem
/// makes", but `timed` records only when the call's future finishes. The
/// heartbeat's extend is cut off when the handler ends (its task is
/// aborted): a renewal the store applied, whose reply was slow, leaves no
/// sample, with no `outcome` at all. The calls lost are exactly the slow
/// ones, so the p99 the README's query shows is biased low, and a store
/// that stalls on every renewal shows no extend latency at all.
///
/// The store here is a MemoryStore (it does the work) whose extend reply
/// arrives 2 s after the renewal was applied, as over a slow link.
#[test]
fn a_heartbeat_extend_cut_off_by_the_handlers_end_still_leaves_a_sample() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct SlowRenewals {
        inner: MemoryStore,
        applied: AtomicUsize,
    }
    #[idem_core::async_trait]
    impl IdempotencyStore for SlowRenewals {
        fn backend_name(&self) -> &'static str {
            self.inner.backend_name()
        }
        async fn acquire(
            &self,
            key: &IdempotencyKey,
            fingerprint: Option<&idem_core::Fingerprint>,
            lease: Duration,
        ) -> Result<idem_core::Acquisition, idem_core::StoreError> {
            self.inner.acquire(key, fingerprint, lease).await
        }
        async fn complete(
            &self,
            lease: &idem_core::Lease,
            response: &[u8],
            retention: Duration,
        ) -> Result<(), idem_core::StoreError> {
            self.inner.complete(lease, response, retention).await
        }
        async fn release(&self, lease: &idem_core::Lease) -> Result<(), idem_core::StoreError> {
            self.inner.release(lease).await
        }
        async fn extend(
            &self,
            lease: &idem_core::Lease,
            lease_for: Duration,
        ) -> Result<idem_core::Lease, idem_core::StoreError> {
            let renewed = self.inner.extend(lease, lease_for).await;
            self.applied.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(2)).await;
            renewed
        }
        async fn get(
            &self,
            key: &IdempotencyKey,
        ) -> Result<Option<idem_core::Record>, idem_core::StoreError> {
            self.inner.get(key).await
        }
        async fn delete(&self, key: &IdempotencyKey) -> Result<bool, idem_core::StoreError> {
            self.inner.delete(key).await
        }
        async fn purge_expired(&self, max: usize) -> Result<u64, idem_core::StoreError> {
            self.inner.purge_expired(max).await
        }
    }
    let store = Arc::new(SlowRenewals {
        inner: MemoryStore::new(),
        applied: AtomicUsize::new(0),
    });
    let seen = store.clone();
    let snapshotter = recorded(|| async move {
        let idem = Idempotency::from_arc(store)
            .lease(Duration::from_secs(3))
            .heartbeat_interval(Duration::from_secs(1));
        // The heartbeat renews at 1 s; the handler ends at 1.5 s, while
        // the renewal's reply is on its way.
        let out = idem
            .process(&key("slow-renewal"), 1u8, |_| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                Ok::<_, Declined>(1u8)
            })
            .await;
        assert!(out.is_ok(), "{out:?}");
        // Long enough for any reply still on its way.
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let samples = store_samples(&snapshotter);
    let applied = seen.applied.load(Ordering::SeqCst);
    assert_eq!(applied, 1, "the store applied one renewal");
    let extend_samples: usize = samples
        .iter()
        .filter(|((_, op, _), _)| op == "extend")
        .map(|(_, v)| v.len())
        .sum();
    assert_eq!(
        extend_samples, applied,
        "the store applied {applied} extend call(s) the executor made, the histogram has \
         {extend_samples} sample(s): {samples:?}"
    );
}
