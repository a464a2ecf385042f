//! Adversarial review of issue 18 (failover, TLS, access): each test here
//! states a property the documentation promises and checks it on real
//! servers. A failing test is a finding.
//!
//! `scripts/with-servers cargo test --features postgres,redis-tls --test review18 -- --nocapture`

use crate::support;

use std::time::{Duration, Instant};

use idem::postgres::{Claim, Failover, PgStore};
use idem::redis::RedisStore;
use idem::{Acquisition, IdempotencyKey, IdempotencyStore, StoreError};
use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;
use support::pg::PgServer;
use support::pg_replica::{PgReplicaPair, Replication};

fn report(scenario: &str, backend: &str, fields: &[(&str, String)], started: Instant) {
    let figures: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!(
        "reliability scenario={scenario} backend={backend} {} duration_ms={}",
        figures.join(" "),
        started.elapsed().as_millis()
    );
}

fn key(run: &str, n: u64) -> IdempotencyKey {
    IdempotencyKey::new("review18", format!("{run}-{n}")).unwrap_or_else(|e| panic!("{e}"))
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

/// Finding: after a failover, the old primary comes back (a host reboot
/// with PostgreSQL enabled at boot starts it from its old data directory:
/// a writable primary on the old timeline). Later the new primary is
/// restarted (a routine restart: a minor upgrade, a setting that needs
/// it). The store's search tries the server in use, finds it down, then
/// the others in order, finds the old primary writable and moves there,
/// and stays there after the new primary is back. A key completed on the
/// new primary is then acquired afresh on the old one: the handler runs a
/// second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_moves_back_to_an_old_primary_that_came_back() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .probe_timeout(Duration::from_secs(1))
        .check_interval(Duration::from_millis(100));
    let pool = failover
        .connect_with(
            PgPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(2)),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool)
        .failover(failover.clone())
        .connections(4)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    // The table is on the standby before the crash.
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

    // 1. The primary crashes; the standby is promoted; the store follows.
    tokio::task::block_in_place(|| {
        pair.kill_primary();
        pair.promote_standby();
    });
    let run = format!("{:016x}", fastrand::u64(..));
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

/// Finding: "The watcher ends when every `Failover` clone and every store
/// built with it is dropped." It ends only at its next tick: with a long
/// `check_interval`, its task and its connection to the server outlive
/// every `Failover` and pool by up to that interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_watcher_and_its_connection_outlive_the_failover() {
    let started = Instant::now();
    let server = tokio::task::block_in_place(PgServer::start);
    let mut admin = sqlx::PgConnection::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let others = "SELECT count(*) FROM pg_stat_activity \
                  WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()";
    let failover = Failover::new([&server.url])
        .unwrap_or_else(|e| panic!("{e}"))
        .check_interval(Duration::from_millis(20));
    let pool = failover.connect().await.unwrap_or_else(|e| panic!("{e}"));
    pool.close().await;
    drop(pool);
    // The watcher's own connection (it checks the server every 20 ms).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar(others)
            .fetch_one(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
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
        left = sqlx::query_scalar::<_, i64>(others)
            .fetch_one(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
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

/// Finding: a TLS setting that no retry cures (`sslmode=require` to a
/// server without TLS, an `sslrootcert` file that does not exist) is
/// `Backend` from `idem_postgres::connect`, but `Failover::connect` /
/// `connect_any` report it as the retryable `Unavailable` (the probe's
/// classification counts every `Io`/`Tls` error as "may pass"), so an
/// application that retries `Unavailable` at start retries forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_tls_misconfiguration_is_not_retryable() {
    let started = Instant::now();
    let url = support::pg::shared_url().to_owned();
    let sep = if url.contains('?') { '&' } else { '?' };
    let cases = [
        (
            "require-to-plaintext-server",
            format!("{url}{sep}sslmode=require"),
        ),
        (
            "missing-rootcert",
            format!("{url}{sep}sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"),
        ),
    ];
    let mut rows = Vec::new();
    for (what, bad) in &cases {
        let single = idem::postgres::connect(bad).await.map(|_| ());
        let any = idem::postgres::connect_any(&[bad.as_str()])
            .await
            .map(|_| ());
        rows.push((*what, single, any));
    }
    let fields: Vec<(&str, String)> = rows
        .iter()
        .flat_map(|(what, single, any)| {
            let r = |x: &Result<(), StoreError>| match x {
                Ok(()) => "ok".to_owned(),
                Err(e) => format!("retryable={}", e.is_retryable()),
            };
            [(
                *what,
                format!("connect:{},connect_any:{}", r(single), r(any)),
            )]
        })
        .collect();
    report(
        "postgres-failover-tls-setting",
        "postgres",
        &fields,
        started,
    );
    for (what, single, any) in rows {
        if let Err(e) = &single {
            assert!(!e.is_retryable(), "{what}: connect says retryable: {e}");
        }
        match any {
            Err(e) => assert!(
                !e.is_retryable(),
                "{what}: connect says {:?} but connect_any says retryable: {e}",
                single.as_ref().err().map(|e| e.to_string())
            ),
            Ok(()) => panic!("{what}: connect_any connected"),
        }
    }
}

/// Holds (checked): extreme durations given to `Failover` do not panic,
/// and a store built on it still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_extreme_durations_do_not_panic() {
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
        let run = format!("{:016x}", fastrand::u64(..));
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

/// Synchronous replication, the standby goes away (stopped), then the
/// primary crashes and the standby is started and promoted. A completion
/// the store reported as done must be on the promoted standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replication_reported_completion_survives_standby_outage_then_failover() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Sync));
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .probe_timeout(Duration::from_secs(1))
        .check_interval(Duration::from_millis(100));
    let pool = failover
        .connect_with(
            PgPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(2)),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool)
        .failover(failover.clone())
        .connections(4)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let run = format!("{:016x}", fastrand::u64(..));
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

/// Holds (checked): a Redis that turned into a replica (a failover moved
/// the master away) refuses the scripts' writes with READONLY, and one
/// whose master link is down with `replica-serve-stale-data no` refuses
/// the scripts' GET with MASTERDOWN (which the scripts now pass on): both
/// must be the retryable `Unavailable`, never `Backend`/`Corrupt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_replica_refusals_are_retryable() {
    let started = Instant::now();
    let master = tokio::task::block_in_place(|| support::redis_server::RedisServer::start(&[]));
    let replica = tokio::task::block_in_place(|| support::redis_server::RedisServer::start(&[]));
    let on_master = RedisStore::connect(&master.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = RedisStore::connect(&replica.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_secs(2));
    let run = format!("{:016x}", fastrand::u64(..));
    let lease = match on_master
        .acquire(&key(&run, 1), None, Duration::from_secs(60))
        .await
    {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    };
    // The server the store uses is (now) a replica of `master`, with the
    // worker's reservation on it.
    let said = replica.command(&format!("REPLICAOF 127.0.0.1 {}", master.port));
    assert!(said.starts_with("+OK"), "{said}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(replica
        .command("INFO replication")
        .contains("master_link_status:up")
        && replica.command("DBSIZE").trim() == ":1")
    {
        assert!(Instant::now() < deadline, "the replica never synced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let readonly_acquire = store
        .acquire(&key(&run, 2), None, Duration::from_secs(30))
        .await
        .map(|_| ());
    let readonly_complete = store.complete(&lease, b"x", Duration::from_secs(60)).await;
    // The master goes away; stale reads are refused.
    assert!(replica
        .command("CONFIG SET replica-serve-stale-data no")
        .starts_with("+OK"));
    master.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica
        .command("INFO replication")
        .contains("master_link_status:down")
    {
        assert!(
            Instant::now() < deadline,
            "the replica never saw its master go"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stale_acquire = store
        .acquire(&key(&run, 3), None, Duration::from_secs(30))
        .await
        .map(|_| ());
    let stale_complete = store.complete(&lease, b"x", Duration::from_secs(60)).await;
    let stale_release = store.release(&lease).await;
    let stale_extend = store
        .extend(&lease, Duration::from_secs(30))
        .await
        .map(|_| ());
    let cases = [
        ("readonly_acquire", readonly_acquire),
        ("readonly_complete", readonly_complete),
        ("stale_acquire", stale_acquire),
        ("stale_complete", stale_complete),
        ("stale_release", stale_release),
        ("stale_extend", stale_extend),
    ];
    let show = |r: &Result<(), StoreError>| match r {
        Ok(()) => "ok".to_owned(),
        Err(e) if e.is_retryable() => "Unavailable".to_owned(),
        Err(_) => "NOT-retryable".to_owned(),
    };
    report(
        "redis-replica-refusals",
        "redis",
        &cases.iter().map(|(w, r)| (*w, show(r))).collect::<Vec<_>>(),
        started,
    );
    for (what, r) in cases {
        match r {
            Err(e) => assert!(e.is_retryable(), "{what}: {e:?}"),
            Ok(()) => panic!("{what}: a replica took the write"),
        }
    }
}

/// A server of its own where the role `idem` logs in over TCP with a
/// password (scram-sha-256) and owns the database `idem`; returns it and
/// an admin connection (as `postgres`, trusted).
async fn pg_with_password() -> (PgServer, sqlx::PgConnection) {
    let server = tokio::task::block_in_place(PgServer::start);
    let mut admin = sqlx::PgConnection::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for sql in [
        "SET password_encryption = 'scram-sha-256'",
        "CREATE ROLE idem LOGIN PASSWORD 'first'",
        "CREATE DATABASE idem OWNER idem",
    ] {
        sqlx::raw_sql(sql)
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let hba = server.dir().join("data").join("pg_hba.conf");
    let rules = "local all all trust\nhost all postgres 127.0.0.1/32 trust\n\
                 host all idem 127.0.0.1/32 scram-sha-256\n";
    std::fs::write(&hba, rules).unwrap_or_else(|e| panic!("{e}"));
    sqlx::raw_sql("SELECT pg_reload_conf()")
        .execute(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (server, admin)
}

/// Finding: the role's password is changed while the store runs (a
/// rotation done on the server before the app's configuration). Without
/// `Failover`, the store's next connection fails `Backend` ("authentication
/// failed", as documented: no retry helps). With `Failover`, the failed
/// connection sends the store searching, the search's verdict (every server
/// refused the credentials: not retryable) is dropped, and the call is the
/// retryable `Unavailable`: retried forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_wrong_password_at_runtime_is_not_retryable() {
    let started = Instant::now();
    let (server, mut admin) = pg_with_password().await;
    let url = format!("postgres://idem:first@127.0.0.1:{}/idem", server.port);
    let plain = PgStore::builder(
        PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .connections(1)
    .call_timeout(Duration::from_secs(2))
    .build()
    .unwrap_or_else(|e| panic!("{e}"));
    plain.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let failover = Failover::new([&url]).unwrap_or_else(|e| panic!("{e}"));
    let with_failover = PgStore::builder(
        failover
            .connect_with(PgPoolOptions::new().max_connections(2))
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .failover(failover)
    .connections(1)
    .call_timeout(Duration::from_secs(2))
    .build()
    .unwrap_or_else(|e| panic!("{e}"));
    let run = format!("{:016x}", fastrand::u64(..));
    for store in [&plain, &with_failover] {
        assert!(store
            .acquire(&key(&run, fastrand::u64(..)), None, Duration::from_secs(30))
            .await
            .is_ok());
    }
    // The password changes on the server; the store's connections are
    // closed (a restart, an idle timeout, a network blip).
    for sql in [
        "ALTER ROLE idem PASSWORD 'second'",
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'idem'",
    ] {
        sqlx::raw_sql(sql)
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let mut verdicts = Vec::new();
    for (name, store) in [("plain", &plain), ("failover", &with_failover)] {
        // The first call may fail on its dead connection: the verdict is
        // the one once only new connections are tried.
        let mut last = None;
        for i in 0..3 {
            last = Some(
                store
                    .acquire(&key(&run, 100 + i), None, Duration::from_secs(30))
                    .await
                    .map(|_| ()),
            );
        }
        verdicts.push((name, last.unwrap_or(Ok(()))));
    }
    report(
        "postgres-password-rotated-at-runtime",
        "postgres",
        &verdicts
            .iter()
            .map(|(n, r)| {
                (
                    *n,
                    match r {
                        Ok(()) => "ok".to_owned(),
                        Err(e) if e.is_retryable() => "Unavailable".to_owned(),
                        Err(_) => "Backend".to_owned(),
                    },
                )
            })
            .collect::<Vec<_>>(),
        started,
    );
    for (name, r) in verdicts {
        match r {
            Err(e) => assert!(
                !e.is_retryable(),
                "{name}: a refused password at runtime must be Backend (as documented), got {e}"
            ),
            Ok(()) => panic!("{name}: connected with the old password"),
        }
    }
}

/// The documentation of `Failover`: "a pool opened by `connect_with` ...
/// is pointed at the server each search finds ... so a transaction begun
/// on the pool after a failover reaches the new primary even if no store
/// call noticed it." A controlled switchover: the old primary is fenced
/// read-only (`default_transaction_read_only = on`, reloaded) and stays
/// up, the standby is promoted, the watcher moves the Failover to it.
/// Transactions then begun on the pool (the in-transaction mode's) must
/// run on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_pool_transactions_reach_the_new_primary_after_a_switchover() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Async));
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .probe_timeout(Duration::from_secs(1))
        .check_interval(Duration::from_millis(100));
    let pool = failover
        .connect_with(
            PgPoolOptions::new()
                .max_connections(4)
                .min_connections(4)
                .acquire_timeout(Duration::from_secs(2)),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool.clone())
        .failover(failover.clone())
        .connections(2)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
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
    // The pool's connections are open (min_connections), on the primary.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.size() < 4 {
        assert!(
            Instant::now() < deadline,
            "the pool never opened its connections"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Switchover: fence the old primary read-only, promote the standby.
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

    let run = format!("{:016x}", fastrand::u64(..));
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

/// Holds (checked): the same switchover as above, seen by store calls
/// (not the pool): the store's idle connections to the fenced old primary
/// get 25006, are dropped, and the call is resent on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_store_calls_reach_the_new_primary_after_a_switchover() {
    let started = Instant::now();
    let pair = tokio::task::block_in_place(|| PgReplicaPair::start(Replication::Sync));
    let failover = Failover::new([&pair.primary_url, &pair.standby_url])
        .unwrap_or_else(|e| panic!("{e}"))
        .probe_timeout(Duration::from_secs(1))
        .check_interval(Duration::from_millis(100));
    let pool = failover
        .connect_with(PgPoolOptions::new().max_connections(4))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool)
        .failover(failover.clone())
        .connections(4)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let run = format!("{:016x}", fastrand::u64(..));
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
    tokio::task::block_in_place(|| {
        pair.psql_primary("ALTER SYSTEM SET default_transaction_read_only = on");
        pair.psql_primary("SELECT pg_reload_conf()");
        pair.promote_standby();
    });
    let new_primary = format!("127.0.0.1:{}", pair.standby_port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while failover.current() != new_primary {
        assert!(Instant::now() < deadline, "the watcher never moved");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

/// Finding: every pool `Failover::connect_with` opens is kept in the
/// Failover's list (to be pointed at the next server) and never let go: a
/// pool the application drops is not dropped, and its connections stay
/// open on the server as long as the `Failover` lives (an application that
/// rebuilds its pool or store, keeping the Failover, leaks them).
/// Resolution: sqlx has no weak pool handle, so this cannot be detected;
/// the Failover lets go of a pool once it is closed, and documents that a
/// pool must be closed (not only dropped) while the Failover lives on.
/// The test checks that documented behaviour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_does_not_keep_dropped_pools_alive() {
    let started = Instant::now();
    let server = tokio::task::block_in_place(PgServer::start);
    let mut admin = sqlx::PgConnection::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let others = "SELECT count(*) FROM pg_stat_activity \
                  WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() \
                  AND application_name = 'review18-pool'";
    let url = format!("{}?application_name=review18-pool", server.url);
    // Control: plain sqlx pools, dropped, close their connections.
    for _ in 0..3 {
        let pool = PgPoolOptions::new()
            .min_connections(2)
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.size() < 2 {
            assert!(
                Instant::now() < deadline,
                "the pool never opened its connections"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(pool);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = count_clients(&mut admin, others)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
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
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.size() < 2 {
            assert!(
                Instant::now() < deadline,
                "the pool never opened its connections"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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
        left = count_clients(&mut admin, others)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
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

async fn count_clients(admin: &mut sqlx::PgConnection, sql: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(admin)
        .await
}
