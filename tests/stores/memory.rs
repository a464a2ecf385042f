//! The conformance suite on `MemoryStore`, with tokio time paused so the
//! lease and retention waits take no real time.

use idemkit::testkit::{self, MemoryHarness};

idemkit::conformance_tests!(MemoryHarness, paused);

/// `run_all` is the entry a third-party store can call; it must cover the
/// same cases as the macro.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn run_all_on_memory() {
    testkit::run_all(&MemoryHarness).await;
    assert_eq!(testkit::CASES.len(), 29);
}

/// The same suite on real time, multi-threaded, so that the store is also
/// exercised with tasks racing on two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_on_memory_real_time() {
    testkit::run_all(&MemoryHarness).await;
}

/// The suite on a store that implements only the required methods, so
/// that its batch operations are the trait's default loops: what a
/// third-party store gets without writing its own.
mod default_batch_operations {
    use std::time::Duration;

    use idemkit::testkit::Harness;
    use idemkit::{
        async_trait, Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease,
        MemoryStore, Record, StoreError,
    };

    pub(super) struct Plain(MemoryStore);

    #[async_trait]
    impl IdempotencyStore for Plain {
        async fn acquire(
            &self,
            key: &IdempotencyKey,
            fingerprint: Option<&Fingerprint>,
            lease: Duration,
        ) -> Result<Acquisition, StoreError> {
            self.0.acquire(key, fingerprint, lease).await
        }
        async fn complete(
            &self,
            lease: &Lease,
            response: &[u8],
            retention: Duration,
        ) -> Result<(), StoreError> {
            self.0.complete(lease, response, retention).await
        }
        async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
            self.0.release(lease).await
        }
        async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
            self.0.extend(lease, lease_for).await
        }
        async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
            self.0.get(key).await
        }
        async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
            self.0.delete(key).await
        }
        async fn purge_expired(&self, max: usize) -> Result<u64, StoreError> {
            self.0.purge_expired(max).await
        }
    }

    pub(super) struct PlainHarness;

    #[async_trait]
    impl Harness for PlainHarness {
        type Store = Plain;
        async fn store(&self) -> Plain {
            Plain(MemoryStore::new())
        }
        async fn corrupt(&self, store: &Plain, key: &IdempotencyKey) {
            store.0.corrupt_for_tests(key);
        }
    }

    idemkit::conformance_tests!(PlainHarness, paused);
}
