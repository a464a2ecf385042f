//! Delivery counts: each failed run of a key is counted by a counter
//! record of its own in the store (see the
//! [crate docs](crate#delivery-counts)).

use std::time::Duration;

use idem_core::{Codec, IdempotencyKey, IdempotencyStore};

use crate::work::Work;

/// The key of the counter of `key`'s failed runs.
pub(crate) fn failure_counter(key: &IdempotencyKey) -> Option<IdempotencyKey> {
    key.counter_of("idem.failures")
}

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// Counts a failed run of `key` and returns the count so far: the
    /// attempt number of a counter record (see the crate docs). `None`
    /// when the store could not count it.
    pub(crate) async fn failures(&self, key: &IdempotencyKey) -> Option<u32> {
        let counter = failure_counter(key)?;
        match self
            .idem
            .store()
            .acquire(&counter, None, Duration::from_millis(1))
            .await
        {
            Ok(idem_core::Acquisition::Acquired(lease)) => Some(lease.attempt),
            Ok(idem_core::Acquisition::InProgress { attempt, .. }) => Some(attempt),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(error = %e, "could not count a failed run");
                None
            }
        }
    }
}
