//! Shutdown: bounded however the records in flight behave (a handler that
//! never returns, a dead letter to a missing topic), and a record cut off
//! by it run once after a restart.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit::kafka::{KafkaRecord, RecordError};
use idemkit::{Idempotency, MemoryStore};

use super::{
    committed, consumer, effect, effects_of, name, run_until_committed, send, wait_for, Effects,
};

/// A handler that never returns (a stuck downstream call) and a shutdown:
/// `run` gives the task up after its bound (`revoke_wait`) and returns; the
/// detached handler goes on, and the next owner of the record gets "in
/// progress", then the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_a_handler_blocks_returns_within_a_bound() {
    let topic = name("stuck");
    let group = name("stuck-g");
    support::kafka::create_topic(&topic, 1);
    send(&topic, 0, Some(b"stuck"), &[], Some(b"1")).await;
    let consumer = consumer(
        &group,
        &topic,
        Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(5)),
    )
    .revoke_wait(Duration::from_secs(1));
    let started = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let started = started.clone();
        move |_record: KafkaRecord| {
            let started = started.clone();
            async move {
                started.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, RecordError>(())
            }
        }
    };
    let shutdown = {
        let started = started.clone();
        async move {
            let _ = tokio::time::timeout(Duration::from_secs(30), started.notified()).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let t0 = Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(45), consumer.run(handler, shutdown)).await;
    assert!(
        out.is_ok(),
        "run did not return {:?} after its shutdown future completed (a handler blocks); stats {:?}",
        t0.elapsed(),
        consumer.stats()
    );
}

/// The dead-letter topic does not exist (a typo, or a broker that does not
/// create topics): producing a dead letter gives up after `call_timeout`
/// (not librdkafka's `message.timeout.ms`, 300 s), so a shutdown returns
/// within a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_does_not_hold_shutdown_past_call_timeout() {
    let topic = name("nodlq");
    let group = name("nodlq-g");
    support::kafka::create_topic(&topic, 1);
    send(&topic, 0, None, &[], Some(b"no key")).await;
    let consumer = consumer(&group, &topic, Idempotency::new(MemoryStore::new()))
        .dead_letter(name("missing-dlq"))
        .call_timeout(Duration::from_secs(2))
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let handler =
        |record: KafkaRecord| async move { Ok::<_, RecordError>(record.key_text()?.to_owned()) };
    let stop_at = Arc::new(Mutex::new(None::<Instant>));
    let shutdown = {
        let stop_at = stop_at.clone();
        let consumer = &consumer;
        async move {
            wait_for(Duration::from_secs(30), || async {
                consumer.stats().received >= 1
            })
            .await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            *stop_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
    };
    let out = tokio::time::timeout(Duration::from_secs(60), consumer.run(handler, shutdown)).await;
    let stopped = *stop_at.lock().unwrap_or_else(|p| p.into_inner());
    let took = stopped.map(|s| s.elapsed());
    assert!(
        out.is_ok() && took.is_some_and(|t| t < Duration::from_secs(15)),
        "shutdown with a dead letter to a missing topic: returned {}, {took:?} after the shutdown (call_timeout 2 s); stats {:?}",
        out.is_ok(),
        consumer.stats()
    );
}

/// A handler that takes 3 s; the consumer shuts down with a 300 ms
/// `revoke_wait`, so the record's task is given up (the detached handler
/// goes on and records) and nothing is committed. The consumer is started
/// again at once: the record comes back while its handler still runs (in
/// progress), then gets the replay. One effect, and the offset committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_cut_off_by_shutdown_runs_once_after_a_restart() {
    let topic = name("abort");
    let group = name("abort-g");
    support::kafka::create_topic(&topic, 1);
    let end = send(&topic, 0, Some(b"slow-1"), &[], Some(b"{\"amount\":1}")).await + 1;
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(2));
    let effects: Effects = Arc::default();
    let handler = {
        let effects = effects.clone();
        move |record: KafkaRecord| {
            let effects = effects.clone();
            async move {
                let id = record.key_text()?.to_owned();
                effect(&effects, &id);
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<_, RecordError>(format!("done {id}"))
            }
        }
    };
    let first = consumer(&group, &topic, idem.clone()).revoke_wait(Duration::from_millis(300));
    let shutdown = {
        let effects = effects.clone();
        async move {
            wait_for(Duration::from_secs(30), || {
                let e = effects.clone();
                async move { effects_of(&e, "slow-1") >= 1 }
            })
            .await;
        }
    };
    let stats1 = tokio::time::timeout(
        Duration::from_secs(60),
        first.run(handler.clone(), shutdown),
    )
    .await
    .unwrap_or_else(|_| panic!("first run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    // Nothing was committed: the run's lag is its one record (read before
    // leaving the group; read after, with nothing assigned, it would be 0).
    assert_eq!(
        (stats1.abandoned, stats1.committed, stats1.lag),
        (1, 0, Some(end)),
        "{stats1:?}"
    );
    drop(first);
    let second = consumer(&group, &topic, idem.clone())
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let stats2 = run_until_committed(
        &second,
        handler,
        (&group, &topic),
        end,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        effects_of(&effects, "slow-1"),
        1,
        "first: {stats1:?}; restart: {stats2:?}"
    );
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "restart: {stats2:?}"
    );
}
