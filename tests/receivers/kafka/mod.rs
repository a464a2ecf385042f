//! The Kafka consumer against a real Kafka-protocol broker (Tansu, started
//! by `support::kafka`) and a real Redis or an in-memory store. Every
//! effect once, every record committed, the committed offset never past a
//! running record, whatever happens to the members:
//!
//! - `delivery`: duplicates, a member killed mid-batch, out-of-order
//!   completion within a partition;
//! - `rebalance`: members joining while records run, short revoke waits;
//! - `in_transaction`: the in-transaction form on PostgreSQL: a member
//!   killed between its INSERT and the commit, panics, 64 copies on a
//!   pool of 8;
//! - `poison`: dead letters, `max_deliveries`, input no handler can use;
//! - `settings`: settings at their extremes, scopes that cannot be keys;
//! - `shutdown`: a bounded shutdown, a record cut off by it;
//! - `unrecorded`: a store outage after the handler ran (`Unrecorded`),
//!   the result finished later, across a shutdown and a restart, and the
//!   window a rebalance opens meanwhile.
//!
//! `cargo test --all-features --test receivers kafka::` runs them;
//! `RUST_LOG=idem_kafka=debug` shows what the consumers did.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit::kafka::rdkafka::config::ClientConfig;
use idemkit::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idemkit::kafka::rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use idemkit::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idemkit::kafka::rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use idemkit::kafka::rdkafka::util::Timeout;
use idemkit::kafka::{ConsumerStats, KafkaConsumer, KafkaRecord};
use idemkit::redis::RedisStore;
use idemkit::{Idempotency, IdempotencyStore};
use serde::de::DeserializeOwned;
use serde::Serialize;

mod delivery;
#[cfg(feature = "postgres")]
mod in_transaction;
mod poison;
mod rebalance;
mod settings;
mod shutdown;
mod unrecorded;

/// Effects per message id, counted by the handlers.
type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// A topic or group name of a test's own.
fn name(prefix: &str) -> String {
    format!("{prefix}-{:08x}", fastrand::u32(..))
}

/// A member's client configuration: short session and heartbeat, so a
/// join takes a second or two, not the default's 20-odd.
fn config(group: &str) -> ClientConfig {
    support::logs::init();
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", support::kafka::brokers())
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .set("auto.offset.reset", "earliest");
    c
}

/// A consumer of `topic` in `group` (configured by [`config`]).
fn consumer<S: IdempotencyStore + ?Sized>(
    group: &str,
    topic: &str,
    idem: Idempotency<S>,
) -> KafkaConsumer<S> {
    KafkaConsumer::new(&config(group), &[topic], idem).unwrap_or_else(|e| panic!("{e}"))
}

fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", support::kafka::brokers())
        .set("linger.ms", "5")
        .create()
        .unwrap_or_else(|e| panic!("producer: {e}"))
}

/// A record to produce: (partition, key, headers, payload).
type Out = (i32, Option<String>, Vec<(String, String)>, String);

/// One past the last offset the producer wrote, per partition (from its
/// delivery reports: Tansu 0.6 under-reports the high watermark of a
/// multi-record batch, so the lag it gives is not trusted here).
type Ends = BTreeMap<i32, i64>;

/// Produces records, all at once through one producer.
async fn produce(topic: &str, records: Vec<Out>) -> Ends {
    let p = producer();
    let sends = records.iter().map(|(partition, key, headers, payload)| {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        let mut r: FutureRecord<'_, str, str> = FutureRecord::to(topic)
            .partition(*partition)
            .payload(payload.as_str())
            .headers(h);
        if let Some(k) = key {
            r = r.key(k.as_str());
        }
        p.send(r, Timeout::After(Duration::from_secs(30)))
    });
    let mut ends = Ends::new();
    for r in futures::future::join_all(sends).await {
        match r {
            Ok(d) => {
                let end = ends.entry(d.partition).or_default();
                *end = (*end).max(d.offset + 1);
            }
            Err((e, _)) => panic!("produce to {topic}: {e}"),
        }
    }
    ends
}

fn merge(mut a: Ends, b: Ends) -> Ends {
    for (p, e) in b {
        let end = a.entry(p).or_default();
        *end = (*end).max(e);
    }
    a
}

/// Sends one record, any of its parts raw bytes or absent; its offset.
async fn send(
    topic: &str,
    partition: i32,
    key: Option<&[u8]>,
    headers: &[(&str, Option<&[u8]>)],
    payload: Option<&[u8]>,
) -> i64 {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header { key: k, value: *v });
    }
    let mut r: FutureRecord<'_, [u8], [u8]> =
        FutureRecord::to(topic).partition(partition).headers(h);
    if let Some(k) = key {
        r = r.key(k);
    }
    if let Some(p) = payload {
        r = r.payload(p);
    }
    let d = producer()
        .send(r, Timeout::After(Duration::from_secs(30)))
        .await
        .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
    d.offset
}

/// The group's committed offsets on the topic, per partition.
async fn committed(group: &str, topic: &str, partitions: i32) -> BTreeMap<i32, i64> {
    let (group, topic) = (group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = config(&group).create().unwrap_or_else(|e| panic!("{e}"));
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
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

/// Whether the group committed every partition up to its end.
async fn all_committed(group: &str, topic: &str, ends: &Ends) -> bool {
    let partitions = ends.keys().max().map_or(0, |p| p + 1);
    let committed = committed(group, topic, partitions).await;
    ends.iter().all(|(p, e)| committed.get(p) == Some(e))
}

/// Waits for `cond`, checked every 20 ms, failing after `limit`.
async fn until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (up to 360 s: the broker's group joins take seconds each, and
/// the suite shares two cores with the fault suite and the smoke runs) until each of
/// `messages` messages had an effect and the group committed every
/// partition of `topic` up to its end; on a timeout, says how far it got.
async fn until_every_effect_and_commit(
    effects: &Effects,
    messages: u32,
    (group, topic): (&str, &str),
    ends: &Ends,
) {
    let done = wait_for(Duration::from_secs(360), || async {
        effects.lock().unwrap_or_else(|p| p.into_inner()).len() == messages as usize
            && all_committed(group, topic, ends).await
    })
    .await;
    if !done {
        let had = effects.lock().unwrap_or_else(|p| p.into_inner()).len();
        let partitions = i32::try_from(ends.len()).unwrap_or(i32::MAX);
        let committed = committed(group, topic, partitions).await;
        panic!(
            "timed out waiting for every message's effect and every record committed: \
             {had} of {messages} messages had their effect; committed {committed:?}, ends {ends:?}"
        );
    }
}

/// Waits for `cond` (every 50 ms) up to `limit`; whether it came true.
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

/// Runs `consumer` until its group committed partition 0 of `topic` up to
/// `end` (waited for at most `wait`), then shuts it down: what `run`
/// returned. Fails when `run` fails or does not return within 60 s.
async fn run_until_committed<S, F, Fut, T, E>(
    consumer: &KafkaConsumer<S>,
    handler: F,
    (group, topic): (&str, &str),
    end: i64,
    wait: Duration,
) -> ConsumerStats
where
    S: IdempotencyStore + ?Sized,
    F: Fn(KafkaRecord) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Serialize + DeserializeOwned + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let run = consumer.run(handler, async {
        wait_for(wait, || async {
            committed(group, topic, 1).await.get(&0) == Some(&end)
        })
        .await;
    });
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap_or_else(|_| panic!("run did not return"))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A shutdown future: done once `done` is set (checked every 20 ms).
async fn once_set(done: Arc<AtomicBool>) {
    while !done.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn redis_store() -> Arc<dyn IdempotencyStore> {
    Arc::new(
        RedisStore::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
}

/// Counts an effect of `id`; how many it has now.
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

/// Every id had exactly one effect, and no other id had any.
fn exactly_once(effects: &Effects, ids: impl Iterator<Item = String>) {
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner());
    let mut n = 0;
    for id in ids {
        assert_eq!(effects.get(&id), Some(&1), "{id}: effects");
        n += 1;
    }
    assert_eq!(effects.len(), n, "effects of unknown ids");
}

/// A record read back: (key, payload, headers in order).
type Letter = (
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Vec<(String, Option<Vec<u8>>)>,
);

/// The records of a topic (one partition), read from the start by a reader
/// of its own until `enough` holds of what was read, or `limit` passed.
async fn read_topic_until(
    topic: &str,
    limit: Duration,
    enough: impl Fn(&[Letter]) -> bool + Send + 'static,
) -> Vec<Letter> {
    let reader: BaseConsumer = config(&name("reader"))
        .create()
        .unwrap_or_else(|e| panic!("{e}"));
    reader.subscribe(&[topic]).unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + limit;
    tokio::task::spawn_blocking(move || {
        let mut got = Vec::new();
        while !enough(&got) && Instant::now() < deadline {
            let Some(m) = reader.poll(Duration::from_millis(200)) else {
                continue;
            };
            let Ok(m) = m else { continue };
            let mut headers = Vec::new();
            if let Some(h) = m.headers() {
                for h in h.iter() {
                    headers.push((h.key.to_owned(), h.value.map(<[u8]>::to_vec)));
                }
            }
            got.push((
                m.key().map(<[u8]>::to_vec),
                m.payload().map(<[u8]>::to_vec),
                headers,
            ));
        }
        got
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The first `n` records of a topic (one partition), read for up to `limit`.
async fn read_topic(topic: &str, n: usize, limit: Duration) -> Vec<Letter> {
    read_topic_until(topic, limit, move |got| got.len() >= n).await
}

/// A record's headers as text (an absent value is empty; of a header
/// repeated, the last).
fn headers_of(letter: &Letter) -> HashMap<String, String> {
    letter
        .2
        .iter()
        .map(|(k, v)| {
            let v = String::from_utf8_lossy(v.as_deref().unwrap_or_default()).into_owned();
            (k.clone(), v)
        })
        .collect()
}

/// A record's payload as text (absent: empty).
fn payload_of(letter: &Letter) -> String {
    String::from_utf8_lossy(letter.1.as_deref().unwrap_or_default()).into_owned()
}
