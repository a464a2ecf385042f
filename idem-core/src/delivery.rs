//! What a broker consumer does with a message once its run ended: the part
//! of the contract every consumer shares (DESIGN 5b), written once.
//!
//! A consumer wraps its handler in [`Attempted::guard`] (a key taken over
//! more than `max_deliveries` times is not run again: the runs before were
//! cut off, their process died), runs it through the executor or a
//! [`Runner`](crate::Runner), and reads the outcome with [`settle`]:
//!
//! | outcome | [`Settle`] | the consumer |
//! |---|---|---|
//! | executed, replayed, or completed earlier without a replayable result | [`Settle::Done`] | acks |
//! | in progress elsewhere, the store away, the lease taken over | [`Settle::Retry`] | keeps or hands back the message; never dead-letters it |
//! | the handler failed or panicked; the store refused a call for a reason not known to pass (a `Backend` error: full, a missing table, a refused commit) | [`Settle::Failed`] | hands it back, dead-letters it once its deliveries reach `max_deliveries` |
//! | can never succeed (the handler's permanent error, a mismatch, a key taken over too often, a record that does not decode) | [`Settle::Dead`] | dead-letters it with the reason, then acks |
//! | the handler ran, the store was away until its lease ended | [`Settle::Finish`] | keeps the message from every other consumer while it writes the completion ([`Idempotency::try_finish`](crate::Idempotency::try_finish)), then acks |
//! | the executor's configuration is refused | [`Settle::Fatal`] | stops: nothing can succeed |
//!
//! Brokers that do not count deliveries (RabbitMQ's classic queues) count a
//! message's failed runs in the store with [`count_failure`].

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::error::{IdemError, StoreError, Unrecorded};
use crate::executor::{Context, Processed};
use crate::key::IdempotencyKey;
use crate::record::Acquisition;
use crate::store::IdempotencyStore;

/// The scope of the failure counters of [`count_failure`].
pub const FAILURE_SCOPE: &str = "idem.failures";

/// The handler's own error, or the run refused before it started because
/// its key was acquired more than `max_deliveries` times.
#[derive(Debug)]
pub enum Attempted<E> {
    /// The handler returned this error.
    Handler(E),
    /// Not run: the key was acquired this many times, the runs before were
    /// cut off (their process died, or lost the store mid-run for longer
    /// than it waited).
    TooManyAttempts(u32),
}

impl<E: fmt::Display> fmt::Display for Attempted<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attempted::Handler(e) => e.fmt(f),
            Attempted::TooManyAttempts(n) => write!(
                f,
                "acquired {n} times: the earlier runs were cut off (their consumer died, or lost the store mid-run for longer than it waited)"
            ),
        }
    }
}

impl<E> Attempted<E> {
    /// Runs `handler` unless the acquisition's attempt is past
    /// `max_deliveries`: the handler of a message that killed every
    /// consumer before it is not started again.
    pub async fn guard<T, Fut>(
        context: Context,
        max_deliveries: u32,
        handler: impl FnOnce(Context) -> Fut,
    ) -> Result<T, Attempted<E>>
    where
        Fut: Future<Output = Result<T, E>>,
    {
        if context.attempt > max_deliveries {
            return Err(Attempted::TooManyAttempts(context.attempt));
        }
        handler(context).await.map_err(Attempted::Handler)
    }
}

/// How a message that is settled for good came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Done {
    /// Its handler ran and its result is recorded.
    Executed,
    /// Its handler ran; its result could not be recorded (too large, not
    /// encodable) and the key is completed "not replayable".
    ExecutedNotReplayable,
    /// A duplicate: the recorded result was replayed.
    Replayed,
    /// A duplicate of a key completed without a replayable result
    /// ([`IdemError::ResultUnavailable`]): never run again.
    ResultUnavailable,
}

/// What to do with a message after a run; see the [module docs](self).
#[derive(Debug)]
pub enum Settle {
    /// Settled: ack it.
    Done(Done),
    /// Can never succeed: dead-letter it with this reason, then ack it.
    Dead(String),
    /// The handler failed (its error or panic): hand it back, or
    /// dead-letter it once its deliveries reached `max_deliveries`.
    Failed(String),
    /// Not the message's fault (the key in progress elsewhere, the store
    /// away, the lease taken over): try again later.
    Retry(String),
    /// The handler ran but its completion is not written (the store was
    /// away past the lease): write it with its own lease, keep the message
    /// meanwhile, never run it again.
    Finish(Box<Unrecorded>),
    /// Nothing can succeed (the executor's configuration is refused): stop.
    Fatal(StoreError),
}

/// Whether a handler error is `P`, the consumer's "this message can never
/// succeed" error, itself or boxed.
pub fn is_permanent<P: std::error::Error + 'static, E: 'static>(e: &E) -> bool {
    let any = e as &dyn std::any::Any;
    if any.is::<P>() {
        return true;
    }
    if let Some(b) = any.downcast_ref::<Box<dyn std::error::Error + Send + Sync>>() {
        return b.is::<P>();
    }
    if let Some(b) = any.downcast_ref::<Box<dyn std::error::Error>>() {
        return b.is::<P>();
    }
    false
}

/// What a run's outcome means for its message (see the
/// [module docs](self)); `permanent` tells a handler error that can never
/// succeed (see [`is_permanent`]), `max_deliveries` is named in the reason
/// of a key taken over too often.
pub fn settle<T, E: fmt::Display>(
    result: Result<Processed<T>, IdemError<Attempted<E>>>,
    permanent: impl FnOnce(&E) -> bool,
    max_deliveries: u32,
) -> Settle {
    match result {
        Ok(Processed::Executed(_)) => Settle::Done(Done::Executed),
        Ok(Processed::ExecutedNotReplayable { .. }) => Settle::Done(Done::ExecutedNotReplayable),
        Ok(Processed::Replayed(_)) => Settle::Done(Done::Replayed),
        Err(IdemError::ResultUnavailable { .. }) => Settle::Done(Done::ResultUnavailable),
        // Held elsewhere, or our lease was taken over: the holder records,
        // and the retry gets its replay.
        Err(e @ (IdemError::InProgress { .. } | IdemError::WaitTimeout { .. })) => {
            Settle::Retry(e.to_string())
        }
        Err(IdemError::LeaseLost) => {
            Settle::Retry("the lease was taken over: its new holder records".into())
        }
        Err(IdemError::InvalidConfig { detail }) => {
            Settle::Fatal(StoreError::InvalidArgument { detail })
        }
        Err(IdemError::Store(e @ StoreError::InvalidArgument { .. })) => Settle::Fatal(e),
        Err(IdemError::Store(e)) if e.is_retryable() => Settle::Retry(e.to_string()),
        Err(IdemError::Store(StoreError::LeaseLost)) => {
            Settle::Retry("the lease was taken over: its new holder records".into())
        }
        // A store error not known to pass: the store refusing calls (Redis
        // at maxmemory, a missing table, an ACL), or a commit the database
        // refused (a deferred constraint). Not dead-lettered at once (a
        // store refusing every call would dead-letter the whole queue):
        // handed back like a failed run, dead-lettered with the reason
        // once its deliveries reach `max_deliveries`.
        Err(IdemError::Store(e @ StoreError::Backend(_))) => {
            tracing::warn!(error = %e, "the store refused a call: the message is handed back");
            Settle::Failed(format!("the store refused the call: {e}"))
        }
        Err(IdemError::Unrecorded(u)) => Settle::Finish(u),
        Err(IdemError::Handler(Attempted::TooManyAttempts(n))) => Settle::Dead(format!(
            "acquired {n} times (max_deliveries {max_deliveries}): its earlier runs were cut off (their consumer died, or lost the store mid-run for longer than it waited)"
        )),
        Err(IdemError::Handler(Attempted::Handler(e))) if permanent(&e) => {
            Settle::Dead(format!("the handler refused the message: {e}"))
        }
        Err(IdemError::Handler(Attempted::Handler(e))) => Settle::Failed(e.to_string()),
        Err(e @ IdemError::Panicked { .. }) => Settle::Failed(e.to_string()),
        Err(e) => Settle::Dead(e.to_string()),
    }
}

/// The key of the counter of `key`'s failed runs ([`count_failure`]).
pub fn failure_counter(key: &IdempotencyKey) -> Option<IdempotencyKey> {
    key.counter_of(FAILURE_SCOPE)
}

/// Counts a failed run of `key` in the store, for a broker that does not
/// count deliveries, and returns the count so far (this one included):
/// the attempt of a counter record of scope [`FAILURE_SCOPE`], acquired
/// with a lease of 1 ms and never completed, so each count is one store
/// call and the counter ends with the store's retention of an abandoned
/// lease. `None` when the store could not count it (the consumer then
/// hands the message back, never dead-letters it for a count it lacks).
pub async fn count_failure<S: IdempotencyStore + ?Sized>(
    store: &S,
    key: &IdempotencyKey,
) -> Option<u32> {
    let counter = failure_counter(key)?;
    // A count made less than its 1 ms lease ago is still "in progress":
    // acquiring it again at once would not count this failure (a broker
    // that redelivers at once does that), so wait out the lease and try
    // again, a few times.
    let mut last = None;
    for _ in 0..COUNT_TRIES {
        match store.acquire(&counter, None, COUNT_LEASE).await {
            Ok(Acquisition::Acquired(lease)) => return Some(lease.attempt),
            Ok(Acquisition::InProgress { attempt, .. }) => {
                last = Some(attempt);
                tokio::time::sleep(COUNT_LEASE * 2).await;
            }
            Ok(_) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "could not count a failed run");
                return None;
            }
        }
    }
    // Counted by someone else at the same moment, every time: their count.
    last
}

/// The lease of a failure counter's acquisitions.
const COUNT_LEASE: Duration = Duration::from_millis(1);

/// How many times [`count_failure`] tries a counter whose last count's
/// lease is still live.
const COUNT_TRIES: usize = 5;

/// Forgets the failed runs [`count_failure`] counted for `key` (its
/// message settled or was dead-lettered), so a copy of it counts from
/// zero. Errors are logged: a counter left behind only brings a later
/// copy's dead letter sooner.
pub async fn forget_failures<S: IdempotencyStore + ?Sized>(store: &S, key: &IdempotencyKey) {
    let Some(counter) = failure_counter(key) else {
        return;
    };
    if let Err(e) = store.delete(&counter).await {
        tracing::warn!(error = %e, "could not forget a message's failed runs");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("poison")]
    struct Poison;

    #[tokio::test]
    async fn failures_counted_back_to_back_each_count() {
        let store = crate::MemoryStore::new();
        let key = IdempotencyKey::new("s", "k").unwrap_or_else(|e| panic!("{e}"));
        let mut counts = Vec::new();
        for _ in 0..4 {
            counts.push(count_failure(&store, &key).await);
        }
        assert_eq!(counts, [Some(1), Some(2), Some(3), Some(4)]);
        forget_failures(&store, &key).await;
        assert_eq!(count_failure(&store, &key).await, Some(1));
    }

    #[test]
    fn a_permanent_error_is_found_boxed_or_not() {
        assert!(is_permanent::<Poison, _>(&Poison));
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(Poison);
        assert!(is_permanent::<Poison, _>(&boxed));
        let other: Box<dyn std::error::Error + Send + Sync> = "x".into();
        assert!(!is_permanent::<Poison, _>(&other));
        assert!(!is_permanent::<Poison, _>(&std::io::Error::other("x")));
    }

    #[test]
    fn outcomes_settle_as_the_table_says() {
        let not = |_: &String| false;
        let s = settle::<u8, String>(Ok(Processed::Replayed(1)), not, 3);
        assert!(matches!(s, Settle::Done(Done::Replayed)));
        let s = settle::<u8, String>(Err(IdemError::LeaseLost), not, 3);
        assert!(matches!(s, Settle::Retry(_)));
        let s = settle::<u8, String>(
            Err(IdemError::Handler(Attempted::Handler("no".into()))),
            not,
            3,
        );
        assert!(matches!(s, Settle::Failed(ref r) if r == "no"));
        let s = settle::<u8, String>(
            Err(IdemError::Handler(Attempted::Handler("no".into()))),
            |_| true,
            3,
        );
        assert!(matches!(s, Settle::Dead(_)));
        let s = settle::<u8, String>(
            Err(IdemError::Handler(Attempted::TooManyAttempts(4))),
            not,
            3,
        );
        assert!(matches!(s, Settle::Dead(ref r) if r.contains("max_deliveries 3")));
        let s = settle::<u8, String>(
            Err(IdemError::Store(StoreError::unavailable("down"))),
            not,
            3,
        );
        assert!(matches!(s, Settle::Retry(_)));
        let s = settle::<u8, String>(Err(IdemError::PayloadMismatch), not, 3);
        assert!(matches!(s, Settle::Dead(_)));
    }

    #[test]
    fn a_store_that_refuses_calls_hands_the_message_back_never_dead_letters_it_at_once() {
        let not = |_: &String| false;
        // Redis at maxmemory (OOM), a missing table, an ACL refusal: the
        // store refuses every call for a while; no message is at fault.
        let oom = StoreError::backend("OOM command not allowed when used memory > 'maxmemory'");
        let s = settle::<u8, String>(Err(IdemError::Store(oom)), not, 3);
        assert!(
            matches!(s, Settle::Failed(ref r) if r.contains("OOM")),
            "{s:?}"
        );
        let s = settle::<u8, String>(Err(IdemError::Store(StoreError::LeaseLost)), not, 3);
        assert!(matches!(s, Settle::Retry(_)), "{s:?}");
        // A record that does not decode is the message's key's own fault.
        let key = IdempotencyKey::new("s", "k").unwrap_or_else(|e| panic!("{e}"));
        let corrupt = StoreError::Corrupt {
            key,
            detail: "bad".into(),
        };
        let s = settle::<u8, String>(Err(IdemError::Store(corrupt)), not, 3);
        assert!(matches!(s, Settle::Dead(_)), "{s:?}");
    }
}
