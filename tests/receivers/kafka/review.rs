//! Review of idem-kafka on the real Tansu broker: each test states what the
//! contract (DESIGN.md 2, 4, 5b) expects. On the first version (commit
//! 2cf0871) five of them failed; each doc comment says what went wrong
//! there, and the tests now assert the fix.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::kafka::rdkafka::config::ClientConfig;
use idem::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idem::kafka::rdkafka::message::{Header, Headers, Message, OwnedHeaders};
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

/// Sends one record; its offset.
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

fn effect(effects: &Effects, id: &str) {
    *effects
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(id.to_owned())
        .or_default() += 1;
}

/// Every record of a topic (one partition) read from the start for up to
/// `limit`, until `n` are read: (key, payload, headers in order).
type Letter = (
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Vec<(String, Option<Vec<u8>>)>,
);
async fn read_topic(topic: &str, n: usize, limit: Duration) -> Vec<Letter> {
    let reader: BaseConsumer = config(&name("reader"))
        .create()
        .unwrap_or_else(|e| panic!("{e}"));
    reader.subscribe(&[topic]).unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + limit;
    tokio::task::spawn_blocking(move || {
        let mut got = Vec::new();
        while got.len() < n && Instant::now() < deadline {
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

/// The store goes down while the handler runs (after its effect), for 3 s,
/// longer than the 1 s lease. The handler's effect ran once; idem-core
/// gives up completing before the lease ends and returns
/// `IdemError::Store(Unavailable)`; idem-kafka treats that as "retry the
/// record" and calls `process` again, which takes the expired lease over
/// (attempt 2) and runs the handler a second time.
///
/// Expected: one effect (the consumer should keep its lease and retry the
/// completion, or never re-acquire a key whose handler ran). DESIGN 5b:
/// "ack/commit only after the result is recorded"; 4: "once a handler
/// may have started its side effects ...".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_during_complete_never_runs_the_effect_twice() {
    let topic = name("rv-outage");
    let group = name("rv-outage-g");
    support::kafka::create_topic(&topic, 1);
    let end = send(&topic, 0, Some(b"pay-1"), &[], Some(b"{\"amount\":1}")).await + 1;

    let (store, down) = FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = KafkaConsumer::new(&config(&group), &[&topic], idem)
        .unwrap_or_else(|e| panic!("{e}"))
        .commit_interval(Duration::ZERO)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
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
                // The first run: the store goes down now, for 3 s.
                if !outage_started.swap(true, Ordering::SeqCst) {
                    down.store(true, Ordering::SeqCst);
                    let down = down.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(3));
                        down.store(false, Ordering::SeqCst);
                    });
                }
                Ok::<_, RecordError>(format!("done {id}"))
            }
        }
    };
    let run = consumer.run(handler, async {
        wait_for(Duration::from_secs(30), || async {
            committed(&group, &topic, 1).await.get(&0) == Some(&end)
        })
        .await;
    });
    let stats = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .unwrap_or_else(|_| panic!("run did not return"))
        .unwrap_or_else(|e| panic!("{e}"));
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "committed in the end: {stats:?}"
    );
    assert_eq!(
        effects.get("pay-1"),
        Some(&1),
        "the effect of pay-1 ran {:?} times after a 3 s store outage during its completion: {stats:?}",
        effects.get("pay-1")
    );
}

/// A handler that never returns (a stuck downstream call) and a shutdown:
/// `run` waits for every task in flight with no bound (lib.rs, the loop
/// `while tasks.join_next().await.is_some() {}` after `'read`), so it never
/// returns, and commits nothing of what settled meanwhile. The handler is
/// detached: the run could give it up after a bound (revoke_wait) and let
/// the next owner get "in progress" then the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_a_handler_blocks_returns_within_a_bound() {
    let topic = name("rv-stuck");
    let group = name("rv-stuck-g");
    support::kafka::create_topic(&topic, 1);
    send(&topic, 0, Some(b"stuck"), &[], Some(b"1")).await;
    let consumer = KafkaConsumer::new(
        &config(&group),
        &[&topic],
        Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(5)),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .revoke_wait(Duration::from_secs(1));
    let started = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let started = started.clone();
        move |_record: KafkaRecord| {
            let started = started.clone();
            async move {
                started.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, RecordError>(())
            }
        }
    };
    let shutdown = {
        let started = started.clone();
        async move {
            let _ = tokio::time::timeout(Duration::from_secs(30), started.notified()).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let t0 = Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(45), consumer.run(handler, shutdown)).await;
    assert!(
        out.is_ok(),
        "run did not return {:?} after its shutdown future completed (a handler blocks); stats {:?}",
        t0.elapsed(),
        consumer.stats()
    );
}

/// A record that cannot be used (no key) whose dead-letter copy is larger
/// than the dead-letter producer's `message.max.bytes` (librdkafka's
/// default 1,000,000): the consumer adds six `idem.*` headers to a record
/// that was just under the limit. `dead_letter_one` fails (MsgSizeTooLarge,
/// at once, locally) and `run_record` retries it forever: the record is
/// never dead-lettered, never committed, and its partition's commit point
/// is stuck behind it (the record after it runs but is never committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_record_near_the_size_limit_is_dead_lettered_and_committed() {
    let topic = name("rv-big");
    let group = name("rv-big-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&format!("{topic}.dead"), 1);
    // The largest value (no key, no header) that a producer with
    // librdkafka's default message.max.bytes sends (refused locally above).
    let p = producer();
    let mut size = 1_000_000usize;
    let big_size = loop {
        assert!(size > 990_000, "no size near the limit was accepted");
        let big = vec![b'x'; size];
        let r: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).partition(0).payload(&big);
        match p.send(r, Timeout::After(Duration::from_secs(30))).await {
            Ok(_) => break size,
            Err(_) => size -= 10,
        }
    };
    let end = send(&topic, 0, Some(b"after"), &[], Some(b"2")).await + 1;
    let consumer = KafkaConsumer::new(
        &config(&group),
        &[&topic],
        Idempotency::new(MemoryStore::new()),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .commit_interval(Duration::ZERO)
    .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let handler =
        |record: KafkaRecord| async move { Ok::<_, RecordError>(record.key_text()?.to_owned()) };
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(handler, async {
            wait_for(Duration::from_secs(25), || async {
                committed(&group, &topic, 1).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "the partition never committed past the poison record of {big_size} bytes: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
}

/// A dead letter re-driven to its topic (the usual repair: fix, then
/// produce the dead letters back) fails again. Its new dead letter copies
/// the record's headers first, then appends the new `idem.*` headers: the
/// first `idem.reason` (what `KafkaRecord::header` and most readers take)
/// is the OLD reason, the new one comes second (lib.rs,
/// `dead_letter_one`: record headers inserted before the idem.* ones, the
/// old idem.* ones not dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_dead_letter_gets_its_new_reason_first() {
    let topic = name("rv-redrive");
    let dead = format!("{topic}.dead");
    let group = name("rv-redrive-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    // As an earlier dead letter carried it back: old idem.* headers.
    let end = send(
        &topic,
        0,
        None,
        &[
            ("idem.topic", Some(b"old-topic".as_slice())),
            ("idem.offset", Some(b"41".as_slice())),
            ("idem.deliveries", Some(b"10".as_slice())),
            (
                "idem.reason",
                Some(b"handler failed: ledger timeout (failed 10 times)".as_slice()),
            ),
        ],
        Some(b"{\"amount\":5}"),
    )
    .await
        + 1;
    let consumer = KafkaConsumer::new(
        &config(&group),
        &[&topic],
        Idempotency::new(MemoryStore::new()),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .commit_interval(Duration::ZERO);
    let handler =
        |record: KafkaRecord| async move { Ok::<_, RecordError>(record.key_text()?.to_owned()) };
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(handler, async {
            wait_for(Duration::from_secs(25), || async {
                committed(&group, &topic, 1).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    let letters = read_topic(&dead, 1, Duration::from_secs(20)).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let headers = &letters[0].2;
    let as_record = KafkaRecord {
        headers: headers.clone(),
        ..KafkaRecord::default()
    };
    let reasons: Vec<String> = headers
        .iter()
        .filter(|(k, _)| k == "idem.reason")
        .map(|(_, v)| String::from_utf8_lossy(v.as_deref().unwrap_or_default()).into_owned())
        .collect();
    let first = as_record
        .header_text("idem.reason")
        .unwrap_or("(none)")
        .to_owned();
    assert!(
        first.contains("no key"),
        "the dead letter's idem.reason (first header) is {first:?}, not why it was dead-lettered now; all: {reasons:?}"
    );
    assert_eq!(
        as_record.header_text("idem.topic").ok(),
        Some(topic.as_str()),
        "idem.topic: {headers:?}"
    );
}

/// The dead-letter topic does not exist (a typo, or a broker that does not
/// create topics). `call_timeout` says "How long producing a dead letter
/// may take before it is tried again (default 10 s)", but it is passed as
/// FutureProducer::send's *queue* timeout: the delivery report waits for
/// librdkafka's `message.timeout.ms` (300 s). A shutdown then waits for
/// that produce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_does_not_hold_shutdown_past_call_timeout() {
    let topic = name("rv-nodlq");
    let group = name("rv-nodlq-g");
    support::kafka::create_topic(&topic, 1);
    send(&topic, 0, None, &[], Some(b"no key")).await;
    let consumer = KafkaConsumer::new(
        &config(&group),
        &[&topic],
        Idempotency::new(MemoryStore::new()),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .dead_letter(name("rv-missing-dlq"))
    .call_timeout(Duration::from_secs(2))
    .retry_backoff(Duration::from_millis(20), Duration::from_millis(200));
    let handler =
        |record: KafkaRecord| async move { Ok::<_, RecordError>(record.key_text()?.to_owned()) };
    let stop_at = Arc::new(Mutex::new(None::<Instant>));
    let shutdown = {
        let stop_at = stop_at.clone();
        let consumer = &consumer;
        async move {
            wait_for(Duration::from_secs(30), || async {
                consumer.stats().received >= 1
            })
            .await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            *stop_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
    };
    let out = tokio::time::timeout(Duration::from_secs(60), consumer.run(handler, shutdown)).await;
    let stopped = *stop_at.lock().unwrap_or_else(|p| p.into_inner());
    let took = stopped.map(|s| s.elapsed());
    assert!(
        out.is_ok() && took.is_some_and(|t| t < Duration::from_secs(15)),
        "shutdown with a dead letter to a missing topic: returned {}, {took:?} after the shutdown (call_timeout 2 s); stats {:?}",
        out.is_ok(),
        consumer.stats()
    );
}

/// Headers, value, and whether the record is usable.
type OddCase<'a> = (Vec<(&'a str, Option<&'a [u8]>)>, Option<&'a [u8]>, bool);

/// Input a producer can send, keyed by a header: no key header, a null
/// value, a repeated key header, a non-UTF-8 header value, a non-ASCII
/// header name, an empty key, an empty value, a
/// tombstone, an over-long key (513 bytes), a control character in the
/// key. No panic, every usable record runs once, every unusable one is
/// dead-lettered with a reason, everything is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_input_never_panics_and_every_record_settles() {
    let topic = name("rv-odd");
    let dead = format!("{topic}.dead");
    let group = name("rv-odd-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    let long = "k".repeat(513);
    let cases: Vec<OddCase<'_>> = vec![
        (vec![], Some(b"1"), false),             // no key header
        (vec![("id", None)], Some(b"2"), false), // null value
        (
            vec![("id", Some(b"a")), ("id", Some(b"b"))],
            Some(b"3"),
            true,
        ), // repeated: "a"
        (vec![("id", Some(b"\xff\xfe"))], Some(b"4"), false), // not UTF-8
        (
            vec![("\u{ff}\u{2028}", Some(b"x")), ("id", Some(b"c"))],
            Some(b"5"),
            true,
        ), // odd name
        (vec![("id", Some(b""))], Some(b"6"), false), // empty key
        (vec![("id", Some(b"d"))], None, true),  // tombstone
        (vec![("id", Some(long.as_bytes()))], Some(b"8"), false), // too long
        (vec![("id", Some(b"e\n"))], Some(b"9"), false), // control char
        (vec![("id", Some(b"f"))], Some(b""), true), // empty value
    ];
    let mut end = 0;
    let mut expected_ok = 0;
    let mut expected_dead = 0;
    for (headers, payload, ok) in &cases {
        end = send(&topic, 0, Some(b"rk"), headers, *payload).await + 1;
        if *ok {
            expected_ok += 1;
        } else {
            expected_dead += 1;
        }
    }
    let effects: Effects = Arc::default();
    let consumer = KafkaConsumer::new(
        &config(&group),
        &[&topic],
        Idempotency::new(MemoryStore::new()),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .key_header("id")
    .commit_interval(Duration::ZERO);
    let handler = {
        let effects = effects.clone();
        move |record: KafkaRecord| {
            let effects = effects.clone();
            async move {
                let id = record.header_text("id")?.to_owned();
                effect(&effects, &id);
                Ok::<_, RecordError>(id)
            }
        }
    };
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(handler, async {
            wait_for(Duration::from_secs(30), || async {
                committed(&group, &topic, 1).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        committed(&group, &topic, 1).await.get(&0),
        Some(&end),
        "{stats:?}"
    );
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(effects.len(), expected_ok, "{effects:?} {stats:?}");
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    assert_eq!(stats.dead_lettered, expected_dead as u64, "{stats:?}");
    let letters = read_topic(&dead, expected_dead, Duration::from_secs(20)).await;
    assert_eq!(letters.len(), expected_dead, "{letters:?}");
    for (_, payload, headers) in &letters {
        let reasons = headers.iter().filter(|(k, _)| k == "idem.reason").count();
        assert_eq!(reasons, 1, "{payload:?}: {headers:?}");
    }
}

/// Two partitions hold records of the same keys; a slow handler (2 s) and
/// a second member joining with a short revoke_wait on the first (a
/// revoke while records run, and records of one key waiting in the chain
/// behind them). Every key's effect once; the committed offsets never
/// pass a running record; everything committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_with_one_key_in_two_partitions_and_a_short_revoke_wait() {
    let topic = name("rv-two");
    let group = name("rv-two-g");
    support::kafka::create_topic(&topic, 2);
    let keys = 40u32;
    let mut ends = BTreeMap::new();
    for k in 0..keys {
        for p in 0..2 {
            let o = send(
                &topic,
                p,
                Some(format!("k-{k}").as_bytes()),
                &[],
                Some(format!("{k}").as_bytes()),
            )
            .await;
            ends.insert(p, o + 1);
        }
    }
    let store: Arc<MemoryStore> = Arc::new(MemoryStore::new());
    let effects: Effects = Arc::default();
    let running: Arc<Mutex<HashMap<(i32, i64), Instant>>> = Arc::default();
    let handler = {
        let (effects, running) = (effects.clone(), running.clone());
        move |record: KafkaRecord| {
            let (effects, running) = (effects.clone(), running.clone());
            async move {
                let at = (record.partition, record.offset);
                running
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(at, Instant::now());
                let ms = if record.offset % 7 == 3 {
                    2000
                } else {
                    fastrand::u64(5..80)
                };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let id = record.key_text()?.to_owned();
                effect(&effects, &id);
                running
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&at);
                Ok::<_, RecordError>(id)
            }
        }
    };
    let member = |wait: Duration| {
        KafkaConsumer::new(
            &config(&group),
            &[&topic],
            Idempotency::from_arc(store.clone()).lease(Duration::from_secs(3)),
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .partition_concurrency(4)
        .commit_interval(Duration::ZERO)
        .revoke_wait(wait)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(300))
    };
    let done = Arc::new(AtomicBool::new(false));
    let stop = || {
        let done = done.clone();
        async move {
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let watch = {
        let (running, violations, done) = (running.clone(), violations.clone(), done.clone());
        let (group, topic) = (group.clone(), topic.clone());
        async move {
            while !done.load(Ordering::SeqCst) {
                let before = Instant::now();
                let offsets = committed(&group, &topic, 2).await;
                let running = running.lock().unwrap_or_else(|p| p.into_inner()).clone();
                for ((p, o), started) in running {
                    if started < before && offsets.get(&p).is_some_and(|c| *c > o) {
                        violations
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(format!(
                                "p{p}: committed {:?} while {o} runs",
                                offsets.get(&p)
                            ));
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let a = member(Duration::from_millis(50));
    let started = Arc::new(AtomicU32::new(0));
    let control = async {
        wait_for(Duration::from_secs(30), || async {
            !running.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        started.store(1, Ordering::SeqCst);
        let b = member(Duration::from_secs(10));
        let b_run = b.run(handler.clone(), stop());
        let wait = async {
            let ok = wait_for(Duration::from_secs(60), || async {
                effects.lock().unwrap_or_else(|p| p.into_inner()).len() == keys as usize && {
                    let c = committed(&group, &topic, 2).await;
                    ends.iter().all(|(p, e)| c.get(p) == Some(e))
                }
            })
            .await;
            done.store(true, Ordering::SeqCst);
            ok
        };
        let (b_stats, ok) = tokio::join!(b_run, wait);
        (b_stats.unwrap_or_else(|e| panic!("{e}")), ok)
    };
    let (a_stats, (b_stats, ok), ()) = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::join!(a.run(handler.clone(), stop()), control, watch)
    })
    .await
    .unwrap_or_else(|_| panic!("did not end"));
    let a_stats = a_stats.unwrap_or_else(|e| panic!("{e}"));
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        ok,
        "not everything done/committed: {effects:?} {a_stats:?} {b_stats:?}"
    );
    for k in 0..keys {
        assert_eq!(
            effects.get(&format!("k-{k}")),
            Some(&1),
            "k-{k}: {a_stats:?} {b_stats:?}"
        );
    }
    let v = violations.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(v.is_empty(), "{v:#?}");
    assert!(a_stats.revoked > 0, "{a_stats:?}");
}

/// max_deliveries(1) and a handler that panics: run once, dead-lettered
/// with the panic in the reason, committed; the record after it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_deliveries_one_with_a_panicking_handler() {
    let topic = name("rv-panic");
    let dead = format!("{topic}.dead");
    let group = name("rv-panic-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    send(&topic, 0, Some(b"boom"), &[], Some(b"1")).await;
    let end = send(&topic, 0, Some(b"fine"), &[], Some(b"2")).await + 1;
    let calls: Effects = Arc::default();
    let consumer = KafkaConsumer::new(
        &config(&group),
        &[&topic],
        Idempotency::new(MemoryStore::new()),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .max_deliveries(1)
    .commit_interval(Duration::ZERO);
    let handler = {
        let calls = calls.clone();
        move |record: KafkaRecord| {
            let calls = calls.clone();
            async move {
                let id = record.key_text()?.to_owned();
                effect(&calls, &id);
                if id == "boom" {
                    panic!("handler exploded on {id}");
                }
                Ok::<_, RecordError>(id)
            }
        }
    };
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(handler, async {
            wait_for(Duration::from_secs(30), || async {
                committed(&group, &topic, 1).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    let calls = calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(calls.get("boom"), Some(&1), "{calls:?} {stats:?}");
    assert_eq!(calls.get("fine"), Some(&1), "{calls:?} {stats:?}");
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    let letters = read_topic(&dead, 1, Duration::from_secs(20)).await;
    let reason = letters
        .first()
        .and_then(|l| l.2.iter().find(|(k, _)| k == "idem.reason"))
        .and_then(|(_, v)| v.clone())
        .map(|v| String::from_utf8_lossy(&v).into_owned())
        .unwrap_or_default();
    assert!(reason.contains("exploded"), "{reason:?}");
}

/// Two records with the same key, the first a tombstone (no value), the
/// second with a value. Two records of one key with different values are
/// a payload mismatch (dead-lettered, DESIGN 2 / 5b); but a tombstone has
/// no fingerprint (record.rs, `fingerprint_of`: "a tombstone has none, so
/// no payload check"), so the record with a value is answered with the
/// tombstone's recorded result: replayed and committed, its handler never
/// run and no dead letter (a record lost, another record's result).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_after_a_tombstone_of_its_key_is_not_replayed_the_tombstones_result() {
    let topic = name("rv-tomb");
    let dead = format!("{topic}.dead");
    let group = name("rv-tomb-g");
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    send(
        &topic,
        0,
        Some(b"acct-1"),
        &[("message-id", Some(b"m-1".as_slice()))],
        None,
    )
    .await;
    let end = send(
        &topic,
        0,
        Some(b"acct-1"),
        &[("message-id", Some(b"m-1".as_slice()))],
        Some(b"{\"credit\":500}"),
    )
    .await
        + 1;
    let ran: Arc<Mutex<Vec<Option<Vec<u8>>>>> = Arc::default();
    let consumer = KafkaConsumer::new(
        &config(&group),
        &[&topic],
        Idempotency::new(MemoryStore::new()),
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .key_header("message-id")
    .commit_interval(Duration::ZERO);
    let handler = {
        let ran = ran.clone();
        move |record: KafkaRecord| {
            let ran = ran.clone();
            async move {
                ran.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(record.payload.clone());
                Ok::<_, RecordError>(if record.payload.is_none() {
                    "deleted".to_owned()
                } else {
                    "credited".to_owned()
                })
            }
        }
    };
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        consumer.run(handler, async {
            wait_for(Duration::from_secs(25), || async {
                committed(&group, &topic, 1).await.get(&0) == Some(&end)
            })
            .await;
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("run did not return"))
    .unwrap_or_else(|e| panic!("{e}"));
    let ran = ran.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert!(
        ran.len() == 2 || stats.dead_lettered == 1,
        "the record with a value neither ran nor was dead-lettered as a mismatch: runs {ran:?}, {stats:?}"
    );
}
