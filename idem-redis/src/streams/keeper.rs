//! Keeping a consumer's entries from the other consumers of its group
//! while it still owes them an answer: the entries whose handlers run (a
//! batch in flight, the completion retried up to the lease) and the
//! entries it is finishing after a store outage (`IdemError::Unrecorded`).
//!
//! Another consumer reclaims an entry (`XAUTOCLAIM`) once it has been idle
//! for `claim_idle`; after the lease it would take the key over and run the
//! handler again. So while this consumer lives, it claims those entries
//! again (`XCLAIM ... 0 ... JUSTID`: idle time back to 0, the delivery
//! count unchanged) every quarter of `claim_idle`. Redis is asked, not the
//! store: the broker answers even when the store is away. A consumer that
//! stops claiming (it died) lets its entries go idle and be reclaimed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::Value;

use crate::{map_error, millis};

/// The entry IDs this consumer keeps claimed: those of the batch in
/// flight (held by an [`InFlight`] guard, so a batch whose future is
/// dropped lets them go) and those it keeps across batches (the entries it
/// is finishing, and the duplicates of their keys it holds back).
#[derive(Debug, Default)]
pub(crate) struct Held {
    ids: Mutex<Ids>,
}

#[derive(Debug, Default)]
struct Ids {
    in_flight: HashSet<String>,
    kept: HashSet<String>,
}

impl Held {
    /// Keeps `ids` claimed while the guard lives.
    pub(crate) fn in_flight(self: &Arc<Self>, ids: Vec<String>) -> InFlight {
        lock(&self.ids).in_flight.extend(ids.iter().cloned());
        InFlight {
            held: self.clone(),
            ids,
        }
    }

    /// Keeps `id` claimed until [`let_go`](Self::let_go).
    pub(crate) fn keep(&self, id: &str) {
        lock(&self.ids).kept.insert(id.to_owned());
    }

    /// Stops keeping `id` claimed across batches.
    pub(crate) fn let_go(&self, id: &str) {
        lock(&self.ids).kept.remove(id);
    }

    /// Keeps across batches only the IDs `still` accepts.
    pub(crate) fn retain(&self, still: impl Fn(&str) -> bool) {
        lock(&self.ids).kept.retain(|id| still(id));
    }

    /// Whether any entry is held.
    pub(crate) fn is_empty(&self) -> bool {
        let ids = lock(&self.ids);
        ids.in_flight.is_empty() && ids.kept.is_empty()
    }

    fn snapshot(&self) -> Vec<String> {
        let ids = lock(&self.ids);
        ids.in_flight.union(&ids.kept).cloned().collect()
    }
}

/// The entries of a batch in flight, kept claimed until dropped (the batch
/// settled, or its future was dropped).
pub(crate) struct InFlight {
    held: Arc<Held>,
    ids: Vec<String>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut ids = lock(&self.held.ids);
        for id in &self.ids {
            ids.in_flight.remove(id);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How often the held entries are claimed again: a quarter of
/// `claim_idle` (a blocking read on the same connection may delay a claim
/// by as much again), at least every 5 ms; never when `claim_idle` is zero
/// (any consumer may take any pending entry at once: nothing to keep).
pub(crate) fn period(claim_idle: Duration) -> Option<Duration> {
    (!claim_idle.is_zero()).then(|| (claim_idle / 4).max(Duration::from_millis(5)))
}

/// What the keeper needs of the consumer.
pub(crate) struct Keeper<R> {
    pub(crate) conn: R,
    pub(crate) stream: String,
    pub(crate) group: String,
    pub(crate) consumer: String,
    pub(crate) held: Arc<Held>,
    pub(crate) every: Duration,
    pub(crate) call_timeout: Duration,
}

impl<R: ConnectionLike + Clone + Send + Sync + 'static> Keeper<R> {
    /// Claims the held entries again every `every`, until dropped.
    pub(crate) async fn run(self) {
        loop {
            tokio::time::sleep(self.every).await;
            let ids = self.held.snapshot();
            if ids.is_empty() {
                continue;
            }
            if let Err(e) = self.claim(&ids).await {
                tracing::warn!(stream = %self.stream, error = %e, entries = ids.len(), "could not claim the entries in hand again: another consumer may reclaim them once idle for claim_idle");
            }
        }
    }

    async fn claim(&self, ids: &[String]) -> Result<(), String> {
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(ids)
            .arg("JUSTID");
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.call_timeout, cmd.query_async::<Value>(&mut conn)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(map_error(e).to_string()),
            Err(_) => Err(format!("no answer within {} ms", millis(self.call_timeout))),
        }
    }
}

/// Aborts the keeper when the consumer's `run` ends, however it ends.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
