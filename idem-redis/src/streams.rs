//! A Redis Streams consumer that runs every batch it reads through
//! [`Idempotency::process_batch_with_detached`]: a consumer group reads the
//! stream, each entry's key comes from a field (or from a hash of its
//! content), the keys of a batch are acquired with one `acquire_many` and
//! the results recorded with one `complete_many`, the entries of a batch
//! are acknowledged in one `XACK` once their results are recorded or
//! replayed, entries left pending by a
//! consumer that died are reclaimed with `XAUTOCLAIM` once they have been
//! idle long enough, and entries that can never succeed go to a dead-letter
//! stream.
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
//!     .concurrency(16)
//!     .max_deliveries(5); // then to the stream "payments:dead"
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
//! # What happens to an entry
//!
//! | outcome | the entry |
//! |---|---|
//! | executed, replayed, or completed earlier without a replayable result ([`IdemError::ResultUnavailable`]) | acknowledged |
//! | the key is in progress with another consumer, or the store is unavailable | left pending: delivered again after `claim_idle` (never dead-lettered: the lease ends, the store comes back) |
//! | the handler ran but the store was away until its lease ended ([`IdemError::Unrecorded`]) | left pending and kept from the other consumers (claimed again every `claim_idle / 4`, see below): this consumer writes its completion with the run's own lease ([`Idempotency::finish`]) once the store is back, then acknowledges it. A consumer that stops first leaves it pending: after `claim_idle` another consumer reclaims it and, the lease being over, takes the key over and runs it again (the window of an outage longer than the lease, DESIGN 4) |
//! | the handler ran but the store refuses its completion for good (a non-retryable error while finishing) | dead-lettered; every later entry of its key this consumer reads is dead-lettered too, never run (the handler ran; its lease is over) |
//! | the handler failed or panicked | left pending, until it was delivered [`max_deliveries`](StreamConsumer::max_deliveries) times: then dead-lettered |
//! | can never succeed ([`IdemError::is_retryable`] is false: no usable key, payload mismatch, lease lost, corrupt record, a response that does not decode) | dead-lettered at once |
//! | a field name that is not UTF-8, or that appears twice in the entry | dead-lettered at once, its fields copied byte for byte; the handler never runs ([`StreamEntry::fields`] is a map by `String` name: such names would be merged) |
//! | the executor's configuration is refused (a zero lease or retention) | left pending, and `run` fails: nothing could succeed |
//!
//! Dead-lettering adds the entry to the dead-letter stream (default
//! `{stream}:dead`) with the fields `idem.entry` (its ID), `idem.stream`,
//! `idem.group`, `idem.consumer`, `idem.deliveries` (its delivery count)
//! and `idem.reason`, followed by the entry's own fields, then acknowledges
//! it. The two are separate commands (the streams may live on different
//! cluster slots): a crash between them dead-letters the entry again on its
//! next delivery.
//!
//! # Scopes
//!
//! The keys' scope is `stream.{stream}` by default, or for a stream name
//! that is not a valid scope `stream:` and a hash of the name
//! ([`default_scope`]): two streams never share keys. (Before, every such
//! stream shared the scope `stream`: set [`scope`](StreamConsumer::scope)
//! `("stream")` to keep those keys.)
//!
//! # Handlers run detached
//!
//! Each handler runs in a spawned task that the consumer awaits
//! ([`Idempotency::process_batch_with_detached`]), at most
//! [`concurrency`](StreamConsumer::concurrency) at once: a consumer whose `run` future
//! is dropped (a task aborted at shutdown) does not cut its handlers off;
//! they finish and their results are recorded, and the entries, not yet
//! acknowledged, are replayed and acknowledged on their next delivery. So a
//! handler must be `Send + Sync + 'static`. A process that dies takes its
//! handlers with it: their keys stay in progress until their leases end,
//! then a redelivery takes them over (with a higher attempt and fence).
//!
//! While `run` runs, the entries whose handlers run and those it is
//! finishing are claimed again every `claim_idle / 4` (`XCLAIM ... 0 ...
//! JUSTID`: their idle time back to 0, their delivery counts unchanged;
//! one round trip to Redis, not to the store), so no other consumer of the
//! group reclaims an entry its holder is still working on, however long
//! the handler runs or the store stays away. Give every consumer of a
//! group the same `claim_idle`: a consumer reclaims after its own. A
//! consumer that dies stops claiming; its entries go idle and are
//! reclaimed after `claim_idle`.
//!
//! Deliveries of one key in the same batch run one after the other: the
//! later ones wait for the first and get its replay (or run again if it
//! failed), instead of being answered "in progress" and parked until
//! `claim_idle` (each such repetition costs the batch one more
//! `acquire_many` and `complete_many`).
//!
//! # Reads
//!
//! `XREADGROUP` blocks on the server for up to [`block`](StreamConsumer::block)
//! (`Duration::ZERO`: with no limit of its own), and never past the next
//! reclaim sweep (every `claim_idle / 2`). The client waits for it that
//! long plus the [`call_timeout`](StreamConsumer::call_timeout): a read is
//! never cut short by a fixed response timeout, so no entry is delivered to
//! a read the client gave up on. A shutdown waits for the read in flight.
//! When `run` starts, it first reads this consumer's own pending entries
//! (delivered to the same consumer name before, never acknowledged: a
//! restart after a crash) and processes them at once, without waiting for
//! `claim_idle`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use idem_core::{
    saturate, Codec, Context, Fingerprint, Finished, IdemError, Idempotency, IdempotencyKey,
    IdempotencyStore, JsonCodec, KeyError, LeaseRunner, PayloadFingerprint, Processed, Runner,
    SharedTx, StoreError, TransactionalStore, TxRunner, Unrecorded,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, Value};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{map_error, millis, CallTimeout, UnexpectedReply};

mod keeper;

/// One stream entry, as the handler gets it.
///
/// ```
/// use std::collections::BTreeMap;
/// use idem_redis::streams::StreamEntry;
///
/// let entry = StreamEntry {
///     id: "1700000000000-0".to_owned(),
///     fields: BTreeMap::from([("amount".to_owned(), b"1999".to_vec())]),
///     ..StreamEntry::default()
/// };
/// assert_eq!(entry.text("amount"), Some("1999"));
/// assert_eq!(entry.field("missing"), None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamEntry {
    /// The entry ID (`1700000000000-0`).
    pub id: String,
    /// Its fields, by name.
    pub fields: BTreeMap<String, Vec<u8>>,
    /// The acquisition's attempt number: 1, or more when an earlier run of
    /// this key was cut off (its process died) and its lease taken over.
    pub attempt: u32,
    /// The acquisition's fence: strictly greater than every earlier
    /// acquisition's of this key. Give it to a downstream system that
    /// refuses lower fences.
    pub fence: u64,
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

/// Where an entry's idempotency key comes from: set with
/// [`StreamConsumer::key_field`] or [`StreamConsumer::key_from_content`].
///
/// ```
/// use idem_redis::streams::KeySource;
///
/// let by_id = KeySource::Field("message_id".to_owned()); // a producer-set ID
/// assert_ne!(by_id, KeySource::Content);                 // or the content's hash
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// The value of this field (a message ID set by the producer).
    Field(String),
    /// A SHA-256 of all the entry's fields: duplicates sent with identical
    /// content share a key.
    Content,
}

/// What a consumer did, counted since it started: returned by
/// [`StreamConsumer::run`], and by [`StreamConsumer::stats`] while it runs.
///
/// ```
/// use idem_redis::streams::ConsumerStats;
///
/// fn duplicate_share(stats: &ConsumerStats) -> f64 {
///     let seen = stats.executed + stats.replayed;
///     if seen == 0 { 0.0 } else { stats.replayed as f64 / seen as f64 }
/// }
/// assert_eq!(duplicate_share(&ConsumerStats { executed: 3, replayed: 1, ..Default::default() }), 0.25);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Entries whose handler ran and whose result was recorded.
    pub executed: u64,
    /// Entries answered with a recorded result (duplicates), or whose key
    /// completed without a replayable result.
    pub replayed: u64,
    /// Entries acknowledged (`XACK`), dead-lettered ones included.
    pub acked: u64,
    /// Entries taken over from another consumer with `XAUTOCLAIM`.
    pub reclaimed: u64,
    /// Entries left pending: handler failed (fewer than `max_deliveries`
    /// times), key in progress elsewhere, store unavailable.
    pub left_pending: u64,
    /// Entries moved to the dead-letter stream (then acknowledged): they
    /// could never succeed, or their handler failed `max_deliveries` times.
    pub dead_lettered: u64,
}

#[derive(Default)]
struct Counters {
    executed: AtomicU64,
    replayed: AtomicU64,
    acked: AtomicU64,
    reclaimed: AtomicU64,
    left_pending: AtomicU64,
    dead_lettered: AtomicU64,
}

/// The most entries `batch` reads at once (10,000): larger settings are
/// clamped to it, so a read never asks Redis for an unbounded `COUNT`.
pub const MAX_BATCH: usize = 10_000;

/// The default of [`StreamConsumer::max_deliveries`].
///
/// ```
/// assert_eq!(idem_redis::streams::DEFAULT_MAX_DELIVERIES, 10);
/// ```
pub const DEFAULT_MAX_DELIVERIES: u64 = 10;
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A consumer-group worker; see the [module docs](self).
///
/// `R` is the connection: a [`ConnectionManager`] made by
/// [`connect`](Self::connect), or any connection of the `redis` crate given
/// to [`new`](Self::new) (a `MultiplexedConnection`, a `ClusterConnection`).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::Idempotency;
/// use idem_redis::streams::{StreamConsumer, StreamEntry};
/// use idem_redis::RedisStore;
///
/// # async fn run(url: &str) -> Result<(), Box<dyn std::error::Error>> {
/// let idem = Idempotency::new(RedisStore::connect(url).await?);
/// let consumer = StreamConsumer::connect(url, "payments", "billing", "worker-1", idem)
///     .await?
///     .key_field("message_id")
///     .claim_idle(Duration::from_secs(30));
/// let stats = consumer
///     .run(
///         |entry: StreamEntry| async move { Ok::<_, std::io::Error>(entry.id) },
///         async { let _ = tokio::signal::ctrl_c().await; }, // stop on Ctrl-C
///     )
///     .await?;
/// println!("{stats:?}");
/// # Ok(()) }
/// ```
pub struct StreamConsumer<S: ?Sized, C = JsonCodec, R = ConnectionManager> {
    conn: R,
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
    call_timeout: Duration,
    transaction_wait: Duration,
    max_deliveries: u64,
    dead_letter: String,
    /// What of an entry's fields its fingerprint covers.
    fingerprint: PayloadFingerprint,
    counters: Arc<Counters>,
    /// Entries whose handler ran but whose completion is not written yet
    /// (the store was away past the lease), by entry ID: finished with
    /// their own lease, never run again.
    unfinished: Arc<std::sync::Mutex<Unfinished>>,
    /// An unfinished key was settled: read this consumer's pending
    /// entries again (those of the key held back meanwhile).
    reread_own: Arc<std::sync::atomic::AtomicBool>,
    /// The entries in flight and the unfinished ones, kept claimed while
    /// `run` runs (see [`keeper`]).
    held: Arc<keeper::Held>,
    /// Keys whose handler ran but whose completion the store refused for
    /// good: their later entries are dead-lettered, never run, until the
    /// retention their result would have had ends.
    refused: Arc<idem_core::GivenUpKeys>,
}

impl<S: ?Sized, C, R> fmt::Debug for StreamConsumer<S, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamConsumer")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("key", &self.key)
            .field("batch", &self.batch)
            .field("concurrency", &self.concurrency)
            .field("block", &self.block)
            .field("claim_idle", &self.claim_idle)
            .field("max_deliveries", &self.max_deliveries)
            .field("dead_letter", &self.dead_letter)
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl<S: IdempotencyStore + ?Sized, C: Codec> StreamConsumer<S, C, ConnectionManager> {
    /// Connects to `url` with a connection of its own (reads block on it,
    /// so it is not shared with the store), without a response timeout of
    /// its own (every call is bounded by the consumer's settings), then
    /// does what [`new`](Self::new) does.
    pub async fn connect(
        url: &str,
        stream: &str,
        group: &str,
        consumer: &str,
        idem: Idempotency<S, C>,
    ) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(map_error)?;
        // A `rediss://` URL: rustls needs a process-wide provider before
        // the connection is made (it panics when the build has two).
        #[cfg(feature = "tls")]
        if matches!(
            client.get_connection_info().addr(),
            redis::ConnectionAddr::TcpTls { .. }
        ) {
            crate::tls::install_crypto_provider();
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(DEFAULT_CALL_TIMEOUT))
            .set_response_timeout(None);
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(map_error)?;
        Self::new(conn, stream, group, consumer, idem).await
    }
}

impl<S, C, R> StreamConsumer<S, C, R>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
    R: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A consumer over a connection you made, standalone or cluster (like
    /// [`RedisStore::new`](crate::RedisStore::new)); creates the consumer
    /// group, with the stream if missing, reading from the start of the
    /// stream. An existing group is kept as it is.
    ///
    /// `XREADGROUP ... BLOCK` holds the connection on the server while it
    /// waits: commands of other users of a multiplexed connection queue
    /// behind it, so give the consumer a connection of its own. Its
    /// response timeout, if it has one, must be longer than
    /// [`block`](Self::block) (a `MultiplexedConnection` has 500 ms unless
    /// made with `AsyncConnectionConfig::set_response_timeout(None)`),
    /// or reads fail with `Unavailable`.
    ///
    /// Defaults: key from the field `id`, scope `stream.{stream}` (when
    /// valid, else `stream:` and a hash of the name: [`default_scope`]),
    /// batches of 32, 8 entries at once, reads
    /// blocking for 500 ms, entries reclaimed after 30 s idle (entries
    /// in this consumer's hands are claimed again every `claim_idle / 4`
    /// meanwhile, so a long handler keeps its entry), 5 s call
    /// timeout, dead-lettered to `{stream}:dead` after
    /// [`DEFAULT_MAX_DELIVERIES`] deliveries.
    pub async fn new(
        conn: R,
        stream: &str,
        group: &str,
        consumer: &str,
        idem: Idempotency<S, C>,
    ) -> Result<Self, StoreError> {
        let scope = default_scope(stream);
        let this = StreamConsumer {
            conn,
            stream: stream.to_owned(),
            group: group.to_owned(),
            consumer: consumer.to_owned(),
            idem,
            key: KeySource::Field("id".to_owned()),
            scope,
            batch: 32,
            concurrency: 8,
            block: Duration::from_millis(500),
            claim_idle: Duration::from_secs(30),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            transaction_wait: idem_core::DEFAULT_TRANSACTION_WAIT,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            dead_letter: format!("{stream}:dead"),
            fingerprint: PayloadFingerprint::Whole,
            counters: Arc::default(),
            unfinished: Arc::default(),
            held: Arc::default(),
            refused: Arc::default(),
            reread_own: Arc::default(),
        };
        let mut create = redis::cmd("XGROUP");
        create
            .arg("CREATE")
            .arg(stream)
            .arg(group)
            .arg("0")
            .arg("MKSTREAM");
        match this.call::<()>(&create, this.call_timeout).await {
            Ok(()) => {}
            Err(StoreError::Backend(e) | StoreError::Unavailable(e))
                if e.downcast_ref::<redis::RedisError>()
                    .is_some_and(|e| e.code() == Some("BUSYGROUP")) => {}
            Err(e) => return Err(e),
        }
        Ok(this)
    }

    /// Takes each entry's key from this field.
    pub fn key_field(mut self, field: impl Into<String>) -> Self {
        self.key = KeySource::Field(field.into());
        self
    }

    /// Takes each entry's key from a hash of its fields (of the parts that
    /// count, with a [`fingerprint`](Self::fingerprint) of parts: copies
    /// that differ elsewhere share a key).
    pub fn key_from_content(mut self) -> Self {
        self.key = KeySource::Content;
        self
    }

    /// The scope of the keys (default `stream.{stream}`, or
    /// `stream:{hash}` for a stream name that is not a valid scope: see
    /// [`default_scope`]).
    ///
    /// A scope that is not valid (DESIGN 2: 1 to 64 bytes of
    /// `[A-Za-z0-9._:-]`) is refused here, before any entry is read:
    /// every entry's key would be refused.
    pub fn scope(mut self, scope: impl Into<String>) -> Result<Self, KeyError> {
        let scope = scope.into();
        IdempotencyKey::new(scope.clone(), "-")?;
        self.scope = scope;
        Ok(self)
    }

    /// Entries read per `XREADGROUP` / `XAUTOCLAIM` (default 32; at least
    /// 1, at most [`MAX_BATCH`]).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, MAX_BATCH);
        self
    }

    /// Handlers running at once (default 8; at least 1, at most
    /// [`MAX_BATCH`]: no more can run than a batch holds). The whole batch
    /// is acquired and recorded together whatever this is.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.clamp(1, MAX_BATCH);
        self
    }

    /// How long a read waits for new entries (default 500 ms);
    /// `Duration::ZERO` waits with no limit of its own. A read never waits
    /// past the next reclaim sweep (every `claim_idle / 2`), and a shutdown
    /// waits for the read in flight. Saturated to
    /// [`MAX_DURATION`](idem_core::MAX_DURATION).
    pub fn block(mut self, block: Duration) -> Self {
        self.block = saturate(block);
        self
    }

    /// How long an entry must have been pending with another consumer
    /// before this one takes it over (default 30 s); while `run` runs, the
    /// entries in this consumer's hands (in flight, or being finished after
    /// a store outage) are claimed again every quarter of it, so they
    /// never reach it. Give every consumer of a group the same value.
    /// `Duration::ZERO`: any pending entry may be taken at once, nothing is
    /// kept. `Duration::MAX` (or
    /// anything longer than [`MAX_DURATION`](idem_core::MAX_DURATION)) is
    /// saturated: in effect, never.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = saturate(idle);
        self
    }

    /// How long a call to Redis may take, on top of a read's `block`,
    /// before it fails with `Unavailable` (default 5 s).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = saturate(timeout).max(Duration::from_millis(1));
        self
    }

    /// In the in-transaction form
    /// ([`run_in_transaction`](Self::run_in_transaction)), how long an
    /// entry's claim waits for another transaction holding its key
    /// (default 10 s, at least 1 ms): then the entry is left pending.
    pub fn transaction_wait(mut self, wait: Duration) -> Self {
        self.transaction_wait = wait;
        self
    }

    /// How many deliveries an entry whose handler fails gets before it is
    /// dead-lettered (default [`DEFAULT_MAX_DELIVERIES`]; at least 1). The
    /// count is Redis's delivery counter of the entry (`XPENDING`), which
    /// every read and reclaim increases. Deliveries answered "in progress"
    /// or that found the store unavailable count too, but only a failure
    /// of the handler at or past the limit dead-letters the entry.
    pub fn max_deliveries(mut self, n: u64) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// What of an entry its fingerprint covers (default: every field,
    /// names and values). With [`PayloadFingerprint::json_pointers`], the
    /// pointers read the entry as a JSON object of its fields: a value that
    /// is a JSON object or array is that JSON, any other value a string.
    /// `"/amount"` is the field `amount`, `"/payload/amount"` the member
    /// `amount` of the JSON in the field `payload`; so a producer's resend
    /// that differs elsewhere (a timestamp set on each send) is a
    /// duplicate, replayed and acknowledged, not a payload mismatch
    /// dead-lettered. An entry with a value that is not UTF-8 counts
    /// whole. [`PayloadFingerprint::with`] gets that object's JSON text.
    /// An entry of a key recorded before a change of this is a mismatch.
    pub fn fingerprint(mut self, what: PayloadFingerprint) -> Self {
        self.fingerprint = what;
        self
    }

    /// The fingerprint of an entry's fields, as
    /// [`fingerprint`](Self::fingerprint) says.
    fn fingerprint_of(&self, fields: &BTreeMap<String, Vec<u8>>) -> Option<Fingerprint> {
        if self.fingerprint.is_whole() {
            return Fingerprint::of(fields).ok();
        }
        Some(self.fingerprint.fingerprint(&fields_as_json(fields)))
    }

    /// The dead-letter stream (default `{stream}:dead`).
    pub fn dead_letter(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter = stream.into();
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
            dead_lettered: c.dead_lettered.load(Ordering::Relaxed),
        }
    }

    /// Reads and processes entries until `shutdown` completes, then
    /// finishes the entries in flight and returns what it did. Fails when
    /// Redis cannot be read (`Unavailable`), or when the executor's
    /// configuration is refused (`InvalidArgument`); handler errors leave
    /// the entry pending, then dead-letter it (see the
    /// [module docs](self)).
    pub async fn run<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, StoreError>
    where
        F: Fn(StreamEntry) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        self.run_with(LeaseRunner, move |entry, ()| handler(entry), shutdown)
            .await
    }

    /// The in-transaction form of [`run`](Self::run): each entry runs in a
    /// transaction of the store's database (a [`TransactionalStore`], such
    /// as `PgStore`: the store of the keys is then PostgreSQL, the stream
    /// stays in Redis), handed to the handler; the claim of its key, the
    /// handler's writes and its result commit together before the entry
    /// is acknowledged. A consumer killed anywhere before that commit
    /// leaves nothing: the entry, still pending, is reclaimed and runs
    /// cleanly, with no lease and no window, so effects in that database
    /// happen exactly once. A commit that fails for a passing reason (a
    /// lost connection) leaves the entry pending; one the database refuses
    /// (a deferred constraint) dead-letters it with the reason. A
    /// handler's `Err` or panic rolls everything back; an entry that kills
    /// its consumer is reclaimed and run again each time, as in the lease
    /// form (`max_deliveries` counts failed runs, not crashes). Keep
    /// [`concurrency`](Self::concurrency) at or under the pool's size.
    /// See [`TxRunner`] for the rest.
    ///
    /// ```no_run
    /// use idem_core::Idempotency;
    /// use idem_postgres::{sqlx, PgStore, PgTx};
    /// use idem_redis::streams::{StreamConsumer, StreamEntry};
    ///
    /// # async fn run(conn: redis::aio::ConnectionManager, store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// let consumer = StreamConsumer::new(conn, "orders", "billing", "worker-1", Idempotency::new(store))
    ///     .await?
    ///     .key_field("order_id");
    /// consumer
    ///     .run_in_transaction(
    ///         |entry: StreamEntry, tx: PgTx| async move {
    ///             let mut tx = tx.lock().await?;
    ///             sqlx::query("INSERT INTO shipments (order_id, fence) VALUES ($1, $2)")
    ///                 .bind(entry.text("order_id").unwrap_or_default().to_owned())
    ///                 .bind(entry.fence as i64)
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    ///         },
    ///         async { let _ = tokio::signal::ctrl_c().await; },
    ///     )
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_in_transaction<F, Fut, T, E>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, StoreError>
    where
        S: TransactionalStore,
        F: Fn(StreamEntry, SharedTx<S::Tx>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let runner = TxRunner::new().wait(self.transaction_wait);
        self.run_with(runner, handler, shutdown).await
    }

    /// [`run`](Self::run) with handlers run by `runner`.
    async fn run_with<M, F, Fut, T, E>(
        &self,
        runner: M,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<ConsumerStats, StoreError>
    where
        M: Runner<S, C>,
        F: Fn(StreamEntry, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let handler = Arc::new(handler);
        let shutdown = shutdown.fuse();
        futures_util::pin_mut!(shutdown);
        // This consumer's own pending entries first, from this ID on.
        let mut history = Some("0-0".to_owned());
        // XAUTOCLAIM runs when a sweep is due (every half `claim_idle`)
        // or the last one had more to give, not before every read: a
        // round trip per batch saved on the hot path.
        let mut cursor = "0-0".to_owned();
        let mut next_sweep = tokio::time::Instant::now();
        // Kept from an earlier `run` whose future was dropped: only the
        // entries still to finish (the others are read again below, from
        // this consumer's own pending entries, or were reclaimed).
        {
            let unfinished = self.unfinished.lock().unwrap_or_else(|p| p.into_inner());
            self.held.retain(|id| unfinished.contains_key(id));
        }
        let keep_every = keeper::period(self.claim_idle);
        let _keeper = keep_every.map(|every| {
            keeper::AbortOnDrop(tokio::spawn(
                keeper::Keeper {
                    conn: self.conn.clone(),
                    stream: self.stream.clone(),
                    group: self.group.clone(),
                    consumer: self.consumer.clone(),
                    held: self.held.clone(),
                    every,
                    call_timeout: self.call_timeout,
                }
                .run(),
            ))
        });
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                break;
            }
            self.finish_unfinished().await;
            // A key finished: the entries of it held back meanwhile are in
            // this consumer's pending list; read them again now (they get
            // the replay) rather than after `claim_idle`.
            if self.reread_own.swap(false, Ordering::SeqCst) && history.is_none() {
                history = Some("0-0".to_owned());
            }
            let mut entries = Vec::new();
            if let Some(from) = history.take() {
                entries = self.read_own(&from).await?;
                history = entries.last().map(|d| d.entry.id.clone());
            }
            let now = tokio::time::Instant::now();
            if entries.is_empty() && (cursor != "0-0" || now >= next_sweep) {
                entries = self.reclaim(&mut cursor).await?;
                if cursor == "0-0" {
                    next_sweep = later(tokio::time::Instant::now(), self.claim_idle / 2);
                }
            }
            if entries.is_empty() {
                let until_sweep = next_sweep.saturating_duration_since(tokio::time::Instant::now());
                let mut block = if self.block.is_zero() {
                    until_sweep
                } else {
                    self.block.min(until_sweep)
                };
                // The keeper's claims queue behind a blocking read on this
                // connection: while it holds entries, reads are short.
                if let Some(every) = keep_every.filter(|_| !self.held.is_empty()) {
                    block = block.min(every);
                }
                entries = self.read_new(block).await?;
            }
            self.process_batch(entries, &runner, &handler).await?;
        }
        self.finish_unfinished().await;
        Ok(self.stats())
    }

    /// Writes the completions of entries whose handler ran while the store
    /// was away (one `complete` each, with the run's own lease), and
    /// acknowledges those recorded. One taken over by another consumer is
    /// left pending (its redelivery gets the new holder's answer); one the
    /// store refuses for good is dead-lettered (its handler ran: never run
    /// again); one still failing waits for the next round.
    async fn finish_unfinished(&self) {
        let todo: Vec<String> = {
            let map = self.unfinished.lock().unwrap_or_else(|p| p.into_inner());
            if map.is_empty() {
                return;
            }
            map.keys().cloned().collect()
        };
        let mut ack = Vec::new();
        let mut dead = Vec::new();
        for id in todo {
            let Some((entry, u)) = self
                .unfinished
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id)
            else {
                continue;
            };
            match self.idem.try_finish(&u).await {
                Ok(Finished::Recorded) => {
                    self.counters.executed.fetch_add(1, Ordering::Relaxed);
                    self.reread_own.store(true, Ordering::SeqCst);
                    self.held.let_go(&id);
                    ack.push(id);
                }
                Ok(Finished::TakenOver) => {
                    self.held.let_go(&id);
                    self.reread_own.store(true, Ordering::SeqCst)
                }
                Ok(Finished::Refused(e) | Finished::GaveUp(e)) => {
                    // The handler ran for this key: no later entry of it
                    // runs again at this consumer (its lease is over, a
                    // run would take the key over).
                    let retention = self.idem.retention_period();
                    let lease = u.lease();
                    self.refused
                        .insert(lease.key.clone(), lease.fingerprint, retention);
                    let reason =
                        format!("the handler ran but its result could not be recorded: {e}");
                    let delivery = Delivery {
                        entry,
                        first: false,
                        unusable: None,
                    };
                    self.held.let_go(&id);
                    dead.push((delivery, 0, reason));
                    self.reread_own.store(true, Ordering::SeqCst);
                }
                Err(_) => {
                    self.unfinished
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(id, (entry, u));
                }
            }
        }
        ack.extend(self.dead_letter_all(dead).await);
        self.ack(&ack).await;
    }

    /// One command, bounded by `limit`.
    async fn call<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        limit: Duration,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(limit, cmd.query_async::<T>(&mut conn)).await {
            Ok(reply) => reply.map_err(map_error),
            Err(_) => Err(StoreError::Unavailable(Box::new(CallTimeout(limit)))),
        }
    }

    /// A pipeline of commands on one key, bounded by the call timeout.
    async fn call_pipeline(&self, pipe: &redis::Pipeline) -> Result<Vec<Value>, StoreError> {
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.call_timeout, pipe.query_async::<Vec<Value>>(&mut conn))
            .await
        {
            Ok(reply) => reply.map_err(map_error),
            Err(_) => Err(StoreError::Unavailable(Box::new(CallTimeout(
                self.call_timeout,
            )))),
        }
    }

    /// This consumer's own pending entries after `from` (delivered to it
    /// before and never acknowledged), without blocking.
    async fn read_own(&self, from: &str) -> Result<Vec<Delivery>, StoreError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(self.batch)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(from);
        let reply: Value = self.call(&cmd, self.call_timeout).await?;
        Ok(read_reply(reply)?
            .into_iter()
            .map(|read| Delivery::new(read, false))
            .collect())
    }

    /// Entries idle for `claim_idle` in any consumer's pending list.
    async fn reclaim(&self, cursor: &mut String) -> Result<Vec<Delivery>, StoreError> {
        let mut cmd = redis::cmd("XAUTOCLAIM");
        cmd.arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(millis(self.claim_idle))
            .arg(cursor.as_str())
            .arg("COUNT")
            .arg(self.batch);
        let reply: Value = self.call(&cmd, self.call_timeout).await?;
        let (next, entries) = autoclaim_reply(reply)?;
        *cursor = next;
        self.counters
            .reclaimed
            .fetch_add(entries.len() as u64, Ordering::Relaxed);
        Ok(entries
            .into_iter()
            .map(|read| Delivery::new(read, false))
            .collect())
    }

    /// New entries for this consumer, waiting up to `block` on the server.
    async fn read_new(&self, block: Duration) -> Result<Vec<Delivery>, StoreError> {
        // At least 1 ms: `BLOCK 0` would wait forever.
        let block_ms = millis(block).max(1);
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(self.batch)
            .arg("BLOCK")
            .arg(block_ms)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">");
        let limit = Duration::from_millis(block_ms).saturating_add(self.call_timeout);
        let reply: Value = match self.call(&cmd, limit).await {
            Ok(reply) => reply,
            Err(StoreError::Unavailable(e))
                if e.downcast_ref::<redis::RedisError>()
                    .is_some_and(|e| e.is_timeout()) =>
            {
                return Err(StoreError::Unavailable(
                    format!(
                        "XREADGROUP BLOCK {block_ms} timed out in the connection ({e}): its response \
                         timeout is shorter than the read; give the consumer a connection without one"
                    )
                    .into(),
                ))
            }
            Err(e) => return Err(e),
        };
        Ok(read_reply(reply)?
            .into_iter()
            .map(|read| Delivery::new(read, true))
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
            // With a fingerprint of parts, the key is the hash of those
            // parts: copies that differ elsewhere share a key.
            KeySource::Content if !self.fingerprint.is_whole() => {
                let hash = self.fingerprint.fingerprint(&fields_as_json(&entry.fields));
                IdempotencyKey::new(self.scope.clone(), hash.to_hex()).map_err(|e| e.to_string())
            }
            KeySource::Content => IdempotencyKey::from_content(self.scope.clone(), &entry.fields)
                .map_err(|e| e.to_string()),
        }
    }

    /// Processes a batch through the executor's batch path (one
    /// `acquire_many` and one `complete_many` for all its entries, handlers
    /// `concurrency` at once; deliveries of one key one after the other),
    /// then dead-letters what must be, and acknowledges.
    async fn process_batch<M, F, Fut, T, E>(
        &self,
        deliveries: Vec<Delivery>,
        runner: &M,
        handler: &Arc<F>,
    ) -> Result<(), StoreError>
    where
        M: Runner<S, C>,
        F: Fn(StreamEntry, M::With) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        if deliveries.is_empty() {
            return Ok(());
        }
        // Entries that cannot run are settled here; the others go to the
        // executor as one batch, in stream order.
        let mut settled: Vec<Option<Outcome>> = Vec::with_capacity(deliveries.len());
        let mut items = Vec::new();
        let mut item_of = Vec::new();
        // Completions to write go first: the store may have come back
        // while the read blocked, and a duplicate of their key in this
        // batch then gets the replay.
        self.finish_unfinished().await;
        // What is still unfinished: those entries, and every entry of
        // their keys, wait (pending) for the completion; never run.
        let (unfinished, unfinished_keys): (HashSet<String>, HashSet<IdempotencyKey>) = {
            let map = self.unfinished.lock().unwrap_or_else(|p| p.into_inner());
            (
                map.keys().cloned().collect(),
                map.values().map(|(_, u)| u.lease().key.clone()).collect(),
            )
        };
        for (i, delivery) in deliveries.iter().enumerate() {
            let outcome = match &delivery.unusable {
                // Its handler ran: only its completion is left to write
                // (`finish_unfinished`), never a second run.
                _ if unfinished.contains(&delivery.entry.id) => Some(Outcome::Pending),
                // Its fields cannot be given to the handler as they are:
                // never merged, never run.
                Some(unusable) => Some(Outcome::Dead(unusable.reason.clone())),
                // XADD needs a field: an entry without any was deleted from
                // the stream while pending.
                None if delivery.entry.fields.is_empty() => Some(Outcome::Deleted),
                None => match self.key_of(&delivery.entry) {
                    Err(e) => Some(Outcome::Dead(format!("no usable key: {e}"))),
                    Ok(key) if unfinished_keys.contains(&key) => Some(Outcome::Pending),
                    Ok(key)
                        if !self.refused.is_empty()
                            && self.refused.holds(
                                &key,
                                self.fingerprint_of(&delivery.entry.fields).as_ref(),
                            ) =>
                    {
                        Some(Outcome::Dead(
                            "the handler of this key ran but the store refused its result for good: never run again"
                                .to_owned(),
                        ))
                    }
                    Ok(key) => {
                        let fingerprint = self.fingerprint_of(&delivery.entry.fields);
                        let (handler, mut entry) = (handler.clone(), delivery.entry.clone());
                        items.push((
                            key,
                            fingerprint,
                            move |context: Context, with: M::With| async move {
                                entry.attempt = context.attempt;
                                entry.fence = context.fence;
                                handler(entry, with).await
                            },
                        ));
                        item_of.push(i);
                        None
                    }
                },
            };
            settled.push(outcome);
        }
        // Kept claimed while they run and their completions are written
        // (let go however this batch ends, its future dropped included);
        // those left to finish are kept until they are, and so are the
        // entries held back for an unfinished key. An entry that runs now
        // is no longer held back.
        let _in_flight = self.held.in_flight(
            item_of
                .iter()
                .map(|&i| deliveries[i].entry.id.clone())
                .collect(),
        );
        for (delivery, outcome) in deliveries.iter().zip(&settled) {
            match outcome {
                Some(Outcome::Pending) => self.held.keep(&delivery.entry.id),
                _ => self.held.let_go(&delivery.entry.id),
            }
        }
        // `concurrency` handlers at once; one whose lease may have ended
        // while it waited for its turn does not run (the entry stays
        // pending: its redelivery gets the replay, or takes the key over).
        let idem = self.idem.clone().batch_concurrency(self.concurrency);
        let processed = runner.process_batch(&idem, items).await;
        for (i, result) in item_of.into_iter().zip(processed) {
            settled[i] = Some(self.outcome_of(&deliveries[i].entry.id, result));
        }
        let outcomes = deliveries
            .into_iter()
            .zip(settled)
            .map(|(delivery, outcome)| {
                let outcome = outcome.unwrap_or_else(|| {
                    Outcome::Fatal(StoreError::backend("an entry of the batch got no outcome"))
                });
                (delivery, outcome)
            });

        let mut ack = Vec::new();
        let mut dead: Vec<(Delivery, String)> = Vec::new();
        let mut failed: Vec<(Delivery, String)> = Vec::new();
        let mut fatal = None;
        for (delivery, outcome) in outcomes {
            match outcome {
                Outcome::Ack => ack.push(delivery.entry.id),
                Outcome::Pending => {
                    self.counters.left_pending.fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Failed(reason) => failed.push((delivery, reason)),
                Outcome::Dead(reason) => dead.push((delivery, reason)),
                Outcome::Deleted => {
                    tracing::debug!(stream = %self.stream, entry = %delivery.entry.id, "pending entry deleted from the stream: acknowledged");
                    ack.push(delivery.entry.id)
                }
                Outcome::Fatal(e) => {
                    self.counters.left_pending.fetch_add(1, Ordering::Relaxed);
                    fatal.get_or_insert(e);
                }
                Outcome::Finish(u) => {
                    self.counters.left_pending.fetch_add(1, Ordering::Relaxed);
                    self.held.keep(&delivery.entry.id);
                    self.unfinished
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(delivery.entry.id.clone(), (delivery.entry, u));
                }
            }
        }
        // The delivery counts of the entries that failed or are to be
        // dead-lettered (a round trip on this path only).
        let counts = self
            .delivery_counts(failed.iter().chain(&dead).map(|(d, _)| d))
            .await;
        let count_of = |d: &Delivery| {
            if d.first {
                Some(1)
            } else {
                counts.get(&d.entry.id).copied()
            }
        };
        let mut dead: Vec<(Delivery, u64, String)> = dead
            .into_iter()
            .map(|(d, reason)| {
                let n = count_of(&d).unwrap_or(0);
                (d, n, reason)
            })
            .collect();
        // A failed handler: dead-lettered once the entry was delivered
        // `max_deliveries` times, else left pending.
        for (delivery, reason) in failed {
            let n = if self.max_deliveries == 1 {
                Some(count_of(&delivery).unwrap_or(1))
            } else {
                count_of(&delivery)
            };
            match n {
                Some(n) if n >= self.max_deliveries => {
                    let reason = format!(
                        "{reason} (delivered {n} times, max_deliveries {})",
                        self.max_deliveries
                    );
                    dead.push((delivery, n, reason))
                }
                _ => {
                    self.counters.left_pending.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        for (delivery, _, _) in &dead {
            if let Ok(key) = self.key_of(&delivery.entry) {
                runner.forget(&self.idem, &key).await;
            }
        }
        ack.extend(self.dead_letter_all(dead).await);
        self.ack(&ack).await;
        match fatal {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What to do with an entry after processing it.
    fn outcome_of<T, E: fmt::Display>(
        &self,
        id: &str,
        outcome: Result<Processed<T>, IdemError<E>>,
    ) -> Outcome {
        match outcome {
            Ok(Processed::Executed(_)) => {
                self.counters.executed.fetch_add(1, Ordering::Relaxed);
                Outcome::Ack
            }
            Ok(Processed::ExecutedNotReplayable { reason, .. }) => {
                tracing::warn!(stream = %self.stream, entry = %id, %reason, "the handler ran but its result was not recorded");
                self.counters.executed.fetch_add(1, Ordering::Relaxed);
                Outcome::Ack
            }
            Ok(Processed::Replayed(_)) => {
                self.counters.replayed.fetch_add(1, Ordering::Relaxed);
                Outcome::Ack
            }
            // The key completed (its result was not recordable): acked,
            // never run again, never dead-lettered.
            Err(IdemError::ResultUnavailable { reason }) => {
                tracing::warn!(stream = %self.stream, entry = %id, %reason, "duplicate of an entry whose result was not recorded: acknowledged");
                self.counters.replayed.fetch_add(1, Ordering::Relaxed);
                Outcome::Ack
            }
            // Held by another consumer right now (its lease ends if it
            // died), or the executor waited too long for it.
            Err(IdemError::InProgress { .. } | IdemError::WaitTimeout { .. }) => Outcome::Pending,
            // Nothing could succeed with this configuration.
            Err(IdemError::InvalidConfig { detail }) => {
                Outcome::Fatal(StoreError::InvalidArgument { detail })
            }
            Err(IdemError::Store(e @ StoreError::InvalidArgument { .. })) => Outcome::Fatal(e),
            // The store is away: it comes back; never the entry's fault.
            Err(IdemError::Store(e)) if e.is_retryable() => {
                tracing::warn!(stream = %self.stream, entry = %id, error = %e, "store unavailable: entry left pending");
                Outcome::Pending
            }
            // The handler ran; the store was away past its lease: the
            // completion is written later with the same lease.
            Err(IdemError::Unrecorded(u)) => {
                tracing::warn!(stream = %self.stream, entry = %id, error = %u.cause(), "the handler ran but its result is not recorded yet: entry left pending, to finish");
                Outcome::Finish(u)
            }
            Err(e) if e.is_retryable() => {
                tracing::warn!(stream = %self.stream, entry = %id, error = %e, "handler failed: entry left pending");
                Outcome::Failed(e.to_string())
            }
            Err(e) => Outcome::Dead(e.to_string()),
        }
    }

    /// The delivery counts (`XPENDING`, one round trip for all) of these
    /// deliveries but first ones (whose count is 1). An entry missing from
    /// the answer is no longer pending (another consumer took it over).
    async fn delivery_counts<'a>(
        &self,
        deliveries: impl Iterator<Item = &'a Delivery>,
    ) -> HashMap<String, u64> {
        let ask: Vec<&str> = deliveries
            .filter(|d| !d.first)
            .map(|d| d.entry.id.as_str())
            .collect();
        let mut counts = HashMap::new();
        if ask.is_empty() {
            return counts;
        }
        let mut pipe = redis::pipe();
        for id in &ask {
            pipe.cmd("XPENDING")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(*id)
                .arg(*id)
                .arg(1);
        }
        match self.call_pipeline(&pipe).await {
            Ok(replies) => counts.extend(replies.into_iter().filter_map(pending_count)),
            Err(e) => {
                tracing::warn!(stream = %self.stream, error = %e, "XPENDING failed: delivery counts unknown");
            }
        }
        counts
    }

    /// Adds these entries to the dead-letter stream (one round trip);
    /// returns the IDs of those added, to be acknowledged. Those that could
    /// not be added stay pending.
    async fn dead_letter_all(&self, dead: Vec<(Delivery, u64, String)>) -> Vec<String> {
        if dead.is_empty() {
            return Vec::new();
        }
        let mut pipe = redis::pipe();
        // `idem.deliveries` is 0 when the count could not be read.
        for (delivery, count, reason) in &dead {
            let cmd = pipe
                .cmd("XADD")
                .arg(&self.dead_letter)
                .arg("*")
                .arg("idem.entry")
                .arg(&delivery.entry.id)
                .arg("idem.stream")
                .arg(&self.stream)
                .arg("idem.group")
                .arg(&self.group)
                .arg("idem.consumer")
                .arg(&self.consumer)
                .arg("idem.deliveries")
                .arg(count)
                .arg("idem.reason")
                .arg(reason);
            match &delivery.unusable {
                // Its fields as read, byte for byte.
                Some(unusable) => {
                    for (name, value) in &unusable.raw {
                        cmd.arg(name.as_slice()).arg(value.as_slice());
                    }
                }
                None => {
                    for (name, value) in &delivery.entry.fields {
                        cmd.arg(name).arg(value.as_slice());
                    }
                }
            }
        }
        match self.call_pipeline(&pipe).await {
            Ok(_) => {
                self.counters
                    .dead_lettered
                    .fetch_add(dead.len() as u64, Ordering::Relaxed);
                dead.into_iter()
                    .map(|(delivery, _, reason)| {
                        tracing::warn!(stream = %self.stream, entry = %delivery.entry.id, dead_letter = %self.dead_letter, %reason, "entry dead-lettered");
                        delivery.entry.id
                    })
                    .collect()
            }
            Err(e) => {
                tracing::warn!(stream = %self.stream, dead_letter = %self.dead_letter, entries = dead.len(), error = %e, "could not dead-letter: entries left pending");
                self.counters
                    .left_pending
                    .fetch_add(dead.len() as u64, Ordering::Relaxed);
                Vec::new()
            }
        }
    }

    /// Acknowledges the entries of a batch whose results are recorded or
    /// replayed, or that were dead-lettered, in one `XACK`. A failed XACK
    /// only means they are delivered again, then replayed and acknowledged.
    async fn ack(&self, ids: &[String]) {
        if ids.is_empty() {
            return;
        }
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.stream).arg(&self.group).arg(ids);
        match self.call::<u64>(&cmd, self.call_timeout).await {
            Ok(n) => {
                self.counters.acked.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(stream = %self.stream, entries = ids.len(), error = %e, "XACK failed; the entries will be replayed and acked later")
            }
        }
    }
}

/// An entry as read, and whether this is its first delivery (read with
/// `>`: its delivery count is 1).
struct Delivery {
    entry: StreamEntry,
    first: bool,
    unusable: Option<Unusable>,
}

impl Delivery {
    fn new(read: Read, first: bool) -> Self {
        Delivery {
            entry: read.entry,
            first,
            unusable: read.unusable,
        }
    }
}

/// An entry as parsed from a reply.
struct Read {
    entry: StreamEntry,
    unusable: Option<Unusable>,
}

/// Why an entry's fields cannot be given to the handler as a
/// [`StreamEntry`] (a field name that is not UTF-8, or a name that appears
/// twice: a map by `String` name would merge them), with its fields as
/// read, for the dead-letter stream.
struct Unusable {
    reason: String,
    raw: Vec<(Vec<u8>, Vec<u8>)>,
}

/// An entry's fields as the text of a JSON object, for the pointers of
/// [`StreamConsumer::fingerprint`]: a value that is a JSON object or
/// array (after whitespace or a byte order mark) as that JSON (the
/// pointers canonicalize it, numbers exact), any other UTF-8 value as a
/// JSON string (a string is never an object or an array, so no two values
/// read alike). An entry the pointers cannot read counts whole: a value
/// that is not UTF-8, or that starts as an object or array but is not JSON
/// (or nests too deep) gives the entry's own bytes, framed, which no
/// pointer reads.
fn fields_as_json(fields: &BTreeMap<String, Vec<u8>>) -> Vec<u8> {
    let whole = || {
        let mut raw = vec![0u8];
        for (name, value) in fields {
            for part in [name.as_bytes(), value.as_slice()] {
                raw.extend_from_slice(&(part.len() as u64).to_be_bytes());
                raw.extend_from_slice(part);
            }
        }
        raw
    };
    let mut out = Vec::with_capacity(fields.values().map(|v| v.len() + 16).sum::<usize>() + 2);
    out.push(b'{');
    for (i, (name, value)) in fields.iter().enumerate() {
        let Ok(text) = std::str::from_utf8(value) else {
            return whole();
        };
        if i > 0 {
            out.push(b',');
        }
        // Writing a &str to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, name);
        out.push(b':');
        let json = text.trim_start_matches(|c: char| c == '\u{feff}' || c.is_whitespace());
        if matches!(json.as_bytes().first(), Some(b'{' | b'[')) {
            if idem_core::json::canonical(json.as_bytes()).is_none() {
                return whole();
            }
            out.extend_from_slice(json.as_bytes());
        } else {
            let _ = serde_json::to_writer(&mut out, text);
        }
    }
    out.push(b'}');
    out
}

/// The default scope of a stream's keys: `stream.{stream}` when that is a
/// valid scope, else `stream:` followed by the first 24 bytes of the
/// SHA-256 of the name in hex (55 bytes in all). The two forms differ at
/// their 7th byte (`.` or `:`), and different names give different
/// `stream.{stream}` scopes and (but for a SHA-256 collision) different
/// hashes, so two streams never share a default scope.
///
/// ```
/// use idem_redis::streams::default_scope;
///
/// assert_eq!(default_scope("payments"), "stream.payments");
/// assert!(default_scope("a stream name with spaces").starts_with("stream:"));
/// ```
pub fn default_scope(stream: &str) -> String {
    let scope = format!("stream.{stream}");
    if IdempotencyKey::new(scope.clone(), "x").is_ok() {
        return scope;
    }
    let hash = Fingerprint::of_bytes(stream.as_bytes()).to_hex();
    format!("stream:{}", &hash[..48])
}

/// What to do with an entry after processing it.
enum Outcome {
    /// Acknowledge it.
    Ack,
    /// Leave it pending; not the entry's fault.
    Pending,
    /// The handler failed: pending, or dead-lettered past `max_deliveries`.
    Failed(String),
    /// Dead-letter it at once, with this reason.
    Dead(String),
    /// Deleted from the stream while pending: acknowledge it.
    Deleted,
    /// Leave it pending and stop `run` with this error.
    Fatal(StoreError),
    /// Its handler ran but the completion is not written: pending, finished
    /// later with this lease.
    Finish(Box<Unrecorded>),
}

/// Entries to finish, by entry ID: the entry (for a dead letter) and the
/// run's lease and completion.
type Unfinished = HashMap<String, (StreamEntry, Box<Unrecorded>)>;

/// `t + d`, or far in the future if that overflows.
fn later(t: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(365 * 24 * 60 * 60)))
        .unwrap_or(t)
}

fn unexpected(what: &str, v: &Value) -> StoreError {
    StoreError::Backend(Box::new(UnexpectedReply(format!("{what}: {v:?}"))))
}

fn text(v: Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(&b).into_owned()),
        Value::SimpleString(s) => Some(s),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn bytes(v: Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b,
        Value::SimpleString(s) => s.into_bytes(),
        Value::Int(n) => n.to_string().into_bytes(),
        other => format!("{other:?}").into_bytes(),
    }
}

/// `[id, [field, value, ...]]`, or `[id, nil]` for an entry deleted from
/// the stream while pending (returned with no fields).
fn entry_of(v: Value) -> Result<Read, StoreError> {
    let Value::Array(mut parts) = v else {
        return Err(unexpected("a stream entry", &v));
    };
    if parts.len() != 2 {
        return Err(unexpected("a stream entry", &Value::Array(parts)));
    }
    let raw_fields = parts.pop().unwrap_or(Value::Nil);
    let id_value = parts.pop().unwrap_or(Value::Nil);
    let id = text(id_value.clone()).ok_or_else(|| unexpected("an entry ID", &id_value))?;
    let raw: Vec<(Vec<u8>, Vec<u8>)> = match raw_fields {
        Value::Nil => Vec::new(),
        Value::Array(items) => {
            let mut raw = Vec::with_capacity(items.len() / 2);
            let mut it = items.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                raw.push((bytes(k), bytes(v)));
            }
            raw
        }
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(k, v)| (bytes(k), bytes(v)))
            .collect(),
        other => return Err(unexpected("the fields of an entry", &other)),
    };
    // Names are kept exactly or the entry is refused: never merged.
    let mut fields = BTreeMap::new();
    let mut problem = None;
    for (name, value) in &raw {
        match std::str::from_utf8(name) {
            Ok(text) => {
                if fields.insert(text.to_owned(), value.clone()).is_some() {
                    problem.get_or_insert_with(|| {
                        format!("the field name {text:?} appears more than once")
                    });
                }
            }
            Err(_) => {
                problem.get_or_insert_with(|| {
                    format!("the field name 0x{} is not UTF-8", hex_of(name))
                });
            }
        }
    }
    let unusable = problem.map(|reason| Unusable {
        reason: format!(
            "{reason}: the entry cannot be given to the handler without merging or dropping fields"
        ),
        raw,
    });
    Ok(Read {
        entry: StreamEntry {
            id,
            fields,
            ..StreamEntry::default()
        },
        unusable,
    })
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|c| format!("{c:02x}")).collect()
}

fn entries_of(v: Value) -> Result<Vec<Read>, StoreError> {
    match v {
        Value::Array(items) => items
            .into_iter()
            .filter(|e| !matches!(e, Value::Nil))
            .map(entry_of)
            .collect(),
        Value::Nil => Ok(Vec::new()),
        other => Err(unexpected("a list of entries", &other)),
    }
}

/// The entries of an `XREADGROUP` reply for one stream: nil (nothing
/// new), `[[stream, entries]]` (RESP2) or `{stream: entries}` (RESP3).
fn read_reply(v: Value) -> Result<Vec<Read>, StoreError> {
    match v {
        Value::Nil => Ok(Vec::new()),
        Value::Array(streams) => {
            let mut out = Vec::new();
            for s in streams {
                match s {
                    Value::Array(mut pair) if pair.len() == 2 => {
                        out.extend(entries_of(pair.pop().unwrap_or(Value::Nil))?)
                    }
                    other => return Err(unexpected("XREADGROUP", &other)),
                }
            }
            Ok(out)
        }
        Value::Map(streams) => {
            let mut out = Vec::new();
            for (_, entries) in streams {
                out.extend(entries_of(entries)?);
            }
            Ok(out)
        }
        other => Err(unexpected("XREADGROUP", &other)),
    }
}

/// `[next cursor, entries, deleted IDs]` of `XAUTOCLAIM`. Entries deleted
/// from the stream are dropped from the pending list by Redis itself.
fn autoclaim_reply(v: Value) -> Result<(String, Vec<Read>), StoreError> {
    let Value::Array(items) = v else {
        return Err(unexpected("XAUTOCLAIM", &v));
    };
    let mut it = items.into_iter();
    let next = it
        .next()
        .and_then(text)
        .ok_or_else(|| unexpected("XAUTOCLAIM", &Value::Nil))?;
    let entries = entries_of(it.next().unwrap_or(Value::Nil))?;
    Ok((next, entries))
}

/// `[[id, consumer, idle, count]]` of `XPENDING stream group id id 1`.
fn pending_count(v: Value) -> Option<(String, u64)> {
    let Value::Array(rows) = v else { return None };
    let Value::Array(row) = rows.into_iter().next()? else {
        return None;
    };
    let mut row = row.into_iter();
    let id = text(row.next()?)?;
    let count = match row.nth(2)? {
        Value::Int(n) => u64::try_from(n).ok()?,
        other => text(other)?.parse().ok()?,
    };
    Some((id, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn replies_parse_in_resp2_and_resp3_and_deleted_entries_have_no_fields() {
        let entries = Value::Array(vec![
            Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![bulk("id"), bulk("a"), bulk("n"), bulk("1")]),
            ]),
            Value::Array(vec![bulk("2-0"), Value::Nil]),
        ]);
        let resp2 = Value::Array(vec![Value::Array(vec![bulk("s"), entries.clone()])]);
        let resp3 = Value::Map(vec![(bulk("s"), entries)]);
        for reply in [resp2, resp3] {
            let got = read_reply(reply).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(got.len(), 2);
            assert_eq!(got[0].entry.text("id"), Some("a"));
            assert!(got[0].unusable.is_none());
            assert!(got[1].entry.fields.is_empty());
        }
        assert!(read_reply(Value::Nil).is_ok_and(|e| e.is_empty()));
        let claim = Value::Array(vec![
            bulk("0-0"),
            Value::Array(vec![]),
            Value::Array(vec![]),
        ]);
        assert!(autoclaim_reply(claim).is_ok_and(|(c, e)| c == "0-0" && e.is_empty()));
        let pending = Value::Array(vec![Value::Array(vec![
            bulk("1-0"),
            bulk("c"),
            Value::Int(10),
            Value::Int(3),
        ])]);
        assert_eq!(pending_count(pending), Some(("1-0".to_owned(), 3)));
        assert_eq!(pending_count(Value::Array(vec![])), None);
        assert!(read_reply(Value::Int(1)).is_err());
    }

    #[test]
    fn binary_or_repeated_field_names_are_refused_not_merged() {
        let raw = |k: &[u8], v: &str| [Value::BulkString(k.to_vec()), bulk(v)];
        for (fields, what) in [
            ([raw(b"\xffa", "1"), raw(b"\xfea", "2")], "not UTF-8"),
            ([raw(b"a", "1"), raw(b"a", "2")], "more than once"),
        ] {
            let entry = Value::Array(vec![
                bulk("1-0"),
                Value::Array(fields.into_iter().flatten().collect()),
            ]);
            let read = entry_of(entry).unwrap_or_else(|e| panic!("{e}"));
            let unusable = read.unusable.unwrap_or_else(|| panic!("{what}: accepted"));
            assert!(unusable.reason.contains(what), "{}", unusable.reason);
            assert_eq!(
                unusable.raw.len(),
                2,
                "every field kept for the dead letter"
            );
        }
    }

    #[test]
    fn default_scopes_are_distinct_and_valid() {
        assert_eq!(default_scope("orders"), "stream.orders");
        let (a, b) = (default_scope("orders/eu"), default_scope("refunds/eu"));
        assert_ne!(a, b);
        for s in [&a, &b] {
            assert!(s.starts_with("stream:") && s.len() == 55, "{s}");
            assert!(IdempotencyKey::new(s.clone(), "x").is_ok(), "{s}");
        }
        let long = "x".repeat(100);
        assert!(IdempotencyKey::new(default_scope(&long), "x").is_ok());
    }

    fn fields_of(fields: &[(&str, &[u8])]) -> BTreeMap<String, Vec<u8>> {
        fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_vec()))
            .collect()
    }

    /// Held: a field's JSON object, the JSON text of a string, the plain
    /// string, `[1]` vs `"[1]"`, whitespace-led JSON, invalid JSON that
    /// starts with `{`, a non-UTF-8 value: never one selection for two
    /// texts a handler reads apart.
    #[test]
    fn field_values_never_read_alike() {
        let fp = |pointers: &[&str], fields: &[(&str, &[u8])]| {
            let p = PayloadFingerprint::json_pointers(pointers.iter().copied())
                .unwrap_or_else(|e| panic!("{e}"));
            p.fingerprint(&fields_as_json(&fields_of(fields)))
        };
        let v = ["/v"];
        assert_ne!(fp(&v, &[("v", b"[1]")]), fp(&v, &[("v", b"\"[1]\"")]));
        assert_ne!(fp(&v, &[("v", b"abc")]), fp(&v, &[("v", b"\"abc\"")]));
        assert_ne!(
            fp(&v, &[("v", b"{\"a\":1}")]),
            fp(&v, &[("v", b"{\"a\":1")])
        );
        assert_ne!(fp(&v, &[("v", b"100")]), fp(&v, &[("v", b"100.0")]));
        assert_ne!(fp(&v, &[("v", b"[1]")]), fp(&v, &[("v", b"[1] x")]));
        // Whitespace-led JSON: the same JSON (by design, as over HTTP).
        assert_eq!(fp(&v, &[("v", b" \n[1]")]), fp(&v, &[("v", b"[1]")]));
        // A value that is not UTF-8: the entry counts whole.
        assert_ne!(
            fp(&v, &[("v", b"1"), ("w", b"\xff")]),
            fp(&v, &[("v", b"1"), ("w", b"\xfe")])
        );
        // 128 deep inside a field: the entry document is 129 deep, whole.
        let deep = |n: &str| format!("{}{}{}", "[".repeat(127), n, "]".repeat(127));
        assert_ne!(
            fp(&["/v/0"], &[("v", deep("1").as_bytes())]),
            fp(&["/v/0"], &[("v", deep("2").as_bytes())])
        );
    }

    /// A field holding a JSON document led by a byte order mark (RFC 8259
    /// section 8.1: a parser may ignore it) is read past the mark; one
    /// that nests past MAX_DEPTH somewhere makes the entry count whole.
    /// Never a string whose parts name nothing: two such entries with
    /// different payments would share a selection (and, with
    /// `key_from_content`, a key: the second payment would never run).
    #[test]
    fn a_field_the_parser_refuses_makes_the_entry_count_whole() {
        let parts = PayloadFingerprint::json_pointers(["/payload/amount", "/payload/account"])
            .unwrap_or_else(|e| panic!("{e}"));
        let bom = |amount: u32, account: &str| {
            format!("\u{feff}{{\"amount\":{amount},\"account\":\"{account}\"}}")
        };
        let deep = |amount: u32, account: &str| {
            format!(
                "{{\"amount\":{amount},\"account\":\"{account}\",\"trace\":{}0{}}}",
                "[".repeat(128),
                "]".repeat(128)
            )
        };
        // What a handler reads: two different payments (a handler that
        // skips a BOM as RFC 8259 allows; the nested form needs a parser
        // without serde_json's default depth limit, as most other
        // languages' parsers are, so it is only shown, not read here).
        let read = |t: &str| {
            serde_json::from_str::<serde_json::Value>(t.trim_start_matches('\u{feff}'))
                .ok()
                .map(|v| (v["amount"].clone(), v["account"].clone()))
        };
        for (form, a, b) in [
            ("BOM-led", bom(100, "a-1"), bom(999_999, "b-2")),
            (
                "nested past 128 elsewhere",
                deep(100, "a-1"),
                deep(999_999, "b-2"),
            ),
        ] {
            let (ra, rb) = (read(&a), read(&b));
            if form == "BOM-led" {
                assert!(ra.is_some() && ra != rb, "{form}: {ra:?} {rb:?}");
            }
            // As a whole body (SQS, Kafka, HTTP): apart.
            let whole = PayloadFingerprint::json_pointers(["/amount", "/account"])
                .unwrap_or_else(|e| panic!("{e}"));
            assert_ne!(
                whole.fingerprint(a.as_bytes()),
                whole.fingerprint(b.as_bytes())
            );
            // As a Streams field: the fingerprint, and so a content key.
            let fa = parts.fingerprint(&fields_as_json(&fields_of(&[("payload", a.as_bytes())])));
            let fb = parts.fingerprint(&fields_as_json(&fields_of(&[("payload", b.as_bytes())])));
            assert_ne!(
                fa, fb,
                "{form}: payments {ra:?} and {rb:?} held in a field share a fingerprint (and a content key)"
            );
        }
    }
}
