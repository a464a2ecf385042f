//! Failover under load: a PostgreSQL primary killed and its standby
//! promoted, a Redis Cluster master killed and its replica promoted.

#[cfg(all(feature = "postgres", feature = "tiered", feature = "redis"))]
mod postgres;
mod redis;
