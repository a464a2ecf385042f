//! Redis and Redis Cluster backend for idem.
//!
//! Not built yet: this crate is a placeholder so that the workspace layout
//! and the facade feature `redis` exist from the start. The store lands with
//! the idem-redis issue; until then use [`idem_core::MemoryStore`].
#![deny(missing_docs)]

pub use idem_core::IdempotencyStore;
