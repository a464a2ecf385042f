//! Shutdown: what a consumer holds when it stops is finished or handed
//! back; a key being finished after a store outage is given up, never run
//! again here; a `run` future dropped leaves its handlers running.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::nats::{NatsConsumer, NatsMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{all_acked, create_stream, jetstream, name, publish, wait_until, Running};

/// Consumer A stops (a `shutdown_wait` of 0) while its handler runs: it
/// hands the message back at once; the handler goes on, detached, and
/// records. Consumer B gets the message: "in progress" while the handler
/// runs, then the replay, and acks it. The effect ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_held_at_shutdown_is_handed_back_and_replayed_elsewhere() {
    let js = jetstream().await;
    let stream = name("STOP");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("stop");
    let runs = Arc::new(AtomicUsize::new(0));
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(2));
    let handler = {
        let runs = runs.clone();
        move |_m: NatsMessage| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<_, std::io::Error>(3)
            }
        }
    };
    let consumer = || {
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_from_content()
            .ack_wait(Duration::from_secs(30))
            .retry_delay(Duration::from_millis(100))
            .pull_wait(Duration::from_millis(500))
    };
    let a = Running::start(consumer().shutdown_wait(Duration::ZERO), handler.clone());
    publish(&js, &subject, &[], "held").await;
    let r = runs.clone();
    wait_until("A's handler running", Duration::from_secs(30), || {
        let ran = r.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    let sa = a.stop().await;
    // Handed back: B gets it long before the 30 s ack wait.
    let b = Running::start(consumer(), handler);
    wait_until("the message acked by B", Duration::from_secs(20), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let sb = b.stop().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{sa:?} {sb:?}");
    assert_eq!(
        (sa.abandoned, sa.handed_back, sa.executed),
        (1, 1, 0),
        "{sa:?}"
    );
    assert!(sb.in_progress >= 1, "{sb:?}");
    assert_eq!((sb.replayed, sb.executed), (1, 0), "{sb:?}");
}

/// A consumer stops while it writes the completion of a run whose result
/// the store could not take (the store away past the lease): the message
/// is left (not handed back) and the key given up here. When the same
/// consumer runs again after the store is back, the redelivery is acked
/// as a duplicate whose result was not recorded: never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_being_finished_at_shutdown_is_given_up_never_run_again() {
    let js = jetstream().await;
    let stream = name("GIVEUP");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("giveup");
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (runs, down) = (runs.clone(), down.clone());
        move |_m: NatsMessage| {
            let (runs, down) = (runs.clone(), down.clone());
            async move {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    support::flaky::outage(&down, Duration::from_secs(8));
                }
                Ok::<_, std::io::Error>(7)
            }
        }
    };
    let consumer = Arc::new(
        NatsConsumer::new(js.clone(), &stream, &durable, idem)
            .key_from_content()
            .ack_wait(Duration::from_secs(1))
            .retry_delay(Duration::from_millis(100))
            .pull_wait(Duration::from_millis(500))
            .shutdown_wait(Duration::ZERO),
    );
    let run = |consumer: Arc<NatsConsumer<support::flaky::FlakyStore<MemoryStore>>>| {
        let handler = handler.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            consumer
                .run(handler, async {
                    let _ = stopped.await;
                })
                .await
        });
        (stop, task)
    };
    let (stop, task) = run(consumer.clone());
    publish(&js, &subject, &[], "charge").await;
    let c = consumer.clone();
    // Past the 1 s lease, the completion being written.
    wait_until("the result being finished", Duration::from_secs(30), || {
        let s = c.stats();
        async move { s.progress_acks >= 6 }
    })
    .await;
    let _ = stop.send(());
    let first = task.await.unwrap().unwrap();
    assert_eq!(
        (first.abandoned, first.handed_back, first.acked),
        (1, 0, 0),
        "{first:?}"
    );
    let d = down.clone();
    wait_until("the store back", Duration::from_secs(30), || {
        let up = !d.load(Ordering::SeqCst);
        async move { up }
    })
    .await;
    let (stop, task) = run(consumer.clone());
    wait_until("the message acked", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let _ = stop.send(());
    let second = task.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{second:?}");
    // Counted since the consumer was made: the second run replayed it.
    assert_eq!((second.executed, second.replayed), (0, 1), "{second:?}");
}

/// The `run` future dropped (its task aborted) while a handler runs: the
/// handler goes on, detached, and records; the same consumer run again
/// gets the message back after the ack wait and replays it (or finds it
/// in progress first). The handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_dropped_while_a_handler_runs_records_and_replays() {
    let js = jetstream().await;
    let stream = name("ABORT");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("abort");
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let effects = effects.clone();
        move |_m: NatsMessage| {
            let effects = effects.clone();
            async move {
                effects.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok::<_, std::io::Error>(7)
            }
        }
    };
    let consumer = Arc::new(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(1)),
        )
        .key_from_content()
        .ack_wait(Duration::from_secs(2))
        .retry_delay(Duration::from_millis(200))
        .pull_wait(Duration::from_millis(500)),
    );
    let first = {
        let (c, h) = (consumer.clone(), handler.clone());
        tokio::spawn(async move { c.run(h, std::future::pending::<()>()).await })
    };
    publish(&js, &subject, &[], "abort").await;
    let e = effects.clone();
    wait_until("the handler running", Duration::from_secs(30), || {
        let n = e.load(Ordering::SeqCst);
        async move { n > 0 }
    })
    .await;
    first.abort();
    let _ = first.await;
    let running = {
        let c = Arc::try_unwrap(consumer).unwrap_or_else(|_| panic!("the consumer is shared"));
        Running::start(c, handler)
    };
    wait_until("acked", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(effects.load(Ordering::SeqCst), 1, "{stats:?}");
    assert!(stats.replayed + stats.in_progress >= 1, "{stats:?}");
}
