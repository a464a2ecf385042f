//! The state shared by the run loop, the record tasks and the rebalance
//! callback.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};

use idem_core::{FinishingKeys, IdempotencyKey};

use crate::stats::Counters;
use crate::track::Track;

/// State shared by the run loop, the record tasks and the rebalance
/// callback.
pub(crate) struct Shared {
    /// The last record taken of each key in flight, with its number.
    pub(crate) keys: Mutex<HashMap<IdempotencyKey, (u64, tokio::sync::oneshot::Receiver<()>)>>,
    pub(crate) seq: AtomicU64,
    pub(crate) tracks: Mutex<HashMap<(String, i32), Arc<Track>>>,
    pub(crate) counters: Counters,
    pub(crate) confirmed: Mutex<BTreeMap<(String, i32), i64>>,
    /// Wakes the run loop: a commit point moved, or a commit failed.
    pub(crate) wake: tokio::sync::Notify,
    /// A commit failed: send every commit point again.
    pub(crate) recommit: AtomicBool,
    /// The consumer stops: retries give up.
    pub(crate) stopping: AtomicBool,
    /// `run` left the group: the next one subscribes again.
    pub(crate) left: AtomicBool,
    /// A commit is under way on a blocking thread.
    pub(crate) committing: AtomicBool,
    /// Commits go one at a time (the run loop's and the revoke's).
    pub(crate) commit_lock: Mutex<()>,
    pub(crate) revoke_wait_ms: AtomicU64,
    pub(crate) partition_concurrency: AtomicU64,
    /// Keys of records whose handler ran and whose completion is still to
    /// be written (`Unrecorded`): their other records wait, never run
    /// (after the lease they would take the key over).
    pub(crate) finishing: Arc<FinishingKeys>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub(crate) fn track(&self, topic: &str, partition: i32) -> Option<Arc<Track>> {
        lock(&self.tracks)
            .get(&(topic.to_owned(), partition))
            .cloned()
    }
}
