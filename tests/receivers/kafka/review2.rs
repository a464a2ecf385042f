//! review16: a second review of idem-kafka on the real Tansu broker, around
//! `IdemError::Unrecorded` / `Idempotency::finish` and the bounded
//! shutdown. Each test states what the contract (DESIGN.md 2, 4, 5b and
//! the crate docs) expects.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::kafka::rdkafka::config::ClientConfig;
use idem::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idem::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem::kafka::rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use idem::kafka::rdkafka::util::Timeout;
use idem::kafka::{KafkaConsumer, KafkaRecord, RecordError};
use idem::{Idempotency, MemoryStore};
use support::flaky::FlakyStore;

type Effects = Arc<Mutex<HashMap<String, u32>>>;

fn name(prefix: &str) -> String {
    format!("{prefix}-{:08x}", fastrand::u32(..))
}

fn config(group: &str) -> ClientConfig {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", support::kafka::brokers())
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .set("auto.offset.reset", "earliest");
    c
}

fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", support::kafka::brokers())
        .set("linger.ms", "5")
        .create()
        .unwrap_or_else(|e| panic!("producer: {e}"))
}

/// Sends one record to partition 0; its offset.
async fn send(topic: &str, key: &[u8], payload: &[u8]) -> i64 {
    let r: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic)
        .partition(0)
        .key(key)
        .payload(payload);
    producer()
        .send(r, Timeout::After(Duration::from_secs(30)))
        .await
        .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"))
        .offset
}

async fn committed(group: &str, topic: &str) -> BTreeMap<i32, i64> {
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = config(&group).create().unwrap_or_else(|e| panic!("{e}"));
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&topic, 0);
        let got = c
            .committed_offsets(tpl, Timeout::After(Duration::from_secs(5)))
            .unwrap_or_else(|e| panic!("committed offsets: {e}"));
        got.elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some((e.partition(), o)),
                _ => None,
            })
            .collect()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn wait_for<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn effect(effects: &Effects, id: &str) -> u32 {
    let mut map = effects.lock().unwrap_or_else(|p| p.into_inner());
    let n = map.entry(id.to_owned()).or_default();
    *n += 1;
    *n
}

fn effects_of(effects: &Effects, id: &str) -> u32 {
    effects
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(id)
        .copied()
        .unwrap_or(0)
}

// review16
/// The handler of `pay-1` runs, then the store goes down: the completion
/// is not written before the lease (1 s) ends, `process` returns
/// `Unrecorded` and the record's drive loop retries `finish`. The consumer
/// is asked to shut down while that finish is pending; the store comes
/// back 500 ms later, far inside `revoke_wait` (10 s). The shutdown should
/// use its bounded wait to finish the record (its handler already ran):
/// the crate docs say shutdown "lets the running handlers finish", and
/// `IdemError::Unrecorded` says "do not run the message again". Then the
/// consumer is started again (same group, same store).
///
/// Expected: one effect. (A pending finish that is dropped at shutdown
/// leaves the key in progress with an expired lease: the restarted
/// consumer takes it over and runs the handler a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_a_finish_is_pending_then_restart_runs_the_effect_once() {
    let topic = name("rv16-finish");
    let group = name("rv16-finish-g");
    support::kafka::create_topic(&topic, 1);
    let end = send(&topic, b"pay-1", b"{\"amount\":1}").await + 1;

    let (store, down) = FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects: Effects = Arc::default();
    let outage_started = Arc::new(AtomicBool::new(false));
    let handler = {
        let (effects, down, outage_started) =
            (effects.clone(), down.clone(), outage_started.clone());
        move |record: KafkaRecord| {
            let (effects, down, outage_started) =
                (effects.clone(), down.clone(), outage_started.clone());
            async move {
                let id = record.key_text()?.to_owned();
                effect(&effects, &id);
                if !outage_started.swap(true, Ordering::SeqCst) {
                    // The first run: the store goes down after the effect.
                    down.store(true, Ordering::SeqCst);
                }
                Ok::<_, RecordError>(format!("done {id}"))
            }
        }
    };

    let first = KafkaConsumer::new(&config(&group), &[&topic], idem.clone())
        .unwrap_or_else(|e| panic!("{e}"))
        .commit_interval(Duration::ZERO)
        .revoke_wait(Duration::from_secs(10))
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(100));
    let shutdown = {
        let (effects, down) = (effects.clone(), down.clone());
        async move {
            wait_for(Duration::from_secs(30), || {
                let e = effects.clone();
                async move { effects_of(&e, "pay-1") >= 1 }
            })
            .await;
            // Past the lease (1 s) and the completion's give-up (0.5 s):
            // the record is Unrecorded, its finish retried.
            tokio::time::sleep(Duration::from_millis(1800)).await;
            // The store comes back 500 ms after the shutdown starts.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(500));
                down.store(false, Ordering::SeqCst);
            });
        }
    };
    let t0 = Instant::now();
    let stats1 = tokio::time::timeout(
        Duration::from_secs(60),
        first.run(handler.clone(), shutdown),
    )
    .await
    .unwrap_or_else(|_| panic!("first run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    let shutdown_took = t0.elapsed();
    drop(first);
    // Make sure the store is back before the restart.
    wait_for(Duration::from_secs(5), || {
        let d = down.clone();
        async move { !d.load(Ordering::SeqCst) }
    })
    .await;

    let second = KafkaConsumer::new(&config(&group), &[&topic], idem.clone())
        .unwrap_or_else(|e| panic!("{e}"))
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(100));
    let stats2 = tokio::time::timeout(
        Duration::from_secs(60),
        second.run(handler, async {
            wait_for(Duration::from_secs(20), || async {
                committed(&group, &topic).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("second run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects_of(&effects, "pay-1"),
        1,
        "the effect of pay-1 ran {} times; first run (shutdown took {shutdown_took:?}): {stats1:?}; restart: {stats2:?}",
        effects_of(&effects, "pay-1")
    );
    assert_eq!(committed(&group, &topic).await.get(&0), Some(&end));
}

// review16
/// A handler that takes 3 s; the consumer shuts down with a 300 ms
/// `revoke_wait`, so the record's task is aborted (the detached handler
/// goes on and records). The consumer is started again at once: the
/// record comes back while its handler still runs (in progress), then gets
/// the replay. Expected: one effect, and the offset committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_abort_of_a_running_record_then_restart_runs_the_effect_once() {
    let topic = name("rv16-abort");
    let group = name("rv16-abort-g");
    support::kafka::create_topic(&topic, 1);
    let end = send(&topic, b"slow-1", b"{\"amount\":1}").await + 1;
    let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(2));
    let effects: Effects = Arc::default();
    let handler = {
        let effects = effects.clone();
        move |record: KafkaRecord| {
            let effects = effects.clone();
            async move {
                let id = record.key_text()?.to_owned();
                effect(&effects, &id);
                tokio::time::sleep(Duration::from_secs(3)).await;
                Ok::<_, RecordError>(format!("done {id}"))
            }
        }
    };
    let first = KafkaConsumer::new(&config(&group), &[&topic], idem.clone())
        .unwrap_or_else(|e| panic!("{e}"))
        .revoke_wait(Duration::from_millis(300));
    let shutdown = {
        let effects = effects.clone();
        async move {
            wait_for(Duration::from_secs(30), || {
                let e = effects.clone();
                async move { effects_of(&e, "slow-1") >= 1 }
            })
            .await;
        }
    };
    let stats1 = tokio::time::timeout(
        Duration::from_secs(60),
        first.run(handler.clone(), shutdown),
    )
    .await
    .unwrap_or_else(|_| panic!("first run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    // Nothing was committed: the run's lag is its one record (before, it
    // was read after leaving the group, with nothing assigned: 0).
    assert_eq!(
        (stats1.abandoned, stats1.committed, stats1.lag),
        (1, 0, Some(end)),
        "{stats1:?}"
    );
    drop(first);
    let second = KafkaConsumer::new(&config(&group), &[&topic], idem.clone())
        .unwrap_or_else(|e| panic!("{e}"))
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let stats2 = tokio::time::timeout(
        Duration::from_secs(60),
        second.run(handler, async {
            wait_for(Duration::from_secs(20), || async {
                committed(&group, &topic).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("second run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects_of(&effects, "slow-1"),
        1,
        "first: {stats1:?}; restart: {stats2:?}"
    );
    assert_eq!(
        committed(&group, &topic).await.get(&0),
        Some(&end),
        "restart: {stats2:?}"
    );
}

/// Two records of one key read together and run as one batch
/// (`.batch(2)`); the store goes down right after the first one's effect,
/// for 3 s, three times the 1 s lease. The first record's completion is
/// not written (`Unrecorded`); the second must wait for it, not run: once
/// the store is back, its acquire would take the expired lease over and
/// run the handler a second time (a race with the first record's
/// `finish`). Expected: one effect, both records committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_key_twice_and_an_outage_past_the_lease_runs_the_effect_once() {
    let topic = name("rv16-batch-twice");
    let group = name("rv16-batch-twice-g");
    support::kafka::create_topic(&topic, 1);
    send(&topic, b"pay-2", b"{\"amount\":2}").await;
    let end = send(&topic, b"pay-2", b"{\"amount\":2}").await + 1;
    let (store, down) = FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects: Effects = Arc::default();
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move |record: KafkaRecord| {
            let (effects, down) = (effects.clone(), down.clone());
            async move {
                let id = record.key_text()?.to_owned();
                if effect(&effects, &id) == 1 {
                    down.store(true, Ordering::SeqCst);
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(3));
                        down.store(false, Ordering::SeqCst);
                    });
                }
                Ok::<_, RecordError>(format!("done {id}"))
            }
        }
    };
    let consumer = KafkaConsumer::new(&config(&group), &[&topic], idem)
        .unwrap_or_else(|e| panic!("{e}"))
        .batch(2)
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(100));
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(handler, async {
            wait_for(Duration::from_secs(30), || async {
                committed(&group, &topic).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects_of(&effects, "pay-2"),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!(
        committed(&group, &topic).await.get(&0),
        Some(&end),
        "{stats:?}"
    );
}
