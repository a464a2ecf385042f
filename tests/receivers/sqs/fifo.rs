//! FIFO queues: the messages of one message group that arrive in one
//! receive run one after another, in order, and a message that fails stops
//! its group until it succeeds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemkit::sqs::aws_sdk_sqs::types::QueueAttributeName;
use idemkit::sqs::aws_sdk_sqs::Client;
use idemkit::sqs::{SqsConsumer, SqsMessage};
use idemkit::{Idempotency, MemoryStore};

use super::{client, create_queue_with, queue_empty, text, wait_until, BoxError, Running};

/// A FIFO queue of its own (content-based deduplication off: each message
/// carries its own deduplication ID).
async fn fifo_queue(client: &Client) -> String {
    create_queue_with(
        client,
        "idem-fifo",
        &[(QueueAttributeName::FifoQueue, "true".to_owned())],
    )
    .await
}

/// Sends message `n` of `group`, one at a time (the order SQS keeps).
async fn send_in_group(client: &Client, url: &str, group: &str, n: u32) {
    client
        .send_message()
        .queue_url(url)
        .message_body(format!("{{\"n\":{n}}}"))
        .message_group_id(group)
        .message_deduplication_id(format!("{group}-{n}"))
        .message_attributes("key", text(&format!("{group}-{n}")))
        .message_attributes("group", text(group))
        .message_attributes("n", text(&n.to_string()))
        .send()
        .await
        .unwrap();
}

/// What the handlers saw: per group, the messages started and finished in
/// order, and the most of a group that ran at once.
#[derive(Default)]
struct Seen {
    started: HashMap<String, Vec<u32>>,
    finished: HashMap<String, Vec<u32>>,
    running: HashMap<String, usize>,
    most_at_once: HashMap<String, usize>,
    failures: Vec<(String, u32)>,
}

/// Whether each of `groups` finished its five messages and the queue
/// shows none (moto's depth alone once read (0, 0) while four messages of
/// a group were still to run, 2026-11-27).
async fn run_and_empty(
    seen: &Arc<Mutex<Seen>>,
    groups: &[&str],
    client: &Client,
    url: &str,
) -> bool {
    let finished = {
        let seen = seen.lock().unwrap();
        groups
            .iter()
            .all(|g| seen.finished.get(*g).is_some_and(|f| f.len() >= 5))
    };
    finished && queue_empty(client, url).await
}

/// A consumer that takes up to 10 messages a receive (every group's
/// messages in one receive, when SQS gives them).
fn consumer(client: &Client, url: &str) -> SqsConsumer<MemoryStore> {
    SqsConsumer::new(
        client.clone(),
        url,
        Idempotency::new(MemoryStore::new()).lease(Duration::from_secs(10)),
    )
    .key_attribute("key")
    .batch(10)
    .concurrency(10)
    .visibility_timeout(Duration::from_secs(5))
    .wait_time(Duration::from_secs(1))
    .retry_visibility(Duration::ZERO)
}

/// A handler that records what it saw; the earlier messages of a group
/// take longer, so messages run at once would finish out of order. It
/// fails the first run of each `(group, n)` in `fail_once`.
fn handler(
    seen: Arc<Mutex<Seen>>,
    fail_once: Vec<(&'static str, u32)>,
) -> impl Fn(
    SqsMessage,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<usize, BoxError>> + Send>>
       + Send
       + Sync
       + 'static {
    move |m: SqsMessage| {
        let seen = seen.clone();
        let fail_once = fail_once.clone();
        Box::pin(async move {
            let group = m.attribute_text("group").unwrap().to_owned();
            let n: u32 = m.attribute_text("n").unwrap().parse().unwrap();
            {
                let mut s = seen.lock().unwrap();
                s.started.entry(group.clone()).or_default().push(n);
                let running = {
                    let r = s.running.entry(group.clone()).or_default();
                    *r += 1;
                    *r
                };
                let most = s.most_at_once.entry(group.clone()).or_default();
                *most = (*most).max(running);
            }
            tokio::time::sleep(Duration::from_millis(u64::from(5 - n.min(5)) * 40)).await;
            let mut s = seen.lock().unwrap();
            *s.running.entry(group.clone()).or_default() -= 1;
            let key = (group.clone(), n);
            if fail_once.iter().any(|(g, f)| *g == group && *f == n) && !s.failures.contains(&key) {
                s.failures.push(key);
                return Err::<usize, BoxError>("the first run of this one fails".into());
            }
            s.finished.entry(group).or_default().push(n);
            Ok(m.body.len())
        })
    }
}

/// Two groups of five messages, sent in order, consumed with room for all
/// ten in one receive: each group's messages run one at a time, in the
/// order sent; the two groups run side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_group_runs_in_order_one_at_a_time() {
    let client = client();
    let url = fifo_queue(&client).await;
    for n in 0..5 {
        for group in ["a", "b"] {
            send_in_group(&client, &url, group, n).await;
        }
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let running = Running::start(consumer(&client, &url), handler(seen.clone(), Vec::new()));
    wait_until(
        "every message run and deleted",
        Duration::from_secs(60),
        || run_and_empty(&seen, &["a", "b"], &client, &url),
    )
    .await;
    let stats = running.stop().await;
    let seen = seen.lock().unwrap();
    for group in ["a", "b"] {
        assert_eq!(
            seen.finished.get(group),
            Some(&vec![0, 1, 2, 3, 4]),
            "group {group} finished out of order ({stats:?})"
        );
        assert_eq!(
            seen.most_at_once.get(group),
            Some(&1),
            "group {group} ran several messages at once"
        );
    }
}

/// Message 1 of a group fails its first run: the group stops there (2, 3
/// and 4 do not run before it), and once it succeeds the rest follow in
/// order. Every message runs to completion once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_message_stops_its_group_until_it_succeeds() {
    let client = client();
    let url = fifo_queue(&client).await;
    for n in 0..5 {
        send_in_group(&client, &url, "a", n).await;
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let running = Running::start(
        consumer(&client, &url),
        handler(seen.clone(), vec![("a", 1)]),
    );
    wait_until(
        "every message run and deleted",
        Duration::from_secs(60),
        || run_and_empty(&seen, &["a"], &client, &url),
    )
    .await;
    let stats = running.stop().await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.failures, vec![("a".to_owned(), 1)], "{stats:?}");
    assert_eq!(
        seen.started.get("a"),
        Some(&vec![0, 1, 1, 2, 3, 4]),
        "a later message of the group ran before the failed one succeeded"
    );
    assert_eq!(seen.finished.get("a"), Some(&vec![0, 1, 2, 3, 4]));
}
