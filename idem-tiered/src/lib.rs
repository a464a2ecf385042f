//! Tiered backend for idem: an in-process cache, then Redis, then a source
//! of truth, filling the faster tiers on completed-key hits.
//!
//! Not built yet: this crate is a placeholder so that the workspace layout
//! and the facade feature `tiered` exist from the start. The store lands
//! with the idem-tiered issue; until then use [`idem_core::MemoryStore`].
#![deny(missing_docs)]

pub use idem_core::IdempotencyStore;
