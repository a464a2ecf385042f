//! The conformance suite: the behaviour every [`IdempotencyStore`] must
//! have, as async functions over a [`Harness`] that makes stores.
//!
//! Every store in this workspace runs all of it, and so can yours:
//!
//! ```no_run
//! use idem_core::testkit::{self, Harness};
//! use idem_core::{async_trait, IdempotencyKey, MemoryStore};
//!
//! struct MyHarness;
//!
//! #[async_trait]
//! impl Harness for MyHarness {
//!     type Store = MemoryStore; // your store here
//!     async fn store(&self) -> MemoryStore {
//!         MemoryStore::new()
//!     }
//!     async fn corrupt(&self, store: &MemoryStore, key: &IdempotencyKey) {
//!         store.corrupt_for_tests(key); // write garbage into your backend here
//!     }
//! }
//!
//! // One `#[tokio::test]` per case (needs `tokio` with `macros` and
//! // `rt-multi-thread` in your dev-dependencies):
//! idem_core::conformance_tests!(MyHarness);
//!
//! // Or everything in one test:
//! # async fn all() {
//! testkit::run_all(&MyHarness).await;
//! # }
//! ```
//!
//! Cases panic with a message saying what broke. They use fresh random keys
//! under the scope `idem.conformance`, so several may share one server.
//! Where expiry is under test they wait for real (a few multiples of
//! [`Settings::lease`]); a store on `tokio::time::Instant`, like
//! [`MemoryStore`], can run them under `tokio::time::pause()` (see
//! `conformance_tests!(h, paused)`), where those waits take no time.

mod tap;
pub use tap::Tap;

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::{
    saturate, AcquireItem, Acquisition, Fingerprint, IdemError, Idempotency, IdempotencyKey,
    IdempotencyStore, InProgressPolicy, KeyError, Lease, MemoryStore, Processed, RecordState,
    StoreError,
};

/// Makes stores for the suite and reaches into them where the trait cannot.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: IdempotencyStore;

    /// A store to run one case against (fresh, or sharing a server: cases
    /// use their own random keys).
    async fn store(&self) -> Self::Store;

    /// Makes the stored record of `key` undecodable, writing to the
    /// backend directly (garbage bytes, a wrong type, a missing field).
    async fn corrupt(&self, store: &Self::Store, key: &IdempotencyKey);

    /// Timings and capabilities of this store.
    fn settings(&self) -> Settings {
        Settings::default()
    }
}

/// Timings and capabilities that differ between stores.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settings {
    /// The short lease (and retention) used where expiry is under test.
    /// Long enough that a few round trips fit well inside it. Default 300 ms.
    pub lease: Duration,
    /// Whether `purge_expired` removes records and reports them (`false`
    /// for stores that expire records by themselves, such as Redis).
    pub purge_reports_removed: bool,
    /// Concurrent tasks in the storm. Default 64.
    pub storm_tasks: usize,
    /// Keys in the storm. Default 500.
    pub storm_keys: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            lease: Duration::from_millis(300),
            purge_reports_removed: true,
            storm_tasks: 64,
            storm_keys: 500,
        }
    }
}

impl Settings {
    /// Sets [`Settings::lease`].
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets [`Settings::purge_reports_removed`].
    pub fn purge_reports_removed(mut self, yes: bool) -> Self {
        self.purge_reports_removed = yes;
        self
    }

    /// Sets the storm's size.
    pub fn storm(mut self, tasks: usize, keys: usize) -> Self {
        self.storm_tasks = tasks;
        self.storm_keys = keys;
        self
    }
}

/// The harness of [`MemoryStore`].
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryHarness;

#[async_trait]
impl Harness for MemoryHarness {
    type Store = MemoryStore;

    async fn store(&self) -> MemoryStore {
        MemoryStore::new()
    }

    async fn corrupt(&self, store: &MemoryStore, key: &IdempotencyKey) {
        store.corrupt_for_tests(key);
    }
}

/// Lists every case once; `$cb` is called with the list.
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_conformance_cases {
    ($cb:ident [$($args:tt)*]) => {
        $crate::$cb! { [$($args)*]
            fresh_acquire,
            duplicate_replay,
            mismatch,
            fingerprint_optional,
            in_progress,
            concurrent_acquire_single_winner,
            lease_takeover_fencing,
            expired_lease_still_owned_until_takeover,
            extend_renews_lease,
            release_frees_key,
            complete_is_final,
            token_never_reused,
            retention_expiry,
            get_and_delete,
            purge_expired,
            corrupt_record,
            key_limits,
            large_response,
            fence_strictly_increases,
            completed_record_carries_fence_and_store_ttl,
            zero_lease_refused,
            durations_at_the_extremes,
            batch_mixed_outcomes,
            batch_duplicate_keys_in_one_batch,
            batch_complete_many,
            batch_empty,
            batch_order_kept,
            batch_process_one_handler_fails,
            concurrent_storm
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __idem_conformance_define_run_all {
    ([] $($name:ident),*) => {
        /// Runs every case, one after the other.
        pub async fn run_all<H: Harness>(harness: &H) {
            $(
                tracing::info!(case = stringify!($name), "idem conformance case");
                $name(harness).await;
            )*
        }

        /// The names of all cases, in the order `run_all` runs them.
        pub const CASES: &[&str] = &[$(stringify!($name)),*];
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __idem_conformance_define_tests {
    ([$attr:tt [$harness:expr]] $($name:ident),*) => {
        $(
            #[::tokio::test $attr]
            async fn $name() {
                let harness = $harness;
                $crate::testkit::$name(&harness).await;
            }
        )*
    };
}

/// Expands to one `#[tokio::test]` per conformance case, each building the
/// harness with the given expression (which may `.await`).
///
/// `conformance_tests!(harness)` runs on a 2-worker multi-thread runtime;
/// `conformance_tests!(harness, paused)` on a current-thread runtime with
/// time paused (for stores on `tokio::time::Instant`; needs tokio's
/// `test-util` feature). The calling crate needs `tokio` with `macros`.
#[macro_export]
macro_rules! conformance_tests {
    ($harness:expr, paused) => {
        $crate::__idem_conformance_cases!(
            __idem_conformance_define_tests
                [(flavor = "current_thread", start_paused = true)[$harness]]
        );
    };
    ($harness:expr) => {
        $crate::__idem_conformance_cases!(
            __idem_conformance_define_tests
                [(flavor = "multi_thread", worker_threads = 2)[$harness]]
        );
    };
}

crate::__idem_conformance_cases!(__idem_conformance_define_run_all []);

const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

/// A fresh key no other case or run uses.
pub fn unique_key(tag: &str) -> IdempotencyKey {
    let id = format!("{tag}-{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
    match IdempotencyKey::new("idem.conformance", id) {
        Ok(key) => key,
        Err(e) => panic!("test key is invalid: {e}"),
    }
}

fn fp(text: &str) -> Fingerprint {
    Fingerprint::of_bytes(text.as_bytes())
}

fn acquired(outcome: Result<Acquisition, StoreError>, what: &str) -> Lease {
    match outcome {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("{what}: expected Acquired, got {other:?}"),
    }
}

fn completed_response(outcome: Result<Acquisition, StoreError>, what: &str) -> Vec<u8> {
    match outcome {
        Ok(Acquisition::Completed(record)) => record.response.to_vec(),
        other => panic!("{what}: expected Completed, got {other:?}"),
    }
}

fn ok<T: std::fmt::Debug>(result: Result<T, StoreError>, what: &str) -> T {
    match result {
        Ok(v) => v,
        Err(e) => panic!("{what}: unexpected error {e:?}"),
    }
}

fn lease_lost<T: std::fmt::Debug>(result: Result<T, StoreError>, what: &str) {
    assert!(
        matches!(result, Err(StoreError::LeaseLost)),
        "{what}: expected LeaseLost, got {result:?}"
    );
}

/// Waits until a lease (or retention) of `d` has surely run out.
async fn outlive(d: Duration) {
    tokio::time::sleep(d + d / 2 + Duration::from_millis(20)).await;
}

fn close(a: SystemTime, b: SystemTime, tolerance: Duration) -> bool {
    let diff = a.duration_since(b).unwrap_or_else(|e| e.duration());
    diff <= tolerance
}

/// A fresh key is acquired with attempt 1, and the record is in progress
/// with the fingerprint and the lease's token.
pub async fn fresh_acquire<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("fresh");
    let lease = acquired(
        store.acquire(&key, Some(&fp("a")), LONG).await,
        "fresh acquire",
    );
    assert_eq!(lease.key, key);
    assert_eq!(lease.attempt, 1);
    assert_eq!(
        lease.fingerprint,
        Some(fp("a")),
        "the lease carries the stored fingerprint"
    );
    let record =
        ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("no record after acquire"));
    assert_eq!(record.key, key);
    assert_eq!(record.token, lease.token);
    assert_eq!(record.attempt, 1);
    assert_eq!(record.fingerprint, Some(fp("a")));
    match record.state {
        RecordState::InProgress { lease_expires_at } => assert!(
            close(lease_expires_at, lease.expires_at, Duration::from_millis(2)),
            "record lease {lease_expires_at:?} != lease {:?}",
            lease.expires_at
        ),
        other => panic!("expected InProgress, got {other:?}"),
    }
    let held = lease
        .expires_at
        .duration_since(record.created_at)
        .unwrap_or_default();
    assert!(
        held >= LONG - Duration::from_millis(2) && held <= LONG + Duration::from_secs(1),
        "lease length {held:?}, asked for {LONG:?}"
    );
    assert!(
        record.expires_at >= lease.expires_at,
        "record expires before its lease"
    );
}

/// A completed key replays its response, fingerprint and attempt to every
/// duplicate, with or without a fingerprint.
pub async fn duplicate_replay<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("replay");
    let lease = acquired(
        store.acquire(&key, Some(&fp("p")), LONG).await,
        "first acquire",
    );
    ok(store.complete(&lease, b"receipt-1", DAY).await, "complete");
    for i in 0..3 {
        match store.acquire(&key, Some(&fp("p")), LONG).await {
            Ok(Acquisition::Completed(record)) => {
                assert_eq!(&record.response[..], b"receipt-1");
                assert_eq!(record.fingerprint, Some(fp("p")));
                assert_eq!(record.attempt, 1);
                assert_eq!(record.key, key);
                assert!(record.expires_at > record.completed_at);
            }
            other => panic!("duplicate {i}: expected Completed, got {other:?}"),
        }
    }
    assert_eq!(
        completed_response(
            store.acquire(&key, None, LONG).await,
            "duplicate without fingerprint"
        ),
        b"receipt-1"
    );
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    match record.state {
        RecordState::Completed { response, .. } => assert_eq!(&response[..], b"receipt-1"),
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// A different fingerprint on a live key is `Mismatch`, whether the record
/// is completed, in progress, or in progress with its lease over (the
/// mismatch wins over the takeover).
pub async fn mismatch<H: Harness>(h: &H) {
    let store = h.store().await;
    let lease_len = h.settings().lease;

    let done = unique_key("mismatch-done");
    let lease = acquired(store.acquire(&done, Some(&fp("a")), LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    let got = store.acquire(&done, Some(&fp("b")), LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::Mismatch)),
        "completed: {got:?}"
    );

    let busy = unique_key("mismatch-busy");
    acquired(store.acquire(&busy, Some(&fp("a")), LONG).await, "acquire");
    let got = store.acquire(&busy, Some(&fp("b")), LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::Mismatch)),
        "in progress: {got:?}"
    );

    let stale = unique_key("mismatch-stale");
    acquired(
        store.acquire(&stale, Some(&fp("a")), lease_len).await,
        "acquire",
    );
    outlive(lease_len).await;
    let got = store.acquire(&stale, Some(&fp("b")), LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::Mismatch)),
        "lease over: {got:?}"
    );
    let taken = acquired(
        store.acquire(&stale, Some(&fp("a")), LONG).await,
        "takeover with the right payload",
    );
    assert_eq!(taken.attempt, 2);
}

/// The fingerprint check applies only when both sides carry one.
pub async fn fingerprint_optional<H: Harness>(h: &H) {
    let store = h.store().await;

    let k1 = unique_key("fp-none-stored");
    let lease = acquired(
        store.acquire(&k1, None, LONG).await,
        "acquire without fingerprint",
    );
    assert_eq!(lease.fingerprint, None);
    let got = store.acquire(&k1, Some(&fp("x")), LONG).await;
    assert!(matches!(got, Ok(Acquisition::InProgress { .. })), "{got:?}");
    ok(store.complete(&lease, b"one", DAY).await, "complete");
    assert_eq!(
        completed_response(store.acquire(&k1, Some(&fp("x")), LONG).await, "replay"),
        b"one"
    );

    let k2 = unique_key("fp-none-given");
    let lease = acquired(
        store.acquire(&k2, Some(&fp("y")), LONG).await,
        "acquire with fingerprint",
    );
    ok(store.complete(&lease, b"two", DAY).await, "complete");
    assert_eq!(
        completed_response(store.acquire(&k2, None, LONG).await, "replay"),
        b"two"
    );
}

/// A key held with a live lease is `InProgress`, with the holder's deadline,
/// the time left and its attempt.
pub async fn in_progress<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("busy");
    let lease = acquired(store.acquire(&key, Some(&fp("a")), LONG).await, "acquire");
    match store.acquire(&key, Some(&fp("a")), LONG).await {
        Ok(Acquisition::InProgress {
            lease_expires_at,
            retry_after,
            attempt,
        }) => {
            assert_eq!(attempt, 1);
            assert!(
                close(lease_expires_at, lease.expires_at, Duration::from_millis(2)),
                "deadline {lease_expires_at:?} != lease {:?}",
                lease.expires_at
            );
            assert!(
                retry_after > LONG - Duration::from_secs(5) && retry_after <= LONG,
                "retry_after {retry_after:?}"
            );
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    // Asking did not change the holder.
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, lease.token);
}

/// Many workers acquiring one key at once: exactly one wins.
pub async fn concurrent_acquire_single_winner<H: Harness>(h: &H) {
    let store = Arc::new(h.store().await);
    let key = unique_key("race");
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let store = store.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            store.acquire(&key, Some(&fp("a")), LONG).await
        }));
    }
    let mut winners = 0;
    for task in tasks {
        match task.await {
            Ok(Ok(Acquisition::Acquired(_))) => winners += 1,
            Ok(Ok(Acquisition::InProgress { attempt: 1, .. })) => {}
            other => panic!("unexpected outcome in the race: {other:?}"),
        }
    }
    assert_eq!(winners, 1, "exactly one acquirer must win");
}

/// After the lease ends another worker takes over (new token, attempt 2),
/// and the old holder's complete, release and extend get `LeaseLost` and
/// change nothing.
pub async fn lease_takeover_fencing<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("takeover");
    let old = acquired(
        store.acquire(&key, Some(&fp("a")), short).await,
        "first acquire",
    );
    outlive(short).await;
    // Taken over without a fingerprint: the stored one is kept and reported.
    let new = acquired(store.acquire(&key, None, LONG).await, "takeover");
    assert_eq!(new.attempt, 2);
    assert_eq!(
        new.fingerprint,
        Some(fp("a")),
        "the takeover lease carries the stored fingerprint"
    );
    assert_ne!(new.token, old.token, "takeover must issue a new token");

    lease_lost(store.complete(&old, b"zombie", DAY).await, "stale complete");
    lease_lost(store.release(&old).await, "stale release");
    lease_lost(store.extend(&old, LONG).await, "stale extend");

    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, new.token);
    assert_eq!(record.attempt, 2);
    assert_eq!(
        record.fingerprint,
        Some(fp("a")),
        "fingerprint survives a takeover"
    );
    assert!(matches!(record.state, RecordState::InProgress { .. }));

    ok(
        store.complete(&new, b"owner", DAY).await,
        "new owner completes",
    );
    lease_lost(
        store.complete(&old, b"zombie", DAY).await,
        "stale complete after completion",
    );
    match store.acquire(&key, Some(&fp("a")), LONG).await {
        Ok(Acquisition::Completed(r)) => {
            assert_eq!(&r.response[..], b"owner");
            assert_eq!(r.attempt, 2);
        }
        other => panic!("expected the new owner's result, got {other:?}"),
    }
}

/// A passed deadline only allows a takeover: until someone takes over, the
/// holder's extend, complete and release still succeed.
pub async fn expired_lease_still_owned_until_takeover<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;

    let key = unique_key("late");
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    outlive(short).await;
    let renewed = ok(store.extend(&lease, short).await, "late extend");
    assert_eq!(renewed.token, lease.token);
    assert!(renewed.expires_at > lease.expires_at);
    outlive(short).await;
    ok(store.complete(&lease, b"late", DAY).await, "late complete");
    assert_eq!(
        completed_response(store.acquire(&key, None, LONG).await, "replay"),
        b"late"
    );

    let key = unique_key("late-release");
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    outlive(short).await;
    ok(store.release(&lease).await, "late release");
    assert_eq!(
        acquired(store.acquire(&key, None, LONG).await, "after release").attempt,
        1
    );
}

/// `extend` pushes the deadline out, so no takeover happens at the old one.
pub async fn extend_renews_lease<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("extend");
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    let renewed = ok(store.extend(&lease, LONG).await, "extend");
    assert_eq!(renewed.token, lease.token);
    assert_eq!(renewed.fingerprint, lease.fingerprint);
    assert_eq!(renewed.attempt, lease.attempt);
    assert!(renewed.expires_at > lease.expires_at + short);
    outlive(short).await;
    let got = store.acquire(&key, None, LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::InProgress { .. })),
        "after extend: {got:?}"
    );
    // Both the original lease and the renewed one name the same holder.
    ok(store.complete(&lease, b"done", DAY).await, "complete");
}

/// `release` makes the key absent: the next acquire runs again (attempt 1,
/// new token) and the released token is dead.
pub async fn release_frees_key<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("release");
    let first = acquired(store.acquire(&key, Some(&fp("a")), LONG).await, "acquire");
    ok(store.release(&first).await, "release");
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "released key must be absent"
    );
    // Absent means no fingerprint either.
    let second = acquired(
        store.acquire(&key, Some(&fp("b")), LONG).await,
        "acquire after release",
    );
    assert_eq!(second.attempt, 1);
    assert_ne!(second.token, first.token);
    lease_lost(
        store.release(&first).await,
        "release with the released token",
    );
    lease_lost(
        store.complete(&first, b"x", DAY).await,
        "complete with the released token",
    );
    ok(store.complete(&second, b"y", DAY).await, "complete");
}

/// Completion ends the lease: a release or an extend with it gets
/// `LeaseLost`. Completing again with the same lease (a retry after a lost
/// reply) succeeds and changes nothing: the first response stays.
pub async fn complete_is_final<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("final");
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"first", DAY).await, "complete");
    ok(
        store.complete(&lease, b"second", DAY).await,
        "completing again with the same lease",
    );
    lease_lost(store.release(&lease).await, "release after complete");
    lease_lost(store.extend(&lease, LONG).await, "extend after complete");
    assert_eq!(
        completed_response(store.acquire(&key, None, LONG).await, "replay"),
        b"first"
    );
}

/// Tokens are never reused for a key: across releases, takeovers and
/// expiries, every acquisition gets a new one, and every older one is dead.
pub async fn token_never_reused<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("tokens");
    let mut seen: Vec<Lease> = Vec::new();
    let check_new = |lease: &Lease, seen: &mut Vec<Lease>| {
        assert!(
            seen.iter().all(|old| old.token != lease.token),
            "token {:?} reused",
            lease.token
        );
        seen.push(lease.clone());
    };
    for _ in 0..8 {
        let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
        check_new(&lease, &mut seen);
        ok(store.release(&lease).await, "release");
    }
    // Takeover.
    let lease = acquired(store.acquire(&key, None, short).await, "acquire");
    check_new(&lease, &mut seen);
    outlive(short).await;
    let lease = acquired(store.acquire(&key, None, LONG).await, "takeover");
    check_new(&lease, &mut seen);
    // Retention expiry.
    ok(store.complete(&lease, b"r", short).await, "complete");
    outlive(short).await;
    let lease = acquired(store.acquire(&key, None, LONG).await, "after expiry");
    check_new(&lease, &mut seen);
    let (current, stale) = seen.split_last().unwrap_or_else(|| panic!("no leases"));
    for old in stale {
        lease_lost(store.extend(old, LONG).await, "extend with an old token");
        lease_lost(
            store.complete(old, b"old", DAY).await,
            "complete with an old token",
        );
    }
    let unique: HashSet<_> = seen.iter().map(|l| l.token).collect();
    assert_eq!(unique.len(), seen.len());
    ok(
        store.complete(current, b"current", DAY).await,
        "current complete",
    );
}

/// A completed record is replayed until its retention ends, then the key is
/// absent: `get` finds nothing and `acquire` starts over at attempt 1,
/// without the old fingerprint.
pub async fn retention_expiry<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("retention");
    let lease = acquired(store.acquire(&key, Some(&fp("a")), LONG).await, "acquire");
    ok(store.complete(&lease, b"r", short).await, "complete");
    assert!(ok(store.get(&key).await, "get").is_some());
    outlive(short).await;
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "expired record returned as live"
    );
    let again = acquired(
        store.acquire(&key, Some(&fp("b")), LONG).await,
        "acquire after retention",
    );
    assert_eq!(again.attempt, 1);
    assert_ne!(again.token, lease.token);
}

/// `get` and `delete` of present and absent keys; a deleted in-progress key
/// fences its old holder.
pub async fn get_and_delete<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("delete");
    assert!(ok(store.get(&key).await, "get absent").is_none());
    assert!(!ok(store.delete(&key).await, "delete absent"));

    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    assert!(ok(store.delete(&key).await, "delete completed"));
    assert!(ok(store.get(&key).await, "get deleted").is_none());
    assert!(!ok(store.delete(&key).await, "delete twice"));

    let lease = acquired(
        store.acquire(&key, None, LONG).await,
        "acquire after delete",
    );
    assert_eq!(lease.attempt, 1);
    assert!(ok(store.delete(&key).await, "delete in progress"));
    lease_lost(
        store.complete(&lease, b"r", DAY).await,
        "complete after delete",
    );
}

/// `purge_expired(max)` removes at most `max` expired records per call and
/// never a live one; expired records are never returned, purged or not.
pub async fn purge_expired<H: Harness>(h: &H) {
    let settings = h.settings();
    let short = settings.lease;
    let store = h.store().await;
    let mut expiring = Vec::new();
    for i in 0..5 {
        let key = unique_key(&format!("purge-{i}"));
        let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
        ok(store.complete(&lease, b"r", short).await, "complete");
        expiring.push(key);
    }
    let kept = unique_key("purge-kept");
    let lease = acquired(store.acquire(&kept, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"kept", DAY).await, "complete");
    let busy = unique_key("purge-busy");
    acquired(store.acquire(&busy, None, LONG).await, "acquire");
    outlive(short).await;

    let mut total = 0;
    for _ in 0..1_000 {
        let removed = ok(store.purge_expired(2).await, "purge");
        assert!(removed <= 2, "purge_expired(2) removed {removed}");
        total += removed;
        if removed == 0 {
            break;
        }
    }
    if settings.purge_reports_removed {
        assert!(total >= 5, "purge removed {total} records, 5 had expired");
    }
    for key in &expiring {
        assert!(
            ok(store.get(key).await, "get expired").is_none(),
            "{key} returned after expiry"
        );
    }
    assert_eq!(
        completed_response(store.acquire(&kept, None, LONG).await, "kept"),
        b"kept"
    );
    let got = store.acquire(&busy, None, LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::InProgress { .. })),
        "busy: {got:?}"
    );
}

/// A record that does not decode is reported as `Corrupt` naming its key by
/// `get` and `acquire`, never treated as absent; other keys work; `delete`
/// clears it.
pub async fn corrupt_record<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("corrupt");
    let other = unique_key("corrupt-neighbour");
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    h.corrupt(&store, &key).await;

    match store.get(&key).await {
        Err(StoreError::Corrupt { key: k, .. }) => assert_eq!(k, key),
        other => panic!("get of a corrupt record: expected Corrupt, got {other:?}"),
    }
    match store.acquire(&key, None, LONG).await {
        Err(e @ StoreError::Corrupt { .. }) => assert!(!e.is_retryable()),
        other => panic!("acquire of a corrupt record: expected Corrupt, got {other:?}"),
    }
    let lease = acquired(store.acquire(&other, None, LONG).await, "neighbour acquire");
    ok(
        store.complete(&lease, b"fine", DAY).await,
        "neighbour complete",
    );

    assert!(ok(store.delete(&key).await, "delete corrupt"));
    acquired(
        store.acquire(&key, None, LONG).await,
        "acquire after delete",
    );
}

/// Keys at the length limits, with the characters allowed, round trip; keys
/// that differ only by scope are independent; bad keys are refused before
/// reaching the store.
pub async fn key_limits<H: Harness>(h: &H) {
    let store = h.store().await;
    let tag = format!("{:08x}", fastrand::u32(..));
    let long_scope = format!("{tag}.{}", "s".repeat(64 - tag.len() - 1));
    // 512 bytes: a 2-byte character, a 4-byte one, and ASCII punctuation.
    let mut long_id = format!("{tag}é🦀/%:{{}}\"' \\");
    long_id.push_str(&"x".repeat(512 - long_id.len()));
    let keys = [
        IdempotencyKey::new(long_scope.clone(), long_id.clone()),
        IdempotencyKey::new("A-z_0.9:x", format!("{tag}-id")),
        IdempotencyKey::composite("idem.conformance", [tag.as_str(), "a/b", "100%"]),
        IdempotencyKey::new("idem.conformance.other", long_id.clone()),
    ];
    for (i, key) in keys.into_iter().enumerate() {
        let key = key.unwrap_or_else(|e| panic!("key {i} should be valid: {e}"));
        let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
        ok(
            store
                .complete(&lease, format!("r{i}").as_bytes(), DAY)
                .await,
            "complete",
        );
        assert_eq!(
            completed_response(store.acquire(&key, None, LONG).await, "replay"),
            format!("r{i}").as_bytes()
        );
        let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record {i} gone"));
        assert_eq!(record.key, key, "the key round trips exactly");
    }
    let bad: [Result<IdempotencyKey, KeyError>; 6] = [
        IdempotencyKey::new("", "x"),
        IdempotencyKey::new("s".repeat(65), "x"),
        IdempotencyKey::new("with space", "x"),
        IdempotencyKey::new("s", ""),
        IdempotencyKey::new("s", "x".repeat(513)),
        IdempotencyKey::new("s", "tab\there"),
    ];
    for (i, result) in bad.into_iter().enumerate() {
        assert!(result.is_err(), "bad key {i} was accepted");
    }
}

/// A 1 MiB response with every byte value round trips exactly.
pub async fn large_response<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("large");
    let response: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, &response, DAY).await, "complete");
    let replayed = completed_response(store.acquire(&key, None, LONG).await, "replay");
    assert!(replayed == response, "large response changed in the store");
}

/// The storm: `storm_tasks` tasks (64) each deliver every one of
/// `storm_keys` keys (500) through [`Idempotency::process`], in their own
/// random order. Exactly one handler execution per key; every other call a
/// replay of that execution's value.
pub async fn concurrent_storm<H: Harness>(h: &H) {
    let settings = h.settings();
    let idem = storm_executor(h.store().await);
    storm(&[idem], settings.storm_tasks, settings.storm_keys).await;
}

/// The executor settings the storm uses: a long lease, and waiting (with
/// short polls) for keys another task is running.
pub fn storm_executor<S: IdempotencyStore>(store: S) -> Idempotency<S> {
    Idempotency::new(store)
        .lease(LONG)
        .retention(DAY)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(60),
            poll: Duration::from_millis(2),
        })
}

/// Runs the storm over several executors (say one per connection pool, as
/// separate processes would have): `tasks` tasks, spread round-robin over
/// `executors`, each deliver all `key_count` keys in their own random order.
/// Panics unless every key ran exactly once and every other call replayed
/// that run's value. Returns the number of calls made.
pub async fn storm<S: IdempotencyStore + ?Sized>(
    executors: &[Idempotency<S>],
    tasks: usize,
    key_count: usize,
) -> usize {
    assert!(!executors.is_empty(), "storm needs at least one executor");
    let run = format!("{:016x}", fastrand::u64(..));
    let keys: Arc<Vec<IdempotencyKey>> = Arc::new(
        (0..key_count)
            .map(
                |i| match IdempotencyKey::new("idem.conformance.storm", format!("{run}-{i}")) {
                    Ok(k) => k,
                    Err(e) => panic!("{e}"),
                },
            )
            .collect(),
    );
    let executions: Arc<Vec<AtomicU32>> =
        Arc::new((0..key_count).map(|_| AtomicU32::new(0)).collect());

    let mut handles = Vec::with_capacity(tasks);
    for t in 0..tasks {
        let idem = executors[t % executors.len()].clone();
        let keys = keys.clone();
        let executions = executions.clone();
        handles.push(tokio::spawn(async move {
            let mut order: Vec<usize> = (0..keys.len()).collect();
            fastrand::Rng::with_seed(t as u64).shuffle(&mut order);
            let mut seen = Vec::with_capacity(order.len());
            for i in order {
                let executions = executions.clone();
                let outcome = idem
                    .process(&keys[i], i as u64, |i| async move {
                        executions[i as usize].fetch_add(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        // A value only this execution knows: replays must carry it.
                        Ok::<_, Infallible>(format!("{i}:{:016x}", fastrand::u64(..)))
                    })
                    .await;
                match outcome {
                    Ok(p) => seen.push((i, p)),
                    Err(e) => return Err(format!("key {i}: {e:?}")),
                }
            }
            Ok::<_, String>(seen)
        }));
    }

    let mut executed: Vec<Option<String>> = vec![None; key_count];
    let mut replays: Vec<(usize, String)> = Vec::new();
    for handle in handles {
        let seen = match handle.await {
            Ok(Ok(seen)) => seen,
            Ok(Err(e)) => panic!("storm call failed: {e}"),
            Err(e) => panic!("storm task failed: {e}"),
        };
        for (i, p) in seen {
            match p {
                Processed::Executed(v) => {
                    assert!(executed[i].is_none(), "key {i} reported executed twice");
                    executed[i] = Some(v);
                }
                Processed::Replayed(v) => replays.push((i, v)),
                Processed::ExecutedNotReplayable { reason, .. } => {
                    panic!("key {i}: a string result was not recordable: {reason}")
                }
            }
        }
    }
    let total: u32 = executions.iter().map(|e| e.load(Ordering::SeqCst)).sum();
    for (i, e) in executions.iter().enumerate() {
        assert_eq!(
            e.load(Ordering::SeqCst),
            1,
            "key {i} ran {} times",
            e.load(Ordering::SeqCst)
        );
    }
    assert_eq!(total as usize, key_count);
    assert_eq!(replays.len(), tasks * key_count - key_count);
    for (i, v) in replays {
        assert_eq!(
            Some(&v),
            executed[i].as_ref(),
            "key {i}: replay differs from the execution"
        );
    }
    tasks * key_count
}

/// The fence of a key's acquisitions strictly increases across everything
/// that can happen to its record: a release, a takeover, a delete, the
/// record's expiry; `extend` and `get` keep it.
pub async fn fence_strictly_increases<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let key = unique_key("fence");
    let mut seen: Vec<(&str, u64)> = Vec::new();
    let mut check = |what: &'static str, fence: u64| {
        if let Some((before, last)) = seen.last() {
            assert!(
                fence > *last,
                "fence after {what} ({fence}) is not above the one after {before} ({last})"
            );
        }
        seen.push((what, fence));
    };

    let first = acquired(store.acquire(&key, None, LONG).await, "first acquire");
    check("first acquire", first.fence);
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("no record"));
    assert_eq!(record.fence, first.fence, "get returns the holder's fence");
    let extended = ok(store.extend(&first, LONG).await, "extend");
    assert_eq!(extended.fence, first.fence, "extend keeps the fence");
    ok(store.release(&first).await, "release");

    let after_release = acquired(store.acquire(&key, None, short).await, "after release");
    check("release", after_release.fence);
    outlive(short).await;
    let takeover = acquired(store.acquire(&key, None, LONG).await, "takeover");
    assert_eq!(takeover.attempt, 2, "a takeover is attempt 2");
    check("takeover", takeover.fence);
    lease_lost(
        store.complete(&after_release, b"stale", DAY).await,
        "stale complete",
    );
    ok(store.complete(&takeover, b"done", DAY).await, "complete");
    match store.acquire(&key, None, LONG).await {
        Ok(Acquisition::Completed(record)) => assert_eq!(
            record.fence, takeover.fence,
            "a completed record carries the fence of the acquisition that completed it"
        ),
        other => panic!("expected Completed, got {other:?}"),
    }
    assert!(
        ok(store.delete(&key).await, "delete"),
        "delete found the record"
    );

    let after_delete = acquired(store.acquire(&key, None, short).await, "after delete");
    assert_eq!(after_delete.attempt, 1, "attempt resets after a delete");
    check("delete", after_delete.fence);
    ok(
        store.complete(&after_delete, b"done", short).await,
        "complete",
    );
    outlive(short).await;
    let after_expiry = acquired(store.acquire(&key, None, LONG).await, "after expiry");
    assert_eq!(after_expiry.attempt, 1, "attempt resets after expiry");
    check("retention expiry", after_expiry.fence);
}

/// A completed record handed out by `acquire` carries its fence and the
/// time it has left by the store's clock, no more than its retention.
pub async fn completed_record_carries_fence_and_store_ttl<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("ttl");
    let retention = Duration::from_secs(3_600);
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", retention).await, "complete");
    match store.acquire(&key, None, LONG).await {
        Ok(Acquisition::Completed(record)) => {
            assert_eq!(record.fence, lease.fence);
            assert!(
                record.ttl <= retention && record.ttl + Duration::from_secs(5) >= retention,
                "ttl {:?} for a retention of {retention:?}",
                record.ttl
            );
        }
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// A zero lease is refused with `InvalidArgument` and writes nothing;
/// extending by zero is refused too and leaves the lease as it was.
pub async fn zero_lease_refused<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("zero");
    let refused = store.acquire(&key, None, Duration::ZERO).await;
    assert!(
        matches!(refused, Err(StoreError::InvalidArgument { .. })),
        "zero lease: {refused:?}"
    );
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "a refused acquire wrote a record"
    );
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    let refused = store.extend(&lease, Duration::ZERO).await;
    assert!(
        matches!(refused, Err(StoreError::InvalidArgument { .. })),
        "zero extend: {refused:?}"
    );
    assert!(
        matches!(
            store.acquire(&key, None, LONG).await,
            Ok(Acquisition::InProgress { .. })
        ),
        "the lease still holds after a refused extend"
    );
}

/// `Duration::MAX` as a lease, an extension or a retention is accepted
/// (saturated to `MAX_DURATION`), never an error, a panic or a half-written
/// record: the key is held, then completed and replayed.
pub async fn durations_at_the_extremes<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("max");
    let lease = acquired(
        store.acquire(&key, Some(&fp("m")), Duration::MAX).await,
        "acquire with Duration::MAX",
    );
    let far = SystemTime::now() + saturate(Duration::MAX) - DAY;
    assert!(
        lease.expires_at > far,
        "lease of Duration::MAX ends {:?}",
        lease.expires_at
    );
    assert!(
        matches!(
            store.acquire(&key, Some(&fp("m")), LONG).await,
            Ok(Acquisition::InProgress { .. })
        ),
        "a Duration::MAX lease holds the key"
    );
    let lease = ok(
        store.extend(&lease, Duration::MAX).await,
        "extend Duration::MAX",
    );
    ok(
        store.complete(&lease, b"forever", Duration::MAX).await,
        "complete with Duration::MAX",
    );
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("no record"));
    assert!(record.is_completed(), "{record:?}");
    assert!(
        record.expires_at > far,
        "retention of Duration::MAX ends {:?}",
        record.expires_at
    );
    assert_eq!(
        completed_response(store.acquire(&key, Some(&fp("m")), LONG).await, "replay"),
        b"forever"
    );
    // Executor-level: the same extremes through `process`.
    let idem = Idempotency::from_arc(Arc::new(store))
        .lease(Duration::MAX)
        .retention(Duration::MAX)
        .complete_retry(Duration::MAX)
        .heartbeat_interval(Duration::MAX)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::MAX,
            poll: Duration::MAX,
        });
    let key = unique_key("max-process");
    let first = idem
        .process(&key, 1u8, |_| async { Ok::<_, Infallible>(7u8) })
        .await;
    assert!(matches!(first, Ok(Processed::Executed(7))), "{first:?}");
    let again = idem
        .process(&key, 1u8, |_| async { Ok::<_, Infallible>(8u8) })
        .await;
    assert!(matches!(again, Ok(Processed::Replayed(7))), "{again:?}");
}

/// `acquire_many`, unwrapping the outer result: one result per item.
async fn acquire_batch<S: IdempotencyStore + ?Sized>(
    store: &S,
    items: &[(&IdempotencyKey, Option<&Fingerprint>)],
    lease: Duration,
    what: &str,
) -> Vec<Result<Acquisition, StoreError>> {
    let items: Vec<AcquireItem<'_>> = items
        .iter()
        .map(|(key, fingerprint)| AcquireItem::new(key, *fingerprint))
        .collect();
    let got = ok(store.acquire_many(&items, lease).await, what);
    assert_eq!(
        got.len(),
        items.len(),
        "{what}: {} results for {} items",
        got.len(),
        items.len()
    );
    got
}

/// One `acquire_many` meets every state at once, each item answered as
/// its own `acquire` would be: a fresh key is acquired, a completed one
/// replayed (with or without a fingerprint), a held one in progress, a
/// completed one with another payload a mismatch, one whose lease is over
/// taken over (attempt 2), and a corrupt record is that item's own
/// `Corrupt` error, the others unharmed.
pub async fn batch_mixed_outcomes<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    let fresh = unique_key("batch-fresh");
    let done = unique_key("batch-done");
    let busy = unique_key("batch-busy");
    let stale = unique_key("batch-stale");
    let broken = unique_key("batch-corrupt");

    let lease = acquired(store.acquire(&done, Some(&fp("a")), LONG).await, "acquire");
    ok(store.complete(&lease, b"done", DAY).await, "complete");
    let held = acquired(store.acquire(&busy, Some(&fp("a")), LONG).await, "acquire");
    let old = acquired(
        store.acquire(&stale, Some(&fp("a")), short).await,
        "acquire",
    );
    let lease = acquired(store.acquire(&broken, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    h.corrupt(&store, &broken).await;
    outlive(short).await;

    let got = acquire_batch(
        &store,
        &[
            (&fresh, Some(&fp("x"))),
            (&done, Some(&fp("a"))),
            (&busy, Some(&fp("a"))),
            (&done, Some(&fp("b"))),
            (&broken, None),
            (&stale, Some(&fp("a"))),
            (&done, None),
        ],
        LONG,
        "mixed batch",
    )
    .await;
    let mut got = got.into_iter();
    let mut next = || got.next().unwrap_or_else(|| panic!("missing result"));
    let new = acquired(next(), "fresh item");
    assert_eq!(new.key, fresh);
    assert_eq!(new.attempt, 1);
    assert_eq!(new.fingerprint, Some(fp("x")));
    match next() {
        Ok(Acquisition::Completed(record)) => {
            assert_eq!(record.key, done);
            assert_eq!(&record.response[..], b"done");
            assert_eq!(record.fingerprint, Some(fp("a")));
        }
        other => panic!("completed item: expected Completed, got {other:?}"),
    }
    match next() {
        Ok(Acquisition::InProgress {
            lease_expires_at,
            attempt,
            ..
        }) => {
            assert_eq!(attempt, 1);
            assert!(
                close(lease_expires_at, held.expires_at, Duration::from_millis(2)),
                "in-progress item: deadline {lease_expires_at:?}, holder's {:?}",
                held.expires_at
            );
        }
        other => panic!("held item: expected InProgress, got {other:?}"),
    }
    let got_mismatch = next();
    assert!(
        matches!(got_mismatch, Ok(Acquisition::Mismatch)),
        "other payload: {got_mismatch:?}"
    );
    match next() {
        Err(StoreError::Corrupt { key, .. }) => assert_eq!(key, broken),
        other => panic!("corrupt item: expected Corrupt, got {other:?}"),
    }
    let taken = acquired(next(), "lease over");
    assert_eq!(taken.attempt, 2, "a takeover in a batch is attempt 2");
    assert_ne!(taken.token, old.token);
    assert!(taken.fence > old.fence);
    assert_eq!(
        completed_response(next(), "completed item without fingerprint"),
        b"done"
    );

    // The leases of a batch work like any other.
    lease_lost(store.complete(&old, b"zombie", DAY).await, "stale complete");
    ok(store.complete(&new, b"new", DAY).await, "complete");
    ok(store.complete(&taken, b"taken", DAY).await, "complete");
    assert_eq!(
        completed_response(store.acquire(&fresh, None, LONG).await, "replay"),
        b"new"
    );
    assert_eq!(
        completed_response(store.acquire(&stale, None, LONG).await, "replay"),
        b"taken"
    );
    let record = ok(store.get(&busy).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, held.token, "asking did not change the holder");
}

/// A key that appears several times in one batch is answered as calling
/// `acquire` on each item in order: the first acquires, the later ones see
/// it held (in progress, attempt 1) or, with another fingerprint, a
/// mismatch; a key repeated 100 times is acquired once. Completing twice
/// with one lease in one `complete_many` keeps the first response.
pub async fn batch_duplicate_keys_in_one_batch<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("batch-dup");
    let other = unique_key("batch-dup-other");
    let got = acquire_batch(
        &store,
        &[
            (&key, Some(&fp("a"))),
            (&key, Some(&fp("a"))),
            (&key, Some(&fp("b"))),
            (&other, None),
            (&key, None),
        ],
        LONG,
        "batch with a repeated key",
    )
    .await;
    let mut got = got.into_iter();
    let mut next = || got.next().unwrap_or_else(|| panic!("missing result"));
    let first = acquired(next(), "first of the key");
    for (i, expect_mismatch) in [(1, false), (2, true)] {
        let outcome = next();
        if expect_mismatch {
            assert!(
                matches!(outcome, Ok(Acquisition::Mismatch)),
                "item {i}: {outcome:?}"
            );
        } else {
            match outcome {
                Ok(Acquisition::InProgress {
                    lease_expires_at,
                    attempt: 1,
                    ..
                }) => assert!(
                    close(lease_expires_at, first.expires_at, Duration::from_millis(2)),
                    "item {i}: held until {lease_expires_at:?}, the first lease until {:?}",
                    first.expires_at
                ),
                other => panic!("item {i}: expected InProgress held by item 0, got {other:?}"),
            }
        }
    }
    let other_lease = acquired(next(), "the other key");
    assert!(
        matches!(next(), Ok(Acquisition::InProgress { attempt: 1, .. })),
        "the key again, without a fingerprint"
    );
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, first.token, "later items did not take over");
    assert_eq!(record.fingerprint, Some(fp("a")));

    // One lease twice in one complete_many: the first response stays.
    let done = ok(
        store
            .complete_many(
                &[
                    (&first, b"one".as_slice()),
                    (&other_lease, b"other".as_slice()),
                    (&first, b"two".as_slice()),
                ],
                DAY,
            )
            .await,
        "complete_many",
    );
    assert_eq!(done.len(), 3);
    for (i, one) in done.into_iter().enumerate() {
        ok(one, &format!("completion {i}"));
    }
    assert_eq!(
        completed_response(store.acquire(&key, None, LONG).await, "replay"),
        b"one"
    );

    // A completed key twice, and a key repeated 100 times.
    let got = acquire_batch(
        &store,
        &[(&key, Some(&fp("a"))), (&key, Some(&fp("a")))],
        LONG,
        "completed key twice",
    )
    .await;
    for outcome in got {
        assert_eq!(completed_response(outcome, "completed key twice"), b"one");
    }
    let hot = unique_key("batch-hot");
    let hot_print = fp("h");
    let items: Vec<_> = (0..100).map(|_| (&hot, Some(&hot_print))).collect();
    let got = acquire_batch(&store, &items, LONG, "a key 100 times").await;
    let mut got = got.into_iter();
    let lease = acquired(
        got.next().unwrap_or_else(|| panic!("no result")),
        "first of 100",
    );
    for (i, outcome) in got.enumerate() {
        assert!(
            matches!(outcome, Ok(Acquisition::InProgress { attempt: 1, .. })),
            "copy {}: {outcome:?}",
            i + 1
        );
    }
    ok(store.complete(&lease, b"hot", DAY).await, "complete");
}

/// `complete_many` completes every item whose lease holds and answers
/// `LeaseLost` for a stale one (its key released and acquired again), in
/// the items' order, without touching the new holder's record.
pub async fn batch_complete_many<H: Harness>(h: &H) {
    let store = h.store().await;
    let keys: Vec<IdempotencyKey> = (0..3)
        .map(|i| unique_key(&format!("batch-complete-{i}")))
        .collect();
    let mut leases: Vec<Lease> = Vec::new();
    for key in &keys {
        leases.push(acquired(store.acquire(key, None, LONG).await, "acquire"));
    }
    // The middle lease goes stale: released, and the key acquired again.
    ok(store.release(&leases[1]).await, "release");
    let owner = acquired(
        store.acquire(&keys[1], None, LONG).await,
        "acquire after release",
    );
    let done = ok(
        store
            .complete_many(
                &[
                    (&leases[0], b"r0".as_slice()),
                    (&leases[1], b"stale".as_slice()),
                    (&leases[2], b"r2".as_slice()),
                ],
                DAY,
            )
            .await,
        "complete_many",
    );
    assert_eq!(done.len(), 3);
    let mut done = done.into_iter();
    ok(done.next().unwrap_or(Ok(())), "item 0");
    lease_lost(done.next().unwrap_or(Ok(())), "the stale item");
    ok(done.next().unwrap_or(Ok(())), "item 2");
    assert_eq!(
        completed_response(store.acquire(&keys[0], None, LONG).await, "replay 0"),
        b"r0"
    );
    assert_eq!(
        completed_response(store.acquire(&keys[2], None, LONG).await, "replay 2"),
        b"r2"
    );
    let record = ok(store.get(&keys[1]).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, owner.token);
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "the new holder's record was completed by a stale lease"
    );
    ok(
        store.complete(&owner, b"owner", DAY).await,
        "owner completes",
    );
}

/// Empty batches answer empty lists; a zero lease is refused with
/// `InvalidArgument` before anything is written.
pub async fn batch_empty<H: Harness>(h: &H) {
    let store = h.store().await;
    let got = ok(store.acquire_many(&[], LONG).await, "empty acquire_many");
    assert!(got.is_empty(), "{got:?}");
    let got = ok(store.complete_many(&[], DAY).await, "empty complete_many");
    assert!(got.is_empty(), "{got:?}");
    let key = unique_key("batch-zero");
    let refused = store
        .acquire_many(&[AcquireItem::new(&key, None)], Duration::ZERO)
        .await;
    assert!(
        matches!(refused, Err(StoreError::InvalidArgument { .. })),
        "zero lease: {refused:?}"
    );
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "a refused batch wrote a record"
    );
}

/// 1,000 keys in one batch: every result is its own item's, in order
/// (each key completed with a response naming it, then replayed in a
/// shuffled batch).
pub async fn batch_order_kept<H: Harness>(h: &H) {
    let store = h.store().await;
    let run = format!("{:016x}", fastrand::u64(..));
    let keys: Vec<IdempotencyKey> = (0..1_000)
        .map(
            |i| match IdempotencyKey::new("idem.conformance.batch", format!("{run}-{i}")) {
                Ok(k) => k,
                Err(e) => panic!("{e}"),
            },
        )
        .collect();
    let prints: Vec<Fingerprint> = (0..keys.len()).map(|i| fp(&i.to_string())).collect();
    let items: Vec<_> = keys
        .iter()
        .zip(&prints)
        .map(|(k, f)| (k, Some(f)))
        .collect();
    let got = acquire_batch(&store, &items, LONG, "1,000 fresh keys").await;
    let leases: Vec<Lease> = got
        .into_iter()
        .enumerate()
        .map(|(i, outcome)| {
            let lease = acquired(outcome, &format!("key {i}"));
            assert_eq!(lease.key, keys[i], "result {i} is another item's");
            assert_eq!(lease.fingerprint, Some(prints[i]));
            lease
        })
        .collect();
    let responses: Vec<Vec<u8>> = keys.iter().map(|k| k.id().as_bytes().to_vec()).collect();
    let completions: Vec<(&Lease, &[u8])> = leases
        .iter()
        .zip(&responses)
        .map(|(l, r)| (l, r.as_slice()))
        .collect();
    let done = ok(
        store.complete_many(&completions, DAY).await,
        "complete_many",
    );
    assert_eq!(done.len(), keys.len());
    for (i, one) in done.into_iter().enumerate() {
        ok(one, &format!("completion {i}"));
    }
    let mut order: Vec<usize> = (0..keys.len()).collect();
    fastrand::shuffle(&mut order);
    let items: Vec<_> = order
        .iter()
        .map(|&i| (&keys[i], Some(&prints[i])))
        .collect();
    let got = acquire_batch(&store, &items, LONG, "1,000 replays").await;
    for (&i, outcome) in order.iter().zip(got) {
        assert_eq!(
            completed_response(outcome, &format!("replay of key {i}")),
            responses[i],
            "replay of key {i} carries another item's response"
        );
    }
}

/// `Idempotency::process_batch` on this store: one item's handler fails
/// and its key is released; every other item is recorded (one of them a
/// second delivery of a key in the same batch, which replays); a retry of
/// the batch runs the failed item only.
pub async fn batch_process_one_handler_fails<H: Harness>(h: &H) {
    #[derive(Debug)]
    struct Declined;
    let store = Arc::new(h.store().await);
    let idem = Idempotency::from_arc(store.clone())
        .lease(LONG)
        .retention(DAY);
    let keys: Vec<IdempotencyKey> = (0..4)
        .map(|i| unique_key(&format!("batch-process-{i}")))
        .collect();
    let items = |keys: &[IdempotencyKey]| -> Vec<(IdempotencyKey, u64)> {
        let mut items: Vec<_> = keys.iter().cloned().zip(0u64..).collect();
        items.push((keys[0].clone(), 0));
        items
    };
    let runs = Arc::new(AtomicU32::new(0));
    let out = idem
        .process_batch(items(&keys), |n| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                if n == 2 {
                    Err(Declined)
                } else {
                    Ok(format!("done {n}"))
                }
            }
        })
        .await;
    assert_eq!(out.len(), 5);
    for (i, outcome) in out.iter().enumerate() {
        match (i, outcome) {
            (2, Err(IdemError::Handler(Declined))) => {}
            (4, Ok(Processed::Replayed(v))) => assert_eq!(v, "done 0"),
            (i, Ok(Processed::Executed(v))) if i < 4 => assert_eq!(v, &format!("done {i}")),
            other => panic!("batch item {}: {:?}", other.0, other.1),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4, "the repeated key ran once");
    for (i, key) in keys.iter().enumerate() {
        let record = ok(store.get(key).await, "get");
        match (i, record) {
            (2, None) => {}
            (i, Some(r)) if i != 2 => assert!(r.is_completed(), "key {i}: {r:?}"),
            (i, other) => panic!("key {i}: {other:?}"),
        }
    }
    let retry = idem
        .process_batch(items(&keys), |n| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Declined>(format!("retried {n}"))
            }
        })
        .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        5,
        "only the failed item ran again"
    );
    for (i, outcome) in retry.iter().enumerate() {
        let expected = match i {
            2 => Processed::Executed("retried 2".to_owned()),
            4 => Processed::Replayed("done 0".to_owned()),
            i => Processed::Replayed(format!("done {i}")),
        };
        assert_eq!(outcome.as_ref().ok(), Some(&expected), "retry item {i}");
    }
}
