//! What a run's outcome means for its record: settled, retried, counted
//! as a failure, dead-lettered, finished with its own lease, or fatal.

use std::fmt;
use std::sync::atomic::Ordering;

use idem_core::{Codec, IdemError, IdempotencyStore, Processed, StoreError, Unrecorded};

use crate::record::{KafkaRecord, RecordError};
use crate::work::Work;

/// The handler's error, or the run refused because the key was acquired
/// more than `max_deliveries` times (its earlier runs were cut off).
pub(crate) enum Run<E> {
    Handler(E),
    TooManyAttempts(u32),
}

impl<E: fmt::Display> fmt::Display for Run<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Run::Handler(e) => write!(f, "handler failed: {e}"),
            Run::TooManyAttempts(n) => write!(
                f,
                "acquired {n} times: earlier runs were cut off (their consumer died)"
            ),
        }
    }
}

/// Whether a handler error says the record can never succeed.
fn is_permanent<E: 'static>(e: &E) -> bool {
    let any = e as &dyn std::any::Any;
    if any.is::<RecordError>() {
        return true;
    }
    if let Some(b) = any.downcast_ref::<Box<dyn std::error::Error + Send + Sync>>() {
        return b.is::<RecordError>();
    }
    if let Some(b) = any.downcast_ref::<Box<dyn std::error::Error>>() {
        return b.is::<RecordError>();
    }
    false
}

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
    /// What a run's outcome means for its record.
    pub(crate) fn settle_of<T, E: fmt::Display + 'static>(
        &self,
        record: &KafkaRecord,
        result: Result<Processed<T>, IdemError<Run<E>>>,
    ) -> Settle {
        let c = &self.shared.counters;
        match result {
            Ok(Processed::Executed(_)) => {
                c.executed.fetch_add(1, Ordering::Relaxed);
                Settle::Done
            }
            Ok(Processed::ExecutedNotReplayable { reason, .. }) => {
                tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, %reason, "the handler ran but its result was not recorded");
                c.executed.fetch_add(1, Ordering::Relaxed);
                Settle::Done
            }
            Ok(Processed::Replayed(_)) => {
                c.replayed.fetch_add(1, Ordering::Relaxed);
                Settle::Done
            }
            Err(IdemError::ResultUnavailable { reason }) => {
                tracing::warn!(topic = %record.topic, offset = record.offset, %reason, "duplicate of a record whose result was not recorded: settled");
                c.replayed.fetch_add(1, Ordering::Relaxed);
                Settle::Done
            }
            // Held elsewhere (a rebalance moved the partition while its
            // handler ran there), or our lease was taken over: the holder
            // records, and the retry gets its replay.
            Err(IdemError::InProgress { .. } | IdemError::WaitTimeout { .. } | IdemError::LeaseLost) => {
                Settle::Retry
            }
            Err(IdemError::InvalidConfig { detail }) => {
                Settle::Fatal(StoreError::InvalidArgument { detail })
            }
            Err(IdemError::Store(e @ StoreError::InvalidArgument { .. })) => Settle::Fatal(e),
            Err(IdemError::Store(e)) if e.is_retryable() => {
                tracing::warn!(topic = %record.topic, offset = record.offset, error = %e, "store unavailable: the record is retried");
                Settle::Retry
            }
            Err(IdemError::Unrecorded(u)) => {
                tracing::warn!(topic = %record.topic, offset = record.offset, error = %u.cause(), "the handler ran but its result is not recorded yet: finishing it with its lease");
                Settle::Finish(u)
            }
            Err(IdemError::Handler(Run::TooManyAttempts(n))) => Settle::Dead(format!(
                "acquired {n} times (max_deliveries {}): its earlier runs were cut off (their consumer died, or lost the store mid-run for longer than it waited)",
                self.max_deliveries
            )),
            Err(IdemError::Handler(Run::Handler(e))) if is_permanent(&e) => {
                Settle::Dead(format!("handler refused the record: {e}"))
            }
            Err(IdemError::Handler(Run::Handler(e))) => Settle::Failed(e.to_string()),
            Err(e @ IdemError::Panicked { .. }) => Settle::Failed(e.to_string()),
            Err(e) => Settle::Dead(e.to_string()),
        }
    }
}
