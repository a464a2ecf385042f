//! PostgreSQL waits and timeouts: lock waits longer than the lease, the
//! server's `lock_timeout` and `statement_timeout`, a frozen lock holder,
//! a restart under idle connections.

use super::*;
use support::pg::{until_waiting_on_locks, PgServer};

/// Plain deliveries wait on in-transaction claims of their keys for two
/// leases; the transactions roll back; each waiting delivery acquires
/// with a lease counted from its write, so a redelivery while its
/// handler runs (three leases, heartbeat on) is "in progress": 0
/// takeovers, 1 effect per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_lock_wait_longer_than_the_lease_behind_an_in_transaction_claim() {
    let started = Instant::now();
    let store = pg_store().await; // 2 s calls: the server waits up to 1 s
    let lease = Duration::from_millis(300);
    let wait = lease * 2;
    let messages = 8u64;
    let idem = Idempotency::new(store.clone())
        .lease(lease)
        .on_in_progress(InProgressPolicy::Reject);
    let run = run_id();
    let ledger = Ledger::new(messages);
    let mut claims = Vec::new();
    for msg in 0..messages {
        let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
        let claim = store
            .in_transaction()
            .claim::<_, u64>(&mut tx, &key("faults.lockwait", &run, msg), &msg)
            .await;
        assert!(matches!(claim, Ok(Claim::Acquired(_))), "{claim:?}");
        claims.push(tx);
    }
    let mut deliveries = Vec::new();
    let mut started_rx = Vec::new();
    for msg in 0..messages {
        let (idem, ledger, k) = (
            idem.clone(),
            ledger.clone(),
            key("faults.lockwait", &run, msg),
        );
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        started_rx.push(rx);
        deliveries.push(tokio::spawn(async move {
            idem.process(&k, msg, move |msg| async move {
                ledger.effect(msg);
                let _ = tx.send(());
                tokio::time::sleep(lease * 3).await;
                Ok::<_, std::convert::Infallible>(msg)
            })
            .await
        }));
    }
    until_waiting_on_locks(store.pool(), messages as i64).await;
    tokio::time::sleep(wait).await; // the length of the fault
    for tx in claims {
        tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    }
    let (mut in_progress, mut takeovers) = (0, 0);
    for (msg, rx) in started_rx.into_iter().enumerate() {
        rx.await.unwrap_or_else(|e| panic!("{e}"));
        let again = idem
            .process(
                &key("faults.lockwait", &run, msg as u64),
                msg as u64,
                |_| async { never::<u64>("a live handler's key") },
            )
            .await;
        match again {
            Err(IdemError::InProgress { .. }) => in_progress += 1,
            _ => takeovers += 1,
        }
    }
    for d in deliveries {
        let out = d.await.unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(out, Ok(Processed::Executed(_))), "{out:?}");
    }
    let effects: Vec<u32> = (0..messages).map(|m| ledger.count(m)).collect();
    assert_eq!(
        takeovers, 0,
        "a handler's key was taken over after a lock wait"
    );
    assert!(effects.iter().all(|&n| n == 1), "{effects:?}");
    report(
        "lock-wait-past-lease",
        Backend::Postgres,
        &[
            ("messages", messages.to_string()),
            ("lease_ms", lease.as_millis().to_string()),
            ("lock_wait_ms", wait.as_millis().to_string()),
            ("redeliveries_in_progress", in_progress.to_string()),
            ("takeovers", takeovers.to_string()),
            (
                "double_effects",
                effects.iter().filter(|&&n| n > 1).count().to_string(),
            ),
        ],
        started,
    );
}

/// Completions that run into the server's `lock_timeout` (55P03) or
/// `statement_timeout` (57014), set on the connections as a DBA would:
/// each message's row is locked by another session for 300 ms as its
/// handler returns (100 ms timeouts). The completion fails with
/// `Unavailable`, the executor retries it, it lands once the lock is
/// gone: every message executed once, recorded, replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_statement_and_lock_timeouts_during_completion() {
    for setting in ["lock_timeout", "statement_timeout"] {
        let started = Instant::now();
        let options: sqlx::postgres::PgConnectOptions = support::pg::shared_url()
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .test_before_acquire(false)
            .connect_with(options.options([(setting, "100ms")]))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let store = PgStore::builder(pool)
            .connections(8)
            .call_timeout(Duration::from_secs(5))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let lockers = support::pg::pool(support::pg::shared_url(), 20).await;
        let tap = Arc::new(Tap::new(store.clone()));
        let idem = Idempotency::from_arc(tap.clone())
            .lease(Duration::from_secs(5))
            .complete_retry(Duration::from_secs(3))
            .on_in_progress(InProgressPolicy::Reject);
        let messages = 20u64;
        let run = run_id();
        let ledger = Ledger::new(messages);
        let table = store.qualified_table().to_owned();
        let tasks: Vec<_> = (0..messages)
            .map(|msg| {
                let (idem, ledger, lockers, table) =
                    (idem.clone(), ledger.clone(), lockers.clone(), table.clone());
                let k = key("faults.timeouts", &run, msg);
                tokio::spawn(async move {
                    let kk = k.clone();
                    idem.process(&k, msg, move |msg| async move {
                        ledger.effect(msg);
                        // Another session locks the row before the
                        // completion comes, and holds it for 300 ms.
                        let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
                        tokio::spawn(async move {
                            let mut tx = lockers.begin().await.unwrap_or_else(|e| panic!("{e}"));
                            sqlx::query(sqlx::AssertSqlSafe(format!(
                                "SELECT 1 FROM {table} WHERE scope = $1 AND key = $2 FOR UPDATE"
                            )))
                            .bind(kk.scope())
                            .bind(kk.id())
                            .execute(&mut *tx)
                            .await
                            .unwrap_or_else(|e| panic!("{e}"));
                            let _ = locked_tx.send(());
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
                        });
                        let _ = locked_rx.await;
                        Ok::<_, std::convert::Infallible>(msg)
                    })
                    .await
                })
            })
            .collect();
        let mut failed = Vec::new();
        for t in tasks {
            match t.await.unwrap_or_else(|e| panic!("{e}")) {
                Ok(Processed::Executed(_)) => {}
                other => failed.push(format!("{other:?}")),
            }
        }
        let mut replayed = 0;
        for msg in 0..messages {
            let again = idem
                .process(&key("faults.timeouts", &run, msg), msg, |_| async {
                    never::<u64>("it was recorded")
                })
                .await;
            if matches!(again, Ok(Processed::Replayed(v)) if v == msg) {
                replayed += 1;
            }
        }
        let retried = tap.completes() as u64 - messages;
        let double = (0..messages).filter(|&m| ledger.count(m) > 1).count();
        assert!(failed.is_empty(), "{setting}: {failed:?}");
        assert!(retried > 0, "{setting}: no completion ran into the timeout");
        assert_eq!(replayed, messages, "{setting}: every result recorded");
        assert_eq!(double, 0);
        report(
            &format!("{}-during-completion", setting.replace('_', "-")),
            Backend::Postgres,
            &[
                ("messages", messages.to_string()),
                ("server_timeout_ms", "100".into()),
                ("row_locked_ms", "300".into()),
                ("completions_retried", retried.to_string()),
                ("failed_calls", failed.len().to_string()),
                ("replayed", replayed.to_string()),
                ("double_effects", double.to_string()),
            ],
            started,
        );
    }
}

/// A lock holder that freezes (an in-transaction claim that neither
/// commits nor rolls back) while 16 workers retry its key 10 times each
/// with a 200 ms call timeout: every call is `Unavailable`, and the
/// server never holds more backends than the pool and the store's
/// connections (each statement dies on the server with its call). Once
/// the holder rolls back, the key is free (no reservation was left by a
/// call that gave up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_frozen_lock_holder_with_many_retries_keeps_connections_bounded() {
    let started = Instant::now();
    let server = PgServer::start();
    let pool = support::pg::pool(&server.url, 4).await;
    let store = PgStore::builder(pool.clone())
        .connections(8)
        .call_timeout(Duration::from_millis(200))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let mut monitor = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut holder = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let hot = key("faults.frozen", &run_id(), 0);
    let mut tx = sqlx::Connection::begin(&mut holder)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim::<_, u64>(&mut tx, &hot, &0u64)
        .await;
    assert!(matches!(claim, Ok(Claim::Acquired(_))), "{claim:?}");

    let (workers, retries) = (16usize, 10usize);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (store, hot, outcomes) = (store.clone(), hot.clone(), outcomes.clone());
            tokio::spawn(async move {
                for _ in 0..retries {
                    let r = store.acquire(&hot, None, Duration::from_secs(30)).await;
                    let retryable = matches!(&r, Err(e) if e.is_retryable());
                    outcomes
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((retryable, format!("{r:?}")));
                    tokio::time::sleep(Duration::from_millis(2)).await; // redelivery delay
                }
            })
        })
        .collect();
    // Sample the server's client backends while the retries go on.
    let sampler = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut max = 0i64;
            while !done.load(Ordering::SeqCst) {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
                )
                .fetch_one(&mut monitor)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
                max = max.max(n);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            max
        })
    };
    for t in tasks {
        t.await.unwrap_or_else(|e| panic!("{e}"));
    }
    done.store(true, Ordering::SeqCst);
    let max_backends = sampler.await.unwrap_or_else(|e| panic!("{e}"));
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    let outcomes = outcomes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let unavailable = outcomes.iter().filter(|(r, _)| *r).count();
    let other: Vec<_> = outcomes.iter().filter(|(r, _)| !*r).collect();
    let after = store.acquire(&hot, None, Duration::from_secs(30)).await;
    // pool (4) + store (8) + the monitor and the holder
    let limit = 4 + 8 + 2;
    assert!(
        other.is_empty(),
        "calls behind the frozen holder: {other:?}"
    );
    assert!(
        max_backends <= limit,
        "{max_backends} server backends for a limit of {limit}"
    );
    assert!(
        matches!(&after, Ok(Acquisition::Acquired(l)) if l.attempt == 1),
        "after the holder let go: {after:?}"
    );
    report(
        "frozen-lock-holder-retries",
        Backend::Postgres,
        &[
            ("calls", outcomes.len().to_string()),
            ("unavailable", unavailable.to_string()),
            ("max_server_backends", max_backends.to_string()),
            ("backend_limit", limit.to_string()),
            ("left_reserved", "no".into()),
        ],
        started,
    );
}

/// PostgreSQL restarts while the store's 16 connections sit idle (all
/// dead after it); then a storm of 2,000 messages: no call fails (a
/// call whose connection the server had closed runs again on a fresh
/// one), 0 double effects, 0 lost.
///
/// The call timeout is 2 s here, not the 500 ms of the other fault
/// tests: what is tested is that a dead idle connection costs no call,
/// and on 2 busy cores 16 new backends of a server that just started
/// (cold caches) took longer than the 200 ms a 500 ms call leaves for
/// getting a connection ("no connection to PostgreSQL within 200ms",
/// 4 to 8 calls of a run in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_with_warm_idle_connections() {
    let started = Instant::now();
    let server = PgServer::start();
    let store = PgStore::builder(support::pg::pool(&server.url, 16).await)
        .connections(16)
        .call_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let pool = store.pool().clone();
    // Open all 16: 16 acquires wait on an in-transaction claim.
    let k = key("faults.warm", &run_id(), 0);
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim::<_, u64>(&mut tx, &k, &0u64)
        .await;
    assert!(matches!(claim, Ok(Claim::Acquired(_))), "{claim:?}");
    let warm: Vec<_> = (0..16)
        .map(|_| {
            let (store, k) = (store.clone(), k.clone());
            tokio::spawn(async move { store.acquire(&k, None, Duration::from_secs(30)).await })
        })
        .collect();
    until_waiting_on_locks(&pool, 16).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    for w in warm {
        let got = w.await.unwrap_or_else(|e| panic!("{e}"));
        assert!(got.is_ok(), "{got:?}");
    }
    server.stop();
    server.start_again();
    let s = storm(
        Backend::Postgres,
        fault_receiver(Arc::new(store)),
        FAULT_MESSAGES,
        32,
        None,
    )
    .await;
    assert_eq!(
        s.unavailable + s.failures,
        0,
        "calls failed after the restart"
    );
    assert_eq!(s.lost_completions, 0);
    report(
        "postgres-restart-warm-idle",
        Backend::Postgres,
        &[
            ("idle_connections", "16".into()),
            ("messages", FAULT_MESSAGES.to_string()),
            ("deliveries", s.deliveries.to_string()),
            ("failed_calls", (s.unavailable + s.failures).to_string()),
            ("double_effects", s.double_effects.to_string()),
            ("lost_completions", s.lost_completions.to_string()),
        ],
        started,
    );
}
