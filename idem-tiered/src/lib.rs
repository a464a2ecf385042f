//! Tiered store for [idem](https://docs.rs/idemkit): fast caches in front of a
//! source of truth.
//!
//! [`TieredStore`] is itself an [`IdempotencyStore`]. It answers a
//! duplicate of a completed key from the fastest tier that holds it (an
//! in-process [`MokaCache`], then a [`RedisCache`], then the source of truth,
//! say a PostgreSQL `PgStore`), and writes a completed record found in a
//! slower tier into every faster one (fill on hit), with a time to live no
//! longer than the record's remaining retention.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{Idempotency, MemoryStore};
//! use idem_tiered::{MokaCache, RedisCache, TieredStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let source = MemoryStore::new(); // in production: a PgStore
//! let store = TieredStore::new(source)
//!     .with_cache(MokaCache::new(100_000, 256 << 20)) // fastest first
//!     .with_cache(RedisCache::connect("redis://127.0.0.1:6379/").await?)
//!     .cache_timeout(Duration::from_millis(50));
//! let idem = Idempotency::new(store);
//! # Ok(()) }
//! ```
//!
//! # What each tier guarantees
//!
//! Correctness comes from the source of truth alone: `acquire`, `complete`,
//! `release` and `extend` go to it, and only **completed** records are ever
//! cached (an in-progress record in a cache could let a duplicate through).
//! A cache may *speed up* an answer, never *change* it:
//!
//! - A fill's time to live is the record's remaining retention **as the
//!   store computed it on its own clock** ([`CompletedRecord::ttl`]); the
//!   application's clock never enters, so a database clock ahead of the
//!   application cannot make a cache replay past the retention.
//! - Every entry carries the record's fence, and [`RecordCache::put`]
//!   replaces an entry with a lower fence: a newer completion corrects an
//!   older entry, an older one never overwrites a newer.
//! - A cache may answer "replay"; a "mismatch" seen in a cache is confirmed
//!   at the source before it is returned (the entry may be stale).
//! - [`delete`](IdempotencyStore::delete) deletes from the source, then
//!   leaves a tombstone in every tier (for
//!   [`tombstone_ttl`](TieredStore::tombstone_ttl)) that refuses every
//!   record older than what the source holds after the delete (all of
//!   them, if it holds nothing): a fill racing the delete (read before it,
//!   written after) or a completion written through while it ran is
//!   refused or replaced instead of resurrecting the entry. If a tier
//!   cannot be reached, `delete` returns an error: the key may still replay
//!   from that tier.
//! - Other application instances' in-process tiers are reached through an
//!   invalidation channel ([`RedisInvalidation`], Redis pub/sub): a delete
//!   in one instance tombstones the key in every instance's moka within
//!   milliseconds. A message is lost if an instance is disconnected from
//!   Redis at that moment; bound the staleness that could leave with
//!   [`MokaCache::max_ttl`].
//!
//! A cache tier that fails or is slower than `cache_timeout` is logged,
//! counted (`idem_tier_errors_total`) and skipped; an entry that does not
//! decode is invalidated and treated as a miss. Fingerprints travel with
//! cache entries.
//!
//! A batch ([`acquire_many`](IdempotencyStore::acquire_many)) looks its
//! keys up in each tier in one pass (concurrent lookups), answers the
//! completed ones from the fastest tier that holds them, and sends the rest
//! to the source in one `acquire_many`; `complete_many` completes at the
//! source in one call, then writes through.
//!
//! Concurrent misses for the same key and payload are merged: one caller
//! looks through the slower tiers and the source, the others wait for its
//! answer (a completed record is shared; if it acquired the key, the others
//! are told it is in progress, which it is).
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "redis")]
mod invalidation;
#[cfg(feature = "moka")]
mod moka_cache;
#[cfg(feature = "redis")]
mod redis_cache;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::join_all;
use idem_core::{
    AcquireItem, Acquisition, BoxError, CompletedRecord, Fingerprint, IdempotencyKey,
    IdempotencyStore, Lease, Record, StoreError,
};
use tokio::sync::watch;

pub use idem_core;
#[cfg(feature = "redis")]
pub use invalidation::RedisInvalidation;
#[cfg(feature = "moka")]
pub use moka_cache::{MokaCache, ENTRY_OVERHEAD_BYTES};
/// The redis crate this crate is built on, for [`RedisCache::new`] and
/// [`RedisInvalidation`] connections (`idemkit::tiered::redis`).
#[cfg(feature = "redis")]
pub use redis;
#[cfg(feature = "redis")]
pub use redis_cache::RedisCache;

/// A failure of a cache tier. Never fatal: the tiered store logs it and
/// falls back to slower tiers.
///
/// ```
/// use idem_tiered::CacheError;
///
/// let e = CacheError::Undecodable("bad header".to_owned());
/// assert_eq!(e.to_string(), "cache entry does not decode: bad header");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// The tier could not be reached or failed.
    #[error("cache tier unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// An entry did not decode; it is invalidated and treated as a miss.
    #[error("cache entry does not decode: {0}")]
    Undecodable(String),
}

/// A cache tier: holds completed records (and tombstones), nothing else.
///
/// Entries are ordered by the record's fence ([`CompletedRecord::fence`]):
/// an entry is only ever replaced by one with a higher fence, and a
/// tombstone refuses every record with a fence up to its own.
///
/// A tier is used through [`TieredStore::with_cache`]; called directly:
///
/// ```
/// # #[cfg(feature = "moka")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::{Duration, SystemTime};
/// use idem_core::{CompletedRecord, IdempotencyKey};
/// use idem_tiered::{MokaCache, RecordCache};
///
/// let tier = MokaCache::new(1_000, 1 << 20);
/// let key = IdempotencyKey::new("orders.ship", "o-1")?;
/// let now = SystemTime::now();
/// let shipped = bytes::Bytes::from_static(b"shipped");
/// let record = CompletedRecord::new(key.clone(), shipped.clone(), None, 1, now, now + Duration::from_secs(60))
///     .with_fence(7);
/// tier.put(&record, Duration::from_secs(60)).await?;
/// assert_eq!(tier.get(&key).await?.map(|r| r.response), Some(shipped));
/// tier.invalidate(&key).await?;
/// assert!(tier.get(&key).await?.is_none());
/// # Ok(()) }
/// # #[cfg(not(feature = "moka"))] fn main() {}
/// ```
#[async_trait]
pub trait RecordCache: Send + Sync + 'static {
    /// A short name for logs and metrics (`moka`, `redis`).
    fn name(&self) -> &str;

    /// The completed record of `key`, if cached (a tombstone is a miss),
    /// with [`ttl`](CompletedRecord::ttl) set to the time the entry has
    /// left by this tier's own clock.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<CompletedRecord>, CacheError>;

    /// Caches a completed record for `ttl`, unless the key's entry (a
    /// record or a tombstone) has a fence at least as high: a repeated
    /// completion changes nothing, a newer one replaces an older entry, and
    /// a record read before a delete never replaces the delete's tombstone.
    async fn put(&self, record: &CompletedRecord, ttl: Duration) -> Result<(), CacheError>;

    /// Replaces the key's entry with a tombstone for `ttl` that refuses
    /// every record with a fence up to `fence`, unless the entry has a
    /// higher fence (a completion that came after the delete).
    async fn tombstone(
        &self,
        key: &IdempotencyKey,
        fence: u64,
        ttl: Duration,
    ) -> Result<(), CacheError>;

    /// Drops the entry of `key` (an entry that does not decode).
    async fn invalidate(&self, key: &IdempotencyKey) -> Result<(), CacheError>;

    /// Drops every entry, for an in-process tier that may have missed
    /// invalidations. Default: nothing (a shared tier misses none).
    async fn clear(&self) -> Result<(), CacheError> {
        Ok(())
    }

    /// Whether the tier lives in this process and never waits on I/O (moka).
    /// Calls to such a tier are not wrapped in the `cache_timeout` timer,
    /// which would cost more than the lookup itself, and such tiers are the
    /// ones an invalidation channel reaches. Default `false`.
    fn in_process(&self) -> bool {
        false
    }
}

type FlightKey = (IdempotencyKey, Option<Fingerprint>);

#[derive(Clone)]
enum Flight {
    Done(Acquisition),
    Failed,
}

/// Cache tiers in front of a source of truth; see the crate docs.
///
/// ```
/// # #[cfg(feature = "moka")]
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use idem_core::{Idempotency, IdempotencyKey, MemoryStore, Processed};
/// use idem_tiered::{MokaCache, TieredStore};
///
/// let store = TieredStore::new(MemoryStore::new()) // in production: a PgStore
///     .with_cache(MokaCache::new(10_000, 16 << 20))
///     .cache_timeout(Duration::from_millis(50));
/// let idem = Idempotency::new(store);
/// let key = IdempotencyKey::new("emails.send", "welcome-7")?;
/// let send = |to: &String| { let to = to.clone(); async move { Ok::<_, std::io::Error>(format!("sent to {to}")) } };
/// let first = idem.process(&key, &"a@b.c".to_owned(), send).await?;
/// let again = idem.process(&key, &"a@b.c".to_owned(), send).await?; // from moka
/// assert_eq!(first, Processed::Executed("sent to a@b.c".to_owned()));
/// assert_eq!(again, Processed::Replayed("sent to a@b.c".to_owned()));
/// # Ok(()) }
/// # #[cfg(not(feature = "moka"))] fn main() {}
/// ```
pub struct TieredStore<S> {
    source: Arc<S>,
    caches: Vec<Arc<dyn RecordCache>>,
    /// The in-process tiers, which an invalidation channel updates.
    local: Arc<RwLock<Vec<Arc<dyn RecordCache>>>>,
    channel: Option<Arc<dyn InvalidationChannel>>,
    /// Stops the channel's subscriber when the last clone is dropped.
    subscription: Option<Arc<Subscription>>,
    cache_timeout: Duration,
    tombstone_ttl: Duration,
    inflight: Arc<Mutex<HashMap<FlightKey, watch::Receiver<Option<Flight>>>>>,
}

impl<S> Clone for TieredStore<S> {
    fn clone(&self) -> Self {
        TieredStore {
            source: self.source.clone(),
            caches: self.caches.clone(),
            local: self.local.clone(),
            channel: self.channel.clone(),
            subscription: self.subscription.clone(),
            cache_timeout: self.cache_timeout,
            tombstone_ttl: self.tombstone_ttl,
            inflight: self.inflight.clone(),
        }
    }
}

/// Carries deletes to the other instances of the application, whose
/// in-process tiers then tombstone the key; see [`RedisInvalidation`].
///
/// ```no_run
/// # #[cfg(feature = "redis")]
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::IdempotencyKey;
/// use idem_tiered::{Invalidation, InvalidationChannel, RedisInvalidation};
///
/// let channel = RedisInvalidation::connect("redis://127.0.0.1:6379/").await?;
/// // What a TieredStore does with it: listen, and publish its deletes.
/// let _subscription = channel.subscribe(Box::new(|message: Invalidation| {
///     println!("{message:?}");
///     true // keep listening
/// }));
/// channel.publish(&IdempotencyKey::new("orders.ship", "o-1")?, 7).await?;
/// # Ok(()) }
/// ```
#[async_trait]
pub trait InvalidationChannel: Send + Sync + 'static {
    /// Tells every instance (this one included) that `key` was deleted
    /// with the record of fence `fence`.
    async fn publish(&self, key: &IdempotencyKey, fence: u64) -> Result<(), CacheError>;

    /// Starts delivering the deletes published by any instance to
    /// `deliver`, until the returned [`Subscription`] is dropped (the
    /// tiered store keeps it while any clone of it lives) or `deliver`
    /// returns `false`. After every (re)subscription it delivers
    /// [`Invalidation::All`]: messages published while unsubscribed are
    /// lost.
    fn subscribe(&self, deliver: Box<dyn Fn(Invalidation) -> bool + Send + Sync>) -> Subscription;
}

/// A running subscription of an [`InvalidationChannel`]: dropping it stops
/// the subscriber (its task and its connection).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use idem_tiered::Subscription;
///
/// let task = tokio::spawn(std::future::pending::<()>());
/// let subscription = Subscription::new(task.abort_handle());
/// drop(subscription); // stops the task
/// assert!(task.await.unwrap_err().is_cancelled());
/// # }
/// ```
#[derive(Debug)]
pub struct Subscription(Option<tokio::task::AbortHandle>);

impl Subscription {
    /// A subscription run by a tokio task.
    pub fn new(task: tokio::task::AbortHandle) -> Self {
        Subscription(Some(task))
    }

    /// A subscription with nothing to stop.
    pub fn none() -> Self {
        Subscription(None)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// What an [`InvalidationChannel`] delivers.
///
/// ```
/// use idem_core::IdempotencyKey;
/// use idem_tiered::Invalidation;
///
/// # fn main() -> Result<(), idem_core::KeyError> {
/// let message = Invalidation::Key { key: IdempotencyKey::new("orders.ship", "o-1")?, fence: 7 };
/// match message {
///     Invalidation::Key { key, fence } => println!("tombstone {key} up to fence {fence}"),
///     Invalidation::All => println!("drop every in-process entry"),
///     _ => {}
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invalidation {
    /// `key` was deleted with the record of fence `fence`: tombstone it.
    Key {
        /// The deleted key.
        key: IdempotencyKey,
        /// The deleted record's fence.
        fence: u64,
    },
    /// Deletes may have been missed: drop every in-process entry.
    All,
}

impl<S> std::fmt::Debug for TieredStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore")
            .field(
                "caches",
                &self
                    .caches
                    .iter()
                    .map(|c| c.name().to_owned())
                    .collect::<Vec<_>>(),
            )
            .field("cache_timeout", &self.cache_timeout)
            .finish()
    }
}

/// Removes a leader's in-flight entry when it finishes or is dropped.
struct FlightGuard<'a> {
    inflight: &'a Mutex<HashMap<FlightKey, watch::Receiver<Option<Flight>>>>,
    key: Option<FlightKey>,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            lock(self.inflight).remove(&key);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

impl<S: IdempotencyStore> TieredStore<S> {
    /// A tiered store with `source` as the source of truth and no cache yet.
    pub fn new(source: S) -> Self {
        TieredStore {
            source: Arc::new(source),
            caches: Vec::new(),
            local: Arc::new(RwLock::new(Vec::new())),
            channel: None,
            subscription: None,
            cache_timeout: Duration::from_millis(50),
            tombstone_ttl: Duration::from_secs(600),
            inflight: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Adds a cache tier behind the ones already added (add the fastest
    /// first).
    pub fn with_cache(mut self, cache: impl RecordCache) -> Self {
        let cache: Arc<dyn RecordCache> = Arc::new(cache);
        if cache.in_process() {
            write(&self.local).push(cache.clone());
        }
        self.caches.push(cache);
        self
    }

    /// Carries deletes to the other instances of the application over
    /// `channel` (say [`RedisInvalidation`] on the Redis they share): their
    /// in-process tiers tombstone the key within milliseconds. Needs a
    /// tokio runtime (it spawns the subscriber).
    pub fn with_invalidation(mut self, channel: impl InvalidationChannel) -> Self {
        let channel: Arc<dyn InvalidationChannel> = Arc::new(channel);
        let local = Arc::downgrade(&self.local);
        let ttl = self.tombstone_ttl;
        let subscription = channel.subscribe(Box::new(move |message| {
            let Some(local) = local.upgrade() else {
                return false;
            };
            let caches: Vec<_> = read(&local).clone();
            if caches.is_empty() {
                return true;
            }
            tokio::spawn(async move {
                for cache in caches {
                    let applied = match &message {
                        Invalidation::Key { key, fence } => cache.tombstone(key, *fence, ttl).await,
                        Invalidation::All => cache.clear().await,
                    };
                    if let Err(e) = applied {
                        tier_counter("idem_tier_errors_total", cache.name());
                        tracing::warn!(tier = cache.name(), error = %e, ?message, "could not apply a delete from another instance");
                    }
                }
            });
            true
        }));
        self.channel = Some(channel);
        self.subscription = Some(Arc::new(subscription));
        self
    }

    /// How long a delete's tombstone refuses stale fills (default 10
    /// minutes): longer than any source call can take, so a record read
    /// before a delete cannot be cached after it.
    pub fn tombstone_ttl(mut self, ttl: Duration) -> Self {
        self.tombstone_ttl = ttl.max(Duration::from_millis(1));
        self
    }

    /// The longest a cache call may take before the tier is skipped for
    /// that call (default 50 ms).
    pub fn cache_timeout(mut self, timeout: Duration) -> Self {
        self.cache_timeout = timeout;
        self
    }

    /// The source of truth.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// Drops `key` from every cache tier of this instance (not from the
    /// source, nor from other instances' in-process tiers). An error names
    /// the tiers that could not be reached.
    pub async fn invalidate_caches(&self, key: &IdempotencyKey) -> Result<(), StoreError> {
        let mut failed = Vec::new();
        for cache in &self.caches {
            let error = match self.bounded(cache, cache.invalidate(key)).await {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("timed out after {:?}", self.cache_timeout),
            };
            tier_counter("idem_tier_errors_total", cache.name());
            tracing::warn!(tier = cache.name(), error = %error, key = %key, "could not invalidate a cache entry");
            failed.push(format!("{}: {error}", cache.name()));
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(StoreError::unavailable(format!(
                "{key} may still replay from a cache: {}",
                failed.join("; ")
            )))
        }
    }

    /// Tombstones `key` up to `fence` in every tier of this instance and,
    /// through the channel, in every other instance's in-process tiers.
    async fn tombstone_everywhere(
        &self,
        key: &IdempotencyKey,
        fence: u64,
    ) -> Result<(), StoreError> {
        let mut failed = Vec::new();
        for cache in &self.caches {
            let outcome = self
                .bounded(cache, cache.tombstone(key, fence, self.tombstone_ttl))
                .await;
            let error = match outcome {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("timed out after {:?}", self.cache_timeout),
            };
            tier_counter("idem_tier_errors_total", cache.name());
            tracing::warn!(tier = cache.name(), error = %error, key = %key, "could not invalidate a cache entry");
            failed.push(format!("{}: {error}", cache.name()));
        }
        if let Some(channel) = &self.channel {
            if let Err(e) = channel.publish(key, fence).await {
                tracing::warn!(error = %e, key = %key, "could not publish a delete to the other instances");
                failed.push(format!("invalidation channel: {e}"));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(StoreError::unavailable(format!(
                "{key} may still replay from a cache: {}",
                failed.join("; ")
            )))
        }
    }

    /// Runs a call to `cache` within `cache_timeout`, or unbounded when the
    /// tier is in-process.
    async fn bounded<T>(
        &self,
        cache: &Arc<dyn RecordCache>,
        call: impl std::future::Future<Output = T>,
    ) -> Result<T, tokio::time::error::Elapsed> {
        if cache.in_process() {
            Ok(call.await)
        } else {
            tokio::time::timeout(self.cache_timeout, call).await
        }
    }

    /// Looks `key` up in tier `i`; `None` on a miss or a failure.
    async fn lookup(&self, i: usize, key: &IdempotencyKey) -> Option<CompletedRecord> {
        let cache = &self.caches[i];
        match self.bounded(cache, cache.get(key)).await {
            // The tier expires its entries itself, on its own clock.
            Ok(Ok(Some(record))) if !record.ttl.is_zero() => {
                tier_counter("idem_tier_hits_total", cache.name());
                Some(record)
            }
            Ok(Ok(_)) => None,
            Ok(Err(CacheError::Undecodable(detail))) => {
                tier_counter("idem_tier_errors_total", cache.name());
                tracing::warn!(tier = cache.name(), key = %key, %detail, "undecodable cache entry: invalidated, treated as a miss");
                let _ = self.bounded(cache, cache.invalidate(key)).await;
                None
            }
            Ok(Err(e)) => {
                tier_counter("idem_tier_errors_total", cache.name());
                tracing::warn!(tier = cache.name(), error = %e, "cache tier failed; skipped");
                None
            }
            Err(_) => {
                tier_counter("idem_tier_errors_total", cache.name());
                tracing::warn!(tier = cache.name(), timeout = ?self.cache_timeout, "cache tier timed out; skipped");
                None
            }
        }
    }

    /// Writes `record` into tiers `0..end` for its remaining retention as
    /// the tier or store that answered computed it on its own clock.
    async fn fill(&self, end: usize, record: &CompletedRecord) {
        self.put_all(end, record, record.ttl).await;
    }

    async fn put_all(&self, end: usize, record: &CompletedRecord, ttl: Duration) {
        if ttl.is_zero() {
            return;
        }
        for cache in &self.caches[..end] {
            match self.bounded(cache, cache.put(record, ttl)).await {
                Ok(Ok(())) => tier_counter("idem_tier_fills_total", cache.name()),
                Ok(Err(e)) => {
                    tier_counter("idem_tier_errors_total", cache.name());
                    tracing::warn!(tier = cache.name(), error = %e, "cache fill failed");
                }
                Err(_) => {
                    tier_counter("idem_tier_errors_total", cache.name());
                    tracing::warn!(tier = cache.name(), "cache fill timed out");
                }
            }
        }
    }

    /// Writes a record the source completed (its call started at
    /// `started`) into every cache tier.
    async fn write_through(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
        started: tokio::time::Instant,
    ) {
        // The source's retention started after `started` (by the source's
        // clock, it started when the call arrived): a TTL counted from
        // `started` on this process's monotonic clock ends no later than
        // the source's record, whatever the wall clocks say.
        let ttl = retention.saturating_sub(started.elapsed());
        let now = SystemTime::now();
        let record = CompletedRecord::new(
            lease.key.clone(),
            Bytes::copy_from_slice(response),
            lease.fingerprint,
            lease.attempt,
            now,
            now.checked_add(ttl).unwrap_or(now),
        )
        .with_fence(lease.fence)
        .with_ttl(ttl);
        self.put_all(self.caches.len(), &record, ttl).await;
    }

    /// Tiers after the first, then the source.
    async fn slow_path(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        for i in 1..self.caches.len() {
            if let Some(record) = self.lookup(i, key).await {
                if let Some(replay) = answer(&record, fingerprint) {
                    self.fill(i, &record).await;
                    return Ok(replay);
                }
                // A mismatch is confirmed at the source.
                break;
            }
        }
        self.ask_source(key, fingerprint, lease).await
    }

    /// Asks the source, filling every tier with a completed record.
    async fn ask_source(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        let outcome = self.source.acquire(key, fingerprint, lease).await?;
        if let Acquisition::Completed(record) = &outcome {
            tier_counter("idem_tier_hits_total", "source");
            self.fill(self.caches.len(), record).await;
        }
        Ok(outcome)
    }

    /// `slow_path`, merged with concurrent calls for the same key and
    /// fingerprint.
    async fn merged_slow_path(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        let flight_key: FlightKey = (key.clone(), fingerprint.copied());
        let waiting = {
            let mut inflight = lock(&self.inflight);
            match inflight.get(&flight_key) {
                Some(rx) => Err(rx.clone()),
                None => {
                    let (tx, rx) = watch::channel(None);
                    inflight.insert(flight_key.clone(), rx);
                    Ok(tx)
                }
            }
        };
        match waiting {
            Ok(tx) => {
                let _guard = FlightGuard {
                    inflight: &self.inflight,
                    key: Some(flight_key),
                };
                // A caller that missed the first tier just before the last
                // leader filled it becomes a leader after that leader left:
                // look again, the fill happened before the leader left.
                let result = match self.caches.is_empty() {
                    false => match self.lookup(0, key).await {
                        Some(record) => match answer(&record, fingerprint) {
                            Some(replay) => Ok(replay),
                            None => self.ask_source(key, fingerprint, lease).await,
                        },
                        None => self.slow_path(key, fingerprint, lease).await,
                    },
                    true => self.slow_path(key, fingerprint, lease).await,
                };
                let shared = match &result {
                    Ok(outcome) => Flight::Done(outcome.clone()),
                    Err(_) => Flight::Failed,
                };
                let _ = tx.send(Some(shared));
                result
            }
            Err(mut rx) => {
                let seen = rx
                    .wait_for(|v| v.is_some())
                    .await
                    .ok()
                    .and_then(|v| v.clone());
                match seen {
                    Some(Flight::Done(Acquisition::Acquired(held))) => {
                        Ok(Acquisition::InProgress {
                            lease_expires_at: held.expires_at,
                            retry_after: lease,
                            attempt: held.attempt,
                        })
                    }
                    Some(Flight::Done(outcome)) => Ok(outcome),
                    // The leader failed or was cancelled: ask for ourselves.
                    Some(Flight::Failed) | None => self.slow_path(key, fingerprint, lease).await,
                }
            }
        }
    }
}

/// A cached completed record as the answer to an acquire with
/// `fingerprint`: the replay, or `None` for a mismatch, which only the
/// source may confirm (the entry may be stale: deleted, then reused).
fn answer(record: &CompletedRecord, fingerprint: Option<&Fingerprint>) -> Option<Acquisition> {
    match (record.fingerprint, fingerprint) {
        (Some(stored), Some(given)) if stored != *given => None,
        _ => Some(Acquisition::Completed(record.clone())),
    }
}

fn tier_counter(name: &'static str, tier: &str) {
    metrics::counter!(name, "tier" => tier.to_owned()).increment(1);
}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for TieredStore<S> {
    fn backend_name(&self) -> &'static str {
        "tiered"
    }

    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        if !self.caches.is_empty() {
            if let Some(record) = self.lookup(0, key).await {
                if let Some(replay) = answer(&record, fingerprint) {
                    return Ok(replay);
                }
                return self.ask_source(key, fingerprint, lease).await;
            }
        }
        self.merged_slow_path(key, fingerprint, lease).await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        let started = tokio::time::Instant::now();
        let retention = idem_core::saturate(retention);
        self.source.complete(lease, response, retention).await?;
        self.write_through(lease, response, retention, started)
            .await;
        Ok(())
    }

    /// One lookup pass per cache tier for all the items still unanswered
    /// (concurrent lookups: a Redis tier pipelines them), fills as
    /// `acquire` does, then **one** `acquire_many` on the source for the
    /// misses and the mismatches seen in a cache (which only the source
    /// may confirm), in the items' order. Concurrent misses of a key are
    /// not merged with other callers' as `acquire` merges them: the source
    /// answers the whole batch in one call anyway. If the source call
    /// fails and caches answered some items, those keep their answers and
    /// the others get the source's error.
    async fn acquire_many(
        &self,
        items: &[AcquireItem<'_>],
        lease: Duration,
    ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let mut out: Vec<Option<Result<Acquisition, StoreError>>> =
            items.iter().map(|_| None).collect();
        let mut to_source: Vec<usize> = Vec::new();
        let mut pending: Vec<usize> = (0..items.len()).collect();
        for tier in 0..self.caches.len() {
            if pending.is_empty() {
                break;
            }
            let found = join_all(pending.iter().map(|&j| self.lookup(tier, items[j].key))).await;
            let mut misses = Vec::new();
            let mut fills = Vec::new();
            for (&j, record) in pending.iter().zip(found) {
                match record {
                    Some(record) => match answer(&record, items[j].fingerprint) {
                        Some(replay) => {
                            out[j] = Some(Ok(replay));
                            if tier > 0 {
                                fills.push(record);
                            }
                        }
                        // A mismatch is confirmed at the source.
                        None => to_source.push(j),
                    },
                    None => misses.push(j),
                }
            }
            join_all(fills.iter().map(|record| self.fill(tier, record))).await;
            pending = misses;
        }
        to_source.extend(pending);
        // The source sees the items in the batch's order.
        to_source.sort_unstable();
        if !to_source.is_empty() {
            let asked: Vec<AcquireItem<'_>> = to_source.iter().map(|&j| items[j]).collect();
            match self.source.acquire_many(&asked, lease).await {
                Ok(answers) => {
                    let mut fills = Vec::new();
                    for (&j, answer) in to_source.iter().zip(answers) {
                        if let Ok(Acquisition::Completed(record)) = &answer {
                            tier_counter("idem_tier_hits_total", "source");
                            fills.push(record.clone());
                        }
                        out[j] = Some(answer);
                    }
                    join_all(
                        fills
                            .iter()
                            .map(|record| self.fill(self.caches.len(), record)),
                    )
                    .await;
                }
                Err(e) if to_source.len() == items.len() => return Err(e),
                Err(e) => {
                    for &j in &to_source {
                        out[j] = Some(Err(e.replicate()));
                    }
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|answer| {
                answer.unwrap_or_else(|| {
                    Err(StoreError::backend(
                        "the source answered fewer items than it was asked",
                    ))
                })
            })
            .collect())
    }

    /// The source's `complete_many`, then a write-through to every cache
    /// tier of each item it completed, as `complete` does.
    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let started = tokio::time::Instant::now();
        let retention = idem_core::saturate(retention);
        let done = self.source.complete_many(items, retention).await?;
        join_all(
            items
                .iter()
                .zip(&done)
                .filter(|(_, done)| done.is_ok())
                .map(|((lease, response), _)| {
                    self.write_through(lease, response, retention, started)
                }),
        )
        .await;
        Ok(done)
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.source.release(lease).await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.source.extend(lease, lease_for).await
    }

    /// From the source of truth (caches hold completed records only).
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.source.get(key).await
    }

    /// Deletes the record from the source, then tombstones the key in
    /// every cache tier (and, through the invalidation channel, in every
    /// instance's in-process tiers) so that no record the delete removed,
    /// nor any older one, is replayed or filled again. If a tier could not
    /// be reached, the source is deleted all the same and the error says
    /// the key may still replay from that tier.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        match self.source.delete(key).await {
            Ok(deleted) => self.invalidate_after_delete(key).await.map(|()| deleted),
            // The delete may have gone through with its reply lost: no tier
            // may go on replaying what the source may no longer hold. The
            // caller gets the source's error (it may retry the delete).
            Err(e) => {
                if let Err(tiers) = self.invalidate_after_delete(key).await {
                    tracing::warn!(key = %key, error = %tiers, "tiered store: the source's delete failed and a tier could not be tombstoned");
                }
                Err(e)
            }
        }
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        self.source.purge_expired(max).await
    }
}

impl<S: IdempotencyStore> TieredStore<S> {
    /// What [`delete`](IdempotencyStore::delete) does after deleting in
    /// the source of truth, for a record deleted there by other means (an
    /// operator tool's conditional delete): tombstones `key` in every tier
    /// of this instance and, through the invalidation channel, in every
    /// other instance's in-process tiers, so no cache replays it. An error
    /// says a tier may still replay the key.
    pub async fn invalidate_after_delete(&self, key: &IdempotencyKey) -> Result<(), StoreError> {
        // Whatever the delete removed (the record read by a racing fill, or
        // one completed while the delete ran) has a lower fence than any
        // record acquired after it: read what the source holds now. With a
        // newer record, refuse everything below its fence; with none,
        // refuse everything until the tombstone expires (a completion
        // acquired after the delete is then answered by the source, not
        // the caches: slower, never wrong).
        // The source unreadable: refuse everything (the safe side).
        let fence = match self.source.get(key).await {
            Ok(Some(record)) => record.fence.saturating_sub(1),
            Ok(None) | Err(_) => u64::MAX,
        };
        self.tombstone_everywhere(key, fence).await
    }
}
