//! The SQS consumer on moto's server mode (`support::moto`: the server
//! `IDEM_MOTO_URL` names, or one started here): every effect once and
//! every message deleted, whatever happens to the consumers:
//!
//! - `delivery`: duplicates, a consumer killed mid-batch, a lost reply to
//!   a delete;
//! - `visibility`: the heartbeat keeping a long handler's message
//!   invisible, and failing;
//! - `poison`: dead letters with their reason, the queue's redrive policy,
//!   extreme messages;
//! - `unrecorded`: a store outage after the handler ran (`Unrecorded`),
//!   the result finished later, duplicates meanwhile;
//! - `config`: configurations `run` refuses, a missing queue;
//! - `in_transaction`: the in-transaction form on PostgreSQL: a consumer
//!   killed between its INSERT and the commit, panics, 64 copies on a
//!   pool of 8;
//! - `fifo`: a FIFO queue's message groups, run in order and stopped at a
//!   failure.
//!
//! `cargo test --all-features --test receivers sqs::` runs them;
//! `RUST_LOG=idem_sqs=debug` shows what the consumers did.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit::sqs::aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use idemkit::sqs::aws_sdk_sqs::{self, Client};
use idemkit::sqs::{ConsumerStats, SqsConsumer, SqsConsumerError, SqsMessage};
use idemkit::{IdempotencyStore, MemoryStore};
use tokio::sync::oneshot;

mod config;
mod delivery;
mod fifo;
#[cfg(feature = "postgres")]
mod in_transaction;
mod poison;
mod unrecorded;
mod visibility;

/// A client of the SQS at `url`.
fn client_at(url: &str) -> Client {
    support::logs::init();
    idemkit::sqs::local_client(url)
}

/// A client of the shared moto server.
fn client() -> Client {
    client_at(support::moto::shared_url())
}

/// The address of the shared moto server (for a proxy in front of it).
fn moto_addr() -> SocketAddr {
    addr_of(support::moto::shared_url())
}

/// The address of the moto server at `url`.
fn addr_of(url: &str) -> SocketAddr {
    let hostport = url.trim_start_matches("http://").trim_end_matches('/');
    hostport.parse().unwrap()
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
    let mut name = format!("{prefix}-{:016x}", fastrand::u64(..));
    if attributes
        .iter()
        .any(|(k, _)| *k == QueueAttributeName::FifoQueue)
    {
        name.push_str(".fifo");
    }
    // CreateQueue with the same name and attributes returns the same
    // queue, so a request whose connection was closed under it (a busy
    // moto drops kept-alive connections) is sent again.
    let mut attempt = 1;
    loop {
        let mut request = client.create_queue().queue_name(&name);
        for (k, v) in attributes {
            request = request.attributes(k.clone(), v);
        }
        match request.send().await {
            Ok(out) => return out.queue_url().unwrap().to_owned(),
            Err(aws_sdk_sqs::error::SdkError::DispatchFailure(_)) if attempt < 3 => attempt += 1,
            Err(e) => panic!(
                "moto did not create queue {name}: {}",
                aws_sdk_sqs::error::DisplayErrorContext(&e)
            ),
        }
    }
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
        out.extend(receive_dead(client, url).await);
    }
    out
}

/// Every message that reaches a dead-letter queue within `window` (each
/// deleted): none, when nothing more is to come.
async fn take_dead_within(client: &Client, url: &str, window: Duration) -> Vec<Message> {
    let mut out = Vec::new();
    let start = Instant::now();
    while start.elapsed() < window {
        out.extend(receive_dead(client, url).await);
    }
    out
}

/// One receive (waiting up to 1 s) of a dead-letter queue; what it got is
/// deleted.
async fn receive_dead(client: &Client, url: &str) -> Vec<Message> {
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
    let messages = got.messages.unwrap_or_default();
    for m in &messages {
        client
            .delete_message()
            .queue_url(url)
            .receipt_handle(m.receipt_handle().unwrap())
            .send()
            .await
            .unwrap();
    }
    messages
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
    task: tokio::task::JoinHandle<Result<ConsumerStats, SqsConsumerError>>,
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

    /// Shuts the consumer down; what its `run` returned, within 30 s.
    async fn stop(self) -> ConsumerStats {
        self.stop_within(Duration::from_secs(30)).await
    }

    /// Shuts the consumer down; what its `run` returned, within `limit`.
    async fn stop_within(self, limit: Duration) -> ConsumerStats {
        let _ = self.stop.send(());
        tokio::time::timeout(limit, self.task)
            .await
            .unwrap_or_else(|_| panic!("the consumer did not stop within {limit:?}"))
            .unwrap()
            .unwrap()
    }
}
