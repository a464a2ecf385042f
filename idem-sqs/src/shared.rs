//! The state shared by the run loop, the batch tasks and the heartbeat.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::{FinishingKeys, IdempotencyKey, StoreError};

use crate::finishing::Unfinished;
use crate::stats::Counters;

/// State shared by the run loop, the batch tasks and the heartbeat.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) counters: Counters,
    /// Receipt handles of the messages in flight: the heartbeat keeps them
    /// invisible.
    pub(crate) in_flight: Mutex<HashSet<String>>,
    /// Those of `in_flight` whose delete is on its way: a renewal SQS
    /// refuses for them is no failure (the message may be gone already).
    pub(crate) settling: Mutex<HashSet<String>>,
    /// Messages to finish, by receipt handle (kept in `in_flight`).
    pub(crate) unfinished: Mutex<HashMap<String, Unfinished>>,
    /// A batch found that nothing can succeed: `run` stops with this.
    pub(crate) fatal: Mutex<Option<StoreError>>,
    /// Keys that a batch task is processing.
    pub(crate) busy: Mutex<HashSet<IdempotencyKey>>,
    /// Holds no key (`unfinished` does that): its keys given up
    /// ([`FinishingKeys::given_up`]), which the executor answers
    /// `ResultUnavailable` for.
    pub(crate) finishing: Arc<FinishingKeys>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
