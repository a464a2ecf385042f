//! The in-transaction form on PostgreSQL: the claim, the handler's write
//! and the result commit together before the ack.

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
