//! The keys whose handler ran and whose completion is still to be
//! written (`Unrecorded`): the other records of such a key wait, never run.

use std::sync::Arc;

use idem_core::IdempotencyKey;

use crate::shared::{lock, Shared};

/// A key in [`Shared::finishing`] while a record's completion is to be
/// written; out again when dropped (written, given up, or the task
/// aborted).
pub(crate) struct Finishing {
    shared: Arc<Shared>,
    key: IdempotencyKey,
}

impl Finishing {
    pub(crate) fn new(shared: &Arc<Shared>, key: &IdempotencyKey) -> Self {
        lock(&shared.finishing).insert(key.clone());
        Finishing {
            shared: shared.clone(),
            key: key.clone(),
        }
    }
}

impl Drop for Finishing {
    fn drop(&mut self) {
        lock(&self.shared.finishing).remove(&self.key);
    }
}
