//! PostgreSQL backend for idem (sqlx), with an in-transaction mode.
//!
//! Not built yet: this crate is a placeholder so that the workspace layout
//! and the facade feature `postgres` exist from the start. The store lands
//! with the idem-postgres issue; until then use [`idem_core::MemoryStore`].
#![deny(missing_docs)]

pub use idem_core::IdempotencyStore;
