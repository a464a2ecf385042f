//! The RabbitMQ consumer on a real broker (`support::rabbitmq`: the broker
//! `IDEM_AMQP_URL` names, or one started here) and a real Redis or an
//! in-memory store. Every effect once and every message acked, whatever
//! happens to the consumers and the broker:
//!
//! - `delivery`: duplicates through two consumers, one killed mid-batch; a
//!   broker killed and started again mid-run; a connection lost while a
//!   handler runs (its message redelivered to the other consumer: in
//!   progress, then the replay);
//! - `poison`: dead letters with their reason after `max_deliveries`, on
//!   classic queues (counted in the store) and quorum queues
//!   (`x-delivery-count`), to the queue's own dead-letter exchange, input
//!   no handler can use;
//! - `unrecorded`: a store outage past the lease after the handler ran:
//!   the message kept unacked, its result finished, duplicates replayed;
//! - `config`: configurations `run` refuses, a missing queue;
//! - `in_transaction`: the in-transaction form on PostgreSQL.
//!
//! `cargo test --all-features --test receivers rabbitmq::` runs them;
//! `RUST_LOG=idem_rabbitmq=debug` shows what the consumers did.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use idemkit::rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use idemkit::rabbitmq::lapin::types::{AMQPValue, FieldTable};
use idemkit::rabbitmq::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idemkit::rabbitmq::{ConsumerStats, RabbitConsumer, RabbitConsumerError, RabbitMessage};
use idemkit::redis::RedisStore;
use idemkit::IdempotencyStore;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

mod config;
mod dead_letters;
mod delivery;
#[cfg(feature = "postgres")]
mod in_transaction;
mod poison;
mod redelivery;
mod unrecorded;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A message to publish: its message id (if any), headers and body.
type Outgoing<'a> = (Option<&'a str>, &'a [(&'a str, &'a str)], &'a [u8]);

/// Effects per message id, counted by the handlers.
type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// A queue name of a test's own.
fn name(prefix: &str) -> String {
    format!("{prefix}-{:08x}", fastrand::u32(..))
}

/// A connection to the broker at `url`.
async fn connect_to(url: &str) -> Connection {
    support::logs::init();
    Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// A channel with publisher confirms on the shared broker.
async fn channel() -> Channel {
    channel_on(support::rabbitmq::shared_url()).await
}

async fn channel_on(url: &str) -> Channel {
    let connection = connect_to(url).await;
    let channel = connection
        .create_channel()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The connection lives as long as the channel's users need it.
    std::mem::forget(connection);
    channel
}

/// Declares a durable queue with `arguments` (`x-queue-type`,
/// `x-dead-letter-exchange`, ...).
async fn declare(channel: &Channel, queue: &str, arguments: &[(&str, &str)]) {
    let mut args = FieldTable::default();
    for (k, v) in arguments {
        args.insert((*k).into(), AMQPValue::LongString((*v).into()));
    }
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await
        .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
}

/// Publishes persistent messages to `queue` (through the default exchange),
/// each (message id, headers, body), and waits for every confirm.
async fn publish(channel: &Channel, queue: &str, messages: &[Outgoing<'_>]) {
    let mut confirms = Vec::new();
    for (id, headers, body) in messages {
        let mut table = FieldTable::default();
        for (k, v) in headers.iter() {
            table.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(table);
        if let Some(id) = id {
            properties = properties.with_message_id((*id).into());
        }
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .unwrap_or_else(|e| panic!("publish to {queue}: {e}"));
        confirms.push(confirm);
    }
    for confirm in confirms {
        let c = confirm.await.unwrap_or_else(|e| panic!("confirm: {e}"));
        assert!(c.is_ack(), "the broker refused a message: {c:?}");
    }
}

/// Publishes each id once, with the body `{"n": id}`.
async fn publish_ids(channel: &Channel, queue: &str, ids: &[String]) {
    let bodies: Vec<Vec<u8>> = ids
        .iter()
        .map(|id| format!("{{\"id\":\"{id}\"}}").into_bytes())
        .collect();
    let messages: Vec<Outgoing<'_>> = ids
        .iter()
        .zip(&bodies)
        .map(|(id, body)| (Some(id.as_str()), &[][..], body.as_slice()))
        .collect();
    publish(channel, queue, &messages).await;
}

/// How many messages `queue` holds: ready, and unacked.
async fn depth(queue: &str) -> (u32, u32) {
    depth_on(support::rabbitmq::shared_url(), queue).await
}

/// [`depth`] on the broker at `url`.
async fn depth_on(url: &str, queue: &str) -> (u32, u32) {
    // The management API is not on: ready from a passive declare, unacked
    // as what a consumer of our own cannot see. A passive declare gives
    // only the ready count; a queue is settled when it is 0 and a short
    // consume gets nothing.
    let channel = channel_on(url).await;
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("declare {queue} passively: {e}"));
    let _ = channel.close(200, "".into()).await;
    (q.message_count(), q.consumer_count())
}

/// Whether `queue` holds no ready message.
async fn drained(queue: &str) -> bool {
    depth(queue).await.0 == 0
}

/// Whether a consumer holds no message: each it received was acked,
/// requeued, rejected or lost with its channel.
fn idle(s: &ConsumerStats) -> bool {
    s.received == s.acked + s.requeued + s.ack_failures + s.rejected
}

/// Waits until `queue` holds no ready message and every consumer of
/// `stats` holds none, three checks in a row 100 ms apart (a message
/// requeued the moment before a check is back on the queue by the next).
async fn until_settled(queue: &str, limit: Duration, stats: &[&dyn Fn() -> ConsumerStats]) {
    until_settled_on(support::rabbitmq::shared_url(), queue, limit, stats).await;
}

/// [`until_settled`] on the broker at `url`.
async fn until_settled_on(
    url: &str,
    queue: &str,
    limit: Duration,
    stats: &[&dyn Fn() -> ConsumerStats],
) {
    let deadline = Instant::now() + limit;
    let mut in_a_row = 0;
    while in_a_row < 3 {
        let all_idle = stats.iter().all(|s| idle(&s()));
        if all_idle && depth_on(url, queue).await.0 == 0 {
            in_a_row += 1;
        } else {
            in_a_row = 0;
        }
        let now: Vec<ConsumerStats> = stats.iter().map(|s| s()).collect();
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {queue} to settle: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reads up to `n` messages of `queue` (acking them) for up to `limit`.
async fn read_queue(url: &str, queue: &str, n: usize, limit: Duration) -> Vec<RabbitMessage> {
    let channel = channel_on(url).await;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("consume {queue}: {e}"));
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    while got.len() < n {
        let next = tokio::time::timeout_at(deadline, consumer.next()).await;
        let Ok(Some(Ok(delivery))) = next else { break };
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        got.push(RabbitMessage {
            body: delivery.data,
            properties: delivery.properties,
            redelivered: delivery.redelivered,
            ..RabbitMessage::default()
        });
    }
    let _ = channel.close(200, "".into()).await;
    got
}

/// A header of a message read back, as text.
fn header(message: &RabbitMessage, name: &str) -> String {
    message
        .header_text(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Waits for `cond`, checked every 50 ms, failing after `limit`.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
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

fn count(effects: &Effects) -> usize {
    effects.lock().unwrap_or_else(|p| p.into_inner()).len()
}

/// Every id had exactly one effect, and no other id had any.
fn exactly_once(effects: &Effects, ids: &[String]) {
    let effects = effects.lock().unwrap_or_else(|p| p.into_inner());
    for id in ids {
        assert_eq!(effects.get(id), Some(&1), "{id}: effects");
    }
    assert_eq!(effects.len(), ids.len(), "effects of unknown ids");
}

/// A consumer running in a task of its own until [`stop`](Self::stop).
struct Running {
    stop: Option<oneshot::Sender<()>>,
    stats: Box<dyn Fn() -> ConsumerStats + Send + Sync>,
    task: tokio::task::JoinHandle<Result<ConsumerStats, RabbitConsumerError>>,
}

impl Running {
    fn start<S, F, Fut, T, E>(consumer: RabbitConsumer<S>, handler: F) -> Running
    where
        S: IdempotencyStore + ?Sized,
        F: Fn(RabbitMessage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let consumer = Arc::new(consumer);
        let watched = consumer.clone();
        let task = tokio::spawn(async move {
            consumer
                .run(handler, async {
                    let _ = stopped.await;
                })
                .await
        });
        Running {
            stop: Some(stop),
            stats: Box::new(move || watched.stats()),
            task,
        }
    }

    /// What the consumer did so far.
    fn stats(&self) -> ConsumerStats {
        (self.stats)()
    }

    /// Waits until `cond` holds of the consumer's stats (up to `limit`).
    async fn until(&self, what: &str, limit: Duration, cond: impl Fn(&ConsumerStats) -> bool) {
        let deadline = Instant::now() + limit;
        loop {
            let stats = self.stats();
            if cond(&stats) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {stats:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Shuts the consumer down; what `run` returned (bounded at 60 s).
    async fn stop(mut self) -> ConsumerStats {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let task = &mut self.task;
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .unwrap_or_else(|_| panic!("run did not return"))
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Publishes one persistent message with `message_id` `id` and these
/// headers (any AMQP type) to `queue`, and waits for its confirm.
async fn publish_with(
    channel: &idemkit::rabbitmq::lapin::Channel,
    queue: &str,
    id: &str,
    headers: Vec<(&str, AMQPValue)>,
    body: &[u8],
) {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        table.insert(k.into(), v);
    }
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(id.into())
        .with_headers(table);
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .unwrap_or_else(|e| panic!("publish to {queue}: {e}"));
    let c = confirm.await.unwrap_or_else(|e| panic!("confirm: {e}"));
    assert!(c.is_ack(), "the broker refused a message: {c:?}");
}

/// Declares a durable quorum queue with these extra integer arguments.
async fn declare_quorum(
    channel: &idemkit::rabbitmq::lapin::Channel,
    queue: &str,
    ints: &[(&str, i64)],
) {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    for (k, v) in ints {
        args.insert((*k).into(), AMQPValue::LongLongInt(*v));
    }
    channel
        .queue_declare(
            queue.into(),
            idemkit::rabbitmq::lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap_or_else(|e| panic!("declare {queue}: {e}"));
}
