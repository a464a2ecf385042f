//! The lifetimes of what a `Failover` holds: its watcher (a task with a
//! connection of its own) ends when the last `Failover` and store built
//! with it are dropped, and the pools it opened are let go once closed.

use crate::support;

use std::time::{Duration, Instant};

use idemkit::postgres::Failover;
use idemkit::IdempotencyStore;
use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;
use support::pg::PgServer;
use support::report::report;
use support::storm::run_id;
use support::tls::pool_options;

use super::{key, other_backends, until_open};

/// "The watcher ends when every `Failover` clone and every store built
/// with it is dropped": at once, even with a long `check_interval` (not
/// only at its next tick, which would keep its task and its connection to
/// the server open up to that interval after the last `Failover`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_with_a_long_check_interval_ends_when_the_failover_is_dropped() {
    let started = Instant::now();
    let server = tokio::task::block_in_place(PgServer::start);
    let mut admin = sqlx::PgConnection::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let failover = Failover::new([&server.url])
        .unwrap_or_else(|e| panic!("{e}"))
        .check_interval(Duration::from_millis(20));
    let pool = failover.connect().await.unwrap_or_else(|e| panic!("{e}"));
    pool.close().await;
    drop(pool);
    // The watcher's own connection (it checks the server every 20 ms).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = other_backends(&mut admin, "true").await;
        if n == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the watcher never connected ({n} backends)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A long check interval, set through a clone (clones share it).
    let _ = failover.clone().check_interval(Duration::from_secs(3600));
    // Wait until the watcher has taken the new interval: its last check
    // stops moving.
    let last_check = "SELECT coalesce(max(query_start)::text, '') FROM pg_stat_activity \
                      WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()";
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last: String = String::new();
    let mut same_since = Instant::now();
    loop {
        let now: String = sqlx::query_scalar(last_check)
            .fetch_one(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if now != last {
            last = now;
            same_since = Instant::now();
        } else if same_since.elapsed() > Duration::from_millis(500) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the watcher kept checking every 20 ms"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Every Failover (and every pool) is gone.
    drop(failover);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut left = 0;
    while Instant::now() < deadline {
        left = other_backends(&mut admin, "true").await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    report(
        "postgres-failover-watcher-drop",
        "postgres",
        &[("connections_left_5s_after_drop", left.to_string())],
        started,
    );
    assert_eq!(
        left, 0,
        "5 s after the last Failover was dropped, its watcher's connection to the server is still open"
    );
}

/// The watcher ends, and its connection closes, when every Failover and
/// store is dropped and the pool closed: no session is left on the server.
/// And a store whose Failover found a server keeps working on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_ends_when_failovers_and_stores_are_dropped() {
    let started = Instant::now();
    let server = support::pg::PgServer::start();
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let before = other_backends(&admin, "true").await;
    let mut during = 0;
    for round in 0..3 {
        let failover = Failover::new([server.url.as_str()])
            .unwrap_or_else(|e| panic!("{e}"))
            .check_interval(Duration::from_millis(10));
        let pool = failover
            .connect_with(pool_options())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let store = idemkit::postgres::PgStore::builder(pool.clone())
            .failover(failover.clone())
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        if round == 0 {
            store
                .migrate()
                .await
                .unwrap_or_else(|e| panic!("migrate: {e}"));
        }
        let k = key(&run_id(), 0);
        match store.acquire(&k, None, Duration::from_secs(30)).await {
            Ok(idemkit::Acquisition::Acquired(lease)) => store
                .complete(&lease, b"ok", Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("complete: {e}")),
            other => panic!("acquire: {other:?}"),
        }
        // Let the watcher run a few checks.
        tokio::time::sleep(Duration::from_millis(100)).await;
        during = during.max(other_backends(&admin, "true").await);
        drop(store);
        drop(failover);
        pool.close().await;
    }
    let settle = Instant::now();
    let mut after = other_backends(&admin, "true").await;
    while after > before && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = other_backends(&admin, "true").await;
    }
    report(
        "pg_failover_watcher_drop",
        "postgres",
        &[
            ("sessions_before", before.to_string()),
            ("sessions_during", during.to_string()),
            ("sessions_after", after.to_string()),
        ],
        started,
    );
    assert!(
        after <= before,
        "sessions left on the server after 3 Failovers were dropped: {before} -> {after}"
    );
}

/// Every pool `Failover::connect_with` opens is kept in the Failover's
/// list, to be pointed at the next server. sqlx has no weak pool handle, so
/// a pool the application merely drops cannot be seen to go: the Failover
/// lets go of a pool once it is closed, and documents that a pool must be
/// closed (not only dropped) while the Failover lives on. Checked: closed
/// and dropped pools are let go and their connections close (as dropped
/// plain sqlx pools' do), so an application that rebuilds its pool or
/// store, keeping the Failover, leaks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_pools_are_let_go_and_their_connections_close() {
    let started = Instant::now();
    let server = tokio::task::block_in_place(PgServer::start);
    let mut admin = sqlx::PgConnection::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let of_the_pools = "application_name = 'failover-pool'";
    let url = format!("{}?application_name=failover-pool", server.url);
    // Control: plain sqlx pools, dropped, close their connections.
    for _ in 0..3 {
        let pool = PgPoolOptions::new()
            .min_connections(2)
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        until_open(&pool, 2).await;
        drop(pool);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = other_backends(&mut admin, of_the_pools).await;
        if n == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "control: dropped plain pools left {n} connections open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let failover = Failover::new([&url]).unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..3 {
        let pool = failover
            .connect_with(PgPoolOptions::new().min_connections(2).max_connections(2))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        until_open(&pool, 2).await;
        // The application is done with this pool. sqlx has no weak pool
        // handle, so a Failover cannot see that the last handle of a pool
        // it points at the writable server was dropped: the documented
        // way (see `Failover`, "Lifetimes") is to close the pool, which
        // the Failover then lets go of. (Dropped without closing, the pool
        // stays open as long as the Failover: documented, not fixable
        // without such a handle.)
        pool.close().await;
        drop(pool);
    }
    let held = format!("{failover:?}");
    assert!(
        held.contains("pools: 0"),
        "the Failover still holds closed pools: {held}"
    );
    // Once closed (and dropped), the pools' connections are gone.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut left = 0;
    while Instant::now() < deadline {
        left = other_backends(&mut admin, of_the_pools).await;
        if left <= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The watcher's own connection (same URL) may be one of them.
    report(
        "postgres-failover-dropped-pools",
        "postgres",
        &[
            ("control_plain_pools_left", "0".to_owned()),
            ("connections_left_incl_watcher", left.to_string()),
        ],
        started,
    );
    assert!(
        left <= 1,
        "3 pools (2 connections each) were closed and dropped, {left} connections are still \
         open (at most 1 is the watcher's): the Failover keeps the pools alive"
    );
    drop(failover);
}
