//! What a consumer did: counters shared by its tasks.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a [`RabbitConsumer`](crate::RabbitConsumer) did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Deliveries received.
    pub received: u64,
    /// Messages whose handler ran and whose result is recorded (finished
    /// later included).
    pub executed: u64,
    /// Duplicates acked with the recorded result (or a record completed
    /// without a replayable result).
    pub replayed: u64,
    /// Messages that could not settle now (their key in progress
    /// elsewhere or being finished here, the store away, the lease taken
    /// over): held, then requeued.
    pub in_progress: u64,
    /// Messages whose handler failed or panicked (requeued, or
    /// dead-lettered at their last delivery).
    pub failed: u64,
    /// Messages acked.
    pub acked: u64,
    /// Acks, nacks or rejects the broker did not take (the channel was
    /// gone): the broker delivers the message again and it is replayed.
    pub ack_failures: u64,
    /// Messages requeued (`basic.nack` with `requeue`).
    pub requeued: u64,
    /// Messages found poison (dead-lettered, or left to the queue's
    /// dead-letter exchange).
    pub poison: u64,
    /// Poison messages dead-lettered.
    pub dead_lettered: u64,
    /// Poison messages rejected without requeue, to the queue's own
    /// dead-letter exchange ([`DeadLetter::QueuePolicy`](crate::DeadLetter::QueuePolicy)).
    pub rejected: u64,
    /// Dead letters that could not be published (the message was requeued
    /// instead).
    pub dead_letter_failures: u64,
    /// Results that waited for the store (the lease ended while it was
    /// away) and were then finished.
    pub finished: u64,
    /// Connections made after the first (the broker went away).
    pub reconnects: u64,
    /// Messages still in flight when the shutdown wait ended (not acked:
    /// the broker delivers them again; their handlers go on and record).
    pub abandoned: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) received: AtomicU64,
    pub(crate) executed: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) in_progress: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) ack_failures: AtomicU64,
    pub(crate) requeued: AtomicU64,
    pub(crate) poison: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) dead_letter_failures: AtomicU64,
    pub(crate) finished: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) abandoned: AtomicU64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> ConsumerStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            received: get(&self.received),
            executed: get(&self.executed),
            replayed: get(&self.replayed),
            in_progress: get(&self.in_progress),
            failed: get(&self.failed),
            acked: get(&self.acked),
            ack_failures: get(&self.ack_failures),
            requeued: get(&self.requeued),
            poison: get(&self.poison),
            dead_lettered: get(&self.dead_lettered),
            rejected: get(&self.rejected),
            dead_letter_failures: get(&self.dead_letter_failures),
            finished: get(&self.finished),
            reconnects: get(&self.reconnects),
            abandoned: get(&self.abandoned),
        }
    }
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}
