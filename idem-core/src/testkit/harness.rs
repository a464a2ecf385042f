//! What a store gives the suite: a [`Harness`] that makes stores and
//! corrupts records, and the [`Settings`] that differ between stores.

use std::time::Duration;

use async_trait::async_trait;

use crate::{IdempotencyKey, IdempotencyStore, MemoryStore};

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
