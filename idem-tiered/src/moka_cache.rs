//! The in-process tier.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_core::{CompletedRecord, IdempotencyKey};
use moka::future::Cache;
use moka::Expiry;

use crate::{CacheError, RecordCache};

#[derive(Clone)]
struct Entry {
    record: CompletedRecord,
    ttl: Duration,
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
        Some(entry.ttl)
    }

    fn expire_after_update(
        &self,
        _: &IdempotencyKey,
        entry: &Arc<Entry>,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.ttl)
    }
}

/// An in-process cache tier on a moka `future::Cache`, bounded by both a
/// number of entries and a total weight in bytes, each entry expiring with
/// its record's remaining retention. Like every moka cache it may refuse or
/// evict entries (TinyLFU): a cache miss only costs a slower tier.
#[derive(Clone)]
pub struct MokaCache {
    cache: Cache<IdempotencyKey, Arc<Entry>>,
}

impl std::fmt::Debug for MokaCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MokaCache")
            .field("entries", &self.cache.entry_count())
            .finish()
    }
}

impl MokaCache {
    /// At most `max_entries` entries and `max_bytes` bytes of responses and
    /// keys (each entry weighs at least `max_bytes / max_entries`, so both
    /// bounds hold).
    pub fn new(max_entries: u64, max_bytes: u64) -> Self {
        let max_entries = max_entries.max(1);
        let max_bytes = max_bytes.max(1);
        let floor = (max_bytes / max_entries).max(1);
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(move |key: &IdempotencyKey, entry: &Arc<Entry>| {
                let bytes =
                    (entry.record.response.len() + key.scope().len() + key.id().len() + 96) as u64;
                bytes.max(floor).min(u64::from(u32::MAX)) as u32
            })
            .expire_after(PerEntryTtl)
            .build();
        MokaCache { cache }
    }

    /// Entries held now (moka updates the count lazily).
    pub fn entry_count(&self) -> u64 {
        self.cache.entry_count()
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
        Ok(self.cache.get(key).await.map(|e| e.record.clone()))
    }

    async fn put(&self, record: &CompletedRecord, ttl: Duration) -> Result<(), CacheError> {
        let entry = Arc::new(Entry {
            record: record.clone(),
            ttl,
        });
        self.cache.entry(record.key.clone()).or_insert(entry).await;
        Ok(())
    }

    async fn invalidate(&self, key: &IdempotencyKey) -> Result<(), CacheError> {
        self.cache.invalidate(key).await;
        Ok(())
    }
}
