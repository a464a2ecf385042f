//! Results that could not be recorded (`IdemError::Unrecorded`): the store
//! down after the handler's effect, past the lease. The record is kept and
//! its result finished once the store is back, with its own lease; no
//! other delivery of its key, in the same batch or after a shutdown and a
//! restart, runs the handler again. A rebalance meanwhile hands the record
//! on: the window the crate docs name, its second run fenced above the
//! first.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use idemkit::kafka::{KafkaRecord, RecordError};
use idemkit::{Idempotency, MemoryStore};
use support::flaky::FlakyStore;

use super::{
    committed, consumer, effect, effects_of, name, run_until_committed, send, wait_for, Effects,
};

/// A handler that counts each record's effect by its key and answers
/// "done {key}"; its first run takes the store of `down` down right after
/// the effect, for `outage` (or until the test brings it back).
fn taking_the_store_down(
    effects: &Effects,
    down: &Arc<AtomicBool>,
    outage: Option<Duration>,
) -> impl Fn(KafkaRecord) -> BoxFuture<'static, Result<String, RecordError>>
       + Clone
       + Send
       + Sync
       + 'static {
    let first = Arc::new(AtomicBool::new(true));
    let (effects, down) = (effects.clone(), down.clone());
    move |record: KafkaRecord| {
        let (effects, down, first) = (effects.clone(), down.clone(), first.clone());
        Box::pin(async move {
            let id = record.key_text()?.to_owned();
            effect(&effects, &id);
            if first.swap(false, Ordering::SeqCst) {
                match outage {
                    Some(length) => support::flaky::outage(&down, length),
                    None => down.store(true, Ordering::SeqCst),
                }
            }
            Ok(format!("done {id}"))
        })
    }
}

/// The store goes down while the handler runs (after its effect), for 3 s,
/// longer than the 1 s lease: the result cannot be recorded before the
/// lease ends (`Unrecorded`). The consumer keeps the record and finishes
/// it once the store is back; it never takes its own expired lease over to
/// run the handler again. One effect, the record committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_during_complete_never_runs_the_effect_twice() {
    let topic = name("outage");
    let group = name("outage-g");
    support::kafka::create_topic(&topic, 1);
    let end = send(&topic, 0, Some(b"pay-1"), &[], Some(b"{\"amount\":1}")).await + 1;

    let (store, down) = FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = consumer(&group, &topic, idem)
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let effects: Effects = Arc::default();
    // The first run: the store goes down after the effect, for 3 s.
    let handler = taking_the_store_down(&effects, &down, Some(Duration::from_secs(3)));
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(30),
    )
    .await;
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "committed in the end: {stats:?}"
    );
    assert_eq!(
        effects.get("pay-1"),
        Some(&1),
        "the effect of pay-1 ran {:?} times after a 3 s store outage during its completion: {stats:?}",
        effects.get("pay-1")
    );
}

/// The handler of `pay-1` runs, then the store goes down: the result is not
/// recorded before the lease (1 s) ends (`Unrecorded`), and the record
/// waits for the store to finish it. The consumer is asked to shut down
/// while it waits; the store comes back 500 ms later, far inside
/// `revoke_wait` (10 s). The shutdown uses its bounded wait to finish the
/// record (its handler already ran; `Unrecorded` says "do not run the
/// message again"), so the consumer started again (same group, same store)
/// gets the replay: one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_while_a_result_waits_to_be_recorded_finishes_it_and_a_restart_runs_nothing() {
    let topic = name("finish");
    let group = name("finish-g");
    support::kafka::create_topic(&topic, 1);
    let end = send(&topic, 0, Some(b"pay-1"), &[], Some(b"{\"amount\":1}")).await + 1;

    let (store, down) = FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects: Effects = Arc::default();
    // The first run: the store goes down after the effect (until the
    // shutdown below brings it back).
    let handler = taking_the_store_down(&effects, &down, None);

    let first = consumer(&group, &topic, idem.clone())
        .commit_interval(Duration::ZERO)
        .revoke_wait(Duration::from_secs(10))
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(100));
    let shutdown = {
        let (effects, down) = (effects.clone(), down.clone());
        async move {
            wait_for(Duration::from_secs(30), || {
                let e = effects.clone();
                async move { effects_of(&e, "pay-1") >= 1 }
            })
            .await;
            // Past the lease (1 s) and the completion's give-up (0.5 s):
            // the record is Unrecorded, its finish retried.
            tokio::time::sleep(Duration::from_millis(1800)).await;
            // The store comes back 500 ms after the shutdown starts.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(500));
                down.store(false, Ordering::SeqCst);
            });
        }
    };
    let t0 = Instant::now();
    let stats1 = tokio::time::timeout(
        Duration::from_secs(60),
        first.run(handler.clone(), shutdown),
    )
    .await
    .unwrap_or_else(|_| panic!("first run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    let shutdown_took = t0.elapsed();
    drop(first);
    // Make sure the store is back before the restart.
    wait_for(Duration::from_secs(5), || {
        let d = down.clone();
        async move { !d.load(Ordering::SeqCst) }
    })
    .await;

    let second = consumer(&group, &topic, idem.clone())
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(100));
    let stats2 = run_until_committed(
        &second,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        effects_of(&effects, "pay-1"),
        1,
        "the effect of pay-1 ran {} times; first run (shutdown took {shutdown_took:?}): {stats1:?}; restart: {stats2:?}",
        effects_of(&effects, "pay-1")
    );
    assert_eq!(committed(&group, &topic, 1).await.get(&0), Some(&end));
}

/// Two records of one key read together and run as one batch (`batch(2)`);
/// the store goes down right after the first one's effect, for 3 s, three
/// times the 1 s lease. The first record's result is not recorded
/// (`Unrecorded`); the second waits for it rather than run (once the store
/// is back, its acquire could take the expired lease over). One effect,
/// both records committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_key_twice_and_an_outage_past_the_lease_runs_the_effect_once() {
    let topic = name("batch-twice");
    let group = name("batch-twice-g");
    support::kafka::create_topic(&topic, 1);
    send(&topic, 0, Some(b"pay-2"), &[], Some(b"{\"amount\":2}")).await;
    let end = send(&topic, 0, Some(b"pay-2"), &[], Some(b"{\"amount\":2}")).await + 1;
    let (store, down) = FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects: Effects = Arc::default();
    // The first run: the store goes down after the effect, for 3 s.
    let handler = taking_the_store_down(&effects, &down, Some(Duration::from_secs(3)));
    let consumer = consumer(&group, &topic, idem)
        .batch(2)
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(100));
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        effects_of(&effects, "pay-2"),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "{stats:?}"
    );
}

/// The window the crate docs name (DESIGN 4: an outage longer than the
/// lease, then a rebalance): member A's record ran, its store stays away
/// past the 1 s lease (`Unrecorded`), and member B joins the group. A's
/// revoke waits `revoke_wait` (500 ms), then lets the record go
/// uncommitted; B, whose store answers, takes the expired lease over and
/// runs the record again. What the docs promise of that window holds: B's
/// run is told so (attempt 2) and carries a fence above A's, so a
/// downstream that keeps the highest fence refuses A's effect if it comes
/// late; once A's store is back, A's completion is refused (the lease
/// lost) and never overwrites B's result; the record is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_while_a_result_waits_hands_the_record_on_with_a_higher_fence() {
    use idemkit::IdempotencyStore;
    use std::sync::Mutex;
    let topic = name("rebalance-unrecorded");
    let group = name("rebalance-unrecorded-g");
    support::kafka::create_topic(&topic, 1);
    let end = send(&topic, 0, Some(b"pay-1"), &[], Some(b"{\"amount\":1}")).await + 1;

    let shared: Arc<MemoryStore> = Arc::new(MemoryStore::new());
    let (a_store, a_down) = FlakyStore::new(shared.clone());
    // B's store is never taken away.
    let (b_store, _) = FlakyStore::new(shared.clone());
    // The range assignor gives the one partition to the member whose id
    // sorts first: B's client id makes it B's once B has joined.
    let member = |client_id: &str, idem| {
        let mut config = super::config(&group);
        // A topic this new may have no partition in a member's first
        // metadata: read it again soon, not in 5 minutes.
        config
            .set("client.id", client_id)
            .set("topic.metadata.refresh.interval.ms", "500");
        idemkit::kafka::KafkaConsumer::new(&config, &[topic.as_str()], idem)
            .unwrap_or_else(|e| panic!("{e}"))
            .commit_interval(Duration::ZERO)
            .revoke_wait(Duration::from_millis(500))
            .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
    };
    let a = member(
        "z-member-a",
        Idempotency::new(a_store).lease(Duration::from_secs(1)),
    );
    // B is built when it joins: a consumer subscribes (and joins the
    // group) when it is built.
    let b_idem = Idempotency::new(b_store).lease(Duration::from_secs(1));
    // Each run: its attempt and fence; the first takes A's store away.
    let runs: Arc<Mutex<Vec<(u32, u64)>>> = Arc::default();
    let handler = {
        let (runs, a_down) = (runs.clone(), a_down.clone());
        move |record: KafkaRecord| {
            let (runs, a_down) = (runs.clone(), a_down.clone());
            async move {
                let id = record.key_text()?.to_owned();
                let first = {
                    let mut runs = runs.lock().unwrap_or_else(|p| p.into_inner());
                    runs.push((record.attempt, record.fence));
                    runs.len() == 1
                };
                if first {
                    a_down.store(true, Ordering::SeqCst);
                }
                Ok::<_, RecordError>(format!("done {id}"))
            }
        }
    };
    let runs_now = || runs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let done = Arc::new(AtomicBool::new(false));
    let stop = || {
        let done = done.clone();
        async move {
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let control = async {
        assert!(
            wait_for(Duration::from_secs(30), || async { runs_now().len() == 1 }).await,
            "A never ran the record"
        );
        // Past the lease: A holds a result it cannot record.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let b = member("a-member-b", b_idem);
        let b_run = b.run(handler.clone(), stop());
        let wait = async {
            let handed_on = wait_for(Duration::from_secs(60), || async {
                runs_now().len() == 2 && committed(&group, &topic, 1).await.get(&0) == Some(&end)
            })
            .await;
            // A's store back: its completion finds the key taken over.
            a_down.store(false, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(500)).await;
            done.store(true, Ordering::SeqCst);
            handed_on
        };
        let (b_stats, handed_on) = tokio::join!(b_run, wait);
        (b_stats.unwrap_or_else(|e| panic!("{e}")), handed_on)
    };
    let (a_stats, (b_stats, handed_on)) = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::join!(a.run(handler.clone(), stop()), control)
    })
    .await
    .unwrap_or_else(|_| panic!("did not end"));
    let a_stats = a_stats.unwrap_or_else(|e| panic!("{e}"));
    let runs = runs_now();
    assert!(
        handed_on,
        "the record was not run by B and committed: runs {runs:?}, A {a_stats:?}, B {b_stats:?}"
    );
    let [(first_attempt, first_fence), (second_attempt, second_fence)] = runs[..] else {
        panic!("runs: {runs:?}")
    };
    assert_eq!((first_attempt, second_attempt), (1, 2), "{runs:?}");
    assert!(
        second_fence > first_fence,
        "B's run must carry a higher fence: {runs:?}"
    );
    let key = idemkit::IdempotencyKey::new(idemkit::kafka::default_scope(&topic), "pay-1")
        .unwrap_or_else(|e| panic!("{e}"));
    match shared.get(&key).await {
        Ok(Some(record)) => {
            assert_eq!(record.fence, second_fence, "the record is B's: {record:?}");
            assert!(
                matches!(record.state, idemkit::RecordState::Completed { .. }),
                "{record:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// Two records of one key in one partition. The first one's handler runs,
/// the store is away past the 1 s lease, and once back it refuses the
/// completion for good: the first record is dead-lettered (its handler
/// ran). The second, which waited for it, is settled as a duplicate whose
/// result was not recorded, never run: one effect, both committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_record_of_a_key_whose_completion_was_refused_never_runs() {
    let topic = name("refused");
    let dead = name("refused-dlt");
    let group = name("refused-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    send(&topic, 0, Some(b"pay-1"), &[], Some(b"{\"amount\":1}")).await;
    let end = send(&topic, 0, Some(b"pay-1"), &[], Some(b"{\"amount\":1}")).await + 1;
    let (store, down) = FlakyStore::new(MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = consumer(&group, &topic, idem)
        .dead_letter(&dead)
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let effects: Effects = Arc::default();
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        let first = Arc::new(AtomicBool::new(true));
        move |record: KafkaRecord| {
            let (effects, down, refuse, first) =
                (effects.clone(), down.clone(), refuse.clone(), first.clone());
            Box::pin(async move {
                let id = record.key_text()?.to_owned();
                effect(&effects, &id);
                if first.swap(false, Ordering::SeqCst) {
                    refuse.store(true, Ordering::SeqCst);
                    support::flaky::outage(&down, Duration::from_millis(2500));
                }
                Ok::<_, RecordError>(format!("done {id}"))
            }) as BoxFuture<'static, Result<String, RecordError>>
        }
    };
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        effects_of(&effects, "pay-1"),
        1,
        "the effect of pay-1 ran twice: {stats:?}"
    );
}
