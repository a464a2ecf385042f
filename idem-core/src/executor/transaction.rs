//! The in-transaction form of the receivers: the key is claimed in a
//! transaction of the database the handler writes in, the handler writes
//! in that transaction, the result is recorded in it, and it commits
//! before the message is acknowledged. A crash anywhere before the commit
//! rolls the handler's writes back with the claim: the redelivery runs
//! cleanly, with no lease and no window.
//!
//! A receiver runs its handlers through a [`Runner`]: [`LeaseRunner`]
//! (the executor's lease, the handler gets nothing more than its
//! [`Context`]) or [`TxRunner`] (a transaction per message, handed to the
//! handler as a [`SharedTx`]), so that one receiver serves both forms.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{OwnedMappedMutexGuard, OwnedMutexGuard, Semaphore};
use tracing::Instrument;

use super::{count, lock, panic_message, process_span, run_handler, HandlerOutcome};
use super::{BatchOutcome, Context, Idempotency, Processed};
use crate::codec::Codec;
use crate::error::{IdemError, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{not_replayable_marker, Acquisition, Lease};
use crate::store::IdempotencyStore;

/// How long a claim waits, by default, for another transaction that holds
/// its key (then the message is "in progress" and tried again later).
pub const DEFAULT_TRANSACTION_WAIT: Duration = Duration::from_secs(10);

/// The scope of [`TxRunner`]'s counters of the runs of a key cut off by
/// a crash (records taken over at each start, never completed, deleted
/// when a run is seen to end).
const START_COUNTER: &str = "idem.starts";

/// A store that can hold a key inside a transaction of the database the
/// handler writes in (`PgStore`: a PostgreSQL transaction), for the
/// receivers' in-transaction form ([`TxRunner`]).
///
/// The claim is visible to nobody until the transaction commits; a
/// duplicate that claims meanwhile waits for it, then replays what it
/// recorded (or runs, if it rolled back). Dropping the transaction rolls
/// it back.
#[async_trait]
pub trait TransactionalStore: IdempotencyStore {
    /// The transaction. The handler gets it behind a [`SharedTx`], whose
    /// guard derefs to `Tx::Target` (for sqlx, the connection: `&mut
    /// *guard` is an executor).
    type Tx: DerefMut + Send + 'static;

    /// Begins a transaction (a connection of the store's pool).
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// Claims `key` in `tx`, waiting at most `wait` for another open
    /// transaction that holds it: then `InProgress`, and `tx` must be
    /// rolled back. `Acquired` holds no lease: the key is held until `tx`
    /// ends.
    async fn claim_in(
        &self,
        tx: &mut Self::Tx,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        wait: Duration,
    ) -> Result<Acquisition, StoreError>;

    /// Records `response` for the claim `lease` in `tx`. A response over
    /// the store's limit is refused with [`StoreError::ResponseTooLarge`]
    /// before anything is sent (the transaction stays usable);
    /// [`StoreError::LeaseLost`] means the claim is no longer in `tx` (the
    /// handler ended the transaction itself).
    async fn complete_in(
        &self,
        tx: &mut Self::Tx,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError>;

    /// Commits `tx`. An error may hide a commit that happened (its reply
    /// was lost): the redelivery then gets the replay.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Rolls `tx` back (dropping it does too, later).
    async fn rollback(&self, tx: Self::Tx) {
        drop(tx);
    }
}

/// The transaction of one message (or request), shared with its handler:
/// [`lock`](Self::lock) it for statements. The receiver takes it back once
/// the handler returned, records the result in it and commits; do not
/// commit or roll it back yourself.
pub struct SharedTx<X>(Arc<tokio::sync::Mutex<Option<X>>>);

impl<X> Clone for SharedTx<X> {
    fn clone(&self) -> Self {
        SharedTx(self.0.clone())
    }
}

impl<X> fmt::Debug for SharedTx<X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedTx").finish_non_exhaustive()
    }
}

/// [`SharedTx::lock`] after the transaction ended: the handler kept it
/// past its return (in a task of its own, say). Not retryable: the
/// transaction is committed or rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxEnded;

impl fmt::Display for TxEnded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the transaction has ended: write in it before the handler returns")
    }
}

impl std::error::Error for TxEnded {}

/// The transaction, locked for the handler's statements: it derefs to
/// what the transaction derefs to (for sqlx, the connection: `&mut
/// *guard` is an executor, `guard.begin()` opens a savepoint).
pub struct TxGuard<X>(OwnedMappedMutexGuard<Option<X>, X>);

impl<X> fmt::Debug for TxGuard<X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxGuard").finish_non_exhaustive()
    }
}

impl<X: Deref> Deref for TxGuard<X> {
    type Target = X::Target;
    fn deref(&self) -> &X::Target {
        &self.0
    }
}

impl<X: DerefMut> DerefMut for TxGuard<X> {
    fn deref_mut(&mut self) -> &mut X::Target {
        &mut self.0
    }
}

impl<X> SharedTx<X> {
    /// Shares `tx` (for a receiver handing it to its handler).
    pub fn new(tx: X) -> Self {
        SharedTx(Arc::new(tokio::sync::Mutex::new(Some(tx))))
    }

    /// Locks the transaction until the guard is dropped (statements of one
    /// transaction run one at a time on its connection).
    pub async fn lock(&self) -> Result<TxGuard<X>, TxEnded> {
        let guard = self.0.clone().lock_owned().await;
        OwnedMutexGuard::try_map(guard, Option::as_mut)
            .map(TxGuard)
            .map_err(|_| TxEnded)
    }

    /// Takes the transaction back (for the receiver, once the handler
    /// returned); `None` if a guard is still held after `wait`, or it was
    /// taken already.
    pub async fn take(&self, wait: Duration) -> Option<X> {
        let mut guard = tokio::time::timeout(wait, self.0.lock()).await.ok()?;
        guard.take()
    }
}

/// The keys this process is claiming in a transaction: a duplicate in the
/// same process waits here, holding no connection, instead of in the
/// database on a connection of the pool (64 duplicates of one key on a
/// pool of 8 would hold every connection waiting).
#[derive(Default)]
pub struct KeyGate {
    /// Each key's lock and how many callers hold or wait for it.
    keys: Mutex<HashMap<IdempotencyKey, (KeyLock, usize)>>,
}

/// The lock of one key at a [`KeyGate`].
type KeyLock = Arc<tokio::sync::Mutex<()>>;

/// A batch item waiting for its round: its index, key, fingerprint and
/// handler.
type Waiting<F> = (usize, IdempotencyKey, Option<Fingerprint>, F);

impl fmt::Debug for KeyGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyGate")
            .field("keys", &self.len())
            .finish()
    }
}

/// A caller at a [`KeyGate`] for a key, holding it; counted out when
/// dropped, however its wait ended.
pub struct Gated {
    gate: Arc<KeyGate>,
    key: IdempotencyKey,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl fmt::Debug for Gated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gated").field("key", &self.key).finish()
    }
}

impl KeyGate {
    /// Waits until no other caller of this process holds `key`, for at
    /// most `wait` (`None` then).
    pub async fn enter(self: &Arc<Self>, key: &IdempotencyKey, wait: Duration) -> Option<Gated> {
        let lock = {
            let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            let (lock, users) = keys.entry(key.clone()).or_default();
            *users += 1;
            lock.clone()
        };
        // Counted in from here: dropped on a timeout or a cancellation, it
        // counts itself out.
        let mut gated = Gated {
            gate: self.clone(),
            key: key.clone(),
            guard: None,
        };
        gated.guard = Some(tokio::time::timeout(wait, lock.lock_owned()).await.ok()?);
        Some(gated)
    }

    /// The keys held or waited for (none once every caller left).
    pub fn len(&self) -> usize {
        self.keys.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no key is held or waited for.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        self.guard.take();
        let mut keys = self.gate.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, users)) = keys.get_mut(&self.key) {
            *users -= 1;
            if *users == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

/// How a receiver runs its handlers: [`LeaseRunner`] or [`TxRunner`].
/// The handler gets its [`Context`] and [`With`](Self::With) (nothing, or
/// the message's transaction); the outcomes are the executor's.
pub trait Runner<S: ?Sized, C>: Send + Sync + 'static {
    /// What the handler gets beside its context.
    type With: Send + 'static;

    /// Runs one key, detached (a caller that goes away does not stop it).
    fn process_one<T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> impl Future<Output = Result<Processed<T>, IdemError<E>>> + Send
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context, Self::With) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static;

    /// The message of `key` leaves without a committed run (dead-lettered):
    /// what the runner counted of its runs is forgotten, so a copy of it
    /// (re-driven from the dead letters, say) counts from zero.
    fn forget(
        &self,
        idem: &Idempotency<S, C>,
        key: &IdempotencyKey,
    ) -> impl Future<Output = ()> + Send;

    /// Runs a batch, detached; the outcomes in the items' order. Items of
    /// one key run one after the other, in order.
    fn process_batch<T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        items: Vec<(IdempotencyKey, Option<Fingerprint>, F)>,
    ) -> impl Future<Output = Vec<BatchOutcome<T, E>>> + Send
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context, Self::With) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static;
}

/// The lease form: [`Idempotency::process_with_detached`] and
/// [`Idempotency::process_batch_with_detached`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LeaseRunner;

impl<S, C> Runner<S, C> for LeaseRunner
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    type With = ();

    async fn process_one<T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context, ()) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        idem.process_with_detached(key, fingerprint, move |context| handler(context, ()))
            .await
    }

    /// The lease form counts with the key's own attempt: nothing to forget.
    async fn forget(&self, _: &Idempotency<S, C>, _: &IdempotencyKey) {}

    async fn process_batch<T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        items: Vec<(IdempotencyKey, Option<Fingerprint>, F)>,
    ) -> Vec<BatchOutcome<T, E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context, ()) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let items = items
            .into_iter()
            .map(|(key, fingerprint, handler)| {
                (key, fingerprint, move |context| handler(context, ()))
            })
            .collect::<Vec<_>>();
        idem.process_batch_with_detached(items).await
    }
}

/// The in-transaction form: each message runs in a transaction of its own
/// ([`TransactionalStore`]), handed to the handler as a [`SharedTx`]; the
/// claim, the handler's writes and the result commit together, or none of
/// them. The executor's lease, heartbeat and completion retry are not
/// used (nothing is held outside the transaction); its retention and codec
/// are, and its [`batch_concurrency`](Idempotency::batch_concurrency)
/// bounds the transactions of a batch open at once (keep it at or under
/// the pool's size).
///
/// | the handler | the message |
/// |---|---|
/// | returns `Ok` | the result is recorded in the transaction, which commits: executed (a result that cannot be recorded commits the "not replayable" marker instead) |
/// | returns `Err` or panics | rolled back: nothing of it is kept, the error is the executor's |
/// | the commit fails | [`IdemError::Store`] (retryable for a lost connection, not for a refusal such as a deferred constraint): nothing is kept, unless the commit's reply was lost after it happened (the redelivery then gets the replay) |
/// | keeps a [`TxGuard`] past its return | rolled back, [`IdemError::Store`] (not retryable) |
/// | ends the transaction itself (`COMMIT`, `ROLLBACK`) | what it wrote after that is its own; the key is completed "not replayable" in a new transaction, so it never runs again |
///
/// A duplicate of a key this runner holds waits at the runner's gate (no
/// connection), one of another process waits in the database, both for at
/// most [`wait`](Self::wait): then [`IdemError::InProgress`].
///
/// A run cut off by a crash leaves no trace in its transaction, so the
/// runs started and not seen to end are counted outside it, once the key
/// is claimed (a record of scope `idem.starts` in the store, taken over at
/// each start and deleted as soon as a run is seen to end, committed or
/// not: two more store calls per run): the handler's
/// [`Context::attempt`] is 1 plus the runs of the key cut off in a row,
/// which a receiver compares with its `max_deliveries` to stop a message
/// that kills every consumer. A failure seen to end (the handler's `Err`,
/// a panic, a lost connection, a refused commit) is the receiver's to
/// count: its count is released (with the run's own token, before the
/// rollback lets the claim go, tried again for up to [`wait`](Self::wait),
/// at most a minute, while the store is away); a wait for a key held elsewhere, or a store
/// that is away before the claim, starts nothing; [`Runner::forget`] (a
/// message dead-lettered) starts the count again. What is left: a run
/// whose store stays away for longer than the wait after its transaction
/// was lost counts, for the other consumers, as a run cut off.
#[derive(Debug, Clone)]
pub struct TxRunner {
    wait: Duration,
    gate: Arc<KeyGate>,
    /// Start counters whose delete failed: deleted before the next count.
    unforgotten: Arc<Mutex<HashSet<IdempotencyKey>>>,
}

impl Default for TxRunner {
    fn default() -> Self {
        TxRunner::new()
    }
}

impl TxRunner {
    /// A runner that waits [`DEFAULT_TRANSACTION_WAIT`] for a key held by
    /// another transaction.
    pub fn new() -> Self {
        TxRunner {
            wait: DEFAULT_TRANSACTION_WAIT,
            gate: Arc::new(KeyGate::default()),
            unforgotten: Arc::default(),
        }
    }

    /// How long a claim waits for another transaction holding its key
    /// (at least 1 ms; `Duration::MAX` waits as long as the database lets
    /// it, about 24 days for PostgreSQL's `lock_timeout`).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait.max(Duration::from_millis(1));
        self
    }

    /// The wait of [`wait`](Self::wait).
    pub fn wait_period(&self) -> Duration {
        self.wait
    }

    /// The keys this runner's transactions hold or wait for.
    pub fn gate(&self) -> &Arc<KeyGate> {
        &self.gate
    }
}

impl<S, C> Runner<S, C> for TxRunner
where
    S: TransactionalStore + ?Sized,
    C: Codec,
{
    type With = SharedTx<S::Tx>;

    async fn process_one<T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context, SharedTx<S::Tx>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let (this, idem, key) = (self.clone(), idem.clone(), key.clone());
        let span = process_span(&key);
        let task = async move { this.run(&idem, key, fingerprint, handler).await }.instrument(span);
        match tokio::spawn(task).await {
            Ok(result) => result,
            Err(e) => Err(IdemError::Panicked {
                message: if e.is_panic() {
                    panic_message(e.into_panic())
                } else {
                    "the detached task was cancelled (the runtime is shutting down)".to_owned()
                },
            }),
        }
    }

    async fn forget(&self, idem: &Idempotency<S, C>, key: &IdempotencyKey) {
        self.forget_starts(&**idem.store(), key.counter_of(START_COUNTER).as_ref())
            .await;
    }

    async fn process_batch<T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        items: Vec<(IdempotencyKey, Option<Fingerprint>, F)>,
    ) -> Vec<BatchOutcome<T, E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(Context, SharedTx<S::Tx>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let n = items.len();
        let mut out: Vec<Option<BatchOutcome<T, E>>> = (0..n).map(|_| None).collect();
        // Round `r` holds the `r`-th item of each key: a key's items see
        // the effect of the earlier ones.
        let mut rounds: Vec<Vec<Waiting<F>>> = Vec::new();
        let mut seen: HashMap<IdempotencyKey, usize> = HashMap::new();
        for (index, (key, fingerprint, handler)) in items.into_iter().enumerate() {
            let round = seen.entry(key.clone()).or_insert(0);
            if rounds.len() <= *round {
                rounds.push(Vec::new());
            }
            rounds[*round].push((index, key, fingerprint, handler));
            *round += 1;
        }
        let limit = Arc::new(Semaphore::new(
            idem.batch_concurrency
                .unwrap_or(Semaphore::MAX_PERMITS)
                .clamp(1, Semaphore::MAX_PERMITS),
        ));
        for round in rounds {
            let runs = round.into_iter().map(|(index, key, fingerprint, handler)| {
                let limit = limit.clone();
                async move {
                    // Held from before the transaction begins until it
                    // ended (the semaphore is never closed).
                    let _permit = limit.acquire_owned().await.ok();
                    let outcome = self.process_one(idem, &key, fingerprint, handler).await;
                    (index, outcome)
                }
            });
            for (index, outcome) in futures::future::join_all(runs).await {
                out[index] = Some(outcome);
            }
        }
        out.into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Err(IdemError::Store(StoreError::backend(
                        "an item of the batch got no outcome",
                    )))
                })
            })
            .collect()
    }
}

impl TxRunner {
    /// Deletes a start counter (a run seen to end, or a message
    /// dead-lettered); one whose delete fails is deleted before the next
    /// count of its key.
    async fn forget_starts<S: IdempotencyStore + ?Sized>(
        &self,
        store: &S,
        counter: Option<&IdempotencyKey>,
    ) {
        let Some(counter) = counter else { return };
        if let Err(e) = store.delete(counter).await {
            tracing::warn!(error = %e, "in-transaction run: its start counter could not be deleted (it is, before the next count)");
            lock(&self.unforgotten).insert(counter.clone());
        }
    }

    /// Forgets the count a run took (`start`, the counter's lease), once
    /// it is seen to end: released with the run's own token, so a late
    /// forget never erases a later run's count; one that fails is deleted
    /// before this runner's next count of the key.
    async fn forget_run<S: IdempotencyStore + ?Sized>(
        &self,
        store: &S,
        counter: Option<&IdempotencyKey>,
        start: Option<&Lease>,
    ) {
        let (Some(counter), Some(start)) = (counter, start) else {
            return;
        };
        // Tried again for up to the runner's wait (at most a minute) while
        // the store is away (a failover): a count left behind is a run cut
        // off for every other consumer of the key.
        let until = tokio::time::Instant::now() + self.wait.min(Duration::from_secs(60));
        let mut pause = Duration::from_millis(50);
        loop {
            match store.release(start).await {
                // Released, or taken over since: that count is another run's.
                Ok(()) | Err(StoreError::LeaseLost) => return,
                Err(e) if e.is_retryable() && tokio::time::Instant::now() + pause < until => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "in-transaction run: its start count could not be forgotten (it is, before this runner's next count; another consumer counts it as a run cut off)");
                    lock(&self.unforgotten).insert(counter.clone());
                    return;
                }
            }
        }
    }

    /// Whether `counter` may count: not waiting to be deleted, or deleted
    /// now.
    async fn forgotten<S: IdempotencyStore + ?Sized>(
        &self,
        store: &S,
        counter: &IdempotencyKey,
    ) -> bool {
        if !lock(&self.unforgotten).contains(counter) {
            return true;
        }
        if store.delete(counter).await.is_err() {
            return false;
        }
        lock(&self.unforgotten).remove(counter);
        true
    }

    /// One key, from the gate to the commit.
    async fn run<S, C, T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        key: IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        S: TransactionalStore + ?Sized,
        C: Codec,
        T: Serialize + DeserializeOwned,
        F: FnOnce(Context, SharedTx<S::Tx>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if idem.retention.is_zero() {
            return Err(IdemError::InvalidConfig {
                detail: "the retention is zero: every duplicate would run the handler again".into(),
            });
        }
        let busy = |attempt| IdemError::InProgress {
            retry_after: Duration::from_secs(1).min(self.wait),
            attempt,
        };
        // A duplicate of this process waits for the first here, without a
        // connection; then its claim replays.
        let Some(_gated) = self.gate.enter(&key, self.wait).await else {
            return Err(busy(0));
        };
        let store = idem.store.clone();
        let scope = key.scope();
        let mut tx = store.begin().await.map_err(IdemError::Store)?;
        let lease = match store
            .claim_in(&mut tx, &key, fingerprint.as_ref(), self.wait)
            .await
        {
            Ok(Acquisition::Acquired(lease)) => lease,
            Ok(Acquisition::Completed(record)) => {
                store.rollback(tx).await;
                return idem.replay(scope, &record.response);
            }
            Ok(Acquisition::InProgress {
                retry_after,
                attempt,
                ..
            }) => {
                store.rollback(tx).await;
                count("idem_in_progress_total", scope);
                return Err(IdemError::InProgress {
                    retry_after,
                    attempt,
                });
            }
            Ok(Acquisition::Mismatch) => {
                store.rollback(tx).await;
                count("idem_mismatch_total", scope);
                return Err(IdemError::PayloadMismatch);
            }
            Err(e) => {
                store.rollback(tx).await;
                return Err(IdemError::Store(e));
            }
        };
        count("idem_acquired_total", scope);
        // A run cut off by a crash rolls back with its claim and leaves no
        // trace, so the runs started and not seen to end are counted
        // outside the transaction (the key's claim, held until it ends,
        // keeps two counts of one key apart): the handler's `attempt` is
        // this count, so that a receiver stops a message that kills every
        // consumer. A run seen to end (committed, failed, refused) forgets
        // the count: failures and outages are the receivers' to count.
        let counter = key.counter_of(START_COUNTER);
        let mut context = Context::of(&lease);
        let mut started = None;
        if let Some(counter) = &counter {
            if self.forgotten(&*store, counter).await {
                match store.acquire(counter, None, Duration::from_millis(1)).await {
                    Ok(Acquisition::Acquired(start)) => {
                        context.attempt = context.attempt.max(start.attempt);
                        started = Some(start);
                    }
                    Ok(Acquisition::InProgress { attempt, .. }) => {
                        context.attempt = context.attempt.max(attempt.saturating_add(1))
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "in-transaction run: its start could not be counted");
                    }
                }
            }
        }
        tracing::Span::current().record("attempt", context.attempt);
        tracing::Span::current().record("fence", lease.fence);
        let count = (counter.as_ref(), started.as_ref());
        self.claimed(idem, &key, fingerprint, lease, tx, handler, context, count)
            .await
    }

    /// A claimed key, from its handler to the commit. A run seen to end
    /// (anything but a cancellation: the runtime shutting down under it,
    /// as a crash) forgets its `count` (the counter and the lease its start
    /// took), before its rollback lets the claim go when it rolls back, so
    /// that the next run of the key never counts it.
    #[allow(clippy::too_many_arguments)]
    async fn claimed<S, C, T, E, F, Fut>(
        &self,
        idem: &Idempotency<S, C>,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        lease: Lease,
        tx: S::Tx,
        handler: F,
        context: Context,
        (counter, started): (Option<&IdempotencyKey>, Option<&Lease>),
    ) -> Result<Processed<T>, IdemError<E>>
    where
        S: TransactionalStore + ?Sized,
        C: Codec,
        T: Serialize + DeserializeOwned,
        F: FnOnce(Context, SharedTx<S::Tx>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let store = idem.store.clone();
        let scope = key.scope();
        let forget = || self.forget_run(&*store, counter, started);
        let shared = SharedTx::new(tx);
        let given = shared.clone();
        let outcome = run_handler(move |context| handler(context, given), context).await;
        let value = match outcome {
            HandlerOutcome::Ok(value) => value,
            // Rolled back: nothing of the handler is kept.
            HandlerOutcome::Err(e) => {
                forget().await;
                if let Some(tx) = shared.take(self.wait).await {
                    store.rollback(tx).await;
                }
                return Err(IdemError::Handler(e));
            }
            HandlerOutcome::Panicked(message) => {
                forget().await;
                if let Some(tx) = shared.take(self.wait).await {
                    store.rollback(tx).await;
                }
                return Err(IdemError::Panicked { message });
            }
            // The runtime shutting down under the run: as a crash.
            HandlerOutcome::Cancelled(message) => return Err(IdemError::Panicked { message }),
            HandlerOutcome::NotStarted => {
                forget().await;
                return Err(IdemError::InProgress {
                    retry_after: Duration::ZERO,
                    attempt: lease.attempt,
                });
            }
        };
        let Some(mut tx) = shared.take(self.wait).await else {
            // Rolled back when the handler's guard goes.
            tracing::error!(key = %key, "in-transaction run: the handler still holds its transaction after it returned; rolled back");
            forget().await;
            return Err(IdemError::Store(StoreError::backend(
                "the handler still held its transaction after it returned: nothing was kept",
            )));
        };
        let retention = idem.retention;
        let mut not_replayable = None;
        let written = match idem.encode(&value) {
            Ok(bytes) => match store.complete_in(&mut tx, &lease, &bytes, retention).await {
                Err(e @ StoreError::ResponseTooLarge { .. }) => {
                    let reason = e.to_string();
                    let marker = not_replayable_marker(&reason);
                    not_replayable = Some(reason);
                    store.complete_in(&mut tx, &lease, &marker, retention).await
                }
                other => other,
            },
            Err(reason) => {
                let marker = not_replayable_marker(&reason);
                not_replayable = Some(reason);
                store.complete_in(&mut tx, &lease, &marker, retention).await
            }
        };
        match written {
            Ok(()) => {}
            // The claim is no longer in the transaction: the handler ended
            // it (ROLLBACK or COMMIT), and what it wrote after that was
            // kept on its own. It ran: the key is completed "not
            // replayable" in a new transaction, never run again.
            Err(StoreError::LeaseLost) => {
                drop(tx);
                let marked = self.mark_ran(idem, key, fingerprint, value).await;
                forget().await;
                return marked;
            }
            Err(e) => {
                forget().await;
                store.rollback(tx).await;
                return Err(IdemError::Store(e));
            }
        }
        // Forgotten after the commit: committed, the key replays and is
        // never counted again; not committed (its connection lost), the
        // claim went with it.
        let committed = store.commit(tx).await;
        forget().await;
        if let Err(e) = committed {
            return Err(IdemError::Store(e));
        }
        let done = match not_replayable {
            None => Processed::Executed(value),
            Some(reason) => {
                tracing::warn!(key = %key, %reason, "the handler ran but its result cannot be recorded: the key completed as not replayable");
                count("idem_not_replayable_total", scope);
                Processed::ExecutedNotReplayable { value, reason }
            }
        };
        Ok(done)
    }

    /// After a handler ended its transaction itself: claims the key again
    /// in a new transaction and completes it "not replayable".
    async fn mark_ran<S, C, T, E>(
        &self,
        idem: &Idempotency<S, C>,
        key: &IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        value: T,
    ) -> Result<Processed<T>, IdemError<E>>
    where
        S: TransactionalStore + ?Sized,
        C: Codec,
    {
        let reason =
            "the handler ended its transaction itself: what it wrote after that is not covered"
                .to_owned();
        tracing::error!(key = %key, "in-transaction run: {reason}; the key is marked not replayable");
        let store = idem.store.clone();
        let mut tx = store.begin().await.map_err(IdemError::Store)?;
        match store
            .claim_in(&mut tx, key, fingerprint.as_ref(), self.wait)
            .await
        {
            Ok(Acquisition::Acquired(lease)) => {
                let marker = not_replayable_marker(&reason);
                if let Err(e) = store
                    .complete_in(&mut tx, &lease, &marker, idem.retention)
                    .await
                {
                    store.rollback(tx).await;
                    return Err(IdemError::Store(e));
                }
                store.commit(tx).await.map_err(IdemError::Store)?;
                Ok(Processed::ExecutedNotReplayable { value, reason })
            }
            // It committed its claim with the completion (COMMIT after the
            // record), or another run has the key now.
            Ok(Acquisition::Completed(_)) => {
                store.rollback(tx).await;
                Ok(Processed::ExecutedNotReplayable { value, reason })
            }
            Ok(Acquisition::InProgress { .. } | Acquisition::Mismatch) => {
                store.rollback(tx).await;
                Ok(Processed::ExecutedNotReplayable { value, reason })
            }
            Err(e) => {
                store.rollback(tx).await;
                Err(IdemError::Store(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;

    fn key(id: &str) -> IdempotencyKey {
        IdempotencyKey::new("http", id).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waiters that time out or are cancelled while another request holds
    /// the key count themselves out: the gate keeps no key once every
    /// request ended.
    #[tokio::test]
    async fn the_gate_forgets_a_key_once_its_waiters_timed_out_or_went_away() {
        let gate = Arc::new(KeyGate::default());
        let held = gate.enter(&key("k"), Duration::from_secs(1)).await;
        assert!(held.is_some());
        let timed_out = gate.enter(&key("k"), Duration::from_millis(10)).await;
        assert!(timed_out.is_none(), "the key is held");
        let cancelled = tokio::time::timeout(
            Duration::from_millis(10),
            gate.enter(&key("k"), Duration::from_secs(60)),
        )
        .await;
        assert!(cancelled.is_err(), "still waiting when cancelled");
        assert_eq!(gate.len(), 1);
        let waiting = {
            let gate = gate.clone();
            tokio::spawn(async move {
                gate.enter(&key("k"), Duration::from_secs(60))
                    .await
                    .is_some()
            })
        };
        while gate.keys.lock().unwrap_or_else(|p| p.into_inner())[&key("k")].1 < 2 {
            tokio::task::yield_now().await;
        }
        drop(held);
        assert!(
            waiting.await.unwrap_or_else(|e| panic!("{e}")),
            "the waiter got the key"
        );
        assert_eq!(gate.len(), 0, "no key left");
    }
}
