//! Dead letters and delivery counts: a dead letter owed after a result
//! the store refused is published on the redelivery; the copy of a
//! message keeps neither its TTL, nor a `user_id` of another, nor a
//! `x-delivery-count`; a copy too large for a frame leaves the message's
//! own headers out; a confirm channel the broker closed is opened again;
//! failures are counted in the store whatever header the message carries.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::rabbitmq::lapin::options::BasicPublishOptions;
use idemkit::rabbitmq::lapin::types::{AMQPValue, FieldTable};
use idemkit::rabbitmq::lapin::BasicProperties;
use idemkit::rabbitmq::{MessageError, RabbitConsumer, RabbitMessage};
use idemkit::{Idempotency, IdempotencyKey, IdempotencyStore, MemoryStore, RecordState};

use super::{channel, declare, depth, name, publish, publish_with, read_queue, BoxError, Running};

/// The handler ran, the store was away past the lease, and once it is
/// back it refuses the completion for good (`Finished::Refused`): the
/// docs say the message is dead-lettered ("its handler ran"), and that
/// an unroutable dead letter "is not dropped: the message is requeued".
/// Here the dead-letter queue does not exist yet when the dead letter is
/// tried; it is declared right after. The message must end in it (or stay
/// in its queue); it must never be acked with neither a record nor a dead
/// letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_given_up_result_whose_dead_letter_failed_is_not_acked_without_a_letter() {
    let queue = name("rv-given-up");
    let dead = format!("{queue}-dead");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let runs = Arc::new(AtomicUsize::new(0));
    let (r, d, f) = (runs.clone(), down.clone(), refuse.clone());
    let consumer = RabbitConsumer::new(support::rabbitmq::shared_url(), &queue, idem.clone())
        .requeue_delay(Duration::from_millis(200))
        .dead_letter_queue(&dead);
    let running = Running::start(consumer, move |_m: RabbitMessage| {
        let (r, d, f) = (r.clone(), d.clone(), f.clone());
        async move {
            if r.fetch_add(1, Ordering::SeqCst) == 0 {
                // The store refuses the completion for good once it is back.
                f.store(true, Ordering::SeqCst);
                support::flaky::outage(&d, Duration::from_secs(3));
            }
            Ok::<_, BoxError>(7)
        }
    });
    publish(&channel, &queue, &[(Some("g-1"), &[], b"charge")]).await;
    running
        .until("the dead letter tried", Duration::from_secs(30), |s| {
            s.dead_letter_failures >= 1
        })
        .await;
    // The dead-letter queue exists from now on: the next try goes through.
    declare(&channel, &dead, &[]).await;
    let letters = read_queue(
        support::rabbitmq::shared_url(),
        &dead,
        1,
        Duration::from_secs(15),
    )
    .await;
    let stats = running.stop().await;
    let (ready, _) = depth(&queue).await;
    let key = IdempotencyKey::new(idemkit::rabbitmq::default_scope(&queue), "g-1").unwrap();
    refuse.store(false, Ordering::SeqCst);
    let state = idem.store().get(&key).await.unwrap().map(|r| r.state);
    let completed = matches!(state, Some(RecordState::Completed { .. }));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{stats:?}");
    assert!(
        letters.len() == 1 || ready == 1 || completed,
        "the message is lost: acked with no record (the store holds {state:?}), \
         no dead letter ({} in {dead}) and not in its queue ({ready} ready): {stats:?}",
        letters.len()
    );
}

/// A classic queue does not count deliveries: the docs say the consumer
/// counts a message's failures in the store. But it reads
/// `x-delivery-count` from the message's headers whatever the queue, so a
/// message that carries that header from elsewhere (here: a dead letter
/// this crate published from a quorum queue, which copies every header of
/// the delivery) is never counted: its handler fails forever and it is
/// never dead-lettered at `max_deliveries`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_from_a_quorum_queue_is_dead_lettered_again_downstream() {
    let queue = name("rv-quorum-src");
    let dead = format!("{queue}-dead");
    let dead2 = format!("{queue}-dead2");
    let channel = channel().await;
    declare(&channel, &queue, &[("x-queue-type", "quorum")]).await;
    declare(&channel, &dead, &[]).await;
    declare(&channel, &dead2, &[]).await;
    let failing = |runs: Arc<AtomicUsize>| {
        move |_m: RabbitMessage| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<(), BoxError>("the ledger is closed".into())
            }
        }
    };
    let upstream_runs = Arc::new(AtomicUsize::new(0));
    let upstream = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    )
    .max_deliveries(2)
    .requeue_delay(Duration::ZERO)
    .dead_letter_queue(&dead);
    let up = Running::start(upstream, failing(upstream_runs.clone()));
    publish(&channel, &queue, &[(Some("q-1"), &[], b"{}")]).await;
    up.until("the first dead letter", Duration::from_secs(30), |s| {
        s.dead_lettered == 1
    })
    .await;
    up.stop().await;
    // The dead-letter queue is a classic queue, re-driven by a consumer of
    // its own, as documented: failures counted in the store.
    let downstream_runs = Arc::new(AtomicUsize::new(0));
    let downstream = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &dead,
        Idempotency::new(MemoryStore::new()),
    )
    .max_deliveries(4)
    .requeue_delay(Duration::from_millis(20))
    .dead_letter_queue(&dead2);
    let down = Running::start(downstream, failing(downstream_runs.clone()));
    let dead_lettered = tokio::time::timeout(Duration::from_secs(20), async {
        while down.stats().dead_lettered == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_ok();
    let stats = down.stop().await;
    assert!(
        dead_lettered,
        "never dead-lettered: the handler failed {} times with max_deliveries 4: {stats:?}",
        downstream_runs.load(Ordering::SeqCst)
    );
    assert_eq!(downstream_runs.load(Ordering::SeqCst), 4, "{stats:?}");
}

/// The same, with the header set by a publisher: a classic queue whose
/// messages carry `x-delivery-count: 0` (a republished copy) loops forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_set_delivery_count_does_not_stop_the_failure_count() {
    let queue = name("rv-static-count");
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
    .requeue_delay(Duration::from_millis(20))
    .dead_letter_queue(&dead);
    let running = Running::start(consumer, move |_m: RabbitMessage| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Err::<(), BoxError>("down".into())
        }
    });
    publish_with(
        &channel,
        &queue,
        "s-1",
        vec![("x-delivery-count", AMQPValue::LongInt(0))],
        b"{}",
    )
    .await;
    let dead_lettered = tokio::time::timeout(Duration::from_secs(15), async {
        while running.stats().dead_lettered == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_ok();
    let stats = running.stop().await;
    assert!(
        dead_lettered,
        "never dead-lettered: the handler failed {} times with max_deliveries 3: {stats:?}",
        runs.load(Ordering::SeqCst)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3, "{stats:?}");
}

/// A poison message whose headers are large (but well within what the
/// broker accepted from its publisher): the dead letter adds the reason
/// (up to 4 KiB) and the source queue to its headers, so its content
/// header no longer fits the connection's frame_max (128 KiB). The
/// consumer must still dead-letter it (or keep it), without its
/// connection being killed over and over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_with_large_headers_is_dead_lettered_once() {
    let queue = name("rv-big-headers");
    let dead = format!("{queue}-dead");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    declare(&channel, &dead, &[]).await;
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    )
    .requeue_delay(Duration::from_millis(50))
    .dead_letter_queue(&dead);
    let running = Running::start(consumer, |_m: RabbitMessage| async move {
        // A permanent error with a long text (a parser's message quoting
        // the input): dead-lettered at once.
        Err::<(), MessageError>(MessageError::Json("x".repeat(5000)))
    });
    let pad = "p".repeat(128_500);
    publish_with(
        &channel,
        &queue,
        "big-1",
        vec![("pad", AMQPValue::LongString(pad.as_str().into()))],
        b"{}",
    )
    .await;
    let settled = tokio::time::timeout(Duration::from_secs(20), async {
        while running.stats().dead_lettered == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_ok();
    let stats = running.stop().await;
    assert!(
        settled,
        "never dead-lettered (its connection lost {} times): {stats:?}",
        stats.reconnects
    );
    assert!(stats.reconnects == 0, "{stats:?}");
}

/// A dead letter is a copy "with the same body and properties": the
/// per-message TTL (`expiration`) included, so a poison message published
/// with a 2 s TTL vanishes from the dead-letter queue 2 s after it was
/// dead-lettered (RabbitMQ's own dead-lettering removes `expiration` for
/// that reason, keeping it in `x-death`). The dead letter must stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_does_not_expire_with_the_messages_ttl() {
    let queue = name("rv-ttl");
    let dead = format!("{queue}-dead");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    declare(&channel, &dead, &[]).await;
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    )
    .dead_letter_queue(&dead);
    let running = Running::start(consumer, |m: RabbitMessage| async move {
        let n: u64 = m.json()?;
        Ok::<_, MessageError>(n)
    });
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id("ttl-1".into())
        .with_expiration("2000".into());
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"{not json",
            properties,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    running
        .until("the dead letter", Duration::from_secs(20), |s| {
            s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let letters = read_queue(
        support::rabbitmq::shared_url(),
        &dead,
        1,
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(
        letters.len(),
        1,
        "the dead letter expired in {dead} (it kept the message's expiration): {stats:?}"
    );
}

/// A dead-letter exchange that does not exist yet: the publish closes
/// the consumer's confirm channel (404 NOT_FOUND is a channel error), and
/// the message is requeued, as documented. Once the exchange is declared
/// the next try must go through; but the channel is never opened again
/// while the consuming connection lives, so every dead letter fails for
/// good ("no connection"/channel closed) and poison cycles forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_goes_through_once_its_exchange_exists() {
    let queue = name("rv-no-exchange");
    let exchange = format!("{queue}-ex");
    let dead = format!("{queue}-dead");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    declare(&channel, &dead, &[]).await;
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(MemoryStore::new()),
    )
    .requeue_delay(Duration::from_millis(100))
    .dead_letter(idemkit::rabbitmq::DeadLetter::Exchange {
        exchange: exchange.clone(),
        routing_key: dead.clone(),
    });
    let running = Running::start(consumer, |m: RabbitMessage| async move {
        let n: u64 = m.json()?;
        Ok::<_, MessageError>(n)
    });
    publish(&channel, &queue, &[(Some("nx-1"), &[], b"{not json")]).await;
    running
        .until("a failed dead letter", Duration::from_secs(20), |s| {
            s.dead_letter_failures >= 1
        })
        .await;
    channel
        .exchange_declare(
            exchange.as_str().into(),
            idemkit::rabbitmq::lapin::ExchangeKind::Direct,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    channel
        .queue_bind(
            dead.as_str().into(),
            exchange.as_str().into(),
            dead.as_str().into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let letters = read_queue(
        support::rabbitmq::shared_url(),
        &dead,
        1,
        Duration::from_secs(10),
    )
    .await;
    let stats = running.stop().await;
    assert_eq!(
        letters.len(),
        1,
        "no dead letter once the exchange exists ({} failed tries): {stats:?}",
        stats.dead_letter_failures
    );
}

/// On a connection whose frames are small (`frame_max=4096`, the least a
/// broker takes), a permanent handler error of 5,000 bytes still gives a
/// dead letter that fits in one frame (the reason is cut to the room the
/// frame leaves): dead-lettered once, the connection never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_reason_is_cut_to_fit_a_small_frame() {
    let queue = name("small-frame");
    let dead = format!("{queue}-dead");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    declare(&channel, &dead, &[]).await;
    let url = format!("{}?frame_max=4096", support::rabbitmq::shared_url());
    let consumer = RabbitConsumer::new(&url, &queue, Idempotency::new(MemoryStore::new()))
        .dead_letter_queue(&dead);
    let running = Running::start(consumer, |_m: RabbitMessage| async move {
        Err::<(), _>(MessageError::Json("x".repeat(5000)))
    });
    publish(&channel, &queue, &[(Some("f-1"), &[("trace", "t")], b"{}")]).await;
    running
        .until("the dead letter", Duration::from_secs(30), |s| {
            s.dead_lettered == 1
        })
        .await;
    let stats = running.stop().await;
    assert_eq!((stats.reconnects, stats.ack_failures), (0, 0), "{stats:?}");
    let letters = read_queue(
        support::rabbitmq::shared_url(),
        &dead,
        1,
        Duration::from_secs(10),
    )
    .await;
    let reason = super::header(&letters[0], idemkit::rabbitmq::REASON_HEADER);
    assert!(
        reason.len() < 4096 && reason.ends_with('…'),
        "{}",
        reason.len()
    );
}
