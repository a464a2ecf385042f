//! The store contract.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{Acquisition, Lease, Record};
use crate::telemetry::StoreOperation;

/// Where idempotency records live. Every operation is one round trip to the
/// backend and atomic there; time comes from the store's clock.
///
/// The per-key state machine:
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
    /// The `backend` label of the store-call latency histogram
    /// ([`STORE_DURATION_SECONDS`](crate::STORE_DURATION_SECONDS)): a short
    /// static name such as `"memory"`, `"redis"`, `"postgres"`, `"tiered"`.
    /// The default is `"custom"`; a wrapper forwards its inner store's.
    fn backend_name(&self) -> &'static str {
        "custom"
    }

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

    /// Acquires every item of a batch, as calling [`acquire`](Self::acquire)
    /// on each item **in order** would: a key that appears twice sees the
    /// effect of its earlier item (the second delivery of a fresh key is
    /// [`Acquisition::InProgress`], held by the first; with another
    /// fingerprint it is [`Acquisition::Mismatch`]).
    ///
    /// The answer holds one result per item, in the items' order. An inner
    /// error is that item's own (a [`StoreError::Corrupt`] record of one key
    /// does not fail the others). The outer error means the call as a whole
    /// failed (the store is unavailable, the call timed out): nothing, or an
    /// unknown part of the batch, was applied, so the caller must treat
    /// **every** item as unknown, exactly as a single `acquire` that
    /// returned [`StoreError::Unavailable`] (a reservation it may have made
    /// is held by nobody, and frees itself when its lease ends).
    ///
    /// An empty batch answers an empty list without a round trip. A zero
    /// lease is refused ([`StoreError::zero_lease`]) before anything is
    /// written.
    ///
    /// The default calls `acquire` for each item, one after the other (one
    /// round trip each), so every store supports it; once an item finds
    /// the store unavailable, the items after it are not sent and get
    /// [`StoreError::Unavailable`] of their own (the items before keep
    /// their results). A store with a batched form answers a batch in one
    /// round trip (or one per shard).
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
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            if stopped(&out) {
                out.push(Err(not_sent()));
                continue;
            }
            out.push(self.acquire(item.key, item.fingerprint, lease).await);
        }
        Ok(out)
    }

    /// Completes every lease of a batch with its response, as calling
    /// [`complete`](Self::complete) on each item in order would (per item:
    /// [`StoreError::LeaseLost`], [`StoreError::ResponseTooLarge`], ...).
    ///
    /// The errors have the structure of
    /// [`acquire_many`](Self::acquire_many): one inner result per item, in
    /// order; the outer error means the call failed as a whole and any
    /// part of it may have been applied (completing again with the same
    /// leases is safe: a completion is a compare-and-set on the token, and
    /// completing a record with the lease that completed it changes
    /// nothing). An empty batch answers an empty list without a round
    /// trip. The default calls `complete` for each item, one after the
    /// other, and stops sending as the default `acquire_many` does.
    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for (lease, response) in items {
            if stopped(&out) {
                out.push(Err(not_sent()));
                continue;
            }
            out.push(self.complete(lease, response, retention).await);
        }
        Ok(out)
    }
}

/// Whether the default batch loop stops sending: the last item found the
/// store unavailable, so the next ones would wait for their own timeouts
/// one after the other. The items done before keep their results (a lease
/// acquired is not lost); the rest get [`not_sent`].
fn stopped<T>(done: &[Result<T, StoreError>]) -> bool {
    matches!(done.last(), Some(Err(StoreError::Unavailable(_))))
}

/// The inner error of an item that the default batch loop did not send:
/// nothing was written for it; retryable.
fn not_sent() -> StoreError {
    StoreError::unavailable(
        "not sent: an earlier item of the batch found the store unavailable; nothing was written",
    )
}

/// One item of [`IdempotencyStore::acquire_many`]: a key and the payload's
/// fingerprint, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireItem<'a> {
    /// The key to acquire.
    pub key: &'a IdempotencyKey,
    /// The payload's fingerprint (checked as in
    /// [`acquire`](IdempotencyStore::acquire)).
    pub fingerprint: Option<&'a Fingerprint>,
}

impl<'a> AcquireItem<'a> {
    /// An item for `key` with an optional fingerprint.
    pub fn new(key: &'a IdempotencyKey, fingerprint: Option<&'a Fingerprint>) -> Self {
        AcquireItem { key, fingerprint }
    }
}

/// The future an `#[async_trait]` method returns.
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

macro_rules! forward_store {
    ($ty:ty) => {
        #[async_trait]
        impl<S: IdempotencyStore + ?Sized> IdempotencyStore for $ty {
            fn backend_name(&self) -> &'static str {
                (**self).backend_name()
            }
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
            async fn acquire_many(
                &self,
                items: &[AcquireItem<'_>],
                lease: Duration,
            ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
                (**self).acquire_many(items, lease).await
            }
            async fn complete_many(
                &self,
                items: &[(&Lease, &[u8])],
                retention: Duration,
            ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
                (**self).complete_many(items, retention).await
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
                let call = store.purge_expired(batch);
                match crate::telemetry::timed(
                    store.backend_name(),
                    StoreOperation::PurgeExpired,
                    call,
                )
                .await
                {
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::testkit::Tap;
    use crate::MemoryStore;

    fn key(id: &str) -> IdempotencyKey {
        IdempotencyKey::new("store.test", id).unwrap_or_else(|e| panic!("{e}"))
    }

    const LEASE: Duration = Duration::from_secs(30);

    /// Only the required methods: the batch operations are the defaults.
    /// Calls after the first `up` ones find the store unavailable.
    struct Plain {
        inner: MemoryStore,
        up: usize,
        calls: AtomicUsize,
    }

    impl Plain {
        fn down(&self) -> Result<(), StoreError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) >= self.up {
                return Err(StoreError::unavailable("test: down"));
            }
            Ok(())
        }
    }

    #[async_trait]
    impl IdempotencyStore for Plain {
        async fn acquire(
            &self,
            key: &IdempotencyKey,
            fingerprint: Option<&Fingerprint>,
            lease: Duration,
        ) -> Result<Acquisition, StoreError> {
            self.down()?;
            self.inner.acquire(key, fingerprint, lease).await
        }
        async fn complete(
            &self,
            lease: &Lease,
            response: &[u8],
            retention: Duration,
        ) -> Result<(), StoreError> {
            self.down()?;
            self.inner.complete(lease, response, retention).await
        }
        async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
            self.inner.release(lease).await
        }
        async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
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

    #[tokio::test]
    async fn the_default_loop_keeps_what_it_did_and_stops_sending_when_the_store_is_down() {
        let store = Plain {
            inner: MemoryStore::new(),
            up: 2,
            calls: AtomicUsize::new(0),
        };
        let keys = [key("a"), key("b"), key("c"), key("d")];
        let items: Vec<_> = keys.iter().map(|k| AcquireItem::new(k, None)).collect();
        let got = store
            .acquire_many(&items, LEASE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.len(), 4);
        assert!(matches!(got[0], Ok(Acquisition::Acquired(_))), "{got:?}");
        assert!(matches!(got[1], Ok(Acquisition::Acquired(_))), "{got:?}");
        assert!(matches!(got[2], Err(StoreError::Unavailable(_))), "{got:?}");
        assert!(matches!(got[3], Err(StoreError::Unavailable(_))), "{got:?}");
        // The fourth was not sent: three calls, not four.
        assert_eq!(store.calls.load(Ordering::SeqCst), 3);
        assert!(matches!(store.inner.get(&keys[3]).await, Ok(None)));

        // Empty: no call at all; a zero lease: refused before any call.
        assert!(matches!(store.acquire_many(&[], LEASE).await, Ok(v) if v.is_empty()));
        assert!(matches!(store.complete_many(&[], LEASE).await, Ok(v) if v.is_empty()));
        assert!(matches!(
            store.acquire_many(&items, Duration::ZERO).await,
            Err(StoreError::InvalidArgument { .. })
        ));
        assert_eq!(store.calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn arc_and_box_forward_the_batch_operations() {
        let tap = Arc::new(Tap::new(MemoryStore::new()));
        let k = key("forwarded");
        let items = [AcquireItem::new(&k, None)];
        let as_arc: Arc<Tap<MemoryStore>> = tap.clone();
        let boxed: Box<dyn IdempotencyStore> = Box::new(tap.clone());
        let got = as_arc.acquire_many(&items, LEASE).await;
        let Ok(Some(Ok(Acquisition::Acquired(lease)))) = got.map(|v| v.into_iter().next()) else {
            panic!("not acquired")
        };
        let again = boxed.acquire_many(&items, LEASE).await;
        assert!(
            matches!(again.as_deref(), Ok([Ok(Acquisition::InProgress { .. })])),
            "{again:?}"
        );
        let done = boxed
            .complete_many(&[(&lease, b"r".as_slice())], LEASE)
            .await;
        assert!(matches!(done.as_deref(), Ok([Ok(())])), "{done:?}");
        // Through Arc and Box, the wrapped store's own batch operations ran.
        assert_eq!(tap.acquire_batches(), 2);
        assert_eq!(tap.complete_batches(), 1);
    }
}
