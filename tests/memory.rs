//! The conformance suite on `MemoryStore`, with tokio time paused so the
//! lease and retention waits take no real time.

use idem::testkit::{self, MemoryHarness};

idem::conformance_tests!(MemoryHarness, paused);

/// `run_all` is the entry a third-party store can call; it must cover the
/// same cases as the macro.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn run_all_on_memory() {
    testkit::run_all(&MemoryHarness).await;
    assert_eq!(testkit::CASES.len(), 23);
}

/// The same suite on real time, multi-threaded, so that the store is also
/// exercised with tasks racing on two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_on_memory_real_time() {
    testkit::run_all(&MemoryHarness).await;
}
