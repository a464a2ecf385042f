//! [`Tap`]: a store wrapper for tests that counts calls and injects faults.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease, Record, StoreError,
};

/// Wraps a real store for a test: every call goes to it, the calls that
/// matter to the executor are counted, and two faults can be injected, the
/// ones that make duplicates happen: completions failing as if the store
/// were restarting, and releases that never arrive, as from a process that
/// died. Not a mock: the wrapped store does all the work.
#[derive(Debug, Default)]
pub struct Tap<S> {
    inner: S,
    acquires: AtomicUsize,
    completes: AtomicUsize,
    releases: AtomicUsize,
    extends: AtomicUsize,
    failing_completes: AtomicUsize,
    drop_releases: AtomicBool,
}

impl<S> Tap<S> {
    /// Wraps `inner`, counting from zero, with no fault.
    pub fn new(inner: S) -> Self {
        Tap {
            inner,
            acquires: AtomicUsize::new(0),
            completes: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
            extends: AtomicUsize::new(0),
            failing_completes: AtomicUsize::new(0),
            drop_releases: AtomicBool::new(false),
        }
    }

    /// The wrapped store (calls on it are not counted).
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// `acquire` calls so far.
    pub fn acquires(&self) -> usize {
        self.acquires.load(Ordering::SeqCst)
    }

    /// `complete` calls so far, failed ones included.
    pub fn completes(&self) -> usize {
        self.completes.load(Ordering::SeqCst)
    }

    /// `release` calls so far, dropped ones included.
    pub fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }

    /// `extend` calls so far.
    pub fn extends(&self) -> usize {
        self.extends.load(Ordering::SeqCst)
    }

    /// The next `n` completions fail with [`StoreError::Unavailable`]
    /// without reaching the store.
    pub fn fail_completes(&self, n: usize) {
        self.failing_completes.store(n, Ordering::SeqCst);
    }

    /// Injected completion failures not used yet.
    pub fn failing_completes_left(&self) -> usize {
        self.failing_completes.load(Ordering::SeqCst)
    }

    /// While on, releases report success without reaching the store: the
    /// worker's process died before it could send them.
    pub fn drop_releases(&self, on: bool) {
        self.drop_releases.store(on, Ordering::SeqCst);
    }
}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for Tap<S> {
    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        self.inner.acquire(key, fingerprint, lease).await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        let injected = self
            .failing_completes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if injected {
            return Err(StoreError::unavailable(
                "injected by Tap: the store is restarting",
            ));
        }
        self.inner.complete(lease, response, retention).await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        if self.drop_releases.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.release(lease).await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(lease, lease_for).await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.inner.delete(key).await
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(max).await
    }
}
