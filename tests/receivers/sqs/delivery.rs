//! Delivery: duplicates sent and redelivered, a consumer killed while its
//! handlers run, the reply to a delete lost. Every key's effect once,
//! every message deleted.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::sqs::aws_sdk_sqs::Client;
use idemkit::sqs::{SqsConsumer, SqsMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{
    addr_of, client, client_at, create_queue, depth, moto_addr, queue_empty, send, send_all, text,
    wait_until, Effects, Running,
};

/// 1,000 messages (700 keys, 200 of them sent twice and 50 three times,
/// shuffled), two consumers sharing one store, one of them killed (its `run`
/// future aborted) while its handlers run. Every key's effect runs once,
/// and every message is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_messages_with_duplicates_two_consumers_one_killed_mid_batch() {
    let started = Instant::now();
    // A moto of its own: 1,000 messages through the shared one, beside
    // the other tests' queues, took longer than the windows below.
    let moto = support::moto::MotoServer::start();
    let client = client_at(&moto.url);
    let url = create_queue(&client, "idem-many").await;
    let mut keys = Vec::new();
    for k in 0..700u32 {
        let copies = match k {
            0..200 => 2,
            200..250 => 3,
            _ => 1,
        };
        keys.extend(std::iter::repeat_n(k, copies));
    }
    assert_eq!(keys.len(), 1000);
    fastrand::shuffle(&mut keys);
    let messages = keys
        .iter()
        .map(|k| {
            (
                format!("{{\"n\":{k}}}"),
                vec![("key".to_owned(), text(&format!("key-{k}")))],
            )
        })
        .collect();
    send_all(&client, &url, messages).await;
    let sent_in = started.elapsed();

    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(10));
    let effects: Effects = Arc::default();
    let consumer = |idem: Idempotency<MemoryStore>| {
        SqsConsumer::new(client.clone(), &url, idem)
            .key_attribute("key")
            .visibility_timeout(Duration::from_secs(2))
            .wait_time(Duration::from_secs(1))
            .retry_visibility(Duration::from_secs(1))
            .concurrency(30)
    };
    let handler = |effects: Effects, running: Arc<AtomicUsize>| {
        move |m: SqsMessage| {
            let (effects, running) = (effects.clone(), running.clone());
            async move {
                running.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(5..40))).await;
                let key = m.attribute_text("key").unwrap().to_owned();
                *effects.lock().unwrap().entry(key).or_default() += 1;
                running.fetch_sub(1, Ordering::SeqCst);
                Ok(m.body.len())
            }
        }
    };
    let (a_running, b_running) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let a = Running::start(
        consumer(idem.clone()),
        handler(effects.clone(), a_running.clone()),
    );
    let b = Running::start(
        consumer(idem.clone()),
        handler(effects.clone(), b_running.clone()),
    );

    // Kill A once it has done some work and while handlers of its run.
    let a_consumer = a.consumer.clone();
    wait_until(
        "consumer A executed 100 messages with handlers running",
        Duration::from_secs(600),
        || {
            let (stats, running) = (a_consumer.stats(), a_running.load(Ordering::SeqCst));
            async move { stats.executed >= 100 && running > 0 }
        },
    )
    .await;
    a.task.abort();
    let running_at_kill = a_running.load(Ordering::SeqCst);
    let a_stats = a_consumer.stats();
    assert!(
        a.task.await.is_err_and(|e| e.is_cancelled()),
        "A was not killed"
    );
    drop(a.stop);
    let killed_at = started.elapsed();

    // B alone drains the rest (about 70 s on an idle machine, moto being
    // the slow part): up to 600 s on a loaded one, and a timeout says how
    // far it got.
    let b_consumer = b.consumer.clone();
    let limit = Duration::from_secs(600);
    while !queue_empty(&client, &url).await {
        assert!(
            started.elapsed() < killed_at + limit,
            "the queue not empty {limit:?} after A was killed: (visible, in flight) {:?}; B so far: {:?}",
            depth(&client, &url).await,
            b_consumer.stats()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drained_at = started.elapsed();
    let b_stats = b.stop().await;

    let effects = effects.lock().unwrap().clone();
    assert_eq!(effects.len(), 700, "every key's effect ran");
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "effects that did not run exactly once: {twice:?}"
    );
    assert!(running_at_kill > 0, "A was killed while its handlers ran");
    assert!(b_stats.replayed > 0, "B replayed duplicates: {b_stats:?}");
    assert_eq!(b_stats.dead_lettered + b_stats.poison, 0, "{b_stats:?}");
    assert!(queue_empty(&client, &url).await);
    eprintln!(
        "1,000 messages sent in {sent_in:?}; A killed at {killed_at:?} with {running_at_kill} handlers running \
         (A so far: {a_stats:?}); queue empty at {drained_at:?}; B: {b_stats:?}"
    );
}

/// The reply to DeleteMessageBatch is lost (the delete ran): no second
/// run, no dead letter; the redelivery (if any) is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_delete_reply_never_runs_the_handler_twice() {
    let client = client();
    let url = create_queue(&client, "idem-delloss").await;
    let proxy = support::proxy::CountingProxy::start(moto_addr()).await;
    proxy.lose_replies_to(b"DeleteMessageBatch", 1, 3);
    let through = client_at(&format!("http://{}", proxy.addr));
    let (a, runs) = counting(
        through,
        &url,
        Duration::from_secs(1),
        Duration::from_secs(1),
    );
    send(&client, &url, "x", &[("key", text("d-1"))]).await;
    wait_until("the queue empty", Duration::from_secs(60), || {
        queue_empty(&client, &url)
    })
    .await;
    let s = a.stop_within(Duration::from_secs(40)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{s:?}");
    assert_eq!((s.poison, s.dead_lettered), (0, 0), "{s:?}");
    assert!(proxy.lost() >= 1, "no reply was lost: {s:?}");
}

/// A DeleteMessageBatch that reaches SQS later than the visibility timeout
/// (a slow link): the message is kept invisible until the delete is
/// answered, so it is never received (nor replayed) again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_slower_than_the_visibility_timeout_is_not_received_again() {
    // A moto of its own: the shared one, busy with the other tests, may
    // answer a renewal later than the visibility timeout.
    let moto = support::moto::MotoServer::start();
    let client = client_at(&moto.url);
    let url = create_queue(&client, "idem-slowdel").await;
    let proxy = support::proxy::CountingProxy::start(addr_of(&moto.url)).await;
    proxy.delay_requests_to(b"AmazonSQS.DeleteMessageBatch\r", Duration::from_secs(9));
    let through = client_at(&format!("http://{}", proxy.addr));
    let (a, runs) = counting(
        through,
        &url,
        Duration::from_secs(4),
        Duration::from_secs(30),
    );
    send(&client, &url, "x", &[("key", text("slow-del-1"))]).await;
    wait_until("the queue empty", Duration::from_secs(60), || {
        queue_empty(&client, &url)
    })
    .await;
    let s = a.stop_within(Duration::from_secs(40)).await;
    assert!(
        proxy.delayed() >= 1,
        "no delete went through the proxy: {s:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{s:?}");
    assert_eq!(
        (s.received, s.executed, s.replayed, s.deleted),
        (1, 1, 0, 1),
        "received again while its delete was on its way: {s:?}"
    );
}

/// A consumer of `url` through `client` whose handler counts its runs.
fn counting(
    client: Client,
    url: &str,
    visibility: Duration,
    call_timeout: Duration,
) -> (Running, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let consumer = SqsConsumer::new(client, url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .visibility_timeout(visibility)
        .wait_time(Duration::from_secs(1))
        .call_timeout(call_timeout);
    let running = Running::start(consumer, move |m: SqsMessage| {
        let r = r.clone();
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(m.body.len())
        }
    });
    (running, runs)
}
