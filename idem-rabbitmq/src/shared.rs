//! The state shared by the run loop and the message tasks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::{FinishingKeys, IdempotencyKey, StoreError};

use crate::stats::Counters;

/// State shared by the run loop and the message tasks.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) counters: Counters,
    /// A task found that nothing can succeed: `run` stops with this.
    pub(crate) fatal: Mutex<Option<StoreError>>,
    /// The keys whose results are being finished (held against the other
    /// deliveries of the key here), and those given up.
    pub(crate) finishing: Arc<FinishingKeys>,
    /// Keys whose handler ran, whose result could not be recorded, and
    /// whose dead letter could not be published yet: with its reason.
    pub(crate) owed: Mutex<HashMap<IdempotencyKey, String>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
