//! The `Idempotency` executor: acquire, run once, record, replay.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;
use tracing::Instrument;

use crate::codec::{Codec, JsonCodec};
use crate::error::{CodecError, IdemError, StoreError, Unrecorded};
use crate::fingerprint::Fingerprint;
use crate::finishing::FinishingKeys;
use crate::key::IdempotencyKey;
use crate::record::{
    not_replayable_marker, not_replayable_reason, saturate, Acquisition, Lease, LeaseToken, Record,
};
use crate::store::IdempotencyStore;
use crate::telemetry::{timed, timed_since, StoreOperation};

mod batch;
mod transaction;
pub use batch::BatchOutcome;
pub use transaction::{
    Gated, KeyGate, LeaseRunner, Runner, SharedTx, TransactionalStore, TxEnded, TxGuard, TxRunner,
    DEFAULT_TRANSACTION_WAIT,
};

/// What to do when a key is held by another worker with a live lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProgressPolicy {
    /// Return [`IdemError::InProgress`] at once, with the time left on the
    /// holder's lease. Suits brokers that redeliver later and HTTP APIs (409).
    Reject,
    /// Poll until the holder completes (then replay its result), releases or
    /// loses its lease (then run), or `max_wait` passes
    /// ([`IdemError::WaitTimeout`]). The first pause is `poll`, doubling after
    /// each try up to 16 times `poll`, never past the deadline.
    Wait {
        /// The longest total wait.
        max_wait: Duration,
        /// The first pause between tries.
        poll: Duration,
    },
}

/// The result of [`Idempotency::process`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// The handler ran in this call and its result was recorded.
    Executed(T),
    /// An earlier call recorded this result; the handler did not run.
    Replayed(T),
    /// The handler ran in this call and returned `value`, but the value
    /// could not be recorded for replay (it did not encode, held a NaN, or
    /// the store refused its size). The key is completed all the same, so
    /// the handler never runs again for it; duplicates get
    /// [`IdemError::ResultUnavailable`]. Treat it as executed, and look
    /// into `reason`.
    ExecutedNotReplayable {
        /// The handler's value.
        value: T,
        /// Why it was not recorded.
        reason: String,
    },
}

impl<T> Processed<T> {
    /// The value, executed or replayed.
    pub fn into_inner(self) -> T {
        match self {
            Processed::Executed(v)
            | Processed::Replayed(v)
            | Processed::ExecutedNotReplayable { value: v, .. } => v,
        }
    }

    /// A reference to the value.
    pub fn value(&self) -> &T {
        match self {
            Processed::Executed(v)
            | Processed::Replayed(v)
            | Processed::ExecutedNotReplayable { value: v, .. } => v,
        }
    }

    /// Whether the result was replayed.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Processed::Replayed(_))
    }

    /// Whether the handler ran in this call.
    pub fn is_executed(&self) -> bool {
        !self.is_replayed()
    }
}

/// What [`Idempotency::process_with`] tells the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Context {
    /// 1 on the first acquisition of the record; more after a takeover,
    /// which means an earlier worker started this handler and may have done
    /// its side effects before it vanished. It resets when the record goes
    /// away (release, delete, expiry): use [`fence`](Self::fence), not this,
    /// as a fencing number.
    pub attempt: u32,
    /// The fence of this acquisition: strictly greater than every earlier
    /// acquisition's of this key, across releases, deletes and expiry. Pass
    /// it to a downstream system that keeps the highest fence seen per key
    /// and refuses lower ones: a stale worker is then refused there.
    pub fence: u64,
    /// The lease token of this acquisition.
    pub token: LeaseToken,
}

impl Context {
    /// The context of `lease`: its attempt, fence and token (for a receiver
    /// that acquires keys itself, such as an in-transaction form, to hand
    /// its handler what [`Idempotency::process_with`] would).
    pub fn of(lease: &Lease) -> Context {
        Context {
            attempt: lease.attempt,
            fence: lease.fence,
            token: lease.token,
        }
    }
}

/// Runs handlers at most once per key over an [`IdempotencyStore`], and
/// replays the recorded result to every duplicate.
///
/// ```
/// use idem_core::{Idempotency, IdempotencyKey, InProgressPolicy, MemoryStore, Processed};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let idem = Idempotency::new(MemoryStore::new())
///     .lease(Duration::from_secs(30))
///     .retention(Duration::from_secs(86_400))
///     .on_in_progress(InProgressPolicy::Reject)
///     .heartbeat(true);
///
/// let key = IdempotencyKey::new("payments.charge", "msg-1")?;
/// let charge = |amount: u64| async move { Ok::<_, std::io::Error>(format!("charged {amount}")) };
///
/// let first = idem.process(&key, 100u64, charge).await?;
/// let again = idem.process(&key, 100u64, charge).await?;
/// assert_eq!(first, Processed::Executed("charged 100".to_string()));
/// assert_eq!(again, Processed::Replayed("charged 100".to_string()));
/// # Ok(()) }
/// ```
///
/// Cloning is cheap and shares the store.
pub struct Idempotency<S: ?Sized, C = JsonCodec> {
    store: Arc<S>,
    codec: Arc<C>,
    lease: Duration,
    retention: Duration,
    in_progress: InProgressPolicy,
    heartbeat: bool,
    heartbeat_every: Option<Duration>,
    complete_retry: Option<Duration>,
    batch_concurrency: Option<usize>,
    /// Keys a receiver is finishing: a wait for one of them does not ask
    /// the store ([`waits_for_finishing`](Self::waits_for_finishing)).
    finishing: Option<Arc<FinishingKeys>>,
}

impl<S: ?Sized, C> Clone for Idempotency<S, C> {
    fn clone(&self) -> Self {
        Idempotency {
            store: self.store.clone(),
            codec: self.codec.clone(),
            lease: self.lease,
            retention: self.retention,
            in_progress: self.in_progress,
            heartbeat: self.heartbeat,
            heartbeat_every: self.heartbeat_every,
            complete_retry: self.complete_retry,
            batch_concurrency: self.batch_concurrency,
            finishing: self.finishing.clone(),
        }
    }
}

impl<S> Idempotency<S, JsonCodec>
where
    S: IdempotencyStore,
{
    /// An executor over `store` with the defaults: 60 s lease, 24 h
    /// retention, [`InProgressPolicy::Reject`], heartbeat on, JSON.
    pub fn new(store: S) -> Self {
        Self::from_arc(Arc::new(store))
    }
}

impl<S> Idempotency<S, JsonCodec>
where
    S: IdempotencyStore + ?Sized,
{
    /// Like [`new`](Self::new), sharing a store already in an `Arc`, which
    /// may be an `Arc<dyn IdempotencyStore>` chosen at run time.
    pub fn from_arc(store: Arc<S>) -> Self {
        Idempotency {
            store,
            codec: Arc::new(JsonCodec),
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 60 * 60),
            in_progress: InProgressPolicy::Reject,
            heartbeat: true,
            heartbeat_every: None,
            complete_retry: None,
            batch_concurrency: None,
            finishing: None,
        }
    }
}

impl<S, C> Idempotency<S, C>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// How long a worker holds a key before another may take it over.
    /// With heartbeat on, the lease is renewed while the handler runs, so
    /// it bounds how long a *crashed* worker blocks the key. A zero lease
    /// is refused when a key is processed ([`IdemError::InvalidConfig`]);
    /// `Duration::MAX` means as long as the store holds anything
    /// ([`MAX_DURATION`](crate::MAX_DURATION), about 100 years).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = saturate(lease);
        self
    }

    /// How long a completed result is kept for replay. A duplicate that
    /// arrives later runs the handler again: pick a retention longer than
    /// the longest redelivery window of your broker or clients.
    /// `Duration::MAX` is saturated to [`MAX_DURATION`](crate::MAX_DURATION);
    /// a zero retention is refused when a key is processed
    /// ([`IdemError::InvalidConfig`]): every duplicate would run again.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = saturate(retention);
        self
    }

    /// What to do when another worker holds the key.
    pub fn on_in_progress(mut self, policy: InProgressPolicy) -> Self {
        self.in_progress = match policy {
            InProgressPolicy::Reject => InProgressPolicy::Reject,
            InProgressPolicy::Wait { max_wait, poll } => InProgressPolicy::Wait {
                max_wait: saturate(max_wait),
                poll: saturate(poll).max(Duration::from_millis(1)),
            },
        };
        self
    }

    /// Renew the lease while the handler runs (default on). The renewal
    /// runs on its own tokio task (so a handler that blocks its thread
    /// cannot starve it on a multi-thread runtime), every third of the
    /// lease (see [`heartbeat_interval`](Self::heartbeat_interval)), from
    /// the acquisition until the result is recorded, and stops when the
    /// handler ends or the `process` future is dropped. Off, a handler
    /// slower than the lease can be taken over and its completion gets
    /// [`IdemError::LeaseLost`].
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// How often the heartbeat renews the lease; default a third of it.
    /// Capped at half the lease (a renewal after the lease ended would come
    /// too late); at least 1 ms.
    pub fn heartbeat_interval(mut self, every: Duration) -> Self {
        self.heartbeat_every = Some(saturate(every).max(Duration::from_millis(1)));
        self
    }

    /// Replaces the codec used for responses.
    pub fn codec<C2: Codec>(self, codec: C2) -> Idempotency<S, C2> {
        Idempotency {
            store: self.store,
            codec: Arc::new(codec),
            lease: self.lease,
            retention: self.retention,
            in_progress: self.in_progress,
            heartbeat: self.heartbeat,
            heartbeat_every: self.heartbeat_every,
            complete_retry: self.complete_retry,
            batch_concurrency: self.batch_concurrency,
            finishing: self.finishing.clone(),
        }
    }

    /// How long to keep retrying the completion after the handler succeeded
    /// when the store is briefly unavailable (a restart, a failover), with
    /// backoff from 10 ms to 1 s or an eighth of the lease, whichever is
    /// shorter. Default: half the lease. The heartbeat
    /// keeps running meanwhile, and the retry never goes past the end of
    /// the lease as last renewed (after it another worker may take the key
    /// over). Giving up leaves the key in progress; after the lease another
    /// delivery would run the handler again, so retrying is what keeps the
    /// effect single. It is always safe: the completion is a
    /// compare-and-set on the lease token.
    pub fn complete_retry(mut self, budget: Duration) -> Self {
        self.complete_retry = Some(saturate(budget));
        self
    }

    /// The keys a receiver is finishing ([`FinishingKeys`]: results that
    /// could not be recorded before their lease ended, written later with
    /// that lease). Under [`InProgressPolicy::Wait`], a call that waits
    /// for such a key (with the same fingerprint, or any when the call has
    /// none) waits without asking the store, which would let it take the
    /// key over (the lease is over) and run the handler again, until the
    /// key is let go; then it gets the replay. A key the receiver gave up
    /// finishing ([`FinishingKeys::given_up`]) is answered
    /// [`IdemError::ResultUnavailable`] without asking the store, whatever
    /// the policy. The HTTP layer sets its own.
    pub fn waits_for_finishing(mut self, keys: Arc<FinishingKeys>) -> Self {
        self.finishing = Some(keys);
        self
    }

    /// At most `n` handlers of one batch ([`process_batch`](Self::process_batch)
    /// and its variants) run at once (at least 1; default: all of them).
    /// The batch's keys are still acquired together, so an item may wait
    /// for its turn while its lease runs (the heartbeat renews it meanwhile):
    /// a handler whose lease may have ended by its turn (on this process's
    /// clock, from when the acquire was sent, as renewed) **does not run**.
    /// Its key may be someone else's by then; the item answers
    /// [`IdemError::InProgress`] with a zero `retry_after` and the key is
    /// left as it is, so a redelivery gets the replay, the wait, or the
    /// takeover.
    pub fn batch_concurrency(mut self, n: usize) -> Self {
        self.batch_concurrency = Some(n.max(1));
        self
    }

    /// The retention this executor completes records with
    /// ([`retention`](Self::retention)).
    pub fn retention_period(&self) -> Duration {
        self.retention
    }

    /// The codec of recorded results, shared (for a receiver that records
    /// results itself, such as an in-transaction form, in the same
    /// encoding as this executor's replays).
    pub fn codec_shared(&self) -> Arc<C> {
        self.codec.clone()
    }

    /// The store. Calls made on it directly are not timed in
    /// [`STORE_DURATION_SECONDS`](crate::STORE_DURATION_SECONDS); those
    /// through [`get`](Self::get), [`delete`](Self::delete) and
    /// [`purge_expired`](Self::purge_expired) are.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// Reads the live record of `key` from the store
    /// ([`IdempotencyStore::get`]), timing the call.
    pub async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        timed(
            self.store.backend_name(),
            StoreOperation::Get,
            self.store.get(key),
        )
        .await
    }

    /// Removes the record of `key` whatever its state
    /// ([`IdempotencyStore::delete`]), timing the call. An operator's tool:
    /// deleting an in-progress key lets a duplicate run.
    pub async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        timed(
            self.store.backend_name(),
            StoreOperation::Delete,
            self.store.delete(key),
        )
        .await
    }

    /// Removes up to `max` expired records
    /// ([`IdempotencyStore::purge_expired`]), timing the call.
    pub async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        let call = self.store.purge_expired(max);
        timed(
            self.store.backend_name(),
            StoreOperation::PurgeExpired,
            call,
        )
        .await
    }

    /// Runs `handler(payload)` once for `key` and records its result; a
    /// duplicate gets [`Processed::Replayed`] with the recorded result. The
    /// payload's fingerprint (SHA-256 of its canonical JSON) is stored, and
    /// a later call with the same key and another payload gets
    /// [`IdemError::PayloadMismatch`]. A payload holding a NaN or an
    /// infinite float is refused ([`IdemError::Codec`]): JSON has no form
    /// for it.
    ///
    /// The handler's `Err` releases the key and comes back as
    /// [`IdemError::Handler`]; a panic releases it too and comes back as
    /// [`IdemError::Panicked`]. If the returned future is dropped while the
    /// handler runs, the key is **not** released: the handler was cut off
    /// after an unknown part of its effects, so the key stays in progress
    /// until its lease ends, and the next delivery then takes it over with
    /// a higher attempt and fence. To let the handler finish and its result
    /// be recorded whatever the caller does, use
    /// [`process_detached`](Self::process_detached).
    pub async fn process<P, T, E, F, Fut>(
        &self,
        key: &IdempotencyKey,
        payload: P,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        P: Serialize,
        T: Serialize + DeserializeOwned,
        F: FnOnce(P) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let fingerprint = Fingerprint::of(&payload)
            .map_err(|e| IdemError::Codec(CodecError::Encode(Box::new(e))))?;
        self.process_with(key, Some(fingerprint), move |_| handler(payload))
            .await
    }

    /// Like [`process`](Self::process) with a fingerprint computed by the
    /// caller (say [`Fingerprint::of_bytes`] of a raw body), or none to
    /// skip the payload check. The handler gets a [`Context`] with the
    /// attempt number and the fence.
    pub async fn process_with<T, E, F, Fut>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let span = process_span(key);
        async move {
            let result = self.run(key, fingerprint.as_ref(), handler).await;
            tracing::Span::current().record("outcome", outcome_name(&result));
            result
        }
        .instrument(span)
        .await
    }

    /// Detached mode: like [`process`](Self::process), but the whole
    /// processing (acquire, handler, completion) runs in a spawned tokio
    /// task that the returned future only awaits. Dropping the future (an
    /// HTTP client that disconnects, a consumer shutting down, a timeout)
    /// does not stop the handler: it runs to its end and its result is
    /// recorded, so the retry gets the replay (or "in progress" while it
    /// still runs). This is the mode of the HTTP layer and the broker
    /// consumers. It is a method of its own rather than a flag because a
    /// spawned handler must be `Send + 'static`, which `process` does not
    /// ask of its handler (it may borrow).
    pub async fn process_detached<P, T, E, F, Fut>(
        &self,
        key: &IdempotencyKey,
        payload: P,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        P: Serialize + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(P) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let fingerprint = Fingerprint::of(&payload)
            .map_err(|e| IdemError::Codec(CodecError::Encode(Box::new(e))))?;
        self.process_with_detached(key, Some(fingerprint), move |_| handler(payload))
            .await
    }

    /// Detached mode of [`process_with`](Self::process_with); see
    /// [`process_detached`](Self::process_detached).
    pub async fn process_with_detached<T, E, F, Fut>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let this = self.clone();
        let key = key.clone();
        let span = process_span(&key);
        let task = async move {
            let result = this.run(&key, fingerprint.as_ref(), handler).await;
            tracing::Span::current().record("outcome", outcome_name(&result));
            result
        }
        .instrument(span);
        match tokio::spawn(task).await {
            Ok(result) => result,
            // `run` catches the handler's panics; this is the runtime
            // shutting down under the task, or a panic in the store.
            Err(e) => Err(IdemError::Panicked {
                message: if e.is_panic() {
                    panic_message(e.into_panic())
                } else {
                    "the detached task was cancelled (the runtime is shutting down)".to_owned()
                },
            }),
        }
    }

    async fn run<T, E, F, Fut>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_with(key, fingerprint, handler, run_handler).await
    }

    /// `run`, with the handler run by `runner` (in place, or in a task of
    /// its own).
    async fn run_with<T, E, F, R, RFut>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        handler: F,
        runner: R,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        T: Serialize + DeserializeOwned,
        R: FnOnce(F, Context) -> RFut,
        RFut: Future<Output = HandlerOutcome<T, E>>,
    {
        if let Some(detail) = self.config_error() {
            return Err(IdemError::InvalidConfig { detail });
        }
        let scope = key.scope();
        let (lease, sent_at) = match self.acquire(key, fingerprint).await? {
            Acquired::Lease(lease, sent_at) => (lease, sent_at),
            Acquired::Replay(response) => return self.replay(scope, &response),
        };
        count("idem_acquired_total", scope);
        tracing::Span::current().record("attempt", lease.attempt);
        tracing::Span::current().record("fence", lease.fence);

        // The lease surely ends no earlier than this, on our clock: the store
        // started it after we sent the acquire. The heartbeat moves it on.
        let lease_end = Arc::new(Mutex::new(later(sent_at, self.lease)));
        // Runs from here until the result is recorded; aborted when dropped
        // (handler done and recorded, or this future dropped: a dropped
        // future does not release, the lease then runs out).
        let heartbeat = self.start_heartbeat(&lease, &lease_end);
        if heartbeat.is_some() {
            // A task spawned from a worker waits in that worker's LIFO slot,
            // which other workers cannot steal: yield once so it gets going
            // before a handler that blocks this thread can starve it.
            tokio::task::yield_now().await;
        }

        let value = match runner(handler, Context::of(&lease)).await {
            HandlerOutcome::Ok(value) => value,
            HandlerOutcome::Err(e) => {
                self.release(&lease).await;
                return Err(IdemError::Handler(e));
            }
            HandlerOutcome::Panicked(message) => {
                self.release(&lease).await;
                return Err(IdemError::Panicked { message });
            }
            HandlerOutcome::Cancelled(message) => return Err(IdemError::Panicked { message }),
            // Only a batch with a concurrency limit holds handlers back.
            HandlerOutcome::NotStarted => {
                return Err(IdemError::InProgress {
                    retry_after: Duration::ZERO,
                    attempt: lease.attempt,
                })
            }
        };

        // The handler's effects ran: from here the key is never released.
        let encoded = self.encode(&value);
        let result = self.record(&lease, value, encoded, &lease_end, None).await;
        drop(heartbeat);
        result
    }

    /// Why the configuration is refused (a zero lease or retention), if
    /// it is.
    fn config_error(&self) -> Option<String> {
        if self.lease.is_zero() {
            return Some("the lease is zero: a duplicate would take the key over at once".into());
        }
        if self.retention.is_zero() {
            return Some(
                "the retention is zero: every duplicate would run the handler again".into(),
            );
        }
        None
    }

    /// A recorded response, decoded for the caller (or the "not
    /// replayable" marker's error).
    fn replay<T, E>(&self, scope: &str, response: &[u8]) -> Result<Processed<T>, IdemError<E>>
    where
        T: DeserializeOwned,
    {
        if let Some(reason) = not_replayable_reason(response) {
            count("idem_result_unavailable_total", scope);
            return Err(IdemError::ResultUnavailable { reason });
        }
        count("idem_replayed_total", scope);
        self.codec
            .decode(response)
            .map(Processed::Replayed)
            .map_err(IdemError::Codec)
    }

    /// The handler's value encoded for the store, or why it cannot be (a
    /// codec error, or a panic in its `Serialize`).
    fn encode<T: Serialize>(&self, value: &T) -> Result<Vec<u8>, String> {
        let codec = &self.codec;
        match std::panic::catch_unwind(AssertUnwindSafe(|| codec.encode(value))) {
            Ok(Ok(bytes)) => Ok(bytes),
            Ok(Err(e)) => Err(format!("the result did not encode: {e}")),
            Err(panic) => Err(format!(
                "the result's Serialize panicked: {}",
                panic_message(panic)
            )),
        }
    }

    /// Records a handler's value (its effects ran: the key is never
    /// released from here): completes with `encoded`, retrying while the
    /// store is unavailable (see [`complete_retry`](Self::complete_retry)),
    /// or with the "not replayable" marker if the value cannot be recorded.
    /// `first` is the answer of a batched completion already sent for it
    /// (`None`: not sent); a retryable failure there is retried here.
    async fn record<T, E>(
        &self,
        lease: &Lease,
        value: T,
        encoded: Result<Vec<u8>, String>,
        lease_end: &Mutex<Instant>,
        first: Option<Result<(), StoreError>>,
    ) -> Result<Processed<T>, IdemError<E>> {
        let key = &lease.key;
        // The completion's bytes and the store's answer to it.
        let (bytes, completed) = match encoded {
            Ok(bytes) => {
                let completed = match first {
                    // The item's own verdicts: done, taken over, too large.
                    Some(done @ (Ok(()) | Err(StoreError::LeaseLost))) => done,
                    Some(Err(e @ StoreError::ResponseTooLarge { .. })) => Err(e),
                    // Anything else may be the verdict on a statement or
                    // call that carried other items too (a store that runs
                    // a batch as several statements gives each item of a
                    // failed one its error): completed on its own before
                    // this result is given up as not recordable.
                    Some(Err(e)) => {
                        tracing::warn!(key = %key, error = %e, "batched completion failed; retrying on its own");
                        self.complete(lease, &bytes, lease_end).await
                    }
                    None => self.complete(lease, &bytes, lease_end).await,
                };
                let refused = match &completed {
                    Err(StoreError::ResponseTooLarge { size, limit }) => Some(format!(
                        "the result is {size} bytes, over the store's limit of {limit}"
                    )),
                    // Lost to another worker, or the store is down: not a
                    // verdict on this result.
                    Ok(()) | Err(StoreError::LeaseLost) => None,
                    Err(e) if e.is_retryable() => None,
                    // The store refuses this result for good (Redis out of
                    // memory for it, a value it cannot hold): a retry would
                    // be refused again, so complete as not replayable.
                    Err(e) => Some(format!("the store refused the result: {e}")),
                };
                match refused {
                    None => {
                        if completed.is_ok() {
                            return Ok(Processed::Executed(value));
                        }
                        (bytes, completed)
                    }
                    Some(reason) => {
                        return self.record_marker(lease, value, reason, lease_end).await
                    }
                }
            }
            Err(reason) => return self.record_marker(lease, value, reason, lease_end).await,
        };
        match completed {
            Ok(()) => Ok(Processed::Executed(value)),
            Err(e) => Err(self.unrecorded(lease, bytes, e)),
        }
    }

    /// Completes with the "not replayable" marker: the handler ran but its
    /// result cannot be recorded for `reason`.
    async fn record_marker<T, E>(
        &self,
        lease: &Lease,
        value: T,
        reason: String,
        lease_end: &Mutex<Instant>,
    ) -> Result<Processed<T>, IdemError<E>> {
        let key = &lease.key;
        tracing::warn!(key = %key, %reason, "the handler ran but its result cannot be recorded: the key completes as not replayable");
        count("idem_not_replayable_total", key.scope());
        let marker = not_replayable_marker(&reason);
        match self.complete(lease, &marker, lease_end).await {
            Ok(()) => Ok(Processed::ExecutedNotReplayable { value, reason }),
            Err(e) => Err(self.unrecorded(lease, marker, e)),
        }
    }

    /// The error of a completion that failed after the handler ran: fenced
    /// off ([`IdemError::LeaseLost`]), or not written while the key is
    /// still this lease's ([`IdemError::Unrecorded`], to finish).
    fn unrecorded<E>(&self, lease: &Lease, response: Vec<u8>, e: StoreError) -> IdemError<E> {
        let key = &lease.key;
        match e {
            StoreError::LeaseLost => {
                count("idem_lease_lost_total", key.scope());
                tracing::warn!(key = %key, attempt = lease.attempt, fence = lease.fence, "completion fenced off: the lease was taken over while the handler ran");
                IdemError::LeaseLost
            }
            cause if cause.is_retryable() => {
                count("idem_unrecorded_total", key.scope());
                tracing::warn!(key = %key, attempt = lease.attempt, fence = lease.fence, error = %cause, "the handler ran but its completion is not written: finish it with its lease");
                IdemError::Unrecorded(Box::new(Unrecorded {
                    lease: lease.clone(),
                    response,
                    cause,
                }))
            }
            other => IdemError::Store(other),
        }
    }

    /// Writes the completion of a handler that ran but whose result was
    /// not recorded ([`IdemError::Unrecorded`]), with its own lease token:
    /// one `complete` call, no retry. `Ok`: recorded, every duplicate now
    /// gets the replay. [`StoreError::LeaseLost`]: another worker took the
    /// key over after the lease ended (its handler may run again there).
    /// A retryable error: the store is still away; call again later
    /// (a passed lease does not revoke, so this keeps working until
    /// someone takes the key over).
    pub async fn finish(&self, unrecorded: &Unrecorded) -> Result<(), StoreError> {
        let call = self
            .store
            .complete(&unrecorded.lease, &unrecorded.response, self.retention);
        let result = timed(self.store.backend_name(), StoreOperation::Complete, call).await;
        match &result {
            Ok(()) => count("idem_finished_total", unrecorded.lease.key.scope()),
            // Nothing waits to be finished any more, and the key ran again
            // elsewhere: counted apart (and as a lease lost).
            Err(StoreError::LeaseLost) => {
                count("idem_finish_lost_total", unrecorded.lease.key.scope());
                count("idem_lease_lost_total", unrecorded.lease.key.scope());
            }
            Err(_) => {}
        }
        result
    }

    /// Spawns the heartbeat task, if on and inside a tokio runtime.
    fn start_heartbeat(
        &self,
        lease: &Lease,
        lease_end: &Arc<Mutex<Instant>>,
    ) -> Option<AbortOnDrop> {
        if !self.heartbeat {
            return None;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %lease.key, "no tokio runtime: the lease is not renewed while the handler runs");
            return None;
        };
        let every = self.heartbeat_period();
        let task = heartbeat_loop(
            self.store.clone(),
            lease.clone(),
            self.lease,
            every,
            lease_end.clone(),
        );
        Some(AbortOnDrop(runtime.spawn(task)))
    }

    /// How often the heartbeat renews a lease: never less often than twice
    /// per lease (a renewal after the lease ended would come too late to
    /// keep a live handler's key).
    fn heartbeat_period(&self) -> Duration {
        self.heartbeat_every
            .unwrap_or(self.lease / 3)
            .min(self.lease / 2)
            .max(Duration::from_millis(1))
    }

    /// Records the response, retrying while the store is unavailable, never
    /// past the budget nor the end of the lease as last renewed.
    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        lease_end: &Mutex<Instant>,
    ) -> Result<(), StoreError> {
        let budget = self.complete_retry.unwrap_or(self.lease / 2);
        let give_up = later(Instant::now(), budget);
        // Pauses stay well inside the lease (an eighth of it at most), so
        // the retry lasts as long as the heartbeat keeps the lease.
        let longest = (self.lease / 8).clamp(Duration::from_millis(1), Duration::from_secs(1));
        let mut pause = Duration::from_millis(10).min(longest);
        loop {
            let call = self.store.complete(lease, response, self.retention);
            match timed(self.store.backend_name(), StoreOperation::Complete, call).await {
                Err(e) if e.is_retryable() => {
                    let resume = later(Instant::now(), pause);
                    let lease_over = *lock(lease_end);
                    if resume >= give_up || resume >= lease_over {
                        tracing::warn!(key = %lease.key, error = %e, "completion failed; giving up before the lease ends");
                        return Err(e);
                    }
                    tracing::warn!(key = %lease.key, error = %e, "completion failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(longest);
                }
                other => return other,
            }
        }
    }

    /// Acquires the key, applying the in-progress policy; with a lease, the
    /// instant its acquire was sent.
    async fn acquire<E>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Acquired, IdemError<E>> {
        let scope = key.scope();
        // When the first acquire was sent (the wait's start): read with
        // the send time, one clock read per call on the hot path.
        let mut first_sent = None;
        let mut pause = match self.in_progress {
            InProgressPolicy::Wait { poll, .. } => poll.max(Duration::from_millis(1)),
            InProgressPolicy::Reject => Duration::ZERO,
        };
        loop {
            // A key this receiver is finishing: wait here, never ask the
            // store (after the lease it would hand the key over).
            if let (InProgressPolicy::Wait { max_wait, poll }, Some(keys)) =
                (self.in_progress, &self.finishing)
            {
                let held = match fingerprint {
                    Some(fingerprint) => keys.holds(key, fingerprint),
                    None => keys.contains(key),
                };
                if held {
                    let waited = first_sent.get_or_insert_with(Instant::now).elapsed();
                    if waited >= max_wait {
                        return Err(IdemError::WaitTimeout { waited });
                    }
                    tokio::time::sleep(poll.max(Duration::from_millis(1)).min(max_wait - waited))
                        .await;
                    continue;
                }
            }
            // A key whose completion this receiver gave up writing (its
            // handler ran): never asked of the store, which would hand
            // the expired lease over. Checked after the wait above, which
            // ends when the finisher lets the key go (given up first).
            if let Some(keys) = &self.finishing {
                if keys.given_up().holds(key, fingerprint) {
                    if self.still_held(key).await? {
                        return Err(given_up_here());
                    }
                    keys.given_up().remove(key);
                }
            }
            let sent_at = Instant::now();
            let started = *first_sent.get_or_insert(sent_at);
            let call = self.store.acquire(key, fingerprint, self.lease);
            let backend = self.store.backend_name();
            match timed_since(sent_at, backend, StoreOperation::Acquire, call).await? {
                Acquisition::Acquired(lease) => return Ok(Acquired::Lease(lease, sent_at)),
                Acquisition::Completed(record) => return Ok(Acquired::Replay(record.response)),
                Acquisition::Mismatch => {
                    count("idem_mismatch_total", scope);
                    return Err(IdemError::PayloadMismatch);
                }
                Acquisition::InProgress {
                    retry_after,
                    attempt,
                    ..
                } => {
                    count("idem_in_progress_total", scope);
                    let InProgressPolicy::Wait { max_wait, poll } = self.in_progress else {
                        return Err(IdemError::InProgress {
                            retry_after,
                            attempt,
                        });
                    };
                    let waited = started.elapsed();
                    if waited >= max_wait {
                        return Err(IdemError::WaitTimeout { waited });
                    }
                    tokio::time::sleep(pause.min(max_wait - waited)).await;
                    pause = pause
                        .saturating_mul(2)
                        .min(poll.max(Duration::from_millis(1)).saturating_mul(16));
                }
            }
        }
    }

    /// Whether the store still holds a record of `key`, a key whose
    /// completion this receiver gave up writing: if not (an operator
    /// deleted it, or it expired), the key may run again.
    pub(crate) async fn still_held(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let call = self.store.get(key);
        Ok(timed(self.store.backend_name(), StoreOperation::Get, call)
            .await?
            .is_some())
    }

    async fn release(&self, lease: &Lease) {
        count("idem_released_total", lease.key.scope());
        let call = self.store.release(lease);
        if let Err(e) = timed(self.store.backend_name(), StoreOperation::Release, call).await {
            tracing::warn!(key = %lease.key, error = %e, "could not release the key; it frees itself when the lease ends");
        }
    }
}

/// Renews the lease until it is lost or the task is aborted, moving
/// `lease_end` on after each renewal.
async fn heartbeat_loop<S: IdempotencyStore + ?Sized>(
    store: Arc<S>,
    lease: Lease,
    lease_for: Duration,
    every: Duration,
    lease_end: Arc<Mutex<Instant>>,
) {
    loop {
        tokio::time::sleep(every).await;
        let sent_at = Instant::now();
        let call = store.extend(&lease, lease_for);
        match timed(store.backend_name(), StoreOperation::Extend, call).await {
            Ok(_) => {
                let mut end = lock(&lease_end);
                *end = (*end).max(later(sent_at, lease_for));
            }
            Err(StoreError::LeaseLost) => {
                tracing::debug!(key = %lease.key, attempt = lease.attempt, "heartbeat: the lease is no longer held (taken over, or already recorded)");
                return;
            }
            Err(e) => {
                tracing::warn!(key = %lease.key, error = %e, "heartbeat: lease renewal failed; will retry");
            }
        }
    }
}

/// Runs the handler, catching panics.
async fn run_handler<T, E, F, Fut>(handler: F, context: Context) -> HandlerOutcome<T, E>
where
    F: FnOnce(Context) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let future = match std::panic::catch_unwind(AssertUnwindSafe(|| handler(context))) {
        Ok(future) => future,
        Err(panic) => return HandlerOutcome::Panicked(panic_message(panic)),
    };
    match AssertUnwindSafe(future).catch_unwind().await {
        Ok(Ok(value)) => HandlerOutcome::Ok(value),
        Ok(Err(e)) => HandlerOutcome::Err(e),
        Err(panic) => HandlerOutcome::Panicked(panic_message(panic)),
    }
}

enum Acquired {
    Lease(Lease, Instant),
    Replay(bytes::Bytes),
}

enum HandlerOutcome<T, E> {
    Ok(T),
    Err(E),
    Panicked(String),
    /// The handler's own task was cancelled (the runtime shutting down):
    /// cut off after an unknown part of its effects, so never released.
    Cancelled(String),
    /// Not run: its lease may have ended while it waited for its turn
    /// (a batch's concurrency limit). Nothing ran, nothing is released.
    NotStarted,
}

/// Aborts a spawned task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `t + d`, or `t` itself if that does not fit (the caller then stops
/// early, the safe side).
fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d).unwrap_or(t)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn process_span(key: &IdempotencyKey) -> tracing::Span {
    tracing::info_span!(
        "idem.process",
        scope = key.scope(),
        outcome = tracing::field::Empty,
        attempt = tracing::field::Empty,
        fence = tracing::field::Empty,
    )
}

fn count(name: &'static str, scope: &str) {
    metrics::counter!(name, "scope" => scope.to_owned()).increment(1);
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

fn outcome_name<T, E>(result: &Result<Processed<T>, IdemError<E>>) -> &'static str {
    match result {
        Ok(Processed::Executed(_)) => "executed",
        Ok(Processed::Replayed(_)) => "replayed",
        Ok(Processed::ExecutedNotReplayable { .. }) => "executed_not_replayable",
        Err(IdemError::InProgress { .. }) => "in_progress",
        Err(IdemError::PayloadMismatch) => "mismatch",
        Err(IdemError::Handler(_)) => "handler_error",
        Err(IdemError::Panicked { .. }) => "panicked",
        Err(IdemError::LeaseLost) => "lease_lost",
        Err(IdemError::WaitTimeout { .. }) => "wait_timeout",
        Err(IdemError::Codec(_)) => "codec_error",
        Err(IdemError::ResultUnavailable { .. }) => "result_unavailable",
        Err(IdemError::InvalidConfig { .. }) => "invalid_config",
        Err(IdemError::Store(_)) => "store_error",
        Err(IdemError::InvalidKey(_)) => "invalid_key",
        Err(IdemError::Unrecorded(_)) => "unrecorded",
    }
}

/// The answer for a key whose completion this receiver gave up writing
/// ([`FinishingKeys::given_up`]): its handler ran, its result is not
/// recorded, and it never runs again here.
pub(crate) fn given_up_here<E>() -> IdemError<E> {
    IdemError::ResultUnavailable {
        reason:
            "the handler of this key ran at this receiver, but its result could not be recorded"
                .to_owned(),
    }
}
