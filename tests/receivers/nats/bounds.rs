//! The bounds of what is in flight: `concurrency` in one consumer,
//! `max_ack_pending` over every consumer of the durable consumer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::nats::{NatsConsumer, NatsMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{all_acked, create_stream, jetstream, name, publish, wait_until, Running};

/// A handler that counts how many of its runs are at once, and the most.
fn counting(
    now: &Arc<AtomicUsize>,
    most: &Arc<AtomicUsize>,
) -> impl Fn(NatsMessage) -> futures::future::BoxFuture<'static, Result<(), std::io::Error>>
       + Clone
       + Send
       + Sync
       + 'static {
    let (now, most) = (now.clone(), most.clone());
    move |_m: NatsMessage| {
        let (now, most) = (now.clone(), most.clone());
        Box::pin(async move {
            let n = now.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(n, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(30)).await;
            now.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
    }
}

/// 60 messages: one consumer with `concurrency(4)` never runs more than
/// 4 handlers at once; two consumers with room for 10 each, of a durable
/// consumer with `max_ack_pending(3)`, never more than 3 between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_and_max_ack_pending_bound_the_messages_in_flight() {
    let js = jetstream().await;
    let stream = name("BOUNDS");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    for m in 0..60 {
        publish(&js, &subject, &[], &format!("{m}")).await;
    }
    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let durable = name("four");
    let one = Running::start(
        NatsConsumer::new(
            js.clone(),
            &stream,
            &durable,
            Idempotency::new(MemoryStore::new()),
        )
        .key_from_content()
        .concurrency(4)
        .pull_wait(Duration::from_millis(500)),
        counting(&now, &most),
    );
    wait_until("all acked", Duration::from_secs(60), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let s = one.stop().await;
    assert_eq!(s.executed, 60, "{s:?}");
    assert!(
        most.load(Ordering::SeqCst) <= 4,
        "{}",
        most.load(Ordering::SeqCst)
    );
    assert!(most.load(Ordering::SeqCst) >= 2, "handlers ran at once");

    let (now, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let durable = name("three");
    let idem = Idempotency::new(MemoryStore::new());
    let consumer = || {
        NatsConsumer::new(js.clone(), &stream, &durable, idem.clone())
            .key_from_content()
            .concurrency(10)
            .max_ack_pending(3)
            .pull_wait(Duration::from_millis(500))
    };
    let a = Running::start(consumer(), counting(&now, &most));
    let b = Running::start(consumer(), counting(&now, &most));
    wait_until("all acked", Duration::from_secs(60), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(sa.executed + sb.executed, 60, "{sa:?} {sb:?}");
    assert!(
        most.load(Ordering::SeqCst) <= 3,
        "{}",
        most.load(Ordering::SeqCst)
    );
}
