//! The executor's batch path (`process_batch` and its variants) on
//! MemoryStore, with tokio time paused unless a test needs threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::testkit::Tap;
use idem_core::{
    async_trait, AcquireItem, Acquisition, Context, Fingerprint, IdemError, Idempotency,
    IdempotencyKey, IdempotencyStore, InProgressPolicy, Lease, MemoryStore, Processed, Record,
    StoreError,
};

#[derive(Debug, PartialEq, thiserror::Error)]
#[error("declined")]
struct Declined;

fn key(id: &str) -> IdempotencyKey {
    IdempotencyKey::new("orders.ship", id).unwrap_or_else(|e| panic!("{e}"))
}

fn keys(tag: &str, n: usize) -> Vec<IdempotencyKey> {
    (0..n).map(|i| key(&format!("{tag}-{i}"))).collect()
}

type Store = Arc<Tap<MemoryStore>>;

fn tapped() -> (Store, Idempotency<Tap<MemoryStore>>) {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    (store.clone(), Idempotency::from_arc(store))
}

async fn is_absent(store: &Store, k: &IdempotencyKey) -> bool {
    matches!(store.get(k).await, Ok(None))
}

/// How [`BatchFault`] fails a batch call.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// `acquire_many` fails as a whole, nothing applied.
    AcquireManyDown,
    /// `complete_many` is applied, then its answer is lost.
    CompleteManyReplyLost,
}

/// A tapped MemoryStore whose batch calls fail as `Fault` says; every
/// other call goes through.
struct BatchFault(Tap<MemoryStore>, Fault);

impl BatchFault {
    fn new(fault: Fault) -> Self {
        BatchFault(Tap::new(MemoryStore::new()), fault)
    }
}

#[async_trait]
impl IdempotencyStore for BatchFault {
    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        self.0.acquire(key, fingerprint, lease).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.0.complete(lease, response, retention).await
    }
    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.0.release(lease).await
    }
    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.0.extend(lease, lease_for).await
    }
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.0.get(key).await
    }
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.0.delete(key).await
    }
    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        self.0.purge_expired(max).await
    }
    async fn acquire_many(
        &self,
        items: &[AcquireItem<'_>],
        lease: Duration,
    ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
        if self.1 == Fault::AcquireManyDown {
            return Err(StoreError::unavailable("test: the store is restarting"));
        }
        self.0.acquire_many(items, lease).await
    }
    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let answer = self.0.complete_many(items, retention).await;
        if self.1 == Fault::CompleteManyReplyLost {
            return Err(StoreError::unavailable("test: the reply was lost"));
        }
        answer
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_costs_one_acquire_many_and_one_complete_many() {
    let (store, idem) = tapped();
    let ks = keys("one-trip", 15);
    // Keys 10..15 completed before, with the payloads the batch sends.
    for (i, k) in ks.iter().enumerate().skip(10) {
        let done = idem
            .process(k, i as u64, |n| async move { Ok::<_, Declined>(n * 100) })
            .await;
        assert!(done.is_ok());
    }
    let (a0, c0) = (store.acquires(), store.completes());
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            Ok::<_, Declined>(n * 10)
        })
        .await;
    assert_eq!(out.len(), 15);
    for (i, outcome) in out.iter().enumerate() {
        let expected = if i < 10 {
            Processed::Executed(i as u64 * 10)
        } else {
            Processed::Replayed(i as u64 * 100)
        };
        assert_eq!(outcome.as_ref().ok(), Some(&expected), "item {i}");
    }
    assert_eq!(store.acquire_batches(), 1);
    assert_eq!(store.complete_batches(), 1);
    assert_eq!(store.acquires() - a0, 15, "no acquire of its own");
    assert_eq!(store.completes() - c0, 10, "no completion of its own");

    // The same batch again: every item a replay, one acquire_many,
    // nothing to complete; another payload for one key is its mismatch.
    let mut again: Vec<(IdempotencyKey, u64)> = ks.iter().cloned().zip(0u64..).collect();
    again[4].1 = 99;
    let again = idem
        .process_batch(again, |_| async move { Ok::<_, Declined>(0) })
        .await;
    for (i, outcome) in again.iter().enumerate() {
        match outcome {
            Err(IdemError::PayloadMismatch) if i == 4 => {}
            Ok(Processed::Replayed(v)) if i < 10 => assert_eq!(*v, i as u64 * 10),
            Ok(Processed::Replayed(v)) => assert_eq!(*v, i as u64 * 100),
            other => panic!("item {i}: {other:?}"),
        }
    }
    assert_eq!(store.acquire_batches(), 2);
    assert_eq!(store.complete_batches(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_empty_batch_makes_no_call() {
    let (store, idem) = tapped();
    let none: Vec<(IdempotencyKey, u8)> = Vec::new();
    let out = idem
        .process_batch(none, |n| async move { Ok::<_, Declined>(n) })
        .await;
    assert!(out.is_empty());
    let none: Vec<(IdempotencyKey, u8)> = Vec::new();
    let out = idem
        .process_batch_detached(none, |n| async move { Ok::<_, Declined>(n) })
        .await;
    assert!(out.is_empty());
    assert_eq!(store.acquire_batches(), 0);
}

/// A handler's `Err` and a handler's panic release their own keys only;
/// the other items are recorded, and a retry of the batch runs the failed
/// items again and replays the rest.
#[tokio::test(start_paused = true)]
async fn a_failing_and_a_panicking_handler_affect_only_their_own_items() {
    let (store, idem) = tapped();
    let ks = keys("failing", 6);
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |n: u64| {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            match n {
                1 => Err(Declined),
                3 => panic!("handler {n} panicked"),
                n => Ok(n * 10),
            }
        }
    };
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), handler)
        .await;
    for (i, outcome) in out.iter().enumerate() {
        match (i, outcome) {
            (1, Err(IdemError::Handler(Declined))) => {}
            (3, Err(IdemError::Panicked { message })) => {
                assert!(message.contains("handler 3 panicked"), "{message}")
            }
            (i, Ok(Processed::Executed(v))) => assert_eq!(*v, i as u64 * 10),
            other => panic!("item {i}: {other:?}"),
        }
    }
    assert_eq!(store.releases(), 2);
    for (i, k) in ks.iter().enumerate() {
        let absent = is_absent(&store, k).await;
        assert_eq!(absent, i == 1 || i == 3, "key {i}: absent {absent}");
    }
    let before = runs.load(Ordering::SeqCst);
    let retry = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            if n == 3 {
                Ok::<_, Declined>(33)
            } else {
                Ok(n * 1000)
            }
        })
        .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        before,
        "the first handler is not reused"
    );
    for (i, outcome) in retry.iter().enumerate() {
        match (i, outcome) {
            (1, Ok(Processed::Executed(1000))) | (3, Ok(Processed::Executed(33))) => {}
            (i, Ok(Processed::Replayed(v))) => assert_eq!(*v, i as u64 * 10),
            other => panic!("retry, item {i}: {other:?}"),
        }
    }
}

/// A key that appears several times in one batch runs once; the later
/// items get its replay. If its first run fails, the next item of the key
/// runs its own handler. A key repeated 100 times runs once.
#[tokio::test(start_paused = true)]
async fn duplicate_keys_in_one_batch_run_once_and_replay() {
    let (_, idem) = tapped();
    let (k, j) = (key("dup-k"), key("dup-j"));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |value: u64| {
        let runs = runs.clone();
        move |_: Context| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Declined>(value)
        }
    };
    let out = idem
        .process_batch_with([
            (k.clone(), None, handler(1)),
            (k.clone(), None, handler(2)),
            (j.clone(), None, handler(3)),
            (k.clone(), None, handler(4)),
        ])
        .await;
    let values: Vec<_> = out.into_iter().map(|o| o.ok()).collect();
    assert_eq!(
        values,
        vec![
            Some(Processed::Executed(1)),
            Some(Processed::Replayed(1)),
            Some(Processed::Executed(3)),
            Some(Processed::Replayed(1)),
        ]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The first item of a key fails: the second runs.
    let f = key("dup-fails");
    let maybe = |fail: bool| {
        move |_: Context| async move {
            if fail {
                Err(Declined)
            } else {
                Ok::<u64, _>(9)
            }
        }
    };
    let out = idem
        .process_batch_with([
            (f.clone(), None, maybe(true)),
            (f.clone(), None, maybe(false)),
        ])
        .await;
    assert!(
        matches!(out[0], Err(IdemError::Handler(Declined))),
        "{out:?}"
    );
    assert!(matches!(out[1], Ok(Processed::Executed(9))), "{out:?}");

    // 100 times the same key.
    let hot = key("dup-hot");
    let runs_before = runs.load(Ordering::SeqCst);
    let out = idem
        .process_batch_with((0..100).map(|i| (hot.clone(), None, handler(i))))
        .await;
    assert_eq!(runs.load(Ordering::SeqCst) - runs_before, 1);
    assert!(matches!(out[0], Ok(Processed::Executed(0))));
    assert!(out[1..]
        .iter()
        .all(|o| matches!(o, Ok(Processed::Replayed(0)))));
}

/// Completions that fail in the batch call (the store briefly
/// unavailable) are retried on their own; every item is recorded.
#[tokio::test(start_paused = true)]
async fn completions_failing_in_the_batch_are_retried_on_their_own() {
    let (store, idem) = tapped();
    let ks = keys("retry", 5);
    store.fail_completes(3);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            Ok::<_, Declined>(n)
        })
        .await;
    for (i, outcome) in out.iter().enumerate() {
        assert_eq!(outcome.as_ref().ok(), Some(&Processed::Executed(i as u64)));
    }
    assert_eq!(store.complete_batches(), 1);
    assert_eq!(store.completes(), 5 + 3, "three completions retried");
    assert_eq!(store.failing_completes_left(), 0);
    for k in &ks {
        assert!(matches!(store.get(k).await, Ok(Some(r)) if r.is_completed()));
    }
}

/// A value that cannot be recorded (a NaN in JSON) completes its key as
/// not replayable; the other items are recorded as usual.
#[tokio::test(start_paused = true)]
async fn a_result_that_cannot_be_recorded_is_its_own_items_problem() {
    let (_, idem) = tapped();
    let ks = keys("nan", 3);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            Ok::<_, Declined>(if n == 1 { f64::NAN } else { n as f64 })
        })
        .await;
    assert!(matches!(out[0], Ok(Processed::Executed(v)) if v == 0.0));
    assert!(
        matches!(&out[1], Ok(Processed::ExecutedNotReplayable { value, .. }) if value.is_nan())
    );
    assert!(matches!(out[2], Ok(Processed::Executed(v)) if v == 2.0));
    let again = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |_| async move {
            Ok::<_, Declined>(-1.0)
        })
        .await;
    assert!(matches!(again[1], Err(IdemError::ResultUnavailable { .. })));
    assert!(matches!(again[2], Ok(Processed::Replayed(v)) if v == 2.0));
}

/// An item held by another worker: `Reject` answers it "in progress" at
/// once; `Wait` lets it wait on its own while the rest of the batch is
/// recorded, then replays the holder's result.
#[tokio::test(start_paused = true)]
async fn items_held_elsewhere_are_rejected_or_wait_on_their_own() {
    let (store, idem) = tapped();
    let ks = keys("held", 3);
    let fp = Fingerprint::of(&1u64).unwrap_or_else(|e| panic!("{e}"));
    let Ok(Acquisition::Acquired(holder)) = store
        .inner()
        .acquire(&ks[1], Some(&fp), Duration::from_secs(60))
        .await
    else {
        panic!("not acquired")
    };
    let out = idem
        .process_batch(ks.iter().cloned().map(|k| (k, 1u64)), |n| async move {
            Ok::<_, Declined>(n)
        })
        .await;
    assert!(matches!(out[0], Ok(Processed::Executed(1))));
    assert!(
        matches!(out[1], Err(IdemError::InProgress { attempt: 1, .. })),
        "{out:?}"
    );
    assert!(matches!(out[2], Ok(Processed::Executed(1))));

    let waiting = idem.clone().on_in_progress(InProgressPolicy::Wait {
        max_wait: Duration::from_secs(30),
        poll: Duration::from_millis(10),
    });
    let ks2 = vec![key("held-w0"), ks[1].clone()];
    let before = store.acquires();
    let batch = {
        let (waiting, ks2) = (waiting.clone(), ks2.clone());
        tokio::spawn(async move {
            waiting
                .process_batch(ks2.into_iter().map(|k| (k, 1u64)), |n| async move {
                    Ok::<_, Declined>(n + 1)
                })
                .await
        })
    };
    // The free item is recorded while the held one waits on its own (its
    // own acquire after the batch's shows it polls).
    loop {
        let recorded = matches!(store.get(&ks2[0]).await, Ok(Some(r)) if r.is_completed());
        if recorded && store.acquires() >= before + 3 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(!batch.is_finished(), "the held item did not wait");
    store
        .inner()
        .complete(&holder, b"41", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let out = batch.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(out[0], Ok(Processed::Executed(2))), "{out:?}");
    assert!(matches!(out[1], Ok(Processed::Replayed(41))), "{out:?}");
}

/// One heartbeat task renews every lease of the batch while its handlers
/// run for five leases: no duplicate takes a key over meanwhile, and each
/// item completes.
#[tokio::test(start_paused = true)]
async fn one_heartbeat_renews_every_lease_of_the_batch() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let lease = Duration::from_millis(300);
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    let ks = keys("heartbeat", 4);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let started_tx = std::sync::Mutex::new(Some(started_tx));
    let batch = {
        let (idem, ks) = (idem.clone(), ks.clone());
        tokio::spawn(async move {
            idem.process_batch_detached(ks.into_iter().zip(0u64..), move |n| {
                let tx = started_tx.lock().ok().and_then(|mut t| t.take());
                async move {
                    if let Some(tx) = tx {
                        let _ = tx.send(());
                    }
                    tokio::time::sleep(lease * 5).await;
                    Ok::<_, Declined>(n)
                }
            })
            .await
        })
    };
    let _ = started_rx.await;
    for _ in 0..10 {
        tokio::time::sleep(lease / 2).await;
        let items: Vec<AcquireItem<'_>> = ks.iter().map(|k| AcquireItem::new(k, None)).collect();
        let dup = store
            .inner()
            .acquire_many(&items, lease)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        for (i, d) in dup.iter().enumerate() {
            assert!(
                matches!(
                    d,
                    Ok(Acquisition::InProgress { .. }) | Ok(Acquisition::Completed(_))
                ),
                "key {i} was taken over: {d:?}"
            );
        }
    }
    let out = batch.await.unwrap_or_else(|e| panic!("{e}"));
    for (i, o) in out.iter().enumerate() {
        assert_eq!(o.as_ref().ok(), Some(&Processed::Executed(i as u64)));
    }
    assert!(store.extends() >= 4 * 5, "extends: {}", store.extends());
}

/// A dropped batch future releases nothing: its keys stay in progress
/// until their leases end, then a redelivery takes them over (attempt 2).
#[tokio::test(start_paused = true)]
async fn a_dropped_batch_releases_nothing() {
    let (store, idem) = tapped();
    let lease = Duration::from_secs(10);
    let idem = idem.lease(lease);
    let ks = keys("dropped", 3);
    let started = Arc::new(AtomicUsize::new(0));
    let batch = idem.process_batch(ks.iter().cloned().zip(0u64..), |_| {
        let started = started.clone();
        async move {
            started.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<u64, Declined>>().await
        }
    });
    let cut = tokio::time::timeout(Duration::from_secs(1), batch).await;
    assert!(cut.is_err(), "the handlers never end");
    assert_eq!(started.load(Ordering::SeqCst), 3);
    assert_eq!(store.releases(), 0);
    for k in &ks {
        assert!(matches!(
            store.acquire(k, None, lease).await,
            Ok(Acquisition::InProgress { .. })
        ));
    }
    tokio::time::sleep(lease).await;
    let again = idem
        .process_batch_with(ks.iter().cloned().map(|k| {
            (
                k,
                None,
                |c: Context| async move { Ok::<_, Declined>(c.attempt) },
            )
        }))
        .await;
    for o in again {
        assert_eq!(
            o.ok(),
            Some(Processed::Executed(2)),
            "a takeover is attempt 2"
        );
    }
}

/// Detached: the caller goes away while the handlers run; they finish and
/// are recorded. A panicking handler there releases its own key only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_batch_outlives_its_caller_and_panics_stay_per_item() {
    let (store, idem) = tapped();
    let ks = keys("detached", 4);
    let gate = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(AtomicUsize::new(0));
    let caller = {
        let (idem, ks, gate, started) = (idem.clone(), ks.clone(), gate.clone(), started.clone());
        tokio::spawn(async move {
            idem.process_batch_detached(ks.into_iter().zip(0u64..), move |n| {
                let (gate, started) = (gate.clone(), started.clone());
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    gate.notified().await;
                    if n == 2 {
                        panic!("item 2 panics");
                    }
                    Ok::<_, Declined>(n)
                }
            })
            .await
        })
    };
    while started.load(Ordering::SeqCst) < 4 {
        tokio::task::yield_now().await;
    }
    caller.abort();
    let _ = caller.await;
    // The caller is gone; the handlers go on.
    gate.notify_waiters();
    loop {
        let mut settled = 0;
        for (i, k) in ks.iter().enumerate() {
            match store.get(k).await {
                Ok(Some(r)) if r.is_completed() => settled += 1,
                Ok(None) if i == 2 => settled += 1,
                _ => {}
            }
        }
        if settled == 4 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(store.releases(), 1);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            Ok::<_, Declined>(n + 100)
        })
        .await;
    for (i, o) in out.iter().enumerate() {
        match (i, o) {
            (2, Ok(Processed::Executed(102))) => {}
            (i, Ok(Processed::Replayed(v))) => assert_eq!(*v, i as u64),
            other => panic!("{other:?}"),
        }
    }
}

/// A refused configuration is every item's error; nothing is stored.
#[tokio::test(start_paused = true)]
async fn a_zero_lease_is_every_items_error() {
    let (store, idem) = tapped();
    let idem = idem.lease(Duration::ZERO);
    let ks = keys("zero", 2);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            Ok::<_, Declined>(n)
        })
        .await;
    assert!(out
        .iter()
        .all(|o| matches!(o, Err(IdemError::InvalidConfig { .. }))));
    assert_eq!(store.acquire_batches(), 0);
}

/// A payload that does not serialize is its own item's codec error; the
/// other items run.
#[tokio::test(start_paused = true)]
async fn a_payload_that_does_not_serialize_is_its_own_items_error() {
    let (_, idem) = tapped();
    let ks = keys("payload", 3);
    let payloads = [1.0, f64::NAN, 3.0];
    let out = idem
        .process_batch(ks.into_iter().zip(payloads), |x| async move {
            Ok::<_, Declined>(x * 2.0)
        })
        .await;
    assert!(matches!(out[0], Ok(Processed::Executed(v)) if v == 2.0));
    assert!(matches!(out[1], Err(IdemError::Codec(_))), "{out:?}");
    assert!(matches!(out[2], Ok(Processed::Executed(v)) if v == 6.0));
}

/// A store whose `acquire_many` fails as a whole: every item gets the
/// (retryable) store error, no handler runs.
#[tokio::test(start_paused = true)]
async fn a_failed_acquire_many_is_every_items_error_and_runs_nothing() {
    let idem = Idempotency::new(BatchFault::new(Fault::AcquireManyDown));
    let runs = Arc::new(AtomicUsize::new(0));
    let out = idem
        .process_batch(keys("down", 3).into_iter().zip(0u64..), |n| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Declined>(n)
            }
        })
        .await;
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    for o in &out {
        match o {
            Err(e @ IdemError::Store(StoreError::Unavailable(_))) => assert!(e.is_retryable()),
            other => panic!("{other:?}"),
        }
    }
}

/// 10,000 items: each outcome is its own item's, in order, executed and
/// then replayed in a shuffled batch.
#[tokio::test(start_paused = true)]
async fn ten_thousand_items_keep_their_order() {
    let (store, idem) = tapped();
    let ks = keys("order", 10_000);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            Ok::<_, Declined>(format!("value-{n}"))
        })
        .await;
    for (i, o) in out.iter().enumerate() {
        assert_eq!(
            o.as_ref().ok(),
            Some(&Processed::Executed(format!("value-{i}")))
        );
    }
    let mut order: Vec<usize> = (0..ks.len()).collect();
    fastrand::shuffle(&mut order);
    let replays = idem
        .process_batch(
            order.iter().map(|&i| (ks[i].clone(), i as u64)),
            |_| async move { Ok::<_, Declined>(String::new()) },
        )
        .await;
    for (&i, o) in order.iter().zip(&replays) {
        assert_eq!(
            o.as_ref().ok(),
            Some(&Processed::Replayed(format!("value-{i}")))
        );
    }
    assert_eq!(store.acquire_batches(), 2);
    assert_eq!(store.complete_batches(), 1);
}

/// A slow handler does not hold up the others: their results are recorded
/// while it still runs (a crash then re-runs only what had not been
/// recorded), and it is recorded when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_does_not_hold_up_the_recording_of_the_others() {
    for detached in [false, true] {
        let (store, idem) = tapped();
        let ks = keys(&format!("slow-{detached}"), 3);
        let gate = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let gate = gate.clone();
            move |n: u64| {
                let gate = gate.clone();
                async move {
                    if n == 1 {
                        gate.notified().await;
                    }
                    Ok::<_, Declined>(n)
                }
            }
        };
        let batch = {
            let (idem, ks) = (idem.clone(), ks.clone());
            tokio::spawn(async move {
                let items = ks.into_iter().zip(0u64..);
                if detached {
                    idem.process_batch_detached(items, handler).await
                } else {
                    idem.process_batch(items, handler).await
                }
            })
        };
        loop {
            let mut recorded = 0;
            for i in [0, 2] {
                if matches!(store.get(&ks[i]).await, Ok(Some(r)) if r.is_completed()) {
                    recorded += 1;
                }
            }
            if recorded == 2 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(
            matches!(store.get(&ks[1]).await, Ok(Some(r)) if !r.is_completed()),
            "the slow item is still in progress"
        );
        gate.notify_one();
        let out = batch.await.unwrap_or_else(|e| panic!("{e}"));
        for (i, o) in out.iter().enumerate() {
            assert_eq!(o.as_ref().ok(), Some(&Processed::Executed(i as u64)));
        }
        assert!(store.complete_batches() >= 2);
    }
}

/// A store whose `complete_many` fails as a whole (say its connection
/// dropped after sending): every item falls back to its own completion,
/// which records it; nothing is lost.
#[tokio::test(start_paused = true)]
async fn a_failed_complete_many_falls_back_to_each_items_own_completion() {
    let store = Arc::new(BatchFault::new(Fault::CompleteManyReplyLost));
    let idem = Idempotency::from_arc(store.clone());
    let ks = keys("complete-many-down", 4);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u64..), |n| async move {
            Ok::<_, Declined>(n)
        })
        .await;
    for (i, o) in out.iter().enumerate() {
        assert_eq!(o.as_ref().ok(), Some(&Processed::Executed(i as u64)));
    }
    // One batch call (applied, answer lost), then one completion per item
    // (each a harmless repeat with the same lease).
    assert_eq!(store.0.complete_batches(), 1);
    assert_eq!(store.0.completes(), 4 + 4);
    for k in &ks {
        assert!(matches!(store.get(k).await, Ok(Some(r)) if r.is_completed()));
    }
}

/// One item's lease is taken over while its handler runs (heartbeat off,
/// the handler slower than the lease): that item's completion is fenced
/// off (`LeaseLost`, its effects ran: the caller must know), the new
/// owner's record is untouched, and the other items are recorded.
#[tokio::test(start_paused = true)]
async fn a_lease_lost_in_a_batch_is_that_items_error_only() {
    let (store, idem) = tapped();
    let lease = Duration::from_secs(1);
    let idem = idem.lease(lease).heartbeat(false);
    let ks = keys("lease-lost", 3);
    let batch = {
        let (idem, ks) = (idem.clone(), ks.clone());
        tokio::spawn(async move {
            idem.process_batch(ks.into_iter().zip(0u64..), |n| async move {
                if n == 1 {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
                Ok::<_, Declined>(n)
            })
            .await
        })
    };
    // Once the slow item's lease is over, another worker takes it over.
    tokio::time::sleep(lease * 2).await;
    let fp = Fingerprint::of(&1u64).unwrap_or_else(|e| panic!("{e}"));
    let Ok(Acquisition::Acquired(thief)) = store
        .inner()
        .acquire(&ks[1], Some(&fp), Duration::from_secs(60))
        .await
    else {
        panic!("the lease was not over")
    };
    let out = batch.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out[0].as_ref().ok(), Some(&Processed::Executed(0)));
    assert!(matches!(out[1], Err(IdemError::LeaseLost)), "{:?}", out[1]);
    assert_eq!(out[2].as_ref().ok(), Some(&Processed::Executed(2)));
    let record = store
        .get(&ks[1])
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("record gone"));
    assert_eq!(
        record.token, thief.token,
        "the new owner's record was overwritten"
    );
}

/// With `batch_concurrency`, a handler waiting for its
/// turn while its lease ends must not run (another worker may have taken
/// the key over meanwhile). Lease 1 s, heartbeat off, one handler at a
/// time, the first takes 3 s: the second item's lease ends while it waits
/// and another worker takes its key over; the second handler never runs,
/// its item answers InProgress, and the taker's record stands.
#[tokio::test(start_paused = true)]
async fn a_handler_whose_lease_ended_while_it_waited_for_its_turn_does_not_run() {
    let (store, idem) = tapped();
    let idem = idem
        .lease(Duration::from_secs(1))
        .heartbeat(false)
        .batch_concurrency(1);
    let ks = keys("turns", 2);
    let ran = Arc::new(AtomicUsize::new(0));
    let batch = {
        let (idem, ks, ran) = (idem.clone(), ks.clone(), ran.clone());
        tokio::spawn(async move {
            idem.process_batch(ks.into_iter().map(|k| (k, 0u32)), |_| {
                let ran = ran.clone();
                async move {
                    let n = ran.fetch_add(1, Ordering::SeqCst);
                    if n == 0 {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                    }
                    Ok::<_, Declined>(n)
                }
            })
            .await
        })
    };
    // Past the second item's lease, another worker takes its key over.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let taken = match store.acquire(&ks[1], None, Duration::from_secs(60)).await {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("expected a takeover, got {other:?}"),
    };
    let out = batch.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "a handler ran after its lease ended"
    );
    assert!(matches!(out[0], Ok(Processed::Executed(0))), "{:?}", out[0]);
    assert!(
        matches!(out[1], Err(IdemError::InProgress { .. })),
        "{:?}",
        out[1]
    );
    // The taker's lease is intact: its completion succeeds.
    assert!(store
        .complete(&taken, b"1", Duration::from_secs(60))
        .await
        .is_ok());
}

/// The store takes no completion until every lease of the batch ended:
/// each item is `IdemError::Unrecorded` (not retryable), and `finish`
/// writes each one with its own lease once the store is back. The batch
/// run again replays every item; no handler ran twice.
#[tokio::test(start_paused = true)]
async fn items_not_recorded_before_their_lease_ended_are_finished_not_run_again() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone()).lease(Duration::from_secs(2));
    let ks = keys("unrecorded", 3);
    let runs = Arc::new(AtomicUsize::new(0));
    store.fail_completes(usize::MAX);
    let batch = |idem: Idempotency<Tap<MemoryStore>>, ks: Vec<IdempotencyKey>| {
        let runs = runs.clone();
        async move {
            idem.process_batch(ks.into_iter().zip(0u64..), move |n| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Declined>(n)
                }
            })
            .await
        }
    };
    let out = batch(idem.clone(), ks.clone()).await;
    let mut unrecorded = Vec::new();
    for outcome in out {
        match outcome {
            Err(e @ IdemError::Unrecorded(_)) if !e.is_retryable() => {
                if let IdemError::Unrecorded(u) = e {
                    unrecorded.push(u);
                }
            }
            other => panic!("expected Unrecorded, got {other:?}"),
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    store.fail_completes(0);
    for u in &unrecorded {
        idem.finish(u)
            .await
            .unwrap_or_else(|e| panic!("finish: {e}"));
    }
    let again = batch(idem.clone(), ks.clone()).await;
    for (i, outcome) in again.iter().enumerate() {
        assert_eq!(outcome.as_ref().ok(), Some(&Processed::Replayed(i as u64)));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3, "a handler ran twice");
}

/// A key twice in one batch, and the store takes no completion until the
/// first item's lease ended: the first item is `Unrecorded`; the second
/// is "in progress" (the key is still held by the first run, to finish),
/// never acquired: after the lease an acquire would take the key over and
/// run the handler a second time.
#[tokio::test(start_paused = true)]
async fn a_later_item_of_an_unrecorded_key_in_the_batch_is_in_progress_not_run() {
    let store = Arc::new(Tap::new(MemoryStore::new()));
    let idem = Idempotency::from_arc(store.clone()).lease(Duration::from_secs(2));
    let k = key("unrecorded-twice");
    let runs = Arc::new(AtomicUsize::new(0));
    store.fail_completes(usize::MAX);
    // Back as soon as the first item gave up, before the second round.
    let out = {
        let runs = runs.clone();
        idem.process_batch([(k.clone(), 1u64), (k.clone(), 1u64)], move |n| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Declined>(n)
            }
        })
        .await
    };
    assert!(
        matches!(out[0], Err(IdemError::Unrecorded(_))),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(out[1], Err(IdemError::InProgress { .. })),
        "{:?}",
        out[1]
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran twice");
}
