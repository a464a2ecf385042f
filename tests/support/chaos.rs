//! A storm that runs through a fault: many tasks deliver every key until it
//! is processed, a fault is injected once some keys ran, and (optionally)
//! recovered once a call has seen it. Counts executions per key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::{IdemError, Idempotency, IdempotencyKey, IdempotencyStore, Processed, StoreError};

pub type Action = Box<dyn FnOnce() + Send>;

/// What happened in the storm.
pub struct Report {
    /// Calls that failed with `Unavailable` (and were delivered again).
    pub unavailable: usize,
}

/// Delivers each of `key_count` keys from `tasks` tasks until processed;
/// runs `fault` once a third of the keys ran, and `recover` (if any) once a
/// call failed with `Unavailable` after the fault (a `process`, or the
/// `finish` of an `Unrecorded` run: every task may be finishing). Panics unless every key
/// ran exactly once and every replay returned that run's value.
pub async fn storm_through_fault<S>(
    idem: Idempotency<S>,
    key_count: usize,
    tasks: usize,
    fault: Action,
    recover: Option<Action>,
) -> Report
where
    S: IdempotencyStore + ?Sized,
{
    let run = format!("{:08x}", fastrand::u32(..));
    let keys: Arc<Vec<IdempotencyKey>> = Arc::new(
        (0..key_count)
            .map(|i| {
                IdempotencyKey::new("storm.fault", format!("{run}-{i}"))
                    .unwrap_or_else(|e| panic!("{e}"))
            })
            .collect(),
    );
    let executions: Arc<Vec<AtomicUsize>> =
        Arc::new((0..key_count).map(|_| AtomicUsize::new(0)).collect());
    let total = Arc::new(AtomicUsize::new(0));
    let unavailable = Arc::new(AtomicUsize::new(0));
    let faulted = Arc::new(AtomicBool::new(false));
    let fault_now = Arc::new(tokio::sync::Notify::new());
    let saw_outage = Arc::new(tokio::sync::Notify::new());

    let chaos = {
        let (fault_now, saw_outage, faulted) =
            (fault_now.clone(), saw_outage.clone(), faulted.clone());
        tokio::spawn(async move {
            fault_now.notified().await;
            tokio::task::spawn_blocking(fault)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            faulted.store(true, Ordering::SeqCst);
            if let Some(recover) = recover {
                // Bounded: with no call seeing the outage the server still
                // comes back, and the test fails saying so, never hangs.
                let saw = tokio::time::timeout(Duration::from_secs(60), saw_outage.notified())
                    .await
                    .is_ok();
                tokio::task::spawn_blocking(recover)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                assert!(saw, "no call saw the outage within 60 s of the fault");
            }
        })
    };

    let mut handles = Vec::new();
    for t in 0..tasks {
        let (idem, keys, executions, total, unavailable) = (
            idem.clone(),
            keys.clone(),
            executions.clone(),
            total.clone(),
            unavailable.clone(),
        );
        let (fault_now, saw_outage, faulted) =
            (fault_now.clone(), saw_outage.clone(), faulted.clone());
        handles.push(tokio::spawn(async move {
            let mut order: Vec<usize> = (0..keys.len()).collect();
            fastrand::Rng::with_seed(t as u64).shuffle(&mut order);
            let mut seen = Vec::new();
            for i in order {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                loop {
                    let (executions, total, fault_now) = (&executions, &total, &fault_now);
                    let key_count = keys.len();
                    let outcome = idem
                        .process(&keys[i], i as u64, |i| async move {
                            executions[i as usize].fetch_add(1, Ordering::SeqCst);
                            if total.fetch_add(1, Ordering::SeqCst) + 1 == key_count / 3 {
                                fault_now.notify_one();
                            }
                            Ok::<_, std::io::Error>(format!("{i}:{:x}", fastrand::u64(..)))
                        })
                        .await;
                    match outcome {
                        Ok(p) => {
                            seen.push((i, p));
                            break;
                        }
                        Err(IdemError::Store(StoreError::Unavailable(_))) => {
                            unavailable.fetch_add(1, Ordering::SeqCst);
                            if faulted.load(Ordering::SeqCst) {
                                saw_outage.notify_one();
                            }
                            assert!(
                                tokio::time::Instant::now() < deadline,
                                "key {i}: the store never came back (the last error: {:?})",
                                outcome
                            );
                            // Redelivered after a short pause, as a broker would.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        // The handler ran; the store was away past the
                        // lease: finished with the same lease, as a
                        // consumer does, never run again.
                        // The finisher has its own minute from here.
                        Err(IdemError::Unrecorded(u)) => {
                            let since = tokio::time::Instant::now();
                            let mut tries = 0u32;
                            loop {
                                tries += 1;
                                match idem.finish(&u).await {
                                    Ok(()) => {
                                        let value: String = serde_json::from_slice(u.response())
                                            .unwrap_or_else(|e| panic!("key {i}: {e}"));
                                        seen.push((i, Processed::Executed(value)));
                                        break;
                                    }
                                    Err(e) if e.is_retryable() => {
                                        // The outage seen here counts too:
                                        // every task may be finishing.
                                        if faulted.load(Ordering::SeqCst) {
                                            saw_outage.notify_one();
                                        }
                                        assert!(
                                            since.elapsed() < Duration::from_secs(60),
                                            "key {i}: the store never came back to finish \
                                             ({tries} tries in {:?}, the last: {e})",
                                            since.elapsed()
                                        );
                                        tokio::time::sleep(Duration::from_millis(20)).await;
                                    }
                                    Err(e) => panic!("key {i}: finishing: {e:?}"),
                                }
                            }
                        }
                        Err(e) => panic!("key {i}: unexpected error {e:?}"),
                    }
                }
            }
            seen
        }));
    }
    let mut executed: HashMap<usize, String> = HashMap::new();
    let mut replays = Vec::new();
    for handle in handles {
        for (i, p) in handle.await.unwrap_or_else(|e| panic!("{e}")) {
            match p {
                Processed::Executed(v) => {
                    assert!(
                        executed.insert(i, v).is_none(),
                        "key {i} reported executed twice"
                    );
                }
                Processed::Replayed(v) => replays.push((i, v)),
                Processed::ExecutedNotReplayable { reason, .. } => {
                    panic!("key {i}: not recordable: {reason}")
                }
            }
        }
    }
    chaos.await.unwrap_or_else(|e| panic!("{e}"));
    for (i, e) in executions.iter().enumerate() {
        let n = e.load(Ordering::SeqCst);
        assert_eq!(n, 1, "key {i} ran {n} times");
    }
    assert_eq!(executed.len(), key_count);
    for (i, v) in replays {
        assert_eq!(
            Some(&v),
            executed.get(&i),
            "key {i}: replay differs from the run"
        );
    }
    Report {
        unavailable: unavailable.load(Ordering::SeqCst),
    }
}
