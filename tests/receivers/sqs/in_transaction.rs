//! The consumer's in-transaction form (`run_in_transaction`, PostgreSQL):
//! the claim, the handler's INSERT and the result commit together, before
//! the delete. A consumer killed (SIGKILL) between its INSERT and the
//! commit leaves nothing, and the redelivery commits one row; a panic or
//! an error keeps nothing; 64 copies of a message on two consumers and a
//! pool of 8 connections commit one row.

use crate::support;
use crate::support::ledger::{pg_store, BoxError, Ledger};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::postgres::{PgStore, PgTx};
use idemkit::sqs::aws_sdk_sqs::Client;
use idemkit::sqs::{SqsConsumer, SqsMessage};
use idemkit::Idempotency;

use super::{client, create_queue, queue_empty, send_all, text, Outgoing};

/// Tells a child process of this binary to be the consumer that is killed
/// (its value: queue URL, ledger table).
const KILLED_CONSUMER: &str = "IDEM_TEST_SQS_TX_CONSUMER";

/// The message whose run the killed consumer holds open after its INSERT.
const HELD: &str = "m-7";

fn consumer_of(client: Client, url: &str, store: PgStore) -> SqsConsumer<PgStore> {
    SqsConsumer::new(client, url, Idempotency::new(store))
        .key_attribute("key")
        .visibility_timeout(Duration::from_secs(2))
        .wait_time(Duration::from_secs(1))
        .retry_visibility(Duration::from_secs(1))
}

fn messages(ids: impl IntoIterator<Item = String>) -> Vec<Outgoing> {
    ids.into_iter()
        .map(|id| {
            (
                format!("{{\"id\":\"{id}\"}}"),
                vec![("key".to_owned(), text(&id))],
            )
        })
        .collect()
}

/// The message's key attribute.
fn id_of(message: &SqsMessage) -> Result<String, BoxError> {
    Ok(message.attribute_text("key")?.to_owned())
}

/// Runs `consumer` in its in-transaction form with `handler` until the
/// ledger holds `rows` rows and the queue is empty (120 s at most).
async fn run_until_done<F, Fut>(
    consumer: &SqsConsumer<PgStore>,
    handler: F,
    url: &str,
    ledger: &Ledger,
    rows: i64,
) where
    F: Fn(SqsMessage, PgTx) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let done = Arc::new(AtomicBool::new(false));
    let run = consumer.run_in_transaction(handler, {
        let done = done.clone();
        async move {
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let watch = async {
        let c = client();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let mut finished = false;
        while tokio::time::Instant::now() < deadline {
            if ledger.total().await == rows && queue_empty(&c, url).await {
                finished = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        done.store(true, Ordering::SeqCst);
        finished
    };
    let (stats, finished) = tokio::join!(run, watch);
    stats.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        finished,
        "not done in 120 s: {} of {rows} rows",
        ledger.total().await
    );
}

/// A handler that inserts the message's row.
fn pays(
    ledger: &Ledger,
) -> impl Fn(SqsMessage, PgTx) -> futures::future::BoxFuture<'static, Result<(), BoxError>>
       + Send
       + Sync
       + 'static {
    let ledger = ledger.clone();
    move |message: SqsMessage, tx: PgTx| {
        let ledger = ledger.clone();
        Box::pin(async move {
            ledger.insert(&tx, &id_of(&message)?, message.fence).await?;
            Ok(())
        })
    }
}

/// The killed consumer, in a child process: runs every message, but
/// holds [`HELD`] open after its INSERT (and says so) until it is killed.
async fn killed_consumer(spec: &str) {
    let (url, table) = spec
        .split_once(' ')
        .unwrap_or_else(|| panic!("{KILLED_CONSUMER}={spec}"));
    let store = pg_store(4).await;
    let ledger = Ledger::existing(store.pool(), table);
    let consumer = consumer_of(client(), url, store);
    consumer
        .run_in_transaction(
            move |message: SqsMessage, tx: PgTx| {
                let ledger = ledger.clone();
                async move {
                    let id = id_of(&message)?;
                    ledger.insert(&tx, &id, message.fence).await?;
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
/// handler's INSERT for one message and before that transaction commits:
/// nothing of that run is kept; once the message's visibility timeout
/// lapses the other consumer runs it once, and replays any message the
/// killed one committed but did not delete. Every message's row is in
/// the ledger once, and the queue is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_redelivery_commits_once(
) {
    if let Ok(spec) = std::env::var(KILLED_CONSUMER) {
        return killed_consumer(&spec).await;
    }
    let c = client();
    let url = create_queue(&c, "tx-payments").await;
    send_all(&c, &url, messages((0..20).map(|m| format!("m-{m}")))).await;
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "sqs_tx").await;

    let mut child = support::alone::Part::start(
        "sqs::in_transaction::a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_redelivery_commits_once",
        KILLED_CONSUMER,
        &format!("{url} {}", ledger.table),
        &[("IDEM_MOTO_URL", support::moto::shared_url())],
    );
    child.line_with("idem-inserted ", Duration::from_secs(120));
    assert_eq!(ledger.rows(HELD).await, 0, "not committed yet");
    child.kill();

    let consumer = consumer_of(c, &url, store);
    run_until_done(&consumer, pays(&ledger), &url, &ledger, 20).await;
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
    let c = client();
    let url = create_queue(&c, "tx-panics").await;
    send_all(&c, &url, messages(["p-1".to_owned()])).await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "sqs_tx").await;
    let consumer = consumer_of(c, &url, store).max_deliveries(5);
    let runs = Arc::new(AtomicU64::new(0));
    let l = ledger.clone();
    let handler = move |message: SqsMessage, tx: PgTx| {
        let (ledger, runs) = (l.clone(), runs.clone());
        async move {
            ledger.insert(&tx, "p-1", message.fence).await?;
            match runs.fetch_add(1, Ordering::SeqCst) {
                0 => panic!("the handler panics after its INSERT"),
                1 => Err::<(), BoxError>("the bank is down".into()),
                _ => Ok(()),
            }
        }
    };
    run_until_done(&consumer, handler, &url, &ledger, 1).await;
    assert_eq!(ledger.rows("p-1").await, 1);
    assert_eq!(
        ledger.runs(),
        3,
        "two runs kept nothing, the third committed"
    );
}

/// 64 copies of one message (and 64 other messages), read by two
/// consumers at once (two gates: copies across them wait in the
/// database) with 32 messages in flight each on one pool of 8
/// connections: no deadlock, no exhausted pool, one row per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_copies_on_two_consumers_and_a_pool_of_eight_commit_one_row() {
    let c = client();
    let url = create_queue(&c, "tx-storm").await;
    let ids = (0..64).flat_map(|i| ["same".to_owned(), format!("o-{i}")]);
    send_all(&c, &url, messages(ids)).await;
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "sqs_tx").await;
    let slow = |ledger: &Ledger| {
        let ledger = ledger.clone();
        move |message: SqsMessage, tx: PgTx| {
            let ledger = ledger.clone();
            async move {
                ledger.insert(&tx, &id_of(&message)?, message.fence).await?;
                // The transaction stays open a while: the copies wait.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<_, BoxError>(())
            }
        }
    };
    let a = consumer_of(c.clone(), &url, store.clone()).concurrency(32);
    let b = consumer_of(c.clone(), &url, store.clone()).concurrency(32);
    let done = Arc::new(AtomicBool::new(false));
    let stop = |done: Arc<AtomicBool>| async move {
        while !done.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let watch = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let mut finished = false;
        while tokio::time::Instant::now() < deadline {
            if ledger.total().await == 65 && queue_empty(&c, &url).await {
                finished = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        done.store(true, Ordering::SeqCst);
        finished
    };
    let (ra, rb, finished) = tokio::join!(
        a.run_in_transaction(slow(&ledger), stop(done.clone())),
        b.run_in_transaction(slow(&ledger), stop(done.clone())),
        watch
    );
    ra.unwrap_or_else(|e| panic!("{e}"));
    rb.unwrap_or_else(|e| panic!("{e}"));
    assert!(finished, "{} of 65 rows", ledger.total().await);
    assert!(
        ledger.doubles().await.is_empty(),
        "{:?}",
        ledger.doubles().await
    );
    assert_eq!(ledger.rows("same").await, 1);
}

/// Tells a child process of this binary to be a consumer killed while it
/// runs the poison message (its value: queue URL, ledger table).
const POISONED_CONSUMER: &str = "IDEM_TEST_SQS_TX_POISONED";

/// A consumer, in a child process, that says when it runs the message and
/// then hangs in it until it is killed (a message that kills its
/// consumer).
async fn poisoned_consumer(spec: &str) {
    let (url, table) = spec
        .split_once(' ')
        .unwrap_or_else(|| panic!("{POISONED_CONSUMER}={spec}"));
    let store = pg_store(4).await;
    let ledger = Ledger::existing(store.pool(), table);
    consumer_of(client(), url, store)
        .max_deliveries(3)
        .run_in_transaction(
            move |message: SqsMessage, tx: PgTx| {
                let ledger = ledger.clone();
                async move {
                    ledger.insert(&tx, &id_of(&message)?, message.fence).await?;
                    println!("idem-poisoned {:?}", message.receive_count);
                    std::future::pending::<()>().await;
                    Ok::<_, BoxError>(())
                }
            },
            std::future::pending::<()>(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// A message that kills every consumer that runs it: a crash rolls its
/// claim back, so its `attempt` stays 1, but SQS counts its receives;
/// after `max_deliveries` (3) consumers died in it, the next one
/// dead-letters it (to the consumer's dead-letter queue, with the reason)
/// without running it, and the queue is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_consumers_is_dead_lettered_after_max_deliveries() {
    if let Ok(spec) = std::env::var(POISONED_CONSUMER) {
        return poisoned_consumer(&spec).await;
    }
    let c = client();
    let url = create_queue(&c, "tx-poison").await;
    let dead = create_queue(&c, "tx-poison-dead").await;
    send_all(&c, &url, messages(["kills".to_owned()])).await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "sqs_tx").await;
    for _ in 0..3 {
        let mut child = support::alone::Part::start(
            "sqs::in_transaction::a_message_that_kills_its_consumers_is_dead_lettered_after_max_deliveries",
            POISONED_CONSUMER,
            &format!("{url} {}", ledger.table),
            &[("IDEM_MOTO_URL", support::moto::shared_url())],
        );
        child.line_with("idem-poisoned ", Duration::from_secs(120));
        child.kill();
    }
    let consumer = consumer_of(c.clone(), &url, store)
        .max_deliveries(3)
        .dead_letter(dead.clone());
    run_until_done(&consumer, pays(&ledger), &url, &ledger, 0).await;
    assert_eq!(ledger.runs(), 0, "a 4th consumer ran it");
    let letters = super::take_dead(&c, &dead, 1).await;
    assert!(
        super::attr(&letters[0], "idem.reason").is_some_and(|r| r.contains("acquired 4 times")),
        "{:?}",
        letters[0]
    );
}

/// PostgreSQL is unreachable for 6 s (a failover, a network blip): each
/// receive meanwhile leaves the message without running it (nothing ran,
/// nothing failed); once the database is back it runs once, and is not
/// dead-lettered for the receives it had meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_received_during_a_database_outage_runs_once_it_is_back() {
    let c = client();
    let url = create_queue(&c, "tx-outage").await;
    let dead = create_queue(&c, "tx-outage-dead").await;
    let direct = pg_store(4).await; // migrated
    let ledger = Ledger::create(direct.pool(), "sqs_tx").await;
    let (proxy, proxied) = support::pg::proxied().await;
    let through = PgStore::new(support::pg::pool(&proxied, 4).await);
    proxy.cut(true);
    send_all(&c, &url, messages(["during-outage".to_owned()])).await;
    let consumer = consumer_of(c.clone(), &url, through)
        .max_deliveries(3)
        .dead_letter(dead.clone());
    let outage = async {
        // The outage's length: several receives of the message.
        tokio::time::sleep(Duration::from_secs(6)).await;
        proxy.cut(false);
    };
    tokio::join!(
        run_until_done(&consumer, pays(&ledger), &url, &ledger, 1),
        outage
    );
    assert_eq!(ledger.rows("during-outage").await, 1);
    let letters = super::take_dead_within(&c, &dead, Duration::from_secs(1)).await;
    assert!(letters.is_empty(), "dead-lettered: {letters:?}");
}

/// A message whose key is held by another open transaction (a copy run by
/// another consumer) is left, in progress, each time it is received; it
/// never ran. Once the holder rolls back (its run failed), the message
/// runs once, and is not dead-lettered for the receives it had meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_left_while_its_key_is_held_elsewhere_runs_once_the_holder_rolls_back() {
    let c = client();
    let url = create_queue(&c, "tx-held").await;
    let dead = create_queue(&c, "tx-held-dead").await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "sqs_tx").await;
    let scope = format!("sqs.held.{:08x}", fastrand::u32(..));
    let key = idemkit::IdempotencyKey::new(scope.as_str(), "held").unwrap();
    let mut holder = store.pool().begin().await.unwrap();
    let claim = store
        .in_transaction()
        .claim_with::<()>(&mut holder, &key, None)
        .await
        .unwrap();
    assert!(matches!(claim, idemkit::postgres::Claim::Acquired(_)));
    send_all(&c, &url, messages(["held".to_owned()])).await;
    let consumer = consumer_of(c.clone(), &url, store.clone())
        .scope(scope.as_str())
        .max_deliveries(3)
        .transaction_wait(Duration::from_millis(300))
        .dead_letter(dead.clone());
    let holding = async {
        // Held for several receives of the message, then rolled back.
        tokio::time::sleep(Duration::from_secs(7)).await;
        holder.rollback().await.unwrap();
    };
    tokio::join!(
        run_until_done(&consumer, pays(&ledger), &url, &ledger, 1),
        holding
    );
    assert_eq!(ledger.rows("held").await, 1);
    let letters = super::take_dead_within(&c, &dead, Duration::from_secs(1)).await;
    assert!(letters.is_empty(), "dead-lettered: {letters:?}");
}

/// Three copies of one payment (a producer's resends) arrive together
/// while the bank is down: each copy's run fails once (`max_deliveries`
/// 3). The failures were seen to end, so they count as failures of each
/// copy, never as crashes summed over the key: the payment runs once the
/// bank is back, and nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_a_key_that_each_failed_once_are_not_dead_lettered() {
    let c = client();
    let url = create_queue(&c, "tx-copies").await;
    let dead = create_queue(&c, "tx-copies-dead").await;
    send_all(&c, &url, messages(std::iter::repeat_n("dup".to_owned(), 3))).await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "sqs_tx").await;
    let consumer = consumer_of(c.clone(), &url, store)
        .max_deliveries(3)
        .dead_letter(dead.clone());
    let runs = Arc::new(AtomicU64::new(0));
    let l = ledger.clone();
    let handler = move |message: SqsMessage, tx: PgTx| {
        let (ledger, runs) = (l.clone(), runs.clone());
        async move {
            if runs.fetch_add(1, Ordering::SeqCst) < 3 {
                return Err::<(), BoxError>("the bank is down".into());
            }
            ledger.insert(&tx, &id_of(&message)?, message.fence).await?;
            Ok(())
        }
    };
    run_until_done(&consumer, handler, &url, &ledger, 1).await;
    let letters = super::take_dead_within(&c, &dead, Duration::from_secs(1)).await;
    assert!(letters.is_empty(), "dead-lettered: {letters:?}");
}

/// The connection of a message's transaction is lost after its handler
/// ran (the server terminates the backend: a failover, a network cut), on
/// its first three runs: nothing is kept and the message is left for
/// redelivery. Those runs were seen to end, so they are not counted as
/// crashes: the fourth run, on a sound database, commits, and nothing is
/// dead-lettered (`max_deliveries` 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_connection_was_lost_mid_transaction_runs_once_the_database_is_sound() {
    let c = client();
    let url = create_queue(&c, "tx-lost-conn").await;
    let dead = create_queue(&c, "tx-lost-conn-dead").await;
    send_all(&c, &url, messages(["blip".to_owned()])).await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "sqs_tx").await;
    let consumer = consumer_of(c.clone(), &url, store.clone())
        .max_deliveries(3)
        .dead_letter(dead.clone());
    let runs = Arc::new(AtomicU64::new(0));
    let (l, pool) = (ledger.clone(), store.pool().clone());
    let handler = move |message: SqsMessage, tx: PgTx| {
        let (ledger, runs, pool) = (l.clone(), runs.clone(), pool.clone());
        async move {
            ledger.insert(&tx, &id_of(&message)?, message.fence).await?;
            if runs.fetch_add(1, Ordering::SeqCst) < 3 {
                let pid: i32 = {
                    let mut guard = tx.lock().await?;
                    sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut *guard)
                        .await?
                };
                sqlx::query("SELECT pg_terminate_backend($1)")
                    .bind(pid)
                    .execute(&pool)
                    .await?;
            }
            Ok::<_, BoxError>(())
        }
    };
    run_until_done(&consumer, handler, &url, &ledger, 1).await;
    let letters = super::take_dead_within(&c, &dead, Duration::from_secs(1)).await;
    assert!(letters.is_empty(), "dead-lettered: {letters:?}");
    assert!(
        ledger.runs() >= 4,
        "three runs lost their connection, the fourth committed"
    );
}
