//! Results that could not be recorded (`IdemError::Unrecorded`): the store
//! down after the handler's effect, past the lease. The entry is kept and
//! finished with the run's own lease once the store is back, then acked;
//! a reclaim of it or a duplicate of its key meanwhile never runs the
//! handler again, and a duplicate held back is settled once it finishes.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use idemkit::redis::redis;
use idemkit::redis::streams::StreamEntry;
use idemkit::Idempotency;

use super::{
    conn, consumer_on, pending, pending_of, ran_and_nothing_pending, run_until, xadd, Check,
};

/// A handler that counts its runs in `effects` and answers "charged"; its
/// first run takes the store of `down` down right after its effect, for
/// `outage` (or until the test brings it back).
fn charging(
    effects: &Arc<AtomicU64>,
    down: &Arc<AtomicBool>,
    outage: Option<Duration>,
) -> impl Fn(StreamEntry) -> BoxFuture<'static, Result<String, std::io::Error>> + Send + Sync + 'static
{
    let (effects, down) = (effects.clone(), down.clone());
    move |_e: StreamEntry| {
        let (effects, down) = (effects.clone(), down.clone());
        Box::pin(async move {
            if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                match outage {
                    Some(length) => support::flaky::outage(&down, length),
                    None => down.store(true, Ordering::SeqCst),
                }
            }
            Ok("charged".to_owned())
        })
    }
}

/// The store goes away right after the handler's effect, for 3 s, three
/// times the 1 s lease: the executor gives up completing before the lease
/// ends (`IdemError::Unrecorded`). The entry stays pending and comes back
/// to this consumer (XAUTOCLAIM after 300 ms idle) while the lease is over:
/// it does not run again. Its completion is written with the first run's
/// lease once the store is back, then the entry is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_past_the_lease_during_completion_never_runs_the_entry_twice() {
    let stream = format!("outage-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = consumer_on(&stream, "a", idem.clone())
        .await
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_millis(300));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    // The first run: the store goes down after the effect, for 3 s.
    let handler = charging(&effects, &down, Some(Duration::from_secs(3)));
    let stats = run_until(
        &consumer,
        handler,
        Duration::from_secs(20),
        ran_and_nothing_pending(&stream, &effects, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!(stats.executed, 1, "{stats:?}");
    let key = idemkit::IdempotencyKey::new(format!("stream.{stream}"), "m-1")
        .unwrap_or_else(|e| panic!("{e}"));
    let record = idem.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    let response = match record.map(|r| r.state) {
        Some(idemkit::RecordState::Completed { response, .. }) => response,
        other => panic!("the entry's record: {other:?}"),
    };
    assert_eq!(&response[..], b"\"charged\"", "the first run's result");
}

/// Entry A (`message_id` m-1) runs; the store goes down right after its
/// effect, so its completion is not written before the 1 s lease ends
/// (`Unrecorded`): A is kept, to be finished with its own lease. While the
/// consumer waits in its `XREADGROUP BLOCK`, the store comes back and the
/// producer sends the same message again (entry B, same `message_id`). B
/// gets "in progress" or the replay of A, never a second effect: the
/// unfinished key, not only A's entry ID, holds B back, even when B is read
/// before A is finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_entry_of_an_unfinished_key_never_runs_it_again() {
    let stream = format!("unfinished-dup-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = consumer_on(&stream, "a", idem.clone())
        .await
        .block(Duration::from_secs(3))
        .claim_idle(Duration::from_secs(60));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    // The first run: the store goes down after the effect (until the test
    // brings it back).
    let handler = charging(&effects, &down, None);
    // The producer's retry, sent while the consumer blocks on its read,
    // once the first run's lease is over and the store is back.
    let retry = {
        let (effects, down, stream) = (effects.clone(), down.clone(), stream.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while effects.load(Ordering::SeqCst) == 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(1600)).await;
            down.store(false, Ordering::SeqCst);
            xadd(&stream, &[("message_id", "m-1")]).await;
        })
    };
    let t0 = tokio::time::Instant::now();
    let done = {
        let effects = effects.clone();
        move || {
            let effects = effects.clone();
            Box::pin(async move {
                effects.load(Ordering::SeqCst) >= 2 || t0.elapsed() > Duration::from_secs(8)
            }) as Check
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(30), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    retry.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect of m-1 ran twice (its duplicate entry took the unfinished key over): {stats:?}"
    );
}

/// Entry A (m-1) runs; the store goes down right after its effect, so its
/// completion is not written (`Unrecorded`, A kept to finish). While the
/// store is still down the producer retries (entry B, same m-1): B is held
/// back (its key is unfinished) and left pending in this consumer's PEL.
/// The store comes back, A is finished and acked: B's key now has a
/// recorded result, and B is settled soon after (its replay and its ack),
/// not left pending until `claim_idle` (60 s here) passes or a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_held_back_by_an_unfinished_key_is_settled_once_it_finishes() {
    let stream = format!("unfinished-held-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = consumer_on(&stream, "a", idem.clone())
        .await
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_secs(60));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    // The first run: the store goes down after the effect (until the test
    // brings it back).
    let handler = charging(&effects, &down, None);
    let came_back = Arc::new(std::sync::Mutex::new(None::<tokio::time::Instant>));
    let producer = {
        let (effects, down, stream, came_back) = (
            effects.clone(),
            down.clone(),
            stream.clone(),
            came_back.clone(),
        );
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while effects.load(Ordering::SeqCst) == 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // A's completion given up (Unrecorded) while the store is down.
            tokio::time::sleep(Duration::from_millis(1500)).await;
            xadd(&stream, &[("message_id", "m-1")]).await;
            // B read and held back, the store still down.
            tokio::time::sleep(Duration::from_millis(1000)).await;
            down.store(false, Ordering::SeqCst);
            *came_back.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(tokio::time::Instant::now());
        })
    };
    let t0 = tokio::time::Instant::now();
    let done = {
        let (stream, came_back) = (stream.clone(), came_back.clone());
        move || {
            let (stream, came_back) = (stream.clone(), came_back.clone());
            Box::pin(async move {
                let back = *came_back.lock().unwrap_or_else(|p| p.into_inner());
                t0.elapsed() > Duration::from_secs(20)
                    || back.is_some_and(|b| b.elapsed() > Duration::from_secs(10))
                    || (back.is_some() && pending(&stream, "g").await == 0)
            }) as Check
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(40), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    producer.await.unwrap_or_else(|e| panic!("{e}"));
    let left = pending(&stream, "g").await;
    assert_eq!(
        (effects.load(Ordering::SeqCst), left),
        (1, 0),
        "(effects, entries still pending) 10 s after the store came back and A was finished: {stats:?}"
    );
}

/// Consumer A's handler runs; A's link to the store is cut right after the
/// effect, for 4 s, four times the 1 s lease (`Unrecorded`), while Redis
/// itself stays reachable. Consumer B of the same group (its own link to
/// the store is fine) reclaims entries idle for 1 s. A keeps its entry
/// claimed the whole time (in flight, then while it finishes), so B never
/// reclaims it, never takes the expired lease over, never runs it again;
/// A finishes and acks once its store is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_consumer_never_reclaims_an_entry_its_holder_is_finishing() {
    let stream = format!("unfinished-reclaim-{:08x}", fastrand::u32(..));
    let records = idemkit::MemoryStore::new();
    let (store_a, down) = support::flaky::FlakyStore::new(records.clone());
    let idem_a = Idempotency::new(store_a).lease(Duration::from_secs(1));
    let idem_b = Idempotency::new(records).lease(Duration::from_secs(1));
    let a = consumer_on(&stream, "a", idem_a)
        .await
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_secs(1));
    let b = consumer_on(&stream, "b", idem_b)
        .await
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_secs(1));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let handler_a = charging(&effects, &down, Some(Duration::from_secs(4)));
    let handler_b = charging(&effects, &Arc::new(AtomicBool::new(false)), None);
    let run_a = {
        let effects = effects.clone();
        async move {
            run_until(
                &a,
                handler_a,
                Duration::from_secs(30),
                ran_and_nothing_pending(&stream, &effects, 1),
            )
            .await
        }
    };
    let run_b = async {
        // B starts once A's handler ran.
        while effects.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let stop = tokio::time::sleep(Duration::from_secs(8));
        b.run(handler_b, stop).await
    };
    let (stats_a, stats_b) = tokio::join!(run_a, run_b);
    let stats_b = stats_b.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "B reclaimed the entry A was finishing and ran it again: A {stats_a:?}, B {stats_b:?}"
    );
    let stats_a = stats_a.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats_a.executed, 1, "A finished it: {stats_a:?}");
}

/// A runs entry E1 (m-1); its store goes away after the effect for 6 s,
/// past the 1 s lease (`Unrecorded`): A keeps E1 claimed while it finishes.
/// The producer sends m-1 again (E2); A reads it and holds it back
/// (pending in A's list, "never run" while the key is unfinished). Only
/// then does B (same group, same `claim_idle`, store link fine) start.
/// A keeps E2 claimed too, so B never reclaims it and never runs m-1
/// again (it did, the lease being over, when only E1 was kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_held_back_for_an_unfinished_key_is_kept_from_other_consumers() {
    let stream = format!("heldback-{:08x}", fastrand::u32(..));
    let records = idemkit::MemoryStore::new();
    let (store_a, down) = support::flaky::FlakyStore::new(records.clone());
    let idem_a = Idempotency::new(store_a).lease(Duration::from_secs(1));
    let idem_b = Idempotency::new(records).lease(Duration::from_secs(1));
    let claim_idle = Duration::from_secs(1);
    let a = consumer_on(&stream, "a", idem_a)
        .await
        .block(Duration::from_millis(100))
        .claim_idle(claim_idle);
    let b = consumer_on(&stream, "b", idem_b)
        .await
        .block(Duration::from_millis(100))
        .claim_idle(claim_idle);
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let handler_a = charging(&effects, &down, Some(Duration::from_secs(6)));
    let handler_b = charging(&effects, &Arc::new(AtomicBool::new(false)), None);
    let run_a = {
        let effects = effects.clone();
        let stream = stream.clone();
        async move {
            run_until(
                &a,
                handler_a,
                Duration::from_secs(30),
                ran_and_nothing_pending(&stream, &effects, 1),
            )
            .await
        }
    };
    let b_started = Arc::new(AtomicBool::new(false));
    let run_b = {
        let (effects, stream, b_started) = (effects.clone(), stream.clone(), b_started.clone());
        async move {
            while effects.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Past the lease: A's run is unfinished by now.
            tokio::time::sleep(Duration::from_millis(1500)).await;
            xadd(&stream, &[("message_id", "m-1")]).await;
            // A read the duplicate (two entries pending with A).
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while pending_of(&stream, "a").await < 2 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "A never read the duplicate"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            b_started.store(true, Ordering::SeqCst);
            let stop = tokio::time::sleep(Duration::from_secs(6));
            b.run(handler_b, stop).await
        }
    };
    let (stats_a, stats_b) = tokio::join!(run_a, run_b);
    assert!(b_started.load(Ordering::SeqCst));
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "B reclaimed the duplicate A held back for its unfinished key and ran m-1 again: A {stats_a:?}, B {stats_b:?}"
    );
}

/// An entry A is finishing is deleted from the stream (XDEL) while A holds
/// it: A finishes, nothing stays pending, the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_entry_deleted_from_the_stream_leaves_nothing_stuck() {
    let stream = format!("xdel-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let a = consumer_on(&stream, "a", idem.clone())
        .await
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_millis(200));
    let id = xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let handler = charging(&effects, &down, Some(Duration::from_secs(3)));
    let deleter = {
        let (effects, stream) = (effects.clone(), stream.clone());
        tokio::spawn(async move {
            while effects.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let n: i64 = redis::cmd("XDEL")
                .arg(&stream)
                .arg(&id)
                .query_async(&mut conn().await)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            n
        })
    };
    let stats = run_until(
        &a,
        handler,
        Duration::from_secs(20),
        ran_and_nothing_pending(&stream, &effects, 1),
    )
    .await;
    let deleted = deleter.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(deleted, 1);
    let stats = stats.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(effects.load(Ordering::SeqCst), 1, "{stats:?}");
    assert_eq!(pending(&stream, "g").await, 0);
}

/// Entry E1 (m-1) runs; the store goes away past the 1 s lease
/// (`Unrecorded`); a duplicate E2 (m-1 again) is read and held back. When
/// the store comes back it refuses E1's completion for good: E1 is
/// dead-lettered (its handler ran). E2, and any later entry of the key
/// this consumer reads, is dead-lettered too, never run: the handler
/// already ran for the key. (E2 was read again, took the expired lease
/// over and ran the handler a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_of_a_key_whose_completion_was_refused_never_run() {
    let stream = format!("unfinished-refused-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idemkit::MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = consumer_on(&stream, "a", idem)
        .await
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_secs(60));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        move |_e: StreamEntry| {
            let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
            Box::pin(async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    refuse.store(true, Ordering::SeqCst);
                    support::flaky::outage(&down, Duration::from_secs(3));
                }
                Ok::<_, std::io::Error>("charged".to_owned())
            }) as BoxFuture<'static, _>
        }
    };
    let producer = {
        let (effects, stream) = (effects.clone(), stream.clone());
        tokio::spawn(async move {
            while effects.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Past the lease, the store still down: E2 is held back.
            tokio::time::sleep(Duration::from_millis(1500)).await;
            xadd(&stream, &[("message_id", "m-1")]).await;
        })
    };
    let dead = format!("{stream}:dead");
    let done = {
        let dead = dead.clone();
        move || {
            let dead = dead.clone();
            Box::pin(async move { super::entries_of(&dead).await.len() >= 2 }) as Check
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(30), done).await;
    producer.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the duplicate ran the handler again after its key's completion was refused: {stats:?}"
    );
    stats.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pending(&stream, "g").await, 0);
}
