//! The ack wait: in-progress acks keep a message whose handler runs
//! longer than it from redelivery; without them, the redelivery to the
//! other consumer finds the key in progress, is handed back, and the
//! effect still runs once; the same when the first consumer's acks are
//! lost (its connection cut).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::nats::{NatsConsumer, NatsMessage};
use idemkit::{Idempotency, MemoryStore};

use crate::support;

use super::{
    all_acked, create_stream, jetstream, jetstream_at, name, publish, wait_until, Running,
};

/// Two consumers of a durable consumer with a 3 s ack wait; the handler
/// runs 7 s. The in-progress acks (every third of the ack wait) keep
/// the message from the other consumer: one delivery, one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_acks_keep_a_long_handlers_message_from_redelivery() {
    let js = jetstream().await;
    let stream = name("LONG");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("long");
    let runs = Arc::new(AtomicUsize::new(0));
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(2));
    let handler = {
        let runs = runs.clone();
        move |_m: NatsMessage| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(7)).await;
                Ok::<_, std::io::Error>(1)
            }
        }
    };
    let consumer = || {
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_from_content()
            .ack_wait(Duration::from_secs(3))
            .pull_wait(Duration::from_millis(500))
    };
    let a = Running::start(consumer(), handler.clone());
    let b = Running::start(consumer(), handler);
    publish(&js, &subject, &[], "long").await;
    wait_until("the message acked", Duration::from_secs(30), || {
        let (js, stream, durable, runs) =
            (js.clone(), stream.clone(), durable.clone(), runs.clone());
        async move { runs.load(Ordering::SeqCst) > 0 && all_acked(&js, &stream, &durable).await }
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(sa.received + sb.received, 1, "no redelivery: {sa:?} {sb:?}");
    assert!(sa.progress_acks + sb.progress_acks >= 2, "{sa:?} {sb:?}");
    assert_eq!(sa.executed + sb.executed, 1);
}

/// Without in-progress acks, the ack wait (1 s) runs out while the
/// handler runs (5 s) at consumer A, which has room for that one message
/// only: JetStream delivers it to consumer B, which finds its key in
/// progress (A's lease renewed by the heartbeat) and hands it back, again
/// and again, until A recorded: then the message is acked (by A, or by B
/// with the replay). The effect ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ack_wait_running_out_redelivers_to_the_other_consumer_which_gets_in_progress() {
    let js = jetstream().await;
    let stream = name("WAIT");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("wait");
    let runs = Arc::new(AtomicUsize::new(0));
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(1));
    let r = runs.clone();
    let a = Running::start(
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_from_content()
            .ack_wait(Duration::from_secs(1))
            .progress_acks(false)
            .concurrency(1)
            .pull_wait(Duration::from_millis(500)),
        move |_m: NatsMessage| {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<_, std::io::Error>(7)
            }
        },
    );
    publish(&js, &subject, &[], "slow").await;
    let ra = runs.clone();
    wait_until("A running the handler", Duration::from_secs(30), || {
        let ran = ra.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    let rb = runs.clone();
    let b = Running::start(
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_from_content()
            .ack_wait(Duration::from_secs(1))
            .progress_acks(false)
            .retry_delay(Duration::from_millis(100))
            .pull_wait(Duration::from_millis(500)),
        move |_m: NatsMessage| {
            let rb = rb.clone();
            async move {
                rb.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(7)
            }
        },
    );
    let bc = b.consumer.clone();
    wait_until(
        "B got the redelivery, in progress",
        Duration::from_secs(30),
        || {
            let s = bc.stats();
            async move { s.in_progress >= 1 }
        },
    )
    .await;
    wait_until("the message acked", Duration::from_secs(30), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the effect ran once: {sa:?} {sb:?}"
    );
    assert_eq!((sa.executed, sb.executed), (1, 0), "{sa:?} {sb:?}");
    assert!(sb.in_progress >= 1 && sb.handed_back >= 1, "{sb:?}");
    assert_eq!(sa.progress_acks + sb.progress_acks, 0);
    assert_eq!(sa.poison + sb.poison, 0);
    eprintln!("A: {sa:?}\nB: {sb:?} (B replayed: {})", sb.replayed);
}

/// Consumer A loses its connection (the proxy in front of the server cut)
/// right after its handler started: its in-progress acks and its ack fail.
/// JetStream delivers the message to consumer B after the ack wait: B
/// finds the key in progress (A's lease renewed by the heartbeat, the
/// store being reachable) and hands it back until A's run recorded, then
/// gets the replay and acks it. The effect ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_lost_while_the_handler_runs_gets_in_progress_then_the_replay_elsewhere() {
    let js = jetstream().await;
    let stream = name("CUT");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let durable = name("cut");
    let server: std::net::SocketAddr = support::nats::shared_url()
        .trim_start_matches("nats://")
        .parse()
        .unwrap();
    let proxy = Arc::new(support::proxy::CountingProxy::start(server).await);
    let through = jetstream_at(&format!("nats://{}", proxy.addr)).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let recorded = Arc::new(AtomicUsize::new(0));
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(1));
    let consumer = |js: &idemkit::nats::async_nats::jetstream::Context| {
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_from_content()
            .ack_wait(Duration::from_secs(1))
            .retry_delay(Duration::from_millis(100))
            .pull_wait(Duration::from_millis(500))
    };
    let a = {
        let (runs, recorded, proxy) = (runs.clone(), recorded.clone(), proxy.clone());
        Running::start(consumer(&through).concurrency(1), move |_m: NatsMessage| {
            let (runs, recorded, proxy) = (runs.clone(), recorded.clone(), proxy.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                proxy.cut(true);
                tokio::time::sleep(Duration::from_secs(5)).await;
                recorded.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(7)
            }
        })
    };
    publish(&js, &subject, &[], "cut").await;
    let r = runs.clone();
    wait_until("A's handler running", Duration::from_secs(30), || {
        let ran = r.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    let b = {
        let runs = runs.clone();
        Running::start(consumer(&js), move |_m: NatsMessage| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(7)
            }
        })
    };
    wait_until("the message acked by B", Duration::from_secs(60), || {
        let (js, stream, durable) = (js.clone(), stream.clone(), durable.clone());
        async move { all_acked(&js, &stream, &durable).await }
    })
    .await;
    proxy.cut(false);
    let sb = b.stop().await;
    let sa = a.stop().await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the effect ran once: {sa:?} {sb:?}"
    );
    assert_eq!(recorded.load(Ordering::SeqCst), 1);
    assert_eq!((sa.executed, sb.executed), (1, 0), "{sa:?} {sb:?}");
    assert!(sb.in_progress >= 1, "B got in progress first: {sb:?}");
    assert_eq!(sb.replayed, 1, "then the replay: {sb:?}");
}
