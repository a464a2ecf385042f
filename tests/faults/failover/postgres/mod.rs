//! PostgreSQL failover through `idem_postgres::Failover` (several URLs, the
//! writable one used), on a primary and a standby made by `pg_basebackup`
//! (`support::pg_replica`):
//! - `storm`: the primary killed and the standby promoted under a
//!   redelivery storm, on synchronous and asynchronous replication;
//! - `search`: which server a `Failover` takes (the writable one, on the
//!   highest timeline), and leaves (a read-only one);
//! - `switchover`: store calls and pool transactions after a controlled
//!   switchover, a standby promoted beside a primary that stays writable
//!   (a split brain), a completion on synchronous replication through a
//!   standby outage then a failover;
//! - `fences`: fences keep rising across a failover to a standby that
//!   lacks the last acquisitions;
//! - `lifetimes`: the watcher and its connection end with the last
//!   `Failover`, closed pools are let go;
//! - `errors`: the error classes of `Failover` (TLS settings, passwords, a
//!   role without the privileges of the probe): what no retry cures is
//!   `Backend`, never the retryable `Unavailable`.
//!
//! `cargo test --all-features --test faults failover::postgres -- --nocapture`

use crate::support;

use std::time::{Duration, Instant};

use idemkit::postgres::{Failover, PgStore};
use idemkit::{Acquisition, IdempotencyKey, IdempotencyStore, StoreError};
use sqlx::postgres::PgPoolOptions;
use support::pg_replica::PgReplicaPair;

#[cfg(feature = "postgres-tls")]
mod errors;
mod fences;
mod lifetimes;
mod search;
#[cfg(all(feature = "tiered", feature = "redis"))]
mod storm;
mod switchover;

const SCOPE: &str = "failover.pg";

/// One replica pair at a time for the tests that measure (the storms) or
/// would be slowed down by them: each starts two servers, and the figures
/// (the unavailable window above all) mean more without three other storms
/// on the same two cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The key of message `msg` of `run`.
fn key(run: &str, msg: u64) -> IdempotencyKey {
    support::storm::key(SCOPE, run, msg)
}

/// A `Failover` over the pair (the primary first; a 1 s probe, a check
/// every 100 ms), a pool it opens with `options`, and a migrated store on
/// that pool with `connections` connections and a 2 s call timeout.
async fn store_on(
    pair: &PgReplicaPair,
    options: PgPoolOptions,
    connections: usize,
) -> (Failover, PgStore) {
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .probe_timeout(Duration::from_secs(1))
        .check_interval(Duration::from_millis(100));
    let pool = failover
        .connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool)
        .failover(failover.clone())
        .connections(connections)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    (failover, store)
}

/// Pool options for a store on the pair: 4 connections, a 2 s acquire
/// timeout.
fn small_pool() -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
}

/// Waits (30 s at most) until the store's table is on the standby.
async fn until_migrated_on_standby(pair: &PgReplicaPair) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while tokio::task::block_in_place(|| {
        pair.psql_standby("SELECT to_regclass('public.idem_records') IS NOT NULL")
    }) != "t"
    {
        assert!(
            Instant::now() < deadline,
            "the migration never reached the standby"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A controlled switchover: the old primary is fenced read-only
/// (`default_transaction_read_only = on`, reloaded) and stays up, the
/// standby is promoted; waits (10 s at most) until the watcher moved
/// `failover` to it.
async fn switch_over(pair: &PgReplicaPair, failover: &Failover) {
    tokio::task::block_in_place(|| {
        pair.psql_primary("ALTER SYSTEM SET default_transaction_read_only = on");
        pair.psql_primary("SELECT pg_reload_conf()");
        pair.promote_standby();
    });
    let new_primary = format!("127.0.0.1:{}", pair.standby_port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while failover.current() != new_primary {
        assert!(
            Instant::now() < deadline,
            "the watcher never moved to the new primary"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Retries `acquire` through `Unavailable` until it answers, within 30 s.
async fn acquire_until_answered(store: &PgStore, k: &IdempotencyKey) -> Acquisition {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match store.acquire(k, None, Duration::from_secs(60)).await {
            Ok(a) => return a,
            Err(StoreError::Unavailable(e)) => {
                assert!(
                    Instant::now() < deadline,
                    "no answer within 30 s, last error: {e}"
                );
            }
            Err(e) => panic!("acquire failed with a non-retryable error: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Client backends of the server other than the caller's, matching
/// `filter` (an SQL condition on `pg_stat_activity`, `true` for all).
async fn other_backends<'c>(admin: impl sqlx::PgExecutor<'c>, filter: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND ({filter})"
    )))
    .fetch_one(admin)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits (10 s at most) until `pool` has opened `n` connections.
async fn until_open(pool: &sqlx::PgPool, n: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.size() < n {
        assert!(
            Instant::now() < deadline,
            "the pool never opened its connections"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
