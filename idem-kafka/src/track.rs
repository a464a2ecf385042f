//! Per-partition bookkeeping: which offsets are in flight, which are
//! settled, and how far the partition may be committed (contiguously).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

/// Where a record of the partition stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Being processed (or waiting for a retry).
    Running,
    /// Recorded, replayed or dead-lettered: may be committed.
    Settled,
    /// Given up at a revoke or shutdown: never committed by this consumer.
    Abandoned,
}

#[derive(Debug, Default)]
struct State {
    /// The partition was revoked (or the consumer stops): no more commits
    /// from this track, and retries give up.
    revoked: bool,
    /// The records taken, by offset, that still hold up the commit point
    /// (the first is never settled).
    slots: BTreeMap<i64, Slot>,
    /// The offset to commit: one past the last record of the contiguous
    /// settled prefix.
    committable: Option<i64>,
    /// The last offset handed to a commit.
    committed: Option<i64>,
    /// Records settled into `committable` since the last commit.
    uncommitted_records: u64,
    /// A record was abandoned: nothing past it may be committed.
    blocked: bool,
}

/// One assignment of one partition to this consumer. A partition that is
/// revoked and assigned again gets a new track, so the late completions of
/// the first assignment never commit in the second.
#[derive(Debug)]
pub(crate) struct Track {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    /// Records of this partition in flight at once.
    pub(crate) permits: Arc<Semaphore>,
    state: Mutex<State>,
    changed: Condvar,
}

impl Track {
    pub(crate) fn new(topic: &str, partition: i32, concurrency: usize) -> Self {
        Track {
            topic: topic.to_owned(),
            partition,
            permits: Arc::new(Semaphore::new(concurrency)),
            state: Mutex::default(),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A record taken for processing (offsets in the order read).
    pub(crate) fn begin(&self, offset: i64) {
        self.lock().slots.insert(offset, Slot::Running);
    }

    /// A record's outcome is durable (recorded, replayed, dead-lettered):
    /// the commit point moves over the settled prefix. Returns whether it
    /// moved.
    pub(crate) fn settle(&self, offset: i64) -> bool {
        let moved = {
            let mut s = self.lock();
            if let Some(slot) = s.slots.get_mut(&offset) {
                *slot = Slot::Settled;
            }
            advance(&mut s)
        };
        self.changed.notify_all();
        moved
    }

    /// A record given up (its partition revoked, or the consumer
    /// stopping): the commit point never passes it.
    pub(crate) fn abandon(&self, offset: i64) {
        {
            let mut s = self.lock();
            if let Some(slot) = s.slots.get_mut(&offset) {
                *slot = Slot::Abandoned;
            }
            s.blocked = s.blocked || s.slots.values().next() == Some(&Slot::Abandoned);
        }
        self.changed.notify_all();
    }

    /// Whether this assignment is over.
    pub(crate) fn revoked(&self) -> bool {
        self.lock().revoked
    }

    pub(crate) fn revoke(&self) {
        self.lock().revoked = true;
        self.changed.notify_all();
    }

    /// The offset to commit and the records it covers, if it moved since
    /// the last commit (or whatever it is, with `force`). Never for a
    /// revoked track unless `force`.
    pub(crate) fn take_commit(&self, force: bool) -> Option<(i64, u64)> {
        let mut s = self.lock();
        let offset = s.committable?;
        if !force && (s.revoked || s.committed >= Some(offset)) {
            return None;
        }
        s.committed = Some(offset);
        let n = std::mem::take(&mut s.uncommitted_records);
        Some((offset, n))
    }

    /// Records still running.
    pub(crate) fn running(&self) -> usize {
        self.lock()
            .slots
            .values()
            .filter(|s| **s == Slot::Running)
            .count()
    }

    /// Waits (blocking the thread) until no record of the partition is
    /// running, or `limit` passes. Returns the records still running.
    pub(crate) fn wait_idle(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        let mut s = self.lock();
        loop {
            let running = s.slots.values().filter(|x| **x == Slot::Running).count();
            let now = Instant::now();
            if running == 0 || now >= deadline {
                return running;
            }
            s = match self.changed.wait_timeout(s, deadline - now) {
                Ok((guard, _)) => guard,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

/// Pops the settled prefix, moving `committable` past it; stops at the
/// first running or abandoned record.
fn advance(s: &mut State) -> bool {
    let mut moved = false;
    if s.blocked {
        return false;
    }
    while let Some((&offset, &slot)) = s.slots.iter().next() {
        match slot {
            Slot::Settled => {
                s.slots.remove(&offset);
                s.committable = Some(offset.saturating_add(1));
                s.uncommitted_records += 1;
                moved = true;
            }
            Slot::Abandoned => {
                s.blocked = true;
                break;
            }
            Slot::Running => break,
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commit_point_waits_for_the_slowest() {
        let t = Track::new("t", 0, 8);
        for o in [10, 11, 12, 14] {
            t.begin(o);
        }
        assert!(!t.settle(12));
        assert!(!t.settle(14));
        assert_eq!(t.take_commit(false), None);
        assert!(t.settle(10));
        assert_eq!(t.take_commit(false), Some((11, 1)));
        assert!(t.settle(11));
        // 12 and 14 were settled; 13 was never read (a gap, as after
        // compaction or a transaction marker).
        assert_eq!(t.take_commit(false), Some((15, 3)));
        assert_eq!(t.take_commit(false), None);
    }

    #[test]
    fn nothing_is_committed_past_an_abandoned_record() {
        let t = Track::new("t", 0, 8);
        for o in 0..4 {
            t.begin(o);
        }
        t.settle(0);
        t.abandon(1);
        t.settle(2);
        t.settle(3);
        assert_eq!(t.take_commit(false), Some((1, 1)));
        assert_eq!(t.take_commit(false), None);
        assert_eq!(t.running(), 0);
    }

    #[test]
    fn a_revoked_track_commits_only_when_forced() {
        let t = Track::new("t", 0, 8);
        t.begin(5);
        t.settle(5);
        t.revoke();
        assert_eq!(t.take_commit(false), None);
        assert_eq!(t.take_commit(true), Some((6, 1)));
        assert_eq!(t.wait_idle(Duration::from_millis(1)), 0);
    }
}
