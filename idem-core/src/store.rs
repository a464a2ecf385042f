//! The store contract.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{Acquisition, Lease, Record};

/// Where idempotency records live. Every operation is one round trip to the
/// backend and atomic there; time comes from the store's clock.
///
/// The per-key state machine (DESIGN.md section 2):
///
/// ```text
/// absent --acquire--> InProgress(token t, lease L)
/// InProgress --complete(t)--> Completed(response), expires after `retention`
/// InProgress --release(t)--> absent
/// InProgress --extend(t)--> InProgress(lease renewed)
/// InProgress, lease over --acquire--> InProgress(token t', attempt + 1)
/// any write with a stale token --> LeaseLost, nothing changes
/// Completed, past expires_at == absent
/// ```
///
/// A passed lease deadline only *allows* a takeover: until another worker
/// acquires, the holder's `complete`, `release` and `extend` still succeed.
/// A store of your own proves these rules by running
/// `idem_core::testkit` (feature `testkit`).
#[async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Reserves `key` for `lease`, or reports why not. A fingerprint is
    /// stored on first acquisition; a live record with a different one gives
    /// [`Acquisition::Mismatch`] whatever its state (checked only when both
    /// sides have one).
    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError>;

    /// Records `response` for the lease's key and keeps it for `retention`.
    /// [`StoreError::LeaseLost`] if the token no longer holds the key.
    /// Completing again with the lease that completed the record succeeds
    /// and changes nothing (the first response stays), so a completion can
    /// be retried after a lost reply.
    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError>;

    /// Gives the key up (the handler failed or was cancelled): the record is
    /// removed and the next `acquire` runs the handler again.
    async fn release(&self, lease: &Lease) -> Result<(), StoreError>;

    /// Renews the lease for `lease_for` from now (store clock).
    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError>;

    /// Reads the live record of `key`; `None` if absent or expired.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError>;

    /// Removes the record of `key` whatever its state; `true` if a live
    /// (or corrupt) record was removed. An operator's tool, not part of the
    /// normal flow: deleting an in-progress key lets a duplicate run.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError>;

    /// Removes up to `max` expired records and returns how many it removed.
    /// Stores that expire records by themselves (Redis TTLs) return 0.
    /// Expired records are never returned as live, purged or not.
    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError>;
}

/// The future an `#[async_trait]` method returns.
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

macro_rules! forward_store {
    ($ty:ty) => {
        #[async_trait]
        impl<S: IdempotencyStore + ?Sized> IdempotencyStore for $ty {
            // The hot calls hand back the inner store's boxed future as it
            // is: an `async fn` here would box a second future around it
            // on every call (an `Arc<S>`, as the executor holds, resolves
            // to this impl).
            fn acquire<'life0, 'life1, 'life2, 'async_trait>(
                &'life0 self,
                key: &'life1 IdempotencyKey,
                fingerprint: Option<&'life2 Fingerprint>,
                lease: Duration,
            ) -> BoxFuture<'async_trait, Result<Acquisition, StoreError>>
            where
                'life0: 'async_trait,
                'life1: 'async_trait,
                'life2: 'async_trait,
                Self: 'async_trait,
            {
                (**self).acquire(key, fingerprint, lease)
            }
            fn complete<'life0, 'life1, 'life2, 'async_trait>(
                &'life0 self,
                lease: &'life1 Lease,
                response: &'life2 [u8],
                retention: Duration,
            ) -> BoxFuture<'async_trait, Result<(), StoreError>>
            where
                'life0: 'async_trait,
                'life1: 'async_trait,
                'life2: 'async_trait,
                Self: 'async_trait,
            {
                (**self).complete(lease, response, retention)
            }
            async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
                (**self).release(lease).await
            }
            async fn extend(
                &self,
                lease: &Lease,
                lease_for: Duration,
            ) -> Result<Lease, StoreError> {
                (**self).extend(lease, lease_for).await
            }
            async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
                (**self).get(key).await
            }
            async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
                (**self).delete(key).await
            }
            async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
                (**self).purge_expired(max).await
            }
        }
    };
}

forward_store!(Arc<S>);
forward_store!(Box<S>);

/// Runs `store.purge_expired(batch)` every `every` (at least 1 ms; at most
/// [`MAX_DURATION`](crate::MAX_DURATION)) on a tokio task, until
/// the returned handle is aborted or dropped with the runtime. Each tick
/// purges batches until one comes back short, so a backlog drains without
/// one long delete. Errors are logged and the next tick tries again.
///
/// ```no_run
/// # async fn demo() {
/// use std::{sync::Arc, time::Duration};
/// use idem_core::{purge_periodically, MemoryStore};
///
/// let store = Arc::new(MemoryStore::new());
/// let purger = purge_periodically(store.clone(), Duration::from_secs(60), 1_000);
/// // ... on shutdown:
/// purger.abort();
/// # }
/// ```
pub fn purge_periodically<S>(
    store: Arc<S>,
    every: Duration,
    batch: usize,
) -> tokio::task::JoinHandle<()>
where
    S: IdempotencyStore + ?Sized,
{
    let batch = batch.max(1);
    // `interval` panics on a zero period; `Duration::MAX` would overflow.
    let every = crate::saturate(every).max(Duration::from_millis(1));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            loop {
                match store.purge_expired(batch).await {
                    Ok(n) => {
                        if n > 0 {
                            tracing::debug!(purged = n, "purged expired idempotency records");
                        }
                        if (n as usize) < batch {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "purging expired idempotency records failed");
                        break;
                    }
                }
            }
        }
    })
}
