//! Redis failover: a Redis Cluster master killed and its replica promoted
//! under a redelivery storm (`storm`), the cluster connection healer
//! (`healer`), and the refusals of a replica or of a master without
//! replicas (`replicas`).
//!
//! `cargo test --all-features --test faults failover::redis -- --nocapture`

use idemkit::IdempotencyKey;

mod healer;
mod replicas;
mod storm;

/// A fresh key in `scope`.
fn key(scope: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope, format!("{:016x}", fastrand::u64(..)))
        .unwrap_or_else(|e| panic!("{e}"))
}
