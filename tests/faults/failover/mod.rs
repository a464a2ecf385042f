//! Failover: a PostgreSQL primary killed and its standby promoted, a Redis
//! Cluster master killed and its replica promoted, under load; and what
//! the stores do around it (`idem_postgres::Failover`'s search, watcher and
//! error classes; the Redis Cluster connection healer; the refusals of a
//! replica).

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
