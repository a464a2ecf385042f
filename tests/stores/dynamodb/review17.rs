//! Review 17: DynamoDbStore findings, each a test that states the
//! contract (DESIGN.md and the crate docs) and fails where the code
//! breaks it.

use crate::support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use idem::dynamodb::aws_sdk_dynamodb::primitives::Blob;
use idem::dynamodb::aws_sdk_dynamodb::types::AttributeValue;
use idem::dynamodb::{create_table, local_client, DynamoDbStore};
use idem::testkit;
use idem::{Acquisition, IdempotencyKey, IdempotencyStore, StoreError};
use support::moto;
use support::proxy::CountingProxy;

const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

async fn store_on(url: &str, table: &str) -> DynamoDbStore {
    let client = local_client(url);
    create_table(&client, table)
        .await
        .unwrap_or_else(|e| panic!("cannot create the table {table} at {url}: {e}"));
    DynamoDbStore::new(client, table)
        .clock_skew_margin(Duration::from_millis(20))
        .call_timeout(Duration::from_secs(10))
}

async fn store() -> DynamoDbStore {
    let table = format!("idem_r17_{:016x}", fastrand::u64(..));
    store_on(moto::shared_url(), &table).await
}

fn key(tag: &str) -> IdempotencyKey {
    testkit::unique_key(tag)
}

async fn acquired(store: &DynamoDbStore, k: &IdempotencyKey, lease: Duration) -> idem::Lease {
    match store.acquire(k, None, lease).await {
        Ok(Acquisition::Acquired(l)) => l,
        other => panic!("acquire {k}: {other:?}"),
    }
}

/// Every item of the table (a consistent scan, all pages).
async fn all_items(store: &DynamoDbStore) -> Vec<HashMap<String, AttributeValue>> {
    let mut out = Vec::new();
    let mut start = None;
    loop {
        let page = store
            .client()
            .scan()
            .table_name(store.table())
            .consistent_read(true)
            .projection_expression("pk, ex")
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .unwrap_or_else(|e| panic!("scan: {e:?}"));
        out.extend(page.items().iter().cloned());
        start = page.last_evaluated_key().cloned();
        if start.is_none() {
            return out;
        }
    }
}

/// Waits (bounded) until `get` says the key is absent (its record expired
/// past the skew margin).
async fn until_absent(store: &DynamoDbStore, k: &IdempotencyKey) {
    for _ in 0..500 {
        if store
            .get(k)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none()
        {
            // `gone` is strict on the same numbers `purge` compares: one
            // more millisecond puts the item past the purge's cut too.
            tokio::time::sleep(Duration::from_millis(2)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{k} never expired");
}

/// `purge_periodically`'s drain ("purges batches until one comes back
/// short, so a backlog drains") must leave no expired item behind. The
/// DynamoDB purge keeps a scan cursor across calls: a page holding more
/// expired items than `max` has its extra items skipped (the cursor moves
/// past them), and the next call, finding nothing expired in the rest of
/// the table, comes back short while expired items remain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review17_purge_drain_leaves_no_expired_item_behind() {
    let store = store().await;
    // Two records that expire at once, written first, keys sorting before
    // the padding's (moto pages in insertion order, resumes by key order)...
    let id = format!("{:016x}", fastrand::u64(..));
    let k = |scope: &str, n: u32| {
        IdempotencyKey::new(scope, format!("{id}-{n}")).unwrap_or_else(|e| panic!("{e}"))
    };
    let (e1, e2) = (k("a.review17", 1), k("a.review17", 2));
    for k in [&e1, &e2] {
        let l = acquired(&store, k, LONG).await;
        store
            .complete(&l, b"short-lived", Duration::from_millis(1))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    // ...then three live records of 370 KB each: the scan's first page
    // (1 MB) ends after the second.
    for n in 0..3 {
        let l = acquired(&store, &k("zz.review17", n), LONG).await;
        store
            .complete(&l, &vec![9u8; 370_000], DAY)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    until_absent(&store, &e1).await;
    until_absent(&store, &e2).await;

    // The drain of `purge_periodically(store, every, 1)`.
    let mut purged = 0;
    let mut calls = 0;
    loop {
        calls += 1;
        assert!(calls < 20, "the drain never came back short");
        let n = store
            .purge_expired(1)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        purged += n;
        if n < 1 {
            break;
        }
    }
    let left: Vec<String> = all_items(&store)
        .await
        .into_iter()
        .filter_map(|it| match it.get("pk") {
            Some(AttributeValue::S(pk)) if pk.starts_with("a.review17/") => Some(pk.clone()),
            _ => None,
        })
        .collect();
    assert!(
        purged == 2 && left.is_empty(),
        "the drain purged {purged} of 2 expired records in {calls} calls and stopped; \
         still in the table: {left:?}"
    );
}

/// `delete` turns a completed record into a tombstone; the chunk items of
/// its large response are then referenced by nothing. They keep the
/// record's expiry (here the longest retention, `MAX_DURATION`): no purge
/// removes them, and the deleted response's bytes stay in the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review17_delete_leaves_no_orphan_chunks() {
    let store = store().await;
    let k = key("delete-chunks");
    let l = acquired(&store, &k, LONG).await;
    store
        .complete(&l, &vec![3u8; 900_000], Duration::MAX)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(store.delete(&k).await.unwrap_or_else(|e| panic!("{e}")));
    store
        .purge_expired(1_000)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = format!("#{}/", l.token.to_hex());
    let orphans: Vec<String> = all_items(&store)
        .await
        .into_iter()
        .filter_map(|it| match it.get("pk") {
            Some(AttributeValue::S(pk)) if pk.starts_with(&prefix) => Some(pk.clone()),
            _ => None,
        })
        .collect();
    assert!(
        orphans.is_empty(),
        "after delete and purge, the deleted record's chunks are still stored \
         (until its retention, 100 years): {orphans:?}"
    );
}

/// DESIGN.md 2: the fence **strictly increases** across every acquisition.
/// A tombstone whose fence is u64::MAX (a corrupt or hand-written item)
/// gives the next acquisition the same fence (`saturating_add`): it must
/// be refused (Corrupt) rather than hand out a fence that is not higher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review17_fence_at_u64_max_is_never_reused() {
    let store = store().await;
    let k = key("fence-max");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let item = HashMap::from([
        (
            "pk".to_owned(),
            AttributeValue::S(DynamoDbStore::item_key(&k)),
        ),
        ("st".to_owned(), AttributeValue::S("r".into())),
        ("tk".to_owned(), AttributeValue::B(Blob::new(vec![7u8; 16]))),
        ("fe".to_owned(), AttributeValue::N(u64::MAX.to_string())),
        (
            "ex".to_owned(),
            AttributeValue::N((now_ms + 3_600_000).to_string()),
        ),
        ("rv".to_owned(), AttributeValue::N("1".into())),
    ]);
    store
        .client()
        .put_item()
        .table_name(store.table())
        .set_item(Some(item))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e:?}"));
    match store.acquire(&k, None, LONG).await {
        Ok(Acquisition::Acquired(l)) => panic!(
            "acquired over a tombstone of fence {} with fence {}: not higher",
            u64::MAX,
            l.fence
        ),
        Err(StoreError::Corrupt { .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// The crate docs: "`complete`, `release`, `extend` | 1" and "`complete` of
/// a response over INLINE_RESPONSE_BYTES | 1 | TransactWriteItems". A
/// chunked completion refused (its lease taken over) costs a second
/// request (a `GetItem` after the cancelled transaction), where the
/// inline one answers from ALL_OLD in one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review17_refused_chunked_complete_costs_what_the_docs_say() {
    let url = moto::shared_url();
    let upstream: SocketAddr = url
        .trim_start_matches("http://")
        .parse()
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let proxy = CountingProxy::start(upstream).await;
    let table = store().await.table().to_owned();
    let store = store_on(&format!("http://{}", proxy.addr), &table).await;
    let k = key("refused-chunked");
    let stale = acquired(&store, &k, Duration::from_millis(50)).await;
    // Taken over once the lease ended (a bounded wait for the takeover).
    let mut taken = None;
    for _ in 0..200 {
        match store.acquire(&k, None, LONG).await {
            Ok(Acquisition::Acquired(l)) => {
                taken = Some(l);
                break;
            }
            Ok(Acquisition::InProgress { .. }) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(taken.is_some(), "never taken over");
    let before = proxy.turns();
    let inline = store.complete(&stale, b"small", DAY).await;
    assert!(matches!(inline, Err(StoreError::LeaseLost)), "{inline:?}");
    let inline_cost = proxy.turns() - before;
    let before = proxy.turns();
    let chunked = store.complete(&stale, &vec![1u8; 500_000], DAY).await;
    assert!(matches!(chunked, Err(StoreError::LeaseLost)), "{chunked:?}");
    let chunked_cost = proxy.turns() - before;
    assert_eq!(
        (inline_cost, chunked_cost),
        (1, 1),
        "a refused complete: inline {inline_cost} request(s), chunked {chunked_cost} (the docs: 1)"
    );
}
