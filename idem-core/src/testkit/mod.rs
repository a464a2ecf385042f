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

mod basics;
mod batch;
mod expiry;
mod harness;
mod leases;
mod limits;
mod storm;
mod tap;

pub use basics::{duplicate_replay, fingerprint_optional, fresh_acquire, in_progress, mismatch};
pub use batch::{
    batch_complete_many, batch_duplicate_keys_in_one_batch, batch_empty, batch_mixed_outcomes,
    batch_order_kept, batch_process_one_handler_fails,
};
pub use expiry::{
    completed_record_carries_fence_and_store_ttl, get_and_delete, purge_expired, retention_expiry,
};
pub use harness::{Harness, MemoryHarness, Settings};
pub use leases::{
    complete_is_final, expired_lease_still_owned_until_takeover, extend_renews_lease,
    fence_strictly_increases, lease_takeover_fencing, release_frees_key, token_never_reused,
};
pub use limits::{
    corrupt_record, durations_at_the_extremes, key_limits, large_response, zero_lease_refused,
};
pub use storm::{concurrent_acquire_single_winner, concurrent_storm, storm, storm_executor};
pub use tap::Tap;

use std::time::{Duration, SystemTime};

use crate::{Acquisition, Fingerprint, IdempotencyKey, Lease, StoreError};
#[cfg(doc)]
use crate::{IdempotencyStore, MemoryStore};

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
