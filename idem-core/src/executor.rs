//! The `Idempotency` executor: acquire, run once, record, replay.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;

use crate::codec::{Codec, JsonCodec};
use crate::error::{CodecError, IdemError, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{Acquisition, Lease, LeaseToken};
use crate::store::IdempotencyStore;

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
}

impl<T> Processed<T> {
    /// The value, executed or replayed.
    pub fn into_inner(self) -> T {
        match self {
            Processed::Executed(v) | Processed::Replayed(v) => v,
        }
    }

    /// A reference to the value.
    pub fn value(&self) -> &T {
        match self {
            Processed::Executed(v) | Processed::Replayed(v) => v,
        }
    }

    /// Whether the result was replayed.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Processed::Replayed(_))
    }
}

/// What [`Idempotency::process_with`] tells the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Context {
    /// 1 on the first acquisition; more after a takeover, which means an
    /// earlier worker started this handler and may have done its side
    /// effects before it vanished. Pass it on as a fencing number to
    /// systems that can check one.
    pub attempt: u32,
    /// The fencing token of this acquisition.
    pub token: LeaseToken,
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
    /// it bounds how long a *crashed* worker blocks the key.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long a completed result is kept for replay. A duplicate that
    /// arrives later runs the handler again: pick a retention longer than
    /// the longest redelivery window of your broker or clients.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// What to do when another worker holds the key.
    pub fn on_in_progress(mut self, policy: InProgressPolicy) -> Self {
        self.in_progress = policy;
        self
    }

    /// Renew the lease while the handler runs (default on). The renewal
    /// runs beside the handler in the same task, every third of the lease
    /// (see [`heartbeat_interval`](Self::heartbeat_interval)), and stops
    /// when the handler ends. Off, a handler slower than the lease can be
    /// taken over and its completion gets [`IdemError::LeaseLost`].
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// How often the heartbeat renews the lease; default a third of it.
    pub fn heartbeat_interval(mut self, every: Duration) -> Self {
        self.heartbeat_every = Some(every);
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
        }
    }

    /// How long to keep retrying the completion after the handler succeeded
    /// when the store is briefly unavailable (a restart, a failover), with
    /// backoff from 10 ms to 1 s. Default: half the lease. Giving up leaves
    /// the key in progress; after the lease another delivery would run the
    /// handler again, so retrying is what keeps the effect single. It is
    /// always safe: the completion is a compare-and-set on the lease token.
    pub fn complete_retry(mut self, budget: Duration) -> Self {
        self.complete_retry = Some(budget);
        self
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// Runs `handler(payload)` once for `key` and records its result; a
    /// duplicate gets [`Processed::Replayed`] with the recorded result. The
    /// payload's fingerprint (SHA-256 of its canonical JSON) is stored, and
    /// a later call with the same key and another payload gets
    /// [`IdemError::PayloadMismatch`].
    ///
    /// The handler's `Err` releases the key and comes back as
    /// [`IdemError::Handler`]; a panic releases it too and comes back as
    /// [`IdemError::Panicked`]. If the returned future is dropped while the
    /// handler runs, the key is released in a spawned task (best effort; if
    /// that fails, the lease expiry frees the key).
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
    /// attempt number.
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
        let span = tracing::info_span!(
            "idem.process",
            scope = key.scope(),
            outcome = tracing::field::Empty,
            attempt = tracing::field::Empty,
        );
        async move {
            let result = self.run(key, fingerprint.as_ref(), handler).await;
            let span = tracing::Span::current();
            span.record("outcome", outcome_name(&result));
            result
        }
        .instrument(span)
        .await
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
        let scope = key.scope();
        let lease = self.acquire(key, fingerprint).await?;
        let lease = match lease {
            Acquired::Lease(lease) => lease,
            Acquired::Replay(response) => {
                count("idem_replayed_total", scope);
                return self
                    .codec
                    .decode(&response)
                    .map(Processed::Replayed)
                    .map_err(IdemError::Codec);
            }
        };
        count("idem_acquired_total", scope);
        tracing::Span::current().record("attempt", lease.attempt);

        let mut guard = ReleaseOnDrop {
            store: self.store.clone(),
            lease: Some(lease.clone()),
        };
        let context = Context {
            attempt: lease.attempt,
            token: lease.token,
        };
        let outcome = self.run_handler(&lease, handler, context).await;

        // From here on the guard must not release behind our back.
        guard.lease = None;
        let value = match outcome {
            HandlerOutcome::Ok(value) => value,
            HandlerOutcome::Err(e) => {
                self.release(&lease).await;
                return Err(IdemError::Handler(e));
            }
            HandlerOutcome::Panicked(message) => {
                self.release(&lease).await;
                return Err(IdemError::Panicked { message });
            }
        };
        let bytes = match self.codec.encode(&value) {
            Ok(bytes) => bytes,
            Err(e) => {
                self.release(&lease).await;
                return Err(IdemError::Codec(e));
            }
        };
        match self.complete(&lease, &bytes).await {
            Ok(()) => Ok(Processed::Executed(value)),
            Err(StoreError::LeaseLost) => {
                count("idem_lease_lost_total", scope);
                tracing::warn!(key = %key, attempt = lease.attempt, "completion fenced off: the lease was taken over while the handler ran");
                Err(IdemError::LeaseLost)
            }
            Err(e @ StoreError::ResponseTooLarge { .. }) => {
                // Refused before anything was written: the key would stay
                // in progress until its lease ran out. Release it, as for a
                // response that does not encode.
                self.release(&lease).await;
                Err(IdemError::Store(e))
            }
            Err(e) => Err(IdemError::Store(e)),
        }
    }

    /// Records the response, retrying while the store is unavailable.
    async fn complete(&self, lease: &Lease, response: &[u8]) -> Result<(), StoreError> {
        let budget = self.complete_retry.unwrap_or(self.lease / 2);
        let deadline = tokio::time::Instant::now() + budget;
        let mut pause = Duration::from_millis(10);
        loop {
            match self.store.complete(lease, response, self.retention).await {
                Err(e) if e.is_retryable() && tokio::time::Instant::now() + pause < deadline => {
                    tracing::warn!(key = %lease.key, error = %e, "completion failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                other => return other,
            }
        }
    }

    /// Acquires the key, applying the in-progress policy.
    async fn acquire<E>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Acquired, IdemError<E>> {
        let scope = key.scope();
        let started = tokio::time::Instant::now();
        let mut pause = match self.in_progress {
            InProgressPolicy::Wait { poll, .. } => poll.max(Duration::from_millis(1)),
            InProgressPolicy::Reject => Duration::ZERO,
        };
        loop {
            match self.store.acquire(key, fingerprint, self.lease).await? {
                Acquisition::Acquired(lease) => return Ok(Acquired::Lease(lease)),
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
                    pause = (pause * 2).min(poll.max(Duration::from_millis(1)) * 16);
                }
            }
        }
    }

    /// Runs the handler, with the heartbeat beside it, catching panics.
    async fn run_handler<T, E, F, Fut>(
        &self,
        lease: &Lease,
        handler: F,
        context: Context,
    ) -> HandlerOutcome<T, E>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let future = match std::panic::catch_unwind(AssertUnwindSafe(|| handler(context))) {
            Ok(future) => future,
            Err(panic) => return HandlerOutcome::Panicked(panic_message(panic)),
        };
        let guarded = AssertUnwindSafe(future).catch_unwind();
        let result = if self.heartbeat {
            let heartbeat = self.heartbeat_loop(lease);
            tokio::pin!(guarded);
            tokio::pin!(heartbeat);
            tokio::select! {
                biased;
                result = &mut guarded => result,
                _ = &mut heartbeat => guarded.await,
            }
        } else {
            guarded.await
        };
        match result {
            Ok(Ok(value)) => HandlerOutcome::Ok(value),
            Ok(Err(e)) => HandlerOutcome::Err(e),
            Err(panic) => HandlerOutcome::Panicked(panic_message(panic)),
        }
    }

    /// Renews the lease until it is lost; then returns.
    async fn heartbeat_loop(&self, lease: &Lease) {
        let every = self
            .heartbeat_every
            .unwrap_or(self.lease / 3)
            .max(Duration::from_millis(1));
        loop {
            tokio::time::sleep(every).await;
            match self.store.extend(lease, self.lease).await {
                Ok(_) => {}
                Err(StoreError::LeaseLost) => {
                    tracing::warn!(key = %lease.key, attempt = lease.attempt, "heartbeat: lease lost while the handler runs");
                    return;
                }
                Err(e) => {
                    tracing::warn!(key = %lease.key, error = %e, "heartbeat: lease renewal failed; will retry");
                }
            }
        }
    }

    async fn release(&self, lease: &Lease) {
        count("idem_released_total", lease.key.scope());
        if let Err(e) = self.store.release(lease).await {
            tracing::warn!(key = %lease.key, error = %e, "could not release the key; it frees itself when the lease ends");
        }
    }
}

enum Acquired {
    Lease(Lease),
    Replay(bytes::Bytes),
}

enum HandlerOutcome<T, E> {
    Ok(T),
    Err(E),
    Panicked(String),
}

/// Releases the lease in a spawned task if the `process` future is dropped
/// while the handler runs.
struct ReleaseOnDrop<S: IdempotencyStore + ?Sized> {
    store: Arc<S>,
    lease: Option<Lease>,
}

impl<S: IdempotencyStore + ?Sized> Drop for ReleaseOnDrop<S> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        count("idem_released_total", lease.key.scope());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let store = self.store.clone();
                runtime.spawn(async move {
                    if let Err(e) = store.release(&lease).await {
                        tracing::warn!(key = %lease.key, error = %e, "cancelled handler: could not release the key; it frees itself when the lease ends");
                    }
                });
            }
            Err(_) => {
                tracing::warn!(key = %lease.key, "cancelled handler outside a tokio runtime: the key frees itself when the lease ends");
            }
        }
    }
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
        Err(IdemError::InProgress { .. }) => "in_progress",
        Err(IdemError::PayloadMismatch) => "mismatch",
        Err(IdemError::Handler(_)) => "handler_error",
        Err(IdemError::Panicked { .. }) => "panicked",
        Err(IdemError::LeaseLost) => "lease_lost",
        Err(IdemError::WaitTimeout { .. }) => "wait_timeout",
        Err(IdemError::Codec(_)) => "codec_error",
        Err(IdemError::Store(_)) => "store_error",
        Err(IdemError::InvalidKey(_)) => "invalid_key",
    }
}
