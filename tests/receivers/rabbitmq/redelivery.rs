//! Redelivery: a `run` future dropped while handlers run, a panicking
//! handler, a queue deleted under the consumer, and store outages on
//! quorum queues (a message that cannot settle now is held and tried
//! again in place, never requeued: a quorum queue would count each
//! requeue, and drop the message at its `x-delivery-limit`).

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::rabbitmq::lapin::options::QueueDeleteOptions;
use idemkit::rabbitmq::{RabbitConsumer, RabbitConsumerError, RabbitMessage};
use idemkit::{Idempotency, IdempotencyKey, IdempotencyStore, MemoryStore, RecordState};

use super::{
    channel, declare, declare_quorum, depth, name, publish, read_queue, BoxError, Running,
};

/// The docs: "a consumer whose `run` future is dropped does not cut its
/// handlers off; they finish and their results are recorded, and their
/// messages, not acked, come back and are replayed."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_run_lets_its_messages_come_back_and_records_the_result() {
    let queue = name("rv-dropped");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let idem = Idempotency::new(MemoryStore::new());
    let started = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicUsize::new(0));
    let (s, r) = (started.clone(), runs.clone());
    let consumer = Arc::new(RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        idem.clone(),
    ));
    let c = consumer.clone();
    let task = tokio::spawn(async move {
        c.run(
            move |_m: RabbitMessage| {
                let (s, r) = (s.clone(), r.clone());
                async move {
                    s.store(true, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    r.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, BoxError>(5)
                }
            },
            std::future::pending(),
        )
        .await
    });
    publish(&channel, &queue, &[(Some("d-1"), &[], b"x")]).await;
    tokio::time::timeout(Duration::from_secs(20), async {
        while !started.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the handler never started"));
    task.abort();
    let _ = task.await;
    let back = read_queue(
        support::rabbitmq::shared_url(),
        &queue,
        1,
        Duration::from_secs(15),
    )
    .await;
    assert_eq!(back.len(), 1, "the message did not come back");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let key = IdempotencyKey::new(idemkit::rabbitmq::default_scope(&queue), "d-1").unwrap();
    let state = idem.store().get(&key).await.unwrap().map(|r| r.state);
    assert!(
        matches!(state, Some(RecordState::Completed { .. })),
        "{state:?}"
    );
}

/// A handler that panics is a failure: requeued, then dead-lettered at
/// `max_deliveries` (classic queue: counted in the store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_dead_lettered_after_max_deliveries() {
    let queue = name("rv-panic");
    let dead = format!("{queue}-dead");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    declare(&channel, &dead, &[]).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    )
    .max_deliveries(3)
    .requeue_delay(Duration::ZERO)
    .dead_letter_queue(&dead);
    let running = Running::start(consumer, move |_m: RabbitMessage| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            if r.load(Ordering::SeqCst) < 1000 {
                panic!("handler bug");
            }
            Ok::<_, BoxError>(())
        }
    });
    publish(&channel, &queue, &[(Some("p-1"), &[], b"{}")]).await;
    running
        .until("the dead letter", Duration::from_secs(30), |s| {
            s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 3, "{stats:?}");
}

/// A queue deleted under the consumer: `run` stops with `Refused`
/// (the queue does not exist), it does not reconnect forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_deleted_under_the_consumer_stops_run() {
    let queue = name("rv-deleted");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    );
    let running = Running::start(consumer, |_m: RabbitMessage| async move {
        Ok::<_, BoxError>(())
    });
    publish(&channel, &queue, &[(Some("x-1"), &[], b"{}")]).await;
    running
        .until("the message", Duration::from_secs(20), |s| s.acked == 1)
        .await;
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut running = running;
    let out = tokio::time::timeout(Duration::from_secs(30), &mut running.task)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "run did not return after its queue was deleted: {:?}",
                running.stats()
            )
        })
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(out, Err(RabbitConsumerError::Refused(_))),
        "{out:?}"
    );
}

/// The docs: while the store is unavailable a message is "held unacked
/// for requeue_delay, then requeued (never dead-lettered: the lease ends,
/// the store comes back)", and it is dead-lettered once "its handler
/// failed ... on its max_deliveries-th delivery". On a quorum queue each
/// of those requeues raises `x-delivery-count`, so after a 2 s store
/// outage a handler's first (transient) failure dead-letters the message:
/// the outage used up its failures. On a classic queue (failures counted
/// in the store) the same message runs again and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_does_not_use_up_max_deliveries_on_a_quorum_queue() {
    let queue = name("rv-outage-quorum");
    let dead = format!("{queue}-dead");
    let channel = channel().await;
    declare_quorum(&channel, &queue, &[]).await;
    declare(&channel, &dead, &[]).await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(store),
    )
    .max_deliveries(3)
    .requeue_delay(Duration::from_millis(50))
    .dead_letter_queue(&dead);
    support::flaky::outage(&down, Duration::from_secs(2));
    let running = Running::start(consumer, move |_m: RabbitMessage| {
        let r = r.clone();
        async move {
            // Fails once (a passing error), then succeeds.
            if r.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err::<u8, BoxError>("a passing error".into());
            }
            Ok(1)
        }
    });
    publish(&channel, &queue, &[(Some("o-1"), &[], b"{}")]).await;
    running
        .until("the message settled", Duration::from_secs(30), |s| {
            s.executed + s.dead_lettered >= 1
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(
        (stats.executed, stats.dead_lettered),
        (1, 0),
        "dead-lettered at its first failure ({} runs, {} requeues while the store was away): {stats:?}",
        runs.load(Ordering::SeqCst),
        stats.in_progress
    );
}

/// The same requeues on a quorum queue with a delivery limit (RabbitMQ
/// 4.0 sets `x-delivery-limit` 20 on every quorum queue by default; here
/// set explicitly, the broker being 3.10): after a 3 s store outage the
/// broker has dropped the message (no dead-letter exchange), though the
/// docs say a message is never dead-lettered while the store is away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_does_not_lose_messages_on_a_quorum_queue_with_a_delivery_limit() {
    let queue = name("rv-outage-limit");
    let channel = channel().await;
    declare_quorum(&channel, &queue, &[("x-delivery-limit", 20)]).await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(store),
    )
    .requeue_delay(Duration::from_millis(50));
    support::flaky::outage(&down, Duration::from_secs(3));
    let running = Running::start(consumer, move |_m: RabbitMessage| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, BoxError>(1)
        }
    });
    publish(&channel, &queue, &[(Some("l-1"), &[], b"{}")]).await;
    let executed = tokio::time::timeout(Duration::from_secs(15), async {
        while running.stats().executed == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_ok();
    let stats = running.stop().await;
    let (ready, _) = depth(&queue).await;
    assert!(
        executed || ready == 1,
        "the message is lost: never run ({} runs), not in its queue ({ready} ready), \
         no dead letter: {stats:?}",
        runs.load(Ordering::SeqCst)
    );
}
