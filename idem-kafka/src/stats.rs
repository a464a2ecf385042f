//! What a consumer did: the counters its tasks bump, and the
//! [`ConsumerStats`] read from them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_core::{Codec, IdempotencyStore};

use crate::consumer::KafkaConsumer;
use crate::shared::lock;

/// What a consumer did, counted since it was made: returned by
/// [`KafkaConsumer::run`], and by [`KafkaConsumer::stats`] while it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Records read from the broker.
    pub received: u64,
    /// Records whose handler ran here and whose result was recorded.
    pub executed: u64,
    /// Records answered with a recorded result (duplicates, redeliveries),
    /// or whose key completed without a replayable result.
    pub replayed: u64,
    /// Runs that did not settle their record and were retried (handler
    /// failed, key in progress elsewhere, store unavailable).
    pub retried: u64,
    /// Records produced to the dead-letter topic (then settled).
    pub dead_lettered: u64,
    /// Dead letters the producer did not deliver within `call_timeout`
    /// (a missing topic, a broker away, a copy too large: then sent again
    /// with less of the record), each tried again: a count that keeps
    /// rising means a partition held up behind a record that cannot leave.
    pub dead_letter_failures: u64,
    /// Records whose offsets were handed to a commit.
    pub committed: u64,
    /// The last offset the broker confirmed as committed, per topic and
    /// partition.
    pub committed_offsets: BTreeMap<(String, i32), i64>,
    /// Partitions revoked from this consumer.
    pub revoked: u64,
    /// Records given up at a revoke or shutdown (not committed:
    /// redelivered to the next owner).
    pub abandoned: u64,
    /// The consumer group's lag on this consumer's partitions when `run`
    /// returned (high watermark minus committed offset, summed); `None`
    /// while running, or when it could not be read.
    pub lag: Option<i64>,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) received: AtomicU64,
    pub(crate) executed: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) dead_letter_failures: AtomicU64,
    pub(crate) committed: AtomicU64,
    pub(crate) revoked: AtomicU64,
    pub(crate) abandoned: AtomicU64,
}

impl<S: IdempotencyStore + ?Sized, C: Codec> KafkaConsumer<S, C> {
    /// What this consumer did so far (`lag` is `None`).
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.shared.counters;
        ConsumerStats {
            received: c.received.load(Ordering::Relaxed),
            executed: c.executed.load(Ordering::Relaxed),
            replayed: c.replayed.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
            dead_lettered: c.dead_lettered.load(Ordering::Relaxed),
            dead_letter_failures: c.dead_letter_failures.load(Ordering::Relaxed),
            committed: c.committed.load(Ordering::Relaxed),
            committed_offsets: lock(&self.shared.confirmed).clone(),
            revoked: c.revoked.load(Ordering::Relaxed),
            abandoned: c.abandoned.load(Ordering::Relaxed),
            lag: None,
        }
    }
}
