//! After a controlled switchover (the old primary fenced read-only and
//! left up, the standby promoted), transactions begun on the `Failover`'s
//! pool and the store's calls reach the new primary; on synchronous
//! replication, a completion the store reported survives a standby outage
//! followed by a failover.

use crate::support;

use std::time::{Duration, Instant};

use idemkit::postgres::Claim;
use idemkit::{Acquisition, IdempotencyStore};
use sqlx::postgres::PgPoolOptions;
use support::pg_replica::{PgReplicaPair, Replication};
use support::report::report;
use support::storm::run_id;

use super::{
    acquire_until_answered, key, small_pool, store_on, switch_over, until_migrated_on_standby,
    until_open,
};

/// The documentation of `Failover`: "a pool opened by `connect_with` ...
/// is pointed at the server each search finds ... so a transaction begun
/// on the pool after a failover reaches the new primary even if no store
/// call noticed it." A controlled switchover: the old primary is fenced
/// read-only (`default_transaction_read_only = on`, reloaded) and stays
/// up, the standby is promoted, the watcher moves the Failover to it.
/// Transactions then begun on the pool (the in-transaction mode's) must
/// run on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_transactions_reach_the_new_primary() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let (failover, store) = store_on(
        &pair,
        PgPoolOptions::new()
            .max_connections(4)
            .min_connections(4)
            .acquire_timeout(Duration::from_secs(2)),
        2,
    )
    .await;
    let pool = store.pool().clone();
    until_migrated_on_standby(&pair).await;
    // The pool's connections are open (min_connections), on the primary.
    until_open(&pool, 4).await;

    // Switchover: fence the old primary read-only, promote the standby.
    switch_over(&pair, &failover).await;

    let run = run_id();
    let mut ports = Vec::new();
    let mut claims = Vec::new();
    for i in 0..6u64 {
        let mut tx = match pool.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                claims.push(format!("begin: {e}"));
                continue;
            }
        };
        let port: i32 = sqlx::query_scalar("SELECT inet_server_port()")
            .fetch_one(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        ports.push(port);
        let claimed = store
            .in_transaction()
            .claim::<_, u64>(&mut tx, &key(&run, i), &i)
            .await;
        claims.push(match claimed {
            Ok(Claim::Acquired(lease)) => {
                lease
                    .complete(&mut tx, &i)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
                "acquired".to_owned()
            }
            Ok(_) => "other".to_owned(),
            Err(e) => format!("err: {e}").chars().take(100).collect(),
        });
    }
    let on_old = ports
        .iter()
        .filter(|p| **p as u16 == pair.primary_port)
        .count();
    report(
        "postgres-switchover-pool-transactions",
        "postgres",
        &[
            ("transactions", ports.len().to_string()),
            ("on_old_primary", on_old.to_string()),
            (
                "failed_claims",
                claims
                    .iter()
                    .filter(|c| *c != "acquired")
                    .count()
                    .to_string(),
            ),
        ],
        started,
    );
    assert_eq!(
        on_old,
        0,
        "transactions begun on the pool after the switch ran on the old primary ({} of {}); \
         claims: {claims:?}",
        on_old,
        ports.len()
    );
}

/// The same switchover seen by store calls (not the pool): the store's
/// idle connections to the fenced old primary get 25006, are dropped, and
/// the call is resent on the new primary: no call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_calls_reach_the_new_primary() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Sync));
    let (failover, store) = store_on(&pair, PgPoolOptions::new().max_connections(4), 4).await;
    let run = run_id();
    // Warm idle connections on the primary, and a lease taken there.
    let mut leases = Vec::new();
    for i in 0..4 {
        match store
            .acquire(&key(&run, i), None, Duration::from_secs(60))
            .await
        {
            Ok(Acquisition::Acquired(lease)) => leases.push(lease),
            other => panic!("{other:?}"),
        }
    }
    switch_over(&pair, &failover).await;
    let mut failed = Vec::new();
    for lease in &leases {
        if let Err(e) = store
            .complete(lease, b"done", Duration::from_secs(3600))
            .await
        {
            failed.push(format!("complete: {e}"));
        }
    }
    for i in 10..14 {
        if let Err(e) = store
            .acquire(&key(&run, i), None, Duration::from_secs(60))
            .await
        {
            failed.push(format!("acquire: {e}"));
        }
    }
    for i in 0..4 {
        match store
            .acquire(&key(&run, i), None, Duration::from_secs(60))
            .await
        {
            Ok(Acquisition::Completed(_)) => {}
            other => failed.push(format!("replay: {other:?}")),
        }
    }
    report(
        "postgres-switchover-store-calls",
        "postgres",
        &[("failed_calls", failed.len().to_string())],
        started,
    );
    assert!(failed.is_empty(), "{failed:?}");
}

/// A split brain: the standby is promoted while the old primary stays up
/// and writable (nobody fenced it). The watcher asks every server at each
/// check, so a running store moves to the promoted one (its higher
/// timeline) within a few check intervals, where a process started now
/// goes too: a key acquired by the running store after the move is in
/// progress for a new process, never run by both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_promoted_beside_a_writable_primary_is_followed() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let (failover, store) = store_on(&pair, PgPoolOptions::new().max_connections(2), 2).await;
    let run = run_id();
    match store
        .acquire(&key(&run, 0), None, Duration::from_secs(60))
        .await
    {
        Ok(Acquisition::Acquired(_)) => {}
        other => panic!("{other:?}"),
    }
    until_migrated_on_standby(&pair).await;
    tokio::task::block_in_place(|| pair.promote_standby());
    let promoted = Instant::now();
    assert_eq!(
        tokio::task::block_in_place(|| pair.psql_primary("SELECT NOT pg_is_in_recovery()")),
        "t",
        "the old primary must stay writable for a split brain"
    );
    let new_primary = format!("127.0.0.1:{}", pair.standby_port);
    // Checks every 100 ms: 3 s is 30 of them.
    while failover.current() != new_primary {
        assert!(
            promoted.elapsed() < Duration::from_secs(3),
            "3 s after the promotion the running store still uses the old primary \
             (writable beside the promoted standby: a split brain)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let moved_after = promoted.elapsed();
    let k = key(&run, 1);
    match store.acquire(&k, None, Duration::from_secs(60)).await {
        Ok(Acquisition::Acquired(_)) => {}
        other => panic!("after the move: {other:?}"),
    }
    let (_, fresh) = store_on(&pair, PgPoolOptions::new().max_connections(2), 2).await;
    let duplicate = fresh.acquire(&k, None, Duration::from_secs(60)).await;
    report(
        "postgres-split-brain-followed",
        "postgres",
        &[("moved_after_ms", moved_after.as_millis().to_string())],
        started,
    );
    assert!(
        matches!(duplicate, Ok(Acquisition::InProgress { .. })),
        "a new process did not see the running store's key: {duplicate:?}"
    );
}

/// Synchronous replication, the standby goes away (stopped), then the
/// primary crashes and the standby is started and promoted. A completion
/// the store reported as done must be on the promoted standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replication_completion_survives_a_standby_outage_then_a_failover() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Sync));
    let (_failover, store) = store_on(&pair, small_pool(), 4).await;
    let run = run_id();
    let k = key(&run, 1);
    let lease = match store.acquire(&k, None, Duration::from_secs(60)).await {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    };
    tokio::task::block_in_place(|| pair.stop_standby());
    let t = Instant::now();
    let completed = store
        .complete(&lease, b"charged", Duration::from_secs(3600))
        .await;
    let complete_ms = t.elapsed().as_millis();
    // A redelivery while the standby is away.
    let t = Instant::now();
    let redelivered = store.acquire(&k, None, Duration::from_secs(60)).await;
    let redelivered_ms = t.elapsed().as_millis();
    let on_primary = tokio::task::block_in_place(|| {
        pair.psql_primary(&format!(
            "SELECT status FROM idem_records WHERE key = '{}'",
            k.id()
        ))
    });
    tokio::task::block_in_place(|| {
        pair.kill_primary();
        pair.start_standby_again();
        pair.promote_standby();
    });
    let after = acquire_until_answered(&store, &k).await;
    let told_done = completed.is_ok() || matches!(redelivered, Ok(Acquisition::Completed(_)));
    report(
        "postgres-sync-standby-outage-then-failover",
        "postgres",
        &[
            (
                "complete",
                format!("{:?}", completed.as_ref().map_err(|e| e.to_string())),
            ),
            ("complete_ms", complete_ms.to_string()),
            (
                "redelivered",
                match &redelivered {
                    Ok(Acquisition::Completed(_)) => "replayed".to_owned(),
                    Ok(a) => format!("{a:?}").chars().take(40).collect(),
                    Err(e) => format!("err:{e}").chars().take(120).collect(),
                },
            ),
            ("redelivered_ms", redelivered_ms.to_string()),
            ("status_on_old_primary", on_primary),
            (
                "after_failover",
                match &after {
                    Acquisition::Completed(_) => "replayed".to_owned(),
                    a => format!("{a:?}").chars().take(40).collect(),
                },
            ),
        ],
        started,
    );
    if told_done {
        assert!(
            matches!(after, Acquisition::Completed(_)),
            "the store said the key was done (complete: {completed:?}, redelivery: {redelivered:?}) but \
             after the failover it is {after:?}: a lost completion on synchronous replication"
        );
    }
}
