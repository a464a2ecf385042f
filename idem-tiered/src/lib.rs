//! Tiered store for [idem](https://docs.rs/idem): fast caches in front of a
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
//! A cache can only answer "this key completed with this response", which
//! stays true until the record's retention ends, so a stale cache entry is
//! impossible short of an operator's `delete` racing a completion. A cache
//! tier that fails or is slower than `cache_timeout` is logged, counted
//! (`idem_tier_errors_total`) and skipped; an entry that does not decode is
//! invalidated and treated as a miss. Fingerprints travel with cache
//! entries, so a key reused with another payload is refused on a cache hit
//! too.
//!
//! Concurrent misses for the same key and payload are merged: one caller
//! looks through the slower tiers and the source, the others wait for its
//! answer (a completed record is shared; if it acquired the key, the others
//! are told it is in progress, which it is).
#![deny(missing_docs)]

#[cfg(feature = "moka")]
mod moka_cache;
#[cfg(feature = "redis")]
mod redis_cache;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    Acquisition, BoxError, CompletedRecord, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
    Record, StoreError,
};
use tokio::sync::watch;

pub use idem_core;
#[cfg(feature = "moka")]
pub use moka_cache::MokaCache;
#[cfg(feature = "redis")]
pub use redis_cache::RedisCache;

/// A failure of a cache tier. Never fatal: the tiered store logs it and
/// falls back to slower tiers.
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

/// A cache tier: holds completed records, nothing else.
#[async_trait]
pub trait RecordCache: Send + Sync + 'static {
    /// A short name for logs and metrics (`moka`, `redis`).
    fn name(&self) -> &str;

    /// The completed record of `key`, if cached.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<CompletedRecord>, CacheError>;

    /// Caches a completed record for `ttl`, unless the key already has an
    /// entry: a completed record never changes while it lives, so an
    /// existing entry is right and must stay (a repeated completion is a
    /// no-op at the source, and must be one here too).
    async fn put(&self, record: &CompletedRecord, ttl: Duration) -> Result<(), CacheError>;

    /// Drops the entry of `key`.
    async fn invalidate(&self, key: &IdempotencyKey) -> Result<(), CacheError>;

    /// Whether the tier lives in this process and never waits on I/O (moka).
    /// Calls to such a tier are not wrapped in the `cache_timeout` timer,
    /// which would cost more than the lookup itself. Default `false`.
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
pub struct TieredStore<S> {
    source: Arc<S>,
    caches: Vec<Arc<dyn RecordCache>>,
    cache_timeout: Duration,
    inflight: Arc<Mutex<HashMap<FlightKey, watch::Receiver<Option<Flight>>>>>,
}

impl<S> Clone for TieredStore<S> {
    fn clone(&self) -> Self {
        TieredStore {
            source: self.source.clone(),
            caches: self.caches.clone(),
            cache_timeout: self.cache_timeout,
            inflight: self.inflight.clone(),
        }
    }
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

impl<S: IdempotencyStore> TieredStore<S> {
    /// A tiered store with `source` as the source of truth and no cache yet.
    pub fn new(source: S) -> Self {
        TieredStore {
            source: Arc::new(source),
            caches: Vec::new(),
            cache_timeout: Duration::from_millis(50),
            inflight: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Adds a cache tier behind the ones already added (add the fastest
    /// first).
    pub fn with_cache(mut self, cache: impl RecordCache) -> Self {
        self.caches.push(Arc::new(cache));
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

    /// Drops `key` from every cache tier (not from the source). Failures
    /// are logged and counted.
    pub async fn invalidate_caches(&self, key: &IdempotencyKey) {
        for cache in &self.caches {
            match self.bounded(cache, cache.invalidate(key)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tier_counter("idem_tier_errors_total", cache.name());
                    tracing::warn!(tier = cache.name(), error = %e, key = %key, "could not invalidate a cache entry");
                }
                Err(_) => {
                    tier_counter("idem_tier_errors_total", cache.name());
                    tracing::warn!(tier = cache.name(), key = %key, "cache invalidation timed out");
                }
            }
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
            Ok(Ok(Some(record))) if record.expires_at > SystemTime::now() => {
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

    /// Writes `record` into tiers `0..end` for its remaining retention.
    async fn fill(&self, end: usize, record: &CompletedRecord) {
        let Ok(ttl) = record.expires_at.duration_since(SystemTime::now()) else {
            return;
        };
        self.put_all(end, record, ttl).await;
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

    /// Tiers after the first, then the source.
    async fn slow_path(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        for i in 1..self.caches.len() {
            if let Some(record) = self.lookup(i, key).await {
                self.fill(i, &record).await;
                return Ok(answer(record, fingerprint));
            }
        }
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
                        Some(record) => Ok(answer(record, fingerprint)),
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

/// A cached completed record as the answer to an acquire with `fingerprint`.
fn answer(record: CompletedRecord, fingerprint: Option<&Fingerprint>) -> Acquisition {
    match (record.fingerprint, fingerprint) {
        (Some(stored), Some(given)) if stored != *given => Acquisition::Mismatch,
        _ => Acquisition::Completed(record),
    }
}

fn tier_counter(name: &'static str, tier: &str) {
    metrics::counter!(name, "tier" => tier.to_owned()).increment(1);
}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for TieredStore<S> {
    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        if !self.caches.is_empty() {
            if let Some(record) = self.lookup(0, key).await {
                return Ok(answer(record, fingerprint));
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
        let now = SystemTime::now();
        self.source.complete(lease, response, retention).await?;
        // The source's retention started after `started`: a TTL counted from
        // `started` ends no later than the source's record.
        let ttl = retention.saturating_sub(started.elapsed());
        let record = CompletedRecord::new(
            lease.key.clone(),
            Bytes::copy_from_slice(response),
            lease.fingerprint,
            lease.attempt,
            now,
            now + retention,
        );
        self.put_all(self.caches.len(), &record, ttl).await;
        Ok(())
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

    /// Invalidates every cache tier it can reach, then deletes from the
    /// source.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.invalidate_caches(key).await;
        self.source.delete(key).await
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        self.source.purge_expired(max).await
    }
}
