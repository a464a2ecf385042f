//! A store that can be "down": every call fails with `Unavailable` while
//! its switch is on (a Redis restart, a network partition), wrapped around
//! a real store. For receiver tests that need an outage at an exact point
//! of a handler (the fault suite kills real servers instead).
//!
//! `idemkit::testkit::Tap` injects the other faults (the next n completions
//! failing, releases lost, answers held back, a clock ahead) and counts the
//! calls; a test that only needs completions to fail uses it. What Tap has
//! no switch for is a store that refuses *every* call for a while, the
//! acquires of a takeover and the extends of a heartbeat included: that is
//! this store.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemkit::{
    Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease, Record, StoreError,
};

/// `inner`, failing every call with `Unavailable` while `down` is set.
pub struct FlakyStore<S> {
    pub inner: S,
    pub down: Arc<AtomicBool>,
    /// While set (and the store is up), completions are refused for good
    /// (a non-retryable `Backend` error): a result the store will never
    /// take.
    pub refuse_completes: Arc<AtomicBool>,
}

impl<S> FlakyStore<S> {
    /// `inner`, up; the switch that takes it down.
    pub fn new(inner: S) -> (Self, Arc<AtomicBool>) {
        let down = Arc::new(AtomicBool::new(false));
        (
            FlakyStore {
                inner,
                down: down.clone(),
                refuse_completes: Arc::default(),
            },
            down,
        )
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            Err(StoreError::Unavailable(Box::new(Down)))
        } else {
            Ok(())
        }
    }
}

/// Takes the store of `down` down now and brings it back after `length`,
/// on a thread of its own (it comes back whatever the test's runtime is
/// doing, blocked or shut down).
pub fn outage(down: &Arc<AtomicBool>, length: Duration) {
    down.store(true, Ordering::SeqCst);
    let down = down.clone();
    std::thread::spawn(move || {
        std::thread::sleep(length);
        down.store(false, Ordering::SeqCst);
    });
}

/// The error of a call while the store is down.
#[derive(Debug)]
pub struct Down;

impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the store is down (test)")
    }
}

impl std::error::Error for Down {}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for FlakyStore<S> {
    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        self.check()?;
        self.inner.acquire(key, fingerprint, lease).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.check()?;
        if self.refuse_completes.load(Ordering::SeqCst) {
            return Err(StoreError::backend("completions refused for good (test)"));
        }
        self.inner.complete(lease, response, retention).await
    }
    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.check()?;
        self.inner.release(lease).await
    }
    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.check()?;
        self.inner.extend(lease, lease_for).await
    }
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.check()?;
        self.inner.delete(key).await
    }
    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        self.check()?;
        self.inner.purge_expired(max).await
    }
}
