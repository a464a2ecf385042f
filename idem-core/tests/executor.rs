//! The executor's behaviour on MemoryStore, with tokio time paused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::testkit::Tap;
use idem_core::{
    Acquisition, CodecError, Fingerprint, IdemError, Idempotency, IdempotencyKey, IdempotencyStore,
    InProgressPolicy, MemoryStore, Processed, Record, RecordState, StoreError,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: String,
    amount: u64,
}

#[derive(Debug, PartialEq, thiserror::Error)]
#[error("card declined")]
struct Declined;

fn key(id: &str) -> IdempotencyKey {
    IdempotencyKey::new("payments.charge", id).unwrap_or_else(|e| panic!("{e}"))
}

/// Waits (yielding, no sleep) until the key has no record.
async fn until_absent<S: IdempotencyStore>(store: &S, key: &IdempotencyKey) {
    for _ in 0..1_000 {
        if matches!(store.get(key).await, Ok(None)) {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{key} was never released");
}

#[tokio::test(start_paused = true)]
async fn executes_once_then_replays_typed() {
    let idem = Idempotency::new(MemoryStore::new());
    let runs = AtomicUsize::new(0);
    let charge = |amount: u64| {
        let runs = &runs;
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(Receipt {
                charge_id: "ch_1".into(),
                amount,
            })
        }
    };
    let first = idem.process(&key("m1"), 500u64, charge).await;
    let second = idem.process(&key("m1"), 500u64, charge).await;
    let expected = Receipt {
        charge_id: "ch_1".into(),
        amount: 500,
    };
    assert_eq!(first.ok(), Some(Processed::Executed(expected.clone())));
    assert_eq!(second.ok(), Some(Processed::Replayed(expected)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn handler_error_releases_the_key() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let k = key("m-err");
    let out = idem
        .process(&k, 1u8, |_| async { Err::<Receipt, _>(Declined) })
        .await;
    match out {
        Err(e @ IdemError::Handler(Declined)) => assert!(e.is_retryable()),
        other => panic!("expected Handler error, got {other:?}"),
    }
    assert!(
        matches!(store.get(&k).await, Ok(None)),
        "key must be released"
    );
    let again = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(7u32) })
        .await;
    assert_eq!(again.ok(), Some(Processed::Executed(7)));
}

#[tokio::test(start_paused = true)]
async fn handler_panic_releases_the_key_and_does_not_escape() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let k = key("m-panic");
    let out: Result<Processed<u32>, IdemError<Declined>> = idem
        .process(&k, 1u8, |_| async { panic!("gateway exploded") })
        .await;
    match out {
        Err(IdemError::Panicked { message }) => assert!(message.contains("gateway exploded")),
        other => panic!("expected Panicked, got {other:?}"),
    }
    assert!(matches!(store.get(&k).await, Ok(None)));

    // A panic in the closure itself, before it returns a future.
    let out: Result<Processed<u32>, IdemError<Declined>> = idem
        .process(&k, 1u8, |_| -> std::future::Ready<Result<u32, Declined>> {
            panic!("sync {}", "panic")
        })
        .await;
    assert!(
        matches!(out, Err(IdemError::Panicked { ref message }) if message == "sync panic"),
        "{out:?}"
    );
    assert!(matches!(store.get(&k).await, Ok(None)));

    let again = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(1u32) })
        .await;
    assert_eq!(again.ok(), Some(Processed::Executed(1)));
}

#[tokio::test(start_paused = true)]
async fn dropped_future_releases_the_key() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let k = key("m-cancel");
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let task = {
        let idem = idem.clone();
        let k = k.clone();
        tokio::spawn(async move {
            idem.process(&k, 1u8, |_| async move {
                let _ = started_tx.send(());
                std::future::pending::<Result<u32, Declined>>().await
            })
            .await
        })
    };
    started_rx
        .await
        .unwrap_or_else(|_| panic!("handler never started"));
    assert!(
        matches!(store.get(&k).await, Ok(Some(_))),
        "held while running"
    );
    task.abort();
    assert!(task.await.is_err_and(|e| e.is_cancelled()));
    until_absent(&*store, &k).await;
    let again = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(2u32) })
        .await;
    assert_eq!(again.ok(), Some(Processed::Executed(2)));

    // Dropped by a timeout rather than an abort.
    let k2 = key("m-timeout");
    let slow = idem.process(&k2, 1u8, |_| async {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok::<_, Declined>(0u32)
    });
    assert!(tokio::time::timeout(Duration::from_secs(1), slow)
        .await
        .is_err());
    until_absent(&*store, &k2).await;
}

#[tokio::test(start_paused = true)]
async fn completion_after_takeover_is_lease_lost_and_never_swallowed() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_secs(1))
        .heartbeat(false);
    let k = key("m-zombie");
    let zombie = {
        let idem = idem.clone();
        let k = k.clone();
        tokio::spawn(async move {
            idem.process(&k, 1u8, |_| async {
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<_, Declined>("zombie".to_string())
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rescuer = idem
        .process_with(&k, Fingerprint::of(&1u8).ok(), |ctx| async move {
            Ok::<_, Declined>(format!("rescuer attempt {}", ctx.attempt))
        })
        .await;
    assert_eq!(
        rescuer.ok(),
        Some(Processed::Executed("rescuer attempt 2".to_string()))
    );
    let zombie = zombie.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(zombie, Err(IdemError::LeaseLost)), "{zombie:?}");
    assert!(!zombie.as_ref().is_ok_and(|_| true));
    let replay = idem
        .process(&k, 1u8, |_| async {
            Ok::<_, Declined>("never".to_string())
        })
        .await;
    assert_eq!(
        replay.ok(),
        Some(Processed::Replayed("rescuer attempt 2".to_string()))
    );
}

#[tokio::test(start_paused = true)]
async fn heartbeat_keeps_the_key_for_five_leases_and_stops_after() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone()).lease(Duration::from_secs(1));
    let k = key("m-long");
    let worker = {
        let idem = idem.clone();
        let k = k.clone();
        tokio::spawn(async move {
            idem.process(&k, 1u8, |_| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<_, Declined>(5u32)
            })
            .await
        })
    };
    // Other deliveries every half lease while the handler runs: none may
    // take the key over.
    for _ in 0..9 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let got = store
            .inner()
            .acquire(&k, None, Duration::from_secs(1))
            .await;
        assert!(
            matches!(got, Ok(Acquisition::InProgress { attempt: 1, .. })),
            "{got:?}"
        );
    }
    let done = worker.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(done.ok(), Some(Processed::Executed(5)));
    let extends = store.extends();
    assert!(
        extends >= 12,
        "heartbeat renewed only {extends} times in 5 leases"
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(store.extends(), extends, "heartbeat kept running");
    match store.get(&k).await {
        Ok(Some(Record {
            state: RecordState::Completed { .. },
            attempt: 1,
            ..
        })) => {}
        other => panic!("expected completed at attempt 1, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn reject_policy_reports_retry_after() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone()).on_in_progress(InProgressPolicy::Reject);
    let k = key("m-busy");
    let fp = Fingerprint::of(&1u8).ok();
    let Ok(Acquisition::Acquired(_)) = store
        .acquire(&k, fp.as_ref(), Duration::from_secs(30))
        .await
    else {
        panic!("not acquired")
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let out = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(1u8) })
        .await;
    match out {
        Err(
            e @ IdemError::InProgress {
                retry_after,
                attempt: 1,
            },
        ) => {
            assert_eq!(retry_after, Duration::from_secs(20));
            assert!(e.is_retryable());
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn wait_policy_replays_runs_or_times_out_with_bounded_polling() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone()).on_in_progress(InProgressPolicy::Wait {
        max_wait: Duration::from_secs(5),
        poll: Duration::from_millis(10),
    });
    let fp = Fingerprint::of(&1u8).ok();
    let long = Duration::from_secs(60);

    // The holder completes while we wait: replay.
    let k = key("m-wait-complete");
    let Ok(Acquisition::Acquired(lease)) = store.inner().acquire(&k, fp.as_ref(), long).await
    else {
        panic!("not acquired")
    };
    let holder = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            store.inner().complete(&lease, b"42", long).await
        })
    };
    let out = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(0u32) })
        .await;
    assert_eq!(out.ok(), Some(Processed::Replayed(42)));
    assert!(holder.await.is_ok_and(|r| r.is_ok()));

    // The holder releases: we run.
    let k = key("m-wait-release");
    let Ok(Acquisition::Acquired(lease)) = store.inner().acquire(&k, fp.as_ref(), long).await
    else {
        panic!("not acquired")
    };
    let holder = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            store.inner().release(&lease).await
        })
    };
    let out = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(1u32) })
        .await;
    assert_eq!(out.ok(), Some(Processed::Executed(1)));
    assert!(holder.await.is_ok_and(|r| r.is_ok()));

    // The holder never finishes: WaitTimeout after max_wait, with bounded
    // exponential polling (10, 20, 40, 80, 160, then 160 ms pauses).
    let k = key("m-wait-timeout");
    let Ok(Acquisition::Acquired(_)) = store.inner().acquire(&k, fp.as_ref(), long).await else {
        panic!("not acquired")
    };
    let acquires_before = store.acquires();
    let started = tokio::time::Instant::now();
    let out = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(2u32) })
        .await;
    match out {
        Err(e @ IdemError::WaitTimeout { .. }) => assert!(e.is_retryable()),
        other => panic!("expected WaitTimeout, got {other:?}"),
    }
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_millis(5_200),
        "{waited:?}"
    );
    let polls = store.acquires() - acquires_before;
    assert!((25..=40).contains(&polls), "{polls} acquire calls in 5 s");
}

#[tokio::test(start_paused = true)]
async fn payload_mismatch_is_reported_and_changes_nothing() {
    let idem = Idempotency::new(MemoryStore::new());
    let k = key("m-mismatch");
    let first = idem
        .process(&k, 100u64, |a| async move { Ok::<_, Declined>(a) })
        .await;
    assert_eq!(first.ok(), Some(Processed::Executed(100)));
    let other = idem
        .process(&k, 999u64, |a| async move { Ok::<_, Declined>(a) })
        .await;
    assert!(
        matches!(other, Err(ref e @ IdemError::PayloadMismatch) if !e.is_retryable()),
        "{other:?}"
    );
    let again = idem
        .process(&k, 100u64, |a| async move { Ok::<_, Declined>(a) })
        .await;
    assert_eq!(again.ok(), Some(Processed::Replayed(100)));
}

#[tokio::test(start_paused = true)]
async fn response_that_does_not_serialize_releases_the_key() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let k = key("m-codec");
    // JSON object keys must be strings: a map keyed by tuples fails.
    let out = idem
        .process(&k, 1u8, |_| async {
            Ok::<_, Declined>(HashMap::from([((1u8, 2u8), 3u8)]))
        })
        .await;
    assert!(
        matches!(out, Err(IdemError::Codec(CodecError::Encode(_)))),
        "{out:?}"
    );
    assert!(
        matches!(store.get(&k).await, Ok(None)),
        "key must be released"
    );
}

#[tokio::test(start_paused = true)]
async fn payload_that_does_not_serialize_stores_nothing() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let k = key("m-bad-payload");
    let payload = HashMap::from([((1u8, 2u8), 3u8)]);
    let out = idem
        .process(&k, &payload, |_| async { Ok::<_, Declined>(1u8) })
        .await;
    assert!(
        matches!(out, Err(IdemError::Codec(CodecError::Encode(_)))),
        "{out:?}"
    );
    assert!(matches!(store.get(&k).await, Ok(None)));
}

#[tokio::test(start_paused = true)]
async fn recorded_response_of_another_type_is_a_decode_error_and_is_kept() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let k = key("m-decode");
    let first = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>("text".to_string()) })
        .await;
    assert!(first.is_ok());
    let out = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(5u64) })
        .await;
    match out {
        Err(e @ IdemError::Codec(CodecError::Decode(_))) => assert!(!e.is_retryable()),
        other => panic!("expected a decode error, got {other:?}"),
    }
    assert!(
        matches!(store.get(&k).await, Ok(Some(r)) if r.is_completed()),
        "record kept"
    );
}

#[tokio::test(start_paused = true)]
async fn store_errors_are_typed() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let k = key("m-corrupt");
    store.corrupt_for_tests(&k);
    let out = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(1u8) })
        .await;
    assert!(
        matches!(out, Err(IdemError::Store(StoreError::Corrupt { .. }))),
        "{out:?}"
    );

    let full = MemoryStore::builder().max_records(1).build();
    let idem = Idempotency::new(full).lease(Duration::from_secs(60));
    let busy = idem
        .store()
        .acquire(&key("a"), None, Duration::from_secs(60))
        .await;
    assert!(matches!(busy, Ok(Acquisition::Acquired(_))));
    let out = idem
        .process(&key("b"), 1u8, |_| async { Ok::<_, Declined>(1u8) })
        .await;
    match out {
        Err(e @ IdemError::Store(StoreError::CapacityExceeded { .. })) => assert!(e.is_retryable()),
        other => panic!("expected CapacityExceeded, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn process_with_takes_a_precomputed_fingerprint_or_none() {
    let idem = Idempotency::new(MemoryStore::new());
    let body = br#"{"amount":100}"#;
    let k = key("m-raw");
    let out = idem
        .process_with(&k, Some(Fingerprint::of_bytes(body)), |ctx| async move {
            Ok::<_, Declined>(ctx.attempt)
        })
        .await;
    assert_eq!(out.ok(), Some(Processed::Executed(1)));
    let other = idem
        .process_with(&k, Some(Fingerprint::of_bytes(b"{}")), |_| async {
            Ok::<_, Declined>(0u32)
        })
        .await;
    assert!(matches!(other, Err(IdemError::PayloadMismatch)));
    let unchecked = idem
        .process_with(&k, None, |_| async { Ok::<_, Declined>(0u32) })
        .await;
    assert_eq!(unchecked.ok(), Some(Processed::Replayed(1)));
}

#[tokio::test(start_paused = true)]
async fn works_over_a_dyn_store() {
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let idem = Idempotency::new(store);
    let out = idem
        .process(&key("m-dyn"), 1u8, |_| async { Ok::<_, Declined>(1u8) })
        .await;
    assert_eq!(out.ok(), Some(Processed::Executed(1)));
}

#[test]
fn metrics_count_every_outcome() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        runtime.block_on(async {
            let store = Arc::new(MemoryStore::new());
            let idem = Idempotency::from_arc(store.clone())
                .lease(Duration::from_secs(1))
                .heartbeat(false);
            let ok = |_: u8| async { Ok::<_, Declined>(1u8) };
            let _ = idem.process(&key("c1"), 1u8, ok).await; // acquired
            let _ = idem.process(&key("c1"), 1u8, ok).await; // replayed
            let _ = idem.process(&key("c1"), 2u8, ok).await; // mismatch
            let _ = store
                .acquire(&key("c2"), None, Duration::from_secs(60))
                .await;
            let _ = idem.process(&key("c2"), 1u8, ok).await; // in progress
            let c3 = key("c3");
            let zombie = idem.process(&c3, 1u8, |_| async {
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<_, Declined>(1u8)
            });
            let rescue = async {
                tokio::time::sleep(Duration::from_secs(2)).await;
                idem.process(&c3, 1u8, ok).await
            };
            let (z, r) = tokio::join!(zombie, rescue); // acquired x2, lease lost
            assert!(matches!(z, Err(IdemError::LeaseLost)));
            assert!(r.is_ok());
        });
    });
    let counters: HashMap<String, u64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(n) => Some((key.key().name().to_string(), n)),
            _ => None,
        })
        .fold(HashMap::new(), |mut acc, (name, n)| {
            *acc.entry(name).or_default() += n;
            acc
        });
    assert_eq!(
        counters.get("idem_acquired_total"),
        Some(&3),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("idem_replayed_total"),
        Some(&1),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("idem_mismatch_total"),
        Some(&1),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("idem_in_progress_total"),
        Some(&1),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("idem_lease_lost_total"),
        Some(&1),
        "{counters:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn completion_is_retried_while_the_store_is_unavailable() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    store.fail_completes(3);
    let idem = Idempotency::from_arc(store.clone()).lease(Duration::from_secs(10));
    let runs = AtomicUsize::new(0);
    let out = idem
        .process(&key("m-flaky"), 1u8, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(7u8)
        })
        .await;
    assert_eq!(out.ok(), Some(Processed::Executed(7)));
    assert_eq!(
        store.failing_completes_left(),
        0,
        "all failures were retried"
    );
    let again = idem
        .process(&key("m-flaky"), 1u8, |_| async { Ok::<_, Declined>(0u8) })
        .await;
    assert_eq!(again.ok(), Some(Processed::Replayed(7)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A store down for longer than the budget: the error comes back.
    let store = Arc::new(Tap::new(MemoryStore::new()));
    store.fail_completes(usize::MAX);
    let idem = Idempotency::from_arc(store)
        .lease(Duration::from_secs(10))
        .complete_retry(Duration::from_secs(2));
    let started = tokio::time::Instant::now();
    let out = idem
        .process(&key("m-down"), 1u8, |_| async { Ok::<_, Declined>(7u8) })
        .await;
    assert!(
        matches!(out, Err(IdemError::Store(StoreError::Unavailable(_)))),
        "{out:?}"
    );
    assert!(
        started.elapsed() <= Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}
