//! Callers that go away mid-handler, attached (the key stays reserved,
//! taken over after the lease) and detached (the handler runs on and is
//! recorded).

use super::*;

/// Waits (bounded) until the record of `key` is completed.
async fn until_completed(store: &Arc<dyn IdempotencyStore>, key: &IdempotencyKey) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(record)) = store.get(key).await {
            if record.is_completed() {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{key} never completed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A caller that goes away mid-handler (a task aborted, an HTTP client that
/// disconnects). Attached: the key is not released (the handler was cut off
/// after an unknown part of its effects); after the lease the next delivery
/// takes it over as attempt 2 with a higher fence. Detached: the handler
/// runs on, its result is recorded, the retry gets "in progress" and then
/// the replay; one effect.
async fn cancelled_caller_scenario(backend: Backend) {
    use std::convert::Infallible;
    let started = Instant::now();
    let lease = Duration::from_millis(400);
    let store = backend.store().await;
    let idem = Idempotency::from_arc(store.clone()).lease(lease);
    let run = run_id();

    let k = key("faults.cancel", &run, 0);
    let (fence_tx, fence_rx) = tokio::sync::oneshot::channel();
    let caller = {
        let (idem, k) = (idem.clone(), k.clone());
        tokio::spawn(async move {
            idem.process_with(&k, None, |cx| async move {
                let _ = fence_tx.send(cx.fence);
                std::future::pending::<Result<u64, Infallible>>().await
            })
            .await
        })
    };
    let first_fence = fence_rx.await.unwrap_or_else(|e| panic!("{e}"));
    caller.abort();
    let _ = caller.await;
    let held = store.acquire(&k, None, lease).await;
    assert!(
        matches!(held, Ok(Acquisition::InProgress { attempt: 1, .. })),
        "a dropped caller released the key: {held:?}"
    );
    tokio::time::sleep(lease + Duration::from_millis(100)).await; // the lease runs out
    let again = idem
        .process_with(&k, None, |cx| async move {
            Ok::<_, Infallible>((cx.attempt, cx.fence))
        })
        .await;
    let (attempt, fence) = match again {
        Ok(Processed::Executed(seen)) => seen,
        other => panic!("after the lease: {other:?}"),
    };
    assert_eq!(attempt, 2);
    assert!(fence > first_fence, "fence {fence} after {first_fence}");

    let k = key("faults.cancel", &run, 1);
    let effects = Arc::new(AtomicU32::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let caller = {
        let (idem, k, effects, gate) = (idem.clone(), k.clone(), effects.clone(), gate.clone());
        tokio::spawn(async move {
            idem.process_with_detached(&k, None, move |_| async move {
                let _ = started_tx.send(());
                gate.notified().await;
                effects.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Infallible>(7u64)
            })
            .await
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    caller.abort(); // the client goes away
    let _ = caller.await;
    let retry = idem
        .process_with(&k, None, |_| async { never::<u64>("it still runs") })
        .await;
    assert!(
        matches!(retry, Err(IdemError::InProgress { .. })),
        "{retry:?}"
    );
    gate.notify_one();
    until_completed(&store, &k).await;
    let replay = idem
        .process_with(&k, None, |_| async { never::<u64>("it was recorded") })
        .await;
    assert!(matches!(replay, Ok(Processed::Replayed(7))), "{replay:?}");
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    report(
        "cancelled-caller",
        backend,
        &[
            ("attached_released", "no".into()),
            ("takeover_attempt", attempt.to_string()),
            ("fence_increased", "yes".into()),
            (
                "detached_effects",
                effects.load(Ordering::SeqCst).to_string(),
            ),
            ("detached_retry", "in-progress-then-replayed".into()),
        ],
        started,
    );
}

on_backends!(cancelled_caller_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
    redis => Backend::Redis, redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
