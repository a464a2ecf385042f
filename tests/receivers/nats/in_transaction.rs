//! The in-transaction form on PostgreSQL: the claim, the handler's write
//! and the result commit together before the ack; a consumer killed
//! before the commit leaves nothing.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemkit::nats::{NatsConsumer, NatsMessage};
use idemkit::postgres::{sqlx, PgStore, PgTx};
use idemkit::Idempotency;

use super::{all_acked, create_stream, jetstream, name, publish, wait_until};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// 50 messages, each published 1 to 3 times; the handler inserts a row in
/// the transaction it is given, and fails (a rollback) on each key's first
/// run. Every key's row is there once, every message acked, and the
/// failed runs left nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_commit_with_the_claim_once_per_key_and_a_failure_rolls_back() {
    let store: PgStore = support::ledger::pg_store(8).await;
    let pool = support::pg::pool(support::pg::shared_url(), 2).await;
    let table = format!("nats_effects_{:08x}", fastrand::u32(..));
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (id TEXT NOT NULL, fence BIGINT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let js = jetstream().await;
    let stream = name("TX");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    let mut total = 0;
    for m in 0..50 {
        for _ in 0..fastrand::u32(1..=3) {
            publish(&js, &subject, &[("message-id", &format!("m-{m}"))], "x").await;
            total += 1;
        }
    }
    let failures = Arc::new(std::sync::Mutex::new(
        std::collections::HashSet::<String>::new(),
    ));
    let runs = Arc::new(AtomicUsize::new(0));
    let durable = name("tx");
    let handler = {
        let (failures, runs, table) = (failures.clone(), runs.clone(), table.clone());
        move |m: NatsMessage, tx: PgTx| {
            let (failures, runs, table) = (failures.clone(), runs.clone(), table.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let id = m.header_text("message-id")?.to_owned();
                let mut conn = tx.lock().await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} (id, fence) VALUES ($1, $2)"
                )))
                .bind(&id)
                .bind(m.fence as i64)
                .execute(&mut *conn)
                .await?;
                if failures.lock().unwrap().insert(id.clone()) {
                    return Err::<String, BoxError>("first run fails".into());
                }
                Ok(id)
            }
        }
    };
    let consumer = Arc::new(
        NatsConsumer::new(js.clone(), &stream, &durable, Idempotency::new(store))
            .key_header("message-id")
            .concurrency(8)
            .retry_delay(Duration::from_millis(100))
            .pull_wait(Duration::from_millis(500)),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let c = consumer.clone();
    let task = tokio::spawn(async move {
        c.run_in_transaction(handler, async {
            let _ = stopped.await;
        })
        .await
    });
    wait_until("every message acked", Duration::from_secs(120), || {
        all_acked(&js, &stream, &durable)
    })
    .await;
    let _ = stop.send(());
    let stats = task.await.unwrap().unwrap();
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, count(*) FROM {table} GROUP BY id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 50, "{stats:?}");
    assert!(rows.iter().all(|(_, n)| *n == 1), "{rows:?}");
    assert_eq!(stats.executed, 50, "{stats:?}");
    assert!(stats.received >= total, "{stats:?}");
    assert_eq!(stats.poison, 0, "{stats:?}");
}

/// The variable that tells a child process of this binary to be the
/// consumer killed in [`a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing`]
/// (its value: the stream and the table).
const KILLED_CONSUMER: &str = "IDEM_TEST_NATS_TX_CONSUMER";

/// The message whose handler the killed consumer holds, its INSERT done
/// and its transaction open.
const HELD: &str = "m-7";

fn tx_consumer(
    js: &idemkit::nats::async_nats::jetstream::Context,
    stream: &str,
    store: PgStore,
) -> NatsConsumer<PgStore> {
    NatsConsumer::new(js.clone(), stream, "tx", Idempotency::new(store))
        .key_header("message-id")
        .concurrency(4)
        .ack_wait(Duration::from_secs(2))
        .retry_delay(Duration::from_millis(100))
        .pull_wait(Duration::from_millis(500))
}

/// A consumer, a process of its own, runs 20 messages in transactions and
/// is killed (SIGKILL) while one of them has done its INSERT and not
/// committed. PostgreSQL rolls that transaction back with its claim; the
/// message comes back after the ack wait to the consumer that takes over,
/// which runs it cleanly: every row once, the held one included, no lease
/// to wait out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing() {
    if let Ok(spec) = std::env::var(KILLED_CONSUMER) {
        let (stream, table) = spec
            .split_once(' ')
            .unwrap_or_else(|| panic!("{KILLED_CONSUMER}={spec}"));
        return killed_consumer(stream, table).await;
    }
    let store: PgStore = support::ledger::pg_store(4).await;
    let pool = support::pg::pool(support::pg::shared_url(), 2).await;
    let table = format!("nats_killed_{:08x}", fastrand::u32(..));
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (id TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let js = jetstream().await;
    let stream = name("TXKILL");
    let subject = format!("{stream}.in");
    create_stream(&js, &stream, &[&subject]).await;
    for m in 0..20 {
        publish(&js, &subject, &[("message-id", &format!("m-{m}"))], "x").await;
    }
    let mut child = {
        let exe = std::env::current_exe().unwrap();
        let child = std::process::Command::new(exe)
            .args([
                "nats::in_transaction::a_consumer_killed_between_its_insert_and_the_commit_leaves_nothing",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(KILLED_CONSUMER, format!("{stream} {table}"))
            .env("IDEM_POSTGRES_URL", support::pg::shared_url())
            .env("IDEM_NATS_URL", support::nats::shared_url())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the consumer to kill: {e}"));
        support::alone::Killed(child)
    };
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    {
        use std::io::BufRead;
        let out = child.0.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if line.ends_with("idem-held") {
                    let _ = held_tx.send(());
                } else {
                    println!("killed consumer: {line}");
                }
            }
        });
    }
    tokio::task::spawn_blocking(move || held_rx.recv_timeout(Duration::from_secs(60)))
        .await
        .unwrap()
        .unwrap_or_else(|_| panic!("the consumer never held {HELD}"));
    child.kill();
    let rows_at_kill: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE id = '{HELD}'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows_at_kill, 0, "the held INSERT was not committed");

    let table2 = table.clone();
    let consumer = Arc::new(tx_consumer(&js, &stream, store));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let c = consumer.clone();
    let task = tokio::spawn(async move {
        c.run_in_transaction(
            move |m: NatsMessage, tx: PgTx| {
                let table = table2.clone();
                async move {
                    let id = m.header_text("message-id")?.to_owned();
                    let mut conn = tx.lock().await?;
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "INSERT INTO {table} (id) VALUES ($1)"
                    )))
                    .bind(&id)
                    .execute(&mut *conn)
                    .await?;
                    Ok::<_, BoxError>(id)
                }
            },
            async {
                let _ = stopped.await;
            },
        )
        .await
    });
    wait_until("every message acked", Duration::from_secs(120), || {
        all_acked(&js, &stream, "tx")
    })
    .await;
    let _ = stop.send(());
    let stats = task.await.unwrap().unwrap();
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, count(*) FROM {table} GROUP BY id"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 20, "{rows:?} {stats:?}");
    assert!(rows.iter().all(|(_, n)| *n == 1), "{rows:?}");
    assert!(stats.executed >= 1, "the held message ran here: {stats:?}");
}

/// The consumer of the test above, in its child process: it runs the
/// messages in transactions, and holds the transaction of `HELD` open
/// after its INSERT (`idem-held` on stdout) until it is killed.
async fn killed_consumer(stream: &str, table: &str) {
    use std::io::Write;
    let js = jetstream().await;
    let store: PgStore = support::ledger::pg_store(4).await;
    let table = table.to_owned();
    let outcome = tx_consumer(&js, stream, store)
        .run_in_transaction(
            move |m: NatsMessage, tx: PgTx| {
                let table = table.clone();
                async move {
                    let id = m.header_text("message-id")?.to_owned();
                    let mut conn = tx.lock().await?;
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "INSERT INTO {table} (id) VALUES ($1)"
                    )))
                    .bind(&id)
                    .execute(&mut *conn)
                    .await?;
                    if id == HELD {
                        let _ = writeln!(std::io::stdout().lock(), "idem-held");
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, BoxError>(id)
                }
            },
            std::future::pending::<()>(),
        )
        .await;
    panic!("the consumer stopped before it was killed: {outcome:?}");
}
