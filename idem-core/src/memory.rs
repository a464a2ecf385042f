//! The in-process store.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{
    saturate, Acquisition, CompletedRecord, Lease, LeaseToken, Record, RecordState,
    IN_PROGRESS_GRACE,
};
use crate::store::{AcquireItem, IdempotencyStore};

const DEFAULT_SHARDS: usize = 64;

/// Fences of every `MemoryStore` in the process: strictly increasing, so a
/// key's next acquisition always has a higher fence, whatever happened to
/// its record in between.
static NEXT_FENCE: AtomicU64 = AtomicU64::new(1);

fn next_fence() -> u64 {
    NEXT_FENCE.fetch_add(1, Ordering::Relaxed)
}

/// An in-process [`IdempotencyStore`]: a sharded hash map, one mutex per
/// shard, never held across an await.
///
/// It has exactly the semantics of the server-backed stores (it runs the same
/// conformance suite) but lives and dies with the process: use it for tests,
/// single-instance services, and as the default while you pick a backend.
///
/// Time is `tokio::time::Instant`, so tests under `tokio::time::pause()` can
/// move leases and retention forward instantly. Lease tokens come from a
/// per-store counter and are never reused. Expired records are never
/// returned as live; `purge_expired` frees their memory. With
/// [`MemoryStoreBuilder::max_records`] the store refuses new keys with
/// [`StoreError::CapacityExceeded`] when full of live records instead of
/// evicting any.
///
/// Cloning is cheap and shares the records.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// Builds a [`MemoryStore`] with non-default settings.
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    shards: usize,
    max_records: Option<usize>,
}

struct Inner {
    shards: Box<[Mutex<HashMap<IdempotencyKey, Slot>>]>,
    hasher: RandomState,
    next_token: AtomicU64,
    len: AtomicUsize,
    max_records: Option<usize>,
    origin: Instant,
    origin_wall: SystemTime,
}

enum Slot {
    Live(Stored),
    /// Only made by [`MemoryStore::corrupt_for_tests`]: the conformance
    /// suite's corrupt-record case.
    #[cfg_attr(not(feature = "testkit"), allow(dead_code))]
    Corrupt(String),
}

struct Stored {
    state: State,
    fingerprint: Option<Fingerprint>,
    token: u128,
    fence: u64,
    attempt: u32,
    created_at: Instant,
    expires_at: Instant,
}

enum State {
    InProgress {
        lease_until: Instant,
    },
    Completed {
        response: Bytes,
        completed_at: Instant,
    },
}

impl Stored {
    fn is_live(&self, now: Instant) -> bool {
        now < self.expires_at
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("records", &self.len())
            .field("max_records", &self.inner.max_records)
            .finish()
    }
}

impl MemoryStoreBuilder {
    /// Number of shards (rounded up to at least 1). Default 64.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// Refuse new keys once this many records are stored (expired records
    /// are purged first to make room). Default: unbounded.
    pub fn max_records(mut self, max: usize) -> Self {
        self.max_records = Some(max);
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..self.shards)
                    .map(|_| Mutex::new(HashMap::new()))
                    .collect(),
                hasher: RandomState::new(),
                next_token: AtomicU64::new(1),
                len: AtomicUsize::new(0),
                max_records: self.max_records,
                origin: Instant::now(),
                origin_wall: SystemTime::now(),
            }),
        }
    }
}

impl MemoryStore {
    /// An unbounded store with 64 shards.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder for shards and `max_records`.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            shards: DEFAULT_SHARDS,
            max_records: None,
        }
    }

    /// Records held, including expired ones not purged yet.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replaces the record of `key` with one that does not decode, so that
    /// the conformance suite can check that corruption is reported as
    /// [`StoreError::Corrupt`]. Only with the `testkit` feature.
    #[cfg(feature = "testkit")]
    pub fn corrupt_for_tests(&self, key: &IdempotencyKey) {
        let mut shard = self.inner.shard(key);
        if shard
            .insert(
                key.clone(),
                Slot::Corrupt("injected by the test suite".into()),
            )
            .is_none()
        {
            self.inner.len.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl MemoryStore {
    /// One attempt at `acquire`; `Ok(None)` when a bounded store lost the race
    /// for a fresh slot to another insert of the same key.
    fn acquire_now(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Option<Acquisition>, StoreError> {
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let inner = &*self.inner;
        let now = Instant::now();
        let lease_until = later(now, lease);
        let acquired = |token: u128, fence: u64, attempt: u32, stored: Option<Fingerprint>| {
            Acquisition::Acquired(
                Lease::new(
                    key.clone(),
                    LeaseToken::from_u128(token),
                    attempt,
                    inner.wall(lease_until),
                )
                .with_fence(fence)
                .with_fingerprint(stored),
            )
        };
        let fresh = |token, fence| {
            Slot::Live(Stored {
                state: State::InProgress { lease_until },
                fingerprint: fingerprint.copied(),
                token,
                fence,
                attempt: 1,
                created_at: now,
                expires_at: later(lease_until, IN_PROGRESS_GRACE),
            })
        };

        let mut shard = inner.shard(key);
        let s = match shard.get_mut(key) {
            Some(Slot::Corrupt(detail)) => return Err(Inner::corrupt(key, detail)),
            Some(Slot::Live(s)) if s.is_live(now) => s,
            Some(slot) => {
                // Expired: the same as absent; reuse its room.
                let (token, fence) = (inner.token(), next_fence());
                *slot = fresh(token, fence);
                return Ok(Some(acquired(token, fence, 1, fingerprint.copied())));
            }
            None if inner.max_records.is_none() => {
                inner.reserve_slot()?;
                let (token, fence) = (inner.token(), next_fence());
                shard.insert(key.clone(), fresh(token, fence));
                return Ok(Some(acquired(token, fence, 1, fingerprint.copied())));
            }
            None => {
                // Making room may purge every other shard: release this
                // shard's lock first so two full acquires cannot deadlock.
                drop(shard);
                inner.reserve_slot()?;
                let mut shard = inner.shard(key);
                if shard.contains_key(key) {
                    inner.len.fetch_sub(1, Ordering::Relaxed);
                    return Ok(None);
                }
                let (token, fence) = (inner.token(), next_fence());
                shard.insert(key.clone(), fresh(token, fence));
                return Ok(Some(acquired(token, fence, 1, fingerprint.copied())));
            }
        };

        if mismatch(s.fingerprint, fingerprint) {
            return Ok(Some(Acquisition::Mismatch));
        }
        let outcome = match &s.state {
            State::Completed {
                response,
                completed_at,
            } => Acquisition::Completed(
                CompletedRecord::new(
                    key.clone(),
                    response.clone(),
                    s.fingerprint,
                    s.attempt,
                    inner.wall(*completed_at),
                    inner.wall(s.expires_at),
                )
                .with_fence(s.fence)
                .with_ttl(s.expires_at.saturating_duration_since(now)),
            ),
            State::InProgress { lease_until: held } if now < *held => Acquisition::InProgress {
                lease_expires_at: inner.wall(*held),
                retry_after: *held - now,
                attempt: s.attempt,
            },
            State::InProgress { .. } => {
                // Takeover: the holder's lease is over. The fingerprint and
                // the attempt count carry over.
                s.token = inner.token();
                s.fence = next_fence();
                s.attempt = s.attempt.saturating_add(1);
                s.state = State::InProgress { lease_until };
                s.expires_at = later(lease_until, IN_PROGRESS_GRACE);
                if s.fingerprint.is_none() {
                    s.fingerprint = fingerprint.copied();
                }
                acquired(s.token, s.fence, s.attempt, s.fingerprint)
            }
        };
        Ok(Some(outcome))
    }

    /// `complete`, done at once.
    fn complete_now(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.inner.shard(&lease.key);
        match shard.get_mut(&lease.key) {
            Some(Slot::Corrupt(detail)) => Err(Inner::corrupt(&lease.key, detail)),
            Some(Slot::Live(s))
                if s.is_live(now)
                    && s.token == lease.token.as_u128()
                    && matches!(s.state, State::InProgress { .. }) =>
            {
                s.state = State::Completed {
                    response: Bytes::copy_from_slice(response),
                    completed_at: now,
                };
                s.expires_at = later(now, retention);
                Ok(())
            }
            // Completed by this very lease: a retry after a lost reply.
            Some(Slot::Live(s))
                if s.is_live(now)
                    && s.token == lease.token.as_u128()
                    && matches!(s.state, State::Completed { .. }) =>
            {
                Ok(())
            }
            _ => Err(StoreError::LeaseLost),
        }
    }

    /// `acquire`, done at once.
    fn acquire_blocking(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        // `None` only when a bounded store lost a race for a fresh slot to
        // another insert of the same key; the second pass sees that record.
        loop {
            if let Some(outcome) = self.acquire_now(key, fingerprint, lease)? {
                return Ok(outcome);
            }
        }
    }
}

impl Inner {
    fn shard(&self, key: &IdempotencyKey) -> MutexGuard<'_, HashMap<IdempotencyKey, Slot>> {
        let index = (self.hasher.hash_one(key) as usize) % self.shards.len();
        // A poisoned shard only means a panic elsewhere while it was held;
        // every update below leaves the map consistent, so keep going.
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn wall(&self, t: Instant) -> SystemTime {
        self.origin_wall + t.saturating_duration_since(self.origin)
    }

    fn token(&self) -> u128 {
        u128::from(self.next_token.fetch_add(1, Ordering::Relaxed))
    }

    fn record(&self, key: &IdempotencyKey, s: &Stored) -> Record {
        let state = match &s.state {
            State::InProgress { lease_until } => RecordState::InProgress {
                lease_expires_at: self.wall(*lease_until),
            },
            State::Completed {
                response,
                completed_at,
            } => RecordState::Completed {
                response: response.clone(),
                completed_at: self.wall(*completed_at),
            },
        };
        Record::new(
            key.clone(),
            state,
            s.fingerprint,
            LeaseToken::from_u128(s.token),
            s.attempt,
            self.wall(s.created_at),
            self.wall(s.expires_at),
        )
        .with_fence(s.fence)
    }

    /// Makes room for one more record, or says the store is full.
    fn reserve_slot(&self) -> Result<(), StoreError> {
        let Some(max) = self.max_records else {
            self.len.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        for purged_once in [false, true] {
            let mut current = self.len.load(Ordering::Relaxed);
            while current < max {
                match self.len.compare_exchange_weak(
                    current,
                    current + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return Ok(()),
                    Err(actual) => current = actual,
                }
            }
            if !purged_once {
                self.purge(usize::MAX, None);
            }
        }
        Err(StoreError::CapacityExceeded { max_records: max })
    }

    /// Removes up to `max` expired records; `skip` is a shard index whose
    /// lock the caller already holds.
    fn purge(&self, max: usize, skip: Option<usize>) -> u64 {
        let now = Instant::now();
        let mut removed = 0usize;
        for (i, shard) in self.shards.iter().enumerate() {
            if removed >= max {
                break;
            }
            if Some(i) == skip {
                continue;
            }
            let mut map = shard.lock().unwrap_or_else(|p| p.into_inner());
            map.retain(|_, slot| match slot {
                Slot::Live(s) if !s.is_live(now) && removed < max => {
                    removed += 1;
                    false
                }
                _ => true,
            });
        }
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed as u64
    }

    fn corrupt(key: &IdempotencyKey, detail: &str) -> StoreError {
        StoreError::Corrupt {
            key: key.clone(),
            detail: detail.to_owned(),
        }
    }
}

/// `t + d` with `d` saturated to [`MAX_DURATION`](crate::MAX_DURATION),
/// never overflowing.
fn later(t: Instant, d: Duration) -> Instant {
    let d = saturate(d);
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(86_400 * 365)))
        .unwrap_or(t)
}

fn mismatch(stored: Option<Fingerprint>, given: Option<&Fingerprint>) -> bool {
    matches!((stored, given), (Some(a), Some(b)) if a != *b)
}

#[async_trait]
impl IdempotencyStore for MemoryStore {
    fn backend_name(&self) -> &'static str {
        "memory"
    }

    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        self.acquire_blocking(key, fingerprint, lease)
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.complete_now(lease, response, retention)
    }

    /// One pass over the items, each as `acquire` would do it, in order.
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
        Ok(items
            .iter()
            .map(|item| self.acquire_blocking(item.key, item.fingerprint, lease))
            .collect())
    }

    /// One pass over the items, each as `complete` would do it, in order.
    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        Ok(items
            .iter()
            .map(|(lease, response)| self.complete_now(lease, response, retention))
            .collect())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.inner.shard(&lease.key);
        match shard.get(&lease.key) {
            Some(Slot::Corrupt(detail)) => Err(Inner::corrupt(&lease.key, detail)),
            Some(Slot::Live(s))
                if s.is_live(now)
                    && s.token == lease.token.as_u128()
                    && matches!(s.state, State::InProgress { .. }) =>
            {
                shard.remove(&lease.key);
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(StoreError::LeaseLost),
        }
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        if lease_for.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let now = Instant::now();
        let mut shard = self.inner.shard(&lease.key);
        match shard.get_mut(&lease.key) {
            Some(Slot::Corrupt(detail)) => Err(Inner::corrupt(&lease.key, detail)),
            Some(Slot::Live(s))
                if s.is_live(now)
                    && s.token == lease.token.as_u128()
                    && matches!(s.state, State::InProgress { .. }) =>
            {
                let lease_until = later(now, lease_for);
                s.state = State::InProgress { lease_until };
                s.expires_at = later(lease_until, IN_PROGRESS_GRACE);
                Ok(Lease::new(
                    lease.key.clone(),
                    lease.token,
                    s.attempt,
                    self.inner.wall(lease_until),
                )
                .with_fence(s.fence)
                .with_fingerprint(s.fingerprint))
            }
            _ => Err(StoreError::LeaseLost),
        }
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let now = Instant::now();
        let shard = self.inner.shard(key);
        match shard.get(key) {
            Some(Slot::Corrupt(detail)) => Err(Inner::corrupt(key, detail)),
            Some(Slot::Live(s)) if s.is_live(now) => Ok(Some(self.inner.record(key, s))),
            _ => Ok(None),
        }
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut shard = self.inner.shard(key);
        match shard.remove(key) {
            Some(slot) => {
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
                Ok(match slot {
                    Slot::Corrupt(_) => true,
                    Slot::Live(s) => s.is_live(now),
                })
            }
            None => Ok(false),
        }
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        Ok(self.inner.purge(max, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> IdempotencyKey {
        IdempotencyKey::new("mem.test", id).unwrap_or_else(|e| panic!("{e}"))
    }

    #[tokio::test(start_paused = true)]
    async fn max_records_refuses_without_evicting() {
        let store = MemoryStore::builder().max_records(2).shards(4).build();
        let lease = Duration::from_secs(10);
        let Ok(Acquisition::Acquired(a)) = store.acquire(&key("a"), None, lease).await else {
            panic!("a not acquired")
        };
        let b = store.acquire(&key("b"), None, lease).await;
        assert!(matches!(b, Ok(Acquisition::Acquired(_))), "{b:?}");

        let full = store.acquire(&key("c"), None, lease).await;
        assert!(
            matches!(full, Err(StoreError::CapacityExceeded { max_records: 2 })),
            "{full:?}"
        );
        assert!(full.as_ref().err().is_some_and(StoreError::is_retryable));
        // Live records were not evicted to make room.
        for id in ["a", "b"] {
            let again = store.acquire(&key(id), None, lease).await;
            assert!(
                matches!(again, Ok(Acquisition::InProgress { .. })),
                "{again:?}"
            );
        }

        // Once a record has expired, its room is reused.
        assert!(store
            .complete(&a, b"done", Duration::from_secs(1))
            .await
            .is_ok());
        tokio::time::advance(Duration::from_secs(2)).await;
        let c = store.acquire(&key("c"), None, lease).await;
        assert!(matches!(c, Ok(Acquisition::Acquired(_))), "{c:?}");
        assert_eq!(store.len(), 2);
        assert!(matches!(store.get(&key("a")).await, Ok(None)));
    }
}
