//! What a consumer did: [`ConsumerStats`], and the counters it is read
//! from (also exported as `metrics` counters).

use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(doc)]
use crate::NatsConsumer;
#[cfg(doc)]
use idem_core::IdemError;

/// What a consumer did, counted since it was made: returned by
/// [`NatsConsumer::run`], and by [`NatsConsumer::stats`] while it runs.
///
/// ```
/// use idem_nats::ConsumerStats;
///
/// fn duplicate_share(stats: &ConsumerStats) -> f64 {
///     let seen = stats.executed + stats.replayed;
///     if seen == 0 { 0.0 } else { stats.replayed as f64 / seen as f64 }
/// }
/// assert_eq!(duplicate_share(&ConsumerStats { executed: 3, replayed: 1, ..Default::default() }), 0.25);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Messages delivered to this consumer.
    pub received: u64,
    /// Messages whose handler ran here and whose result was recorded.
    pub executed: u64,
    /// Messages answered with a recorded result (duplicates,
    /// redeliveries), or whose key completed without a replayable result.
    pub replayed: u64,
    /// Deliveries whose key another run held, handed back: in progress
    /// with another worker ([`IdemError::InProgress`], or
    /// [`IdemError::WaitTimeout`]), or its completion being written here
    /// after a store outage. Deliveries handed back because the store was
    /// away, or whose lease was taken over, are not counted here (they
    /// are in [`handed_back`](Self::handed_back)).
    pub in_progress: u64,
    /// Acks sent (dead-lettered and terminated messages included).
    pub acked: u64,
    /// Acks that failed to go out (the connection was down): those
    /// messages come back after the ack wait and are replayed, which is
    /// harmless.
    pub ack_failures: u64,
    /// Messages found poison: they can never succeed, or their handler
    /// failed `max_deliveries` times.
    pub poison: u64,
    /// Messages published to the dead-letter subject (then acked).
    pub dead_lettered: u64,
    /// Dead letters that could not be published: the message then handed
    /// back, and dead-lettered again on its redelivery; or, refused by
    /// JetStream for good even without the message's headers and
    /// payload, terminated (`+TERM`, an error logged).
    pub dead_letter_failures: u64,
    /// Deliveries handed back (a `-NAK` with the retry delay): handler
    /// failed or the store refused a call (fewer than `max_deliveries`
    /// times), key in progress elsewhere, store unavailable.
    pub handed_back: u64,
    /// In-progress acks (`+WPI`) sent for messages being handled or
    /// finished.
    pub progress_acks: u64,
    /// In-progress acks that failed to go out (such a message may be
    /// redelivered to another consumer after the ack wait, which then gets
    /// "in progress" or the replay).
    pub progress_failures: u64,
    /// Handlers that ran while the store was away until their lease
    /// ended, whose completion this consumer wrote later.
    pub finished_late: u64,
    /// Pull requests that failed (the server away or restarting); retried
    /// with a backoff.
    pub pull_failures: u64,
    /// Messages still held when `run` stopped waiting for them at
    /// shutdown (handed back, or left to come back after the ack wait).
    pub abandoned: u64,
}

/// What the counters count: one [`ConsumerStats`] field each, and the
/// `metrics` counter `idem_nats_{field}_total` (labelled with the durable
/// consumer's name).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Event {
    Received,
    Executed,
    Replayed,
    InProgress,
    Acked,
    AckFailures,
    Poison,
    DeadLettered,
    DeadLetterFailures,
    HandedBack,
    ProgressAcks,
    ProgressFailures,
    FinishedLate,
    PullFailures,
    Abandoned,
}

const EVENTS: usize = 15;

impl Event {
    fn metric(self) -> &'static str {
        match self {
            Event::Received => "idem_nats_received_total",
            Event::Executed => "idem_nats_executed_total",
            Event::Replayed => "idem_nats_replayed_total",
            Event::InProgress => "idem_nats_in_progress_total",
            Event::Acked => "idem_nats_acked_total",
            Event::AckFailures => "idem_nats_ack_failures_total",
            Event::Poison => "idem_nats_poison_total",
            Event::DeadLettered => "idem_nats_dead_lettered_total",
            Event::DeadLetterFailures => "idem_nats_dead_letter_failures_total",
            Event::HandedBack => "idem_nats_handed_back_total",
            Event::ProgressAcks => "idem_nats_progress_acks_total",
            Event::ProgressFailures => "idem_nats_progress_failures_total",
            Event::FinishedLate => "idem_nats_finished_late_total",
            Event::PullFailures => "idem_nats_pull_failures_total",
            Event::Abandoned => "idem_nats_abandoned_total",
        }
    }
}

/// The counters of one consumer.
#[derive(Default)]
pub(crate) struct Counters {
    counts: [AtomicU64; EVENTS],
    /// The durable consumer's name, the label of the metrics.
    durable: String,
}

impl Counters {
    pub(crate) fn new(durable: &str) -> Self {
        Counters {
            counts: Default::default(),
            durable: durable.to_owned(),
        }
    }

    /// Counts `n` events.
    pub(crate) fn add(&self, event: Event, n: usize) {
        if n == 0 {
            return;
        }
        self.counts[event as usize].fetch_add(n as u64, Ordering::Relaxed);
        metrics::counter!(event.metric(), "consumer" => self.durable.clone()).increment(n as u64);
    }

    pub(crate) fn read(&self) -> ConsumerStats {
        let get = |e: Event| self.counts[e as usize].load(Ordering::Relaxed);
        ConsumerStats {
            received: get(Event::Received),
            executed: get(Event::Executed),
            replayed: get(Event::Replayed),
            in_progress: get(Event::InProgress),
            acked: get(Event::Acked),
            ack_failures: get(Event::AckFailures),
            poison: get(Event::Poison),
            dead_lettered: get(Event::DeadLettered),
            dead_letter_failures: get(Event::DeadLetterFailures),
            handed_back: get(Event::HandedBack),
            progress_acks: get(Event::ProgressAcks),
            progress_failures: get(Event::ProgressFailures),
            finished_late: get(Event::FinishedLate),
            pull_failures: get(Event::PullFailures),
            abandoned: get(Event::Abandoned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_event_counts_in_its_own_field() {
        let counters = Counters::new("d");
        counters.add(Event::Received, 3);
        counters.add(Event::Acked, 2);
        counters.add(Event::Abandoned, 1);
        counters.add(Event::Poison, 0);
        let stats = counters.read();
        assert_eq!(
            stats,
            ConsumerStats {
                received: 3,
                acked: 2,
                abandoned: 1,
                ..ConsumerStats::default()
            }
        );
        assert_eq!(Event::Abandoned as usize, EVENTS - 1);
    }
}
