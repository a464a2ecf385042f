//! The consumer's in-transaction form (`run_in_transaction`, PostgreSQL):
//! the claim, the handler's INSERT and the result commit together, before
//! the offset. A member killed (SIGKILL) between its INSERT and the
//! commit leaves nothing, and the redelivery commits one row; a panic
//! keeps nothing; 64 copies of a record on two members and a pool of 8
//! connections commit one row.

use crate::support;
use crate::support::ledger::{pg_store, BoxError, Ledger};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::kafka::{ConsumerStats, KafkaConsumer, KafkaRecord};
use idemkit::postgres::{PgStore, PgTx};
use idemkit::Idempotency;

use super::{all_committed, config, name, once_set, produce, wait_for, Ends};

/// Tells a child process of this binary to be the member that is killed
/// (its value: topic, group, ledger table).
const KILLED_MEMBER: &str = "IDEM_TEST_KAFKA_TX_MEMBER";

/// The record whose run the killed member holds open after its INSERT.
const HELD: &str = "m-7";

fn member(group: &str, topic: &str, store: PgStore) -> KafkaConsumer<PgStore> {
    KafkaConsumer::new(&config(group), &[topic], Idempotency::new(store))
        .unwrap_or_else(|e| panic!("{e}"))
        .key_header("message-id")
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

/// A handler that inserts the record's row and answers its fence.
fn pays(
    ledger: &Ledger,
) -> impl Fn(KafkaRecord, PgTx) -> futures::future::BoxFuture<'static, Result<u64, BoxError>>
       + Send
       + Sync
       + 'static {
    let ledger = ledger.clone();
    move |record: KafkaRecord, tx: PgTx| {
        let ledger = ledger.clone();
        Box::pin(async move {
            let id = record.header_text("message-id")?.to_owned();
            ledger.insert(&tx, &id, record.fence).await?;
            Ok(record.fence)
        })
    }
}

/// Runs `consumer` in its in-transaction form with `handler` until the
/// ledger holds `rows` rows and the group committed up to `ends` (360 s at
/// most: group joins take seconds on a busy machine); what `run` returned.
async fn run_until_done<F, Fut>(
    consumer: &KafkaConsumer<PgStore>,
    handler: F,
    (group, topic): (&str, &str),
    ledger: &Ledger,
    rows: i64,
    ends: &Ends,
) -> ConsumerStats
where
    F: Fn(KafkaRecord, PgTx) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<u64, BoxError>> + Send + 'static,
{
    let done = Arc::new(AtomicBool::new(false));
    let run = consumer.run_in_transaction(handler, once_set(done.clone()));
    let watch = async {
        let finished = wait_for(Duration::from_secs(360), || async {
            ledger.total().await == rows && all_committed(group, topic, ends).await
        })
        .await;
        done.store(true, Ordering::SeqCst);
        finished
    };
    let (stats, finished) = tokio::join!(run, watch);
    let stats = stats.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        finished,
        "not done in 360 s: {} of {rows} rows, committed up to the ends: {}; {stats:?}",
        ledger.total().await,
        all_committed(group, topic, ends).await
    );
    stats
}

/// The killed member, in a child process: runs every record, but holds
/// [`HELD`] open after its INSERT (and says so) until it is killed.
async fn killed_member(spec: &str) {
    let mut parts = spec.split(' ');
    let (Some(topic), Some(group), Some(table)) = (parts.next(), parts.next(), parts.next()) else {
        panic!("{KILLED_MEMBER}={spec}")
    };
    let store = pg_store(4).await;
    let ledger = Ledger::existing(store.pool(), table);
    let consumer = member(group, topic, store);
    let run = consumer.run_in_transaction(
        move |record: KafkaRecord, tx: PgTx| {
            let ledger = ledger.clone();
            async move {
                let id = record.header_text("message-id")?.to_owned();
                ledger.insert(&tx, &id, record.fence).await?;
                if id == HELD {
                    println!("idem-inserted {id}");
                    std::future::pending::<()>().await;
                }
                Ok::<_, BoxError>(record.fence)
            }
        },
        std::future::pending::<()>(),
    );
    run.await.unwrap_or_else(|e| panic!("{e}"));
}

/// A member, a process of its own, is killed (SIGKILL) after its
/// handler's INSERT for one record and before that transaction commits:
/// nothing of that run is kept, and the other member, once it has the
/// partition, runs that record once and replays the records the killed
/// member committed. Every record's row is in the ledger once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_redelivery_commits_once(
) {
    if let Ok(spec) = std::env::var(KILLED_MEMBER) {
        return killed_member(&spec).await;
    }
    let (topic, group) = (name("tx-payments"), name("tx-billing"));
    support::kafka::create_topic(&topic, 1);
    let records = (0..20)
        .map(|m| {
            let id = format!("m-{m}");
            (
                0,
                Some(id.clone()),
                vec![("message-id".to_owned(), id)],
                "{}".to_owned(),
            )
        })
        .collect();
    let ends = produce(&topic, records).await;
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "kafka_tx").await;

    let mut child = support::alone::Part::start(
        "kafka::in_transaction::a_member_killed_between_its_insert_and_the_commit_leaves_nothing_and_the_redelivery_commits_once",
        KILLED_MEMBER,
        &format!("{topic} {group} {}", ledger.table),
        &[("IDEM_KAFKA_BROKERS", support::kafka::brokers())],
    );
    child.line_with("idem-inserted ", Duration::from_secs(120));
    assert_eq!(ledger.rows(HELD).await, 0, "not committed yet");
    child.kill();

    let consumer = member(&group, &topic, store.clone());
    run_until_done(
        &consumer,
        pays(&ledger),
        (&group, &topic),
        &ledger,
        20,
        &ends,
    )
    .await;
    assert!(
        ledger.doubles().await.is_empty(),
        "{:?}",
        ledger.doubles().await
    );
    assert_eq!(ledger.rows(HELD).await, 1);
    assert!(ledger.runs() >= 1, "this member ran the held record");
}

/// A handler that panics after its INSERT, then one that fails: nothing
/// of either is kept, and the retry in place commits one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_or_fails_after_its_insert_keeps_nothing_and_the_retry_commits_once()
{
    let (topic, group) = (name("tx-panics"), name("tx-billing"));
    support::kafka::create_topic(&topic, 1);
    let ends = produce(
        &topic,
        vec![(
            0,
            None,
            vec![("message-id".to_owned(), "p-1".to_owned())],
            "{}".to_owned(),
        )],
    )
    .await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "kafka_tx").await;
    let consumer = member(&group, &topic, store).max_deliveries(5);
    let runs = Arc::new(AtomicU64::new(0));
    let l = ledger.clone();
    let handler = move |record: KafkaRecord, tx: PgTx| {
        let (ledger, runs) = (l.clone(), runs.clone());
        async move {
            ledger.insert(&tx, "p-1", record.fence).await?;
            match runs.fetch_add(1, Ordering::SeqCst) {
                0 => panic!("the handler panics after its INSERT"),
                1 => Err::<u64, BoxError>("the bank is down".into()),
                _ => Ok(record.fence),
            }
        }
    };
    run_until_done(&consumer, handler, (&group, &topic), &ledger, 1, &ends).await;
    assert_eq!(ledger.rows("p-1").await, 1);
    assert_eq!(
        ledger.runs(),
        3,
        "two runs kept nothing, the third committed"
    );
}

/// 64 copies of one record (and 64 other records) over two partitions,
/// read by two members at once (two gates: duplicates across them wait in
/// the database) with 64 records in flight each on one pool of 8
/// connections: no deadlock, no exhausted pool, one row per record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_copies_on_two_members_and_a_pool_of_eight_commit_one_row() {
    let (topic, group) = (name("tx-storm"), name("tx-billing"));
    support::kafka::create_topic(&topic, 2);
    let mut records = Vec::new();
    for i in 0..64 {
        records.push((
            i % 2,
            None,
            vec![("message-id".to_owned(), "same".to_owned())],
            "{}".to_owned(),
        ));
        let id = format!("o-{i}");
        records.push((
            i % 2,
            None,
            vec![("message-id".to_owned(), id)],
            "{}".to_owned(),
        ));
    }
    let ends = produce(&topic, records).await;
    let store = pg_store(8).await;
    let ledger = Ledger::create(store.pool(), "kafka_tx").await;
    let slow = |ledger: &Ledger| {
        let ledger = ledger.clone();
        move |record: KafkaRecord, tx: PgTx| {
            let ledger = ledger.clone();
            async move {
                let id = record.header_text("message-id")?.to_owned();
                ledger.insert(&tx, &id, record.fence).await?;
                // The transaction stays open a while: the copies wait.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<_, BoxError>(record.fence)
            }
        }
    };
    let a = member(&group, &topic, store.clone()).concurrency(64);
    let b = member(&group, &topic, store.clone()).concurrency(64);
    let done = Arc::new(AtomicBool::new(false));
    let watch = async {
        let finished = wait_for(Duration::from_secs(360), || async {
            ledger.total().await == 65 && all_committed(&group, &topic, &ends).await
        })
        .await;
        done.store(true, Ordering::SeqCst);
        finished
    };
    let (ra, rb, finished) = tokio::join!(
        a.run_in_transaction(slow(&ledger), once_set(done.clone())),
        b.run_in_transaction(slow(&ledger), once_set(done.clone())),
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

/// Tells a child process of this binary to be a member killed while it
/// runs the poison record (its value: topic, group, dead-letter topic,
/// ledger table).
const POISONED_MEMBER: &str = "IDEM_TEST_KAFKA_TX_POISONED";

/// A member, in a child process, that says when it runs the record and
/// then hangs in it until it is killed (a record that kills its
/// consumer: out of memory, a crash in a library).
async fn poisoned_member(spec: &str) {
    let mut parts = spec.split(' ');
    let (Some(topic), Some(group), Some(dead), Some(table)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        panic!("{POISONED_MEMBER}={spec}")
    };
    let store = pg_store(4).await;
    let ledger = Ledger::existing(store.pool(), table);
    let consumer = member(group, topic, store)
        .dead_letter(dead)
        .max_deliveries(3);
    let run = consumer.run_in_transaction(
        move |record: KafkaRecord, tx: PgTx| {
            let ledger = ledger.clone();
            async move {
                let id = record.header_text("message-id")?.to_owned();
                ledger.insert(&tx, &id, record.fence).await?;
                println!("idem-poisoned {id} attempt {}", record.attempt);
                std::future::pending::<()>().await;
                Ok::<_, BoxError>(record.fence)
            }
        },
        std::future::pending::<()>(),
    );
    run.await.unwrap_or_else(|e| panic!("{e}"));
}

/// A record that kills every member that runs it: a crash rolls its
/// claim back, so its `attempt` stays 1, but each start is counted; after
/// `max_deliveries` (3) members died in it, the next one dead-letters it
/// without running it, and the partition moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_kills_its_members_is_dead_lettered_after_max_deliveries() {
    if let Ok(spec) = std::env::var(POISONED_MEMBER) {
        return poisoned_member(&spec).await;
    }
    let (topic, group, dead) = (name("tx-poison"), name("tx-billing"), name("tx-poison-dlq"));
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    let ends = produce(
        &topic,
        vec![(
            0,
            None,
            vec![("message-id".to_owned(), "kills".to_owned())],
            "{}".to_owned(),
        )],
    )
    .await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "kafka_tx").await;
    for _ in 0..3 {
        let mut child = support::alone::Part::start(
            "kafka::in_transaction::a_record_that_kills_its_members_is_dead_lettered_after_max_deliveries",
            POISONED_MEMBER,
            &format!("{topic} {group} {dead} {}", ledger.table),
            &[("IDEM_KAFKA_BROKERS", support::kafka::brokers())],
        );
        child.line_with("idem-poisoned ", Duration::from_secs(120));
        child.kill();
    }
    let consumer = member(&group, &topic, store.clone())
        .dead_letter(dead.clone())
        .max_deliveries(3);
    let stats = run_until_done(
        &consumer,
        pays(&ledger),
        (&group, &topic),
        &ledger,
        0,
        &ends,
    )
    .await;
    assert_eq!(ledger.runs(), 0, "a 4th member ran it: {stats:?}");
    assert_eq!(stats.dead_lettered, 1, "{stats:?}");
    assert_eq!(ledger.total().await, 0, "no run committed");
}

/// A record whose key is held by another open transaction (a revoked
/// member still running it) is retried in place, in progress; it never
/// ran. Once the holder rolls back (its run failed), the record runs
/// once: its retries in place are not counted as starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_retried_while_its_key_is_held_elsewhere_runs_once_the_holder_rolls_back() {
    let (topic, group, dead) = (name("tx-held"), name("tx-billing"), name("tx-held-dlq"));
    support::kafka::create_topic(&topic, 1);
    support::kafka::create_topic(&dead, 1);
    let ends = produce(
        &topic,
        vec![(
            0,
            None,
            vec![("message-id".to_owned(), "held".to_owned())],
            "{}".to_owned(),
        )],
    )
    .await;
    let store = pg_store(4).await;
    let ledger = Ledger::create(store.pool(), "kafka_tx").await;
    let scope = format!("kafka.held.{:08x}", fastrand::u32(..));
    // The other holder of the key: an open transaction that claimed it.
    let key =
        idemkit::IdempotencyKey::new(scope.as_str(), "held").unwrap_or_else(|e| panic!("{e}"));
    let mut holder = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim_with::<u64>(&mut holder, &key, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(claim, idemkit::postgres::Claim::Acquired(_)));
    let consumer = member(&group, &topic, store.clone())
        .scope(scope.as_str())
        .unwrap_or_else(|e| panic!("{e}"))
        .dead_letter(dead.clone())
        .max_deliveries(3)
        .transaction_wait(Duration::from_millis(300));
    let holding = async {
        // Held for several retries, then rolled back (its run failed).
        tokio::time::sleep(Duration::from_secs(6)).await;
        holder.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    };
    let (stats, ()) = tokio::join!(
        run_until_done(
            &consumer,
            pays(&ledger),
            (&group, &topic),
            &ledger,
            1,
            &ends
        ),
        holding
    );
    assert_eq!(
        ledger.rows("held").await,
        1,
        "the record never ran: handler runs {}, {stats:?}",
        ledger.runs()
    );
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
}
