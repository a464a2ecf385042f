//! Delivery counts: each failed run of a key is counted by a counter
//! record of its own in the store (see the
//! [crate docs](crate#delivery-counts)).

use idem_core::{Codec, IdempotencyKey, IdempotencyStore};

use crate::work::Work;

/// The key of the counter of `key`'s failed runs.
pub(crate) fn failure_counter(key: &IdempotencyKey) -> Option<IdempotencyKey> {
    idem_core::delivery::failure_counter(key)
}

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// Counts a failed run of `key` and returns the count so far
    /// ([`idem_core::delivery::count_failure`]). `None` when the store
    /// could not count it.
    pub(crate) async fn failures(&self, key: &IdempotencyKey) -> Option<u32> {
        idem_core::delivery::count_failure(self.idem.store().as_ref(), key).await
    }
}
