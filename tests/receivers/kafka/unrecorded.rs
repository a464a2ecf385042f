//! Results that could not be recorded (`IdemError::Unrecorded`): the store
//! down after the handler's effect, past the lease. The record is kept and
//! its result finished once the store is back, with its own lease; no
//! other delivery of its key, in the same batch or after a shutdown and a
//! restart, runs the handler again.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use idem::kafka::{KafkaRecord, RecordError};
use idem::{Idempotency, MemoryStore};
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
