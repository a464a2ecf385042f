//! The receivers' in-transaction runner (`TxRunner`) on PostgreSQL: the
//! claim, the handler's INSERT and the result commit together or not at
//! all. A duplicate waits for the open transaction (at the runner's gate
//! in one process, in the database across processes) and replays; an
//! error, a panic or a failed commit keep nothing; a handler that keeps or
//! ends its transaction never runs twice; 64 duplicates on a pool of 8
//! run once.

use crate::support;
use crate::support::ledger::{pg_store, BoxError, Ledger};

use std::sync::Arc;
use std::time::Duration;

use idemkit::postgres::{PgStore, PgTx};
use idemkit::{
    Context, IdemError, Idempotency, IdempotencyKey, IdempotencyStore, Processed, Runner, TxRunner,
};

fn key(id: &str) -> IdempotencyKey {
    IdempotencyKey::new("tx.runner", format!("{id}-{:08x}", fastrand::u32(..)))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A handler that inserts the row of `id` and answers its fence.
fn pays(
    ledger: &Ledger,
    id: &str,
) -> impl FnOnce(Context, PgTx) -> futures::future::BoxFuture<'static, Result<u64, BoxError>> {
    let (ledger, id) = (ledger.clone(), id.to_owned());
    move |context: Context, tx: PgTx| {
        Box::pin(async move {
            ledger.insert(&tx, &id, context.fence).await?;
            Ok(context.fence)
        })
    }
}

async fn setup(connections: u32) -> (PgStore, Idempotency<PgStore>, Ledger) {
    let store = pg_store(connections).await;
    let ledger = Ledger::create(store.pool(), "tx_runner").await;
    (store.clone(), Idempotency::new(store), ledger)
}

/// A run commits its row with its record; the duplicate replays the
/// fence the run was given, and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_commits_its_write_with_its_record_and_the_duplicate_replays() {
    let (store, idem, ledger) = setup(4).await;
    let runner = TxRunner::new();
    let k = key("pay");
    let first = runner
        .process_one(&idem, &k, None, pays(&ledger, "p"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let Processed::Executed(fence) = first else {
        panic!("first: {first:?}")
    };
    let again = runner
        .process_one(&idem, &k, None, pays(&ledger, "p"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(again, Processed::Replayed(f) if f == fence));
    assert_eq!(ledger.rows("p").await, 1);
    assert_eq!(ledger.runs(), 1);
    let record = store.get(&k).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(record.map(|r| r.fence), Some(fence));
    assert!(runner.gate().is_empty(), "the gate keeps no key");
}

/// A duplicate from another process (another runner: another gate)
/// waits in the database for the open transaction, then replays; one
/// whose wait is shorter than the transaction is told "in progress" and
/// keeps nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_of_another_process_waits_for_the_open_transaction_then_replays() {
    let (store, idem, ledger) = setup(8).await;
    let k = key("wait");
    let open = Arc::new(tokio::sync::Semaphore::new(0));
    let inserted = Arc::new(tokio::sync::Notify::new());
    let first = {
        let (idem, k, ledger, open, inserted) = (
            idem.clone(),
            k.clone(),
            ledger.clone(),
            open.clone(),
            inserted.clone(),
        );
        tokio::spawn(async move {
            TxRunner::new()
                .process_one(
                    &idem,
                    &k,
                    None,
                    move |context: Context, tx: PgTx| async move {
                        ledger.insert(&tx, "w", context.fence).await?;
                        inserted.notify_one();
                        let _permit = open.acquire().await;
                        Ok::<_, BoxError>(context.fence)
                    },
                )
                .await
        })
    };
    inserted.notified().await;
    // Another process with a short wait: in progress, nothing kept.
    let impatient = TxRunner::new()
        .wait(Duration::from_millis(200))
        .process_one(&idem, &k, None, pays(&ledger, "w"))
        .await;
    assert!(
        matches!(impatient, Err(IdemError::InProgress { .. })),
        "{impatient:?}"
    );
    // Another process that waits: it waits on the open transaction.
    let second = {
        let (idem, k, ledger) = (idem.clone(), k.clone(), ledger.clone());
        tokio::spawn(async move {
            TxRunner::new()
                .process_one(&idem, &k, None, pays(&ledger, "w"))
                .await
        })
    };
    support::pg::until_waiting_on_locks(store.pool(), 1).await;
    open.add_permits(1);
    let first = first
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let second = second
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(first, Processed::Executed(_)));
    assert!(
        matches!(second, Processed::Replayed(f) if f == *first.value()),
        "{second:?}"
    );
    assert_eq!(ledger.rows("w").await, 1);
    assert_eq!(ledger.runs(), 1);
}

/// A handler's error, a panic after its INSERT, and a commit that fails
/// keep nothing; the next run commits one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_a_panic_or_a_failed_commit_keep_nothing_and_the_next_run_commits_once() {
    let (_store, idem, ledger) = setup(4).await;
    let runner = TxRunner::new();
    let k = key("fails");
    let l = ledger.clone();
    let failed = runner
        .process_one(
            &idem,
            &k,
            None,
            move |context: Context, tx: PgTx| async move {
                l.insert(&tx, "f", context.fence).await?;
                Err::<u64, BoxError>("declined by the bank".into())
            },
        )
        .await;
    assert!(matches!(failed, Err(IdemError::Handler(_))), "{failed:?}");
    let l = ledger.clone();
    let panicked = runner
        .process_one(
            &idem,
            &k,
            None,
            move |context: Context, tx: PgTx| async move {
                l.insert(&tx, "f", context.fence).await?;
                panic!(
                    "the handler panics after its INSERT (fence {})",
                    context.fence
                );
                #[allow(unreachable_code)]
                Ok::<u64, BoxError>(0)
            },
        )
        .await;
    assert!(
        matches!(panicked, Err(IdemError::Panicked { .. })),
        "{panicked:?}"
    );
    let l = ledger.clone();
    let refused = runner
        .process_one(
            &idem,
            &k,
            None,
            move |context: Context, tx: PgTx| async move {
                l.insert(&tx, "f", context.fence).await?;
                l.break_commit(&tx).await?;
                Ok::<u64, BoxError>(context.fence)
            },
        )
        .await;
    match &refused {
        Err(IdemError::Store(e)) => assert!(!e.is_retryable(), "a refused commit: {e}"),
        other => panic!("a refused commit: {other:?}"),
    }
    assert_eq!(ledger.rows("f").await, 0, "nothing was kept");
    let ran = runner
        .process_one(&idem, &k, None, pays(&ledger, "f"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(ran, Processed::Executed(_)));
    assert_eq!(ledger.rows("f").await, 1);
    assert_eq!(ledger.runs(), 4);
}

/// A handler that keeps its transaction past its return is rolled back
/// (nothing kept, told so); one that ends it itself (ROLLBACK, then a
/// write on its own) is completed "not replayable": its duplicate is
/// never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_keeps_or_ends_its_transaction_never_runs_twice() {
    let (_store, idem, ledger) = setup(4).await;
    let runner = TxRunner::new().wait(Duration::from_millis(300));
    let k = key("keeps");
    let (kept_tx, kept_rx) = tokio::sync::oneshot::channel();
    let l = ledger.clone();
    let kept = runner
        .process_one(
            &idem,
            &k,
            None,
            move |context: Context, tx: PgTx| async move {
                l.insert(&tx, "k", context.fence).await?;
                let guard = tx.lock().await?;
                let _ = kept_tx.send(guard);
                Ok::<u64, BoxError>(context.fence)
            },
        )
        .await;
    assert!(matches!(kept, Err(IdemError::Store(_))), "{kept:?}");
    drop(kept_rx);
    assert_eq!(ledger.rows("k").await, 0);

    let k = key("ends");
    let l = ledger.clone();
    let ended = runner
        .process_one(
            &idem,
            &k,
            None,
            move |context: Context, tx: PgTx| async move {
                {
                    let mut conn = tx.lock().await?;
                    sqlx::query("ROLLBACK").execute(&mut *conn).await?;
                }
                // On its own now (autocommit).
                l.insert(&tx, "e", context.fence).await?;
                Ok::<u64, BoxError>(context.fence)
            },
        )
        .await;
    assert!(
        matches!(ended, Ok(Processed::ExecutedNotReplayable { .. })),
        "{ended:?}"
    );
    let again = runner
        .process_one(&idem, &k, None, pays(&ledger, "e"))
        .await;
    assert!(
        matches!(again, Err(IdemError::ResultUnavailable { .. })),
        "{again:?}"
    );
    assert_eq!(ledger.rows("e").await, 1);
}

/// A result that does not encode (NaN) or is over the store's limit
/// commits the write with the "not replayable" marker: the duplicate gets
/// `ResultUnavailable`, never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_that_cannot_be_recorded_commits_not_replayable() {
    let small = PgStore::builder(support::pg::pool(support::pg::shared_url(), 4).await)
        .max_response_bytes(64)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    small.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let ledger = Ledger::create(small.pool(), "tx_runner").await;
    let idem = Idempotency::new(small);
    let runner = TxRunner::new();
    let l = ledger.clone();
    let nan = key("nan");
    let ran = runner
        .process_one(
            &idem,
            &nan,
            None,
            move |context: Context, tx: PgTx| async move {
                l.insert(&tx, "nan", context.fence).await?;
                Ok::<f64, BoxError>(f64::NAN)
            },
        )
        .await;
    assert!(
        matches!(ran, Ok(Processed::ExecutedNotReplayable { .. })),
        "{ran:?}"
    );
    let l = ledger.clone();
    let large = key("large");
    let ran = runner
        .process_one(
            &idem,
            &large,
            None,
            move |context: Context, tx: PgTx| async move {
                l.insert(&tx, "large", context.fence).await?;
                Ok::<String, BoxError>("x".repeat(1 << 20))
            },
        )
        .await;
    assert!(
        matches!(ran, Ok(Processed::ExecutedNotReplayable { .. })),
        "{ran:?}"
    );
    for (k, id) in [(&nan, "nan"), (&large, "large")] {
        let again = runner.process_one(&idem, k, None, pays(&ledger, id)).await;
        assert!(
            matches!(again, Err(IdemError::ResultUnavailable { .. })),
            "{id}: {again:?}"
        );
        assert_eq!(ledger.rows(id).await, 1, "{id}");
    }
    assert_eq!(ledger.runs(), 2);
}

/// 64 duplicates of one key at once, on a pool of 8 connections, from
/// two runners (two processes): they wait without holding the pool, the
/// key runs once, and every duplicate gets its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_duplicates_on_a_pool_of_eight_run_once_and_all_replay() {
    let (_store, idem, ledger) = setup(8).await;
    let runners = [TxRunner::new(), TxRunner::new()];
    let k = key("storm");
    let calls = (0..64).map(|i| {
        let (runner, idem, k, ledger) = (
            runners[i % 2].clone(),
            idem.clone(),
            k.clone(),
            ledger.clone(),
        );
        tokio::spawn(async move {
            runner
                .process_one(
                    &idem,
                    &k,
                    None,
                    move |context: Context, tx: PgTx| async move {
                        ledger.insert(&tx, "s", context.fence).await?;
                        // The transaction stays open a while: the others wait.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Ok::<_, BoxError>(context.fence)
                    },
                )
                .await
        })
    });
    let outcomes = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(calls))
        .await
        .unwrap_or_else(|_| panic!("64 duplicates did not end in 60 s"));
    let (mut executed, mut replayed) = (0, 0);
    for outcome in outcomes {
        match outcome.unwrap_or_else(|e| panic!("{e}")) {
            Ok(Processed::Executed(_)) => executed += 1,
            Ok(Processed::Replayed(_)) => replayed += 1,
            other => panic!("a duplicate: {other:?}"),
        }
    }
    assert_eq!((executed, replayed), (1, 63));
    assert_eq!(ledger.rows("s").await, 1);
    assert_eq!(ledger.runs(), 1);
    assert!(runners.iter().all(|r| r.gate().is_empty()));
}

/// A batch mixing fresh keys, a key twice and a completed key, with 3
/// transactions at once (`batch_concurrency`) on a pool of 8: each key
/// runs once, the key that appears twice replays to its second item, and
/// no more than 3 transactions are open at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_each_key_once_within_its_concurrency() {
    let (_store, idem, ledger) = setup(8).await;
    let idem = idem.batch_concurrency(3);
    let runner = TxRunner::new();
    let done = key("done");
    runner
        .process_one(&idem, &done, None, pays(&ledger, "done"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let twice = key("twice");
    type Handler = Box<
        dyn FnOnce(Context, PgTx) -> futures::future::BoxFuture<'static, Result<u64, BoxError>>
            + Send,
    >;
    let boxed = |id: &str| Box::new(pays(&ledger, id)) as Handler;
    let mut items: Vec<(IdempotencyKey, Option<idemkit::Fingerprint>, Handler)> = vec![
        (twice.clone(), None, boxed("twice")),
        (done.clone(), None, boxed("done")),
        (twice.clone(), None, boxed("twice")),
    ];
    // The transactions open at once, and the most seen.
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for i in 0..20 {
        let id = format!("b{i}");
        let (pay, open, most) = (pays(&ledger, &id), open.clone(), most.clone());
        items.push((
            key(&id),
            None,
            Box::new(move |context: Context, tx: PgTx| {
                let now = open.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                most.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                let run = pay(context, tx);
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let out = run.await;
                    open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    out
                }) as futures::future::BoxFuture<'static, Result<u64, BoxError>>
            }) as Handler,
        ));
    }
    let outcomes = runner.process_batch(&idem, items).await;
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        most <= 3,
        "{most} transactions at once, batch_concurrency 3"
    );
    assert_eq!(outcomes.len(), 23);
    assert!(matches!(outcomes[0], Ok(Processed::Executed(_))));
    assert!(matches!(outcomes[1], Ok(Processed::Replayed(_))));
    assert!(matches!(outcomes[2], Ok(Processed::Replayed(_))));
    assert!(outcomes[3..]
        .iter()
        .all(|o| matches!(o, Ok(Processed::Executed(_)))));
    assert_eq!(ledger.total().await, 22);
    assert!(ledger.doubles().await.is_empty());
}

/// A wait of zero (taken as 1 ms) or `Duration::MAX` (as long as the
/// database lets a claim wait) runs a key and replays it like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_of_zero_and_duration_max_run_and_replay() {
    let (_store, idem, ledger) = setup(4).await;
    for (name, wait) in [("zero", Duration::ZERO), ("max", Duration::MAX)] {
        let runner = TxRunner::new().wait(wait);
        let k = key(name);
        let first = runner
            .process_one(&idem, &k, None, pays(&ledger, name))
            .await;
        assert!(
            matches!(first, Ok(Processed::Executed(_))),
            "{name}: {first:?}"
        );
        let again = runner
            .process_one(&idem, &k, None, pays(&ledger, name))
            .await;
        assert!(
            matches!(again, Ok(Processed::Replayed(_))),
            "{name}: {again:?}"
        );
        assert_eq!(ledger.rows(name).await, 1);
    }
}

/// The attempts the handlers of a test saw, in order.
type Seen = Arc<std::sync::Mutex<Vec<u32>>>;

/// A handler that notes its attempt and fails.
fn fails(
    seen: &Seen,
) -> impl FnOnce(Context, PgTx) -> futures::future::BoxFuture<'static, Result<u64, BoxError>> {
    let seen = seen.clone();
    move |context: Context, _tx: PgTx| {
        Box::pin(async move {
            seen.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(context.attempt);
            Err::<u64, BoxError>("fails".into())
        })
    }
}

/// Runs `key` on a new runner with a handler that notes its attempt and
/// commits.
async fn commits_noting_its_attempt(
    idem: &Idempotency<PgStore>,
    key: &IdempotencyKey,
    seen: &Seen,
) {
    let seen = seen.clone();
    let ran = TxRunner::new()
        .process_one(
            idem,
            key,
            None,
            move |context: Context, _tx: PgTx| async move {
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(context.attempt);
                Ok::<u64, BoxError>(context.fence)
            },
        )
        .await;
    assert!(matches!(ran, Ok(Processed::Executed(_))), "{ran:?}");
}

/// Runs `key` in a runtime of its own (a process of its own, with its own
/// pool) whose handler says its attempt and hangs, then drops that
/// runtime under it: a consumer that dies mid-transaction.
fn crash(key: &IdempotencyKey, seen: &Seen) {
    let (key, seen) = (key.clone(), seen.clone());
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let (started, running) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let idem = Idempotency::new(pg_store(2).await);
            let _ = TxRunner::new()
                .process_one(&idem, &key, None, move |context: Context, _tx: PgTx| {
                    seen.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(context.attempt);
                    let _ = started.send(());
                    std::future::pending::<Result<u64, BoxError>>()
                })
                .await;
        });
        running
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("the run never started: {e}"));
        // The process dies: its connections close, the server rolls back.
        runtime.shutdown_background();
    })
    .join()
    .unwrap_or_else(|_| panic!("the crashing thread panicked"));
}

/// A run cut off by a crash leaves no trace in its transaction, so the
/// runner counts the runs started and not seen to end: the handler's
/// `attempt` is 1, 2, 3 across two crashes; a run seen to end (a failure:
/// the receiver counts those) forgets the count, and so does `forget` (a
/// message dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attempt_counts_the_runs_cut_off_by_a_crash_until_one_is_seen_to_end() {
    let (_store, idem, ledger) = setup(4).await;
    let runner = TxRunner::new();
    let k = key("starts");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    crash(&k, &seen);
    crash(&k, &seen);
    for _ in 0..2 {
        let out = runner.process_one(&idem, &k, None, fails(&seen)).await;
        assert!(matches!(out, Err(IdemError::Handler(_))), "{out:?}");
    }
    crash(&k, &seen);
    runner.forget(&idem, &k).await;
    let s = seen.clone();
    let l = ledger.clone();
    let ran = runner
        .process_one(
            &idem,
            &k,
            None,
            move |context: Context, tx: PgTx| async move {
                s.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(context.attempt);
                l.insert(&tx, "starts", context.fence).await?;
                Ok::<u64, BoxError>(context.fence)
            },
        )
        .await;
    assert!(matches!(ran, Ok(Processed::Executed(_))), "{ran:?}");
    assert_eq!(
        *seen.lock().unwrap_or_else(|p| p.into_inner()),
        [1, 2, 3, 1, 1, 1],
        "crash, crash, failure (seen to end), failure, crash, forget, commit"
    );
    assert_eq!(ledger.rows("starts").await, 1);
}

/// A run that fails while a run of another process waits for its key:
/// its count is released before its rollback lets the key go, so the
/// waiting run does not count it (attempt 1); and that release, late (the
/// proxy holds it back 1.5 s), is made with the run's own token, so it
/// never erases the count of the waiting run, which crashes: the next run
/// sees one run cut off (attempt 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_of_a_failed_run_neither_counts_it_nor_erases_a_crash_after_it() {
    let (store, idem, _ledger) = setup(4).await;
    let (proxy, proxied) = support::pg::proxied().await;
    let through = Idempotency::new(PgStore::new(support::pg::pool(&proxied, 4).await));
    let k = key("late-release");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let (fail_tx, fail) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let (k, s) = (k.clone(), seen.clone());
        tokio::spawn(async move {
            TxRunner::new()
                .process_one(
                    &through,
                    &k,
                    None,
                    move |context: Context, _tx: PgTx| async move {
                        s.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(context.attempt);
                        let _ = started_tx.send(());
                        let _ = fail.await;
                        Err::<u64, BoxError>("the bank is down".into())
                    },
                )
                .await
        })
    };
    started.await.unwrap_or_else(|e| panic!("{e}"));
    // The first run's release (its first DELETE through the proxy) is late.
    proxy.delay_requests_to(b"DELETE FROM", Duration::from_millis(1500));
    let crashed = {
        let (k, s) = (k.clone(), seen.clone());
        tokio::task::spawn_blocking(move || crash(&k, &s))
    };
    support::pg::until_waiting_on_locks(store.pool(), 1).await;
    let _ = fail_tx.send(());
    crashed.await.unwrap_or_else(|e| panic!("{e}"));
    let out = first.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(out, Err(IdemError::Handler(_))), "{out:?}");
    commits_noting_its_attempt(&idem, &k, &seen).await;
    assert_eq!(
        *seen.lock().unwrap_or_else(|p| p.into_inner()),
        [1, 1, 2],
        "a failure seen to end, a run cut off by a crash, then a run after one crash"
    );
}

/// Three runs, each of another process, lose their transaction to a
/// failover (the proxy cut for 1 s, shorter than the runner's wait): the
/// commit fails, and the release of their count is tried again until the
/// store is back, so none of them counts as a run cut off: the next run,
/// on a sound database, is attempt 1 and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_whose_transactions_a_short_failover_lost_do_not_count_as_cut_off() {
    let (_store, idem, ledger) = setup(4).await;
    let (proxy, proxied) = support::pg::proxied().await;
    let proxy = Arc::new(proxy);
    let k = key("failover");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    for _ in 0..3 {
        let through = Idempotency::new(PgStore::new(support::pg::pool(&proxied, 4).await));
        let (s, l, p) = (seen.clone(), ledger.clone(), proxy.clone());
        let out = TxRunner::new()
            .process_one(
                &through,
                &k,
                None,
                move |context: Context, tx: PgTx| async move {
                    s.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(context.attempt);
                    l.insert(&tx, "failover", context.fence).await?;
                    // The failover: every connection cut, back after 1 s.
                    p.cut(true);
                    let back = p.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        back.cut(false);
                    });
                    Ok::<u64, BoxError>(context.fence)
                },
            )
            .await;
        assert!(matches!(out, Err(IdemError::Store(_))), "{out:?}");
    }
    commits_noting_its_attempt(&idem, &k, &seen).await;
    assert_eq!(
        *seen.lock().unwrap_or_else(|p| p.into_inner()),
        [1, 1, 1, 1]
    );
    assert_eq!(
        ledger.rows("failover").await,
        0,
        "no lost transaction kept its row"
    );
}
