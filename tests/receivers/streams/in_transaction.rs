//! The consumer's in-transaction form (`run_in_transaction`, keys in
//! PostgreSQL, the stream in Redis): the claim, the handler's INSERT and
//! the result commit together, before the acknowledgement. A consumer
//! killed (SIGKILL) between its INSERT and the commit leaves nothing, and
//! the reclaimed entry commits one row; a panic or an error keeps nothing;
//! 64 copies of an entry on two consumers and a pool of 8 connections
//! commit one row.

use crate::support;
use crate::support::ledger::{pg_store, BoxError, Ledger};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::postgres::{PgStore, PgTx};
use idemkit::redis::streams::{StreamConsumer, StreamEntry};
use idemkit::Idempotency;

use super::{consumer_on, pending, xadd, Check};

/// Tells a child process of this binary to be the consumer that is killed
/// (its value: stream, ledger table).
const KILLED_CONSUMER: &str = "IDEM_TEST_STREAMS_TX_CONSUMER";

/// The entry whose run the killed consumer holds open after its INSERT.
const HELD: &str = "m-7";

async fn consumer(stream: &str, name: &str, store: PgStore) -> StreamConsumer<PgStore> {
    consumer_on(stream, name, Idempotency::new(store))
        .await
        .claim_idle(Duration::from_secs(1))
}

/// The entry's key field.
fn id_of(entry: &StreamEntry) -> Result<String, BoxError> {
    Ok(entry
        .text("message_id")
        .ok_or("no message_id field")?
        .to_owned())
}

/// A handler that inserts the entry's row.
fn pays(
    ledger: &Ledger,
) -> impl Fn(StreamEntry, PgTx) -> futures::future::BoxFuture<'static, Result<(), BoxError>>
       + Clone
       + Send
       + Sync
       + 'static {
    let ledger = ledger.clone();
    move |entry: StreamEntry, tx: PgTx| {
        let ledger = ledger.clone();
        Box::pin(async move {
            ledger.insert(&tx, &id_of(&entry)?, entry.fence).await?;
            Ok(())
        })
    }
}

/// Done once the ledger holds `rows` rows and nothing is pending.
fn done(stream: &str, ledger: &Ledger, rows: i64) -> impl Fn() -> Check {
    let (stream, ledger) = (stream.to_owned(), ledger.clone());
    move || {
        let (stream, ledger) = (stream.clone(), ledger.clone());
        Box::pin(async move { ledger.total().await == rows && pending(&stream, "g").await == 0 })
    }
}

/// Runs `consumers` in their in-transaction form with `handler` until
/// `done` holds (120 s at most), then shuts them down.
async fn run_until_done<F, Fut>(
    consumers: &[StreamConsumer<PgStore>],
    handler: F,
    done: impl Fn() -> Check,
) where
    F: Fn(StreamEntry, PgTx) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let runs = consumers.iter().map(|c| {
        let mut stopped = stopped.clone();
        c.run_in_transaction(handler.clone(), async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
    });
    let watch = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let mut finished = false;
        while tokio::time::Instant::now() < deadline {
            if done().await {
                finished = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = stop.send(true);
        finished
    };
    let (ran, finished) = tokio::join!(futures::future::join_all(runs), watch);
    for run in ran {
        run.unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(finished, "not done in 120 s");
}

/// The killed consumer, in a child process: runs every entry, but holds
/// [`HELD`] open after its INSERT (and says so) until it is killed.
async fn killed_consumer(spec: &str) {
    let (stream, table) = spec
        .split_once(' ')
        .unwrap_or_else(|| panic!("{KILLED_CONSUMER}={spec}"));
    let store = pg_store(4).await;
    let ledger = Ledger::existing(store.pool(), table);
    let consumer = consumer(stream, "a", store).await;
    consumer
        .run_in_transaction(
            move |entry: StreamEntry, tx: PgTx| {
                let ledger = ledger.clone();
                async move {
                    let id = id_of(&entry)?;
                    ledger.insert(&tx, &id, entry.fence).await?;
                    if id == HELD {
                        println!("idem-inserted {id}");
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, BoxError>(())
                }
            },
            std::future::pending::<()>(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// A consumer, a process of its own, is killed (SIGKILL) after its
/// handler's INSERT for one entry and before that transaction commits:
/// nothing of that run is kept; the other consumer reclaims the entry
/// once it is idle, runs it once, and replays any entry the killed one
/// committed but did not acknowledge. Every entry's row is in the ledger
/// once, and nothing is pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_reclaimed_entry_commits_once(
) {
    if let Ok(spec) = std::env::var(KILLED_CONSUMER) {
        return killed_consumer(&spec).await;
    }
    let stream = format!("tx-payments-{:08x}", fastrand::u32(..));
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "streams_tx").await;
    // The group, before the entries: it reads from the start.
    let b = consumer(&stream, "b", store.clone()).await;
    for m in 0..20 {
        xadd(&stream, &[("message_id", &format!("m-{m}"))]).await;
    }
    let mut child = support::alone::Part::start(
        "streams::in_transaction::a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_reclaimed_entry_commits_once",
        KILLED_CONSUMER,
        &format!("{stream} {}", ledger.table),
        &[("IDEM_REDIS_URL", support::redis_server::shared_url())],
    );
    child.line_with("idem-inserted ", Duration::from_secs(120));
    assert_eq!(ledger.rows(HELD).await, 0, "not committed yet");
    child.kill();

    run_until_done(&[b], pays(&ledger), done(&stream, &ledger, 20)).await;
    assert!(
        ledger.doubles().await.is_empty(),
        "{:?}",
        ledger.doubles().await
    );
    assert_eq!(ledger.rows(HELD).await, 1);
}

/// A handler that panics after its INSERT, then one that fails: nothing
/// of either is kept, and the redelivery commits one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_or_fails_after_its_insert_keeps_nothing_and_the_redelivery_commits_once(
) {
    let stream = format!("tx-panics-{:08x}", fastrand::u32(..));
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "streams_tx").await;
    let c = consumer(&stream, "a", store).await.max_deliveries(5);
    xadd(&stream, &[("message_id", "p-1")]).await;
    let runs = Arc::new(AtomicU64::new(0));
    let l = ledger.clone();
    let handler = move |entry: StreamEntry, tx: PgTx| {
        let (ledger, runs) = (l.clone(), runs.clone());
        async move {
            ledger.insert(&tx, "p-1", entry.fence).await?;
            match runs.fetch_add(1, Ordering::SeqCst) {
                0 => panic!("the handler panics after its INSERT"),
                1 => Err::<(), BoxError>("the bank is down".into()),
                _ => Ok(()),
            }
        }
    };
    run_until_done(&[c], handler, done(&stream, &ledger, 1)).await;
    assert_eq!(ledger.rows("p-1").await, 1);
    assert_eq!(
        ledger.runs(),
        3,
        "two runs kept nothing, the third committed"
    );
}

/// 64 copies of one entry (and 64 other entries), read by two consumers
/// at once (two gates: copies across them wait in the database) with 32
/// entries in flight each on one pool of 8 connections: no deadlock, no
/// exhausted pool, one row per entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_copies_on_two_consumers_and_a_pool_of_eight_commit_one_row() {
    let stream = format!("tx-storm-{:08x}", fastrand::u32(..));
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "streams_tx").await;
    let a = consumer(&stream, "a", store.clone())
        .await
        .batch(64)
        .concurrency(32);
    let b = consumer(&stream, "b", store.clone())
        .await
        .batch(64)
        .concurrency(32);
    for i in 0..64 {
        xadd(&stream, &[("message_id", "same")]).await;
        xadd(&stream, &[("message_id", &format!("o-{i}"))]).await;
    }
    let l = ledger.clone();
    let slow = move |entry: StreamEntry, tx: PgTx| {
        let ledger = l.clone();
        async move {
            ledger.insert(&tx, &id_of(&entry)?, entry.fence).await?;
            // The transaction stays open a while: the copies wait.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, BoxError>(())
        }
    };
    run_until_done(&[a, b], slow, done(&stream, &ledger, 65)).await;
    assert!(
        ledger.doubles().await.is_empty(),
        "{:?}",
        ledger.doubles().await
    );
    assert_eq!(ledger.rows("same").await, 1);
}

/// Handlers that hold their transaction open far longer than `claim_idle`
/// (1.5 s against 200 ms), on two consumers: the keeper keeps each entry in
/// flight from the other consumer, and an entry reclaimed anyway waits on
/// the key in the database, then replays: one row per entry, nothing
/// pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_longer_than_claim_idle_on_two_consumers_commit_once() {
    let stream = format!("tx-long-{:08x}", fastrand::u32(..));
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "streams_tx").await;
    let a = consumer(&stream, "a", store.clone())
        .await
        .claim_idle(Duration::from_millis(200))
        .transaction_wait(Duration::from_millis(300))
        .concurrency(4);
    let b = consumer(&stream, "b", store.clone())
        .await
        .claim_idle(Duration::from_millis(200))
        .transaction_wait(Duration::from_millis(300))
        .concurrency(4);
    for i in 0..8 {
        xadd(&stream, &[("message_id", &format!("l-{i}"))]).await;
        xadd(&stream, &[("message_id", &format!("l-{i}"))]).await;
    }
    let l = ledger.clone();
    let slow = move |entry: StreamEntry, tx: PgTx| {
        let ledger = l.clone();
        async move {
            ledger.insert(&tx, &id_of(&entry)?, entry.fence).await?;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Ok::<_, BoxError>(())
        }
    };
    run_until_done(&[a, b], slow, done(&stream, &ledger, 8)).await;
    assert!(
        ledger.doubles().await.is_empty(),
        "{:?}",
        ledger.doubles().await
    );
}
