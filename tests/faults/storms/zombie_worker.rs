//! A worker that stalls past its lease (a zombie): its late completion is
//! fenced off, the new owner's result stands; in the in-transaction mode a
//! stalled transaction keeps its key and a duplicate waits for it.

use super::*;

/// A worker stalls past its lease (heartbeat off, so nothing renews it);
/// another worker takes the key over and completes it. When the zombie
/// wakes up and finishes, its completion is fenced off with `LeaseLost`,
/// the new owner's result stands, and replays return it.
async fn zombie_scenario(backend: Backend) {
    let started = Instant::now();
    let store = backend.store().await;
    let key = key("faults.zombie", &run_id(), 0);
    let ledger = Ledger::new(1);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (wake_tx, wake_rx) = tokio::sync::oneshot::channel::<()>();
    let zombie = {
        let idem = Idempotency::from_arc(store.clone())
            .lease(SHORT_LEASE)
            .heartbeat(false);
        let (key, ledger) = (key.clone(), ledger.clone());
        tokio::spawn(async move {
            idem.process_with(&key, None, |_| async move {
                let _ = started_tx.send(());
                let _ = wake_rx.await;
                ledger.effect(0);
                Ok::<_, std::convert::Infallible>(1u64)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));

    let idem = Idempotency::from_arc(store)
        .lease(Duration::from_secs(30))
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(10),
            poll: Duration::from_millis(50),
        });
    let new_owner = {
        let ledger = ledger.clone();
        idem.process_with(&key, None, |ctx| async move {
            assert_eq!(ctx.attempt, 2, "the new owner takes over as attempt 2");
            ledger.effect(0);
            Ok::<_, std::convert::Infallible>(2u64)
        })
        .await
    };
    assert!(
        matches!(new_owner, Ok(Processed::Executed(2))),
        "{new_owner:?}"
    );

    let _ = wake_tx.send(());
    let zombie = zombie.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(zombie, Err(IdemError::LeaseLost)),
        "the zombie is fenced off: {zombie:?}"
    );
    let replay = idem
        .process_with(&key, None, |_| async {
            never::<u64>("a completed key never runs again")
        })
        .await;
    assert!(
        matches!(replay, Ok(Processed::Replayed(2))),
        "replays return the new owner's result: {replay:?}"
    );
    report(
        "zombie-worker",
        backend,
        &[
            ("messages", "1".into()),
            ("deliveries", "3".into()),
            ("zombie_completion", "LeaseLost".into()),
            ("replayed", "new-owner".into()),
            ("effects", ledger.count(0).to_string()),
        ],
        started,
    );
}

/// MemoryStore on paused time: the lease runs out without waiting.
#[tokio::test(start_paused = true)]
async fn memory() {
    zombie_scenario(Backend::Memory).await
}
on_backends!(zombie_scenario; postgres => Backend::Postgres, redis => Backend::Redis,
    redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);

/// The in-transaction mode has no lease to run out: a stalled transaction
/// keeps the key, a duplicate waits on it (it does not take over), and
/// replays the stalled one's result once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_stalled_transaction_is_waited_for() {
    let started = Instant::now();
    let store = pg_store().await;
    let Receiver::Tx { ledger, .. } = Receiver::tx(store.clone()).await else {
        unreachable!()
    };
    let key = key("faults.zombie", &run_id(), 0);
    let (mut tx, lease) = claim_with_effect(&store, &ledger, &key).await;

    let receiver = Receiver::Tx {
        store: store.clone(),
        ledger: ledger.clone(),
    };
    let duplicate = {
        let (receiver, key) = (receiver.clone(), key.clone());
        tokio::spawn(async move { receiver.deliver(&key, 0, &Ledger::new(1)).await })
    };
    // The duplicate is blocked on the stalled transaction's row: PostgreSQL
    // shows a session waiting on this transaction's backend.
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let waiting = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        )
        .bind(holder)
        .fetch_one(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while waiting().await == 0 {
        assert!(
            Instant::now() < deadline,
            "the duplicate never waited on the lock"
        );
        tokio::task::yield_now().await;
    }
    assert!(
        !duplicate.is_finished(),
        "the duplicate waits; it does not take over"
    );
    lease
        .complete(&mut tx, &21u64)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let out = duplicate.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(out, Delivery::Replayed(21)), "{out:?}");
    let effects = receiver.effects(&Ledger::new(1), 1).await;
    assert_eq!(effects, vec![1]);
    report(
        "zombie-worker",
        Backend::PostgresTx,
        &[
            ("messages", "1".into()),
            ("deliveries", "2".into()),
            ("zombie_completion", "committed-duplicate-waited".into()),
            ("replayed", "stalled-transaction".into()),
            ("effects", effects[0].to_string()),
        ],
        started,
    );
}
