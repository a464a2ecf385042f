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

/// DESIGN 4: a dropped `process` future was cut off after an unknown part
/// of its effects, so it must not release the key: the key stays in
/// progress until the lease ends, then the next delivery takes it over with
/// attempt 2 and a higher fence.
#[tokio::test(start_paused = true)]
async fn dropped_future_does_not_release_the_key() {
    let store = Arc::new(MemoryStore::new());
    let lease = Duration::from_secs(10);
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    for (k, how) in [(key("m-cancel"), "abort"), (key("m-timeout"), "timeout")] {
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<u64>();
        let slow = {
            let idem = idem.clone();
            let k = k.clone();
            async move {
                idem.process_with(&k, None, |cx| async move {
                    let _ = started_tx.send(cx.fence);
                    std::future::pending::<Result<u32, Declined>>().await
                })
                .await
            }
        };
        if how == "abort" {
            let task = tokio::spawn(slow);
            let _ = started_rx.await;
            task.abort();
            assert!(task.await.is_err_and(|e| e.is_cancelled()));
        } else {
            assert!(tokio::time::timeout(Duration::from_secs(1), slow)
                .await
                .is_err());
        }
        // Let any spawned release run, were there one.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        let held = store.acquire(&k, None, lease).await;
        assert!(
            matches!(held, Ok(Acquisition::InProgress { attempt: 1, .. })),
            "{how}: a dropped future released the key: {held:?}"
        );
        tokio::time::advance(lease + Duration::from_secs(1)).await;
        let (fences_tx, mut fences_rx) = tokio::sync::mpsc::unbounded_channel();
        let again = idem
            .process_with(&k, None, |cx| async move {
                let _ = fences_tx.send((cx.attempt, cx.fence));
                Ok::<_, Declined>(2u32)
            })
            .await;
        assert_eq!(again.ok(), Some(Processed::Executed(2)), "{how}");
        let (attempt, fence) = fences_rx.recv().await.unwrap_or_default();
        assert_eq!(attempt, 2, "{how}: the takeover is attempt 2");
        assert!(fence > 0, "{how}: fence {fence}");
    }
}

/// Detached mode: the caller goes away mid-handler (an HTTP client that
/// disconnects), the handler still runs to its end and its result is
/// recorded; the retry gets "in progress" while it runs, then the replay.
#[tokio::test(start_paused = true)]
async fn detached_handler_outlives_its_caller_and_is_recorded() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone()).lease(Duration::from_secs(30));
    let k = key("m-detached");
    let runs = Arc::new(AtomicUsize::new(0));
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let caller = {
        let (idem, k, runs) = (idem.clone(), k.clone(), runs.clone());
        tokio::spawn(async move {
            idem.process_detached(&k, 5u64, move |amount| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = go_rx.await;
                Ok::<_, Declined>(amount * 2)
            })
            .await
        })
    };
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    caller.abort(); // the client disconnects
    assert!(caller.await.is_err_and(|e| e.is_cancelled()));
    let retry = idem
        .process(&k, 5u64, |_| async { Ok::<_, Declined>(0u64) })
        .await;
    assert!(
        matches!(retry, Err(IdemError::InProgress { .. })),
        "while it still runs: {retry:?}"
    );
    let _ = go_tx.send(());
    let mut replay = None;
    for _ in 0..1_000 {
        match store.get(&k).await {
            Ok(Some(r)) if r.is_completed() => {
                replay = Some(
                    idem.process(&k, 5u64, |_| async { Ok::<_, Declined>(0u64) })
                        .await,
                );
                break;
            }
            _ => tokio::task::yield_now().await,
        }
    }
    assert!(
        matches!(replay, Some(Ok(Processed::Replayed(10)))),
        "{replay:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
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

/// Panics in `Serialize`, like a response that does not encode.
struct PanicsOnSerialize;

impl Serialize for PanicsOnSerialize {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("serialize blew up")
    }
}

impl<'de> Deserialize<'de> for PanicsOnSerialize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(d).map(|_| PanicsOnSerialize)
    }
}

/// DESIGN 4: a result that cannot be recorded after the handler returned
/// `Ok` (it does not encode, it holds a NaN, its `Serialize` panics) is not
/// released: the key completes as "not replayable", the caller gets its
/// value and the reason, and every duplicate gets `ResultUnavailable`
/// without running the handler.
#[tokio::test(start_paused = true)]
async fn result_that_cannot_be_recorded_completes_the_key_as_not_replayable() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone());
    let runs = AtomicUsize::new(0);

    // JSON object keys must be strings: a map keyed by tuples fails.
    let k = key("m-codec");
    let out = idem
        .process(&k, 1u8, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(HashMap::from([((1u8, 2u8), 3u8)]))
        })
        .await;
    assert!(
        matches!(&out, Ok(Processed::ExecutedNotReplayable { value, .. }) if value.len() == 1),
        "{out:?}"
    );
    // NaN: serde_json would record `null`, which then fails every replay.
    let k_nan = key("m-nan");
    let out = idem
        .process(&k_nan, 1u8, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(vec![1.0, f64::NAN])
        })
        .await;
    assert!(
        matches!(&out, Ok(Processed::ExecutedNotReplayable { reason, .. }) if reason.contains("non-finite")),
        "{out:?}"
    );
    // A panic in Serialize neither escapes nor leaves the key in progress.
    let k_panic = key("m-ser-panic");
    let out = idem
        .process(&k_panic, 1u8, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(PanicsOnSerialize)
        })
        .await;
    assert!(
        matches!(&out, Ok(Processed::ExecutedNotReplayable { reason, .. }) if reason.contains("blew up")),
        "{:?}",
        out.as_ref().err()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    for k in [&k, &k_nan, &k_panic] {
        let record = store.get(k).await;
        assert!(
            matches!(&record, Ok(Some(r)) if r.is_completed()),
            "{k}: not completed: {record:?}"
        );
        let dup = idem
            .process(k, 1u8, |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Declined>(0u8)
            })
            .await;
        assert!(
            matches!(&dup, Err(e @ IdemError::ResultUnavailable { .. }) if !e.is_retryable()),
            "{k}: {dup:?}"
        );
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "no duplicate ran the handler"
    );
}

/// DESIGN 4: the heartbeat runs on its own task, so a handler that blocks
/// its thread (a synchronous client, a long computation) keeps its lease
/// on a multi-thread runtime and is not taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_handler_does_not_starve_the_heartbeat() {
    let store = Arc::new(MemoryStore::new());
    let lease = Duration::from_millis(300);
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    let k = key("m-blocking");
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = {
        let (idem, k) = (idem.clone(), k.clone());
        tokio::spawn(async move {
            idem.process(&k, 1u8, |_| async move {
                let _ = started_tx.send(());
                // Blocks this worker thread for more than 5 leases.
                std::thread::sleep(Duration::from_millis(1_600));
                Ok::<_, Declined>(1u8)
            })
            .await
        })
    };
    let _ = started_rx.await;
    let mut takeovers = 0;
    let deadline = std::time::Instant::now() + Duration::from_millis(1_400);
    while std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match store
            .acquire(
                &k,
                Some(&Fingerprint::of(&1u8).unwrap_or_else(|e| panic!("{e}"))),
                lease,
            )
            .await
        {
            Ok(Acquisition::InProgress { .. }) => {}
            Ok(Acquisition::Acquired(stolen)) => {
                takeovers += 1;
                let _ = store.release(&stolen).await;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(takeovers, 0, "the blocked handler's lease ran out");
    let out = worker.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.ok(), Some(Processed::Executed(1)));
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
        matches!(&out, Err(IdemError::Unrecorded(u)) if u.cause().is_retryable()),
        "{out:?}"
    );
    assert!(
        started.elapsed() <= Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// DESIGN 4: the completion retry never outlives the lease. With the
/// heartbeat off and a retry budget longer than the lease, the executor
/// gives up before the lease ends instead of retrying while another worker
/// takes the key over and runs the handler again.
#[tokio::test(start_paused = true)]
async fn completion_retry_never_outlives_the_lease() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    store.fail_completes(usize::MAX);
    let lease = Duration::from_secs(3);
    let idem = Idempotency::from_arc(store.clone())
        .lease(lease)
        .heartbeat(false)
        .complete_retry(Duration::from_secs(60));
    let started = tokio::time::Instant::now();
    let out = idem
        .process(&key("m-retry-lease"), 1u8, |_| async {
            Ok::<_, Declined>(7u8)
        })
        .await;
    assert!(matches!(out, Err(IdemError::Unrecorded(_))), "{out:?}");
    assert!(
        started.elapsed() < lease,
        "retried for {:?}, past the lease of {lease:?}",
        started.elapsed()
    );
}

/// The store stays away past the lease while the completion is retried:
/// the executor gives up (never past the lease) with
/// `IdemError::Unrecorded`, which hands the lease back. Neither it nor the
/// message's retry may run the handler again: `finish` writes the same
/// completion with the same token once the store is back (a passed lease
/// does not revoke), and every duplicate replays it. A `finish` after
/// another worker took the key over is `LeaseLost` and writes nothing.
#[tokio::test(start_paused = true)]
async fn unrecorded_result_is_finished_with_its_own_lease() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let lease = Duration::from_secs(2);
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    let runs = AtomicUsize::new(0);
    let k = key("m-unrecorded");
    store.fail_completes(usize::MAX);
    let out = idem
        .process(&k, 1u8, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(7u8)
        })
        .await;
    assert!(
        out.as_ref().is_err_and(|e| !e.is_retryable()),
        "the message must not be run again: {out:?}"
    );
    let unrecorded = match out {
        Err(IdemError::Unrecorded(u)) => u,
        other => panic!("expected Unrecorded, got {other:?}"),
    };
    assert_eq!(unrecorded.lease().key, k);
    // Still down: finish says so and can be called again.
    let down = idem.finish(&unrecorded).await;
    assert!(matches!(&down, Err(e) if e.is_retryable()), "{down:?}");
    // The store comes back after the lease ended; nobody took over.
    tokio::time::sleep(lease * 3).await;
    store.fail_completes(0);
    idem.finish(&unrecorded)
        .await
        .unwrap_or_else(|e| panic!("finish: {e}"));
    let again = idem
        .process(&k, 1u8, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(0u8)
        })
        .await;
    assert_eq!(again.ok(), Some(Processed::Replayed(7)));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran twice");

    // Taken over before the store came back: finish is fenced off.
    let k2 = key("m-unrecorded-taken");
    store.fail_completes(usize::MAX);
    let out = idem
        .process(&k2, 1u8, |_| async { Ok::<_, Declined>(7u8) })
        .await;
    let unrecorded = match out {
        Err(IdemError::Unrecorded(u)) => u,
        other => panic!("expected Unrecorded, got {other:?}"),
    };
    tokio::time::sleep(lease * 2).await;
    let fp = Fingerprint::of(&1u8).unwrap_or_else(|e| panic!("{e}"));
    let taken = store.inner().acquire(&k2, Some(&fp), lease).await;
    assert!(matches!(taken, Ok(Acquisition::Acquired(_))), "{taken:?}");
    store.fail_completes(0);
    let late = idem.finish(&unrecorded).await;
    assert!(matches!(late, Err(StoreError::LeaseLost)), "{late:?}");
}

/// DESIGN 4: while the completion is retried, the heartbeat keeps the lease,
/// so a store that comes back after longer than the lease still gets the
/// one result, and no other worker took the key over meanwhile.
#[tokio::test(start_paused = true)]
async fn heartbeat_keeps_running_during_the_completion_retry() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let lease = Duration::from_secs(3);
    let idem = Idempotency::from_arc(store.clone())
        .lease(lease)
        .complete_retry(Duration::from_secs(60));
    let k = key("m-retry-heartbeat");
    // About 20 s of failures with backoff capped at 1 s.
    store.fail_completes(25);
    let worker = {
        let (idem, k) = (idem.clone(), k.clone());
        tokio::spawn(async move {
            idem.process(&k, 1u8, |_| async { Ok::<_, Declined>(7u8) })
                .await
        })
    };
    let mut takeovers = 0;
    while !worker.is_finished() {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(Acquisition::Acquired(_)) = store
            .inner()
            .acquire(
                &k,
                Some(&Fingerprint::of(&1u8).unwrap_or_else(|e| panic!("{e}"))),
                lease,
            )
            .await
        {
            takeovers += 1;
        }
    }
    assert_eq!(takeovers, 0, "the key was taken over during the retry");
    let out = worker.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.ok(), Some(Processed::Executed(7)));
    assert!(
        store.extends() > 5,
        "the heartbeat ran: {} extends",
        store.extends()
    );
}

/// A short lease (600 ms) and a long retry budget (6 s), the heartbeat on:
/// completions refused for a while are retried with pauses that stay well
/// inside the lease (at most an eighth of it), so the retry goes on as
/// long as the heartbeat renews the lease and the store answers in the
/// end. (The pause doubled to 640 ms, past the lease, and the retry gave
/// up after 0.65 s with `Unrecorded`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_retry_pauses_stay_inside_a_short_lease() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_millis(600))
        .complete_retry(Duration::from_secs(6));
    let k = key("m-retry-short-lease");
    store.fail_completes(12);
    let out = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(7u8) })
        .await;
    assert!(
        matches!(out, Ok(Processed::Executed(7))),
        "12 refused completions under a renewed 600 ms lease: {out:?}"
    );
}

/// DESIGN 4: configuration never panics: a zero lease is refused before
/// anything is stored; `Duration::MAX` everywhere works (saturated).
#[tokio::test(start_paused = true)]
async fn zero_lease_is_refused_and_max_durations_work() {
    let store = Arc::new(MemoryStore::new());
    let k = key("m-zero");
    let out = Idempotency::from_arc(store.clone())
        .lease(Duration::ZERO)
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(1u8) })
        .await;
    assert!(
        matches!(&out, Err(e @ IdemError::InvalidConfig { .. }) if !e.is_retryable()),
        "{out:?}"
    );
    assert!(matches!(store.get(&k).await, Ok(None)));
    idem_core::testkit::durations_at_the_extremes(&idem_core::testkit::MemoryHarness).await;
}

/// NaN, +inf and -inf are refused by fingerprints, content
/// keys and the executor's payload check, instead of all becoming `null`
/// (one fingerprint for different payloads, one key for different
/// messages).
#[tokio::test(start_paused = true)]
async fn non_finite_floats_are_refused_never_collide() {
    for v in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert!(Fingerprint::of(&serde_json::json!({"amount": 1})).is_ok());
        assert!(Fingerprint::of(&(1u8, v)).is_err(), "fingerprint of {v}");
        assert!(
            matches!(
                IdempotencyKey::from_content("emails.send", &vec![v]),
                Err(idem_core::KeyError::Content(_))
            ),
            "content key of {v}"
        );
        let store = Arc::new(MemoryStore::new());
        let idem = Idempotency::from_arc(store.clone());
        let k = key("m-nan-payload");
        let out = idem
            .process(&k, v, |_| async { Ok::<_, Declined>(1u8) })
            .await;
        assert!(
            matches!(out, Err(IdemError::Codec(CodecError::Encode(_)))),
            "{v}: {out:?}"
        );
        assert!(
            matches!(store.get(&k).await, Ok(None)),
            "nothing stored for {v}"
        );
    }
    // `None` still serializes as null, and differs from any number.
    assert_ne!(
        Fingerprint::of(&Option::<f64>::None).ok(),
        Fingerprint::of(&0.0f64).ok()
    );
}

/// `purge_periodically` with a zero or `Duration::MAX` period neither
/// panics nor spins.
#[tokio::test(start_paused = true)]
async fn purge_periodically_accepts_zero_and_max_periods() {
    let store = Arc::new(MemoryStore::new());
    for every in [Duration::ZERO, Duration::MAX] {
        let purger = idem_core::purge_periodically(store.clone(), every, 0);
        tokio::time::advance(Duration::from_millis(5)).await;
        tokio::task::yield_now().await;
        assert!(
            !purger.is_finished(),
            "the purger died with a period of {every:?}"
        );
        purger.abort();
    }
}

/// A heartbeat interval past the lease (`Duration::MAX`)
/// is capped at half the lease, so a live handler keeps its key.
#[tokio::test(start_paused = true)]
async fn a_heartbeat_interval_past_the_lease_is_capped() {
    let store = Arc::new(MemoryStore::new());
    let lease = Duration::from_secs(3);
    let idem = Idempotency::from_arc(store.clone())
        .lease(lease)
        .heartbeat_interval(Duration::MAX);
    let k = key("m-heartbeat-max");
    let worker = {
        let (idem, k) = (idem.clone(), k.clone());
        tokio::spawn(async move {
            idem.process(&k, 1u8, |_| async {
                tokio::time::sleep(Duration::from_secs(20)).await;
                Ok::<_, Declined>(1u8)
            })
            .await
        })
    };
    let fp = Fingerprint::of(&1u8).unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..15 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let dup = store.acquire(&k, Some(&fp), lease).await;
        assert!(
            matches!(dup, Ok(Acquisition::InProgress { .. })),
            "a live handler's key was taken over: {dup:?}"
        );
    }
    let out = worker.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.ok(), Some(Processed::Executed(1)));
}

/// A zero retention is refused before anything is
/// stored (every duplicate would run the handler again).
#[tokio::test(start_paused = true)]
async fn a_zero_retention_is_refused() {
    let store = Arc::new(MemoryStore::new());
    let idem = Idempotency::from_arc(store.clone()).retention(Duration::ZERO);
    let runs = AtomicUsize::new(0);
    let k = key("m-zero-retention");
    for _ in 0..3 {
        let out = idem
            .process(&k, 1u8, |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Declined>(1u8)
            })
            .await;
        assert!(
            matches!(&out, Err(e @ IdemError::InvalidConfig { .. }) if !e.is_retryable()),
            "{out:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(matches!(store.get(&k).await, Ok(None)));
}

/// An `Unrecorded` of key `k`: the store refuses every completion past the
/// lease (heartbeat off), then completions fail `then_failing` more times.
async fn unrecorded_of(
    store: &Arc<Tap<MemoryStore>>,
    idem: &Idempotency<Tap<MemoryStore>>,
    k: &IdempotencyKey,
    then_failing: usize,
) -> Box<idem_core::Unrecorded> {
    store.fail_completes(usize::MAX);
    let out = idem
        .process(k, 1u8, |_| async { Ok::<_, Declined>(7u8) })
        .await;
    store.fail_completes(then_failing);
    match out {
        Err(IdemError::Unrecorded(u)) => u,
        other => panic!("expected Unrecorded, got {other:?}"),
    }
}

/// `finish_until` (the loop every receiver runs for an `Unrecorded`)
/// writes the completion once the store is back, pausing as told between
/// tries, and the duplicate replays it: the handler ran once.
#[tokio::test(start_paused = true)]
async fn finish_until_writes_the_completion_once_the_store_is_back() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_secs(2))
        .heartbeat(false);
    let k = key("m-finish-until");
    let u = unrecorded_of(&store, &idem, &k, 4).await;
    let pauses = idem_core::Pauses::new(Duration::from_millis(10), Duration::from_millis(40));
    let started = tokio::time::Instant::now();
    let out = idem
        .finish_until(&u, pauses, std::future::pending::<()>())
        .await;
    assert!(matches!(out, idem_core::Finished::Recorded), "{out:?}");
    // Four failed tries: pauses of 10, 20, 40 and 40 ms.
    assert_eq!(started.elapsed(), Duration::from_millis(110));
    let again = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(0u8) })
        .await;
    assert_eq!(again.ok(), Some(Processed::Replayed(7)));
}

/// `finish_until_woken`: a finisher pausing 10 s between tries tries again
/// as soon as its receiver hears that the store answered
/// (`FinishingKeys::store_answered`), not after the pause; nothing wakes it
/// while no key is held.
#[tokio::test(start_paused = true)]
async fn a_finisher_tries_again_as_soon_as_the_store_answers() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_secs(2))
        .heartbeat(false);
    let k = key("m-finish-woken");
    let u = unrecorded_of(&store, &idem, &k, 1).await;
    let keys = Arc::new(idem_core::FinishingKeys::new());
    let _held = keys.hold(k.clone(), None);
    let pauses = idem_core::Pauses::new(Duration::from_secs(10), Duration::from_secs(10));
    let started = tokio::time::Instant::now();
    let waker = {
        let keys = keys.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            keys.store_answered();
        })
    };
    let out = idem
        .finish_until_woken(&u, pauses, std::future::pending::<()>(), &keys)
        .await;
    assert!(matches!(out, idem_core::Finished::Recorded), "{out:?}");
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(300),
        "tried again when the store answered"
    );
    waker.await.unwrap_or_else(|e| panic!("{e}"));
}

/// `finish_until` gives up only when told to and after one more failed
/// try, returning the last error; the key is then still in progress (its
/// lease not released: the handler ran).
#[tokio::test(start_paused = true)]
async fn finish_until_gives_up_when_told_while_the_store_is_away() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_secs(60))
        .heartbeat(false)
        .complete_retry(Duration::from_millis(100));
    let k = key("m-finish-give-up");
    let u = unrecorded_of(&store, &idem, &k, usize::MAX).await;
    let pauses = idem_core::Pauses::new(Duration::from_millis(100), Duration::from_secs(1));
    let started = tokio::time::Instant::now();
    let out = idem
        .finish_until(&u, pauses, tokio::time::sleep(Duration::from_millis(250)))
        .await;
    assert!(
        matches!(&out, idem_core::Finished::GaveUp(e) if e.is_retryable()),
        "{out:?}"
    );
    // Tries at 0, 100 and 250 ms (the pause cut short by giving up).
    assert_eq!(started.elapsed(), Duration::from_millis(250));
    let busy = idem
        .process(&k, 1u8, |_| async { Ok::<_, Declined>(0u8) })
        .await;
    assert!(
        matches!(busy, Err(IdemError::InProgress { .. })),
        "{busy:?}"
    );
}

/// A key taken over by another worker after the lease: `finish_until`
/// says so at once and writes nothing over the new holder.
#[tokio::test(start_paused = true)]
async fn finish_until_stops_when_the_key_was_taken_over() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let lease = Duration::from_secs(2);
    let idem = Idempotency::from_arc(store.clone())
        .lease(lease)
        .heartbeat(false);
    let k = key("m-finish-taken");
    let u = unrecorded_of(&store, &idem, &k, 0).await;
    tokio::time::sleep(lease * 2).await;
    let fp = Fingerprint::of(&1u8).unwrap_or_else(|e| panic!("{e}"));
    let taken = store.inner().acquire(&k, Some(&fp), lease).await;
    assert!(matches!(taken, Ok(Acquisition::Acquired(_))), "{taken:?}");
    let pauses = idem_core::Pauses::new(Duration::from_millis(10), Duration::from_millis(10));
    let out = idem
        .finish_until(&u, pauses, std::future::pending::<()>())
        .await;
    assert!(matches!(out, idem_core::Finished::TakenOver), "{out:?}");
    let record = store
        .inner()
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(
            record.map(|r| r.state),
            Some(RecordState::InProgress { .. })
        ),
        "the new holder's record was overwritten"
    );
}

/// `Pauses::new(Duration::ZERO, longest)` is accepted ("from `first`,
/// doubled up to `longest`"), but zero doubled stays zero: `finish_until`
/// then tries the store back to back for as long as it is away, without
/// ever pausing: a hot loop that floods a store that is struggling (and,
/// with tokio's clock paused, never lets a `sleep` given as `give_up`
/// complete). Configuration is "validated or saturated": the pauses should
/// grow toward `longest` (or a zero first pause be refused/raised).
#[tokio::test(start_paused = true)]
async fn finish_until_with_a_zero_first_pause_still_pauses_between_tries() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_secs(2))
        .heartbeat(false);
    let k = key("m-finish-zero-pause");
    // The store refuses the next 1,000 completions, then takes one.
    let u = unrecorded_of(&store, &idem, &k, 1_000).await;
    let before = store.completes();
    let pauses = idem_core::Pauses::new(Duration::ZERO, Duration::from_millis(100));
    let started = tokio::time::Instant::now();
    let out = idem
        .finish_until(&u, pauses, std::future::pending::<()>())
        .await;
    assert!(matches!(out, idem_core::Finished::Recorded), "{out:?}");
    let tries = store.completes() - before;
    assert!(
        started.elapsed() >= Duration::from_millis(100),
        "{tries} tries in {:?}: no pause between tries of a store that is away",
        started.elapsed()
    );
}

/// A key a receiver is finishing, held without a fingerprint (as
/// `FinishingKeys::hold(key, None)` allows, and as the Kafka consumer
/// holds its keys), its run acquired without one: a waiting call that
/// carries a fingerprint waits without asking the store. (It went to the
/// store and, the lease being over and the record carrying no fingerprint,
/// no mismatch possible, took the key over and ran the handler a second
/// time while the first run's result was still being written.)
#[tokio::test(start_paused = true)]
async fn a_waiting_call_with_a_fingerprint_waits_for_a_key_finishing_without_one() {
    let store = Arc::new(MemoryStore::new());
    let k = IdempotencyKey::new("finishing.wait", "k1").unwrap_or_else(|e| panic!("{e}"));
    // The first run: acquired without a fingerprint; its handler ran, the
    // store went away past its lease: the receiver is finishing it.
    let Acquisition::Acquired(_first) = store
        .acquire(&k, None, Duration::from_secs(1))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    else {
        panic!("not acquired")
    };
    let keys = Arc::new(idem_core::FinishingKeys::new());
    let _held = keys.hold(k.clone(), None);
    tokio::time::sleep(Duration::from_secs(2)).await; // the lease is over
    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_secs(1))
        .heartbeat(false)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(5),
            poll: Duration::from_millis(50),
        })
        .waits_for_finishing(keys.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let out = idem
        .process(&k, &serde_json::json!({"amount": 1}), |_| async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::convert::Infallible>(1u32)
        })
        .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the handler ran again while the key was held finishing: {:?}",
        out.as_ref().map(|_| ()).map_err(|e| e.to_string())
    );
    assert!(
        matches!(out, Err(IdemError::WaitTimeout { .. })),
        "{:?}",
        out.map(|_| ()).map_err(|e| e.to_string())
    );
}
