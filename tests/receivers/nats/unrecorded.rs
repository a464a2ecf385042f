//! Results that could not be recorded (`IdemError::Unrecorded`): the store
//! down after the handler's effect, past the lease. The message is kept
//! (in-progress acks past the ack wait) and its result written with the
//! run's own lease once the store is back, then acked; a copy meanwhile
//! is handed back, never run, and replayed once the result is written;
//! the finish goes on when the `run` future is dropped. A completion the
//! store refuses for good dead-letters the message, and that dead letter
//! is owed until it is published.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use idemkit::nats::{NatsConsumer, NatsMessage, REASON_HEADER};
use idemkit::{Idempotency, IdempotencyKey, MemoryStore, RecordState};

use super::{
    all_acked, create_stream, holds_within, jetstream, name, publish, read_all, wait_until, Running,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A handler that counts its runs in `effects` and answers 7; its first
/// run takes the store of `down` down right after the effect, for 4 s.
fn taking_the_store_down(
    effects: &Arc<AtomicUsize>,
    down: &Arc<AtomicBool>,
) -> impl Fn(NatsMessage) -> BoxFuture<'static, Result<u32, BoxError>> + Clone + Send + Sync + 'static
{
    let (effects, down) = (effects.clone(), down.clone());
    move |_m: NatsMessage| {
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
/// times the 1 s lease and twice the 2 s ack wait: the executor gives up
/// completing before the lease ends (`Unrecorded`). The message is kept
/// with in-progress acks (never delivered again) while the consumer
/// writes its completion with the first run's lease once the store is
/// back, then acked; a copy published meanwhile is handed back while the
/// key is being finished, and replayed after. The effect ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_past_the_lease_keeps_the_message_and_never_runs_it_twice() {
    let js = jetstream().await;
    let stream = name("OUTAGE");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("outage");
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let running = Running::start(
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_header("key")
            .scope("outage")
            .ack_wait(Duration::from_secs(2))
            .retry_delay(Duration::from_millis(200))
            .pull_wait(Duration::from_millis(500)),
        taking_the_store_down(&effects, &down),
    );
    publish(&js, &subject, &[("key", "k-1")], "charge").await;
    let e = effects.clone();
    wait_until("the first run", Duration::from_secs(30), || {
        let ran = e.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    publish(&js, &subject, &[("key", "k-1")], "charge").await;
    wait_until("both acked", Duration::from_secs(60), || {
        let (js, stream, durable, down) =
            (js.clone(), stream.clone(), durable.clone(), down.clone());
        async move { !down.load(Ordering::SeqCst) && all_acked(&js, &stream, &durable).await }
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!(
        (stats.executed, stats.replayed, stats.finished_late),
        (1, 1, 1),
        "{stats:?}"
    );
    // Kept: only the copy was delivered again (once per hand-back), never
    // the message whose result was being written.
    assert_eq!(stats.received, 2 + stats.handed_back, "{stats:?}");
    assert!(
        stats.progress_acks >= 4,
        "kept past the ack wait: {stats:?}"
    );
    assert_eq!(stats.poison, 0, "{stats:?}");
    let key = IdempotencyKey::new("outage", "k-1").unwrap();
    match idem.get(&key).await.unwrap().map(|r| r.state) {
        Some(RecordState::Completed { response, .. }) => assert_eq!(&response[..], b"7"),
        other => panic!("the record: {other:?}"),
    }
}

/// The handler ran, the store was away past the lease, and once back it
/// refuses the completion for good: the message is dead-lettered with the
/// reason (its handler ran), and a copy of it at this consumer is acked as
/// a duplicate whose result was not recorded, never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_the_store_refuses_for_good_dead_letters_the_message_and_never_runs_it_again()
{
    let js = jetstream().await;
    let stream = name("REFUSE");
    let subject = format!("{stream}.in");
    let dead = name("REFUSED");
    let dead_subject = format!("{dead}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    create_stream(&js, &dead, &[&dead_subject]).await;
    let durable = name("refuse");
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        move |_m: NatsMessage| {
            let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    refuse.store(true, Ordering::SeqCst);
                    support::flaky::outage(&down, Duration::from_secs(3));
                }
                Ok::<_, BoxError>(7)
            }
        }
    };
    let running = Running::start(
        NatsConsumer::new(js.clone(), &stream, &durable, idem)
            .key_header("key")
            .ack_wait(Duration::from_secs(1))
            .retry_delay(Duration::from_millis(200))
            .pull_wait(Duration::from_millis(500))
            .dead_letter(&dead_subject),
        handler,
    );
    publish(&js, &subject, &[("key", "k-1")], "charge").await;
    let consumer = running.consumer.clone();
    wait_until("the message dead-lettered", Duration::from_secs(60), || {
        let s = consumer.stats();
        async move { s.dead_lettered == 1 }
    })
    .await;
    refuse.store(false, Ordering::SeqCst);
    publish(&js, &subject, &[("key", "k-1")], "charge").await;
    // The copy settled (a look at the consumer's pending counts alone can
    // come before the server counts the copy as pending).
    wait_until("the copy settled", Duration::from_secs(60), || {
        let s = consumer.stats();
        async move { s.replayed == 1 }
    })
    .await;
    wait_until("both acked", Duration::from_secs(60), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(effects.load(Ordering::SeqCst), 1, "{stats:?}");
    assert_eq!(
        (stats.poison, stats.dead_lettered, stats.replayed),
        (1, 1, 1),
        "{stats:?}"
    );
    let letters = read_all(&js, &dead, 1).await;
    assert_eq!(letters.len(), 1);
    let reason = letters[0].header(REASON_HEADER).unwrap();
    assert!(reason.contains("could not be recorded"), "{reason}");
}

/// A handler ran, the store was away past the lease (`Unrecorded`), and
/// the `run` future is dropped (a `select!` that lost, a timeout, an
/// aborted task) while the consumer writes the completion: the finish
/// runs in a task of its own, keeps the message with in-progress acks,
/// and records the result once the store is back, then acks. The same
/// consumer run again finds the message acked; the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_a_result_is_finished_still_records_it() {
    let js = jetstream().await;
    let stream = name("DROPFIN");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("dropfin");
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move |_m: NatsMessage| {
            let (effects, down) = (effects.clone(), down.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    support::flaky::outage(&down, Duration::from_secs(4));
                }
                Ok::<_, BoxError>(7)
            }
        }
    };
    let consumer = Arc::new(
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_header("key")
            .scope("nats.dropfin")
            .ack_wait(Duration::from_secs(2))
            .retry_delay(Duration::from_millis(200))
            .pull_wait(Duration::from_millis(500)),
    );
    let first = {
        let (c, h) = (consumer.clone(), handler.clone());
        tokio::spawn(async move { c.run(h, std::future::pending::<()>()).await })
    };
    publish(&js, &subject, &[("key", "k-1")], "charge").await;
    let e = effects.clone();
    wait_until("the first run", Duration::from_secs(30), || {
        let ran = e.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    // Past the 1 s lease (and the completion retry inside it): the
    // handler's result is unrecorded and being finished by the consumer.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        down.load(Ordering::SeqCst),
        "the store is still away while the result is being finished"
    );
    // The run future is dropped (a `select!` that lost, a timeout, a
    // task aborted), not shut down.
    first.abort();
    let _ = first.await;
    // The store comes back; the result should get recorded.
    let d = down.clone();
    wait_until("the store back", Duration::from_secs(30), || {
        let up = !d.load(Ordering::SeqCst);
        async move { up }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let key = IdempotencyKey::new("nats.dropfin", "k-1").unwrap();
    let state = idem.get(&key).await.unwrap().map(|r| r.state);
    let recorded = matches!(state, Some(RecordState::Completed { .. }));
    // The same consumer runs again: the message comes back (not acked).
    let stop = Arc::new(AtomicBool::new(false));
    let second = {
        let (c, h, stop) = (consumer.clone(), handler.clone(), stop.clone());
        tokio::spawn(async move {
            c.run(h, async move {
                while !stop.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await
        })
    };
    let acked = holds_within(Duration::from_secs(30), || {
        let (js, stream, durable) = (js.clone(), stream.clone(), durable.clone());
        async move { all_acked(&js, &stream, &durable).await }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let stats = tokio::time::timeout(Duration::from_secs(60), second)
        .await
        .expect("the second run stops")
        .expect("the second run's task")
        .expect("the second run");
    assert!(acked, "the message acked in the end: {stats:?}");
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the handler ran twice (record 1 s after the store came back: {state:?}, recorded {recorded}): {stats:?}"
    );
}

/// The handler ran, the store was away past the lease and, once back,
/// refuses the completion for good, and the dead letter cannot be
/// published (the dead-letter stream full: `max_msgs` 1, discard new):
/// the message is handed back, its key given up and its dead letter owed.
/// Its next delivery, answered "result unavailable" (given up), publishes
/// the owed dead letter before the ack, never acks it without one; the
/// handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_completions_dead_letter_that_failed_is_published_on_the_next_delivery() {
    let js = jetstream().await;
    let stream = name("OWED");
    let subject = format!("{stream}.in");
    let dead = name("OWEDDEAD");
    let dead_subject = format!("{dead}.letters");
    create_stream(&js, &stream, &[&subject]).await;
    js.create_stream(idemkit::nats::async_nats::jetstream::stream::Config {
        name: dead.clone(),
        subjects: vec![dead_subject.clone()],
        max_messages: 1,
        discard: idemkit::nats::async_nats::jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    })
    .await
    .unwrap();
    // The dead-letter stream full.
    publish(&js, &dead_subject, &[], "filler").await;
    let durable = name("owed");
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let refuse = store.refuse_completes.clone();
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
        move |_m: NatsMessage| {
            let (effects, down, refuse) = (effects.clone(), down.clone(), refuse.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    refuse.store(true, Ordering::SeqCst);
                    support::flaky::outage(&down, Duration::from_secs(3));
                }
                Ok::<_, BoxError>(7)
            }
        }
    };
    let running = Running::start(
        NatsConsumer::new(js.clone(), &stream, &durable, idem)
            .key_header("key")
            .ack_wait(Duration::from_secs(1))
            .retry_delay(Duration::from_millis(500))
            .pull_wait(Duration::from_millis(500))
            .dead_letter(&dead_subject),
        handler,
    );
    publish(&js, &subject, &[("key", "k-1")], "charge").await;
    let consumer = running.consumer.clone();
    wait_until("a dead letter refused", Duration::from_secs(60), || {
        let s = consumer.stats();
        async move { s.dead_letter_failures >= 1 }
    })
    .await;
    // Room again in the dead-letter stream.
    js.get_stream(&dead).await.unwrap().purge().await.unwrap();
    let acked = holds_within(Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let stats = running.stop().await;
    assert!(acked, "{stats:?}");
    assert_eq!(effects.load(Ordering::SeqCst), 1, "{stats:?}");
    let letters = if stats.dead_lettered > 0 {
        read_all(&js, &dead, 1).await.len()
    } else {
        0
    };
    assert_eq!(
        (stats.dead_lettered, letters),
        (1, 1),
        "the message was acked (its result never recorded) without a dead letter: {stats:?}"
    );
}
