//! Delivery: duplicates through two consumers, one killed mid-batch; the
//! broker killed and started again mid-run; a consumer's connection lost
//! while its handler runs. Every effect once, every message acked.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::rabbitmq::{RabbitConsumer, RabbitMessage};
use idemkit::{Idempotency, IdempotencyKey, IdempotencyStore, RecordState};

use super::{
    channel, channel_on, count, declare, drained, effect, exactly_once, name, publish, publish_ids,
    redis_store, until_settled, wait_until, Effects, Running,
};

/// The variable that tells a child process of this binary to be consumer
/// A of [`two_consumers_one_killed_mid_batch_every_effect_once`] (its
/// value: the queue).
const CONSUMER_A: &str = "IDEM_TEST_RABBITMQ_CONSUMER_A";

/// After this many effects, consumer A's handlers stall before their
/// effect, and A is killed.
const A_EFFECTS: u64 = 300;

/// 1,000 messages, each published 1 to 4 times (a publisher's resend after
/// a lost confirm); two consumers share a Redis store and one of them, a
/// process of its own, is killed (SIGKILL) with a prefetch's worth of
/// messages unacked, its handlers stalled. Every message's effect runs
/// once, the queue ends empty, and the messages A held are run or
/// replayed by B, never run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_one_killed_mid_batch_every_effect_once() {
    if let Ok(queue) = std::env::var(CONSUMER_A) {
        return consumer_a(&queue).await;
    }
    let queue = name("payments");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let ids: Vec<String> = (0..1000).map(|m| format!("m-{m}")).collect();
    let mut copies = Vec::new();
    for id in &ids {
        for _ in 0..fastrand::u32(1..=4) {
            copies.push(id.clone());
        }
    }
    fastrand::shuffle(&mut copies);
    let total = copies.len() as u64;
    publish_ids(&channel, &queue, &copies).await;

    let effects: Effects = Arc::default();
    let a_effects = Arc::new(AtomicU64::new(0));
    let stalled = Arc::new(tokio::sync::Notify::new());
    let mut a_process = {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("this test binary: {e}"));
        let child = std::process::Command::new(exe)
            .args([
                "rabbitmq::delivery::two_consumers_one_killed_mid_batch_every_effect_once",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CONSUMER_A, &queue)
            .env("IDEM_REDIS_URL", support::redis_server::shared_url())
            .env("IDEM_AMQP_URL", support::rabbitmq::shared_url())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start consumer A: {e}"));
        support::alone::Killed(child)
    };
    {
        let out = a_process
            .0
            .stdout
            .take()
            .unwrap_or_else(|| panic!("A's stdout"));
        let (effects, a_effects, stalled) = (effects.clone(), a_effects.clone(), stalled.clone());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if let Some((_, id)) = line.split_once("idem-effect ") {
                    effect(&effects, id);
                    a_effects.fetch_add(1, Ordering::SeqCst);
                } else if line.ends_with("idem-stalled") {
                    stalled.notify_one();
                } else {
                    println!("consumer A: {line}");
                }
            }
        });
    }
    // B starts once A ran an effect, so both hold messages.
    let a = a_effects.clone();
    wait_until("A's first effect", Duration::from_secs(120), || {
        let ran = a.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    let store = redis_store().await;
    let b = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        &queue,
        Idempotency::new(store.clone()).lease(Duration::from_secs(2)),
    )
    .requeue_delay(Duration::from_millis(100));
    let b_effects = effects.clone();
    let b = Running::start(b, move |m: RabbitMessage| {
        let effects = b_effects.clone();
        async move {
            let id = m.message_id().unwrap_or_default().to_owned();
            effect(&effects, &id);
            Ok::<_, std::io::Error>(id)
        }
    });
    tokio::time::timeout(Duration::from_secs(120), stalled.notified())
        .await
        .unwrap_or_else(|_| panic!("A never stalled"));
    a_process.kill();
    let had = a_effects.load(Ordering::SeqCst);
    assert!(had >= A_EFFECTS, "A ran {had} effects");

    let e = effects.clone();
    wait_until("every message's effect", Duration::from_secs(180), || {
        let n = count(&e);
        async move { n == 1000 }
    })
    .await;
    until_settled(&queue, Duration::from_secs(60), &[&|| b.stats()]).await;
    let stats = b.stop().await;
    // Stopped: what B held unacked is back in the queue, if anything.
    assert!(
        drained(&queue).await,
        "messages left in the queue: {stats:?}"
    );
    exactly_once(&effects, &ids);
    assert!(stats.replayed >= 1, "B replayed what A recorded: {stats:?}");
    assert!(stats.received < total + 1000, "{stats:?}");
    // Every key is recorded, with its own id.
    for id in ids.iter().step_by(97) {
        let key =
            IdempotencyKey::new(idemkit::rabbitmq::default_scope(&queue), id.as_str()).unwrap();
        match store.get(&key).await.unwrap().map(|r| r.state) {
            Some(RecordState::Completed { response, .. }) => {
                assert_eq!(&response[..], format!("\"{id}\"").as_bytes());
            }
            other => panic!("{id}: {other:?}"),
        }
    }
}

/// Consumer A, in a child process: prints each effect; after
/// [`A_EFFECTS`] of them, each handler waits until every effect it
/// printed is recorded, says it stalled, and never returns.
async fn consumer_a(queue: &str) {
    let store = redis_store().await;
    let printed: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let n = Arc::new(AtomicU64::new(0));
    let consumer = RabbitConsumer::new(
        support::rabbitmq::shared_url(),
        queue,
        Idempotency::new(store.clone()).lease(Duration::from_secs(2)),
    )
    .prefetch(16);
    let scope = idemkit::rabbitmq::default_scope(queue);
    let run = consumer.run(
        move |m: RabbitMessage| {
            let (printed, n, store, scope) =
                (printed.clone(), n.clone(), store.clone(), scope.clone());
            async move {
                let id = m.message_id().unwrap_or_default().to_owned();
                if n.fetch_add(1, Ordering::SeqCst) >= A_EFFECTS {
                    // Stalled before the effect; first, every effect
                    // printed is recorded (so killing A now cuts off no
                    // effect between its run and its record).
                    let ids = printed.lock().unwrap().clone();
                    for id in ids {
                        let key = IdempotencyKey::new(scope.as_str(), id.as_str()).unwrap();
                        loop {
                            let state = store.get(&key).await.ok().flatten().map(|r| r.state);
                            if matches!(state, Some(RecordState::Completed { .. })) {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                    println!("idem-stalled");
                    std::future::pending::<()>().await;
                }
                println!("idem-effect {id}");
                printed.lock().unwrap().push(id.clone());
                Ok::<_, std::io::Error>(id)
            }
        },
        std::future::pending::<()>(),
    );
    let _ = run.await;
}

/// The broker is killed (SIGKILL) mid-run and started again on the same
/// port and data: the consumer connects again by itself; the messages
/// whose acks were lost come back and are replayed, those in flight are
/// found in progress and then replayed. No effect twice, none lost, the
/// queue empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_restart_mid_run_loses_nothing_and_runs_nothing_twice() {
    let broker = support::rabbitmq::RabbitServer::start();
    let queue = name("restart");
    let publisher = channel_on(&broker.url).await;
    declare(&publisher, &queue, &[]).await;
    let ids: Vec<String> = (0..400).map(|m| format!("r-{m}")).collect();
    let mut copies: Vec<String> = ids.iter().flat_map(|id| [id.clone(), id.clone()]).collect();
    fastrand::shuffle(&mut copies);
    publish_ids(&publisher, &queue, &copies).await;
    drop(publisher);

    let store = redis_store().await;
    let effects: Effects = Arc::default();
    let e = effects.clone();
    let consumer = RabbitConsumer::new(
        &broker.url,
        &queue,
        Idempotency::new(store).lease(Duration::from_secs(2)),
    )
    .requeue_delay(Duration::from_millis(100))
    .prefetch(8);
    let running = Running::start(consumer, move |m: RabbitMessage| {
        let effects = e.clone();
        async move {
            let id = m.message_id().unwrap_or_default().to_owned();
            // Slow enough that the kill finds handlers in flight.
            tokio::time::sleep(Duration::from_millis(5)).await;
            effect(&effects, &id);
            Ok::<_, std::io::Error>(())
        }
    });
    let e = effects.clone();
    wait_until("100 effects", Duration::from_secs(120), || {
        let n = count(&e);
        async move { n >= 100 }
    })
    .await;
    broker.kill();
    let at_kill = count(&effects);
    broker.start_again();
    let e = effects.clone();
    wait_until("every message's effect", Duration::from_secs(180), || {
        let n = count(&e);
        async move { n == 400 }
    })
    .await;
    // Drained on the restarted broker (its own ready count).
    super::until_settled_on(
        &broker.url,
        &queue,
        Duration::from_secs(60),
        &[&|| running.stats()],
    )
    .await;
    let stats = running.stop().await;
    assert_eq!(super::depth_on(&broker.url, &queue).await.0, 0, "{stats:?}");
    exactly_once(&effects, &ids);
    assert!(
        at_kill < 400,
        "the kill came after the last effect: {stats:?}"
    );
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert!(
        stats.replayed >= 400,
        "every second copy is a replay: {stats:?}"
    );
}

/// Consumer A's connection to the broker is lost (a proxy in front of the
/// broker cuts it) while A's handler runs: the broker hands the message to
/// consumer B, which finds it in progress (A's lease, renewed by its
/// heartbeat) and requeues it, until A's handler returns and records its
/// result (A's ack cannot be sent); then B acks it with the replay. One
/// effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_lost_while_the_handler_runs_gives_the_other_consumer_in_progress_then_the_replay(
) {
    let url = support::rabbitmq::shared_url();
    let queue = name("lost");
    let channel = channel().await;
    declare(&channel, &queue, &[]).await;
    let broker: std::net::SocketAddr = {
        let hostport = url
            .trim_start_matches("amqp://")
            .split_once('@')
            .map_or("", |(_, rest)| rest)
            .split_once('/')
            .map_or("", |(hp, _)| hp);
        hostport
            .parse()
            .unwrap_or_else(|e| panic!("{hostport}: {e}"))
    };
    let proxy = support::proxy::CountingProxy::start(broker).await;
    let via_proxy = format!("amqp://guest:guest@{}/%2f", proxy.addr);
    let store = redis_store().await;
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects: Effects = Arc::default();
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let (e, s, r) = (effects.clone(), started.clone(), release.clone());
    let a = Running::start(
        RabbitConsumer::new(&via_proxy, &queue, idem.clone())
            .requeue_delay(Duration::from_millis(100)),
        move |m: RabbitMessage| {
            let (e, s, r) = (e.clone(), s.clone(), r.clone());
            async move {
                s.notify_one();
                r.notified().await;
                effect(&e, m.message_id().unwrap_or_default());
                Ok::<_, std::io::Error>(7)
            }
        },
    );
    publish(&channel, &queue, &[(Some("k-1"), &[], b"slow")]).await;
    tokio::time::timeout(Duration::from_secs(60), started.notified())
        .await
        .unwrap_or_else(|_| panic!("A's handler never started"));
    let e = effects.clone();
    let b = Running::start(
        RabbitConsumer::new(url, &queue, idem.clone()).requeue_delay(Duration::from_millis(100)),
        move |m: RabbitMessage| {
            let e = e.clone();
            async move {
                effect(&e, m.message_id().unwrap_or_default());
                Ok::<_, std::io::Error>(7)
            }
        },
    );
    proxy.cut(true);
    // B gets the message and finds it in progress, more than once (A's
    // heartbeat renews its 1 s lease).
    tokio::time::sleep(Duration::from_secs(3)).await;
    release.notify_one();
    let q = queue.clone();
    let key = IdempotencyKey::new(idemkit::rabbitmq::default_scope(&queue), "k-1").unwrap();
    let i = idem.clone();
    wait_until("the result recorded", Duration::from_secs(30), || {
        let (i, key) = (i.clone(), key.clone());
        async move {
            matches!(
                i.get(&key).await.ok().flatten().map(|r| r.state),
                Some(RecordState::Completed { .. })
            )
        }
    })
    .await;
    b.until("B's replay", Duration::from_secs(30), |s| s.replayed == 1)
        .await;
    let _ = q;
    let b_stats = b.stop().await;
    proxy.cut(false);
    let a_stats = a.stop().await;
    assert_eq!(count(&effects), 1);
    exactly_once(&effects, &["k-1".to_owned()]);
    assert!(
        b_stats.in_progress >= 1,
        "B found it in progress: {b_stats:?}"
    );
    assert_eq!((b_stats.replayed, b_stats.executed), (1, 0), "{b_stats:?}");
    assert_eq!(a_stats.executed, 1, "{a_stats:?}");
    assert!(a_stats.ack_failures >= 1, "A's ack was lost: {a_stats:?}");
    assert!(drained(&queue).await);
}
