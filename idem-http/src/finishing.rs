//! The finishing of responses whose handler ran while the store was away
//! (`IdemError::Unrecorded`): their keys are held in [`Finishing`] (a
//! duplicate gets 409 without asking the store) while [`finish_later`]
//! writes their completions with the run's own lease.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Codec, Fingerprint, Idempotency, IdempotencyKey, IdempotencyStore};

/// The keys of responses written later, after the store was away: a
/// request with one of them gets 409 here, without asking the store (after
/// the lease, the store would let it take the key over and run again).
#[derive(Default)]
pub(crate) struct Finishing {
    /// How many keys: the request path reads this, and looks into the set
    /// only when it is not zero.
    count: std::sync::atomic::AtomicUsize,
    /// Each key with the fingerprint of the request that ran.
    keys: std::sync::Mutex<std::collections::HashMap<IdempotencyKey, Fingerprint>>,
}

impl Finishing {
    /// Whether `key` is being finished for a request with this
    /// fingerprint. Another payload goes on to the store, which answers
    /// the mismatch (422), whatever the record's state.
    pub(crate) fn holds(&self, key: &IdempotencyKey, fingerprint: &Fingerprint) -> bool {
        self.count.load(std::sync::atomic::Ordering::Acquire) > 0
            && self
                .keys
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(key)
                .is_some_and(|f| f == fingerprint)
    }

    pub(crate) fn insert(&self, key: IdempotencyKey, fingerprint: Fingerprint) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.insert(key, fingerprint).is_none() {
            self.count
                .fetch_add(1, std::sync::atomic::Ordering::Release);
        }
    }

    fn remove(&self, key: &IdempotencyKey) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.remove(key).is_some() {
            self.count
                .fetch_sub(1, std::sync::atomic::Ordering::Release);
        }
    }
}

/// Takes a key out of [`Finishing`] when dropped.
pub(crate) struct FinishingGuard(pub(crate) Arc<Finishing>, pub(crate) IdempotencyKey);

impl Drop for FinishingGuard {
    fn drop(&mut self) {
        self.0.remove(&self.1);
    }
}

/// How long [`finish_later`] keeps trying.
const FINISH_FOR: Duration = Duration::from_secs(3600);

/// Writes the completion of a handler that ran while the store was away
/// (`IdemError::Unrecorded`), with its own lease, retrying with a backoff
/// (10 ms to 500 ms: a client retry after the lease may take the key
/// over, so the completion goes in soon after the store is back) until it
/// is written, another worker took the key over,
/// the store refuses it for good, or an hour passed.
pub(crate) async fn finish_later<S: IdempotencyStore + ?Sized, C: Codec>(
    idem: Idempotency<S, C>,
    unrecorded: Box<idem_core::Unrecorded>,
) {
    let key = &unrecorded.lease().key;
    let give_up = tokio::time::Instant::now() + FINISH_FOR;
    let mut pause = Duration::from_millis(10);
    loop {
        match idem.finish(&unrecorded).await {
            Ok(()) => {
                tracing::info!(key = %key, "idempotency layer: the response was recorded after the store came back");
                return;
            }
            Err(e) if e.is_retryable() && tokio::time::Instant::now() + pause < give_up => {
                tracing::debug!(key = %key, error = %e, "idempotency layer: recording the response later");
            }
            Err(e) => {
                tracing::error!(key = %key, error = %e, "idempotency layer: gave up recording a response whose handler ran; after its lease a retry runs the handler again");
                return;
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}
