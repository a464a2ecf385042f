//! [`Tap`]: a store wrapper for tests that counts calls and injects faults.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;

use async_trait::async_trait;

use crate::{
    AcquireItem, Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease, Record,
    StoreError,
};

/// Wraps a real store for a test: every call goes to it, the calls that
/// matter to the executor are counted, and faults can be injected, the ones
/// that make duplicates happen: completions failing as if the store were
/// restarting, releases that never arrive, as from a process that died, an
/// answer held back after the store gave it (a slow reply racing another
/// call), and a store clock ahead of the application's. Not a mock: the
/// wrapped store does all the work.
#[derive(Debug, Default)]
pub struct Tap<S> {
    held_acquire: Held,
    held_delete: Held,
    clock_ahead_ms: AtomicU64,
    inner: S,
    acquires: AtomicUsize,
    completes: AtomicUsize,
    acquire_batches: AtomicUsize,
    complete_batches: AtomicUsize,
    releases: AtomicUsize,
    extends: AtomicUsize,
    failing_completes: AtomicUsize,
    drop_releases: AtomicBool,
}

impl<S> Tap<S> {
    /// Wraps `inner`, counting from zero, with no fault.
    pub fn new(inner: S) -> Self {
        Tap {
            held_acquire: Mutex::new(None),
            held_delete: Mutex::new(None),
            clock_ahead_ms: AtomicU64::new(0),
            inner,
            acquires: AtomicUsize::new(0),
            completes: AtomicUsize::new(0),
            acquire_batches: AtomicUsize::new(0),
            complete_batches: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
            extends: AtomicUsize::new(0),
            failing_completes: AtomicUsize::new(0),
            drop_releases: AtomicBool::new(false),
        }
    }

    /// The wrapped store (calls on it are not counted).
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// `acquire` calls so far, plus the items of `acquire_many` calls.
    pub fn acquires(&self) -> usize {
        self.acquires.load(Ordering::SeqCst)
    }

    /// `complete` calls so far, failed ones included, plus the items of
    /// `complete_many` calls.
    pub fn completes(&self) -> usize {
        self.completes.load(Ordering::SeqCst)
    }

    /// `acquire_many` calls so far (empty ones included).
    pub fn acquire_batches(&self) -> usize {
        self.acquire_batches.load(Ordering::SeqCst)
    }

    /// `complete_many` calls so far (empty ones included).
    pub fn complete_batches(&self) -> usize {
        self.complete_batches.load(Ordering::SeqCst)
    }

    /// `release` calls so far, dropped ones included.
    pub fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }

    /// `extend` calls so far.
    pub fn extends(&self) -> usize {
        self.extends.load(Ordering::SeqCst)
    }

    /// The next `n` completions fail with [`StoreError::Unavailable`]
    /// without reaching the store (in a `complete_many`, the first `n`
    /// items do, each with its own error, and the others go to the store
    /// in one batch).
    pub fn fail_completes(&self, n: usize) {
        self.failing_completes.store(n, Ordering::SeqCst);
    }

    /// Injected completion failures not used yet.
    pub fn failing_completes_left(&self) -> usize {
        self.failing_completes.load(Ordering::SeqCst)
    }

    /// While on, releases report success without reaching the store: the
    /// worker's process died before it could send them.
    pub fn drop_releases(&self, on: bool) {
        self.drop_releases.store(on, Ordering::SeqCst);
    }

    /// The next `acquire` (or `acquire_many`) reaches the store, then holds its answer: the
    /// first receiver fires once the store has answered, and the answer is
    /// returned when the sender is sent to (or dropped). Lets a test run
    /// another call between a store's answer and its use.
    pub fn hold_next_acquire(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (reached_tx, reached_rx) = oneshot::channel();
        let (resume_tx, resume_rx) = oneshot::channel();
        *self.held_acquire.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((reached_tx, resume_rx));
        (reached_rx, resume_tx)
    }

    /// The next `delete` waits before it reaches the store: the first
    /// receiver fires once it is called, and it goes on when the sender is
    /// sent to (or dropped). Lets a test run calls during a delete.
    pub fn hold_next_delete(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        arm(&self.held_delete)
    }

    /// Every time the store reports (lease and record deadlines, completion
    /// and expiry times) is moved `ahead`, as from a store whose clock runs
    /// ahead of the application's. Durations the store computed on its own
    /// clock (`retry_after`, a completed record's `ttl`) do not change.
    pub fn clock_ahead(&self, ahead: Duration) {
        let ms = u64::try_from(ahead.as_millis()).unwrap_or(u64::MAX);
        self.clock_ahead_ms.store(ms, Ordering::SeqCst);
    }

    fn skew(&self, outcome: Acquisition) -> Acquisition {
        let ahead = Duration::from_millis(self.clock_ahead_ms.load(Ordering::SeqCst));
        if ahead.is_zero() {
            return outcome;
        }
        let shift = |t: std::time::SystemTime| t.checked_add(ahead).unwrap_or(t);
        match outcome {
            Acquisition::Acquired(mut lease) => {
                lease.expires_at = shift(lease.expires_at);
                Acquisition::Acquired(lease)
            }
            Acquisition::Completed(mut record) => {
                record.completed_at = shift(record.completed_at);
                record.expires_at = shift(record.expires_at);
                Acquisition::Completed(record)
            }
            Acquisition::InProgress {
                lease_expires_at,
                retry_after,
                attempt,
            } => Acquisition::InProgress {
                lease_expires_at: shift(lease_expires_at),
                retry_after,
                attempt,
            },
            other => other,
        }
    }
}

type Held = Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>;

/// Arms a hold: the next call that passes `hold(slot)` signals the first
/// half and waits for the second.
fn arm(slot: &Held) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
    let (reached_tx, reached_rx) = oneshot::channel();
    let (resume_tx, resume_rx) = oneshot::channel();
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some((reached_tx, resume_rx));
    (reached_rx, resume_tx)
}

/// Waits here if a hold is armed (once).
async fn hold(slot: &Held) {
    let held = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some((reached, resume)) = held {
        let _ = reached.send(());
        let _ = resume.await;
    }
}

#[async_trait]
impl<S: IdempotencyStore> IdempotencyStore for Tap<S> {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        self.acquires.fetch_add(1, Ordering::SeqCst);
        let outcome = self.inner.acquire(key, fingerprint, lease).await;
        hold(&self.held_acquire).await;
        outcome.map(|o| self.skew(o))
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        let injected = self
            .failing_completes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if injected {
            return Err(StoreError::unavailable(
                "injected by Tap: the store is restarting",
            ));
        }
        self.inner.complete(lease, response, retention).await
    }

    async fn acquire_many(
        &self,
        items: &[AcquireItem<'_>],
        lease: Duration,
    ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
        self.acquire_batches.fetch_add(1, Ordering::SeqCst);
        self.acquires.fetch_add(items.len(), Ordering::SeqCst);
        let outcome = self.inner.acquire_many(items, lease).await;
        hold(&self.held_acquire).await;
        outcome.map(|all| {
            all.into_iter()
                .map(|one| one.map(|o| self.skew(o)))
                .collect()
        })
    }

    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        self.complete_batches.fetch_add(1, Ordering::SeqCst);
        self.completes.fetch_add(items.len(), Ordering::SeqCst);
        let mut injected = vec![false; items.len()];
        for slot in &mut injected {
            *slot = self
                .failing_completes
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        }
        let sent: Vec<(&Lease, &[u8])> = items
            .iter()
            .zip(&injected)
            .filter(|(_, injected)| !**injected)
            .map(|(item, _)| *item)
            .collect();
        let mut answers = if sent.is_empty() {
            Vec::new()
        } else {
            self.inner.complete_many(&sent, retention).await?
        }
        .into_iter();
        let mut out = Vec::with_capacity(items.len());
        for injected in injected {
            if injected {
                out.push(Err(StoreError::unavailable(
                    "injected by Tap: the store is restarting",
                )));
            } else {
                out.push(answers.next().unwrap_or_else(|| {
                    Err(StoreError::backend(
                        "the store answered fewer items than it was sent",
                    ))
                }));
            }
        }
        Ok(out)
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        if self.drop_releases.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.release(lease).await
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        self.inner.extend(lease, lease_for).await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        hold(&self.held_delete).await;
        self.inner.delete(key).await
    }

    async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(max).await
    }
}
