//! The stores' operator reads (used by the `idem` command), against real
//! servers: the server's clock, a record with the clock, keys stuck in
//! progress, counts by scope and state, key scans on every cluster primary.

use crate::support;

use std::time::{Duration, Instant, SystemTime};

use idemkit::postgres::PgStore;
use idemkit::redis::{redis, RedisStore};
use idemkit::{Acquisition, IdempotencyKey, IdempotencyStore, Lease, RecordState};

fn key(scope: &str, id: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope, id).unwrap_or_else(|e| panic!("{e}"))
}

async fn acquire<S: IdempotencyStore>(store: &S, key: &IdempotencyKey, lease: Duration) -> Lease {
    match store.acquire(key, None, lease).await {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("{other:?}"),
    }
}

async fn complete<S: IdempotencyStore>(store: &S, key: &IdempotencyKey, retention: Duration) {
    let lease = acquire(store, key, Duration::from_secs(60)).await;
    store
        .complete(&lease, b"done", retention)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Waits until `clock` (the store's) is past `t`.
async fn until_past<F, Fut>(t: SystemTime, clock: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = SystemTime>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while clock().await <= t {
        assert!(Instant::now() < deadline, "the clock never passed {t:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_lists_stuck_keys_and_counts_by_scope_and_state() {
    let pool = support::pg::pool(support::pg::shared_url(), 4).await;
    let table = format!("ops_{:08x}", fastrand::u32(..));
    let store = PgStore::builder(pool.clone())
        .table(table.clone())
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let clock = || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) };
    // An empty table: nothing stuck, no scope.
    assert!(store
        .stuck(10)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .records
        .is_empty());
    assert!(store
        .counts()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_empty());

    complete(&store, &key("a", "done"), Duration::from_secs(600)).await;
    complete(&store, &key("a", "expired"), Duration::from_millis(10)).await;
    let expired_by = clock().await + Duration::from_millis(10);
    let s1 = acquire(&store, &key("a", "stuck-1"), Duration::from_millis(20)).await;
    let s2 = acquire(&store, &key("b", "stuck-2"), Duration::from_millis(10)).await;
    acquire(&store, &key("b", "live"), Duration::from_secs(600)).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (scope, key, status, token, attempt, created_at, expires_at) \
         VALUES ('b', 'bad', 1, '\\x00112233445566778899aabbccddeeff'::bytea, 1, now(), now() + interval '1 hour')"
    )))
    .execute(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    until_past(s1.expires_at.max(s2.expires_at).max(expired_by), clock).await;

    let (record, now) = store
        .get_with_time(&key("b", "live"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    match record.map(|r| r.state) {
        Some(RecordState::InProgress { lease_expires_at }) => assert!(lease_expires_at > now),
        other => panic!("{other:?}"),
    }
    let (none, _) = store
        .get_with_time(&key("a", "expired"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(none.is_none(), "an expired row reads as absent");
    assert!(matches!(
        store.get_with_time(&key("b", "bad")).await,
        Err(idemkit::StoreError::Corrupt { .. })
    ));

    let stuck = store.stuck(10).await.unwrap_or_else(|e| panic!("{e}"));
    let listed: Vec<(String, bool)> = stuck
        .records
        .iter()
        .map(|r| (r.id.clone(), r.record.is_ok()))
        .collect();
    // Oldest deadline first (the deadlines as the server set them: on a
    // loaded machine the second acquire may come late enough to end
    // last), then the corrupt row (in progress, no lease).
    let mut by_deadline = [("stuck-1", s1.expires_at), ("stuck-2", s2.expires_at)];
    by_deadline.sort_by_key(|(_, deadline)| *deadline);
    assert_eq!(
        listed,
        vec![
            (by_deadline[0].0.to_owned(), true),
            (by_deadline[1].0.to_owned(), true),
            ("bad".to_owned(), false)
        ]
    );
    assert_eq!(store.stuck(1).await.map(|s| s.records.len()).ok(), Some(1));

    let counts = store.counts().await.unwrap_or_else(|e| panic!("{e}"));
    let row = |scope: &str| {
        counts
            .iter()
            .find(|c| c.scope == scope)
            .map(|c| (c.in_progress, c.stuck, c.completed, c.expired, c.corrupt))
    };
    assert_eq!(row("a"), Some((0, 1, 1, 1, 0)));
    assert_eq!(row("b"), Some((1, 1, 0, 0, 1)));
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_scans_list_stuck_keys_count_and_report_corrupt_records() {
    let prefix = format!("ops{:08x}:", fastrand::u32(..));
    let store = RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .prefix(prefix.clone());
    let clock = || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) };
    complete(&store, &key("a", "done"), Duration::from_secs(600)).await;
    let s = acquire(&store, &key("a", "stuck"), Duration::from_millis(10)).await;
    acquire(&store, &key("b", "live"), Duration::from_secs(600)).await;
    complete(&store, &key("b", "deleted"), Duration::from_secs(600)).await;
    assert!(store.delete(&key("b", "deleted")).await.unwrap_or(false));
    let mut conn = redis::Client::open(support::redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}b/bad"))
        .arg(vec![b'c'; 50])
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    until_past(s.expires_at, clock).await;

    // Four records and one delete marker under the prefix.
    let (keys, complete_scan) = store
        .scan_keys(&prefix, 100)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((keys.len(), complete_scan), (5, true));
    let (keys, complete_scan) = store
        .scan_keys(&prefix, 2)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((keys.len(), complete_scan), (2, false));
    // A glob character in the prefix is matched literally.
    let (keys, _) = store
        .scan_keys("ops*", 100)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(keys.is_empty());

    let stuck = store
        .stuck(10, 1_000)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut found: Vec<String> = stuck
        .records
        .iter()
        .map(|r| match &r.record {
            Ok(record) => record.key.id().to_owned(),
            Err(detail) => format!("corrupt {}: {detail}", r.redis_key),
        })
        .collect();
    found.sort();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].starts_with(&format!("corrupt {prefix}b/bad: ")),
        "{found:?}"
    );
    assert_eq!(found[1], "stuck");
    assert!(stuck.complete);

    let counts = store.counts(1_000).await.unwrap_or_else(|e| panic!("{e}"));
    let row = |scope: &str| {
        counts
            .by_scope
            .get(scope)
            .map(|c| (c.in_progress, c.stuck, c.completed, c.corrupt))
    };
    assert_eq!(row("a"), Some((0, 1, 1, 0)));
    assert_eq!(row("b"), Some((1, 0, 0, 1)));
    assert_eq!(counts.corrupt.len(), 1);
    assert_eq!(counts.scanned, 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster_scans_reach_every_primary() {
    let nodes = support::redis_server::shared_cluster();
    let prefix = format!("ops{:08x}:", fastrand::u32(..));
    let store = RedisStore::connect_cluster(nodes.iter().map(String::as_str))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .prefix(prefix.clone());
    for i in 0..30 {
        complete(
            &store,
            &key("c", &format!("k{i}")),
            Duration::from_secs(600),
        )
        .await;
    }
    let (keys, complete_scan) = store
        .scan_keys(&prefix, 1_000)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((keys.len(), complete_scan), (30, true));
    let counts = store.counts(1_000).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(counts.by_scope.get("c").map(|c| c.completed), Some(30));
    let (record, now) = store
        .get_with_time(&key("c", "k3"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(record.is_some_and(|r| r.expires_at > now));
}

/// The checked-then-deleted record is the one deleted: a takeover between
/// the check and the delete gives the record another token, and
/// `delete_if_token` with the old token leaves the new holder alone; a
/// live lease is left alone whatever the token.
async fn delete_if_token_spares_a_takeover<S, D, Fut, C, CFut>(store: &S, delete_if: D, clock: C)
where
    S: IdempotencyStore,
    D: Fn(IdempotencyKey, idemkit::LeaseToken) -> Fut,
    Fut: std::future::Future<Output = Result<bool, idemkit::StoreError>>,
    C: Fn() -> CFut,
    CFut: std::future::Future<Output = SystemTime>,
{
    let k = key(&format!("del{:08x}", fastrand::u32(..)), "k");
    let stuck = acquire(store, &k, Duration::from_millis(50)).await;
    until_past(stuck.expires_at, &clock).await;
    let taken = acquire(store, &k, Duration::from_secs(3_600)).await;
    assert_eq!(taken.attempt, 2);
    let deleted = delete_if(k.clone(), stuck.token)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!deleted, "the old token deleted the new holder's record");
    match store.acquire(&k, None, Duration::from_secs(60)).await {
        Ok(Acquisition::InProgress { attempt, .. }) => assert_eq!(attempt, 2),
        other => panic!("a duplicate must see the takeover in progress: {other:?}"),
    }
    // Its own token does not delete a live lease either (a late extend
    // after a check makes a lease live again with the same token).
    assert!(!delete_if(k.clone(), taken.token)
        .await
        .unwrap_or_else(|e| panic!("{e}")));
    // Completed, the record is deleted by the token that completed it.
    store
        .complete(&taken, b"done", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(delete_if(k.clone(), taken.token)
        .await
        .unwrap_or_else(|e| panic!("{e}")));
    assert!(store
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());
    // Sent again (a resend after a lost reply): nothing there, nothing done.
    assert!(!delete_if(k.clone(), taken.token)
        .await
        .unwrap_or_else(|e| panic!("{e}")));
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_delete_if_token_spares_a_takeover() {
    let pool = support::pg::pool(support::pg::shared_url(), 4).await;
    let store = PgStore::new(pool);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    delete_if_token_spares_a_takeover(
        &store,
        |k, t| {
            let store = store.clone();
            async move { store.delete_if_token(&k, &t).await }
        },
        || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_delete_if_token_spares_a_takeover() {
    let store = RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let clock_store = store.clone();
    delete_if_token_spares_a_takeover(
        &store,
        |k, t| {
            let store = store.clone();
            async move { store.delete_if_token(&k, &t).await }
        },
        move || {
            let store = clock_store.clone();
            async move {
                store
                    .get_with_time(&key("clock", "x"))
                    .await
                    .unwrap_or_else(|e| panic!("{e}"))
                    .1
            }
        },
    )
    .await;
}
