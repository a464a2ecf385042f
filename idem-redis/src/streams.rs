//! A Redis Streams consumer that runs every entry through
//! [`Idempotency::process_with`]: a consumer group reads the stream, each
//! entry's key comes from a field (or from a hash of its content), the
//! entries of a batch are acknowledged in one `XACK` once their results are
//! recorded or replayed, and
//! entries left pending by a consumer that died are reclaimed with
//! `XAUTOCLAIM` once they have been idle long enough.
//!
//! ```no_run
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_redis::streams::{StreamConsumer, StreamEntry};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotency::new(MemoryStore::new());
//! let consumer = StreamConsumer::connect("redis://127.0.0.1:6379/", "payments", "billing", "worker-1", idem)
//!     .await?
//!     .key_field("message_id")
//!     .concurrency(16);
//! let shutdown = async { let _ = tokio::signal::ctrl_c().await; };
//! let stats = consumer
//!     .run(
//!         |entry: StreamEntry| async move {
//!             let amount = entry.text("amount").unwrap_or("0").to_owned();
//!             Ok::<_, std::io::Error>(format!("charged {amount}"))
//!         },
//!         shutdown,
//!     )
//!     .await?;
//! println!("{stats:?}");
//! # Ok(()) }
//! ```
//!
//! An entry whose handler fails, or whose key is held by another consumer
//! right now, is left pending: it is delivered again after `claim_idle`.
//! An entry without a usable key is left pending too and logged (it shows in
//! `XPENDING`); nothing is acknowledged that was not processed.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use idem_core::{
    Codec, Fingerprint, IdemError, Idempotency, IdempotencyKey, IdempotencyStore, JsonCodec,
    Processed, StoreError,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use redis::Value;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// One stream entry, as the handler gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEntry {
    /// The entry ID (`1700000000000-0`).
    pub id: String,
    /// Its fields, by name.
    pub fields: BTreeMap<String, Vec<u8>>,
}

impl StreamEntry {
    /// A field's bytes.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields.get(name).map(Vec::as_slice)
    }

    /// A field as UTF-8 text.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.field(name).and_then(|b| std::str::from_utf8(b).ok())
    }
}

/// Where an entry's idempotency key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The value of this field (a message ID set by the producer).
    Field(String),
    /// A SHA-256 of all the entry's fields: duplicates sent with identical
    /// content share a key.
    Content,
}

/// What a consumer did, counted since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Entries whose handler ran and whose result was recorded.
    pub executed: u64,
    /// Entries answered with a recorded result (duplicates).
    pub replayed: u64,
    /// Entries acknowledged (`XACK`).
    pub acked: u64,
    /// Entries taken over from another consumer with `XAUTOCLAIM`.
    pub reclaimed: u64,
    /// Entries left pending: handler failed, key in progress elsewhere,
    /// store unavailable, or no usable key.
    pub left_pending: u64,
}

#[derive(Default)]
struct Counters {
    executed: AtomicU64,
    replayed: AtomicU64,
    acked: AtomicU64,
    reclaimed: AtomicU64,
    left_pending: AtomicU64,
}

/// A consumer-group worker; see the [module docs](self).
pub struct StreamConsumer<S: ?Sized, C = JsonCodec> {
    conn: ConnectionManager,
    stream: String,
    group: String,
    consumer: String,
    idem: Idempotency<S, C>,
    key: KeySource,
    scope: String,
    batch: usize,
    concurrency: usize,
    block: Duration,
    claim_idle: Duration,
    counters: Arc<Counters>,
}

impl<S: ?Sized, C> fmt::Debug for StreamConsumer<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamConsumer")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("key", &self.key)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::unavailable(e)
}

impl<S: IdempotencyStore + ?Sized, C: Codec> StreamConsumer<S, C> {
    /// Connects to `url` with a connection of its own (reads block on it),
    /// and creates the consumer group, with the stream if missing, reading
    /// from the start of the stream. An existing group is kept as it is.
    ///
    /// Defaults: key from the field `id`, scope `stream.{stream}` (when
    /// valid, else `stream`), batches of 32, 8 entries at once, reads
    /// blocking for 500 ms, entries reclaimed after 30 s idle (set
    /// `claim_idle` longer than your handler's longest run).
    pub async fn connect(
        url: &str,
        stream: &str,
        group: &str,
        consumer: &str,
        idem: Idempotency<S, C>,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Backend(Box::new(e)))?;
        let block = Duration::from_millis(500);
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(block + Duration::from_secs(5)));
        let mut conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(unavailable)?;
        let created: Result<(), redis::RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match created {
            Ok(()) => {}
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(unavailable(e)),
        }
        let scope = format!("stream.{stream}");
        let scope = if IdempotencyKey::new(scope.clone(), "x").is_ok() {
            scope
        } else {
            "stream".to_owned()
        };
        Ok(StreamConsumer {
            conn,
            stream: stream.to_owned(),
            group: group.to_owned(),
            consumer: consumer.to_owned(),
            idem,
            key: KeySource::Field("id".to_owned()),
            scope,
            batch: 32,
            concurrency: 8,
            block,
            claim_idle: Duration::from_secs(30),
            counters: Arc::default(),
        })
    }

    /// Takes each entry's key from this field.
    pub fn key_field(mut self, field: impl Into<String>) -> Self {
        self.key = KeySource::Field(field.into());
        self
    }

    /// Takes each entry's key from a hash of its fields.
    pub fn key_from_content(mut self) -> Self {
        self.key = KeySource::Content;
        self
    }

    /// The scope of the keys (default `stream.{stream}`).
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// Entries read per `XREADGROUP` / `XAUTOCLAIM` (default 32).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// Entries processed at once (default 8).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// How long a read waits for new entries (default 500 ms); also how
    /// long a shutdown may wait for the read in flight.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// How long an entry must have been pending with another consumer
    /// before this one takes it over (default 30 s).
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle;
        self
    }

    /// What this consumer did so far.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.counters;
        ConsumerStats {
            executed: c.executed.load(Ordering::Relaxed),
            replayed: c.replayed.load(Ordering::Relaxed),
            acked: c.acked.load(Ordering::Relaxed),
            reclaimed: c.reclaimed.load(Ordering::Relaxed),
            left_pending: c.left_pending.load(Ordering::Relaxed),
        }
    }

    /// Reads and processes entries until `shutdown` completes, then
    /// finishes the entries in flight and returns what it did. Fails only
    /// when Redis cannot be read (`Unavailable`); handler errors leave the
    /// entry pending.
    pub async fn run<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, StoreError>
    where
        F: Fn(StreamEntry) -> Fut + Sync,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
    {
        let shutdown = shutdown.fuse();
        futures_util::pin_mut!(shutdown);
        // XAUTOCLAIM runs when a sweep is due (every half `claim_idle`)
        // or the last one had more to give, not before every read: a
        // round trip per batch saved on the hot path.
        let mut cursor = "0-0".to_owned();
        let mut next_sweep = tokio::time::Instant::now();
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                break;
            }
            let mut entries = Vec::new();
            if cursor != "0-0" || tokio::time::Instant::now() >= next_sweep {
                entries = self.reclaim(&mut cursor).await?;
                if cursor == "0-0" {
                    next_sweep = tokio::time::Instant::now() + self.claim_idle / 2;
                }
            }
            if entries.is_empty() {
                entries = self.read_new().await?;
            }
            let done: Vec<String> = futures_util::stream::iter(entries)
                .map(|entry| self.process(entry, &handler))
                .buffer_unordered(self.concurrency)
                .filter_map(|id| async move { id })
                .collect()
                .await;
            self.ack(&done).await;
        }
        Ok(self.stats())
    }

    /// Acknowledges the entries of a batch whose results are recorded or
    /// replayed, in one `XACK`. A failed XACK only means they are delivered
    /// again, then replayed and acknowledged.
    async fn ack(&self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        let mut conn = self.conn.clone();
        let acked: Result<u64, _> = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(ids)
            .query_async(&mut conn)
            .await;
        match acked {
            Ok(n) => {
                self.counters.acked.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(stream = %self.stream, entries = ids.len(), error = %e, "XACK failed; the entries will be replayed and acked later")
            }
        }
    }

    /// Entries idle for `claim_idle` in other consumers' pending lists.
    async fn reclaim(&self, cursor: &mut String) -> Result<Vec<StreamEntry>, StoreError> {
        let mut conn = self.conn.clone();
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(self.claim_idle.as_millis() as u64)
            .arg(cursor.as_str())
            .arg("COUNT")
            .arg(self.batch)
            .query_async(&mut conn)
            .await
            .map_err(unavailable)?;
        *cursor = reply.next_stream_id;
        let entries: Vec<StreamEntry> = reply.claimed.into_iter().map(entry).collect();
        self.counters
            .reclaimed
            .fetch_add(entries.len() as u64, Ordering::Relaxed);
        Ok(entries)
    }

    /// New entries for this consumer, waiting up to `block`.
    async fn read_new(&self) -> Result<Vec<StreamEntry>, StoreError> {
        let mut conn = self.conn.clone();
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(self.batch)
            .arg("BLOCK")
            .arg(self.block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .map(entry)
            .collect())
    }

    fn key_of(&self, entry: &StreamEntry) -> Result<IdempotencyKey, String> {
        match &self.key {
            KeySource::Field(name) => {
                let value = entry
                    .field(name)
                    .ok_or_else(|| format!("no field {name:?}"))?;
                IdempotencyKey::from_utf8(self.scope.clone(), value).map_err(|e| e.to_string())
            }
            KeySource::Content => IdempotencyKey::from_content(self.scope.clone(), &entry.fields)
                .map_err(|e| e.to_string()),
        }
    }

    /// Runs one entry; its ID when it is to be acknowledged.
    async fn process<F, Fut, T, E>(&self, entry: StreamEntry, handler: &F) -> Option<String>
    where
        F: Fn(StreamEntry) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
    {
        let id = entry.id.clone();
        let key = match self.key_of(&entry) {
            Ok(key) => key,
            Err(e) => {
                tracing::error!(stream = %self.stream, entry = %id, error = %e, "entry without a usable key: left pending");
                self.counters.left_pending.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        let fingerprint = Fingerprint::of(&entry.fields).ok();
        let outcome = self
            .idem
            .process_with(&key, fingerprint, |_| handler(entry))
            .await;
        let counter = match outcome {
            Ok(Processed::Executed(_)) => &self.counters.executed,
            Ok(Processed::ExecutedNotReplayable { reason, .. }) => {
                tracing::warn!(stream = %self.stream, entry = %id, %reason, "the handler ran but its result was not recorded");
                &self.counters.executed
            }
            Ok(Processed::Replayed(_)) => &self.counters.replayed,
            // The key completed (its result was not recordable): acked,
            // never run again.
            Err(IdemError::ResultUnavailable { reason }) => {
                tracing::warn!(stream = %self.stream, entry = %id, %reason, "duplicate of an entry whose result was not recorded: acknowledged");
                &self.counters.replayed
            }
            Err(e) => {
                if !matches!(e, IdemError::InProgress { .. }) {
                    tracing::warn!(stream = %self.stream, entry = %id, error = %e, "entry left pending; it will be delivered again");
                }
                self.counters.left_pending.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Some(id)
    }
}

fn entry(id: StreamId) -> StreamEntry {
    StreamEntry {
        id: id.id,
        fields: id
            .map
            .into_iter()
            .map(|(k, v)| {
                let bytes = match v {
                    Value::BulkString(b) => b,
                    Value::SimpleString(s) => s.into_bytes(),
                    Value::Int(n) => n.to_string().into_bytes(),
                    other => format!("{other:?}").into_bytes(),
                };
                (k, bytes)
            })
            .collect(),
    }
}
