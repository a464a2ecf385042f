//! The finishing of responses whose handler ran while the store was away
//! (`IdemError::Unrecorded`): their keys are held in the layer's
//! [`FinishingKeys`](idem_core::FinishingKeys) (a duplicate with the same
//! payload gets 409 without asking the store) while [`finish_later`]
//! writes their completions with the run's own lease
//! ([`Idempotency::finish_until`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::{
    Codec, Fingerprint, Finished, FinishingKeys, Idempotency, IdempotencyKey, IdempotencyStore,
    Pauses,
};

/// How long [`finish_later`] keeps trying.
pub(crate) const FINISH_FOR: Duration = Duration::from_secs(3600);

/// The longest pause between two tries of [`finish_later`]: a client
/// retry at another instance after the lease takes the key over and runs
/// again, so the completion must go in soon after the store is back.
pub(crate) const LONGEST_PAUSE: Duration = Duration::from_millis(100);

/// Writes the completion of a handler that ran while the store was away
/// (`IdemError::Unrecorded`), with its own lease, retrying with a backoff
/// (10 ms to [`LONGEST_PAUSE`], cut short as soon as a request of this
/// layer or another finisher gets an answer from the store: `keys`) until
/// it is written, another worker took the key over, the store refuses it
/// for good, or an hour passed. Whether it gave up (refused or still
/// failing after the hour): the handler ran and its response is not
/// recorded.
pub(crate) async fn finish_later<S: IdempotencyStore + ?Sized, C: Codec>(
    idem: Idempotency<S, C>,
    unrecorded: Box<idem_core::Unrecorded>,
    keys: &FinishingKeys,
) -> bool {
    let key = &unrecorded.lease().key;
    let pauses = Pauses::new(Duration::from_millis(10), LONGEST_PAUSE);
    match idem
        .finish_until_woken(&unrecorded, pauses, tokio::time::sleep(FINISH_FOR), keys)
        .await
    {
        Finished::Recorded => {
            tracing::info!(key = %key, "idempotency layer: the response was recorded after the store came back");
            false
        }
        Finished::TakenOver => {
            tracing::error!(key = %key, "idempotency layer: gave up recording a response whose handler ran: another worker took its key over after the lease");
            false
        }
        Finished::Refused(e) | Finished::GaveUp(e) => {
            tracing::error!(key = %key, error = %e, "idempotency layer: gave up recording a response whose handler ran; this instance answers its retries 409 (not recorded) for the retention, but another instance may take the expired lease over and run it again");
            true
        }
    }
}

/// The keys whose response this layer gave up recording after its handler
/// ran ([`finish_later`] refused for good, or the store away for
/// [`FINISH_FOR`]): a retry with the same payload at this instance gets 409
/// "not recorded" from the layer itself until the retention ends, never a
/// takeover of the expired lease that runs the handler again. Another
/// instance does not know them (the store holds the run in progress, its
/// lease over). One entry per given-up key, pruned as entries expire; a
/// lookup reads one atomic counter while the set is empty.
#[derive(Debug, Default)]
pub(crate) struct GivenUp {
    count: AtomicUsize,
    /// Each key with its run's fingerprint and when it is let go (`None`:
    /// a retention too long for this clock, kept for the process's life).
    keys: Mutex<HashMap<IdempotencyKey, (Fingerprint, Option<Instant>)>>,
}

impl GivenUp {
    /// Keeps `key` (its run's `fingerprint`) for `retention` from now.
    pub(crate) fn insert(
        &self,
        key: IdempotencyKey,
        fingerprint: Fingerprint,
        retention: Duration,
    ) {
        let now = Instant::now();
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.retain(|_, (_, until)| until.is_none_or(|u| u > now));
        keys.insert(key, (fingerprint, now.checked_add(retention)));
        self.count.store(keys.len(), Ordering::Release);
    }

    /// Whether `key` was given up for a run with this `fingerprint` (a
    /// request with another payload goes on to the store, which answers
    /// the mismatch).
    pub(crate) fn holds(&self, key: &IdempotencyKey, fingerprint: &Fingerprint) -> bool {
        if self.count.load(Ordering::Acquire) == 0 {
            return false;
        }
        let now = Instant::now();
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        match keys.get(key) {
            Some((_, Some(until))) if *until <= now => {
                keys.remove(key);
                self.count.store(keys.len(), Ordering::Release);
                false
            }
            Some((held, _)) => held == fingerprint,
            None => false,
        }
    }
}
