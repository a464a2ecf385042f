//! A worker's handler killed mid-way, its process dead before it can
//! release the key: the redelivery takes the key over after the lease.

use super::*;

/// A worker's handler is killed mid-way (before its side effect, or after
/// the effect started), and its process dies before it can release the key.
/// After the lease, the redelivery takes the key over as attempt 2: with an
/// effect outside the store, the effect that had started is done again
/// (at-least-once, and `attempt` tells the handler); before the effect,
/// it runs once.
async fn crash_scenario(backend: Backend, effect_started: bool) {
    let started = Instant::now();
    let store = backend.store().await;
    let run = run_id();
    let key = key("faults.crash", &run, 0);
    let ledger = Ledger::new(1);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    // The worker's process dies before it can release the key.
    let dying = Tap::new(store.clone());
    dying.drop_releases(true);
    let dying = Idempotency::new(dying).lease(SHORT_LEASE);
    let worker = {
        let (key, ledger) = (key.clone(), ledger.clone());
        tokio::spawn(async move {
            let _ = dying
                .process_with(&key, None, |_| async move {
                    if effect_started {
                        ledger.effect(0);
                    }
                    let _ = started_tx.send(());
                    std::future::pending::<Result<u64, std::convert::Infallible>>().await
                })
                .await;
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    worker.abort();
    let _ = worker.await;

    // The redelivery waits out the dead worker's lease, then takes over.
    let idem = Idempotency::from_arc(store)
        .lease(SHORT_LEASE)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(10),
            poll: Duration::from_millis(50),
        });
    let attempt = Arc::new(AtomicU32::new(0));
    let out = {
        let (ledger, attempt) = (ledger.clone(), attempt.clone());
        idem.process_with(&key, None, |ctx| async move {
            attempt.store(ctx.attempt, Ordering::SeqCst);
            ledger.effect(0);
            Ok::<_, std::convert::Infallible>(7u64)
        })
        .await
    };
    assert!(matches!(out, Ok(Processed::Executed(7))), "{out:?}");
    assert_eq!(
        attempt.load(Ordering::SeqCst),
        2,
        "the takeover runs as attempt 2"
    );
    let expected = if effect_started { 2 } else { 1 };
    assert_eq!(ledger.count(0), expected);
    report(
        if effect_started {
            "crash-after-effect"
        } else {
            "crash-before-effect"
        },
        backend,
        &[
            ("messages", "1".into()),
            ("deliveries", "2".into()),
            (
                "takeover_attempt",
                attempt.load(Ordering::SeqCst).to_string(),
            ),
            ("effects", ledger.count(0).to_string()),
        ],
        started,
    );
}

/// In the in-transaction mode the effect is a row of the same transaction:
/// a worker killed after writing it rolls back with its reservation, and
/// the redelivery's effect is the only one.
async fn crash_tx_scenario() {
    let started = Instant::now();
    let store = pg_store().await;
    let Receiver::Tx { ledger, .. } = Receiver::tx(store.clone()).await else {
        unreachable!()
    };
    let key = key("faults.crash", &run_id(), 0);
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let worker = {
        let (store, ledger, key) = (store.clone(), ledger.clone(), key.clone());
        tokio::spawn(async move {
            let (_tx, _lease) = claim_with_effect(&store, &ledger, &key).await;
            let _ = started_tx.send(());
            std::future::pending::<()>().await;
        })
    };
    started_rx.await.unwrap_or_else(|e| panic!("{e}"));
    worker.abort();
    let _ = worker.await;
    let receiver = Receiver::Tx {
        store: store.clone(),
        ledger,
    };
    let ledger_unused = Ledger::new(1);
    let out = receiver.deliver(&key, 0, &ledger_unused).await;
    assert!(matches!(out, Delivery::Executed(_)), "{out:?}");
    let effects = receiver.effects(&ledger_unused, 1).await;
    assert_eq!(
        effects,
        vec![1],
        "the killed transaction's effect rolled back"
    );
    report(
        "crash-after-effect",
        Backend::PostgresTx,
        &[
            ("messages", "1".into()),
            ("deliveries", "2".into()),
            ("takeover_attempt", "1".into()),
            ("effects", effects[0].to_string()),
        ],
        started,
    );
}

/// Killed before the side effect: it runs once.
async fn before_the_effect(backend: Backend) {
    crash_scenario(backend, false).await
}

/// Killed after the side effect started: it runs again (at-least-once).
async fn after_the_effect_started(backend: Backend) {
    crash_scenario(backend, true).await
}

/// A module per backend holding both tests.
macro_rules! crash_tests {
    ($($name:ident: $backend:expr),*) => {$(
        mod $name {
            use super::*;
            on_backends!(super::before_the_effect; before_the_effect => $backend);
            on_backends!(super::after_the_effect_started; after_the_effect_started => $backend);
        }
    )*};
}
crash_tests!(memory: Backend::Memory, postgres: Backend::Postgres, redis: Backend::Redis,
             redis_cluster: Backend::RedisCluster, tiered: Backend::Tiered);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_never_doubles_the_effect() {
    crash_tx_scenario().await
}
