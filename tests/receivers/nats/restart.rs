//! The server stopped and started mid-run (same port, same JetStream
//! store): the consumer waits for it, pulls again, and no effect runs
//! twice, no message is lost.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::nats::{MessageError, NatsConsumer, NatsMessage};
use idemkit::Idempotency;

use super::{
    all_acked, create_stream, effect, jetstream_at, redis_store, wait_until, Effects, Running,
};

/// 400 messages (each published once or twice), a consumer on a Redis
/// store. After 100
/// effects the server is stopped (SIGTERM) with handlers running and
/// acks, in-progress acks and pulls failing, and started again 2 s later
/// on the same port and store. Every message's effect runs once and every
/// message is acked in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_run_runs_no_effect_twice_and_loses_no_message() {
    let server = support::nats::NatsServer::start();
    let js = jetstream_at(&server.url).await;
    create_stream(&js, "RESTART", &["restart.>"]).await;
    let messages = 400u32;
    let mut total = 0;
    for m in 0..messages {
        for _ in 0..fastrand::u32(1..=2) {
            let mut headers = idemkit::nats::async_nats::HeaderMap::new();
            headers.insert("message-id", format!("m-{m}"));
            js.publish_with_headers("restart.charge", headers, format!("{m}").into())
                .await
                .unwrap()
                .await
                .unwrap();
            total += 1;
        }
    }
    let store = Arc::new(redis_store().await);
    let effects: Effects = Arc::default();
    let count = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, count) = (effects.clone(), count.clone());
        move |m: NatsMessage| {
            let (effects, count) = (effects.clone(), count.clone());
            async move {
                // Slow enough that the restart finds handlers running.
                tokio::time::sleep(Duration::from_millis(fastrand::u64(20..50))).await;
                let id = m.header_text("message-id")?.to_owned();
                effect(&effects, &id);
                count.fetch_add(1, Ordering::SeqCst);
                Ok::<_, MessageError>(id)
            }
        }
    };
    let consumer = NatsConsumer::new(
        js.clone(),
        "RESTART",
        "billing",
        Idempotency::from_arc(store.clone()).lease(Duration::from_secs(10)),
    )
    .scope(format!("restart-{:08x}", fastrand::u32(..)))
    .key_header("message-id")
    .ack_wait(Duration::from_secs(3))
    .pull_wait(Duration::from_secs(1))
    .retry_delay(Duration::from_millis(200))
    .concurrency(8);
    let a = Running::start(consumer, handler);
    let c = count.clone();
    wait_until("100 effects", Duration::from_secs(120), || {
        let n = c.load(Ordering::SeqCst);
        async move { n >= 100 }
    })
    .await;
    let stopped = Instant::now();
    server.stop();
    let effects_at_stop = effects.lock().unwrap().len();
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.start_again();
    let restarted = stopped.elapsed();
    wait_until(
        "every effect, and every message acked",
        Duration::from_secs(300),
        || {
            let (js, effects) = (js.clone(), effects.clone());
            async move {
                let all = effects.lock().unwrap().len() == messages as usize;
                all && all_acked(&js, "RESTART", "billing").await
            }
        },
    )
    .await;
    let recovered = stopped.elapsed();
    let stats = a.stop().await;
    let effects = effects.lock().unwrap().clone();
    let not_once: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        not_once.is_empty(),
        "effects not run exactly once: {not_once:?}"
    );
    assert_eq!(effects.len(), messages as usize, "no message lost");
    assert_eq!(stats.executed, u64::from(messages), "{stats:?}");
    assert!(stats.received >= total, "{stats:?}, {total} entries");
    assert_eq!(stats.poison, 0, "{stats:?}");
    assert!(effects_at_stop < messages as usize, "the stop came mid-run");
    eprintln!("stopped after {effects_at_stop} effects, restarted in {restarted:?}, all acked {recovered:?} after the stop; {stats:?}");
}

/// The server is stopped while a handler runs longer than the ack wait,
/// and started again: the in-progress acks fail meanwhile, and after the
/// restart JetStream delivers the message again, to the other consumer,
/// which finds its key in progress (the lease renewed by the heartbeat),
/// hands it back, and gets the replay or sees it acked once the first run
/// recorded. The effect ran once, nothing is left unacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_a_long_handler_runs_never_runs_it_twice() {
    let server = support::nats::NatsServer::start();
    let js = jetstream_at(&server.url).await;
    create_stream(&js, "LONGRESTART", &["long.>"]).await;
    let runs = Arc::new(AtomicU64::new(0));
    let idem = Idempotency::new(idemkit::MemoryStore::new()).lease(Duration::from_secs(2));
    let handler = {
        let runs = runs.clone();
        move |_m: NatsMessage| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<_, MessageError>(1)
            }
        }
    };
    let consumer = || {
        NatsConsumer::new(js.clone(), "LONGRESTART", "long", idem.clone())
            .key_from_content()
            .ack_wait(Duration::from_secs(1))
            .retry_delay(Duration::from_millis(200))
            .pull_wait(Duration::from_millis(500))
    };
    let a = Running::start(consumer().concurrency(1), handler.clone());
    js.publish("long.x", "payload".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let r = runs.clone();
    wait_until("the handler running", Duration::from_secs(30), || {
        let ran = r.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    let b = Running::start(consumer(), handler);
    server.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.start_again();
    wait_until("the message acked", Duration::from_secs(60), || {
        let js = js.clone();
        async move { all_acked(&js, "LONGRESTART", "long").await }
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{sa:?} {sb:?}");
    assert_eq!(sa.executed + sb.executed, 1, "{sa:?} {sb:?}");
    assert_eq!(sa.poison + sb.poison, 0);
    eprintln!("A: {sa:?}\nB: {sb:?}");
}
