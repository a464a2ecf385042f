//! What a consumer did: [`ConsumerStats`], and the counters it is read
//! from.

use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(doc)]
use crate::SqsConsumer;

/// What a consumer did, counted since it was made: returned by
/// [`SqsConsumer::run`], and by [`SqsConsumer::stats`] while it runs.
///
/// ```
/// use idem_sqs::ConsumerStats;
///
/// fn duplicate_share(stats: &ConsumerStats) -> f64 {
///     let seen = stats.executed + stats.replayed;
///     if seen == 0 { 0.0 } else { stats.replayed as f64 / seen as f64 }
/// }
/// assert_eq!(duplicate_share(&ConsumerStats { executed: 3, replayed: 1, ..Default::default() }), 0.25);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages received from SQS.
    pub received: u64,
    /// Messages whose handler ran here and whose result was recorded.
    pub executed: u64,
    /// Messages answered with a recorded result (duplicates,
    /// redeliveries), or whose key completed without a replayable result.
    pub replayed: u64,
    /// Deliveries whose key was in progress with another worker (left for
    /// redelivery).
    pub in_progress: u64,
    /// Messages deleted from the queue (dead-lettered ones included).
    pub deleted: u64,
    /// Deletes that SQS refused or that failed: those messages come back
    /// and are replayed, which is harmless.
    pub delete_failures: u64,
    /// Messages found poison: they can never succeed, or their handler
    /// failed `max_deliveries` times (dead-lettered, or left to the
    /// queue's redrive policy when no dead-letter queue is set).
    pub poison: u64,
    /// Messages sent to the dead-letter queue (then deleted).
    pub dead_lettered: u64,
    /// Dead letters that could not be sent (then left for redelivery, and
    /// dead-lettered again on it).
    pub dead_letter_failures: u64,
    /// Deliveries left for redelivery: handler failed (fewer than
    /// `max_deliveries` times), key in progress elsewhere, store
    /// unavailable, poison without a dead-letter queue.
    pub left_for_redelivery: u64,
    /// Visibility extensions of messages in flight that SQS accepted.
    pub heartbeats: u64,
    /// Visibility extensions that failed (such a message may be handed to
    /// another consumer, which then gets "in progress" or the replay).
    pub heartbeat_failures: u64,
    /// Messages still in flight when `run` stopped waiting for them at
    /// shutdown (not deleted: they come back after their visibility
    /// timeout).
    pub abandoned: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) received: AtomicU64,
    pub(crate) executed: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) in_progress: AtomicU64,
    pub(crate) deleted: AtomicU64,
    pub(crate) delete_failures: AtomicU64,
    pub(crate) poison: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) dead_letter_failures: AtomicU64,
    pub(crate) left_for_redelivery: AtomicU64,
    pub(crate) heartbeats: AtomicU64,
    pub(crate) heartbeat_failures: AtomicU64,
    pub(crate) abandoned: AtomicU64,
}

pub(crate) fn add(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}
