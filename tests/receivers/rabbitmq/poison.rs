//! Poison: dead letters with their reason after `max_deliveries`, on a
//! classic queue (failures counted in the store) and a quorum queue
//! (`x-delivery-count`); the queue's own dead-letter exchange; input no
//! handler can use; a dead letter that cannot be routed is not dropped.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::rabbitmq::{
    MessageError, RabbitConsumer, RabbitMessage, REASON_HEADER, SOURCE_QUEUE_HEADER,
};
use idemkit::{Idempotency, MemoryStore};

use super::{
    channel, declare, depth, drained, header, name, publish, read_queue, wait_until, BoxError,
    Running,
};

/// A handler that always fails, counting its runs.
fn failing(
    runs: &Arc<AtomicUsize>,
) -> impl Fn(RabbitMessage) -> futures::future::BoxFuture<'static, Result<(), BoxError>>
       + Send
       + Sync
       + 'static {
    let runs = runs.clone();
    move |_m| {
        let runs = runs.clone();
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Err::<(), BoxError>("the ledger is closed".into())
        })
    }
}

/// On a classic queue and on a quorum queue, a message whose handler
/// always fails runs `max_deliveries` (3) times, then goes to our dead-letter
/// queue with the reason (the delivery and the handler's error) and its
/// source queue; it is acked, the queue ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_message_is_dead_lettered_after_max_deliveries_with_its_reason() {
    for quorum in [false, true] {
        let queue = name(if quorum {
            "poison-quorum"
        } else {
            "poison-classic"
        });
        let dead = format!("{queue}-dead");
        let channel = channel().await;
        let kind: &[(&str, &str)] = if quorum {
            &[("x-queue-type", "quorum")]
        } else {
            &[]
        };
        declare(&channel, &queue, kind).await;
        declare(&channel, &dead, &[]).await;
        let runs = Arc::new(AtomicUsize::new(0));
        let consumer = RabbitConsumer::new(
            support::rabbitmq::shared_url(),
            &queue,
            Idempotency::new(MemoryStore::new()),
        )
        .max_deliveries(3)
        .requeue_delay(Duration::ZERO)
        .dead_letter_queue(&dead);
        let running = Running::start(consumer, failing(&runs));
        publish(
            &channel,
            &queue,
            &[(Some("p-1"), &[("trace", "t-9")], b"{\"amount\":5}")],
        )
        .await;
        running
            .until("the dead letter", Duration::from_secs(60), |s| {
                s.dead_lettered == 1
            })
            .await;
        let stats = running.stop().await;
        assert_eq!(runs.load(Ordering::SeqCst), 3, "quorum {quorum}: {stats:?}");
        assert_eq!(
            (stats.failed, stats.poison, stats.acked),
            (3, 1, 1),
            "quorum {quorum}: {stats:?}"
        );
        assert!(drained(&queue).await, "quorum {quorum}");
        let letters = read_queue(
            support::rabbitmq::shared_url(),
            &dead,
            1,
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(letters.len(), 1, "quorum {quorum}");
        let letter = &letters[0];
        assert_eq!(letter.body, b"{\"amount\":5}");
        assert_eq!(letter.message_id(), Some("p-1"));
        assert_eq!(header(letter, "trace"), "t-9");
        let reason = header(letter, REASON_HEADER);
        assert!(reason.contains("delivery 3 (max_deliveries 3)"), "{reason}");
        assert!(reason.contains("the ledger is closed"), "{reason}");
        assert_eq!(header(letter, SOURCE_QUEUE_HEADER), queue);
        if quorum {
            assert_eq!(
                header(letter, idemkit::rabbitmq::DEAD_DELIVERY_COUNT_HEADER),
                "3"
            );
        }
    }
}

/// Input no handler can use is dead-lettered at once, without a run: a
/// message without `message_id`; a body the handler cannot parse (its
/// [`MessageError`]) runs once. By default poison goes to the queue's own
/// dead-letter exchange (here the default exchange, routed to a queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_input_goes_to_the_queues_dead_letter_exchange_at_once() {
    let queue = name("unusable");
    let dead = format!("{queue}-dlx");
    let channel = channel().await;
    declare(&channel, &dead, &[]).await;
    declare(
        &channel,
        &queue,
        &[
            ("x-dead-letter-exchange", ""),
            ("x-dead-letter-routing-key", &dead),
        ],
    )
    .await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    );
    let running = Running::start(consumer, move |m: RabbitMessage| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            let n: u64 = m.json()?;
            Ok::<_, MessageError>(n)
        }
    });
    let huge_id = "i".repeat(255);
    publish(
        &channel,
        &queue,
        &[
            (None, &[], b"1"),
            (Some("bad-json"), &[], b"{not json"),
            (Some(&huge_id), &[], b"2"),
        ],
    )
    .await;
    running
        .until("two poison", Duration::from_secs(30), |s| {
            s.poison == 2 && s.executed == 1
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "{stats:?}");
    assert_eq!(stats.dead_lettered, 2, "{stats:?}");
    let letters = read_queue(
        support::rabbitmq::shared_url(),
        &dead,
        2,
        Duration::from_secs(10),
    )
    .await;
    let mut bodies: Vec<&[u8]> = letters.iter().map(|l| l.body.as_slice()).collect();
    bodies.sort();
    assert_eq!(bodies, [&b"1"[..], b"{not json"]);
    // The broker's own record of why: rejected.
    for letter in &letters {
        assert!(letter.header("x-death").is_some(), "{letter:?}");
    }
    assert!(drained(&queue).await);
}

/// A dead letter the broker cannot route (no such queue) is not dropped:
/// the message is requeued and stays in its queue, and the failure is
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_dead_letter_keeps_the_message() {
    let queue = name("unroutable");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    )
    .requeue_delay(Duration::from_millis(50))
    .dead_letter_queue(name("nowhere"));
    let running = Running::start(consumer, |_m: RabbitMessage| async {
        Ok::<_, BoxError>(())
    });
    publish(&channel, &queue, &[(None, &[], b"no id")]).await;
    running
        .until("two failed dead letters", Duration::from_secs(30), |s| {
            s.dead_letter_failures >= 2
        })
        .await;
    let stats = running.stop().await;
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    let q = queue.clone();
    wait_until(
        "the message back in its queue",
        Duration::from_secs(10),
        || {
            let q = q.clone();
            async move { depth(&q).await.0 == 1 }
        },
    )
    .await;
}
