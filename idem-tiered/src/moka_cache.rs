//! The in-process tier.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{CompletedRecord, IdempotencyKey};
use moka::future::Cache;
use moka::ops::compute::Op;
use moka::Expiry;

use crate::{CacheError, RecordCache};

/// A cached record, or a delete's tombstone; either lives for `ttl` from
/// `stored`.
#[derive(Clone)]
enum Entry {
    Record {
        record: CompletedRecord,
        ttl: Duration,
        stored: Instant,
    },
    Tombstone {
        fence: u64,
        ttl: Duration,
    },
}

impl Entry {
    fn fence(&self) -> u64 {
        match self {
            Entry::Record { record, .. } => record.fence,
            Entry::Tombstone { fence, .. } => *fence,
        }
    }

    fn ttl(&self) -> Duration {
        match self {
            Entry::Record { ttl, .. } | Entry::Tombstone { ttl, .. } => *ttl,
        }
    }
}

/// Each entry lives for the time to live it was put with.
struct PerEntryTtl;

impl Expiry<IdempotencyKey, Arc<Entry>> for PerEntryTtl {
    fn expire_after_create(
        &self,
        _: &IdempotencyKey,
        entry: &Arc<Entry>,
        _: Instant,
    ) -> Option<Duration> {
        Some(entry.ttl())
    }

    fn expire_after_update(
        &self,
        _: &IdempotencyKey,
        entry: &Arc<Entry>,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.ttl())
    }
}

/// What an entry of [`MokaCache`] takes beyond its response and its key
/// (counted twice): moka's per-entry bookkeeping (hash table slot, access
/// and write order, per-entry expiry), the record's fields and the
/// allocator's rounding. Measured on x86_64 Linux with glibc's allocator
/// and moka 0.12 as the growth of resident memory per entry over 200,000
/// entries (`tests/stores/moka_weight.rs`, which checks the weight against it
/// within 25%).
///
/// ```
/// // A million 200-byte responses under 40-byte keys weigh about 1 GB:
/// let per_entry = 200 + 2 * 40 + idem_tiered::ENTRY_OVERHEAD_BYTES;
/// assert!(per_entry * 1_000_000 < 1 << 30);
/// ```
pub const ENTRY_OVERHEAD_BYTES: u64 = 720;

/// An in-process cache tier on a moka `future::Cache`, bounded by both a
/// number of entries and a total weight in bytes, each entry expiring with
/// its record's remaining retention (as the store computed it), or sooner
/// with [`max_ttl`](Self::max_ttl). Entries are ordered by fence: a put
/// never replaces an entry with a higher or equal fence, and a delete's
/// tombstone refuses records up to its fence. Like every moka cache it may
/// refuse or evict entries (TinyLFU): a cache miss only costs a slower tier.
///
/// ```
/// use std::time::Duration;
/// use idem_tiered::MokaCache;
///
/// // At most 100,000 entries and 256 MiB; no entry outlives an hour, which
/// // bounds how long a missed invalidation can replay a deleted key.
/// let tier = MokaCache::new(100_000, 256 << 20).max_ttl(Duration::from_secs(3_600));
/// assert_eq!(tier.entry_count(), 0);
/// ```
#[derive(Clone)]
pub struct MokaCache {
    cache: Cache<IdempotencyKey, Arc<Entry>>,
    max_ttl: Duration,
}

impl std::fmt::Debug for MokaCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MokaCache")
            .field("entries", &self.cache.entry_count())
            .field("max_ttl", &self.max_ttl)
            .finish()
    }
}

impl MokaCache {
    /// At most `max_entries` entries and `max_bytes` bytes of memory, as
    /// measured: an entry weighs its response, twice its key (moka keeps
    /// one copy, the record another) and [`ENTRY_OVERHEAD_BYTES`] for moka's
    /// bookkeeping and the record's fields (each entry weighs at least
    /// `max_bytes / max_entries`, so both bounds hold). With 200-byte
    /// responses and 40-byte keys an entry takes about 1 KB: a budget of
    /// 1 GiB holds about a million of them.
    pub fn new(max_entries: u64, max_bytes: u64) -> Self {
        let max_entries = max_entries.max(1);
        let max_bytes = max_bytes.max(1);
        let floor = (max_bytes / max_entries).max(1);
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(move |key: &IdempotencyKey, entry: &Arc<Entry>| {
                let body = match &**entry {
                    Entry::Record { record, .. } => record.response.len(),
                    Entry::Tombstone { .. } => 0,
                };
                let key_bytes = key.scope().len() + key.id().len();
                let bytes = (body + 2 * key_bytes) as u64 + ENTRY_OVERHEAD_BYTES;
                bytes.max(floor).min(u64::from(u32::MAX)) as u32
            })
            .expire_after(PerEntryTtl)
            .build();
        MokaCache {
            cache,
            max_ttl: idem_core::MAX_DURATION,
        }
    }

    /// Keeps no entry longer than `max_ttl`, whatever the record's
    /// retention: bounds how long an entry can outlive a delete whose
    /// invalidation message this instance missed (default: no bound).
    pub fn max_ttl(mut self, max_ttl: Duration) -> Self {
        self.max_ttl = max_ttl.max(Duration::from_millis(1));
        self
    }

    /// Entries held now (moka updates the count lazily).
    pub fn entry_count(&self) -> u64 {
        self.cache.entry_count()
    }

    /// The bytes the cache counts against `max_bytes` now, after applying
    /// the writes it has queued (each entry weighs what it takes in memory:
    /// see [`new`](Self::new)).
    pub async fn weighted_bytes(&self) -> u64 {
        self.cache.run_pending_tasks().await;
        self.cache.weighted_size()
    }

    /// Writes `entry` unless the key's entry has a higher fence, or an
    /// equal one and `keep_equal`.
    async fn put_ordered(&self, key: IdempotencyKey, entry: Entry, keep_equal: bool) {
        let fence = entry.fence();
        let entry = Arc::new(entry);
        self.cache
            .entry(key)
            .and_compute_with(|existing| {
                let op = match existing {
                    Some(old)
                        if old.value().fence() > fence
                            || (keep_equal && old.value().fence() == fence) =>
                    {
                        Op::Nop
                    }
                    _ => Op::Put(entry),
                };
                std::future::ready(op)
            })
            .await;
    }
}

#[async_trait]
impl RecordCache for MokaCache {
    fn name(&self) -> &str {
        "moka"
    }

    fn in_process(&self) -> bool {
        true
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<CompletedRecord>, CacheError> {
        Ok(match self.cache.get(key).await.as_deref() {
            Some(Entry::Record {
                record,
                ttl,
                stored,
            }) => {
                let left = ttl.saturating_sub(stored.elapsed());
                (!left.is_zero()).then(|| record.clone().with_ttl(left))
            }
            Some(Entry::Tombstone { .. }) | None => None,
        })
    }

    async fn put(&self, record: &CompletedRecord, ttl: Duration) -> Result<(), CacheError> {
        let ttl = ttl.min(self.max_ttl);
        if ttl.is_zero() {
            return Ok(());
        }
        let key = record.key.clone();
        let mut record = record.clone();
        // A store's response may be a slice of a larger reply (Redis hands
        // out the record's header with it): keep only the response's bytes.
        record.response = Bytes::copy_from_slice(&record.response);
        let entry = Entry::Record {
            record,
            ttl,
            stored: Instant::now(),
        };
        self.put_ordered(key, entry, true).await;
        Ok(())
    }

    async fn tombstone(
        &self,
        key: &IdempotencyKey,
        fence: u64,
        ttl: Duration,
    ) -> Result<(), CacheError> {
        let ttl = ttl.max(Duration::from_millis(1));
        self.put_ordered(key.clone(), Entry::Tombstone { fence, ttl }, false)
            .await;
        Ok(())
    }

    async fn invalidate(&self, key: &IdempotencyKey) -> Result<(), CacheError> {
        self.cache.invalidate(key).await;
        Ok(())
    }

    async fn clear(&self) -> Result<(), CacheError> {
        self.cache.invalidate_all();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::time::SystemTime;

    fn record(fence: u64, body: &'static str) -> CompletedRecord {
        let key = IdempotencyKey::new("moka.test", "k").unwrap_or_else(|e| panic!("{e}"));
        let now = SystemTime::now();
        CompletedRecord::new(key, Bytes::from_static(body.as_bytes()), None, 1, now, now)
            .with_fence(fence)
    }

    async fn body(cache: &MokaCache) -> Option<Bytes> {
        let key = IdempotencyKey::new("moka.test", "k").unwrap_or_else(|e| panic!("{e}"));
        cache.get(&key).await.ok().flatten().map(|r| r.response)
    }

    /// DESIGN 5 cache rules: `put` replaces an entry with a lower fence and
    /// never one with a higher; a tombstone refuses records up to its
    /// fence and yields to a later completion.
    #[tokio::test]
    async fn entries_are_ordered_by_fence_and_tombstones_refuse_stale_fills() {
        let cache = MokaCache::new(100, 1 << 20);
        let ttl = Duration::from_secs(60);
        let k = record(0, "").key;
        let put = |r: CompletedRecord| {
            let cache = cache.clone();
            async move { cache.put(&r, ttl).await.ok() }
        };
        put(record(5, "five")).await;
        put(record(7, "seven")).await;
        assert_eq!(
            body(&cache).await.as_deref(),
            Some(&b"seven"[..]),
            "a newer completion replaces"
        );
        put(record(6, "six")).await;
        put(record(7, "other")).await;
        assert_eq!(
            body(&cache).await.as_deref(),
            Some(&b"seven"[..]),
            "older or equal never replaces"
        );
        assert!(cache.tombstone(&k, 7, ttl).await.is_ok());
        assert_eq!(body(&cache).await, None, "a tombstone is a miss");
        put(record(7, "seven")).await;
        assert_eq!(
            body(&cache).await,
            None,
            "a stale fill after the delete is refused"
        );
        put(record(8, "eight")).await;
        assert_eq!(
            body(&cache).await.as_deref(),
            Some(&b"eight"[..]),
            "a completion after the delete is cached"
        );
        assert!(cache.tombstone(&k, 7, ttl).await.is_ok());
        assert_eq!(
            body(&cache).await.as_deref(),
            Some(&b"eight"[..]),
            "an older tombstone never hides a newer record"
        );
    }

    #[tokio::test]
    async fn ttl_is_what_is_left_and_capped_by_max_ttl() {
        let cache = MokaCache::new(100, 1 << 20).max_ttl(Duration::from_secs(5));
        assert!(cache
            .put(&record(1, "x"), Duration::from_secs(3_600))
            .await
            .is_ok());
        let key = record(1, "x").key;
        let got = cache.get(&key).await.ok().flatten().map(|r| r.ttl);
        assert!(
            got.is_some_and(|t| t <= Duration::from_secs(5) && t > Duration::from_secs(4)),
            "{got:?}"
        );
    }
}
