//! What a run's outcome means for its record: settled, retried, counted
//! as a failure, dead-lettered, finished with its own lease, or fatal.

use std::fmt;
use std::sync::atomic::Ordering;

use idem_core::delivery::{self, Done};
use idem_core::{Codec, IdemError, IdempotencyStore, Processed, StoreError, Unrecorded};

use crate::record::{KafkaRecord, RecordError};
use crate::work::Work;

/// The handler's error, or the run refused because the key was acquired
/// more than `max_deliveries` times (its earlier runs were cut off): the
/// shared [`Attempted`](idem_core::delivery::Attempted).
pub(crate) use idem_core::delivery::Attempted as Run;

/// What to do with a record after a run.
pub(crate) enum Settle {
    /// Settled: commit it.
    Done,
    /// Dead-letter it with this reason.
    Dead(String),
    /// The handler failed: counted, then retried or dead-lettered.
    Failed(String),
    /// Not the record's fault: try again later.
    Retry,
    /// The handler ran but its completion is not written (the store was
    /// away past the lease): write it with its own lease, never run the
    /// record again.
    Finish(Box<Unrecorded>),
    /// Nothing can succeed: stop the consumer.
    Fatal(StoreError),
}

impl<S, C, F, M> Work<S, C, F, M>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// What a run's outcome means for its record
    /// ([`idem_core::delivery::settle`], the table every consumer shares),
    /// counted and logged.
    pub(crate) fn settle_of<T, E: fmt::Display + 'static>(
        &self,
        record: &KafkaRecord,
        result: Result<Processed<T>, IdemError<Run<E>>>,
    ) -> Settle {
        let c = &self.shared.counters;
        let not_replayable = match &result {
            Ok(Processed::ExecutedNotReplayable { reason, .. }) => Some(reason.clone()),
            Err(IdemError::ResultUnavailable { reason }) => Some(reason.clone()),
            _ => None,
        };
        match delivery::settle(result, is_permanent::<E>, self.max_deliveries) {
            delivery::Settle::Done(done) => {
                match done {
                    Done::Executed => {}
                    Done::ExecutedNotReplayable => {
                        tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, reason = ?not_replayable, "the handler ran but its result was not recorded");
                    }
                    Done::ResultUnavailable => {
                        tracing::warn!(topic = %record.topic, offset = record.offset, reason = ?not_replayable, "duplicate of a record whose result was not recorded: settled");
                    }
                    Done::Replayed => {}
                }
                let counter = match done {
                    Done::Executed | Done::ExecutedNotReplayable => &c.executed,
                    Done::Replayed | Done::ResultUnavailable => &c.replayed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Settle::Done
            }
            // Held elsewhere (a rebalance moved the partition while its
            // handler ran there), our lease taken over, or the store away:
            // the holder records, and the retry gets its replay.
            delivery::Settle::Retry(reason) => {
                tracing::debug!(topic = %record.topic, offset = record.offset, %reason, "the record is retried");
                Settle::Retry
            }
            delivery::Settle::Finish(u) => {
                tracing::warn!(topic = %record.topic, offset = record.offset, error = %u.cause(), "the handler ran but its result is not recorded yet: finishing it with its lease");
                Settle::Finish(u)
            }
            delivery::Settle::Dead(reason) => Settle::Dead(reason),
            delivery::Settle::Failed(reason) => Settle::Failed(reason),
            delivery::Settle::Fatal(e) => Settle::Fatal(e),
        }
    }
}

/// Whether a handler error says the record can never succeed.
fn is_permanent<E: 'static>(e: &E) -> bool {
    delivery::is_permanent::<RecordError, E>(e)
}
