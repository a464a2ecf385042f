//! Rebalances: members joining while records run, partitions revoked with
//! a short `revoke_wait`, one key's records in two partitions. No effect
//! twice, no commit past a running record.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit::kafka::{KafkaRecord, RecordError};
use idemkit::{Idempotency, MemoryStore};

use super::{
    all_committed, committed, consumer, effect, exactly_once, name, once_set, produce, redis_store,
    send, until, until_every_effect_and_commit, wait_for, Effects,
};

/// Records running now: (partition, offset) -> when their handler started.
type Running = Arc<Mutex<HashMap<(i32, i64), Instant>>>;

/// Until `done` is set, reads the group's committed offsets on `partitions`
/// partitions of `topic` every `every`, and adds to `violations` every
/// offset past a record whose handler started before the read and still
/// runs; `checks` counts the reads.
async fn watch_commits(
    (group, topic, partitions): (&str, &str, i32),
    running: &Running,
    done: &Arc<AtomicBool>,
    (violations, checks): (&Arc<Mutex<Vec<String>>>, &Arc<AtomicU64>),
    every: Duration,
) {
    while !done.load(Ordering::SeqCst) {
        let before = Instant::now();
        let offsets = committed(group, topic, partitions).await;
        let running = running.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for ((partition, offset), started) in running {
            if started < before && offsets.get(&partition).is_some_and(|c| *c > offset) {
                violations
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!(
                        "partition {partition}: committed {:?} while offset {offset} runs",
                        offsets.get(&partition)
                    ));
            }
        }
        checks.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(every).await;
    }
}

/// Two members run records slowly (one with batches of 8 and a 100 ms
/// revoke wait) when a third joins: partitions are revoked with records
/// running. No effect twice, no commit past a running record (watched at
/// the broker all along), everything committed, and the new member gets
/// records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_while_records_run_no_effect_twice_no_commit_past_a_running_record() {
    let topic = name("orders");
    let group = name("shipping");
    support::kafka::create_topic(&topic, 3);
    let messages = 600u32;
    let mut records = Vec::new();
    for m in 0..messages {
        let copies = if m % 5 == 0 { 2 } else { 1 };
        for c in 0..copies {
            records.push((
                ((m + c) % 3) as i32,
                Some(format!("o-{m}")),
                vec![],
                format!("{{\"order\":{m}}}"),
            ));
        }
    }
    let ends = produce(&topic, records).await;
    let effects: Effects = Arc::default();
    // (partition, offset) -> when its handler started, while it runs.
    let running: Running = Arc::default();
    let store = redis_store().await;
    // Slow work while the third member joins, so that records remain for
    // it and are in flight at the rebalance.
    let slow = Arc::new(AtomicBool::new(false));
    let handler = {
        let (effects, running, slow) = (effects.clone(), running.clone(), slow.clone());
        move |record: KafkaRecord| {
            let (effects, running, slow) = (effects.clone(), running.clone(), slow.clone());
            async move {
                let at = (record.partition, record.offset);
                running
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(at, Instant::now());
                // Work of 5 to 60 ms; one record in 50 takes 600 ms.
                let ms = if record.offset % 50 == 7 {
                    600
                } else if slow.load(Ordering::SeqCst) {
                    fastrand::u64(100..200)
                } else {
                    fastrand::u64(5..60)
                };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let id = record.key_text()?.to_owned();
                effect(&effects, &id);
                running
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&at);
                Ok::<_, RecordError>(id)
            }
        }
    };
    let member = |revoke_wait: Duration, batch: usize| {
        consumer(
            &group,
            &topic,
            Idempotency::from_arc(store.clone()).lease(Duration::from_secs(5)),
        )
        .partition_concurrency(8)
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(300))
        .batch(batch)
        // A short wait on one member: some records are left running
        // when it lets its partitions go.
        .revoke_wait(revoke_wait)
    };
    // A runs its records in batches of up to 8 per partition.
    let (a, b) = (
        member(Duration::from_millis(100), 8),
        member(Duration::from_secs(10), 1),
    );
    let done = Arc::new(AtomicBool::new(false));
    let stop = || once_set(done.clone());
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let checks = Arc::new(AtomicU64::new(0));
    // Watches the broker's committed offsets: never past a record whose
    // handler started before the offsets were read and still runs.
    let watch = watch_commits(
        (&group, &topic, 3),
        &running,
        &done,
        (&violations, &checks),
        Duration::from_millis(10),
    );
    let control = async {
        until("100 effects", Duration::from_secs(60), || async {
            effects.lock().unwrap_or_else(|p| p.into_inner()).len() >= 100
        })
        .await;
        // A third member joins while records run on the two others (it
        // joins the group when it subscribes, in `new`).
        slow.store(true, Ordering::SeqCst);
        let c = member(Duration::from_secs(10), 1);
        let joined = c.run(handler.clone(), stop());
        let wait = async {
            until(
                "the new member's first record",
                Duration::from_secs(60),
                || async { c.stats().received > 0 },
            )
            .await;
            slow.store(false, Ordering::SeqCst);
            until_every_effect_and_commit(&effects, messages, (&group, &topic), &ends).await;
            done.store(true, Ordering::SeqCst);
        };
        let (c_stats, ()) = tokio::join!(joined, wait);
        c_stats.unwrap_or_else(|e| panic!("member C: {e}"))
    };
    let (a_stats, b_stats, c_stats, ()) = tokio::join!(
        a.run(handler.clone(), stop()),
        b.run(handler.clone(), stop()),
        control,
        watch
    );
    let (a_stats, b_stats) = (
        a_stats.unwrap_or_else(|e| panic!("{e}")),
        b_stats.unwrap_or_else(|e| panic!("{e}")),
    );
    exactly_once(&effects, (0..messages).map(|m| format!("o-{m}")));
    let v = violations.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(v.is_empty(), "{v:#?}");
    assert!(checks.load(Ordering::SeqCst) > 10, "the watch ran");
    assert!(
        all_committed(&group, &topic, &ends).await,
        "lag 0 at the end"
    );
    let revoked = a_stats.revoked + b_stats.revoked;
    assert!(
        revoked > 0,
        "the join revoked partitions: {a_stats:?} {b_stats:?}"
    );
    assert!(
        c_stats.received > 0,
        "the new member got records: {c_stats:?}"
    );
    let executed = a_stats.executed + b_stats.executed + c_stats.executed;
    assert_eq!(
        executed,
        u64::from(messages),
        "{a_stats:?} {b_stats:?} {c_stats:?}"
    );
}

/// Two partitions hold records of the same keys; a slow handler (2 s) and a
/// second member joining with a short revoke_wait on the first (a revoke
/// while records run, and records of one key waiting in the chain behind
/// them). Every key's effect once; the committed offsets never pass a
/// running record; everything committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_two_partitions_runs_once_through_a_rebalance_with_a_short_revoke_wait() {
    let topic = name("two");
    let group = name("two-g");
    support::kafka::create_topic(&topic, 2);
    let keys = 40u32;
    let mut ends = BTreeMap::new();
    for k in 0..keys {
        for p in 0..2 {
            let o = send(
                &topic,
                p,
                Some(format!("k-{k}").as_bytes()),
                &[],
                Some(format!("{k}").as_bytes()),
            )
            .await;
            ends.insert(p, o + 1);
        }
    }
    let store: Arc<MemoryStore> = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let running: Running = Arc::default();
    let handler = {
        let (effects, running) = (effects.clone(), running.clone());
        move |record: KafkaRecord| {
            let (effects, running) = (effects.clone(), running.clone());
            async move {
                let at = (record.partition, record.offset);
                running
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(at, Instant::now());
                let ms = if record.offset % 7 == 3 {
                    2000
                } else {
                    fastrand::u64(5..80)
                };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let id = record.key_text()?.to_owned();
                effect(&effects, &id);
                running
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&at);
                Ok::<_, RecordError>(id)
            }
        }
    };
    let member = |wait: Duration| {
        consumer(
            &group,
            &topic,
            Idempotency::from_arc(store.clone()).lease(Duration::from_secs(3)),
        )
        .partition_concurrency(4)
        .commit_interval(Duration::ZERO)
        .revoke_wait(wait)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(300))
    };
    let done = Arc::new(AtomicBool::new(false));
    let stop = || once_set(done.clone());
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let checks: Arc<AtomicU64> = Arc::default();
    let watch = watch_commits(
        (&group, &topic, 2),
        &running,
        &done,
        (&violations, &checks),
        Duration::from_millis(20),
    );
    let a = member(Duration::from_millis(50));
    let started = Arc::new(AtomicU32::new(0));
    let control = async {
        wait_for(Duration::from_secs(30), || async {
            !running.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        started.store(1, Ordering::SeqCst);
        let b = member(Duration::from_secs(10));
        let b_run = b.run(handler.clone(), stop());
        let wait = async {
            let ok = wait_for(Duration::from_secs(60), || async {
                effects.lock().unwrap_or_else(|p| p.into_inner()).len() == keys as usize && {
                    let c = committed(&group, &topic, 2).await;
                    ends.iter().all(|(p, e)| c.get(p) == Some(e))
                }
            })
            .await;
            done.store(true, Ordering::SeqCst);
            ok
        };
        let (b_stats, ok) = tokio::join!(b_run, wait);
        (b_stats.unwrap_or_else(|e| panic!("{e}")), ok)
    };
    let (a_stats, (b_stats, ok), ()) = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::join!(a.run(handler.clone(), stop()), control, watch)
    })
    .await
    .unwrap_or_else(|_| panic!("did not end"));
    let a_stats = a_stats.unwrap_or_else(|e| panic!("{e}"));
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        ok,
        "not everything done/committed: {effects:?} {a_stats:?} {b_stats:?}"
    );
    for k in 0..keys {
        assert_eq!(
            effects.get(&format!("k-{k}")),
            Some(&1),
            "k-{k}: {a_stats:?} {b_stats:?}"
        );
    }
    let v = violations.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(v.is_empty(), "{v:#?}");
    assert!(a_stats.revoked > 0, "{a_stats:?}");
}
