//! Natural batching (group commit) of concurrent single calls.
//!
//! While one call of a store is in flight, the `acquire`s (and the
//! `complete`s) that other tasks make meanwhile wait for it in a queue,
//! and then go together as one [`acquire_many`](IdempotencyStore::acquire_many)
//! (one [`complete_many`](IdempotencyStore::complete_many)): one round
//! trip serves many callers. A call that finds nothing in flight goes at
//! once, alone, so a lone caller waits for nothing. This is how databases
//! do group commit.
//!
//! Each caller gets the answer its own call would have got: the batch
//! operations answer per item and in order (a key twice in a batch sees
//! its earlier item, as two calls one after the other would), and a
//! batched call that fails or loses its reply is each item's failure or
//! lost reply, with the rules a single call has (an acquire whose reply
//! was lost may have reserved the key for nobody until its lease ends).
//! A caller that goes away while its item still waits in the queue is
//! left out of the batch: nothing is sent for it, as for a single call
//! dropped before it was sent.
//!
//! The stores of the idem crates batch by default; a store of your own
//! can hold a [`Batcher`] and route its single calls through it.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::oneshot;

use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{Acquisition, Lease};
use crate::store::{AcquireItem, IdempotencyStore};

/// The histogram of the number of single calls each batched call served,
/// labelled `backend` and `operation` (`acquire` or `complete`). A call
/// sent alone (nothing in flight) is not recorded.
pub const STORE_BATCH_SIZE: &str = "idem_store_batch_size";

/// The most items one batched call carries, whatever
/// [`Batching::max_items`] asks for.
pub const MAX_BATCH_ITEMS: usize = 10_000;

/// How long a call waits at most in the queue by default; see
/// [`Batching::max_wait`].
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_millis(10);

/// The most batched calls in flight at once, whatever
/// [`Batching::in_flight`] asks for.
pub const MAX_IN_FLIGHT: usize = 1_024;

/// How a store batches concurrent single calls (see the
/// [module docs](crate::batching)). On by default: at most 128 items and
/// 1 MiB of responses per batched call, one call of each kind
/// (`acquire`, `complete`) in flight at a time.
///
/// ```
/// use idem_core::Batching;
///
/// let default = Batching::default();
/// assert!(default.is_on());
/// assert_eq!(default.items(), 128);
/// // Settings out of range are clamped, never a panic.
/// let clamped = Batching::default().max_items(0).in_flight(usize::MAX);
/// assert_eq!((clamped.items(), clamped.calls_in_flight()), (1, 1_024));
/// assert!(!Batching::off().is_on());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    on: bool,
    max_items: usize,
    max_bytes: usize,
    in_flight: usize,
    max_wait: Duration,
}

impl Default for Batching {
    fn default() -> Self {
        Batching {
            on: true,
            max_items: 128,
            max_bytes: 1 << 20,
            in_flight: 1,
            max_wait: DEFAULT_MAX_WAIT,
        }
    }
}

impl Batching {
    /// No batching: every call goes alone, at once.
    pub fn off() -> Self {
        Batching {
            on: false,
            ..Batching::default()
        }
    }

    /// The most calls one batched call serves (default 128; clamped to
    /// `1..=`[`MAX_BATCH_ITEMS`]). The calls beyond it wait for the next one.
    pub fn max_items(mut self, n: usize) -> Self {
        self.max_items = n.clamp(1, MAX_BATCH_ITEMS);
        self
    }

    /// The most response bytes one batched `complete_many` carries
    /// (default 1 MiB). A response larger than this goes alone, at once:
    /// it is not copied into a queue.
    pub fn max_bytes(mut self, n: usize) -> Self {
        self.max_bytes = n;
        self
    }

    /// How many calls of each kind may be in flight before new ones wait
    /// to be batched (default 1; clamped to `1..=`[`MAX_IN_FLIGHT`]). More
    /// lets a server with several cores (PostgreSQL) work on several
    /// batches at once, at the price of smaller batches.
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n.clamp(1, MAX_IN_FLIGHT);
        self
    }

    /// The longest a call waits in the queue for the call in flight
    /// (default [`DEFAULT_MAX_WAIT`], 10 ms; at least 1 µs, at most
    /// [`MAX_DURATION`](crate::MAX_DURATION)). A call in flight that takes
    /// longer (PostgreSQL: waiting for a lock another transaction holds)
    /// then no longer holds up the others: the waiting calls go as a
    /// batch of their own beside it.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.max_wait = crate::saturate(wait).max(Duration::from_micros(1));
        self
    }

    /// The longest a call waits for the call in flight.
    pub fn waits_at_most(&self) -> Duration {
        self.max_wait
    }

    /// Whether calls are batched.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// The most calls per batched call.
    pub fn items(&self) -> usize {
        self.max_items
    }

    /// The most response bytes per batched call.
    pub fn bytes(&self) -> usize {
        self.max_bytes
    }

    /// The calls of each kind in flight before new ones wait.
    pub fn calls_in_flight(&self) -> usize {
        self.in_flight
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Sends a batch of requests with an owned clone of the store: one answer
/// per request, in order.
type SendFn<S, R, T> = fn(S, Vec<R>) -> BoxFuture<Vec<Result<T, StoreError>>>;

/// The batching of one store's `acquire` and `complete` calls. Cloning it
/// shares its queues (a store's clones batch together).
///
/// A store routes a single call through [`acquire`](Self::acquire) or
/// [`complete`](Self::complete), handing over the future of the call made
/// alone; the batched path calls the store's own `acquire_many` or
/// `complete_many`, which must not come back here.
#[derive(Clone)]
pub struct Batcher {
    settings: Batching,
    acquires: Arc<Queue<AcquireRequest, Acquisition>>,
    completes: Arc<Queue<CompleteRequest, ()>>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("settings", &self.settings)
            .finish()
    }
}

struct AcquireRequest {
    key: IdempotencyKey,
    fingerprint: Option<Fingerprint>,
    lease: Duration,
}

struct CompleteRequest {
    lease: Lease,
    response: Vec<u8>,
    retention: Duration,
}

impl Batcher {
    /// A batcher with `settings`, for a store whose
    /// [`backend_name`](IdempotencyStore::backend_name) is `backend` (the
    /// label of [`STORE_BATCH_SIZE`]).
    pub fn new(settings: Batching, backend: &'static str) -> Self {
        Batcher {
            settings,
            acquires: Arc::new(Queue::new(settings, backend, "acquire")),
            completes: Arc::new(Queue::new(settings, backend, "complete")),
        }
    }

    /// Its settings.
    pub fn settings(&self) -> Batching {
        self.settings
    }

    /// The `acquire` and `complete` calls waiting now for the call in
    /// flight, to go in the next batch.
    pub fn waiting(&self) -> (usize, usize) {
        (
            self.acquires.lock().waiting.len(),
            self.completes.lock().waiting.len(),
        )
    }

    /// `store.acquire(key, fingerprint, lease)`: `alone` (the call made by
    /// itself) when nothing is in flight, else batched with the calls that
    /// wait with it into `store.acquire_many`.
    pub async fn acquire<S, F>(
        &self,
        store: &S,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        alone: F,
    ) -> Result<Acquisition, StoreError>
    where
        S: IdempotencyStore + Clone,
        F: Future<Output = Result<Acquisition, StoreError>>,
    {
        if !self.settings.on {
            return alone.await;
        }
        let request = || AcquireRequest {
            key: key.clone(),
            fingerprint: fingerprint.copied(),
            lease,
        };
        self.acquires
            .call(store, send_acquires::<S>, 0, request, alone)
            .await
    }

    /// `store.complete(lease, response, retention)`: `alone` when nothing
    /// is in flight or the response is larger than
    /// [`Batching::max_bytes`], else batched into `store.complete_many`.
    pub async fn complete<S, F>(
        &self,
        store: &S,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
        alone: F,
    ) -> Result<(), StoreError>
    where
        S: IdempotencyStore + Clone,
        F: Future<Output = Result<(), StoreError>>,
    {
        if !self.settings.on {
            return alone.await;
        }
        let request = || CompleteRequest {
            lease: lease.clone(),
            response: response.to_vec(),
            retention,
        };
        self.completes
            .call(store, send_completes::<S>, response.len(), request, alone)
            .await
    }
}

/// The calls of one kind waiting for the one in flight.
struct Queue<R, T> {
    settings: Batching,
    backend: &'static str,
    operation: &'static str,
    state: Mutex<State<R, T>>,
}

struct State<R, T> {
    /// Calls in flight: alone or batched.
    in_flight: usize,
    waiting: VecDeque<Waiting<R, T>>,
    /// The number of the next call to wait.
    next: u64,
}

struct Waiting<R, T> {
    /// Its number, to find it in the queue.
    number: u64,
    request: R,
    weight: usize,
    /// Where its batch is handed to it, once taken.
    reply: oneshot::Sender<Assigned<T>>,
}

/// The answers of one batched call, one per item, each taken by its
/// caller; `None` if the call panicked.
type Answers<T> = Option<Arc<Vec<Mutex<Option<Result<T, StoreError>>>>>>;

/// A batched call in flight. Every caller in it polls it, so it goes on
/// while any of them waits, on whichever runtime that one runs (several
/// runtimes may share a store, and one may stop being driven while a batch
/// of its callers is in flight); when all of them went away, it is
/// dropped, as their calls made alone would be.
type InFlight<T> = futures::future::Shared<BoxFuture<Answers<T>>>;

/// A caller's place in a batched call.
struct Assigned<T> {
    call: InFlight<T>,
    index: usize,
}

impl<R: Send + 'static, T: Send + 'static> Queue<R, T> {
    fn new(settings: Batching, backend: &'static str, operation: &'static str) -> Self {
        Queue {
            settings,
            backend,
            operation,
            state: Mutex::new(State {
                in_flight: 0,
                waiting: VecDeque::new(),
                next: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<R, T>> {
        // Nothing here panics while holding the lock; a poisoned one still
        // holds a consistent queue.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn call<S, F>(
        self: &Arc<Self>,
        store: &S,
        send: SendFn<S, R, T>,
        weight: usize,
        request: impl FnOnce() -> R,
        alone: F,
    ) -> Result<T, StoreError>
    where
        S: Clone + Send + Sync + 'static,
        F: Future<Output = Result<T, StoreError>>,
    {
        if weight > self.settings.max_bytes {
            return alone.await;
        }
        let waited = {
            let mut state = self.lock();
            if state.in_flight < self.settings.in_flight && state.waiting.is_empty() {
                state.in_flight += 1;
                None
            } else if state.in_flight < self.settings.in_flight {
                // A free slot with calls waiting (rare): this call goes
                // with them, once the store is cloned outside the lock.
                drop(state);
                let owned = store.clone();
                let (reply, assigned) = oneshot::channel();
                let mut state = self.lock();
                let number = state.next;
                state.next = state.next.wrapping_add(1);
                state.waiting.push_back(Waiting {
                    number,
                    request: request(),
                    weight,
                    reply,
                });
                state.in_flight += 1;
                let batch = self.take(&mut state);
                drop(state);
                self.start(owned, send, batch);
                Some((number, assigned))
            } else {
                let (reply, assigned) = oneshot::channel();
                let number = state.next;
                state.next = state.next.wrapping_add(1);
                state.waiting.push_back(Waiting {
                    number,
                    request: request(),
                    weight,
                    reply,
                });
                Some((number, assigned))
            }
        };
        let Some((number, mut assigned)) = waited else {
            // Whether it ends or is dropped, the flight's end starts the
            // calls that waited for it.
            let _flight = Flight {
                queue: self,
                store,
                send,
            };
            return alone.await;
        };
        let assigned = match tokio::time::timeout(self.settings.max_wait, &mut assigned).await {
            Ok(assigned) => assigned,
            Err(_) => {
                // The call in flight takes long (a lock wait): if this call
                // still waits, it and the calls before it go now, beside
                // the one in flight, on a slot of their own (up to
                // MAX_IN_FLIGHT slots in all).
                let owned = store.clone();
                let batch = {
                    let mut state = self.lock();
                    if state.in_flight < MAX_IN_FLIGHT
                        && state.waiting.iter().any(|w| w.number == number)
                    {
                        state.in_flight += 1;
                        Some(self.take(&mut state))
                    } else {
                        None
                    }
                };
                if let Some(batch) = batch {
                    self.start(owned, send, batch);
                }
                assigned.await
            }
        };
        let Ok(Assigned { call, index }) = assigned else {
            return Err(no_answer());
        };
        let answer = match call.await {
            Some(answers) => answers
                .get(index)
                .and_then(|slot| slot.lock().unwrap_or_else(|e| e.into_inner()).take())
                .unwrap_or_else(|| Err(no_answer())),
            None => Err(no_answer()),
        };
        match answer {
            // The batch could not answer it without holding up the others.
            Err(e) if is_send_alone(&e) => alone.await,
            answer => answer,
        }
    }

    /// The next batch: the waiting calls in order, up to the item and byte
    /// limits (the first always), leaving out the callers that went away.
    fn take(&self, state: &mut State<R, T>) -> Vec<Waiting<R, T>> {
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        while let Some(next) = state.waiting.front() {
            if next.reply.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            if !batch.is_empty()
                && (batch.len() >= self.settings.max_items
                    || bytes.saturating_add(next.weight) > self.settings.max_bytes)
            {
                break;
            }
            bytes = bytes.saturating_add(next.weight);
            batch.extend(state.waiting.pop_front());
        }
        batch
    }

    /// A flight ended: its slot goes to the next batch, or is freed.
    fn landed<S>(self: &Arc<Self>, store: &S, send: SendFn<S, R, T>)
    where
        S: Clone + Send + Sync + 'static,
    {
        // Cloned first (an `Arc`'s clone, for the idem stores), so that a
        // clone that panics changes nothing: it runs in a `Drop`, and the
        // slot must be given back whatever happens.
        let owned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.clone()));
        let mut state = self.lock();
        let Ok(owned) = owned else {
            // Nothing to send the waiting calls with: they end (each gets
            // a retryable `no_answer`; nothing was sent for them) and the
            // slot is given back.
            let gone: Vec<_> = state.waiting.drain(..).collect();
            state.in_flight = state.in_flight.saturating_sub(1);
            drop(state);
            drop(gone);
            return;
        };
        let batch = self.take(&mut state);
        if batch.is_empty() {
            state.in_flight = state.in_flight.saturating_sub(1);
            return;
        }
        drop(state);
        self.start(owned, send, batch);
    }

    /// Makes `batch` one call holding a slot, and hands it to each of its
    /// callers, who all poll it. If none of them is there any more, the
    /// call is dropped unsent and its slot handed on.
    fn start<S>(self: &Arc<Self>, store: S, send: SendFn<S, R, T>, batch: Vec<Waiting<R, T>>)
    where
        S: Clone + Send + Sync + 'static,
    {
        let mut requests = Vec::with_capacity(batch.len());
        let mut replies = Vec::with_capacity(batch.len());
        for waiting in batch {
            requests.push(waiting.request);
            replies.push(waiting.reply);
        }
        // Made outside the call's future: dropped unpolled, it lands too.
        let flight = OwnedFlight {
            queue: self.clone(),
            store,
            send,
        };
        let call: BoxFuture<Answers<T>> = Box::pin(flight.run(requests));
        let call = call.shared();
        for (index, reply) in replies.into_iter().enumerate() {
            let _ = reply.send(Assigned {
                call: call.clone(),
                index,
            });
        }
    }
}

/// A call sent alone, in its caller's future.
struct Flight<'a, S, R: Send + 'static, T: Send + 'static>
where
    S: Clone + Send + Sync + 'static,
{
    queue: &'a Arc<Queue<R, T>>,
    store: &'a S,
    send: SendFn<S, R, T>,
}

impl<S, R: Send + 'static, T: Send + 'static> Drop for Flight<'_, S, R, T>
where
    S: Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        self.queue.landed(self.store, self.send);
    }
}

/// A batched call, polled by its callers.
struct OwnedFlight<S, R: Send + 'static, T: Send + 'static>
where
    S: Clone + Send + Sync + 'static,
{
    queue: Arc<Queue<R, T>>,
    store: S,
    send: SendFn<S, R, T>,
}

impl<S, R: Send + 'static, T: Send + 'static> OwnedFlight<S, R, T>
where
    S: Clone + Send + Sync + 'static,
{
    async fn run(self, requests: Vec<R>) -> Answers<T> {
        metrics::histogram!(
            STORE_BATCH_SIZE,
            "backend" => self.queue.backend,
            "operation" => self.queue.operation
        )
        .record(requests.len() as f64);
        let asked = requests.len();
        // A panic of the store's batch call is each caller's `no_answer`,
        // not a panic in every caller that polls the call.
        let call = std::panic::AssertUnwindSafe((self.send)(self.store.clone(), requests));
        let answers = call.catch_unwind().await.ok()?;
        let answers: Vec<Result<T, StoreError>> = if answers.len() == asked {
            answers
        } else {
            let got = answers.len();
            (0..asked)
                .map(|_| {
                    Err(StoreError::backend(format!(
                        "a batched call answered {got} items of {asked}"
                    )))
                })
                .collect()
        };
        Some(Arc::new(
            answers.into_iter().map(|a| Mutex::new(Some(a))).collect(),
        ))
        // `self` drops here: its slot goes to the next batch.
    }
}

impl<S, R: Send + 'static, T: Send + 'static> Drop for OwnedFlight<S, R, T>
where
    S: Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        self.queue.landed(&self.store, self.send);
    }
}

/// The answer a store's batch operation gives an item it could not answer
/// without holding up the rest of the batch (PostgreSQL: a key whose lock
/// is held in another transaction), having written nothing for it: a
/// caller whose single call was batched then sends its call alone. Only
/// for the batch operations a store's [`Batcher`] calls; an
/// `acquire_many` called by an application answers every item itself.
pub fn send_alone(why: impl Into<String>) -> StoreError {
    StoreError::Unavailable(Box::new(SendAlone(why.into())))
}

fn is_send_alone(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(source) if source.is::<SendAlone>())
}

/// See [`send_alone`].
#[derive(Debug)]
struct SendAlone(String);

impl std::fmt::Display for SendAlone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "to be sent alone: {}", self.0)
    }
}

impl std::error::Error for SendAlone {}

/// The answer of a caller whose batched call ended without one (it
/// panicked): as a lost reply, it may or may not have been applied;
/// retryable.
fn no_answer() -> StoreError {
    StoreError::unavailable(
        "the batched call ended without an answer (it panicked): it may or may not have been \
         applied",
    )
}

/// The distinct values of `of` over `items`, in order of appearance, each
/// with the positions that have it.
fn groups<I, K: PartialEq + Copy>(items: &[I], of: impl Fn(&I) -> K) -> Vec<(K, Vec<usize>)> {
    let mut out: Vec<(K, Vec<usize>)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let k = of(item);
        match out.iter_mut().find(|(g, _)| *g == k) {
            Some((_, members)) => members.push(i),
            None => out.push((k, vec![i])),
        }
    }
    out
}

/// What a batch operation answers: per item, or for the call as a whole.
type BatchAnswer<T> = Result<Vec<Result<T, StoreError>>, StoreError>;

/// Puts each group's answers (or its call's error, for each of its items)
/// in the items' order.
fn gather<T>(
    n: usize,
    answered: Vec<(Vec<usize>, BatchAnswer<T>)>,
    operation: &str,
) -> Vec<Result<T, StoreError>> {
    let mut out: Vec<Option<Result<T, StoreError>>> = (0..n).map(|_| None).collect();
    for (members, answer) in answered {
        match answer {
            Ok(answers) if answers.len() == members.len() => {
                for (i, a) in members.into_iter().zip(answers) {
                    out[i] = Some(a);
                }
            }
            Ok(answers) => {
                for i in members {
                    out[i] = Some(Err(StoreError::backend(format!(
                        "{operation} answered {} items of a batch",
                        answers.len()
                    ))));
                }
            }
            Err(e) => {
                for i in members {
                    out[i] = Some(Err(e.replicate()));
                }
            }
        }
    }
    out.into_iter()
        .map(|a| {
            a.unwrap_or_else(|| {
                Err(StoreError::backend(format!(
                    "{operation}: an item was lost"
                )))
            })
        })
        .collect()
}

fn send_acquires<S: IdempotencyStore + Clone>(
    store: S,
    requests: Vec<AcquireRequest>,
) -> BoxFuture<Vec<Result<Acquisition, StoreError>>> {
    Box::pin(async move {
        // One acquire_many per lease length (nearly always one).
        let calls = groups(&requests, |r| r.lease)
            .into_iter()
            .map(|(lease, members)| {
                let items: Vec<AcquireItem<'_>> = members
                    .iter()
                    .map(|&i| AcquireItem::new(&requests[i].key, requests[i].fingerprint.as_ref()))
                    .collect();
                let store = &store;
                async move {
                    let answer = store.acquire_many(&items, lease).await;
                    (members, answer)
                }
            });
        let answered = futures::future::join_all(calls).await;
        gather(requests.len(), answered, "acquire_many")
    })
}

fn send_completes<S: IdempotencyStore + Clone>(
    store: S,
    requests: Vec<CompleteRequest>,
) -> BoxFuture<Vec<Result<(), StoreError>>> {
    Box::pin(async move {
        let calls = groups(&requests, |r| r.retention)
            .into_iter()
            .map(|(retention, members)| {
                let items: Vec<(&Lease, &[u8])> = members
                    .iter()
                    .map(|&i| (&requests[i].lease, requests[i].response.as_slice()))
                    .collect();
                let store = &store;
                async move {
                    let answer = store.complete_many(&items, retention).await;
                    (members, answer)
                }
            });
        let answered = futures::future::join_all(calls).await;
        gather(requests.len(), answered, "complete_many")
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use async_trait::async_trait;
    use tokio::sync::watch;

    use super::*;
    use crate::record::Record;
    use crate::MemoryStore;

    const LEASE: Duration = Duration::from_secs(30);

    fn key(id: &str) -> IdempotencyKey {
        IdempotencyKey::new("batching.test", id).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A MemoryStore whose single calls go through a [`Batcher`], with
    /// every call to the "server" counted, and held at a gate while the
    /// gate is closed.
    struct Counted(Arc<Inner>);

    impl Clone for Counted {
        fn clone(&self) -> Self {
            // Armed by a test: the next clone panics (once).
            if self.0.clone_panics.swap(false, Ordering::SeqCst) {
                panic!("test: a clone of the store panics");
            }
            Counted(self.0.clone())
        }
    }

    struct Inner {
        memory: MemoryStore,
        batcher: Batcher,
        gate: watch::Sender<bool>,
        /// Holds the calls sent alone only.
        singles_gate: watch::Sender<bool>,
        single_acquires: AtomicUsize,
        single_completes: AtomicUsize,
        batches: Mutex<Vec<(&'static str, usize)>>,
        down: AtomicBool,
        panics: AtomicBool,
        clone_panics: AtomicBool,
    }

    impl Counted {
        fn new(settings: Batching) -> Self {
            Counted(Arc::new(Inner {
                memory: MemoryStore::new(),
                batcher: Batcher::new(settings, "counted"),
                gate: watch::channel(true).0,
                singles_gate: watch::channel(true).0,
                single_acquires: AtomicUsize::new(0),
                single_completes: AtomicUsize::new(0),
                batches: Mutex::new(Vec::new()),
                down: AtomicBool::new(false),
                panics: AtomicBool::new(false),
                clone_panics: AtomicBool::new(false),
            }))
        }

        fn close_gate(&self) {
            self.0.gate.send_replace(false);
        }

        fn open_gate(&self) {
            self.0.gate.send_replace(true);
        }

        async fn pass_gate(&self) -> Result<(), StoreError> {
            let mut gate = self.0.gate.subscribe();
            let _ = gate.wait_for(|open| *open).await;
            // A round trip: other tasks run meanwhile.
            tokio::task::yield_now().await;
            if self.0.down.load(Ordering::SeqCst) {
                return Err(StoreError::unavailable("test: down"));
            }
            Ok(())
        }

        fn batches(&self) -> Vec<(&'static str, usize)> {
            self.0
                .batches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        }

        fn singles(&self) -> (usize, usize) {
            (
                self.0.single_acquires.load(Ordering::SeqCst),
                self.0.single_completes.load(Ordering::SeqCst),
            )
        }

        /// Waits until `n` acquires (or completes) wait in the queue.
        async fn until_waiting(&self, acquires: usize, completes: usize) {
            loop {
                let (a, c) = self.0.batcher.waiting();
                if a >= acquires && c >= completes {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }

        async fn acquire_alone(
            &self,
            key: &IdempotencyKey,
            fingerprint: Option<&Fingerprint>,
            lease: Duration,
        ) -> Result<Acquisition, StoreError> {
            self.0.single_acquires.fetch_add(1, Ordering::SeqCst);
            let _ = self.0.singles_gate.subscribe().wait_for(|open| *open).await;
            self.pass_gate().await?;
            self.0.memory.acquire(key, fingerprint, lease).await
        }

        async fn complete_alone(
            &self,
            lease: &Lease,
            response: &[u8],
            retention: Duration,
        ) -> Result<(), StoreError> {
            self.0.single_completes.fetch_add(1, Ordering::SeqCst);
            self.pass_gate().await?;
            self.0.memory.complete(lease, response, retention).await
        }
    }

    #[async_trait]
    impl IdempotencyStore for Counted {
        async fn acquire(
            &self,
            key: &IdempotencyKey,
            fingerprint: Option<&Fingerprint>,
            lease: Duration,
        ) -> Result<Acquisition, StoreError> {
            let alone = self.acquire_alone(key, fingerprint, lease);
            self.0
                .batcher
                .acquire(self, key, fingerprint, lease, alone)
                .await
        }
        async fn complete(
            &self,
            lease: &Lease,
            response: &[u8],
            retention: Duration,
        ) -> Result<(), StoreError> {
            let alone = self.complete_alone(lease, response, retention);
            self.0
                .batcher
                .complete(self, lease, response, retention, alone)
                .await
        }
        async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
            self.0.memory.release(lease).await
        }
        async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
            self.0.memory.extend(lease, lease_for).await
        }
        async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
            self.0.memory.get(key).await
        }
        async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
            self.0.memory.delete(key).await
        }
        async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
            self.0.memory.purge_expired(max).await
        }
        async fn acquire_many(
            &self,
            items: &[AcquireItem<'_>],
            lease: Duration,
        ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
            self.0
                .batches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(("acquire", items.len()));
            if self.0.panics.load(Ordering::SeqCst) {
                panic!("test: a batched call panics");
            }
            self.pass_gate().await?;
            self.0.memory.acquire_many(items, lease).await
        }
        async fn complete_many(
            &self,
            items: &[(&Lease, &[u8])],
            retention: Duration,
        ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
            self.0
                .batches
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(("complete", items.len()));
            self.pass_gate().await?;
            self.0.memory.complete_many(items, retention).await
        }
    }

    fn acquired(a: &Result<Acquisition, StoreError>) -> &Lease {
        match a {
            Ok(Acquisition::Acquired(lease)) => lease,
            other => panic!("not acquired: {other:?}"),
        }
    }

    /// Starts a call of `store.acquire` on a task of its own.
    fn spawn_acquire(
        store: &Counted,
        key: IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        lease: Duration,
    ) -> tokio::task::JoinHandle<Result<Acquisition, StoreError>> {
        let store = store.clone();
        tokio::spawn(async move { store.acquire(&key, fingerprint.as_ref(), lease).await })
    }

    async fn joined<T>(task: tokio::task::JoinHandle<T>) -> T {
        task.await.unwrap_or_else(|e| panic!("task: {e}"))
    }

    #[tokio::test]
    async fn a_lone_call_goes_at_once_without_a_batch() {
        let store = Counted::new(Batching::default());
        let got = store.acquire(&key("lone"), None, LEASE).await;
        let lease = acquired(&got).clone();
        store
            .complete(&lease, b"done", LEASE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(store.singles(), (1, 1));
        assert!(store.batches().is_empty(), "{:?}", store.batches());
    }

    #[tokio::test]
    async fn calls_made_while_one_is_in_flight_go_together_each_with_its_own_answer() {
        let store = Counted::new(Batching::default());
        // A completed key and one held in progress, before any batching.
        let done = key("done");
        let lease = store.acquire(&done, None, LEASE).await;
        let lease = acquired(&lease).clone();
        store
            .complete(&lease, b"recorded", LEASE)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let held = key("held");
        let printed = Fingerprint::of_bytes(b"a");
        acquired(&store.acquire(&held, Some(&printed), LEASE).await);

        store.close_gate();
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        while store.singles().0 < 3 {
            tokio::task::yield_now().await;
        }
        // While `first` is in flight: fresh keys, one fresh key twice, a
        // duplicate of a completed key, a key in progress, a mismatch.
        let other = Fingerprint::of_bytes(b"b");
        let asked: Vec<(IdempotencyKey, Option<Fingerprint>)> = vec![
            (key("fresh-1"), None),
            (key("twice"), None),
            (done.clone(), None),
            (key("twice"), None),
            (held.clone(), Some(printed)),
            (held.clone(), Some(other)),
            (key("fresh-2"), None),
        ];
        let mut tasks = Vec::new();
        for (i, (k, fp)) in asked.iter().cloned().enumerate() {
            tasks.push(spawn_acquire(&store, k, fp, LEASE));
            // In this order in the queue.
            store.until_waiting(i + 1, 0).await;
        }
        store.open_gate();
        acquired(&joined(first).await);
        let mut got = Vec::new();
        for task in tasks {
            got.push(joined(task).await);
        }
        acquired(&got[0]);
        acquired(&got[1]);
        assert!(
            matches!(&got[2], Ok(Acquisition::Completed(r)) if &r.response[..] == b"recorded"),
            "{:?}",
            got[2]
        );
        assert!(
            matches!(got[3], Ok(Acquisition::InProgress { .. })),
            "{:?}",
            got[3]
        );
        assert!(
            matches!(got[4], Ok(Acquisition::InProgress { .. })),
            "{:?}",
            got[4]
        );
        assert!(matches!(got[5], Ok(Acquisition::Mismatch)), "{:?}", got[5]);
        acquired(&got[6]);
        // Three single calls (two before, `first`) and one batch of seven.
        assert_eq!(store.singles().0, 3);
        assert_eq!(store.batches(), vec![("acquire", 7)]);
    }

    #[tokio::test]
    async fn a_caller_gone_while_waiting_is_not_sent() {
        let store = Counted::new(Batching::default());
        store.close_gate();
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        let gone = spawn_acquire(&store, key("gone"), None, LEASE);
        let kept = spawn_acquire(&store, key("kept"), None, LEASE);
        store.until_waiting(2, 0).await;
        gone.abort();
        let _ = gone.await;
        store.open_gate();
        acquired(&joined(first).await);
        acquired(&joined(kept).await);
        // Nothing was reserved for the caller that went away.
        assert!(matches!(store.get(&key("gone")).await, Ok(None)));
        assert_eq!(store.batches(), vec![("acquire", 1)]);
    }

    #[tokio::test]
    async fn a_batched_call_that_fails_fails_each_of_its_callers_alone() {
        let store = Counted::new(Batching::default());
        store.close_gate();
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        let a = spawn_acquire(&store, key("a"), None, LEASE);
        let b = spawn_acquire(&store, key("b"), None, LEASE);
        store.until_waiting(2, 0).await;
        store.0.down.store(true, Ordering::SeqCst);
        store.open_gate();
        for task in [first, a, b] {
            let got = joined(task).await;
            assert!(matches!(got, Err(StoreError::Unavailable(_))), "{got:?}");
        }
        store.0.down.store(false, Ordering::SeqCst);
        acquired(&store.acquire(&key("a"), None, LEASE).await);
    }

    #[tokio::test]
    async fn a_batched_call_that_panics_answers_unavailable_and_the_queue_goes_on() {
        let store = Counted::new(Batching::default());
        store.close_gate();
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        let a = spawn_acquire(&store, key("a"), None, LEASE);
        store.until_waiting(1, 0).await;
        store.0.panics.store(true, Ordering::SeqCst);
        store.open_gate();
        acquired(&joined(first).await);
        let got = joined(a).await;
        assert!(matches!(got, Err(StoreError::Unavailable(_))), "{got:?}");
        store.0.panics.store(false, Ordering::SeqCst);
        // The slot of the call that panicked was given back.
        acquired(&store.acquire(&key("after"), None, LEASE).await);
        assert_eq!(store.singles().0, 2);
    }

    #[tokio::test]
    async fn calls_with_different_leases_go_in_a_call_each() {
        let store = Counted::new(Batching::default());
        store.close_gate();
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        let short = spawn_acquire(&store, key("short"), None, Duration::from_secs(5));
        store.until_waiting(1, 0).await;
        let long = spawn_acquire(&store, key("long"), None, Duration::from_secs(500));
        store.until_waiting(2, 0).await;
        store.open_gate();
        acquired(&joined(first).await);
        let short = joined(short).await;
        let long = joined(long).await;
        let (short, long) = (acquired(&short), acquired(&long));
        assert!(long.expires_at > short.expires_at + Duration::from_secs(400));
        let mut batches = store.batches();
        batches.sort();
        assert_eq!(batches, vec![("acquire", 1), ("acquire", 1)]);
    }

    #[tokio::test]
    async fn batches_keep_to_their_item_and_byte_limits_and_large_responses_go_alone() {
        let store = Counted::new(Batching::default().max_items(2).max_bytes(10));
        let mut leases = Vec::new();
        for i in 0..6 {
            let got = store.acquire(&key(&format!("k{i}")), None, LEASE).await;
            leases.push(acquired(&got).clone());
        }
        store.close_gate();
        let complete = |lease: Lease, response: Vec<u8>| {
            let store = store.clone();
            tokio::spawn(async move { store.complete(&lease, &response, LEASE).await })
        };
        let first = complete(leases[0].clone(), b"1".to_vec());
        while store.singles().1 < 1 {
            tokio::task::yield_now().await;
        }
        // 11 bytes: over the limit, it goes alone at once.
        let large = complete(leases[1].clone(), vec![b'x'; 11]);
        while store.singles().1 < 2 {
            tokio::task::yield_now().await;
        }
        let mut waiting = Vec::new();
        for (n, (i, size)) in [(2, 4), (3, 4), (4, 4), (5, 1)].into_iter().enumerate() {
            waiting.push(complete(leases[i].clone(), vec![b'y'; size]));
            store.until_waiting(0, n + 1).await;
        }
        store.open_gate();
        for task in [first, large].into_iter().chain(waiting) {
            let done = joined(task).await;
            assert!(done.is_ok(), "{done:?}");
        }
        // 4 + 4 bytes, then 4 + 1 (two items at most, ten bytes at most).
        assert_eq!(store.batches(), vec![("complete", 2), ("complete", 2)]);
        assert_eq!(store.singles().1, 2);
    }

    #[tokio::test]
    async fn with_batching_off_every_call_goes_alone() {
        let store = Counted::new(Batching::off());
        store.close_gate();
        let tasks: Vec<_> = (0..4)
            .map(|i| spawn_acquire(&store, key(&format!("k{i}")), None, LEASE))
            .collect();
        while store.singles().0 < 4 {
            tokio::task::yield_now().await;
        }
        store.open_gate();
        for task in tasks {
            acquired(&joined(task).await);
        }
        assert!(store.batches().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_concurrent_callers_are_served_by_few_calls_and_each_key_runs_once() {
        let store = Counted::new(Batching::default());
        // 64 tasks, each asking for 8 keys of 32 in turn: every key is
        // acquired exactly once, whatever the batches looked like.
        let tasks: Vec<_> = (0..64)
            .map(|t| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut mine = 0;
                    for k in 0..8 {
                        let id = format!("k{}", (t * 8 + k) % 32);
                        if let Ok(Acquisition::Acquired(_)) =
                            store.acquire(&key(&id), None, LEASE).await
                        {
                            mine += 1;
                        }
                    }
                    mine
                })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            won += joined(task).await;
        }
        assert_eq!(won, 32);
        let calls = store.singles().0 + store.batches().len();
        assert!(calls < 512, "{calls} calls for 512 acquires");
    }

    #[tokio::test]
    async fn a_call_in_flight_that_takes_long_holds_up_the_waiting_calls_no_longer_than_max_wait() {
        let store = Counted::new(Batching::default().max_wait(Duration::from_millis(20)));
        store.0.singles_gate.send_replace(false);
        let stuck = spawn_acquire(&store, key("stuck"), None, LEASE);
        while store.singles().0 < 1 {
            tokio::task::yield_now().await;
        }
        let a = spawn_acquire(&store, key("a"), None, LEASE);
        let b = spawn_acquire(&store, key("b"), None, LEASE);
        // Answered while the call in flight is still held.
        let answered = tokio::time::timeout(Duration::from_secs(10), async {
            (joined(a).await, joined(b).await)
        })
        .await
        .unwrap_or_else(|_| panic!("the waiting calls waited for the stuck one"));
        acquired(&answered.0);
        acquired(&answered.1);
        assert!(!stuck.is_finished());
        store.0.singles_gate.send_replace(true);
        acquired(&joined(stuck).await);
        // And the slots were all given back: a lone call goes alone.
        acquired(&store.acquire(&key("after"), None, LEASE).await);
        assert_eq!(store.singles().0, 2);
    }

    /// A store shared by threads that each drive a runtime of their own
    /// (a sync facade, tests sharing a static store): a caller queued
    /// behind a call made on another runtime must be answered even when
    /// that runtime has nothing more to do once its own call is back.
    #[test]
    fn a_caller_queued_behind_a_call_on_another_runtime_is_answered_when_that_runtime_is_idle() {
        let store = Counted::new(Batching::default());
        store.close_gate();
        let rt = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let (other, mine) = (rt(), rt());
        let s = store.clone();
        // Another thread's call, alone, held at the gate.
        let other_thread = std::thread::spawn(move || {
            let got = other.block_on(async { s.acquire(&key("other"), None, LEASE).await });
            // That runtime stays, idle (its thread's next call has not come).
            (other, got)
        });
        while store.singles().0 < 1 {
            std::thread::yield_now();
        }
        let got = mine.block_on(async {
            let queued = spawn_acquire(&store, key("mine"), None, LEASE);
            store.until_waiting(1, 0).await;
            store.open_gate();
            tokio::time::timeout(Duration::from_secs(5), queued).await
        });
        let (_idle, other_got) = other_thread.join().unwrap_or_else(|_| panic!("thread"));
        acquired(&other_got);
        let got = got.unwrap_or_else(|_| {
            panic!("the queued caller was never answered: its batch went to an idle runtime")
        });
        acquired(&got.unwrap_or_else(|e| panic!("task: {e}")));
    }

    /// The same, with that other runtime shut down: the queued caller
    /// (whose own runtime runs on) gets its own answer, not an error.
    #[test]
    fn a_caller_queued_behind_a_call_on_a_runtime_that_shuts_down_gets_its_own_answer() {
        let store = Counted::new(Batching::default());
        store.close_gate();
        let rt = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let (other, mine) = (rt(), rt());
        let s = store.clone();
        let other_thread = std::thread::spawn(move || {
            let got = other.block_on(async { s.acquire(&key("other"), None, LEASE).await });
            drop(other);
            got
        });
        while store.singles().0 < 1 {
            std::thread::yield_now();
        }
        let got = mine.block_on(async {
            let queued = spawn_acquire(&store, key("mine"), None, LEASE);
            store.until_waiting(1, 0).await;
            store.open_gate();
            tokio::time::timeout(Duration::from_secs(5), queued).await
        });
        acquired(&other_thread.join().unwrap_or_else(|_| panic!("thread")));
        let got = got
            .unwrap_or_else(|_| panic!("never answered"))
            .unwrap_or_else(|e| panic!("task: {e}"));
        acquired(&got);
    }

    #[tokio::test]
    async fn a_call_in_flight_dropped_by_its_caller_lets_the_waiting_calls_go() {
        let store = Counted::new(Batching::default().max_wait(Duration::from_secs(3600)));
        store.0.singles_gate.send_replace(false);
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        while store.singles().0 < 1 {
            tokio::task::yield_now().await;
        }
        let a = spawn_acquire(&store, key("a"), None, LEASE);
        let b = spawn_acquire(&store, key("b"), None, LEASE);
        store.until_waiting(2, 0).await;
        first.abort();
        let _ = first.await;
        let got = tokio::time::timeout(Duration::from_secs(5), async {
            (joined(a).await, joined(b).await)
        })
        .await
        .unwrap_or_else(|_| panic!("the waiting calls were left waiting"));
        acquired(&got.0);
        acquired(&got.1);
        store.0.singles_gate.send_replace(true);
        acquired(&store.acquire(&key("after"), None, LEASE).await);
        assert_eq!(store.singles().0, 2);
    }

    /// The batch of `x` (queued first, on another thread's runtime) and
    /// `y` (queued after it, on this runtime) is run on `x`'s runtime;
    /// then `x`'s caller stops waiting (its `block_on` ends with a
    /// cancellation, as a sync facade's timeout does). `ends` gets that
    /// runtime (kept idle, or dropped). `y` must still get its own answer.
    fn queued_caller_after_the_one_whose_runtime_runs_the_batch_went_away(
        ends: impl FnOnce(tokio::runtime::Runtime),
    ) -> Result<Result<Acquisition, StoreError>, tokio::time::error::Elapsed> {
        // Only the caller going away lets the waiting calls go.
        let store = Counted::new(Batching::default().max_wait(Duration::from_secs(3600)));
        let rt = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let mine = rt();
        let (cancel, cancelled) = oneshot::channel::<()>();
        let (first, other_thread) = mine.block_on(async {
            store.close_gate();
            let first = spawn_acquire(&store, key("first"), None, LEASE);
            while store.singles().0 < 1 {
                tokio::task::yield_now().await;
            }
            let s = store.clone();
            let other = rt();
            let other_thread = std::thread::spawn(move || {
                let x = key("x");
                let got = other.block_on(async {
                    tokio::select! {
                        got = s.acquire(&x, None, LEASE) => Some(got),
                        _ = cancelled => None,
                    }
                });
                (other, got)
            });
            store.until_waiting(1, 0).await;
            (first, other_thread)
        });
        mine.block_on(async {
            let y = spawn_acquire(&store, key("y"), None, LEASE);
            store.until_waiting(2, 0).await;
            // The call in flight goes away: its slot starts the batch
            // [x, y], on x's runtime, held at the gate.
            first.abort();
            let _ = first.await;
            tokio::time::timeout(Duration::from_secs(10), async {
                while store.batches().is_empty() {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .unwrap_or_else(|_| panic!("the batch never started"));
            assert_eq!(store.batches(), vec![("acquire", 2)]);
            // x's caller stops waiting, its thread's block_on returns.
            let _ = cancel.send(());
            let (other, got) = other_thread.join().unwrap_or_else(|_| panic!("thread"));
            assert!(got.is_none(), "{got:?}");
            ends(other);
            store.open_gate();
            tokio::time::timeout(Duration::from_secs(5), y)
                .await
                .map(|joined| joined.unwrap_or_else(|e| panic!("task: {e}")))
        })
    }

    #[test]
    fn a_queued_caller_is_answered_when_the_caller_whose_idle_runtime_ran_its_batch_went_away() {
        let mut idle = None;
        let got = queued_caller_after_the_one_whose_runtime_runs_the_batch_went_away(|rt| {
            // That thread's runtime stays, not driven (its next call has
            // not come).
            idle = Some(rt);
        });
        let got = got.unwrap_or_else(|_| {
            panic!("y was never answered: its batch sits on an idle runtime of a caller that went away")
        });
        acquired(&got);
    }

    #[test]
    fn a_queued_caller_gets_its_own_answer_when_the_caller_whose_runtime_ran_its_batch_went_away_and_that_runtime_shut_down(
    ) {
        let got = queued_caller_after_the_one_whose_runtime_runs_the_batch_went_away(|rt| {
            // Shut down on a thread of its own (not from async code).
            std::thread::spawn(move || drop(rt))
                .join()
                .unwrap_or_else(|_| panic!("thread"));
        });
        let got = got.unwrap_or_else(|_| panic!("y was never answered"));
        acquired(&got);
    }

    /// `first` goes alone (held), `a` waits behind it; the store's next
    /// clone panics, which is the one `landed` makes to start `a`'s batch
    /// when `first` ends. Returns `first`'s and `a`'s outcomes.
    async fn a_flight_lands_while_the_store_clone_panics(
        store: &Counted,
    ) -> (
        Result<Result<Acquisition, StoreError>, tokio::task::JoinError>,
        Result<Result<Acquisition, StoreError>, tokio::task::JoinError>,
    ) {
        store.0.singles_gate.send_replace(false);
        let first = spawn_acquire(store, key("first"), None, LEASE);
        while store.singles().0 < 1 {
            tokio::task::yield_now().await;
        }
        let a = spawn_acquire(store, key("a"), None, LEASE);
        store.until_waiting(1, 0).await;
        store.0.clone_panics.store(true, Ordering::SeqCst);
        store.0.singles_gate.send_replace(true);
        let first = first.await;
        let a = a.await;
        assert!(
            !store.0.clone_panics.load(Ordering::SeqCst),
            "the clone was never made"
        );
        (first, a)
    }

    #[tokio::test]
    async fn a_store_clone_panicking_as_a_flight_lands_does_not_reach_the_caller_whose_call_succeeded(
    ) {
        let store = Counted::new(Batching::default().max_wait(Duration::from_secs(3600)));
        let (first, _a) = a_flight_lands_while_the_store_clone_panics(&store).await;
        match first {
            Ok(got) => {
                acquired(&got);
            }
            Err(e) => panic!("first's own call succeeded, its caller got a panic: {e}"),
        }
    }

    #[tokio::test]
    async fn a_store_clone_panicking_as_a_flight_lands_gives_back_its_in_flight_slot() {
        let store = Counted::new(Batching::default().max_wait(Duration::from_secs(3600)));
        let _ = a_flight_lands_while_the_store_clone_panics(&store).await;
        // Nothing is in flight and nothing waits: a lone call goes at once.
        let after = tokio::time::timeout(
            Duration::from_secs(5),
            store.acquire(&key("after"), None, LEASE),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "a lone call never went: the slot of the flight whose landing panicked is never \
                 given back (waiting: {:?})",
                store.0.batcher.waiting()
            )
        });
        acquired(&after);
    }

    /// MAX_IN_FLIGHT: "the most batched calls in flight at once, whatever
    /// `in_flight` asks for". A slow call in flight and many queued
    /// callers each past `max_wait` must not put more than that many
    /// calls in flight.
    #[tokio::test]
    async fn queued_callers_past_max_wait_never_put_more_than_max_in_flight_calls_in_flight() {
        let store = Counted::new(
            Batching::default()
                .max_items(1)
                .max_wait(Duration::from_micros(1)),
        );
        store.close_gate();
        let first = spawn_acquire(&store, key("first"), None, LEASE);
        while store.singles().0 < 1 {
            tokio::task::yield_now().await;
        }
        let n = MAX_IN_FLIGHT + 100;
        let tasks: Vec<_> = (0..n)
            .map(|i| spawn_acquire(&store, key(&format!("k{i}")), None, LEASE))
            .collect();
        // Every call is held at the gate: wait until every caller has
        // either been sent in a batch or sits in the queue.
        tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let sent: usize = store.batches().iter().map(|(_, n)| n).sum();
                if sent + store.0.batcher.waiting().0 >= n || store.batches().len() > MAX_IN_FLIGHT
                {
                    break;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .ok();
        let in_flight = 1 + store.batches().len();
        store.open_gate();
        acquired(&joined(first).await);
        for task in tasks {
            acquired(&joined(task).await);
        }
        assert!(
            in_flight <= MAX_IN_FLIGHT,
            "{in_flight} calls in flight at once (MAX_IN_FLIGHT {MAX_IN_FLIGHT})"
        );
    }

    #[test]
    fn settings_are_clamped() {
        let b = Batching::default()
            .max_wait(Duration::ZERO)
            .max_items(usize::MAX)
            .in_flight(0);
        assert_eq!(b.waits_at_most(), Duration::from_micros(1));
        assert_eq!(b.items(), MAX_BATCH_ITEMS);
        assert_eq!(b.calls_in_flight(), 1);
        assert_eq!(
            Batching::default().max_wait(Duration::MAX).waits_at_most(),
            crate::MAX_DURATION
        );
    }
}
