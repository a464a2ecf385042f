//! PgStore against a real PostgreSQL started by tests/support (or
//! IDEM_POSTGRES_URL): the conformance suite, the storm across two pools,
//! the in-transaction mode, server outages, bad rows and round trips.

use crate::support;

use std::convert::Infallible;
use std::time::Duration;

use idemkit::postgres::{Claim, MissingTable, PgStore};
use idemkit::testkit::{self, Harness, Settings};
use idemkit::{
    async_trait, AcquireItem, Acquisition, Batching, IdemError, IdempotencyKey, IdempotencyStore,
    StoreError,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use support::pg;

struct PgHarness;

#[async_trait]
impl Harness for PgHarness {
    type Store = PgStore;

    async fn store(&self) -> PgStore {
        let store = PgStore::new(pg::pool(pg::shared_url(), 16).await);
        store
            .migrate()
            .await
            .unwrap_or_else(|e| panic!("migrate: {e}"));
        store
    }

    async fn corrupt(&self, store: &PgStore, key: &IdempotencyKey) {
        let sql = format!(
            "UPDATE {} SET status = 9 WHERE scope = $1 AND key = $2",
            store.qualified_table()
        );
        let done = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(key.scope())
            .bind(key.id())
            .execute(store.pool())
            .await
            .unwrap_or_else(|e| panic!("corrupt: {e}"));
        assert_eq!(done.rows_affected(), 1, "no row to corrupt for {key}");
    }

    fn settings(&self) -> Settings {
        Settings::default().lease(Duration::from_millis(400))
    }
}

idemkit::conformance_tests!(PgHarness);

fn key(tag: &str) -> IdempotencyKey {
    testkit::unique_key(tag)
}

async fn exec(pool: &PgPool, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("setup SQL failed: {e}"));
}

/// Two pools stand for two processes: 64 tasks, 500 keys, each run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_across_two_pools() {
    let a = PgHarness.store().await;
    let b = PgStore::new(pg::pool(pg::shared_url(), 8).await);
    let calls = testkit::storm(
        &[testkit::storm_executor(a), testkit::storm_executor(b)],
        64,
        500,
    )
    .await;
    assert_eq!(calls, 64 * 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_safe_from_many_processes_at_once() {
    let pool = pg::pool(pg::shared_url(), 16).await;
    let schema = format!("idem_m{:08x}", fastrand::u32(..));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        // Separate pools, as separate processes would have.
        let store = PgStore::builder(pg::pool(pg::shared_url(), 2).await)
            .schema(schema.clone())
            .table("records")
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        tasks.push(tokio::spawn(async move { store.migrate().await }));
    }
    for task in tasks {
        let result = task.await.unwrap_or_else(|e| panic!("{e}"));
        assert!(result.is_ok(), "concurrent migrate failed: {result:?}");
    }
    let versions: Vec<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM \"{schema}\".\"records_migrations\""
    )))
    .fetch_all(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(versions, vec![1, 2]);

    // The custom table works end to end.
    let store = PgStore::builder(pool)
        .schema(schema)
        .table("records")
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(store.qualified_table().ends_with("\"records\""));
    let k = key("custom-table");
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, Duration::from_secs(5)).await
    else {
        panic!("not acquired")
    };
    assert!(store
        .complete(&lease, b"ok", Duration::from_secs(60))
        .await
        .is_ok());
    assert!(matches!(
        store.acquire(&k, None, Duration::from_secs(5)).await,
        Ok(Acquisition::Completed(_))
    ));
}

#[tokio::test]
async fn missing_table_says_to_migrate() {
    let store = PgStore::builder(pg::pool(pg::shared_url(), 2).await)
        .table(format!("idem_absent_{:08x}", fastrand::u32(..)))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    match store
        .acquire(&key("absent"), None, Duration::from_secs(1))
        .await
    {
        Err(StoreError::Backend(source)) => {
            assert!(source.downcast_ref::<MissingTable>().is_some(), "{source}");
            assert!(source.to_string().contains("migrate"), "{source}");
        }
        other => panic!("expected a MissingTable backend error, got {other:?}"),
    }
}

#[tokio::test]
async fn bad_configuration_and_oversized_responses_are_typed_errors() {
    let pool = pg::pool(pg::shared_url(), 2).await;
    for bad in ["Bad", "a-b", "x\"; drop table t; --", ""] {
        assert!(
            PgStore::builder(pool.clone()).table(bad).build().is_err(),
            "{bad:?}"
        );
        assert!(
            PgStore::builder(pool.clone()).schema(bad).build().is_err(),
            "{bad:?}"
        );
    }
    let store = PgStore::builder(pool)
        .max_response_bytes(1024)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let k = key("too-large");
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, Duration::from_secs(5)).await
    else {
        panic!("not acquired")
    };
    let big = vec![7u8; 1025];
    match store.complete(&lease, &big, Duration::from_secs(60)).await {
        Err(
            e @ StoreError::ResponseTooLarge {
                size: 1025,
                limit: 1024,
            },
        ) => {
            assert!(!e.is_retryable())
        }
        other => panic!("expected ResponseTooLarge, got {other:?}"),
    }
    // Nothing was lost: the lease still completes with a response that fits.
    assert!(store
        .complete(&lease, b"fits", Duration::from_secs(60))
        .await
        .is_ok());
}

#[tokio::test]
async fn corrupt_rows_of_every_kind_are_reported_never_absent() {
    let store = PgHarness.store().await;
    let table = store.qualified_table().to_owned();
    let damage = [
        "status = 7",
        "fingerprint = '\\x0102'::bytea",
        "token = '\\x01'::bytea",
        "attempt = 0",
        "response = NULL",
        "completed_at = NULL",
    ];
    for (i, set) in damage.iter().enumerate() {
        let k = key(&format!("damaged-{i}"));
        let Ok(Acquisition::Acquired(lease)) = store
            .acquire(
                &k,
                Some(&idemkit::Fingerprint::of_bytes(b"p")),
                Duration::from_secs(5),
            )
            .await
        else {
            panic!("not acquired")
        };
        assert!(store
            .complete(&lease, b"r", Duration::from_secs(600))
            .await
            .is_ok());
        exec(
            store.pool(),
            format!(
                "UPDATE {table} SET {set} WHERE scope = '{}' AND key = '{}'",
                k.scope(),
                k.id()
            ),
        )
        .await;
        let got = store.get(&k).await;
        assert!(
            matches!(&got, Err(StoreError::Corrupt { key, .. }) if *key == k),
            "get after `{set}`: {got:?}"
        );
        if *set != "token = '\\x01'::bytea" {
            let got = store
                .acquire(
                    &k,
                    Some(&idemkit::Fingerprint::of_bytes(b"p")),
                    Duration::from_secs(5),
                )
                .await;
            assert!(
                matches!(&got, Err(StoreError::Corrupt { key, .. }) if *key == k),
                "acquire after `{set}`: {got:?}"
            );
        }
    }
}

/// Every store operation is one round trip, counted on the wire by a proxy.
#[tokio::test]
async fn every_operation_is_one_round_trip() {
    let upstream: std::net::SocketAddr = {
        let url = pg::shared_url();
        let host_port = url
            .split('@')
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_else(|| panic!("cannot parse {url}"));
        tokio::net::lookup_host(host_port)
            .await
            .ok()
            .and_then(|mut a| a.next())
            .unwrap_or_else(|| panic!("cannot resolve {host_port}"))
    };
    PgHarness.store().await; // migrated
    let proxy = support::proxy::CountingProxy::start(upstream).await;
    let url = pg::shared_url().replacen(&upstream.to_string(), &proxy.addr.to_string(), 1);
    let url = if url.contains(&proxy.addr.to_string()) {
        url
    } else {
        // IDEM_POSTGRES_URL may name the host as localhost.
        format!("postgres://postgres@{}/postgres", proxy.addr)
    };
    // One connection, so every call below reuses it (and its prepared
    // statements); nothing else talks through the proxy.
    let store = one_connection_store(&url).await;
    let long = Duration::from_secs(60);

    // Warm up: the first use of each statement on a connection prepares it.
    let warm = key("rt-warm");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&warm, None, long).await else {
        panic!("warm-up acquire")
    };
    let l = store
        .extend(&l, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store
        .complete(&l, b"r", long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = store.get(&warm).await;
    let _ = store.delete(&warm).await;
    let Ok(Acquisition::Acquired(l)) = store.acquire(&warm, None, long).await else {
        panic!("warm-up acquire")
    };
    store.release(&l).await.unwrap_or_else(|e| panic!("{e}"));
    let _ = store.purge_expired(10).await;

    let k = key("rt");
    let mut measure = Vec::new();
    let before = proxy.turns();
    let Ok(Acquisition::Acquired(l)) = store.acquire(&k, None, long).await else {
        panic!("fresh acquire")
    };
    measure.push(("acquire (fresh)", proxy.turns() - before));
    let before = proxy.turns();
    let l = store
        .extend(&l, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    measure.push(("extend", proxy.turns() - before));
    let before = proxy.turns();
    assert!(matches!(
        store.acquire(&k, None, long).await,
        Ok(Acquisition::InProgress { .. })
    ));
    measure.push(("acquire (in progress)", proxy.turns() - before));
    let before = proxy.turns();
    store
        .complete(&l, b"r", long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    measure.push(("complete", proxy.turns() - before));
    let before = proxy.turns();
    assert!(matches!(
        store.acquire(&k, None, long).await,
        Ok(Acquisition::Completed(_))
    ));
    measure.push(("acquire (duplicate)", proxy.turns() - before));
    let before = proxy.turns();
    assert!(matches!(store.get(&k).await, Ok(Some(_))));
    measure.push(("get", proxy.turns() - before));
    let before = proxy.turns();
    assert!(matches!(store.delete(&k).await, Ok(true)));
    measure.push(("delete", proxy.turns() - before));
    let Ok(Acquisition::Acquired(l)) = store.acquire(&k, None, long).await else {
        panic!("acquire")
    };
    let before = proxy.turns();
    store.release(&l).await.unwrap_or_else(|e| panic!("{e}"));
    measure.push(("release", proxy.turns() - before));
    let before = proxy.turns();
    let _ = store
        .purge_expired(10)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let purge = proxy.turns() - before;
    assert_eq!(purge, 1, "purge_expired(10) took {purge} round trips");
    for (op, turns) in measure {
        assert_eq!(turns, 1, "{op} took {turns} round trips");
    }
}

/// The server goes away: calls fail with Unavailable (retryable) within the
/// call timeout; once it is back, the same store works again and the
/// completed record survived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_down_is_unavailable_and_the_store_recovers() {
    let server = pg::PgServer::start();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(pool)
        .call_timeout(Duration::from_secs(3))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let k = key("outage");
    let Ok(Acquisition::Acquired(l)) = store.acquire(&k, None, Duration::from_secs(60)).await
    else {
        panic!("not acquired")
    };
    store
        .complete(&l, b"before", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    server.stop();
    for i in 0..3 {
        match store
            .acquire(&key("during"), None, Duration::from_secs(60))
            .await
        {
            Err(e @ StoreError::Unavailable(_)) => assert!(e.is_retryable()),
            other => panic!("call {i} during the outage: expected Unavailable, got {other:?}"),
        }
    }
    server.start_again();
    // The pool reconnects on its own; broken connections fail once each.
    let mut recovered = None;
    for _ in 0..20 {
        match store.acquire(&k, None, Duration::from_secs(60)).await {
            Ok(a) => {
                recovered = Some(a);
                break;
            }
            Err(StoreError::Unavailable(_)) => continue,
            Err(e) => panic!("after restart: {e:?}"),
        }
    }
    match recovered {
        Some(Acquisition::Completed(r)) => assert_eq!(&r.response[..], b"before"),
        other => panic!("after restart: expected the completed record, got {other:?}"),
    }
}

// ------------------------------------------------------------------
// In-transaction mode
// ------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Payment {
    order: String,
    amount_cents: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    payment_id: i64,
}

/// A `payments` table of its own for one test.
async fn payments_table(pool: &PgPool) -> String {
    let table = format!("payments_{:08x}", fastrand::u32(..));
    exec(
        pool,
        format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, order_id text NOT NULL, amount_cents bigint NOT NULL)"
        ),
    )
    .await;
    table
}

async fn count_payments(pool: &PgPool, table: &str, order: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE order_id = $1"
    )))
    .bind(order)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Inserts the payment row inside `tx`.
async fn insert_payment(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    table: &str,
    payment: &Payment,
) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (order_id, amount_cents) VALUES ($1, $2) RETURNING id"
    )))
    .bind(&payment.order)
    .bind(payment.amount_cents)
    .fetch_one(&mut **tx)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_transaction_duplicates_racing_write_once_and_replay() {
    let store = PgHarness.store().await;
    let pool = store.pool().clone();
    let table = payments_table(&pool).await;
    let payment = Payment {
        order: format!("order-{:08x}", fastrand::u32(..)),
        amount_cents: 1999,
    };
    let k = IdempotencyKey::new("payments.charge", payment.order.clone())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (store, pool, table, payment, k) = (
            store.clone(),
            pool.clone(),
            table.clone(),
            payment.clone(),
            k.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
            let claim = store
                .in_transaction()
                .claim::<_, Receipt>(&mut tx, &k, &payment)
                .await
                .unwrap_or_else(|e| panic!("claim: {e}"));
            match claim {
                Claim::Replayed(r) => (false, r),
                Claim::Acquired(lease) => {
                    let payment_id = insert_payment(&mut tx, &table, &payment).await;
                    // Keep the transaction open so the others must wait.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let receipt = Receipt { payment_id };
                    lease
                        .complete(&mut tx, &receipt)
                        .await
                        .unwrap_or_else(|e| panic!("complete: {e}"));
                    tx.commit().await.unwrap_or_else(|e| panic!("commit: {e}"));
                    (true, receipt)
                }
            }
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap_or_else(|e| panic!("{e}")));
    }
    assert_eq!(
        results.iter().filter(|(ran, _)| *ran).count(),
        1,
        "exactly one ran"
    );
    let first = &results[0].1;
    assert!(
        results.iter().all(|(_, r)| r == first),
        "all got the same receipt"
    );
    assert_eq!(count_payments(&pool, &table, &payment.order).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_transaction_rollback_lets_the_waiting_duplicate_run() {
    let store = PgHarness.store().await;
    let pool = store.pool().clone();
    let table = payments_table(&pool).await;
    let payment = Payment {
        order: format!("order-{:08x}", fastrand::u32(..)),
        amount_cents: 500,
    };
    let k = IdempotencyKey::new("payments.charge", payment.order.clone())
        .unwrap_or_else(|e| panic!("{e}"));

    let mut first = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(_lease)) = store
        .in_transaction()
        .claim::<_, Receipt>(&mut first, &k, &payment)
        .await
    else {
        panic!("first claim")
    };
    insert_payment(&mut first, &table, &payment).await;

    let duplicate = {
        let (store, pool, table, payment, k) = (
            store.clone(),
            pool.clone(),
            table.clone(),
            payment.clone(),
            k.clone(),
        );
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
            match store
                .in_transaction()
                .claim::<_, Receipt>(&mut tx, &k, &payment)
                .await
            {
                Ok(Claim::Acquired(lease)) => {
                    let attempt = lease.attempt();
                    let receipt = Receipt {
                        payment_id: insert_payment(&mut tx, &table, &payment).await,
                    };
                    lease
                        .complete(&mut tx, &receipt)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
                    attempt
                }
                other => panic!("the duplicate should run after the rollback, got {other:?}"),
            }
        })
    };
    support::pg::until_waiting_on_locks(&pool, 1).await;
    first.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    let attempt = duplicate.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(attempt, 1, "a rolled-back reservation never existed");
    assert_eq!(count_payments(&pool, &table, &payment.order).await, 1);
    match store.acquire(&k, None, Duration::from_secs(5)).await {
        Ok(Acquisition::Completed(_)) => {}
        other => panic!("expected completed, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_transaction_killed_connection_leaves_nothing_behind() {
    let store = PgHarness.store().await;
    let pool = store.pool().clone();
    let table = payments_table(&pool).await;
    let payment = Payment {
        order: format!("order-{:08x}", fastrand::u32(..)),
        amount_cents: 700,
    };
    let k = IdempotencyKey::new("payments.charge", payment.order.clone())
        .unwrap_or_else(|e| panic!("{e}"));

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim::<_, Receipt>(&mut tx, &k, &payment)
        .await
    else {
        panic!("claim")
    };
    let payment_id = insert_payment(&mut tx, &table, &payment).await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(killed);
    // The handler carries on; its completion or commit fails.
    let completed = lease.complete(&mut tx, &Receipt { payment_id }).await;
    let committed = if completed.is_ok() {
        tx.commit().await.is_ok()
    } else {
        false
    };
    assert!(!committed, "a killed transaction must not commit");

    assert_eq!(count_payments(&pool, &table, &payment.order).await, 0);
    assert!(
        matches!(store.get(&k).await, Ok(None)),
        "no idempotency record left"
    );
    let mut again = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    match store
        .in_transaction()
        .claim::<_, Receipt>(&mut again, &k, &payment)
        .await
    {
        Ok(Claim::Acquired(lease)) => assert_eq!(lease.attempt(), 1),
        other => panic!("the key must be acquirable again, got {other:?}"),
    }
}

#[tokio::test]
async fn in_transaction_mismatch_and_replay_are_typed() {
    let store = PgHarness.store().await;
    let pool = store.pool().clone();
    let k = key("tx-mismatch");
    let payment = Payment {
        order: "o".into(),
        amount_cents: 1,
    };
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim::<_, Receipt>(&mut tx, &k, &payment)
        .await
    else {
        panic!("claim")
    };
    lease
        .complete(&mut tx, &Receipt { payment_id: 9 })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let other = Payment {
        order: "o".into(),
        amount_cents: 2,
    };
    let got = store
        .in_transaction()
        .claim::<_, Receipt>(&mut tx, &k, &other)
        .await;
    assert!(matches!(got, Err(IdemError::PayloadMismatch)), "{got:?}");
    drop(tx);
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let got: Result<Claim<Receipt>, IdemError<Infallible>> =
        store.in_transaction().claim(&mut tx, &k, &payment).await;
    assert!(
        matches!(got, Ok(Claim::Replayed(Receipt { payment_id: 9 }))),
        "{got:?}"
    );
}

// ------------------------------------------------------------------
// Fences, store-clock TTL, durations
// ------------------------------------------------------------------

/// A table at migration 1 (rows without a fence) is brought to 2 by
/// `migrate`: old rows read fence 0 and keep working, the next acquisition
/// gets a fence from the sequence; `migrate` again changes nothing, and the
/// migration SQL run a second time by hand (another tool) does not fail.
#[tokio::test]
async fn migration_2_upgrades_a_version_1_table() {
    let pool = pg::pool(pg::shared_url(), 2).await;
    let schema = format!("idem_up{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pool.clone())
        .schema(schema.clone())
        .table("records")
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let migrations = store.migrations();
    assert_eq!(
        migrations.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        vec![1, 2]
    );
    // Version 1 only, as an older release left it, with the versions table.
    exec(&pool, format!("CREATE SCHEMA \"{schema}\"")).await;
    exec(&pool, migrations[0].1.clone()).await;
    exec(
        &pool,
        format!(
            "CREATE TABLE \"{schema}\".\"records_migrations\" (version integer PRIMARY KEY, \
             description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now()); \
             INSERT INTO \"{schema}\".\"records_migrations\" (version, description) \
             VALUES (1, 'create records table')"
        ),
    )
    .await;
    let (done, held) = (key("old-done"), key("old-held"));
    exec(
        &pool,
        format!(
            "INSERT INTO \"{schema}\".\"records\" (scope, key, status, token, attempt, lease_until, \
             response, created_at, completed_at, expires_at) VALUES \
             ('{s}', '{d}', 2, '\\x000102030405060708090a0b0c0d0e0f', 1, NULL, 'old', now(), now(), \
              now() + interval '1 hour'), \
             ('{s}', '{h}', 1, '\\x0f0e0d0c0b0a09080706050403020100', 1, now() - interval '1 second', \
              NULL, now(), NULL, now() + interval '1 hour')",
            s = done.scope(),
            d = done.id(),
            h = held.id(),
        ),
    )
    .await;

    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("again: {e}"));
    exec(&pool, migrations[1].1.clone()).await; // by hand, once more
    let versions: Vec<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM \"{schema}\".\"records_migrations\" ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(versions, vec![1, 2]);

    let old = store.get(&done).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        old.map(|r| r.fence),
        Some(0),
        "a row from before has fence 0"
    );
    match store.acquire(&done, None, Duration::from_secs(5)).await {
        Ok(Acquisition::Completed(r)) => {
            assert_eq!(&r.response[..], b"old");
            assert_eq!(r.fence, 0);
            assert!(r.ttl > Duration::from_secs(3_500) && r.ttl <= Duration::from_secs(3_600));
        }
        other => panic!("expected the old completed row, got {other:?}"),
    }
    match store.acquire(&held, None, Duration::from_secs(5)).await {
        Ok(Acquisition::Acquired(lease)) => {
            assert_eq!(lease.attempt, 2, "took the old row over");
            assert!(lease.fence > 0);
        }
        other => panic!("expected a takeover of the old row, got {other:?}"),
    }
}

/// In-transaction claims take fences from the same sequence: a claim
/// after a rolled-back one, after a commit without completion (takeover)
/// and after a plain acquisition and release, each has a higher fence.
#[tokio::test]
async fn in_transaction_claims_carry_increasing_fences() {
    let store = PgHarness.store().await;
    let pool = store.pool().clone();
    let k = key("tx-fence");
    let mut fences = Vec::new();

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("first claim")
    };
    fences.push(lease.fence());
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("claim after rollback")
    };
    assert_eq!(lease.attempt(), 1);
    fences.push(lease.fence());
    // Committed without completing: the next claim takes it over.
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("takeover claim")
    };
    assert_eq!(lease.attempt(), 2);
    fences.push(lease.fence());
    lease
        .release(&mut tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));

    let Ok(Acquisition::Acquired(plain)) = store.acquire(&k, None, Duration::from_secs(5)).await
    else {
        panic!("plain acquire")
    };
    fences.push(plain.fence);
    store
        .release(&plain)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("claim after release")
    };
    fences.push(lease.fence());
    assert_eq!(lease.fence(), lease.lease().fence);
    lease
        .complete(&mut tx, &Receipt { payment_id: 1 })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let record = store.get(&k).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(record.map(|r| r.fence), fences.last().copied());
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences do not strictly increase: {fences:?}"
    );
}

/// `Duration::MAX` as the in-transaction retention is saturated, not an
/// error: the record completes and replays; its expiry is about
/// MAX_DURATION away. And the plain store's MAX lease + the in-progress
/// grace fits PostgreSQL's timestamptz.
/// A response the in-transaction claim cannot record (over the store's
/// `max_response_bytes`, or a NaN the JSON codec refuses) completes the
/// key "not replayable" in the same transaction: the writes commit, and
/// every later claim gets `ResultUnavailable`, never a second run.
#[tokio::test]
async fn in_transaction_a_response_that_cannot_be_recorded_completes_not_replayable() {
    let pool = pg::pool(pg::shared_url(), 4).await;
    let store = PgStore::builder(pool.clone())
        .max_response_bytes(64)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    for (name, response) in [
        (
            "tx-too-large",
            serde_json::json!({ "pad": "x".repeat(256) }),
        ),
        ("tx-nan", serde_json::json!({ "amount": 1.0 })),
    ] {
        let k = key(name);
        let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
        let Ok(Claim::Acquired(lease)) = store
            .in_transaction()
            .claim_with::<serde_json::Value>(&mut tx, &k, None)
            .await
        else {
            panic!("claim")
        };
        let completion = if name == "tx-nan" {
            lease.complete(&mut tx, &f64::NAN).await
        } else {
            lease.complete(&mut tx, &response).await
        };
        match completion {
            Ok(idemkit::postgres::Completion::NotReplayable { reason }) => {
                assert!(!reason.is_empty())
            }
            other => panic!("{name}: expected NotReplayable, got {other:?}"),
        }
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
        let mut again = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
        let claimed = store
            .in_transaction()
            .claim_with::<serde_json::Value>(&mut again, &k, None)
            .await;
        assert!(
            matches!(claimed, Err(IdemError::ResultUnavailable { .. })),
            "{name}: {claimed:?}"
        );
    }
}

#[tokio::test]
async fn in_transaction_retention_of_duration_max() {
    let store = PgHarness.store().await;
    let pool = store.pool().clone();
    let k = key("tx-max");
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(lease)) = store
        .in_transaction()
        .retention(Duration::MAX)
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("claim")
    };
    lease
        .complete(&mut tx, &Receipt { payment_id: 3 })
        .await
        .unwrap_or_else(|e| panic!("complete with Duration::MAX: {e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let far = std::time::SystemTime::now() + idemkit::MAX_DURATION - Duration::from_secs(86_400);
    match store.acquire(&k, None, Duration::from_secs(5)).await {
        Ok(Acquisition::Completed(r)) => {
            assert!(r.expires_at > far, "{:?}", r.expires_at);
            assert!(r.ttl > idemkit::MAX_DURATION - Duration::from_secs(86_400));
            assert!(r.ttl <= idemkit::MAX_DURATION);
        }
        other => panic!("expected the replay, got {other:?}"),
    }

    let k = key("max-lease");
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, Duration::MAX).await else {
        panic!("acquire")
    };
    let record = store
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("no record"));
    let grace = record
        .expires_at
        .duration_since(lease.expires_at)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        grace,
        idemkit::IN_PROGRESS_GRACE,
        "expiry = MAX lease + grace"
    );
    let zero = store.acquire(&key("zero"), None, Duration::ZERO).await;
    assert!(
        matches!(zero, Err(StoreError::InvalidArgument { .. })),
        "{zero:?}"
    );
}

// ------------------------------------------------------------------
// Waits, timeouts, restarts and connections
// ------------------------------------------------------------------

/// A store on the shared server with its own pool and call timeout.
async fn store_with_timeout(call_timeout: Duration) -> PgStore {
    let store = PgStore::builder(pg::pool(pg::shared_url(), 8).await)
        .call_timeout(call_timeout)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

/// The server's clock, in the form leases are given in.
async fn server_now(pool: &PgPool) -> std::time::SystemTime {
    let us: i64 =
        sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8")
            .fetch_one(pool)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    std::time::UNIX_EPOCH + Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

/// Item 1: a delivery waits on an in-transaction claim for two leases, then
/// acquires; its lease starts when its row is written, so a redelivery
/// while its handler runs is told "in progress" and the handler runs once.
/// (A lease counted from the statement's start would be born over, and
/// the redelivery would take it over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_granted_after_a_lock_wait_starts_when_the_row_is_written() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let store = store_with_timeout(Duration::from_secs(10)).await;
    let key = key("late");
    let lease = Duration::from_millis(600);
    let idem = idemkit::Idempotency::new(store.clone()).lease(lease);
    let effects = Arc::new(AtomicU64::new(0));
    let started = Arc::new(tokio::sync::Notify::new());

    // A transactional worker holds the key (uncommitted insert)...
    let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim::<_, String>(&mut tx, &key, "payload")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(claim, Claim::Acquired(_)));

    // ... a delivery through the executor waits for it ...
    let first = {
        let (idem, key, effects, started) =
            (idem.clone(), key.clone(), effects.clone(), started.clone());
        tokio::spawn(async move {
            idem.process(&key, "payload", move |_| async move {
                effects.fetch_add(1, Ordering::SeqCst);
                started.notify_one();
                tokio::time::sleep(Duration::from_millis(1500)).await;
                Ok::<_, std::io::Error>("first".to_owned())
            })
            .await
        })
    };
    support::pg::until_waiting_on_locks(store.pool(), 1).await;
    // ... for two leases (the length of the fault), then the transaction
    // rolls back.
    tokio::time::sleep(lease * 2).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));

    tokio::time::timeout(Duration::from_secs(5), started.notified())
        .await
        .unwrap_or_else(|_| panic!("the first delivery never ran"));
    let record = store.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    let now = server_now(store.pool()).await;
    println!("row as written: {record:?}\nserver clock: {now:?}");
    // A redelivery arrives while that handler runs.
    let effects2 = effects.clone();
    let second = idem
        .process(&key, "payload", move |_| async move {
            effects2.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>("second".to_owned())
        })
        .await;
    let first = first.await.unwrap_or_else(|e| panic!("{e}"));
    let n = effects.load(Ordering::SeqCst);
    println!("redelivery: {second:?}; first: {first:?}; handler executions: {n}");
    assert!(
        matches!(second, Err(IdemError::InProgress { .. })),
        "a live handler's key was taken over: {second:?}"
    );
    assert_eq!(n, 1, "the handler ran {n} times");
}

/// Item 1: a takeover that waits on a row lock held by another session
/// (here a plain `SELECT ... FOR UPDATE`, which PostgreSQL does not
/// re-evaluate the update for) longer than the lease never reports a lease
/// that is already over: a duplicate right after it is "in progress".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_waited_on_a_row_lock_reports_a_live_lease() {
    let store = store_with_timeout(Duration::from_secs(10)).await;
    let k = key("locked-takeover");
    let lease = Duration::from_millis(300);
    let Ok(Acquisition::Acquired(first)) = store.acquire(&k, None, lease).await else {
        panic!("not acquired")
    };
    // The holder vanishes; its lease runs out.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;

    let mut locker = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE scope = $1 AND key = $2 FOR UPDATE",
        store.qualified_table()
    )))
    .bind(k.scope())
    .bind(k.id())
    .execute(&mut *locker)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let takeover = {
        let (store, k) = (store.clone(), k.clone());
        tokio::spawn(async move { store.acquire(&k, None, lease).await })
    };
    support::pg::until_waiting_on_locks(store.pool(), 1).await;
    tokio::time::sleep(lease * 2).await; // the lock is held for two leases
    locker.commit().await.unwrap_or_else(|e| panic!("{e}"));

    let second = match takeover.await.unwrap_or_else(|e| panic!("{e}")) {
        Ok(Acquisition::Acquired(l)) => l,
        other => panic!("expected the takeover, got {other:?}"),
    };
    let now = server_now(store.pool()).await;
    println!(
        "takeover: attempt {} fence {} lease until {:?}, server now {now:?}",
        second.attempt, second.fence, second.expires_at
    );
    assert!(second.fence > first.fence);
    assert!(
        second.expires_at > now,
        "the takeover was granted a lease that was already over"
    );
    let duplicate = store.acquire(&k, None, lease).await;
    assert!(
        matches!(duplicate, Ok(Acquisition::InProgress { .. })),
        "a duplicate took the fresh takeover over: {duplicate:?}"
    );
}

/// Item 1: fences never go backwards, even when an acquisition's insert is
/// delayed after its statement started (here by a test trigger that sleeps
/// before the row is inserted, widening a window that preemption opens in
/// production): an acquisition that lands later always carries a higher
/// fence than one that landed before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_insert_never_lands_with_a_lower_fence() {
    let pool = pg::pool(pg::shared_url(), 4).await;
    let schema = format!("idem_fence{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pool.clone())
        .schema(schema.clone())
        .table("records")
        .call_timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    exec(
        &pool,
        format!(
            "CREATE FUNCTION \"{schema}\".slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF current_setting('idem_test.slow_insert', true) = 'on' THEN \
             PERFORM pg_sleep(0.5); END IF; RETURN NEW; END $$; \
             CREATE TRIGGER slow_insert BEFORE INSERT ON \"{schema}\".\"records\" \
             FOR EACH ROW EXECUTE FUNCTION \"{schema}\".slow_insert()"
        ),
    )
    .await;
    let k = key("fence-order");

    // X: an in-transaction claim whose insert is held back by the trigger.
    let (claimed_tx, claimed_rx) = tokio::sync::oneshot::channel::<u64>();
    let x = {
        let (store, pool, k) = (store.clone(), pool.clone(), k.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
            sqlx::query("SET LOCAL idem_test.slow_insert = 'on'")
                .execute(&mut *tx)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let Ok(Claim::Acquired(lease)) = store
                .in_transaction()
                .claim_with::<u64>(&mut tx, &k, None)
                .await
            else {
                panic!("X not acquired")
            };
            let fence = lease.fence();
            let _ = claimed_tx.send(fence);
            lease
                .release(&mut tx)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
            fence
        })
    };
    // X's statement is running (sleeping in the trigger).
    for _ in 0..500 {
        let sleeping: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        if sleeping > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Y: a plain acquisition of the same key meanwhile.
    let y = match store.acquire(&k, None, Duration::from_secs(30)).await {
        Ok(Acquisition::Acquired(l)) => l,
        other => panic!("Y: {other:?}"),
    };
    let mut claimed_rx = claimed_rx;
    let x_first = claimed_rx.try_recv().ok();
    store.release(&y).await.unwrap_or_else(|e| panic!("{e}"));
    let x_fence = x.await.unwrap_or_else(|e| panic!("{e}"));
    println!(
        "X (delayed insert) fence {x_fence}, Y fence {}; X acquired first: {}",
        y.fence,
        x_first.is_some()
    );
    if x_first.is_some() {
        assert!(y.fence > x_fence, "Y came after X with a lower fence");
    } else {
        assert!(
            x_fence > y.fence,
            "X's insert landed after Y's acquisition with a lower fence ({x_fence} < {})",
            y.fence
        );
    }
}

/// A SQLSTATE of the PostgreSQL error behind a store error.
fn sqlstate(e: &StoreError) -> Option<String> {
    let source = match e {
        StoreError::Unavailable(s) | StoreError::Backend(s) => s,
        _ => return None,
    };
    match source.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(db)) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// A pool whose connections carry `settings` (as a DBA's role or database
/// defaults would), on the shared server.
async fn pool_with_settings(max: u32, settings: &[(&str, &str)]) -> PgPool {
    let options: sqlx::postgres::PgConnectOptions =
        pg::shared_url().parse().unwrap_or_else(|e| panic!("{e}"));
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .connect_with(options.options(settings.iter().copied()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Item 2: a completion killed by the server's `lock_timeout` (55P03) or
/// `statement_timeout` (57014) is `Unavailable`, retryable, and the retry
/// completes once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_lock_and_statement_timeouts_are_unavailable_and_retryable() {
    for (setting, code) in [("lock_timeout", "55P03"), ("statement_timeout", "57014")] {
        let pool = pool_with_settings(4, &[(setting, "100ms")]).await;
        let store = PgStore::builder(pool)
            .call_timeout(Duration::from_secs(10))
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let k = key("timeout-complete");
        let Ok(Acquisition::Acquired(lease)) =
            store.acquire(&k, None, Duration::from_secs(30)).await
        else {
            panic!("not acquired")
        };
        let other = pg::pool(pg::shared_url(), 1).await;
        let mut locker = other.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT 1 FROM {} WHERE scope = $1 AND key = $2 FOR UPDATE",
            store.qualified_table()
        )))
        .bind(k.scope())
        .bind(k.id())
        .execute(&mut *locker)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let blocked = store
            .complete(&lease, b"done", Duration::from_secs(60))
            .await;
        println!("{setting}: complete behind a lock: {blocked:?}");
        match &blocked {
            Err(e @ StoreError::Unavailable(_)) => {
                assert!(e.is_retryable());
                assert_eq!(sqlstate(e).as_deref(), Some(code), "{e:?}");
            }
            other => panic!("{setting}: expected Unavailable ({code}), got {other:?}"),
        }
        locker.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        store
            .complete(&lease, b"done", Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{setting}: the retry: {e}"));
    }
}

/// Items 2 and 8: the server ends an idle store connection
/// (`idle_session_timeout`, 57P05) before the next call is sent: the call
/// is not lost, it runs on a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_server_closed_while_idle_costs_no_failed_call() {
    let app = format!("idem-idle-{:08x}", fastrand::u32(..));
    let pool = pool_with_settings(
        2,
        &[
            ("idle_session_timeout", "200ms"),
            ("application_name", &app),
        ],
    )
    .await;
    let store = PgStore::builder(pool)
        .call_timeout(Duration::from_secs(10))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let k = key("idle-killed");
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired")
    };
    // The server closes every idle session of this application.
    let monitor = pg::pool(pg::shared_url(), 1).await;
    for i in 0.. {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(&app)
                .fetch_one(&monitor)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        if left == 0 {
            break;
        }
        assert!(i < 500, "the server never closed the idle sessions");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let done = store.complete(&lease, b"r", Duration::from_secs(60)).await;
    println!("complete on a connection the server closed while idle: {done:?}");
    assert!(done.is_ok(), "{done:?}");
}

/// An acquire that waited on a lock past the call
/// timeout is told "unavailable", and its statement dies on the server
/// too: no reservation commits after its caller gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_timed_out_never_commits_a_reservation_later() {
    let store = store_with_timeout(Duration::from_millis(300)).await;
    let key = key("ghost");
    let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim::<_, String>(&mut tx, &key, "payload")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(claim, Claim::Acquired(_)));

    let lease = Duration::from_secs(30);
    let told = store.acquire(&key, None, lease).await;
    println!("acquire while the row is locked: {told:?}");
    assert!(
        matches!(told, Err(ref e) if e.is_retryable()),
        "the caller is told the store is unavailable"
    );
    // The in-transaction worker fails and rolls back.
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    // Nothing may happen from here on: give a lingering statement the time
    // to commit if it were still alive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let record = store.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    println!("record after the caller gave up: {record:?}");
    assert!(
        record.is_none(),
        "a reservation committed after its caller was told 'unavailable'"
    );
    assert!(matches!(
        store.acquire(&key, None, lease).await,
        Ok(Acquisition::Acquired(l)) if l.attempt == 1
    ));
}

/// Twenty retries of a call blocked by a frozen lock
/// holder leave no server backend waiting behind them (each statement died
/// on the server with its call); before, each left one, past the store's
/// connection limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_calls_leave_no_server_backend_waiting() {
    let store = store_with_timeout(Duration::from_millis(200)).await;
    let key = key("pile");
    let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim::<_, String>(&mut tx, &key, "payload")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(claim, Claim::Acquired(_)));
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..20 {
        let r = store.acquire(&key, None, Duration::from_secs(30)).await;
        assert!(matches!(r, Err(ref e) if e.is_retryable()), "{r:?}");
    }
    let blocked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
    )
    .bind(holder)
    .fetch_one(store.pool())
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    println!("backends still blocked after 20 timed-out calls: {blocked}");
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(blocked, 0, "{blocked} server backends outlive their calls");
}

/// Item 7: one transaction claiming the same key twice gets the same
/// claim (same token, attempt and fence), never a takeover of its own
/// row; both complete; a claim rolled back with its savepoint is gone.
#[tokio::test]
async fn one_transaction_claiming_a_key_twice_gets_the_same_claim() {
    let store = PgHarness.store().await;
    let pool = store.pool().clone();
    let k = key("tx-twice");
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(first)) = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("first claim")
    };
    let again = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await;
    let second = match again {
        Ok(Claim::Acquired(second)) => second,
        other => panic!("second claim in the same transaction: {other:?}"),
    };
    println!(
        "first: attempt {} fence {}; second: attempt {} fence {}",
        first.attempt(),
        first.fence(),
        second.attempt(),
        second.fence()
    );
    assert_eq!(second.attempt(), 1, "the transaction took its own row over");
    assert_eq!(second.fence(), first.fence());
    assert_eq!(second.lease().token, first.lease().token);
    first
        .complete(&mut tx, &Receipt { payment_id: 1 })
        .await
        .unwrap_or_else(|e| panic!("completing the first claim: {e}"));
    second
        .complete(&mut tx, &Receipt { payment_id: 2 })
        .await
        .unwrap_or_else(|e| panic!("completing the second claim: {e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let got = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await;
    assert!(
        matches!(got, Ok(Claim::Replayed(Receipt { payment_id: 1 }))),
        "{got:?}"
    );
    drop(tx);

    // A claim inside a savepoint that is rolled back leaves nothing.
    let k = key("tx-savepoint");
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    {
        let mut inner = sqlx::Acquire::begin(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let Ok(Claim::Acquired(_)) = store
            .in_transaction()
            .claim_with::<Receipt>(&mut inner, &k, None)
            .await
        else {
            panic!("claim in the savepoint")
        };
        inner.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    }
    let got = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await;
    assert!(
        matches!(&got, Ok(Claim::Acquired(l)) if l.attempt() == 1),
        "{got:?}"
    );
}

/// Item 8: PostgreSQL restarts while the store's connections sit idle;
/// every one of them is dead, yet no call fails: a call whose connection
/// the server had already closed runs again on a fresh one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_warm_idle_connections_fails_no_call() {
    let server = pg::PgServer::start();
    let pool = pg::pool(&server.url, 2).await;
    // Calls alone: eight acquires of one key open eight connections.
    let store = PgStore::builder(pool.clone())
        .connections(8)
        .call_timeout(Duration::from_secs(5))
        .batching(Batching::off())
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    // Open all eight: eight acquires wait on an in-transaction claim.
    let k = key("warm");
    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(_)) = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("claim")
    };
    let waiting: Vec<_> = (0..8)
        .map(|_| {
            let (store, k) = (store.clone(), k.clone());
            tokio::spawn(async move { store.acquire(&k, None, Duration::from_secs(30)).await })
        })
        .collect();
    let monitor = pg::pool(&server.url, 1).await;
    support::pg::until_waiting_on_locks(&monitor, 8).await;
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    for w in waiting {
        let got = w.await.unwrap_or_else(|e| panic!("{e}"));
        assert!(got.is_ok(), "{got:?}");
    }
    monitor.close().await;
    pool.close().await;

    server.stop();
    server.start_again();
    let mut failed = Vec::new();
    for i in 0..16 {
        if let Err(e) = store.get(&key(&format!("after-restart-{i}"))).await {
            failed.push(e.to_string());
        }
    }
    println!(
        "calls failed after a restart with 8 warm idle connections: {}",
        failed.len()
    );
    assert!(failed.is_empty(), "{failed:?}");
}

/// Item 9: `purge_expired` finds expired rows through the `expires_at`
/// index (a stable time, not `clock_timestamp()`), so a batch with nothing
/// to delete does not scan the table.
#[tokio::test]
async fn purge_expired_finds_expired_rows_through_the_expires_at_index() {
    let pool = pg::pool(pg::shared_url(), 2).await;
    let schema = format!("idem_purge{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pool.clone())
        .schema(schema.clone())
        .table("records")
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let table = format!("\"{schema}\".\"records\"");
    exec(
        &pool,
        format!(
            "INSERT INTO {table} (scope, key, status, token, attempt, response, created_at, \
             completed_at, expires_at) \
             SELECT 'purge', 'live-' || i, 2, '\\x000102030405060708090a0b0c0d0e0f', 1, 'r', now(), \
                    now(), now() + interval '1 day' FROM generate_series(1, 50000) i; \
             INSERT INTO {table} (scope, key, status, token, attempt, response, created_at, \
             completed_at, expires_at) \
             SELECT 'purge', 'old-' || i, 2, '\\x000102030405060708090a0b0c0d0e0f', 1, 'r', now(), \
                    now(), now() - interval '1 second' FROM generate_series(1, 10) i; \
             ANALYZE {table}"
        ),
    )
    .await;
    let statement = include_str!("../../idem-postgres/sql/purge.sql").replace("{{table}}", &table);
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {statement}")))
        .bind(1_000i64)
        .fetch_all(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let plan = plan.join("\n");
    println!("{plan}");
    assert!(
        plan.contains("records_expires_at_idx") && !plan.contains("Seq Scan"),
        "purge does not use the expires_at index:\n{plan}"
    );
    assert_eq!(
        store
            .purge_expired(100)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        10
    );
    assert_eq!(
        store
            .purge_expired(100)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        0
    );
}

/// Item 11: the store's own connections are a small set (4 by default)
/// next to the pool's, opened the way the pool opens its own (its
/// `after_connect` runs on them), and closed after the pool's
/// `idle_timeout`. A burst that fills the pool (10) and the store shows at
/// most 10 + 4 server backends, not 10 + 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_connections_are_a_small_set_that_honours_the_pool_options() {
    let server = pg::PgServer::start();
    let app = "idem-after-connect";
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .test_before_acquire(false)
        .idle_timeout(Duration::from_millis(300))
        .after_connect(move |conn, _meta| {
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SET application_name = '{app}'"
                )))
                .execute(conn)
                .await
                .map(|_| ())
            })
        })
        .connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::new(pool.clone());
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let mut monitor = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut holder = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let count = |sql: &'static str| sqlx::query_scalar::<_, i64>(sql);
    let backends = "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
                    AND pid <> pg_backend_pid()";

    // Everything waits behind one claim: 10 in-transaction claims on the
    // pool, 32 plain acquires on the store.
    let k = key("budget");
    let mut tx = sqlx::Connection::begin(&mut holder)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let Ok(Claim::Acquired(_)) = store
        .in_transaction()
        .claim_with::<Receipt>(&mut tx, &k, None)
        .await
    else {
        panic!("claim")
    };
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (store, pool, k) = (store.clone(), pool.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
            let _ = store
                .in_transaction()
                .claim_with::<Receipt>(&mut tx, &k, None)
                .await;
        }));
    }
    for _ in 0..32 {
        let (store, k) = (store.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            let _ = store.acquire(&k, None, Duration::from_secs(30)).await;
        }));
    }
    // Until the number of waiting sessions stops growing.
    let waiting_sql = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'";
    let (mut last, mut stable) = (-1, 0);
    for _ in 0..500 {
        let now = count(waiting_sql)
            .fetch_one(&mut monitor)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if now == last && now >= 10 {
            stable += 1;
            if stable == 10 {
                break;
            }
        } else {
            (last, stable) = (now, 0);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total = count(backends)
        .fetch_one(&mut monitor)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        - 1; // the holder
    let without_hook: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
         AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' AND application_name <> $1",
    )
    .bind(app)
    .fetch_one(&mut monitor)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    println!(
        "server backends of the pool (10) and the store: {total}; waiting without after_connect: {without_hook}"
    );
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    for t in tasks {
        t.await.unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(total <= 14, "{total} backends for a pool of 10 and a store");
    assert_eq!(without_hook, 0, "store connections skipped after_connect");

    // Idle past the pool's idle_timeout: the pool and the store close theirs.
    let mut left = -1;
    for _ in 0..300 {
        left = count(backends)
            .fetch_one(&mut monitor)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            - 1;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("backends left after the idle timeout: {left}");
    assert_eq!(left, 0, "idle connections outlive the pool's idle_timeout");
}

/// Item 11: the store's connections are counted (`connection_stats` and
/// the gauge `idem_postgres_connections`), stay within `connections(n)`,
/// and one past the pool's `max_lifetime` is replaced by a new one.
#[test]
fn store_connections_are_counted_and_replaced_after_the_max_lifetime() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let schema = format!("idem_life{:08x}", fastrand::u32(..));
    let table = format!("{schema}.records");
    let stats = metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        runtime.block_on(async {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .test_before_acquire(false)
                .idle_timeout(None)
                .max_lifetime(Duration::from_millis(300))
                .connect(pg::shared_url())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let store = PgStore::builder(pool)
                .schema(schema.clone())
                .table("records")
                .connections(1)
                .build()
                .unwrap_or_else(|e| panic!("{e}"));
            store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(store.connection_stats().max, 1);
            assert_eq!(store.server_timeout(), Duration::from_secs(5));
            // A call every 100 ms for a second: the connection outlives
            // its 300 ms lifetime and is replaced.
            for i in 0..10 {
                let got = store.get(&key(&format!("life-{i}"))).await;
                assert!(matches!(got, Ok(None)), "{got:?}");
                let stats = store.connection_stats();
                assert!(stats.open <= 1, "{stats:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            store.connection_stats()
        })
    });
    println!("store connections after a second of calls: {stats:?}");
    assert!(stats.opened >= 3, "connections not replaced: {stats:?}");
    let gauge = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(k, _, _, _)| {
            k.key().name() == "idem_postgres_connections"
                && k.key()
                    .labels()
                    .any(|l| l.key() == "table" && l.value() == table)
        })
        .map(|(_, _, _, v)| v);
    assert!(
        matches!(gauge, Some(DebugValue::Gauge(g)) if g.into_inner() == stats.open as f64),
        "{gauge:?} for {stats:?}"
    );
}

// ------------------------------------------------------------------
// Call timeouts, settings, lost replies, the connection gauge, delete
// ------------------------------------------------------------------

/// DESIGN 5: "a call the client gave up on dies on the
/// server too (never a reservation that commits after its caller was told
/// 'unavailable')". An acquire re-run (a row committed after the
/// statement's snapshot, the usual result of waiting on the key's advisory
/// lock) obeys the same rule as the first send: only while enough of the
/// call is left for the server's timeout to fire first. Here the call got
/// its connection late (sent at ~35% of the call), waited on an
/// in-transaction claim past the send-by point, and needs a re-run: it is
/// not sent, the caller is told `Unavailable` (the first run wrote
/// nothing), and the key stays free for the retry. (Before the fix the
/// re-run was sent, committed after the caller gave up, and the retry got
/// "in progress" for the whole lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_rerun_too_late_in_the_call_is_not_sent_and_leaves_the_key_free() {
    use std::time::Instant;
    let pool = pg::pool(pg::shared_url(), 8).await;
    let store = PgStore::builder(pool.clone())
        .call_timeout(Duration::from_secs(2))
        .connections(1)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let (k, hog_key) = (key("rerun-late"), key("rerun-hog"));
    let lease = Duration::from_secs(30);
    let intx = store.in_transaction();

    // T0 holds another key; T1 holds k (both in-transaction claims).
    let mut t0 = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let c0 = intx.claim_with::<String>(&mut t0, &hog_key, None).await;
    assert!(matches!(c0, Ok(Claim::Acquired(_))));
    let mut t1 = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let c1 = intx.claim_with::<String>(&mut t1, &k, None).await;
    assert!(matches!(c1, Ok(Claim::Acquired(_))));

    // Another call occupies the store's only connection, waiting on T0.
    let hog = {
        let (store, hog_key) = (store.clone(), hog_key.clone());
        tokio::spawn(async move { store.acquire(&hog_key, None, lease).await })
    };
    support::pg::until_waiting_on_locks(&pool, 1).await;

    // The call under test: waits for the connection, then for T1.
    let started = Instant::now();
    let b = {
        let (store, k) = (store.clone(), k.clone());
        tokio::spawn(async move { store.acquire(&k, None, lease).await })
    };
    tokio::time::sleep(Duration::from_millis(650)).await;
    t0.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    let hogged = hog.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(hogged, Ok(Acquisition::Acquired(_))), "{hogged:?}");
    support::pg::until_waiting_on_locks(&pool, 1).await;
    println!(
        "acquire sent at {:?} (send_by is 800 ms)",
        started.elapsed()
    );

    // T2, another in-transaction worker, queues behind it for k.
    let (release_t2, t2_go) = tokio::sync::oneshot::channel::<()>();
    let t2 = {
        let (pool, store, k) = (pool.clone(), store.clone(), k.clone());
        tokio::spawn(async move {
            let mut t2 = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
            let c = store
                .in_transaction()
                .claim_with::<String>(&mut t2, &k, None)
                .await;
            println!("T2 claim: {:?}", c.as_ref().map(|_| "claimed"));
            let _ = t2_go.await;
            t2.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        })
    };
    support::pg::until_waiting_on_locks(&pool, 2).await;

    // T1 commits without completing (DESIGN: the key is left in progress
    // with its lease over, for the next delivery to take over).
    tokio::time::sleep(Duration::from_millis(1400).saturating_sub(started.elapsed())).await;
    t1.commit().await.unwrap_or_else(|e| panic!("{e}"));

    let told = b.await.unwrap_or_else(|e| panic!("{e}"));
    let at = started.elapsed();
    // The caller was told the store is unavailable; T2 gives up at once.
    let _ = release_t2.send(());
    t2.await.unwrap_or_else(|e| panic!("{e}"));
    println!("caller told after {at:?}: {told:?}");
    assert!(
        matches!(told, Err(ref e) if e.is_retryable()),
        "expected Unavailable, got {told:?}"
    );

    tokio::time::sleep(Duration::from_millis(300)).await;
    let record = store.get(&k).await.unwrap_or_else(|e| panic!("{e}"));
    let now = server_now(&pool).await;
    println!("record after the caller gave up: {record:?}\nserver clock: {now:?}");
    // Nobody holds k: T1 left it with its lease over, T2 rolled back, and
    // the call above was told "unavailable". The retry must acquire it.
    let retry = store.acquire(&k, None, lease).await;
    println!("the caller's retry: {retry:?}");
    assert!(
        matches!(retry, Ok(Acquisition::Acquired(_))),
        "a reservation committed after its caller was told 'unavailable': the retry got {retry:?}"
    );
}

/// DESIGN 4: "Configuration never panics".
/// `PgStoreBuilder::connections(n)` is clamped to `MAX_CONNECTIONS` and
/// nothing is allocated per possible connection, so `usize::MAX` builds a
/// store (it used to panic: capacity overflow / tokio's MAX_PERMITS).
#[tokio::test]
async fn a_huge_connection_count_is_clamped_and_does_not_panic_the_builder() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy(pg::shared_url())
        .unwrap_or_else(|e| panic!("{e}"));
    for n in [usize::MAX, usize::MAX >> 2] {
        let builder = PgStore::builder(pool.clone()).connections(n);
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            builder.build().map(|s| s.connection_stats())
        }));
        println!(
            "connections({n}): {:?}",
            built.as_ref().map_err(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            })
        );
        let Ok(Ok(stats)) = built else {
            panic!("PgStoreBuilder::connections({n}).build() panicked or failed")
        };
        assert_eq!(stats.max, idemkit::postgres::MAX_CONNECTIONS, "{stats:?}");
    }
}

/// A URL of the shared server through a new proxy that can lose replies
/// (its table migrated).
pub(crate) async fn proxied_shared_server() -> (support::proxy::CountingProxy, String) {
    PgHarness.store().await; // migrated
    pg::proxied().await
}

/// An acquire whose reply is lost after the server
/// committed it is sent again (same token, so it answers "acquired")
/// whether its connection was reused or fresh (the store's first call, or
/// the first after the pool's idle timeout or max lifetime). Before the
/// fix only a reused connection was resent: on a fresh one the caller got
/// `Unavailable` and the reservation stayed, held by a token nobody has,
/// "in progress" for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_acquire_reply_is_resent_on_fresh_and_reused_connections() {
    let (proxy, url) = proxied_shared_server().await;
    let lease = Duration::from_secs(30);

    // Reused connection: warmed by one call first.
    let store = one_connection_store(&url).await;
    let _ = store.get(&key("warm")).await;
    let k1 = key("lost-reused");
    proxy.lose_replies_to(k1.id().as_bytes(), 1, 1);
    let reused = store.acquire(&k1, None, lease).await;
    println!(
        "reply lost on a reused connection: {reused:?} (lost {})",
        proxy.lost()
    );
    assert!(matches!(reused, Ok(Acquisition::Acquired(_))), "{reused:?}");

    // Fresh connection: a new store, this is its first call.
    let store = one_connection_store(&url).await;
    let k2 = key("lost-fresh");
    proxy.lose_replies_to(k2.id().as_bytes(), 1, 1);
    let fresh = store.acquire(&k2, None, lease).await;
    println!(
        "reply lost on a fresh connection: {fresh:?} (lost {})",
        proxy.lost()
    );
    let record = store.get(&k2).await.unwrap_or_else(|e| panic!("{e}"));
    let retry = store.acquire(&k2, None, lease).await;
    println!("record: {record:?}\nthe caller's retry: {retry:?}");
    assert!(
        matches!(fresh, Ok(Acquisition::Acquired(_))),
        "a lost reply on a fresh connection was not resent: {fresh:?}"
    );
    assert!(
        matches!(retry, Ok(Acquisition::InProgress { .. })),
        "the resent acquisition holds the key: another call is in progress, got {retry:?}"
    );
}

/// `connection_stats().open` and the gauge
/// `idem_postgres_connections` count a connection only once its session
/// setup (the `set_config` of the server timeouts) succeeded; one whose
/// setup fails is dropped uncounted. Before the fix each such failure left
/// the count one higher for good (3 open, over a maximum of 1, with none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_session_setup_is_not_counted_as_an_open_connection() {
    let (proxy, url) = proxied_shared_server().await;
    let store = one_connection_store(&url).await;
    proxy.lose_replies_to(b"set_config('statement_timeout'", 1, 3);
    for i in 0..3 {
        let r = store.get(&key(&format!("setup-{i}"))).await;
        println!("call {i}: {r:?}");
    }
    let stats = store.connection_stats();
    println!("lost {} setup replies; stats {stats:?}", proxy.lost());
    assert_eq!(proxy.lost(), 3);
    assert!(
        stats.open <= stats.max && stats.open == stats.idle,
        "the store counts connections it does not have: {stats:?}"
    );
}

/// `delete` has no token, so it is never resent: a
/// connection failure during it is `Unavailable` (the delete may or may not
/// have happened). Before the fix a delete whose reply was lost was resent
/// on a fresh connection (here a slow one: `after_connect` takes 500 ms);
/// meanwhile a delivery acquired the key, and the resend deleted that live
/// reservation, so a redelivery ran the handler a second time while the
/// first still ran (DESIGN 4: nothing but the handler's own Err/panic lets
/// a key run again before its lease ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_whose_reply_was_lost_is_not_resent_and_spares_a_later_reservation() {
    let (proxy, url) = proxied_shared_server().await;
    // The deleting store (an admin task, or a TieredStore's source) goes
    // through the proxy; connecting takes 500 ms (a remote server, TLS).
    let slow_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|_conn, _meta| {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok(())
            })
        })
        .connect_lazy(&url)
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = PgStore::builder(slow_pool)
        .connections(1)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    // The workers talk to the server directly.
    let store = PgHarness.store().await;
    let lease = Duration::from_secs(30);
    let k = key("resent-delete");
    let Ok(Acquisition::Acquired(old)) = store.acquire(&k, None, lease).await else {
        panic!("not acquired")
    };
    store
        .complete(&old, b"old", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = admin.get(&key("warm")).await; // the admin's connection is reused

    proxy.lose_replies_to(k.id().as_bytes(), 1, 1);
    let delete = {
        let (admin, k) = (admin.clone(), k.clone());
        tokio::spawn(async move { admin.delete(&k).await })
    };
    // The first send deleted the record.
    for i in 0.. {
        if matches!(store.get(&k).await, Ok(None)) {
            break;
        }
        assert!(i < 200, "the delete never landed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A delivery acquires the key: its handler starts.
    let first = store.acquire(&k, None, lease).await;
    println!("delivery 1 after the delete: {first:?}");
    let Ok(Acquisition::Acquired(first)) = first else {
        panic!("not acquired")
    };
    let deleted = delete.await.unwrap_or_else(|e| panic!("{e}"));
    println!(
        "the admin's delete (reply lost once): {deleted:?}; lost {}",
        proxy.lost()
    );
    assert!(
        matches!(deleted, Err(StoreError::Unavailable(_))),
        "a delete whose reply was lost must be Unavailable: {deleted:?}"
    );
    // A redelivery while delivery 1's handler runs (well inside its lease).
    let second = store.acquire(&k, None, lease).await;
    println!("delivery 2 while delivery 1 runs: {second:?}");
    let done = store
        .complete(&first, b"first", Duration::from_secs(600))
        .await;
    println!("delivery 1 completes: {done:?}");
    assert!(
        matches!(second, Ok(Acquisition::InProgress { .. })),
        "a live reservation was deleted by a resent delete: the key ran twice ({second:?})"
    );
}

/// `delete_if_token` (the operator's conditional delete) sent again after
/// its connection failed answers what the first send did: deleted, not
/// "nothing deleted" for the row it removed (which would make `idem
/// delete` skip the cache invalidation). Whether the statement's reply
/// was lost (the transaction never committed: the resend deletes) or the
/// `COMMIT`'s (the resend asks the server whether it committed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conditional_delete_sent_again_answers_what_the_first_send_did() {
    let (proxy, url) = proxied_shared_server().await;
    let admin = one_connection_store(&url).await;
    let store = PgHarness.store().await;
    let lease = Duration::from_secs(30);
    for (what, lose) in [
        ("the statement's reply", None),
        ("the commit's reply", Some(&b"COMMIT"[..])),
    ] {
        let k = key("resent-delete-if");
        let Ok(Acquisition::Acquired(held)) = store.acquire(&k, None, lease).await else {
            panic!("not acquired")
        };
        store
            .complete(&held, b"done", Duration::from_secs(600))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = admin.get(&key("warm")).await; // a reused connection
        let lost = proxy.lost();
        proxy.lose_replies_to(lose.unwrap_or(k.id().as_bytes()), 1, 1);
        let deleted = admin.delete_if_token(&k, &held.token).await;
        assert_eq!(proxy.lost(), lost + 1, "{what}: no reply was lost");
        assert!(
            matches!(deleted, Ok(true)),
            "{what} lost: the resend answered {deleted:?}, the row is deleted"
        );
        assert!(store
            .get(&k)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none());
    }
}

/// A `complete` whose reply is lost after the server
/// committed it is resent; with a short retention the completed row is
/// already past its expiry when the resend arrives. The resend must still
/// answer Ok (the row was completed by this very token; nobody took it
/// over), not `LeaseLost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_complete_past_a_short_retention_is_not_lease_lost() {
    let (proxy, url) = proxied_shared_server().await;
    let store = one_connection_store(&url).await;
    let k = key("resent-complete-short");
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, Duration::from_secs(30)).await
    else {
        panic!("not acquired")
    };
    proxy.lose_replies_to(b"resent-complete-reply", 1, 1);
    let done = store
        .complete(&lease, b"resent-complete-reply", Duration::from_millis(5))
        .await;
    assert_eq!(proxy.lost(), 1, "no reply was lost: proves nothing");
    assert!(matches!(done, Ok(())), "{done:?}");
}

/// A PgStore with one connection of its own, over a pool of one, on `url`
/// (a proxied server in the resend tests).
pub(crate) async fn one_connection_store(url: &str) -> PgStore {
    PgStore::builder(pg::pool(url, 1).await)
        .connections(1)
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

// ------------------------------------------------------------------
// Batches: acquire_many and complete_many
// ------------------------------------------------------------------

fn keys(tag: &str, n: usize) -> Vec<IdempotencyKey> {
    let run = format!("{:016x}", fastrand::u64(..));
    (0..n)
        .map(|i| {
            IdempotencyKey::new("idem.test.batch", format!("{tag}-{run}-{i}"))
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect()
}

fn items(keys: &[IdempotencyKey]) -> Vec<AcquireItem<'_>> {
    keys.iter().map(|k| AcquireItem::new(k, None)).collect()
}

fn leases(got: Vec<Result<Acquisition, StoreError>>) -> Vec<idemkit::Lease> {
    got.into_iter()
        .enumerate()
        .map(|(i, outcome)| match outcome {
            Ok(Acquisition::Acquired(lease)) => lease,
            other => panic!("item {i}: expected Acquired, got {other:?}"),
        })
        .collect()
}

/// A batch costs one round trip per statement, whatever its items' states:
/// 100 fresh keys, the same 100 in progress, their completion, their
/// replays. A key repeated three times needs three statements (each sees
/// the one before); a batch over `batch_statement` is split.
#[tokio::test]
async fn a_batch_is_one_round_trip_per_statement() {
    let (proxy, url) = proxied_shared_server().await;
    let store = one_connection_store(&url).await;
    let long = Duration::from_secs(60);
    // Warm up: the first use of a statement on a connection prepares it.
    let warm = keys("rt-warm", 2);
    let got = store.acquire_many(&items(&warm), long).await;
    let warm_leases = leases(got.unwrap_or_else(|e| panic!("{e}")));
    let done: Vec<_> = warm_leases.iter().map(|l| (l, b"w".as_slice())).collect();
    let _ = store.complete_many(&done, long).await;

    let ks = keys("rt", 100);
    let turns = |before: u64| proxy.turns() - before;
    let before = proxy.turns();
    let got = store.acquire_many(&items(&ks), long).await;
    assert_eq!(turns(before), 1, "100 fresh keys");
    let held = leases(got.unwrap_or_else(|e| panic!("{e}")));
    let before = proxy.turns();
    let got = store
        .acquire_many(&items(&ks), long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(turns(before), 1, "100 keys in progress");
    assert!(got
        .iter()
        .all(|o| matches!(o, Ok(Acquisition::InProgress { .. }))));
    let done: Vec<_> = held.iter().map(|l| (l, b"r".as_slice())).collect();
    let before = proxy.turns();
    let got = store
        .complete_many(&done, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(turns(before), 1, "100 completions");
    assert!(got.iter().all(Result::is_ok), "{got:?}");
    let before = proxy.turns();
    let got = store
        .acquire_many(&items(&ks), long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(turns(before), 1, "100 duplicates");
    assert!(got
        .iter()
        .all(|o| matches!(o, Ok(Acquisition::Completed(_)))));

    let repeated = keys("rt-repeated", 2);
    let batch = [
        AcquireItem::new(&repeated[0], None),
        AcquireItem::new(&repeated[1], None),
        AcquireItem::new(&repeated[0], None),
        AcquireItem::new(&repeated[0], None),
    ];
    let before = proxy.turns();
    let got = store
        .acquire_many(&batch, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(turns(before), 3, "a key three times: three statements");
    assert!(matches!(got[0], Ok(Acquisition::Acquired(_))), "{got:?}");
    assert!(matches!(got[1], Ok(Acquisition::Acquired(_))), "{got:?}");
    assert!(
        matches!(got[2], Ok(Acquisition::InProgress { .. })),
        "{got:?}"
    );
    assert!(
        matches!(got[3], Ok(Acquisition::InProgress { .. })),
        "{got:?}"
    );

    let small = PgStore::builder(pg::pool(&url, 1).await)
        .connections(1)
        .batch_statement(50)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = small.acquire_many(&items(&keys("rt-warm2", 1)), long).await;
    let ks = keys("rt-split", 120);
    let before = proxy.turns();
    let got = small.acquire_many(&items(&ks), long).await;
    assert_eq!(turns(before), 3, "120 items, 50 per statement");
    let held = leases(got.unwrap_or_else(|e| panic!("{e}")));
    for (lease, k) in held.iter().zip(&ks) {
        assert_eq!(&lease.key, k, "results out of order across statements");
    }
}

/// Two batches over the same keys in opposite orders, started together,
/// round after round: their advisory locks are taken in one order, so they
/// queue instead of deadlocking (PostgreSQL would abort one with 40P01), and
/// every key is acquired by exactly one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_batches_in_opposite_orders_do_not_deadlock() {
    let store = PgStore::builder(pg::pool(pg::shared_url(), 4).await)
        .connections(4)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let lease = Duration::from_secs(60);
    for round in 0..30 {
        let ks = keys(&format!("deadlock-{round}"), 64);
        let mut reversed = ks.clone();
        reversed.reverse();
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
        let run = |order: Vec<IdempotencyKey>| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let got = store.acquire_many(&items(&order), lease).await;
                (order, got)
            })
        };
        let (a, b) = (run(ks.clone()), run(reversed));
        let mut winners = std::collections::HashMap::new();
        for task in [a, b] {
            let (order, got) = task.await.unwrap_or_else(|e| panic!("{e}"));
            let got = got.unwrap_or_else(|e| {
                panic!(
                    "round {round}: a batch failed (deadlock?): {e:?} {:?}",
                    sqlstate(&e)
                )
            });
            for (k, outcome) in order.iter().zip(got) {
                match outcome {
                    Ok(Acquisition::Acquired(_)) => *winners.entry(k.clone()).or_insert(0) += 1,
                    Ok(Acquisition::InProgress { .. }) => {}
                    other => panic!("round {round}, {k}: {other:?}"),
                }
            }
        }
        for k in &ks {
            assert_eq!(
                winners.get(k),
                Some(&1),
                "round {round}: {k} acquired by both or neither"
            );
        }
    }
}

/// A batch that waits behind a key held by a transaction (an
/// in-transaction claim) for two leases: every lease of the batch is
/// counted from after the wait, so a duplicate batch right after it finds
/// every key in progress; none was born with its lease over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_waited_on_a_lock_gets_leases_counted_from_after_the_wait() {
    let store = store_with_timeout(Duration::from_secs(10)).await;
    let ks = keys("batch-wait", 3);
    let lease = Duration::from_millis(600);
    let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim::<_, String>(&mut tx, &ks[1], "payload")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(claim, Claim::Acquired(_)));
    let batch = {
        let (store, ks) = (store.clone(), ks.clone());
        tokio::spawn(async move { store.acquire_many(&items(&ks), lease).await })
    };
    support::pg::until_waiting_on_locks(store.pool(), 1).await;
    tokio::time::sleep(lease * 2).await; // the fault: a lock held for two leases
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    let got = batch
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let now = server_now(store.pool()).await;
    let held = leases(got);
    for lease in &held {
        assert!(
            lease.expires_at > now,
            "{}: granted a lease already over ({:?} <= {now:?})",
            lease.key,
            lease.expires_at
        );
    }
    let again = store
        .acquire_many(&items(&ks), lease)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (k, outcome) in ks.iter().zip(again) {
        assert!(
            matches!(outcome, Ok(Acquisition::InProgress { .. })),
            "{k}: a duplicate took a fresh lease over: {outcome:?}"
        );
    }
}

/// A batch held behind a lock past the server's timeouts fails as a whole
/// with `Unavailable` (55P03 or 57014), retryable, and committed nothing: not
/// even the keys that were free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_behind_a_lock_past_the_server_timeout_is_unavailable_and_writes_nothing() {
    let store = store_with_timeout(Duration::from_secs(1)).await;
    // Connections opened before the lock is taken: on a loaded machine,
    // opening one within the call's wait for a connection could fail
    // first (`NoConnection`), before the server's timeout is reached.
    let warm = (
        store
            .pool()
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        store
            .pool()
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    drop(warm);
    let ks = keys("batch-timeout", 3);
    let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
    let claim = store
        .in_transaction()
        .claim::<_, String>(&mut tx, &ks[2], "payload")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(claim, Claim::Acquired(_)));
    let got = store
        .acquire_many(&items(&ks), Duration::from_secs(30))
        .await;
    match &got {
        Err(e @ StoreError::Unavailable(_)) => {
            assert!(e.is_retryable());
            // The lock timeout or the statement timeout (both at half the
            // call timeout), whichever the server notices first.
            assert!(
                matches!(sqlstate(e).as_deref(), Some("55P03" | "57014")),
                "{e:?}"
            );
        }
        other => panic!("expected Unavailable (a server timeout), got {other:?}"),
    }
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    for k in &ks {
        let record = store.get(k).await.unwrap_or_else(|e| panic!("{e}"));
        assert!(record.is_none(), "{k}: a failed batch left {record:?}");
    }
}

/// A batch whose reply is lost (after the server committed it) is sent
/// again on a fresh connection with the same tokens: every item answers
/// "acquired", and the reservations are the caller's (a duplicate batch
/// finds them in progress, and the leases complete).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_acquire_many_reply_is_resent_with_the_same_tokens() {
    let (proxy, url) = proxied_shared_server().await;
    let store = one_connection_store(&url).await;
    let lease = Duration::from_secs(30);
    let ks = keys("batch-lost", 5);
    proxy.lose_replies_to(ks[3].id().as_bytes(), 1, 1);
    let got = store.acquire_many(&items(&ks), lease).await;
    assert_eq!(proxy.lost(), 1, "no reply was lost: proves nothing");
    let held = leases(got.unwrap_or_else(|e| panic!("the lost batch was not resent: {e}")));
    let again = store
        .acquire_many(&items(&ks), lease)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(again
        .iter()
        .all(|o| matches!(o, Ok(Acquisition::InProgress { .. }))));
    // The lost completion reply is resent too: it changes nothing twice.
    let done: Vec<_> = held.iter().map(|l| (l, b"r".as_slice())).collect();
    proxy.lose_replies_to(ks[0].id().as_bytes(), 1, 1);
    let completed = store
        .complete_many(&done, lease)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(proxy.lost(), 2);
    assert!(completed.iter().all(Result::is_ok), "{completed:?}");
}

/// 10,000 items (40 statements): every answer is its own item's; one
/// response over `max_response_bytes` in a batch is that item's
/// `ResponseTooLarge`, and the others complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_items_and_one_huge_response() {
    let store = PgStore::builder(pg::pool(pg::shared_url(), 4).await)
        .max_response_bytes(1 << 20)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let long = Duration::from_secs(60);
    let ks = keys("batch-10k", 10_000);
    let held = leases(
        store
            .acquire_many(&items(&ks), long)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let responses: Vec<Vec<u8>> = ks.iter().map(|k| k.id().as_bytes().to_vec()).collect();
    let huge = vec![7u8; (1 << 20) + 1];
    let mut done: Vec<(&idemkit::Lease, &[u8])> = held
        .iter()
        .zip(&responses)
        .map(|(l, r)| (l, r.as_slice()))
        .collect();
    done[4_321].1 = &huge;
    let completed = store
        .complete_many(&done, long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (i, outcome) in completed.iter().enumerate() {
        if i == 4_321 {
            assert!(
                matches!(outcome, Err(StoreError::ResponseTooLarge { .. })),
                "{outcome:?}"
            );
        } else {
            assert!(outcome.is_ok(), "item {i}: {outcome:?}");
        }
    }
    let replays = store
        .acquire_many(&items(&ks), long)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for (i, outcome) in replays.into_iter().enumerate() {
        match outcome {
            Ok(Acquisition::InProgress { .. }) if i == 4_321 => {}
            Ok(Acquisition::Completed(r)) => assert_eq!(r.response, responses[i], "item {i}"),
            other => panic!("item {i}: {other:?}"),
        }
    }
}

/// `process_batch` on PgStore: one item's result is over the store's
/// `max_response_bytes`: `complete_many` refuses that item only, which
/// completes as not replayable (its handler never runs again); the others
/// are recorded in the same statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_item_whose_result_is_too_large_completes_as_not_replayable() {
    let store = PgStore::builder(pg::pool(pg::shared_url(), 4).await)
        .max_response_bytes(1_000)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let idem = idemkit::Idempotency::new(store.clone());
    let ks = keys("batch-too-large", 3);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0usize..), |n| async move {
            Ok::<_, Infallible>("x".repeat(if n == 1 { 5_000 } else { 10 }))
        })
        .await;
    assert!(matches!(&out[0], Ok(idemkit::Processed::Executed(v)) if v.len() == 10));
    assert!(
        matches!(&out[1], Ok(idemkit::Processed::ExecutedNotReplayable { value, .. }) if value.len() == 5_000),
        "{:?}",
        out[1].as_ref().map(|_| ())
    );
    assert!(matches!(&out[2], Ok(idemkit::Processed::Executed(_))));
    let again = idem
        .process_batch(ks.iter().cloned().zip(0usize..), |_| async move {
            Ok::<_, Infallible>(String::new())
        })
        .await;
    assert!(matches!(again[1], Err(IdemError::ResultUnavailable { .. })));
    assert!(matches!(&again[2], Ok(idemkit::Processed::Replayed(v)) if v.len() == 10));
}

/// The round trips of the in-transaction mode, counted on the
/// wire. A fresh key: BEGIN, the claim, the completion, COMMIT (4, which
/// the caller waits for), then sqlx's pool pings the connection as it goes
/// back (a 5th, on a task of its own, before the connection can serve the
/// next caller). A duplicate: BEGIN, the claim, ROLLBACK, and the ping.
#[tokio::test]
async fn in_transaction_mode_round_trips() {
    use idemkit::postgres::Claim;
    let (proxy, url) = proxied_shared_server().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = idemkit::postgres::PgStore::builder(pool.clone())
        .connections(1)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let fp = idemkit::Fingerprint::of_bytes(b"p");
    // (turns until the caller has its answer, turns until the pool has the
    // connection back)
    let deliver = |k: IdempotencyKey| {
        let (store, pool, proxy) = (store.clone(), pool.clone(), &proxy);
        async move {
            let before = proxy.turns();
            let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
            let fresh = match store
                .in_transaction()
                .claim_with::<u64>(&mut tx, &k, Some(fp))
                .await
                .unwrap_or_else(|e| panic!("{e}"))
            {
                Claim::Acquired(lease) => {
                    lease
                        .complete(&mut tx, &43u64)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
                    true
                }
                Claim::Replayed(_) => {
                    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
                    false
                }
            };
            let answered = proxy.turns() - before;
            // The connection is back (pinged) once the pool holds it idle.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while pool.num_idle() < 1 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the connection never came back"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (fresh, answered, proxy.turns() - before)
        }
    };
    // Warm up: the first use of each statement on the connection prepares it.
    let warm = key("tx-rt-warm");
    deliver(warm.clone()).await;
    deliver(warm).await;
    let k = key("tx-rt");
    let (fresh, answered, total) = deliver(k.clone()).await;
    assert!(fresh);
    assert_eq!(
        (answered, total),
        (4, 5),
        "fresh key: the caller's round trips, then with the pool's ping"
    );
    let (fresh, answered, total) = deliver(k).await;
    assert!(!fresh);
    assert_eq!(
        (answered, total),
        (3, 4),
        "duplicate: the caller's round trips, then with the pool's ping"
    );
}

/// A store on a table of its own whose trigger refuses (a non-retryable
/// error, as a constraint or any statement-level failure would give) to
/// insert (`on`: "INSERT") or complete (`on`: "UPDATE") the key `poison`.
async fn store_refusing(poison: &IdempotencyKey, on: &str, statement: usize) -> PgStore {
    let pool = pg::pool(pg::shared_url(), 4).await;
    let table = format!("idem_poison_{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pool.clone())
        .table(&table)
        .batch_statement(statement)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate: {e}"));
    let status = if on == "UPDATE" {
        "AND NEW.status = 2"
    } else {
        ""
    };
    exec(
        &pool,
        format!(
            "CREATE FUNCTION {table}_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.key = '{id}' {status} THEN RAISE EXCEPTION 'refused by a trigger'; END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER refuse BEFORE {on} ON {qualified}
               FOR EACH ROW EXECUTE FUNCTION {table}_refuse();",
            id = poison.id(),
            qualified = store.qualified_table(),
        ),
    )
    .await;
    store
}

/// One statement of a `complete_many` failing with a
/// non-retryable error gave its error to the items of the statements
/// after it, which were never sent; the executor took that error as the
/// store refusing those results for good and completed their keys as
/// "not replayable": results that were perfectly recordable were lost,
/// and every duplicate got `ResultUnavailable` instead of the replay.
///
/// Two items a statement: [0, 1] [2 refused, 3] [4]. Item 3 shares the
/// failed statement, item 4 was never sent: both are recorded (each on
/// its own), only item 2 is not.
#[tokio::test]
async fn a_failed_statement_of_complete_many_loses_no_other_items_result() {
    let ks = keys("poison-complete", 5);
    let store = store_refusing(&ks[2], "UPDATE", 2).await;
    let idem = idemkit::Idempotency::new(store);
    let out = idem
        .process_batch(ks.iter().cloned().zip(0u32..), |n| async move {
            Ok::<_, Infallible>(n)
        })
        .await;
    assert!(out[2].is_err(), "the refused item: {:?}", out[2]);
    for i in [0, 1, 3, 4] {
        assert!(
            matches!(out[i], Ok(idemkit::Processed::Executed(n)) if n as usize == i),
            "item {i}: {:?}",
            out[i]
        );
    }
    let again = idem
        .process_batch(ks.iter().cloned().zip(0u32..), |_| async move {
            Ok::<_, Infallible>(99)
        })
        .await;
    for i in [0, 1, 3, 4] {
        assert!(
            matches!(again[i], Ok(idemkit::Processed::Replayed(n)) if n as usize == i),
            "duplicate of item {i}: {:?}",
            again[i]
        );
    }
}

/// Likewise for `acquire_many`: the items after a
/// statement that failed were never sent, yet got its non-retryable
/// error, so the executor answered them `Store(Backend)` and the Streams
/// consumer dead-lettered them. Never sent means nothing written, and
/// retryable (as the default loop answers: "not sent").
#[tokio::test]
async fn items_after_a_failed_statement_of_acquire_many_are_retryable_and_unwritten() {
    let ks = keys("poison-acquire", 4);
    let store = store_refusing(&ks[1], "INSERT", 1).await;
    let got = store
        .acquire_many(&items(&ks), Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(got[0], Ok(Acquisition::Acquired(_))),
        "{:?}",
        got[0]
    );
    assert!(got[1].is_err(), "the refused item: {:?}", got[1]);
    for i in [2, 3] {
        assert!(
            matches!(&got[i], Err(e) if e.is_retryable()),
            "item {i}, never sent: {:?}",
            got[i]
        );
        assert!(
            matches!(store.get(&ks[i]).await, Ok(None)),
            "item {i} was written"
        );
    }
}

// ------------------------------------------------------------------
// Connecting: a bad URL fails fast with its cause,
// and a migrated table starts quietly (item 5).

fn shared_target() -> (String, u16) {
    let options: sqlx::postgres::PgConnectOptions = pg::shared_url()
        .parse()
        .unwrap_or_else(|e| panic!("IDEM_POSTGRES_URL does not parse: {e}"));
    (options.get_host().to_owned(), options.get_port())
}

/// Connects through `idemkit::postgres::connect`, bounded far below sqlx's 30 s
/// acquire timeout, and returns the error and how long it took.
async fn connect_failure(url: &str) -> (StoreError, Duration) {
    let started = std::time::Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(20), idemkit::postgres::connect(url))
        .await
        .unwrap_or_else(|_| panic!("connect({url}) still waiting after 20 s"));
    match outcome {
        Ok(_) => panic!("connect({url}) succeeded"),
        Err(e) => (e, started.elapsed()),
    }
}

#[tokio::test]
async fn a_refused_connection_fails_fast_retryable_and_says_refused() {
    let port = support::free_port();
    let url = format!("postgres://app:s3cret-password@127.0.0.1:{port}/app");
    let (e, took) = connect_failure(&url).await;
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    assert!(e.is_retryable());
    let text = e.to_string();
    assert!(text.contains("connection refused"), "{text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("s3cret"), "the password leaked: {text}");
}

#[tokio::test]
async fn an_unknown_role_fails_fast_not_retryable_and_says_authentication() {
    let (host, port) = shared_target();
    let url = format!("postgres://no_such_role_idem@{host}:{port}/postgres");
    let (e, took) = connect_failure(&url).await;
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(matches!(e, StoreError::Backend(_)), "{e:?}");
    assert!(!e.is_retryable());
    let text = e.to_string();
    assert!(text.contains("authentication failed"), "{text}");
    assert!(text.contains("no_such_role_idem"), "{text}");
}

#[tokio::test]
async fn an_unknown_database_fails_fast_not_retryable_and_says_so() {
    let options: sqlx::postgres::PgConnectOptions = pg::shared_url()
        .parse()
        .unwrap_or_else(|e| panic!("IDEM_POSTGRES_URL does not parse: {e}"));
    let url = format!(
        "postgres://{}@{}:{}/no_such_database_idem",
        options.get_username(),
        options.get_host(),
        options.get_port()
    );
    let (e, took) = connect_failure(&url).await;
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(!e.is_retryable(), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("database does not exist"), "{text}");
}

#[tokio::test]
async fn a_url_that_does_not_parse_is_an_invalid_argument() {
    let (e, _) = connect_failure("postgres://127.0.0.1:notaport/db").await;
    assert!(matches!(e, StoreError::InvalidArgument { .. }), "{e:?}");
    let (e, _) = connect_failure("mysql://127.0.0.1/db").await;
    assert!(matches!(e, StoreError::InvalidArgument { .. }), "{e:?}");
}

#[tokio::test]
async fn connect_opens_a_working_pool() {
    let pool = idemkit::postgres::connect(pg::shared_url())
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("SELECT 1: {e}"));
    assert_eq!(one, 1);
}

#[tokio::test]
async fn the_sqlx_migrator_composes_with_the_users_own() {
    use sqlx::migrate::{Migration, MigrationType, Migrator};
    use sqlx::SqlSafeStr;
    let pool = pg::pool(pg::shared_url(), 4).await;
    let schema = format!("migrator_{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pool.clone())
        .schema(&schema)
        .build()
        .unwrap_or_else(|e| panic!("build: {e}"));
    // The user's own migrations: version 1 as well, their own history table.
    let mut user = Migrator::with_migrations(vec![Migration::new(
        1,
        "payments".into(),
        MigrationType::Simple,
        sqlx::AssertSqlSafe(format!(
            "CREATE TABLE \"{schema}\".payments (id bigint PRIMARY KEY)"
        ))
        .into_sql_str(),
        false,
    )]);
    user.dangerous_set_table_name(format!("\"{schema}\".app_migrations"));
    // idem's first: it creates the schema.
    store
        .migrator()
        .run(&pool)
        .await
        .unwrap_or_else(|e| panic!("idem's migrator: {e}"));
    user.run(&pool)
        .await
        .unwrap_or_else(|e| panic!("the user's migrator: {e}"));
    // Again, in the other order: both no-ops, neither sees the other's
    // version 1 as its own.
    user.run(&pool)
        .await
        .unwrap_or_else(|e| panic!("the user's migrator again: {e}"));
    store
        .migrator()
        .run(&pool)
        .await
        .unwrap_or_else(|e| panic!("idem's migrator again: {e}"));
    let versions: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT version FROM \"{schema}\".idem_records_sqlx_migrations WHERE success ORDER BY version"
    )))
    .fetch_all(&pool)
    .await
    .unwrap_or_else(|e| panic!("history: {e}"));
    assert_eq!(versions, vec![1, 2]);
    // The table works, and migrate() on it afterwards changes nothing.
    let key = IdempotencyKey::new("migrator", "k").unwrap_or_else(|e| panic!("{e}"));
    let lease = match store.acquire(&key, None, Duration::from_secs(5)).await {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("acquire: {other:?}"),
    };
    store
        .complete(&lease, b"done", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("complete: {e}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate after the migrator: {e}"));
    match store.acquire(&key, None, Duration::from_secs(5)).await {
        Ok(Acquisition::Completed(done)) => assert_eq!(&done.response[..], b"done"),
        other => panic!("replay: {other:?}"),
    }
}

/// `connect` says "retryable" when retrying
/// cannot help. A URL asking for TLS (`sslmode=require`) can never connect
/// with this build (sqlx without a TLS feature) nor to a server without
/// TLS, however often it is retried: the same configuration error as an
/// unknown database. `connect_error` falls through to `map_error_kind`,
/// which counts `sqlx::Error::Tls` as a connection failure, so it comes
/// back `Unavailable` (DESIGN §3: `Unavailable` is "connection, timeout:
/// retryable").
#[tokio::test]
async fn a_url_that_requires_tls_is_not_retryable() {
    let (host, port) = shared_target();
    let options: sqlx::postgres::PgConnectOptions = pg::shared_url()
        .parse()
        .unwrap_or_else(|e| panic!("IDEM_POSTGRES_URL does not parse: {e}"));
    let url = format!(
        "postgres://{}:s3cret-password@{host}:{port}/postgres?sslmode=require",
        options.get_username()
    );
    for _ in 0..3 {
        let (e, took) = connect_failure(&url).await;
        assert!(took < Duration::from_secs(5), "took {took:?}");
        assert!(!e.to_string().contains("s3cret"), "{e}");
        assert!(
            !e.is_retryable(),
            "the same failure on every retry, yet called retryable: {e:?}"
        );
    }
}

/// A response limit smaller than the "not replayable" marker: a result
/// over it still completes the key as not replayable (the marker is
/// never refused for its size), so the duplicate gets `ResultUnavailable`
/// and the handler runs once.
#[tokio::test]
async fn a_result_over_a_limit_smaller_than_the_marker_completes_not_replayable() {
    let store = PgStore::builder(pg::pool(pg::shared_url(), 4).await)
        .max_response_bytes(16)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let idem = idemkit::Idempotency::new(store);
    let k = key("tiny-limit");
    let runs = std::sync::atomic::AtomicU64::new(0);
    for _ in 0..2 {
        let out = idem
            .process(&k, &"payload", |_| async {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, Infallible>("x".repeat(1024))
            })
            .await;
        assert!(
            matches!(
                out,
                Ok(idemkit::Processed::ExecutedNotReplayable { .. })
                    | Err(IdemError::ResultUnavailable { .. })
            ),
            "{out:?}"
        );
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}
