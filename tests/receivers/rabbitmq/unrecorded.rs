//! Results that could not be recorded (`IdemError::Unrecorded`): the store
//! down after the handler's effect, past the lease. The message is kept
//! unacked and its result written with the run's own lease once the store
//! is back; a duplicate meanwhile never runs the handler again.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::rabbitmq::{RabbitConsumer, RabbitMessage};
use idemkit::{Idempotency, IdempotencyKey, IdempotencyStore, MemoryStore, RecordState};

use super::{channel, declare, drained, name, publish, BoxError, Running};

/// The store goes away right after the handler's effect, for 4 s, four
/// times the 1 s lease: the executor gives up completing before the lease
/// ends. The message stays unacked (the broker gives it to no one else)
/// and is never run again; a duplicate published meanwhile is held and
/// requeued while the key is being finished; once the store is back the
/// completion is written with the first run's lease, the message acked,
/// and the duplicate replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_past_the_lease_never_runs_the_message_twice() {
    let queue = name("outage");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let (e, d) = (effects.clone(), down.clone());
    let consumer = RabbitConsumer::new(support::rabbitmq::shared_url(), &queue, idem.clone())
        .requeue_delay(Duration::from_millis(200));
    let running = Running::start(consumer, move |_m: RabbitMessage| {
        let (e, d) = (e.clone(), d.clone());
        async move {
            if e.fetch_add(1, Ordering::SeqCst) == 0 {
                support::flaky::outage(&d, Duration::from_secs(4));
            }
            Ok::<_, BoxError>(7)
        }
    });
    publish(&channel, &queue, &[(Some("k-1"), &[], b"charge")]).await;
    let e = effects.clone();
    super::wait_until("the first run", Duration::from_secs(30), || {
        let ran = e.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    // While the store is down: the message is unacked, not ready.
    assert!(drained(&queue).await);
    publish(&channel, &queue, &[(Some("k-1"), &[], b"charge")]).await;
    running
        .until(
            "the result finished and the duplicate replayed",
            Duration::from_secs(60),
            |s| s.finished == 1 && s.replayed == 1,
        )
        .await;
    let stats = running.stop().await;
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!(
        (stats.executed, stats.acked, stats.poison),
        (1, 2, 0),
        "{stats:?}"
    );
    assert!(drained(&queue).await, "{stats:?}");
    let key = IdempotencyKey::new(idemkit::rabbitmq::default_scope(&queue), "k-1").unwrap();
    match idem.store().get(&key).await.unwrap().map(|r| r.state) {
        Some(RecordState::Completed { response, .. }) => assert_eq!(&response[..], b"7"),
        other => panic!("the record: {other:?}"),
    }
}

/// The `run` future is dropped (not shut down) while the consumer writes
/// the completion of a run whose store went away past its lease: the
/// finish goes on by itself and records the result once the store is
/// back, so the message, back in the queue with the dropped connection,
/// is replayed by the next consumer, never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_dropped_while_a_result_is_finished_still_records_it() {
    let queue = name("dropped");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let memory = MemoryStore::new();
    let (store, down) = support::flaky::FlakyStore::new(memory.clone());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (e, d) = (effects.clone(), down.clone());
        move |_m: RabbitMessage| {
            let (e, d) = (e.clone(), d.clone());
            async move {
                if e.fetch_add(1, Ordering::SeqCst) == 0 {
                    support::flaky::outage(&d, Duration::from_secs(4));
                }
                Ok::<_, BoxError>(7)
            }
        }
    };
    let consumer = RabbitConsumer::new(support::rabbitmq::shared_url(), &queue, idem.clone());
    let handler_a = handler.clone();
    let task = tokio::spawn(async move {
        let _ = consumer.run(handler_a, std::future::pending()).await;
    });
    publish(&channel, &queue, &[(Some("k-1"), &[], b"charge")]).await;
    // The lease of the first run is over while the store is away (read
    // on the store underneath): its completion waits to be finished.
    let key = IdempotencyKey::new(idemkit::rabbitmq::default_scope(&queue), "k-1").unwrap();
    super::wait_until("the first run's lease over", Duration::from_secs(30), || {
        let (memory, key) = (memory.clone(), key.clone());
        async move {
            matches!(
                memory.get(&key).await.ok().flatten().map(|r| r.state),
                Some(RecordState::InProgress { lease_expires_at }) if lease_expires_at < std::time::SystemTime::now()
            )
        }
    })
    .await;
    assert!(down.load(Ordering::SeqCst), "the store came back too soon");
    task.abort();
    let _ = task.await;
    // The store comes back; the finish left running records the result.
    let d = down.clone();
    super::wait_until("the store back", Duration::from_secs(30), || {
        let up = !d.load(Ordering::SeqCst);
        async move { up }
    })
    .await;
    super::wait_until("the result recorded", Duration::from_secs(10), || {
        let (memory, key) = (memory.clone(), key.clone());
        async move {
            matches!(
                memory.get(&key).await.ok().flatten().map(|r| r.state),
                Some(RecordState::Completed { .. })
            )
        }
    })
    .await;
    let b = Running::start(
        RabbitConsumer::new(support::rabbitmq::shared_url(), &queue, idem),
        handler,
    );
    b.until("the replay", Duration::from_secs(30), |s| s.replayed == 1)
        .await;
    let stats = b.stop().await;
    assert_eq!(effects.load(Ordering::SeqCst), 1, "{stats:?}");
}
