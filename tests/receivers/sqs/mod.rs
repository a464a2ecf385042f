//! The SQS consumer on moto's server mode (`IDEM_MOTO_URL`): duplicates,
//! a consumer killed mid-batch, poison and mismatches dead-lettered with
//! their reason, the visibility heartbeat, and extreme messages.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idem::sqs::aws_sdk_sqs::primitives::Blob;
use idem::sqs::aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use idem::sqs::aws_sdk_sqs::{self, Client};
use idem::sqs::{ConsumerStats, SqsConsumer, SqsConsumerError, SqsMessage};
use idem::{Idempotency, IdempotencyKey, IdempotencyStore, MemoryStore, RecordState};
use tokio::sync::oneshot;

use crate::support;

fn moto_url() -> String {
    std::env::var("IDEM_MOTO_URL").unwrap_or_else(|_| {
        panic!(
            "IDEM_MOTO_URL is not set: run the tests with scripts/test or scripts/with-servers \
             (they start moto), or start moto's server yourself \
             (`pip install 'moto[server]'`, then `moto_server -H 127.0.0.1 -p PORT`) and export \
             IDEM_MOTO_URL=http://127.0.0.1:PORT"
        )
    })
}

fn client() -> Client {
    // RUST_LOG=idem_sqs=debug shows what the consumers did.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(moto_url())
        .credentials_provider(Credentials::new("test", "test", None, None, "static"))
        .build();
    Client::from_conf(config)
}

/// A queue of its own for each test, with a random name.
async fn create_queue(client: &Client, prefix: &str) -> String {
    create_queue_with(client, prefix, &[]).await
}

async fn create_queue_with(
    client: &Client,
    prefix: &str,
    attributes: &[(QueueAttributeName, String)],
) -> String {
    let name = format!("{prefix}-{:016x}", fastrand::u64(..));
    let mut request = client.create_queue().queue_name(&name);
    for (k, v) in attributes {
        request = request.attributes(k.clone(), v);
    }
    let out = request.send().await.unwrap_or_else(|e| {
        panic!(
            "moto at {} did not create a queue: {}",
            moto_url(),
            aws_sdk_sqs::error::DisplayErrorContext(&e)
        )
    });
    out.queue_url().unwrap().to_owned()
}

fn text(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .unwrap()
}

/// A message to send: its body and attributes.
type Outgoing = (String, Vec<(String, MessageAttributeValue)>);

/// Sends these messages (body, attributes), 10 a call, 8 calls at once;
/// returns their message IDs in order.
async fn send_all(client: &Client, url: &str, messages: Vec<Outgoing>) -> Vec<String> {
    let chunks: Vec<Vec<Outgoing>> = messages.chunks(10).map(<[_]>::to_vec).collect();
    let mut ids = Vec::new();
    for group in chunks.chunks(8) {
        let calls = group.iter().map(|chunk| {
            let entries: Vec<SendMessageBatchRequestEntry> = chunk
                .iter()
                .enumerate()
                .map(|(i, (body, attributes))| {
                    let mut entry = SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(body);
                    for (k, v) in attributes {
                        entry = entry.message_attributes(k, v.clone());
                    }
                    entry.build().unwrap()
                })
                .collect();
            client
                .send_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
        });
        for out in futures::future::join_all(calls).await {
            let out = out.unwrap();
            assert!(out.failed.is_empty(), "{:?}", out.failed);
            let mut sent = out.successful;
            sent.sort_by_key(|e| e.id.parse::<usize>().unwrap());
            ids.extend(sent.into_iter().map(|e| e.message_id));
        }
    }
    ids
}

async fn send(
    client: &Client,
    url: &str,
    body: &str,
    attributes: &[(&str, MessageAttributeValue)],
) -> String {
    let mut request = client.send_message().queue_url(url).message_body(body);
    for (k, v) in attributes {
        request = request.message_attributes(*k, v.clone());
    }
    request
        .send()
        .await
        .unwrap()
        .message_id()
        .unwrap()
        .to_owned()
}

/// (visible, in flight) messages of a queue.
async fn depth(client: &Client, url: &str) -> (u64, u64) {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap();
    let attributes = out.attributes().unwrap();
    let get = |name: QueueAttributeName| -> u64 {
        attributes.get(&name).map_or(0, |v| v.parse().unwrap())
    };
    (
        get(QueueAttributeName::ApproximateNumberOfMessages),
        get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    )
}

/// Polls `condition` every 50 ms until it holds; fails after `limit`.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !condition().await {
        assert!(start.elapsed() < limit, "{what}: not after {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn queue_empty(client: &Client, url: &str) -> bool {
    depth(client, url).await == (0, 0)
}

/// Receives `n` messages of a dead-letter queue (and deletes them).
async fn take_dead(client: &Client, url: &str, n: usize) -> Vec<Message> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{} of {n} dead letters after 60 s: {out:?}",
            out.len()
        );
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await
            .unwrap();
        for m in got.messages.unwrap_or_default() {
            client
                .delete_message()
                .queue_url(url)
                .receipt_handle(m.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
            out.push(m);
        }
    }
    out
}

fn attr<'a>(m: &'a Message, name: &str) -> Option<&'a str> {
    m.message_attributes()?.get(name)?.string_value()
}

/// The dead letter whose `idem.message_id` is `id`.
fn dead_of<'a>(dead: &'a [Message], id: &str) -> &'a Message {
    dead.iter()
        .find(|m| attr(m, "idem.message_id") == Some(id))
        .unwrap_or_else(|| panic!("no dead letter of {id}: {dead:#?}"))
}

type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// The handlers' error: a `MessageError` in it dead-letters at once.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A consumer run in a task of its own, with its shutdown switch.
struct Running<S: IdempotencyStore = MemoryStore> {
    consumer: Arc<SqsConsumer<S>>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<ConsumerStats, idem::sqs::SqsConsumerError>>,
}

impl<S: IdempotencyStore> Running<S> {
    fn start<F, Fut>(consumer: SqsConsumer<S>, handler: F) -> Self
    where
        F: Fn(SqsMessage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<usize, BoxError>> + Send + 'static,
    {
        let consumer = Arc::new(consumer);
        let (stop, stopped) = oneshot::channel::<()>();
        let c = consumer.clone();
        let task = tokio::spawn(async move {
            c.run(handler, async {
                let _ = stopped.await;
            })
            .await
        });
        Running {
            consumer,
            stop,
            task,
        }
    }

    async fn stop(self) -> ConsumerStats {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the consumer stopped within 30 s")
            .unwrap()
            .unwrap()
    }
}

/// The issue's test: 1,000 messages (700 keys, 200 of them sent twice and
/// 50 three times, shuffled), two consumers sharing one store, one of them
/// killed (its `run` future aborted) while its handlers run. Every key's
/// effect runs once, and every message is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_messages_with_duplicates_two_consumers_one_killed_mid_batch() {
    let started = Instant::now();
    let client = client();
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
        Duration::from_secs(60),
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

    wait_until("the queue empty", Duration::from_secs(180), || {
        queue_empty(&client, &url)
    })
    .await;
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

/// A message whose handler always fails is dead-lettered after
/// `max_deliveries` receives, with the reason attributes and its own
/// attributes (within SQS's 10); a payload mismatch (the key of an earlier
/// message with another body) is dead-lettered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_dead_lettered_after_max_deliveries_and_a_mismatch_at_once() {
    let client = client();
    let url = create_queue(&client, "idem-poison").await;
    let dlq = create_queue(&client, "idem-poison-dead").await;
    let runs: Effects = Arc::default();
    let r = runs.clone();
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .max_deliveries(3)
        .visibility_timeout(Duration::from_secs(2))
        .retry_visibility(Duration::ZERO)
        .wait_time(Duration::from_secs(1))
        .dead_letter(&dlq);
    let running = Running::start(consumer, move |m: SqsMessage| {
        let runs = r.clone();
        async move {
            *runs.lock().unwrap().entry(m.body.clone()).or_default() += 1;
            if m.body == "poison" {
                return Err("always fails".into());
            }
            Ok(m.body.len())
        }
    });
    // The poison carries 9 attributes: with our 4, only 5 fit.
    let mut attributes = vec![("key", text("p-1"))];
    let extra: Vec<String> = (1..=8).map(|i| format!("a{i}")).collect();
    attributes.extend(extra.iter().map(|n| (n.as_str(), text("v"))));
    let poison = send(&client, &url, "poison", &attributes).await;
    send(&client, &url, "first", &[("key", text("g-1"))]).await;
    let r = runs.clone();
    wait_until(
        "the first message of g-1 ran",
        Duration::from_secs(30),
        || {
            let done = r.lock().unwrap().get("first") == Some(&1);
            async move { done }
        },
    )
    .await;
    let mismatch = send(&client, &url, "second", &[("key", text("g-1"))]).await;

    let dead = take_dead(&client, &dlq, 2).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;

    let p = dead_of(&dead, &poison);
    assert_eq!(p.body(), Some("poison"));
    let reason = attr(p, "idem.reason").unwrap();
    assert!(
        reason.contains("always fails") && reason.contains("received 3 times"),
        "{reason}"
    );
    assert_eq!(attr(p, "idem.receive_count"), Some("3"));
    assert_eq!(attr(p, "idem.source_queue"), Some(url.as_str()));
    let kept = p.message_attributes().unwrap();
    assert!(kept.len() <= 10, "{kept:?}");
    assert_eq!(
        attr(p, "key"),
        Some("p-1"),
        "the key attribute is kept first"
    );
    assert!(kept.contains_key("a1") && kept.contains_key("a4") && !kept.contains_key("a5"));
    let dropped = attr(p, "idem.dropped").unwrap();
    assert!(
        dropped.starts_with("4 of") && dropped.contains("a5, a6, a7, a8"),
        "{dropped}"
    );
    assert_eq!(
        runs.lock().unwrap().get("poison"),
        Some(&3),
        "the handler ran max_deliveries times"
    );

    let m = dead_of(&dead, &mismatch);
    assert_eq!(m.body(), Some("second"));
    let reason = attr(m, "idem.reason").unwrap();
    assert!(reason.contains("different payload"), "{reason}");
    assert_eq!(
        attr(m, "idem.receive_count"),
        Some("1"),
        "dead-lettered at once"
    );
    assert_eq!(attr(m, "key"), Some("g-1"));
    assert_eq!(
        runs.lock().unwrap().get("second"),
        None,
        "a mismatch never runs"
    );

    assert_eq!(
        (stats.dead_lettered, stats.poison, stats.executed),
        (2, 2, 1),
        "{stats:?}"
    );
    assert_eq!(
        stats.left_for_redelivery, 2,
        "the poison's first two failures: {stats:?}"
    );
}

/// Without a dead-letter queue, poison is left to the queue's redrive
/// policy: SQS (here moto) moves it after `maxReceiveCount` receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_a_dead_letter_queue_poison_goes_by_the_redrive_policy() {
    let client = client();
    let dlq = create_queue(&client, "idem-redrive-dead").await;
    let arn = client
        .get_queue_attributes()
        .queue_url(&dlq)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes()
        .unwrap()
        .get(&QueueAttributeName::QueueArn)
        .unwrap()
        .clone();
    let policy = format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"2"}}"#);
    let url = create_queue_with(
        &client,
        "idem-redrive",
        &[(QueueAttributeName::RedrivePolicy, policy)],
    )
    .await;
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .max_deliveries(5)
        .visibility_timeout(Duration::from_secs(2))
        .retry_visibility(Duration::ZERO)
        .wait_time(Duration::from_secs(1));
    let running = Running::start(consumer, |m: SqsMessage| async move {
        if m.body == "poison" {
            return Err("always fails".into());
        }
        Ok(m.body.len())
    });
    let poison = send(&client, &url, "poison", &[("key", text("p-1"))]).await;
    let no_key = send(&client, &url, "no key", &[]).await;
    let dead = take_dead(&client, &dlq, 2).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    let mut ids: Vec<&str> = dead.iter().filter_map(Message::message_id).collect();
    ids.sort_unstable();
    let mut want = vec![poison.as_str(), no_key.as_str()];
    want.sort_unstable();
    assert_eq!(ids, want, "SQS moved both (a redrive keeps the message ID)");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
    assert_eq!(
        stats.poison, 2,
        "the message without a key, on each of its 2 receives: {stats:?}"
    );
}

/// A handler that runs longer than the visibility timeout: with the
/// heartbeat, the message is not handed to the second consumer meanwhile
/// (one receive in all, no "in progress"); without it (the control), it
/// is, and only idem keeps the effect single.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn visibility_heartbeat_keeps_a_long_handler_from_the_second_consumer() {
    async fn one(heartbeat: bool) -> (u32, ConsumerStats, ConsumerStats) {
        let client = client();
        let url = create_queue(&client, "idem-heartbeat").await;
        let idem = Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(30));
        let runs = Arc::new(AtomicUsize::new(0));
        let start = |idem: Idempotency<MemoryStore>| {
            let consumer = SqsConsumer::new(client.clone(), &url, idem)
                .key_attribute("key")
                .visibility_timeout(Duration::from_secs(2))
                .retry_visibility(Duration::from_secs(1))
                .wait_time(Duration::from_secs(1))
                .heartbeat(heartbeat);
            let runs = runs.clone();
            Running::start(consumer, move |m: SqsMessage| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    // Three and a half visibility timeouts.
                    tokio::time::sleep(Duration::from_secs(7)).await;
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
    let ((runs, a, b), (control_runs, ca, cb)) = tokio::join!(one(true), one(false));
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

/// Extremes: an empty body (moto accepts it; SQS does not), a key
/// attribute of 513 bytes, a binary key attribute, a message without the
/// key attribute, a 256 KiB body (sent twice: replayed), a body the
/// handler refuses (a `MessageError`): each gets its typed outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn extremes_get_typed_outcomes() {
    let client = client();
    let url = create_queue(&client, "idem-extremes").await;
    let dlq = create_queue(&client, "idem-extremes-dead").await;
    let runs: Effects = Arc::default();
    let r = runs.clone();
    let consumer = SqsConsumer::new(client.clone(), &url, Idempotency::new(MemoryStore::new()))
        .key_attribute("key")
        .visibility_timeout(Duration::from_secs(5))
        .retry_visibility(Duration::ZERO)
        .wait_time(Duration::from_secs(1))
        .dead_letter(&dlq);
    let running = Running::start(consumer, move |m: SqsMessage| {
        let runs = r.clone();
        async move {
            *runs
                .lock()
                .unwrap()
                .entry(m.attribute_text("key").unwrap_or("?").to_owned())
                .or_default() += 1;
            if m.attribute("parse").is_some() {
                let _: serde_json::Value = m.json()?;
            }
            Ok(m.body.len())
        }
    });
    let big = "b".repeat(256 * 1024);
    let binary = MessageAttributeValue::builder()
        .data_type("Binary")
        .binary_value(Blob::new(b"k-1".to_vec()))
        .build()
        .unwrap();
    send(&client, &url, "", &[("key", text("empty-1"))]).await;
    let long_key = send(
        &client,
        &url,
        "long key",
        &[("key", text(&"k".repeat(513)))],
    )
    .await;
    let binary_key = send(&client, &url, "binary key", &[("key", binary)]).await;
    let no_key = send(&client, &url, "no key", &[]).await;
    send(&client, &url, &big, &[("key", text("big-1"))]).await;
    send(&client, &url, &big, &[("key", text("big-1"))]).await;
    let bad_json = send(
        &client,
        &url,
        "{not json",
        &[("key", text("json-1")), ("parse", text("1"))],
    )
    .await;

    let dead = take_dead(&client, &dlq, 4).await;
    wait_until("the queue empty", Duration::from_secs(30), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;

    let reason = |id: &str| attr(dead_of(&dead, id), "idem.reason").unwrap().to_owned();
    let r = reason(&long_key);
    assert!(
        r.contains("no usable key") && r.contains("513 bytes, the limit is 512"),
        "{r}"
    );
    assert_eq!(dead_of(&dead, &long_key).body(), Some("long key"));
    let r = reason(&binary_key);
    assert!(r.contains("binary, not text"), "{r}");
    let r = reason(&no_key);
    assert!(r.contains(r#"no attribute "key""#), "{r}");
    let r = reason(&bad_json);
    assert!(r.contains("does not parse"), "{r}");
    assert_eq!(
        attr(dead_of(&dead, &bad_json), "idem.receive_count"),
        Some("1"),
        "dead-lettered at once"
    );

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get("empty-1"), Some(&1), "{runs:?}");
    assert_eq!(
        runs.get("big-1"),
        Some(&1),
        "the second copy replayed: {runs:?}"
    );
    assert_eq!(runs.get("json-1"), Some(&1), "{runs:?}");
    assert_eq!(
        runs.len(),
        3,
        "no handler ran for the messages without a usable key: {runs:?}"
    );
    assert_eq!(
        (stats.executed, stats.replayed, stats.dead_lettered),
        (2, 1, 4),
        "{stats:?}"
    );
}

/// The store goes away right after the handler's effect, for 3 s, three
/// times the 1 s lease: the executor gives up completing before the lease
/// ends (`IdemError::Unrecorded`). The message is kept invisible (past its
/// 2 s visibility timeout) and never run again; a duplicate sent meanwhile
/// is left for redelivery; once the store is back the completion is
/// written with the first run's lease, the message deleted, and the
/// duplicate replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_past_the_lease_never_runs_the_message_twice() {
    let client = client();
    let url = create_queue(&client, "idem-outage").await;
    let (store, down) = support::flaky::FlakyStore::new(MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let effects = Arc::new(AtomicUsize::new(0));
    let consumer = SqsConsumer::new(client.clone(), &url, idem.clone())
        .key_attribute("key")
        .visibility_timeout(Duration::from_secs(2))
        .retry_visibility(Duration::from_secs(1))
        .wait_time(Duration::from_secs(1));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move |_m: SqsMessage| {
            let (effects, down) = (effects.clone(), down.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The first run: the store goes down now, for 3 s.
                    down.store(true, Ordering::SeqCst);
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(3));
                        down.store(false, Ordering::SeqCst);
                    });
                }
                Ok(7)
            }
        }
    };
    let running = Running::start(consumer, handler);
    send(&client, &url, "charge", &[("key", text("k-1"))]).await;
    let e = effects.clone();
    wait_until("the first run", Duration::from_secs(30), || {
        let ran = e.load(Ordering::SeqCst) > 0;
        async move { ran }
    })
    .await;
    send(&client, &url, "charge", &[("key", text("k-1"))]).await;
    wait_until("the queue empty", Duration::from_secs(60), || {
        queue_empty(&client, &url)
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!((stats.executed, stats.replayed), (1, 1), "{stats:?}");
    assert!(
        stats.left_for_redelivery >= 1,
        "the duplicate waited: {stats:?}"
    );
    assert_eq!(stats.heartbeat_failures, 0, "{stats:?}");
    let scope = idem::sqs::default_scope(idem::sqs::queue_name(&url));
    let key = IdempotencyKey::new(scope, "k-1").unwrap();
    match idem.get(&key).await.unwrap().map(|r| r.state) {
        Some(RecordState::Completed { response, .. }) => assert_eq!(&response[..], b"7"),
        other => panic!("the record: {other:?}"),
    }
}

/// A configuration that cannot work fails `run` before any call; a queue
/// that does not exist fails it with SQS's error, not transient.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconfiguration_and_a_missing_queue_fail_run_with_typed_errors() {
    let client = client();
    let url = create_queue(&client, "idem-config").await;
    let idem = Idempotency::new(MemoryStore::new());
    let handler = |m: SqsMessage| async move { Ok::<_, std::io::Error>(m.body.len()) };
    let run = |consumer: SqsConsumer<MemoryStore>| async move {
        tokio::time::timeout(
            Duration::from_secs(30),
            consumer.run(handler, std::future::pending()),
        )
        .await
        .expect("run returned")
    };
    let same = SqsConsumer::new(client.clone(), &url, idem.clone()).dead_letter(&url);
    assert!(
        matches!(run(same).await, Err(SqsConsumerError::Config(e)) if e.contains("the queue itself"))
    );
    let scope = SqsConsumer::new(client.clone(), &url, idem.clone()).scope("a scope with spaces");
    assert!(matches!(run(scope).await, Err(SqsConsumerError::Config(e)) if e.contains("scope")));
    let empty = SqsConsumer::new(client.clone(), "", idem.clone());
    assert!(matches!(run(empty).await, Err(SqsConsumerError::Config(_))));
    let missing = format!("{}-gone", url);
    let gone =
        SqsConsumer::new(client.clone(), missing, idem.clone()).wait_time(Duration::from_secs(1));
    match run(gone).await {
        Err(SqsConsumerError::Sqs(e)) => {
            assert!(!e.is_transient(), "{e}");
            assert_eq!(e.operation(), "ReceiveMessage");
            let code = e.code().unwrap_or_default();
            assert!(
                code.contains("NonExistentQueue") || code.contains("QueueDoesNotExist"),
                "{e}"
            );
        }
        other => panic!("a missing queue: {other:?}"),
    }
}

mod review17b;
