//! The stores against real servers: the conformance suite on every
//! backend, what each backend adds (round trips, bad records, outages,
//! the in-transaction mode), the operator reads, keys from content
//! checked against another RFC 8785 implementation, and the Grafana
//! dashboard's queries against the metrics example's `/metrics`.
//!
//! One test binary (the heavy dependencies link once); each module is an
//! area, gated by the facade features it needs. `cargo test --all-features
//! --test stores` runs it all; servers are started by `tests/support` on
//! free loopback ports unless the `IDEM_*` variables name running ones.

#[path = "../support/mod.rs"]
mod support;

mod canonical;
mod memory;

#[cfg(all(feature = "postgres", feature = "redis", feature = "tiered"))]
mod batching;
#[cfg(feature = "dynamodb")]
mod dynamodb;
#[cfg(all(feature = "http", feature = "postgres", feature = "tiered"))]
mod metrics_export;
#[cfg(feature = "postgres")]
mod migrate_log;
#[cfg(feature = "tiered")]
mod moka_weight;
#[cfg(all(feature = "postgres", feature = "redis"))]
mod operator;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redis_batch_answers;
#[cfg(feature = "redis")]
mod redis_batch_faults;
#[cfg(all(feature = "tiered", feature = "postgres", feature = "redis"))]
mod tiered;
#[cfg(feature = "postgres")]
mod transactions;
