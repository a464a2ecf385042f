//! The batch path of the executor: one `acquire_many` and one
//! `complete_many` for a batch of deliveries, each item with its own key,
//! fingerprint, handler and outcome.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::{join_all, OptionFuture};
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;
use tracing::Instrument;

use super::{
    count, given_up_here, later, lock, panic_message, run_handler, AbortOnDrop, Context,
    HandlerOutcome, Idempotency, InProgressPolicy, Processed,
};
use crate::codec::Codec;
use crate::error::{CodecError, IdemError, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{Acquisition, Lease};
use crate::store::{AcquireItem, IdempotencyStore};
use crate::telemetry::{timed, StoreOperation};

/// The outcome of one item of a batch.
pub type BatchOutcome<T, E> = Result<Processed<T>, IdemError<E>>;

/// An item on its way through a round: its position in the batch, key,
/// fingerprint and handler.
struct Item<F> {
    index: usize,
    key: IdempotencyKey,
    fingerprint: Option<Fingerprint>,
    handler: F,
}

/// A lease of the batch that the heartbeat renews until its item is
/// recorded (or released).
struct Held {
    lease: Lease,
    /// The lease surely ends no earlier than this, on our clock.
    end: Mutex<Instant>,
    live: AtomicBool,
}

impl Held {
    fn done(&self) {
        self.live.store(false, Ordering::SeqCst);
    }
}

/// What is left to do for an item whose handler ended.
enum Settle<T, E> {
    /// Its `Err` or panic: release the key, then this is its outcome.
    Release(BatchOutcome<T, E>),
    /// Its value: record it (the encoded form or why it has none; the
    /// answer of a batched completion already sent, if any).
    Record(T, Result<Vec<u8>, String>, Option<Result<(), StoreError>>),
}

impl<S, C> Idempotency<S, C>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// Runs a batch of deliveries (a broker poll, say): each item is
    /// `(key, payload)` and gets its own outcome, as if
    /// [`process`](Self::process) ran for it with `handler`, in the same
    /// order as the items. The whole batch costs one `acquire_many` and,
    /// when its handlers finish together, one `complete_many` (see [`process_batch_with`](Self::process_batch_with)
    /// for what happens to each item). A payload that does not serialize
    /// for its fingerprint is that item's [`IdemError::Codec`].
    ///
    /// ```
    /// use idem_core::{Idempotency, IdempotencyKey, MemoryStore, Processed};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let idem = Idempotency::new(MemoryStore::new());
    /// let key = |id: &str| IdempotencyKey::new("orders.ship", id);
    /// let poll = vec![(key("o-1")?, 10u32), (key("o-2")?, 20), (key("o-1")?, 10)];
    /// let out = idem
    ///     .process_batch(poll, |n| async move { Ok::<_, std::io::Error>(n * 2) })
    ///     .await;
    /// assert_eq!(out[0].as_ref().ok(), Some(&Processed::Executed(20)));
    /// assert_eq!(out[1].as_ref().ok(), Some(&Processed::Executed(40)));
    /// // The same key again in the batch: the first item's result.
    /// assert_eq!(out[2].as_ref().ok(), Some(&Processed::Replayed(20)));
    /// # Ok(()) }
    /// ```
    pub async fn process_batch<P, T, E, F, Fut>(
        &self,
        items: impl IntoIterator<Item = (IdempotencyKey, P)>,
        handler: F,
    ) -> Vec<BatchOutcome<T, E>>
    where
        P: Serialize,
        T: Serialize + DeserializeOwned,
        F: Fn(P) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let handler = &handler;
        let (items, refused) = fingerprinted(items, |payload| move |_: Context| handler(payload));
        let out = self.process_batch_with(items).await;
        merge(out, refused)
    }

    /// The batch form of [`process_with`](Self::process_with): each item
    /// is `(key, fingerprint, handler)`, and gets its own outcome, in the
    /// items' order:
    ///
    /// - all the keys are acquired with one
    ///   [`acquire_many`](IdempotencyStore::acquire_many); an item answered
    ///   with a recorded result gets [`Processed::Replayed`], one held
    ///   elsewhere [`IdemError::InProgress`] (with
    ///   [`InProgressPolicy::Wait`], that item waits on its own, as
    ///   `process_with` would), a mismatch [`IdemError::PayloadMismatch`];
    /// - the handlers of the acquired items run concurrently; one lease
    ///   renewal task (the heartbeat) renews all their leases while they
    ///   run;
    /// - the results are recorded with
    ///   [`complete_many`](IdempotencyStore::complete_many) as the
    ///   handlers finish: the results ready when a call can be sent go
    ///   together (one call, when the handlers finish together), so a slow
    ///   handler never holds up the recording of the others; an item whose
    ///   completion failed there (the store briefly unavailable) is retried
    ///   on its own as `process_with` retries it, and a result that cannot
    ///   be recorded completes its key as not replayable;
    /// - a handler's `Err` or panic releases its own key only.
    ///
    /// So a failure of one item never affects another item's record. A
    /// key that appears more than once in the batch is processed once per
    /// appearance, in order: the later items run after the earlier one is
    /// recorded (or released), so they get its replay (or, if it failed,
    /// run their own handler). Each such repetition costs one more
    /// `acquire_many` and `complete_many`.
    ///
    /// If the returned future is dropped, no key is released (as with
    /// `process`): use
    /// [`process_batch_with_detached`](Self::process_batch_with_detached)
    /// to have the handlers finish and be recorded whatever the caller
    /// does. An empty batch returns at once.
    pub async fn process_batch_with<T, E, F, Fut>(
        &self,
        items: impl IntoIterator<Item = (IdempotencyKey, Option<Fingerprint>, F)>,
    ) -> Vec<BatchOutcome<T, E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let items: Vec<_> = items.into_iter().collect();
        let span = batch_span(items.len());
        self.run_batch(items, run_handler).instrument(span).await
    }

    /// Detached mode of [`process_batch`](Self::process_batch): the whole
    /// batch runs in a spawned task that the returned future only awaits,
    /// and each handler in a task of its own (so handlers run in parallel
    /// on a multi-thread runtime). Dropping the future does not stop them:
    /// they finish and their results are recorded. See
    /// [`process_detached`](Self::process_detached).
    pub async fn process_batch_detached<P, T, E, F, Fut>(
        &self,
        items: impl IntoIterator<Item = (IdempotencyKey, P)>,
        handler: F,
    ) -> Vec<BatchOutcome<T, E>>
    where
        P: Serialize + Send + 'static,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: Fn(P) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let (items, refused) = fingerprinted(items, |payload| {
            let handler = handler.clone();
            move |_: Context| handler(payload)
        });
        let out = self.process_batch_with_detached(items).await;
        merge(out, refused)
    }

    /// Detached mode of [`process_batch_with`](Self::process_batch_with);
    /// see [`process_batch_detached`](Self::process_batch_detached).
    pub async fn process_batch_with_detached<T, E, F, Fut>(
        &self,
        items: impl IntoIterator<Item = (IdempotencyKey, Option<Fingerprint>, F)>,
    ) -> Vec<BatchOutcome<T, E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let items: Vec<_> = items.into_iter().collect();
        let n = items.len();
        if n == 0 {
            return Vec::new();
        }
        let this = self.clone();
        let span = batch_span(n);
        let task = async move { this.run_batch(items, spawn_handler).await }.instrument(span);
        match tokio::spawn(task).await {
            Ok(out) => out,
            // A panic in the store, or the runtime shutting down under the
            // task: what happened to each item is unknown.
            Err(e) => {
                let message = if e.is_panic() {
                    panic_message(e.into_panic())
                } else {
                    "the detached batch was cancelled (the runtime is shutting down)".to_owned()
                };
                (0..n)
                    .map(|_| {
                        Err(IdemError::Panicked {
                            message: message.clone(),
                        })
                    })
                    .collect()
            }
        }
    }

    /// Processes the batch in rounds: round `r` holds the `r`-th item of
    /// each key, so a key's items see the effect of the earlier ones.
    async fn run_batch<T, E, F, R, RFut>(
        &self,
        items: Vec<(IdempotencyKey, Option<Fingerprint>, F)>,
        runner: R,
    ) -> Vec<BatchOutcome<T, E>>
    where
        T: Serialize + DeserializeOwned,
        R: Fn(F, Context) -> RFut,
        RFut: Future<Output = HandlerOutcome<T, E>>,
    {
        let n = items.len();
        let mut out: Vec<Option<BatchOutcome<T, E>>> = (0..n).map(|_| None).collect();
        if let Some(detail) = self.config_error() {
            return (0..n)
                .map(|_| {
                    Err(IdemError::InvalidConfig {
                        detail: detail.clone(),
                    })
                })
                .collect();
        }
        let mut rounds: Vec<Vec<Item<F>>> = Vec::new();
        let mut seen: HashMap<IdempotencyKey, usize> = HashMap::new();
        for (index, (key, fingerprint, handler)) in items.into_iter().enumerate() {
            let round = seen.entry(key.clone()).or_insert(0);
            if rounds.len() <= *round {
                rounds.push(Vec::new());
            }
            rounds[*round].push(Item {
                index,
                key,
                fingerprint,
                handler,
            });
            *round += 1;
        }
        // Keys whose handler ran in an earlier round but whose completion
        // is not written (`Unrecorded`, the store away past the lease): the
        // key is still held by that run, to be finished by the caller. Its
        // later items are "in progress", never acquired (after the lease
        // an acquire would take the key over and run it again).
        let mut unrecorded: HashMap<IdempotencyKey, u32> = HashMap::new();
        for round in rounds {
            let (held, round): (Vec<_>, Vec<_>) = round
                .into_iter()
                .partition(|item| unrecorded.contains_key(&item.key));
            for item in held {
                let attempt = unrecorded.get(&item.key).copied().unwrap_or(1);
                out[item.index] = Some(Err(IdemError::InProgress {
                    retry_after: std::time::Duration::ZERO,
                    attempt,
                }));
            }
            // Keys whose completion the receiver gave up writing (their
            // handler ran): never acquired while the store holds their
            // record, as in a single call.
            let round: Vec<_> = match &self.finishing {
                Some(keys) if !keys.given_up().is_empty() => {
                    let mut kept = Vec::with_capacity(round.len());
                    for item in round {
                        if !keys.given_up().holds(&item.key, item.fingerprint.as_ref()) {
                            kept.push(item);
                            continue;
                        }
                        match self.still_held(&item.key).await {
                            Ok(true) => out[item.index] = Some(Err(given_up_here())),
                            Ok(false) => {
                                keys.given_up().remove(&item.key);
                                kept.push(item);
                            }
                            Err(e) => out[item.index] = Some(Err(IdemError::from(e))),
                        }
                    }
                    kept
                }
                _ => round,
            };
            if round.is_empty() {
                continue;
            }
            for (index, outcome) in self.run_round(round, &runner).await {
                if let Err(IdemError::Unrecorded(u)) = &outcome {
                    unrecorded.insert(u.lease().key.clone(), u.lease().attempt);
                }
                out[index] = Some(outcome);
            }
        }
        out.into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Err(IdemError::Store(StoreError::backend(
                        "an item of the batch was left without an outcome",
                    )))
                })
            })
            .collect()
    }

    /// One round: keys unique. Returns each item's outcome with its index.
    async fn run_round<T, E, F, R, RFut>(
        &self,
        items: Vec<Item<F>>,
        runner: &R,
    ) -> Vec<(usize, BatchOutcome<T, E>)>
    where
        T: Serialize + DeserializeOwned,
        R: Fn(F, Context) -> RFut,
        RFut: Future<Output = HandlerOutcome<T, E>>,
    {
        let sent_at = Instant::now();
        let answers = {
            let asked: Vec<AcquireItem<'_>> = items
                .iter()
                .map(|i| AcquireItem::new(&i.key, i.fingerprint.as_ref()))
                .collect();
            let call = self.store.acquire_many(&asked, self.lease);
            timed(self.store.backend_name(), StoreOperation::AcquireMany, call).await
        };
        let answers = match answers {
            Ok(answers) if answers.len() == items.len() => answers,
            Ok(answers) => {
                let e = StoreError::backend(format!(
                    "acquire_many answered {} items of {}",
                    answers.len(),
                    items.len()
                ));
                return items
                    .iter()
                    .map(|i| (i.index, Err(IdemError::Store(e.replicate()))))
                    .collect();
            }
            // Every item is unknown, as after a failed `acquire`.
            Err(e) => {
                return items
                    .iter()
                    .map(|i| (i.index, Err(IdemError::from(e.replicate()))))
                    .collect();
            }
        };

        let mut done: Vec<(usize, BatchOutcome<T, E>)> = Vec::new();
        let mut acquired: Vec<(usize, Lease, F)> = Vec::new();
        let mut waiting: Vec<Item<F>> = Vec::new();
        for (item, answer) in items.into_iter().zip(answers) {
            let scope = item.key.scope();
            match answer {
                Ok(Acquisition::Acquired(lease)) => {
                    count("idem_acquired_total", scope);
                    acquired.push((item.index, lease, item.handler));
                }
                Ok(Acquisition::Completed(record)) => {
                    done.push((item.index, self.replay(scope, &record.response)));
                }
                Ok(Acquisition::Mismatch) => {
                    count("idem_mismatch_total", scope);
                    done.push((item.index, Err(IdemError::PayloadMismatch)));
                }
                Ok(Acquisition::InProgress {
                    retry_after,
                    attempt,
                    ..
                }) => {
                    count("idem_in_progress_total", scope);
                    match self.in_progress {
                        InProgressPolicy::Reject => done.push((
                            item.index,
                            Err(IdemError::InProgress {
                                retry_after,
                                attempt,
                            }),
                        )),
                        InProgressPolicy::Wait { .. } => waiting.push(item),
                    }
                }
                Err(e) => done.push((item.index, Err(IdemError::from(e)))),
            }
        }

        // Items held elsewhere under `Wait` take the single path, each on
        // its own, alongside the batch.
        let waits = join_all(waiting.into_iter().map(|item| async move {
            let outcome = self
                .run_with(&item.key, item.fingerprint.as_ref(), item.handler, runner)
                .await;
            (item.index, outcome)
        }));
        let (ran, waited) = futures::join!(self.run_acquired(acquired, sent_at, runner), waits);
        done.extend(ran);
        done.extend(waited);
        done
    }

    /// Runs the handlers of the acquired items concurrently under one
    /// heartbeat, releases the keys of those that failed, and records the
    /// others with `complete_many` as they finish: the results ready when
    /// a completion can be sent go together (all of them, when the
    /// handlers finish together), so a slow handler never holds up the
    /// recording of the others.
    async fn run_acquired<T, E, F, R, RFut>(
        &self,
        acquired: Vec<(usize, Lease, F)>,
        sent_at: Instant,
        runner: &R,
    ) -> Vec<(usize, BatchOutcome<T, E>)>
    where
        T: Serialize + DeserializeOwned,
        R: Fn(F, Context) -> RFut,
        RFut: Future<Output = HandlerOutcome<T, E>>,
    {
        if acquired.is_empty() {
            return Vec::new();
        }
        let mut handlers = Vec::with_capacity(acquired.len());
        let mut held = Vec::with_capacity(acquired.len());
        let mut indices = Vec::with_capacity(acquired.len());
        for (index, lease, handler) in acquired {
            indices.push(index);
            handlers.push(handler);
            held.push(Held {
                end: Mutex::new(later(sent_at, self.lease)),
                lease,
                live: AtomicBool::new(true),
            });
        }
        let held = Arc::new(held);
        let heartbeat = self.start_batch_heartbeat(&held);
        if heartbeat.is_some() {
            // As in `run`: let the heartbeat start before a handler that
            // blocks this thread can starve it.
            tokio::task::yield_now().await;
        }
        let held = &*held;

        // `batch_concurrency`: handlers take turns, and one whose lease may
        // have ended while it waited does not start.
        let turns = self
            .batch_concurrency
            .map(|n| tokio::sync::Semaphore::new(n.min(tokio::sync::Semaphore::MAX_PERMITS)));
        let turns = turns.as_ref();
        let mut running: FuturesUnordered<_> = handlers
            .into_iter()
            .enumerate()
            .map(|(k, handler)| {
                let lease = &held[k].lease;
                let context = Context {
                    attempt: lease.attempt,
                    fence: lease.fence,
                    token: lease.token,
                };
                let end = &held[k].end;
                async move {
                    // The semaphore is never closed.
                    let _turn = match turns {
                        Some(turns) => Some(turns.acquire().await),
                        None => None,
                    };
                    if turns.is_some() {
                        let end = *end.lock().unwrap_or_else(|p| p.into_inner());
                        if Instant::now() >= end {
                            return (k, HandlerOutcome::NotStarted);
                        }
                    }
                    (k, runner(handler, context).await)
                }
            })
            .collect();
        // Values that encoded, waiting for a completion call.
        let mut ready: Vec<(usize, T, Vec<u8>)> = Vec::new();
        // The completion call in flight, with the values it carries.
        let mut sending = None;
        // Items being settled on their own: a release, a retried
        // completion, the not-replayable marker.
        let mut settling = FuturesUnordered::new();
        let mut outcomes: Vec<Option<BatchOutcome<T, E>>> = held.iter().map(|_| None).collect();

        let settle = |k: usize, ran: Settle<T, E>| {
            let held = &held[k];
            async move {
                let outcome = match ran {
                    Settle::Release(outcome) => {
                        self.release(&held.lease).await;
                        outcome
                    }
                    Settle::Record(value, encoded, first) => {
                        self.record(&held.lease, value, encoded, &held.end, first)
                            .await
                    }
                };
                held.done();
                (k, outcome)
            }
        };
        loop {
            if sending.is_none() && !ready.is_empty() {
                let batch = std::mem::take(&mut ready);
                sending = Some(Box::pin(async move {
                    let items: Vec<(&Lease, &[u8])> = batch
                        .iter()
                        .map(|(k, _, bytes)| (&held[*k].lease, bytes.as_slice()))
                        .collect();
                    let call = self.store.complete_many(&items, self.retention);
                    let answers = timed(
                        self.store.backend_name(),
                        StoreOperation::CompleteMany,
                        call,
                    )
                    .await;
                    (batch, answers)
                }));
            }
            if running.is_empty() && sending.is_none() && settling.is_empty() {
                break;
            }
            tokio::select! {
                Some((k, ran)) = running.next(), if !running.is_empty() => {
                    // Take every handler that finished meanwhile too.
                    let mut finished = vec![(k, ran)];
                    while let Some(Some(more)) = running.next().now_or_never() {
                        finished.push(more);
                    }
                    for (k, ran) in finished {
                        match ran {
                            HandlerOutcome::Ok(value) => match self.encode(&value) {
                                Ok(bytes) => ready.push((k, value, bytes)),
                                Err(reason) => {
                                    settling.push(settle(k, Settle::Record(value, Err(reason), None)))
                                }
                            },
                            HandlerOutcome::Err(e) => {
                                held[k].done();
                                settling.push(settle(k, Settle::Release(Err(IdemError::Handler(e)))));
                            }
                            HandlerOutcome::Panicked(message) => {
                                held[k].done();
                                settling.push(settle(k, Settle::Release(Err(IdemError::Panicked { message }))));
                            }
                            HandlerOutcome::Cancelled(message) => {
                                // Cut off: never released.
                                held[k].done();
                                outcomes[k] = Some(Err(IdemError::Panicked { message }));
                            }
                            HandlerOutcome::NotStarted => {
                                // Never ran; the key may be another's now.
                                held[k].done();
                                outcomes[k] = Some(Err(IdemError::InProgress {
                                    retry_after: std::time::Duration::ZERO,
                                    attempt: held[k].lease.attempt,
                                }));
                            }
                        }
                    }
                }
                Some((batch, answers)) = OptionFuture::from(sending.as_mut()), if sending.is_some() => {
                    sending = None;
                    let answers = match answers {
                        Ok(answers) if answers.len() == batch.len() => answers.into_iter().map(Some).collect(),
                        // Unknown: each item completes on its own (again
                        // with the same lease: harmless).
                        _ => batch.iter().map(|_| None).collect::<Vec<_>>(),
                    };
                    for ((k, value, bytes), answer) in batch.into_iter().zip(answers) {
                        match answer {
                            Some(Ok(())) => {
                                held[k].done();
                                outcomes[k] = Some(Ok(Processed::Executed(value)));
                            }
                            first => settling.push(settle(k, Settle::Record(value, Ok(bytes), first))),
                        }
                    }
                }
                Some((k, outcome)) = settling.next(), if !settling.is_empty() => {
                    outcomes[k] = Some(outcome);
                }
            }
        }
        drop(heartbeat);
        indices
            .into_iter()
            .zip(outcomes)
            .map(|(index, outcome)| {
                let outcome = outcome.unwrap_or_else(|| {
                    Err(IdemError::Store(StoreError::backend(
                        "an item of the batch was left without an outcome",
                    )))
                });
                (index, outcome)
            })
            .collect()
    }

    /// Spawns one task that renews every live lease of the batch, if the
    /// heartbeat is on and a tokio runtime is there.
    fn start_batch_heartbeat(&self, held: &Arc<Vec<Held>>) -> Option<AbortOnDrop> {
        if !self.heartbeat {
            return None;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                "no tokio runtime: the leases of the batch are not renewed while its handlers run"
            );
            return None;
        };
        let every = self.heartbeat_period();
        let (store, held, lease_for) = (self.store.clone(), held.clone(), self.lease);
        Some(AbortOnDrop(runtime.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let live: Vec<&Held> = held
                    .iter()
                    .filter(|h| h.live.load(Ordering::SeqCst))
                    .collect();
                if live.is_empty() {
                    return;
                }
                let sent_at = Instant::now();
                let backend = store.backend_name();
                let renewed = join_all(live.iter().map(|h| {
                    timed(backend, StoreOperation::Extend, store.extend(&h.lease, lease_for))
                }))
                .await;
                for (h, renewed) in live.into_iter().zip(renewed) {
                    match renewed {
                        Ok(_) => {
                            let mut end = lock(&h.end);
                            *end = (*end).max(later(sent_at, lease_for));
                        }
                        Err(StoreError::LeaseLost) => {
                            tracing::debug!(key = %h.lease.key, attempt = h.lease.attempt, "heartbeat: the lease is no longer held (taken over, or already recorded)");
                            h.done();
                        }
                        Err(e) => {
                            tracing::warn!(key = %h.lease.key, error = %e, "heartbeat: lease renewal failed; will retry");
                        }
                    }
                }
            }
        })))
    }
}

/// Fingerprints each payload; an item whose payload does not serialize is
/// set aside with its error (and its position).
#[allow(clippy::type_complexity)]
fn fingerprinted<P, H, T, E>(
    items: impl IntoIterator<Item = (IdempotencyKey, P)>,
    mut handler_for: impl FnMut(P) -> H,
) -> (
    Vec<(IdempotencyKey, Option<Fingerprint>, H)>,
    Vec<(usize, BatchOutcome<T, E>)>,
)
where
    P: Serialize,
{
    let mut ok = Vec::new();
    let mut refused = Vec::new();
    for (index, (key, payload)) in items.into_iter().enumerate() {
        match Fingerprint::of(&payload) {
            Ok(fingerprint) => ok.push((key, Some(fingerprint), handler_for(payload))),
            Err(e) => refused.push((
                index,
                Err(IdemError::Codec(CodecError::Encode(Box::new(e)))),
            )),
        }
    }
    (ok, refused)
}

/// Puts the outcomes of the items set aside back at their positions.
fn merge<T, E>(
    processed: Vec<BatchOutcome<T, E>>,
    refused: Vec<(usize, BatchOutcome<T, E>)>,
) -> Vec<BatchOutcome<T, E>> {
    if refused.is_empty() {
        return processed;
    }
    let n = processed.len() + refused.len();
    let mut processed = processed.into_iter();
    let mut refused = refused.into_iter().peekable();
    (0..n)
        .map(|i| match refused.next_if(|(at, _)| *at == i) {
            Some((_, outcome)) => outcome,
            None => processed.next().unwrap_or_else(|| {
                Err(IdemError::Store(StoreError::backend(
                    "an item of the batch was left without an outcome",
                )))
            }),
        })
        .collect()
}

/// Runs a handler in a task of its own (detached batches): a panic is the
/// handler's; a cancelled task (the runtime shutting down) is not released.
async fn spawn_handler<T, E, F, Fut>(handler: F, context: Context) -> HandlerOutcome<T, E>
where
    T: Send + 'static,
    E: Send + 'static,
    F: FnOnce(Context) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
{
    match tokio::spawn(run_handler(handler, context)).await {
        Ok(outcome) => outcome,
        Err(e) if e.is_panic() => HandlerOutcome::Panicked(panic_message(e.into_panic())),
        Err(_) => HandlerOutcome::Cancelled(
            "the handler's task was cancelled (the runtime is shutting down); its key is not \
             released"
                .to_owned(),
        ),
    }
}

fn batch_span(items: usize) -> tracing::Span {
    tracing::info_span!("idem.process_batch", items)
}
