//! Results that could not be recorded (`IdemError::Unrecorded`): the store
//! down after the handler's effect, past the lease. The message is kept
//! invisible and its result written with the run's own lease once the
//! store is back; a duplicate meanwhile, on this consumer or on another
//! sharing the store and the scope, never runs the handler again.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use idemkit::sqs::{SqsConsumer, SqsMessage};
use idemkit::{Idempotency, IdempotencyKey, IdempotencyStore, MemoryStore, RecordState};

use super::{client, create_queue, depth, queue_empty, send, text, wait_until, BoxError, Running};

/// A handler that counts its runs in `effects` and answers 7; its first
/// run takes the store of `down` down right after the effect, for 4 s.
fn taking_the_store_down(
    effects: &Arc<AtomicUsize>,
    down: &Arc<AtomicBool>,
) -> impl Fn(SqsMessage) -> BoxFuture<'static, Result<usize, BoxError>> + Clone + Send + Sync + 'static
{
    let (effects, down) = (effects.clone(), down.clone());
    move |_m: SqsMessage| {
        let (effects, down) = (effects.clone(), down.clone());
        Box::pin(async move {
            if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                support::flaky::outage(&down, Duration::from_secs(4));
            }
            Ok(7)
        })
    }
}

/// The store goes away right after the handler's effect, for 4 s, four
/// times the 1 s lease: the executor gives up completing before the lease
/// ends (`IdemError::Unrecorded`). The message is kept invisible (past its
/// 3 s visibility timeout) and never run again; a duplicate sent meanwhile
/// is left for redelivery; once the store is back the completion is
/// written with the first run's lease, the message deleted, and the
/// duplicate replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_past_the_lease_never_runs_the_message_twice() {
    let client = client();
    let url = create_queue(&client, "idem-outage").await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let consumer = SqsConsumer::new(client.clone(), &url, idem.clone())
        .key_attribute("key")
        .visibility_timeout(Duration::from_secs(3))
        .retry_visibility(Duration::from_secs(1))
        .wait_time(Duration::from_secs(1));
    // The first run: the store goes down after the effect, for 4 s.
    let handler = taking_the_store_down(&effects, &down);
    let running = Running::start(consumer, handler);
    send(&client, &url, "charge", &[("key", text("k-1"))]).await;
    let e = effects.clone();
    wait_until("the first run", Duration::from_secs(30), || {
        let ran = e.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    send(&client, &url, "charge", &[("key", text("k-1"))]).await;
    wait_until("the queue empty", Duration::from_secs(60), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!((stats.executed, stats.replayed), (1, 1), "{stats:?}");
    assert!(
        stats.left_for_redelivery >= 1,
        "the duplicate waited: {stats:?}"
    );
    assert_eq!(stats.heartbeat_failures, 0, "{stats:?}");
    let scope = idemkit::sqs::default_scope(idemkit::sqs::queue_name(&url));
    let key = IdempotencyKey::new(scope, "k-1").unwrap();
    match idem.get(&key).await.unwrap().map(|r| r.state) {
        Some(RecordState::Completed { response, .. }) => assert_eq!(&response[..], b"7"),
        other => panic!("the record: {other:?}"),
    }
}

/// The handler of a message ran; the store went away until its 1 s lease
/// ended (`Unrecorded`). Consumer A keeps the message invisible and writes
/// its result with the run's own lease once the store is back, even while
/// it waits in a long poll (20 s by default): a finisher round every 50
/// ms, not a backoff grown to seconds. Then consumer B, sharing the store
/// and the scope (here on a second queue, as a retry queue fed with the
/// same keys), gets a duplicate: the replay, never a second run. (A
/// duplicate that reaches B inside A's first round after the store is
/// back is the window the crate docs name: not asserted here, since on a
/// loaded machine the two race.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unrecorded_message_is_never_run_again_by_another_consumer_sharing_its_store() {
    let client = client();
    let qa = create_queue(&client, "idem-unrec-a").await;
    let qb = create_queue(&client, "idem-unrec-b").await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    // The first run: the store goes down after the effect, for 4 s.
    let handler = taking_the_store_down(&effects, &down);
    // A: documented defaults but a short visibility (the heartbeat keeps
    // the unfinished message invisible).
    let a = Running::start(
        SqsConsumer::new(client.clone(), &qa, idem.clone())
            .key_attribute("key")
            .scope("pay")
            .visibility_timeout(Duration::from_secs(3)),
        handler.clone(),
    );
    send(&client, &qa, "charge", &[("key", text("k-1"))]).await;
    let e = effects.clone();
    wait_until("the first run", Duration::from_secs(30), || {
        let ran = e.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    // The store is back.
    let d = down.clone();
    wait_until("the store back", Duration::from_secs(30), || {
        let up = !d.load(Ordering::SeqCst);
        async move { up }
    })
    .await;
    let back = std::time::Instant::now();
    // A writes the result it holds: within a few rounds of 50 ms (printed;
    // the wait is bounded at 10 s).
    let key = IdempotencyKey::new("pay", "k-1").unwrap();
    let store = idem.store().clone();
    wait_until("A's completion written", Duration::from_secs(10), || {
        let (store, key) = (store.clone(), key.clone());
        async move {
            matches!(
                store.get(&key).await,
                Ok(Some(r)) if matches!(r.state, RecordState::Completed { .. })
            )
        }
    })
    .await;
    println!(
        "A wrote its completion {:?} after the store came back",
        back.elapsed()
    );
    let b = Running::start(
        SqsConsumer::new(client.clone(), &qb, idem.clone())
            .key_attribute("key")
            .scope("pay")
            .visibility_timeout(Duration::from_secs(3))
            .retry_visibility(Duration::ZERO)
            .wait_time(Duration::from_secs(1)),
        handler,
    );
    send(&client, &qb, "charge", &[("key", text("k-1"))]).await;
    wait_until("both queues empty", Duration::from_secs(60), || {
        let client = client.clone();
        let (qa, qb) = (qa.clone(), qb.clone());
        async move { depth(&client, &qa).await == (0, 0) && depth(&client, &qb).await == (0, 0) }
    })
    .await;
    let (sa, sb) = (
        a.stop_within(Duration::from_secs(40)).await,
        b.stop_within(Duration::from_secs(40)).await,
    );
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "an Unrecorded run ran again: A {sa:?} B {sb:?}"
    );
}

/// The store is away past the 1 s lease after the handler ran, and once
/// it is back it refuses the completion for good: the message is
/// dead-lettered (its handler ran). The producer then sends the key again
/// as a new message: this consumer settles it as a duplicate whose result
/// was not recorded (deleted), never taking the expired lease over to run
/// the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_later_message_of_a_key_whose_completion_was_refused_never_runs() {
    let client = client();
    let url = create_queue(&client, "idem-refused").await;
    let dlq = create_queue(&client, "idem-refused-dlq").await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        move |_m: SqsMessage| {
            let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
            Box::pin(async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    refuse.store(true, Ordering::SeqCst);
                    support::flaky::outage(&down, Duration::from_millis(2500));
                }
                Ok::<usize, BoxError>(7)
            }) as BoxFuture<'static, Result<usize, BoxError>>
        }
    };
    let consumer = SqsConsumer::new(client.clone(), &url, idem.clone())
        .key_attribute("key")
        .visibility_timeout(Duration::from_secs(3))
        .retry_visibility(Duration::from_secs(1))
        .wait_time(Duration::from_secs(1))
        .dead_letter(&dlq);
    let running = Running::start(consumer, handler);
    send(&client, &url, "charge", &[("key", text("k-1"))]).await;
    let dead = super::take_dead(&client, &dlq, 1).await;
    refuse.store(false, Ordering::SeqCst);
    // The producer's retry, as a new message.
    send(&client, &url, "charge", &[("key", text("k-1"))]).await;
    wait_until("the queue empty", Duration::from_secs(60), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect ran twice at one consumer: {stats:?}; dead letter: {:?}",
        dead.first().map(|m| m.message_attributes())
    );
}

/// As above, but the producer then sends the key with another body: a
/// payload mismatch, which this consumer dead-letters at once (DESIGN
/// 5b). The key is kept given up with the run's fingerprint, so the other
/// payload goes on to the store, which answers the mismatch: dead-lettered,
/// never run, never deleted as a duplicate (lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_payload_of_a_key_whose_completion_was_refused_is_dead_lettered() {
    let client = client();
    let url = create_queue(&client, "idem-refused-other").await;
    let dlq = create_queue(&client, "idem-refused-other-dlq").await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        move |_m: SqsMessage| {
            let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
            Box::pin(async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    refuse.store(true, Ordering::SeqCst);
                    support::flaky::outage(&down, Duration::from_millis(2500));
                }
                Ok::<usize, BoxError>(7)
            }) as BoxFuture<'static, Result<usize, BoxError>>
        }
    };
    let consumer = SqsConsumer::new(client.clone(), &url, idem.clone())
        .key_attribute("key")
        .visibility_timeout(Duration::from_secs(3))
        .retry_visibility(Duration::from_secs(1))
        .wait_time(Duration::from_secs(1))
        .dead_letter(&dlq);
    let running = Running::start(consumer, handler);
    send(&client, &url, "charge", &[("key", text("k-1"))]).await;
    let first = super::take_dead(&client, &dlq, 1).await;
    refuse.store(false, Ordering::SeqCst);
    send(&client, &url, "refund 500", &[("key", text("k-1"))]).await;
    let later = super::take_dead(&client, &dlq, 1).await;
    let stats = running.stop().await;
    assert_eq!(
        first.iter().map(|m| m.body()).collect::<Vec<_>>(),
        vec![Some("charge")],
        "{stats:?}"
    );
    assert_eq!(
        later.iter().map(|m| m.body()).collect::<Vec<_>>(),
        vec![Some("refund 500")],
        "the message with another payload is dead-lettered: {stats:?}"
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1, "{stats:?}");
}
