//! Which server a `Failover` takes: the writable one (not a standby, not a
//! server turned read-only), on the highest timeline (not an old primary
//! that came back after a failover); a read-only server is left and found
//! again once it takes writes; odd durations never panic.

use crate::support;

use std::time::{Duration, Instant};

use idemkit::postgres::{Failover, PgStore};
use idemkit::{Acquisition, IdempotencyStore, StoreError};
use support::pg_replica::{PgReplicaPair, Replication};
use support::report::report;
use support::storm::run_id;

use super::{
    acquire_until_answered, key, small_pool, store_on, until_migrated_on_standby, ONE_AT_A_TIME,
};

/// Before any failover: a `Failover` whose first URL is the standby goes
/// to the primary (the writable one), and one whose servers are all
/// standbys or down fails fast with a retryable `Unavailable` naming each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_the_writable_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let failover =
        Failover::new([&pair.standby_url, &pair.primary_url]).unwrap_or_else(|e| panic!("{e}"));
    let pool = failover.connect().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        failover.current(),
        format!("127.0.0.1:{}", pair.primary_port)
    );
    let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!in_recovery, "the pool is on the primary");
    let store = PgStore::builder(pool)
        .failover(failover)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let k = key(&run_id(), 1);
    assert!(matches!(
        store.acquire(&k, None, Duration::from_secs(5)).await,
        Ok(idemkit::Acquisition::Acquired(_))
    ));

    let dead = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        support::free_port()
    );
    let nowhere = Failover::new([&pair.standby_url, &dead]).unwrap_or_else(|e| panic!("{e}"));
    match nowhere.connect().await {
        Err(StoreError::Unavailable(e)) => {
            let text = e.to_string();
            assert!(
                text.contains("read-only")
                    && text.contains("no writable")
                    && text.contains("refused"),
                "the error names each server's state: {text}"
            );
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(matches!(
        Failover::new(Vec::<String>::new()),
        Err(StoreError::InvalidArgument { .. })
    ));
    assert!(matches!(
        Failover::new(["mysql://x"]),
        Err(StoreError::InvalidArgument { .. })
    ));
}

/// A primary that turns read-only under open connections
/// (`default_transaction_read_only = on`, reloaded): the store's statements
/// get 25006, which is `Unavailable` (never `Backend`), the connection is
/// dropped and the store searches again (finding no writable server while
/// it lasts); once the primary takes writes again, the next call succeeds
/// on a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_server_is_left_and_found_again() {
    let _one = ONE_AT_A_TIME.lock().await;
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .check_interval(Duration::from_millis(100));
    let pool = failover.connect().await.unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool)
        .failover(failover.clone())
        .connections(4)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let run = run_id();
    // Warm connections, idle in the store.
    for i in 0..4 {
        assert!(matches!(
            store
                .acquire(&key(&run, i), None, Duration::from_secs(5))
                .await,
            Ok(idemkit::Acquisition::Acquired(_))
        ));
    }

    let set = |on: bool| {
        tokio::task::block_in_place(|| {
            let value = if on { "on" } else { "off" };
            pair.psql_primary(&format!(
                "ALTER SYSTEM SET default_transaction_read_only = {value}"
            ));
            pair.psql_primary("SELECT pg_reload_conf()");
        })
    };
    set(true);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut refused = 0;
    let mut msg = 100;
    loop {
        msg += 1;
        match store
            .acquire(&key(&run, msg), None, Duration::from_secs(5))
            .await
        {
            Err(StoreError::Unavailable(e)) => {
                refused += 1;
                let text = e.to_string();
                assert!(
                    text.contains("read-only") || text.contains("read_only"),
                    "the error says why: {text}"
                );
                break;
            }
            // The reload has not reached this session yet.
            Ok(_) => {}
            Err(e) => panic!("a read-only server is Unavailable, not {e:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "the primary never refused a write"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The writes stay refused while it lasts, and no connection to the
    // read-only server is handed out.
    for i in 0..5 {
        assert!(matches!(
            store
                .acquire(&key(&run, 200 + i), None, Duration::from_secs(5))
                .await,
            Err(StoreError::Unavailable(_))
        ));
    }
    set(false);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store
            .acquire(&key(&run, 300), None, Duration::from_secs(5))
            .await
        {
            Ok(idemkit::Acquisition::Acquired(_)) => break,
            Err(StoreError::Unavailable(_)) => {}
            other => panic!("expected Acquired, got {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "the store did not come back to the primary within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(failover.switches(), 0);
    assert_eq!(
        failover.current(),
        format!("127.0.0.1:{}", pair.primary_port)
    );
    println!(
        "reliability scenario=postgres-read-only-primary backend=postgres refused_calls={} \
         then=acquired",
        refused + 5
    );
}

/// After a failover, the old primary comes back (a host reboot with
/// PostgreSQL enabled at boot starts it from its old data directory: a
/// writable primary on the old timeline). Later the new primary is
/// restarted (a routine restart: a minor upgrade, a setting that needs
/// it). While it is down, the old primary is the only writable server: the
/// store must not move there (a key completed on the new primary would be
/// acquired afresh on the old one, its handler run a second time), and a
/// key completed on the new primary replays once it is back. A fresh
/// search given both servers takes the one on the highest timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stays_off_an_old_primary_that_came_back() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let (failover, store) = store_on(&pair, small_pool(), 4).await;
    // The table is on the standby before the crash.
    until_migrated_on_standby(&pair).await;

    // 1. The primary crashes; the standby is promoted; the store follows.
    tokio::task::block_in_place(|| {
        pair.kill_primary();
        pair.promote_standby();
    });
    let run = run_id();
    let paid = key(&run, 1);
    let first = match acquire_until_answered(&store, &paid).await {
        Acquisition::Acquired(lease) => lease,
        other => panic!("expected Acquired on the new primary, got {other:?}"),
    };
    // The handler's side effect runs here (a payment), then it is recorded.
    let mut executions = 1;
    store
        .complete(&first, b"charged", Duration::from_secs(3600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let new_primary = format!("127.0.0.1:{}", pair.standby_port);
    assert_eq!(failover.current(), new_primary);

    // 2. The old primary's host reboots: PostgreSQL starts from its data
    //    directory, writable (nobody turned it into a standby).
    tokio::task::block_in_place(|| pair.start_old_primary_again());

    // 3. A routine restart of the new primary. While it is down, the only
    //    writable server is the old primary: a store that refuses it (the
    //    right answer) does not answer at all, so the calls made meanwhile
    //    are bounded (3 s) instead of awaited.
    tokio::task::block_in_place(|| pair.stop_standby());
    let probe = key(&run, 2);
    let mut during = None;
    let deadline = Instant::now() + Duration::from_secs(3);
    while during.is_none() && Instant::now() < deadline {
        match store.acquire(&probe, None, Duration::from_secs(60)).await {
            Ok(a) => during = Some(a),
            Err(StoreError::Unavailable(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("acquire failed with a non-retryable error: {e:?}"),
        }
    }
    tokio::task::block_in_place(|| pair.start_standby_again());

    // 4. The message is delivered again (a client retry): it must replay.
    let again = acquire_until_answered(&store, &paid).await;
    let mut second_fence = String::from("-");
    if let Acquisition::Acquired(lease) = &again {
        executions += 1;
        second_fence = lease.fence.to_string();
    }
    report(
        "postgres-old-primary-returns",
        "postgres",
        &[
            (
                "during_restart",
                match during {
                    Some(Acquisition::Acquired(_)) => "acquired",
                    Some(_) => "other",
                    None => "unavailable",
                }
                .to_owned(),
            ),
            ("old_primary", format!("127.0.0.1:{}", pair.primary_port)),
            ("current", failover.current()),
            ("first_fence", first.fence.to_string()),
            ("second_fence", second_fence),
            ("switches", failover.switches().to_string()),
            ("executions", executions.to_string()),
        ],
        started,
    );
    assert!(
        matches!(again, Acquisition::Completed(_)),
        "the key completed on the new primary must replay, got {again:?}: the store now uses {} \
         (the old primary, on the old timeline) after {} switches; the handler ran {executions} times",
        failover.current(),
        failover.switches()
    );
    // A fresh process given both servers (the old primary first) while
    // both are up takes the promoted one: the highest timeline.
    let fresh =
        Failover::new([&pair.primary_url, &pair.standby_url]).unwrap_or_else(|e| panic!("{e}"));
    let fresh_pool = fresh.connect().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        fresh.current(),
        new_primary,
        "a fresh search took the old primary: {fresh:?}"
    );
    fresh_pool.close().await;
}

/// Extreme durations given to `Failover` do not panic, and a store built
/// on it still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_durations_do_not_panic() {
    let started = Instant::now();
    let url = support::pg::shared_url().to_owned();
    let mut served = 0;
    for (probe, check) in [
        (Duration::MAX, Duration::MAX),
        (Duration::ZERO, Duration::ZERO),
        (Duration::from_secs(5), Duration::ZERO),
        (Duration::MAX, Duration::from_nanos(1)),
    ] {
        let failover = Failover::new([url.as_str(), url.as_str()])
            .unwrap_or_else(|e| panic!("{e}"))
            .probe_timeout(probe)
            .check_interval(check);
        // A 1 ms probe may be too short on a busy machine: then a typed
        // error, never a panic.
        let pool = match failover.connect().await {
            Ok(pool) => pool,
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                continue;
            }
        };
        let store = PgStore::builder(pool)
            .failover(failover)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let run = run_id();
        match store
            .acquire(&key(&run, 1), None, Duration::from_secs(5))
            .await
        {
            Ok(_) => served += 1,
            Err(e) => assert!(e.is_retryable(), "{e}"),
        }
    }
    report(
        "postgres-failover-extreme-durations",
        "postgres",
        &[("served", served.to_string())],
        started,
    );
}
