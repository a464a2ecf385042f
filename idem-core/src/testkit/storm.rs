//! Concurrency: many workers racing for one key, and the storm (every
//! key delivered by many tasks at once, each run exactly once).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{
    Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy, Processed,
};

use super::{fp, unique_key, Harness, DAY, LONG};

/// Many workers acquiring one key at once: exactly one wins.
pub async fn concurrent_acquire_single_winner<H: Harness>(h: &H) {
    let store = Arc::new(h.store().await);
    let key = unique_key("race");
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let store = store.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            store.acquire(&key, Some(&fp("a")), LONG).await
        }));
    }
    let mut winners = 0;
    for task in tasks {
        match task.await {
            Ok(Ok(Acquisition::Acquired(_))) => winners += 1,
            Ok(Ok(Acquisition::InProgress { attempt: 1, .. })) => {}
            other => panic!("unexpected outcome in the race: {other:?}"),
        }
    }
    assert_eq!(winners, 1, "exactly one acquirer must win");
}

/// The storm: `storm_tasks` tasks (64) each deliver every one of
/// `storm_keys` keys (500) through [`Idempotency::process`], in their own
/// random order. Exactly one handler execution per key; every other call a
/// replay of that execution's value.
pub async fn concurrent_storm<H: Harness>(h: &H) {
    let settings = h.settings();
    let idem = storm_executor(h.store().await);
    storm(&[idem], settings.storm_tasks, settings.storm_keys).await;
}

/// The executor settings the storm uses: a long lease, and waiting (with
/// short polls) for keys another task is running.
pub fn storm_executor<S: IdempotencyStore>(store: S) -> Idempotency<S> {
    Idempotency::new(store)
        .lease(LONG)
        .retention(DAY)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(60),
            poll: Duration::from_millis(2),
        })
}

/// Runs the storm over several executors (say one per connection pool, as
/// separate processes would have): `tasks` tasks, spread round-robin over
/// `executors`, each deliver all `key_count` keys in their own random order.
/// Panics unless every key ran exactly once and every other call replayed
/// that run's value. Returns the number of calls made.
pub async fn storm<S: IdempotencyStore + ?Sized>(
    executors: &[Idempotency<S>],
    tasks: usize,
    key_count: usize,
) -> usize {
    assert!(!executors.is_empty(), "storm needs at least one executor");
    let run = format!("{:016x}", fastrand::u64(..));
    let keys: Arc<Vec<IdempotencyKey>> = Arc::new(
        (0..key_count)
            .map(
                |i| match IdempotencyKey::new("idem.conformance.storm", format!("{run}-{i}")) {
                    Ok(k) => k,
                    Err(e) => panic!("{e}"),
                },
            )
            .collect(),
    );
    let executions: Arc<Vec<AtomicU32>> =
        Arc::new((0..key_count).map(|_| AtomicU32::new(0)).collect());

    let mut handles = Vec::with_capacity(tasks);
    for t in 0..tasks {
        let idem = executors[t % executors.len()].clone();
        let keys = keys.clone();
        let executions = executions.clone();
        handles.push(tokio::spawn(async move {
            let mut order: Vec<usize> = (0..keys.len()).collect();
            fastrand::Rng::with_seed(t as u64).shuffle(&mut order);
            let mut seen = Vec::with_capacity(order.len());
            for i in order {
                let executions = executions.clone();
                let outcome = idem
                    .process(&keys[i], i as u64, |i| async move {
                        executions[i as usize].fetch_add(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        // A value only this execution knows: replays must carry it.
                        Ok::<_, Infallible>(format!("{i}:{:016x}", fastrand::u64(..)))
                    })
                    .await;
                match outcome {
                    Ok(p) => seen.push((i, p)),
                    Err(e) => return Err(format!("key {i}: {e:?}")),
                }
            }
            Ok::<_, String>(seen)
        }));
    }

    let mut executed: Vec<Option<String>> = vec![None; key_count];
    let mut replays: Vec<(usize, String)> = Vec::new();
    for handle in handles {
        let seen = match handle.await {
            Ok(Ok(seen)) => seen,
            Ok(Err(e)) => panic!("storm call failed: {e}"),
            Err(e) => panic!("storm task failed: {e}"),
        };
        for (i, p) in seen {
            match p {
                Processed::Executed(v) => {
                    assert!(executed[i].is_none(), "key {i} reported executed twice");
                    executed[i] = Some(v);
                }
                Processed::Replayed(v) => replays.push((i, v)),
                Processed::ExecutedNotReplayable { reason, .. } => {
                    panic!("key {i}: a string result was not recordable: {reason}")
                }
            }
        }
    }
    let total: u32 = executions.iter().map(|e| e.load(Ordering::SeqCst)).sum();
    for (i, e) in executions.iter().enumerate() {
        assert_eq!(
            e.load(Ordering::SeqCst),
            1,
            "key {i} ran {} times",
            e.load(Ordering::SeqCst)
        );
    }
    assert_eq!(total as usize, key_count);
    assert_eq!(replays.len(), tasks * key_count - key_count);
    for (i, v) in replays {
        assert_eq!(
            Some(&v),
            executed[i].as_ref(),
            "key {i}: replay differs from the execution"
        );
    }
    tasks * key_count
}
