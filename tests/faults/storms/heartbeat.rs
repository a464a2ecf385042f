//! A handler that runs for several leases keeps its key: the heartbeat
//! renews the lease, duplicates meanwhile are "in progress".

use super::*;

/// A handler that runs for 5 leases keeps its key: the heartbeat renews the
/// lease, every duplicate delivered meanwhile is told "in progress", no
/// takeover happens, and the effect runs once.
async fn heartbeat_scenario(backend: Backend) {
    let started = Instant::now();
    let store = backend.store().await;
    let key = key("faults.heartbeat", &run_id(), 0);
    let ledger = Ledger::new(1);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let long = {
        let idem = Idempotency::from_arc(store.clone()).lease(SHORT_LEASE);
        let (key, ledger) = (key.clone(), ledger.clone());
        tokio::spawn(async move {
            idem.process_with(&key, None, |ctx| async move {
                ledger.effect(0);
                let _ = started_tx.send(());
                tokio::time::sleep(SHORT_LEASE * 5).await; // the handler's long work
                Ok::<_, std::convert::Infallible>(ctx.attempt)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    let duplicate = Idempotency::from_arc(store).lease(SHORT_LEASE);
    let mut rejected = 0;
    while !long.is_finished() {
        let out = duplicate
            .process_with(&key, None, |_| async {
                never::<u32>("no takeover while the heartbeat runs")
            })
            .await;
        match out {
            Err(IdemError::InProgress { .. }) => rejected += 1,
            Ok(Processed::Replayed(1)) => break, // it just finished
            other => panic!("a duplicate during the long handler got {other:?}"),
        }
        tokio::time::sleep(SHORT_LEASE / 4).await;
    }
    let out = long.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(out, Ok(Processed::Executed(1))),
        "the first attempt completes: {out:?}"
    );
    assert!(
        rejected >= 10,
        "duplicates kept arriving during the 5 leases: {rejected}"
    );
    assert_eq!(ledger.count(0), 1);
    report(
        "heartbeat-5-leases",
        backend,
        &[
            ("messages", "1".into()),
            ("deliveries", (rejected + 1).to_string()),
            ("in_progress_answers", rejected.to_string()),
            ("takeovers", "0".into()),
            ("effects", ledger.count(0).to_string()),
        ],
        started,
    );
}

#[tokio::test(start_paused = true)]
async fn memory() {
    heartbeat_scenario(Backend::Memory).await
}
on_backends!(heartbeat_scenario; postgres => Backend::Postgres, redis => Backend::Redis,
    redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
