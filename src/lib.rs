#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

pub use idem_core::*;

/// The Redis and Redis Cluster store (feature `redis`).
#[cfg(feature = "redis")]
pub use idem_redis as redis;

/// The PostgreSQL store (feature `postgres`).
#[cfg(feature = "postgres")]
pub use idem_postgres as postgres;

/// The tiered store (feature `tiered`).
#[cfg(feature = "tiered")]
pub use idem_tiered as tiered;

/// The `Idempotency-Key` layer for tower and axum (feature `http`).
#[cfg(feature = "http")]
pub use idem_http as http;
