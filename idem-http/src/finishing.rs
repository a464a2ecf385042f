//! The finishing of responses whose handler ran while the store was away
//! (`IdemError::Unrecorded`): their keys are held in the layer's
//! [`FinishingKeys`](idem_core::FinishingKeys) (a duplicate with the same
//! payload gets 409 without asking the store) while [`finish_later`]
//! writes their completions with the run's own lease
//! ([`Idempotency::finish_until`]).

use std::time::Duration;

use idem_core::{Codec, Finished, FinishingKeys, Idempotency, IdempotencyStore, Pauses};

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
