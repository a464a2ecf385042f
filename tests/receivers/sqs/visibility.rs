//! The visibility heartbeat: a handler longer than the visibility timeout
//! keeps its message from the other consumers, and when the heartbeat
//! fails the redelivery gets "in progress" or the replay, never a second
//! run.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::sqs::aws_sdk_sqs::Client;
use idemkit::sqs::{ConsumerStats, SqsConsumer, SqsMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{
    client, client_at, create_queue, moto_addr, queue_empty, send, text, wait_until, BoxError,
    Running,
};

/// A handler that runs longer than the visibility timeout: with the
/// heartbeat, the message is not handed to the second consumer meanwhile
/// (one receive in all, no "in progress"); without it (the control), it
/// is, and only idem keeps the effect single.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn visibility_heartbeat_keeps_a_long_handler_from_the_second_consumer() {
    // A moto of its own: the control needs moto to hand the message out
    // again 4 s into a 14 s handler, which the shared moto, busy with the
    // DynamoDB storms of the stores suite, did not do once in CI.
    let moto = support::moto::MotoServer::start();
    async fn one(moto: &str, heartbeat: bool) -> (u32, ConsumerStats, ConsumerStats) {
        let client = client_at(moto);
        let url = create_queue(&client, "idem-heartbeat").await;
        let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(30));
        let runs = Arc::new(AtomicUsize::new(0));
        let start = |idem: Idempotency<MemoryStore>| {
            let consumer = SqsConsumer::new(client.clone(), &url, idem)
                .key_attribute("key")
                .visibility_timeout(Duration::from_secs(4))
                .retry_visibility(Duration::from_secs(1))
                .wait_time(Duration::from_secs(1))
                .heartbeat(heartbeat);
            let runs = runs.clone();
            Running::start(consumer, move |m: SqsMessage| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    // Three and a half visibility timeouts (4 s: a
                    // renewal that moto answers late on a loaded machine
                    // still lands in time).
                    tokio::time::sleep(Duration::from_secs(14)).await;
                    Ok(m.body.len())
                }
            })
        };
        let (a, b) = (start(idem.clone()), start(idem.clone()));
        send(&client, &url, "slow", &[("key", text("s-1"))]).await;
        wait_until("the queue empty", Duration::from_secs(60), || {
            queue_empty(&client, &url)
        })
        .await;
        let (a, b) = (a.stop().await, b.stop().await);
        (runs.load(Ordering::SeqCst) as u32, a, b)
    }
    let started = Instant::now();
    let ((runs, a, b), (control_runs, ca, cb)) =
        tokio::join!(one(&moto.url, true), one(&moto.url, false));
    eprintln!(
        "with the heartbeat: {a:?} {b:?}; without: {ca:?} {cb:?}; {:?}",
        started.elapsed()
    );
    assert_eq!(runs, 1);
    assert_eq!(a.received + b.received, 1, "received once: {a:?} {b:?}");
    assert_eq!(a.in_progress + b.in_progress, 0, "{a:?} {b:?}");
    assert_eq!(a.executed + b.executed, 1);
    assert!(a.heartbeats + b.heartbeats >= 3, "{a:?} {b:?}");
    assert_eq!(a.heartbeat_failures + b.heartbeat_failures, 0);
    // The control shows the test can tell: redelivered while it ran.
    assert_eq!(control_runs, 1, "idem keeps the effect single all the same");
    assert!(ca.received + cb.received >= 2, "{ca:?} {cb:?}");
    assert!(ca.in_progress + cb.in_progress >= 1, "{ca:?} {cb:?}");
}

/// The heartbeat fails while a handler runs (A's connection to SQS is
/// cut): the message is redelivered to consumer B; B must get "in
/// progress" or the replay, never a second run; once A is back, every
/// message is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_heartbeat_never_runs_the_handler_twice() {
    let client = client();
    let url = create_queue(&client, "idem-hbcut").await;
    let proxy = support::proxy::CountingProxy::start(moto_addr()).await;
    let through = client_at(&format!("http://{}", proxy.addr));
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(2));
    let runs = Arc::new(AtomicUsize::new(0));
    let (started_tx, started_rx) = tokio::sync::watch::channel(false);
    let handler = {
        let runs = runs.clone();
        move |m: SqsMessage| {
            let (runs, started) = (runs.clone(), started_tx.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = started.send(true);
                tokio::time::sleep(Duration::from_secs(6)).await;
                Ok::<_, BoxError>(m.body.len())
            }
        }
    };
    let mk = |c: Client| {
        SqsConsumer::new(c, &url, idem.clone())
            .key_attribute("key")
            .visibility_timeout(Duration::from_secs(2))
            .retry_visibility(Duration::from_secs(1))
            .wait_time(Duration::from_secs(1))
            .call_timeout(Duration::from_secs(1))
    };
    let a = Running::start(mk(through), handler.clone());
    send(&client, &url, "slow", &[("key", text("h-1"))]).await;
    let mut rx = started_rx.clone();
    tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|s| *s))
        .await
        .unwrap()
        .unwrap();
    proxy.cut(true);
    let b = Running::start(mk(client.clone()), handler);
    let bc = b.consumer.clone();
    wait_until("B received the redelivery", Duration::from_secs(30), || {
        let n = bc.stats().received;
        async move { n >= 1 }
    })
    .await;
    proxy.cut(false);
    wait_until("the queue empty", Duration::from_secs(60), || {
        queue_empty(&client, &url)
    })
    .await;
    let (sa, sb) = (
        a.stop_within(Duration::from_secs(40)).await,
        b.stop_within(Duration::from_secs(40)).await,
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "A {sa:?} B {sb:?}");
    assert!(sa.heartbeat_failures >= 1, "{sa:?}");
}
