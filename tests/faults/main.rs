//! Faults and the edges of the guarantee on real servers: redelivery
//! storms with crashed and zombie workers, server outages, network faults
//! in a namespace, failover of PostgreSQL and Redis Cluster, and access
//! (TLS, passwords, ACLs); and the watchdogs that stop the test servers.
//!
//! One test binary; each module is an area, gated by the facade features
//! it needs (`cargo test --all-features --test faults`).

#[path = "../support/mod.rs"]
mod support;

#[cfg(all(feature = "redis-tls", feature = "postgres-tls"))]
mod access;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod failover;
#[cfg(all(feature = "postgres", feature = "redis"))]
mod network;
#[cfg(all(feature = "tiered", feature = "postgres", feature = "redis"))]
mod storms;
mod test_servers;
