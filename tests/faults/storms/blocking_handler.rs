//! A handler that blocks its thread: the heartbeat still keeps its lease.

use super::*;

/// A handler that blocks its thread for four leases (a synchronous client,
/// a long computation) on a 2-worker runtime: the heartbeat, on its own
/// task, keeps the lease; duplicates every 50 ms are all "in progress", none
/// takes the key over.
async fn blocking_handler_scenario(backend: Backend) {
    let started = Instant::now();
    let lease = Duration::from_millis(300);
    let store = backend.store().await;
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    let k = key("faults.blocking", &run_id(), 0);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let worker = {
        let (idem, k) = (idem.clone(), k.clone());
        tokio::spawn(async move {
            idem.process_with(&k, None, |_| async move {
                let _ = started_tx.send(());
                std::thread::sleep(lease * 4);
                Ok::<_, std::convert::Infallible>(1u64)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    let (mut duplicates, mut takeovers) = (0, 0);
    while !worker.is_finished() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match store.acquire(&k, None, lease).await {
            Ok(Acquisition::InProgress { .. }) => duplicates += 1,
            Ok(Acquisition::Acquired(stolen)) => {
                takeovers += 1;
                let _ = store.release(&stolen).await;
            }
            Ok(Acquisition::Completed(_)) => break,
            other => panic!("{other:?}"),
        }
    }
    let out = worker.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(takeovers, 0, "a blocked handler's lease ran out");
    assert!(matches!(out, Ok(Processed::Executed(1))), "{out:?}");
    report(
        "blocking-handler",
        backend,
        &[
            ("blocked_ms", (lease * 4).as_millis().to_string()),
            ("duplicates", duplicates.to_string()),
            ("takeovers", takeovers.to_string()),
        ],
        started,
    );
}

on_backends!(blocking_handler_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
    redis => Backend::Redis, redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
