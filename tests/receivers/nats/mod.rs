//! The NATS JetStream consumer on a real nats-server (`support::nats`: the
//! server `IDEM_NATS_URL` names, or one started here; a server of the
//! test's own where it is stopped and started): every effect once and
//! every message acked, whatever happens to the consumers:
//!
//! - `delivery`: 1,000 messages with copies through two consumers, one a
//!   child process killed (SIGKILL) mid-batch; the default key;
//! - `restart`: the server stopped and started mid-run (same port, same
//!   store), and while a handler runs longer than the ack wait;
//! - `bounds`: `concurrency` and `max_ack_pending` bounding what is in
//!   flight;
//! - `ack_wait`: in-progress acks keeping a long handler's message, and
//!   the ack wait running out without them (the redelivery gets "in
//!   progress", then the replay); a consumer's acks lost (its connection
//!   cut) while its handler runs;
//! - `poison`: dead letters after `max_deliveries` with their reason,
//!   messages without a usable key, poison without a dead-letter subject;
//!   two consumers sharing a dead-letter subject, JetStream's publish
//!   headers and payloads near `max_payload` in a poison message, dead
//!   letters the dead-letter stream refuses; a full Redis (not poison);
//! - `unrecorded`: a store outage past the lease after the handler ran,
//!   the result finished later, the message kept meanwhile (even when the
//!   `run` future is dropped); a refused completion's dead letter owed
//!   until it is published;
//! - `shutdown`: a message held at shutdown handed back and replayed
//!   elsewhere, a key being finished given up, a `run` future dropped
//!   while a handler runs;
//! - `config`: configurations `run` refuses (a key header name that is
//!   not valid too), a missing stream or one deleted under the consumer,
//!   extreme settings clamped;
//! - `in_transaction`: the in-transaction form on PostgreSQL;
//! - `telemetry`: the stats as `metrics` counters; what `in_progress`
//!   counts.
//!
//! `cargo test --features nats,redis,postgres --test receivers nats::`
//! runs them; `RUST_LOG=idem_nats=debug` shows what the consumers did.
#![allow(clippy::unwrap_used)]

use crate::support;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit::nats::async_nats::jetstream::{self, stream};
use idemkit::nats::async_nats::{self, HeaderMap};
use idemkit::nats::{ConsumerStats, NatsConsumer, NatsConsumerError, NatsMessage};
use idemkit::{Codec, IdempotencyStore};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

mod ack_wait;
mod bounds;
mod config;
mod delivery;
#[cfg(feature = "postgres")]
mod in_transaction;
mod poison;
mod restart;
mod shutdown;
mod telemetry;
mod unrecorded;

/// How many times each key's effect ran.
type Effects = Arc<Mutex<HashMap<String, u32>>>;

/// Counts an effect of `id`; how many it has now.
fn effect(effects: &Effects, id: &str) -> u32 {
    let mut map = effects.lock().unwrap_or_else(|p| p.into_inner());
    let n = map.entry(id.to_owned()).or_default();
    *n += 1;
    *n
}

/// A unique name (streams and consumers of the shared server).
fn name(prefix: &str) -> String {
    format!("{prefix}-{:08x}", fastrand::u32(..))
}

/// A JetStream context on the server at `url`.
async fn jetstream_at(url: &str) -> jetstream::Context {
    support::logs::init();
    let client = async_nats::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to NATS at {url}: {e}"));
    jetstream::new(client)
}

/// A JetStream context on the shared server.
async fn jetstream() -> jetstream::Context {
    jetstream_at(support::nats::shared_url()).await
}

/// Creates the stream `name` (file storage) of the subjects `subjects`.
async fn create_stream(js: &jetstream::Context, name: &str, subjects: &[&str]) {
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("cannot create the stream {name}: {e}"));
}

/// Publishes `payload` to `subject` with these headers, and waits for
/// JetStream's ack.
async fn publish(js: &jetstream::Context, subject: &str, headers: &[(&str, &str)], payload: &str) {
    let mut map = HeaderMap::new();
    for (k, v) in headers {
        map.insert(*k, *v);
    }
    js.publish_with_headers(subject.to_owned(), map, payload.to_owned().into())
        .await
        .unwrap_or_else(|e| panic!("publish to {subject}: {e}"))
        .await
        .unwrap_or_else(|e| panic!("publish to {subject}, its ack: {e}"));
}

/// (pending, ack pending, redelivered) of a durable consumer: how many
/// messages it has yet to deliver, how many it delivered without an ack.
async fn pending(js: &jetstream::Context, stream: &str, durable: &str) -> Option<(u64, usize)> {
    let stream = js.get_stream(stream).await.ok()?;
    let info = stream.consumer_info(durable).await.ok()?;
    Some((info.num_pending, info.num_ack_pending))
}

/// Whether the durable consumer has delivered and had acked every message.
async fn all_acked(js: &jetstream::Context, stream: &str, durable: &str) -> bool {
    pending(js, stream, durable).await == Some((0, 0))
}

/// Every message of the stream `name` (read by a consumer of its own).
async fn read_all(js: &jetstream::Context, name: &str, expect: usize) -> Vec<NatsMessageCopy> {
    use futures::StreamExt;
    let stream = js.get_stream(name).await.unwrap();
    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            ack_policy: jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < expect && Instant::now() < deadline {
        let mut batch = consumer
            .fetch()
            .max_messages(100)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(m)) = batch.next().await {
            got.push(NatsMessageCopy {
                subject: m.subject.to_string(),
                payload: m.payload.to_vec(),
                headers: m.headers.clone().unwrap_or_default(),
            });
        }
    }
    got
}

/// A message read back from a stream.
struct NatsMessageCopy {
    subject: String,
    payload: Vec<u8>,
    headers: HeaderMap,
}

impl NatsMessageCopy {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.as_str())
    }
}

/// Waits until `cond` holds, polling every 50 ms; fails after `limit`.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `cond` every 100 ms for up to `limit`; whether it held (for an
/// assertion with the stats in its message, where [`wait_until`] would
/// fail without them).
async fn holds_within<F, Fut>(limit: Duration, mut cond: F) -> bool
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
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A consumer running in a task of its own until [`stop`](Self::stop).
struct Running<S: ?Sized + IdempotencyStore, C: Codec> {
    consumer: Arc<NatsConsumer<S, C>>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<ConsumerStats, NatsConsumerError>>,
}

impl<S: ?Sized + IdempotencyStore, C: Codec> Running<S, C> {
    fn start<F, Fut, T, E>(consumer: NatsConsumer<S, C>, handler: F) -> Self
    where
        F: Fn(NatsMessage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
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

    /// Stops it and returns its stats (within 60 s).
    async fn stop(self) -> ConsumerStats {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .unwrap_or_else(|_| panic!("the consumer did not stop within 60 s"))
            .unwrap_or_else(|e| panic!("the consumer task: {e}"))
            .unwrap_or_else(|e| panic!("the consumer failed: {e}"))
    }
}

/// A Redis store on the shared Redis.
async fn redis_store() -> idemkit::redis::RedisStore {
    idemkit::redis::RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}
