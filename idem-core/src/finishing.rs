//! What every receiver does with a result it could not record yet
//! ([`IdemError::Unrecorded`](crate::IdemError::Unrecorded)): keep the key
//! from running again while the completion is written later with the
//! run's own lease ([`FinishingKeys`]), and write it until it is recorded,
//! taken over, refused for good, or the receiver gives up
//! ([`Idempotency::finish_until`]).
//!
//! The HTTP layer and the Kafka, SQS and Redis Streams consumers use these
//! two pieces; a receiver of your own can too.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::codec::Codec;
use crate::error::{StoreError, Unrecorded};
use crate::executor::Idempotency;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::IdempotencyStore;

/// The keys whose completion a receiver is writing after a store outage.
///
/// While a key is here, another delivery of it must wait (HTTP: 409, a
/// consumer: retry later) instead of asking the store, which would let it
/// take the key over once the lease is over and run the handler again.
/// [`hold`](Self::hold) puts a key in for as long as its
/// [`FinishingGuard`] lives; the guard takes it out when dropped (written,
/// given up, or the task that held it aborted). Cheap when empty: a
/// lookup reads one atomic counter until a key is held.
#[derive(Debug, Default)]
pub struct FinishingKeys {
    /// How many keys: lookups read this and take the lock only when it is
    /// not zero.
    count: AtomicUsize,
    /// Each key with the fingerprint of every run being finished (a key
    /// may be held by two runs: one taken over, one of its new holder).
    keys: Mutex<HashMap<IdempotencyKey, Vec<Option<Fingerprint>>>>,
    /// Wakes the finishers pausing between two tries
    /// ([`store_answered`](Self::store_answered)).
    answered: tokio::sync::Notify,
    /// The keys whose completion the receiver gave up writing.
    given_up: GivenUpKeys,
}

impl FinishingKeys {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds `key` (with the fingerprint of the run being finished, for
    /// [`holds`](Self::holds)) until the guard is dropped. A key held by
    /// two guards stays held until both are dropped.
    pub fn hold(
        self: &Arc<Self>,
        key: IdempotencyKey,
        fingerprint: Option<Fingerprint>,
    ) -> FinishingGuard {
        let mut keys = lock(&self.keys);
        let holders = keys.entry(key.clone()).or_default();
        if holders.is_empty() {
            self.count.fetch_add(1, Ordering::Release);
        }
        holders.push(fingerprint);
        FinishingGuard {
            keys: self.clone(),
            key,
            fingerprint,
        }
    }

    /// Whether `key` is being finished.
    pub fn contains(&self, key: &IdempotencyKey) -> bool {
        self.count.load(Ordering::Acquire) > 0 && lock(&self.keys).contains_key(key)
    }

    /// Whether `key` is being finished for a run with this fingerprint, or
    /// for a run without one (whose record cannot tell payloads apart, so
    /// it holds every payload). A delivery with another payload than a
    /// fingerprinted run's is not held: it goes on to the store, which
    /// answers the mismatch whatever the record's state.
    pub fn holds(&self, key: &IdempotencyKey, fingerprint: &Fingerprint) -> bool {
        self.count.load(Ordering::Acquire) > 0
            && lock(&self.keys).get(key).is_some_and(|held| {
                held.iter()
                    .any(|f| f.is_none() || f.as_ref() == Some(fingerprint))
            })
    }

    /// The store answered a call (a request or another finisher got
    /// through): every finisher pausing between two tries in
    /// [`Idempotency::finish_until_woken`] tries again at once, so the
    /// completions go in as soon as the store is back rather than after
    /// their pauses. Cheap when no key is held.
    pub fn store_answered(&self) {
        if !self.is_empty() {
            self.answered.notify_waiters();
        }
    }

    /// The keys whose completion this receiver gave up writing
    /// ([`GivenUpKeys`]): put one in before its [`FinishingGuard`] is
    /// dropped, so a delivery that finds the key no longer held finds it
    /// given up. An executor that [waits for these
    /// keys](Idempotency::waits_for_finishing) answers
    /// [`IdemError::ResultUnavailable`](crate::IdemError::ResultUnavailable)
    /// for them without asking the store.
    pub fn given_up(&self) -> &GivenUpKeys {
        &self.given_up
    }

    /// How many keys are being finished.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Whether no key is being finished.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn remove(&self, key: &IdempotencyKey, fingerprint: &Option<Fingerprint>) {
        let mut keys = lock(&self.keys);
        let Some(holders) = keys.get_mut(key) else {
            return;
        };
        if let Some(at) = holders.iter().position(|f| f == fingerprint) {
            holders.swap_remove(at);
        }
        if holders.is_empty() {
            keys.remove(key);
            self.count.fetch_sub(1, Ordering::Release);
        }
    }
}

/// A key held in [`FinishingKeys`]; dropping it lets the key go.
#[derive(Debug)]
#[must_use = "the key is let go as soon as the guard is dropped"]
pub struct FinishingGuard {
    keys: Arc<FinishingKeys>,
    key: IdempotencyKey,
    fingerprint: Option<Fingerprint>,
}

impl FinishingGuard {
    /// The key held.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }
}

impl Drop for FinishingGuard {
    fn drop(&mut self) {
        self.keys.remove(&self.key, &self.fingerprint);
    }
}

/// The keys whose handler ran at this receiver but whose completion it
/// gave up writing ([`Finished::Refused`], [`Finished::GaveUp`]). The
/// store holds such a key in progress, its lease over: an acquisition
/// would take it over and run the handler again. So another delivery of
/// the key at this receiver, with the same payload, is not acquired: an
/// executor that [waits for these keys](Idempotency::waits_for_finishing)
/// reads the record (one `get`) and answers
/// [`IdemError::ResultUnavailable`](crate::IdemError::ResultUnavailable)
/// while the store holds it (HTTP: 409 "not recorded"; a consumer settles
/// it), until the retention the result would have had ends. A record the
/// store no longer holds (an operator deleted it to have the key run
/// again, or it expired) lets the key go: it runs. Another receiver (instance,
/// consumer) does not know it: that is the window an outage longer than
/// the lease leaves (DESIGN 4).
///
/// One entry per given-up key, pruned as entries expire; a lookup reads
/// one atomic counter while the set is empty.
#[derive(Debug, Default)]
pub struct GivenUpKeys {
    count: AtomicUsize,
    keys: Mutex<HashMap<IdempotencyKey, GivenUp>>,
}

/// A key given up: its run's fingerprint (`None`: every payload) and when
/// it is let go (`None`: a retention too long for this clock, kept for the
/// process's life).
type GivenUp = (Option<Fingerprint>, Option<Instant>);

impl GivenUpKeys {
    /// Keeps `key` (with its run's `fingerprint`, or `None` for every
    /// payload) for `retention` from now.
    pub fn insert(
        &self,
        key: IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        retention: Duration,
    ) {
        let now = Instant::now();
        let mut keys = lock(&self.keys);
        keys.retain(|_, (_, until)| until.is_none_or(|u| u > now));
        keys.insert(key, (fingerprint, now.checked_add(retention)));
        self.count.store(keys.len(), Ordering::Release);
    }

    /// Whether `key` was given up for a run with this `fingerprint` (or
    /// for a run without one, or when the delivery has none). A delivery
    /// with another payload than a fingerprinted run's is not: the store
    /// answers its mismatch.
    pub fn holds(&self, key: &IdempotencyKey, fingerprint: Option<&Fingerprint>) -> bool {
        if self.count.load(Ordering::Acquire) == 0 {
            return false;
        }
        let now = Instant::now();
        let mut keys = lock(&self.keys);
        match keys.get(key) {
            Some((_, Some(until))) if *until <= now => {
                keys.remove(key);
                self.count.store(keys.len(), Ordering::Release);
                false
            }
            Some((held, _)) => match (held, fingerprint) {
                (Some(held), Some(given)) => held == given,
                _ => true,
            },
            None => false,
        }
    }

    /// Lets `key` go (the store no longer holds its record: an operator
    /// deleted it, or it expired).
    pub fn remove(&self, key: &IdempotencyKey) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut keys = lock(&self.keys);
        keys.remove(key);
        self.count.store(keys.len(), Ordering::Release);
    }

    /// How many keys are kept (expired ones included until the next
    /// insert or lookup prunes them).
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Whether no key is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How [`Idempotency::finish_until`] ended, or a try of
/// [`Idempotency::try_finish`] that settled.
#[derive(Debug)]
pub enum Finished {
    /// The completion is written: every duplicate now gets the replay.
    Recorded,
    /// Another worker took the key over after the lease ended
    /// ([`StoreError::LeaseLost`]): its holder records; a later delivery
    /// gets that answer.
    TakenOver,
    /// The store refuses the completion for good (a non-retryable error):
    /// the handler ran, so the message must never run again (a consumer
    /// dead-letters it).
    Refused(StoreError),
    /// The receiver gave up while the store was still away (the last
    /// retryable error): after the lease, the key's next delivery may take
    /// it over and run the handler again. Only from
    /// [`finish_until`](Idempotency::finish_until).
    GaveUp(StoreError),
}

/// The pauses between two tries of [`Idempotency::finish_until`]: the
/// first, doubled after each try up to the longest.
///
/// Keep the longest short: once the lease is over, any delivery may take
/// the key over, so the completion should go in soon after the store is
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pauses {
    /// The pause after the first failed try (at least [`MIN_PAUSE`]).
    first: Duration,
    /// The longest pause (at least `first`).
    longest: Duration,
}

/// The shortest pause [`Idempotency::finish_until`] takes: a zero pause
/// would retry back to back for as long as the store is away.
pub const MIN_PAUSE: Duration = Duration::from_millis(1);

impl Pauses {
    /// Pauses from `first` (at least [`MIN_PAUSE`]), doubled up to
    /// `longest` (at least `first`).
    pub fn new(first: Duration, longest: Duration) -> Self {
        let first = first.max(MIN_PAUSE);
        Pauses {
            first,
            longest: longest.max(first),
        }
    }
}

impl<S, C> Idempotency<S, C>
where
    S: IdempotencyStore + ?Sized,
    C: Codec,
{
    /// One try of [`finish`](Self::finish), read as a receiver needs it:
    /// `Ok` when the completion settled ([`Finished::Recorded`],
    /// [`Finished::TakenOver`] or [`Finished::Refused`]), the store's
    /// retryable error when it is still away (try again soon: after the
    /// lease, any delivery may take the key over). For receivers that
    /// finish many runs in rounds; [`finish_until`](Self::finish_until)
    /// is the loop for one.
    pub async fn try_finish(&self, unrecorded: &Unrecorded) -> Result<Finished, StoreError> {
        match self.finish(unrecorded).await {
            Ok(()) => Ok(Finished::Recorded),
            Err(StoreError::LeaseLost) => Ok(Finished::TakenOver),
            Err(e) if e.is_retryable() => Err(e),
            Err(e) => Ok(Finished::Refused(e)),
        }
    }

    /// Writes an unrecorded completion ([`finish`](Self::finish)) until it
    /// is recorded, taken over, refused for good, or `give_up` completes
    /// while the store is still away; between two tries it waits
    /// `pauses` (cut short by `give_up`). A `give_up` that has completed
    /// before a try still lets that try run: the receiver gives up only
    /// after the store failed once more.
    pub async fn finish_until<G>(
        &self,
        unrecorded: &Unrecorded,
        pauses: Pauses,
        give_up: G,
    ) -> Finished
    where
        G: Future<Output = ()>,
    {
        self.finish_until_inner(unrecorded, pauses, give_up, None)
            .await
    }

    /// [`finish_until`](Self::finish_until), with each pause cut short
    /// when `keys` hears that the store answered
    /// ([`FinishingKeys::store_answered`]); a completion written tells
    /// `keys` too, so the other finishers of the receiver try at once.
    pub async fn finish_until_woken<G>(
        &self,
        unrecorded: &Unrecorded,
        pauses: Pauses,
        give_up: G,
        keys: &FinishingKeys,
    ) -> Finished
    where
        G: Future<Output = ()>,
    {
        self.finish_until_inner(unrecorded, pauses, give_up, Some(keys))
            .await
    }

    async fn finish_until_inner<G>(
        &self,
        unrecorded: &Unrecorded,
        pauses: Pauses,
        give_up: G,
        keys: Option<&FinishingKeys>,
    ) -> Finished
    where
        G: Future<Output = ()>,
    {
        let give_up = std::pin::pin!(give_up);
        let mut give_up = futures::future::FutureExt::fuse(give_up);
        let mut gave_up = false;
        let mut pause = pauses.first;
        loop {
            // Registered before the try, so a wake-up during it is kept.
            let woken = keys.map(|k| k.answered.notified());
            match self.try_finish(unrecorded).await {
                Ok(settled) => {
                    if let Some(keys) = keys {
                        keys.store_answered();
                    }
                    return settled;
                }
                Err(e) if gave_up => return Finished::GaveUp(e),
                Err(_) => {}
            }
            let woken = async {
                match woken {
                    Some(woken) => woken.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = &mut give_up => gave_up = true,
                () = woken => {}
                () = tokio::time::sleep(pause) => {}
            }
            pause = pause.saturating_mul(2).min(pauses.longest);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> IdempotencyKey {
        IdempotencyKey::new("finishing.test", id).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_guard_holds_its_key_until_dropped() {
        let keys = Arc::new(FinishingKeys::new());
        let fp = Fingerprint::of_bytes(b"payload");
        let other = Fingerprint::of_bytes(b"other");
        assert!(!keys.contains(&key("a")) && keys.is_empty());
        let guard = keys.hold(key("a"), Some(fp));
        assert!(keys.contains(&key("a")));
        assert!(keys.holds(&key("a"), &fp));
        assert!(
            !keys.holds(&key("a"), &other),
            "another payload is not held"
        );
        assert!(!keys.contains(&key("b")));
        assert_eq!(keys.len(), 1);
        drop(guard);
        assert!(!keys.contains(&key("a")) && keys.is_empty());
    }

    /// A run without a fingerprint: its record cannot tell payloads
    /// apart (the store would answer no mismatch), so every payload is
    /// held.
    #[test]
    fn a_key_held_without_a_fingerprint_holds_every_payload() {
        let keys = Arc::new(FinishingKeys::new());
        let _guard = keys.hold(key("a"), None);
        assert!(keys.contains(&key("a")));
        assert!(keys.holds(&key("a"), &Fingerprint::of_bytes(b"x")));
        assert!(!keys.holds(&key("b"), &Fingerprint::of_bytes(b"x")));
    }

    /// Two runs of one key finishing at once (the second took the key over
    /// after the first's lease, and the store went away again): each holds
    /// a guard. `hold` says the key is held "until the guard is dropped",
    /// but the first guard's drop lets it go while the second run is still
    /// finishing, so a duplicate is no longer kept waiting: it goes to the
    /// store and, the lease being over, takes the key over and runs again.
    #[test]
    fn a_key_held_twice_stays_held_until_both_guards_are_dropped() {
        let keys = Arc::new(FinishingKeys::new());
        let first = Fingerprint::of_bytes(b"first");
        let g1 = keys.hold(key("a"), Some(first));
        let g2 = keys.hold(key("a"), Some(first));
        drop(g1);
        assert!(
            keys.contains(&key("a")) && keys.holds(&key("a"), &first),
            "the second guard still lives, but its key was let go"
        );
        assert_eq!(keys.len(), 1);
        drop(g2);
        assert!(keys.is_empty());
    }

    #[test]
    fn pauses_never_shrink_below_the_first() {
        let p = Pauses::new(Duration::from_millis(500), Duration::from_millis(10));
        assert_eq!(p.longest, Duration::from_millis(500));
        let p = Pauses::new(Duration::ZERO, Duration::MAX);
        assert_eq!((p.first, p.longest), (MIN_PAUSE, Duration::MAX));
    }
}
