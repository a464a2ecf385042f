//! The table's items: responses past the item limit in chunks (a missing
//! chunk is a corrupt record, a record deleted while its chunks are read is
//! what the table holds now, a delete leaves no chunk behind, even sent
//! again after a lost reply), items that do not decode (corrupt, never
//! absent; deleting one keeps the fence rising), fences that cannot go
//! higher, and purges that drain every expired item.

use std::collections::HashMap;
use std::time::Duration;

use idemkit::dynamodb::aws_sdk_dynamodb::primitives::Blob;
use idemkit::dynamodb::aws_sdk_dynamodb::types::AttributeValue;
use idemkit::dynamodb::DynamoDbStore;
use idemkit::{Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, Processed, StoreError};

use super::{acquired, key, overwrite, proxied, store, store_on, DAY, LONG};
use crate::support::moto;

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

/// Responses past the item limit: 2 MiB and 3 MiB round trip through the
/// executor; one byte more than the limit is refused before anything is
/// sent, and the key completes as not replayable; a missing chunk is a
/// corrupt record, never a short replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_responses_are_stored_in_chunks_and_a_missing_chunk_is_corrupt() {
    let store = store().await;
    let idem = Idempotency::new(store.clone());
    // JSON strings of ASCII letters: the recorded response is the size
    // plus its two quotes. The second is the largest the default allows.
    for size in [2 << 20, (3 << 20) - 2] {
        let k = key("chunks");
        let body: String = (0..size)
            .map(|i: usize| (b'a' + (i % 26) as u8) as char)
            .collect();
        let sent = body.clone();
        let first = idem
            .process(&k, 1u8, |_| async move { Ok::<_, std::io::Error>(sent) })
            .await;
        assert!(
            matches!(&first, Ok(Processed::Executed(v)) if *v == body),
            "{size}: {:?}",
            first.as_ref().map(|_| ())
        );
        let again = idem
            .process(&k, 1u8, |_| async {
                Ok::<_, std::io::Error>(String::new())
            })
            .await;
        assert!(
            matches!(&again, Ok(Processed::Replayed(v)) if *v == body),
            "{size} bytes did not replay"
        );
    }
    let k = key("too-large");
    let lease = acquired(&store, &k, LONG).await;
    let over = vec![7u8; idemkit::dynamodb::DEFAULT_MAX_RESPONSE_BYTES + 1];
    let refused = store.complete(&lease, &over, DAY).await;
    assert!(
        matches!(refused, Err(StoreError::ResponseTooLarge { .. })),
        "{refused:?}"
    );
    // Still held: nothing was written.
    assert!(matches!(
        store.acquire(&k, None, LONG).await,
        Ok(Acquisition::InProgress { .. })
    ));

    // A missing chunk.
    let k = key("chunk-gone");
    let lease = acquired(&store, &k, LONG).await;
    store
        .complete(&lease, &vec![1u8; 900_000], DAY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store
        .client()
        .delete_item()
        .table_name(store.table())
        .key(
            "pk",
            AttributeValue::S(format!("#{}/1", lease.token.to_hex())),
        )
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e:?}"));
    for got in [
        store.acquire(&k, None, LONG).await.map(|_| ()),
        store.get(&k).await.map(|_| ()),
    ] {
        assert!(
            matches!(&got, Err(StoreError::Corrupt { key, .. }) if *key == k),
            "{got:?}"
        );
    }
}

/// The chunk items among `items` of the response completed by `token`.
fn chunk_items(
    items: &[HashMap<String, AttributeValue>],
    token: &idemkit::LeaseToken,
) -> Vec<String> {
    let prefix = format!("#{}/", token.to_hex());
    items
        .iter()
        .filter_map(|it| match it.get("pk") {
            Some(AttributeValue::S(pk)) if pk.starts_with(&prefix) => Some(pk.clone()),
            _ => None,
        })
        .collect()
}

/// A record deleted (its chunks with it) while a duplicate reads its
/// chunked response was never corrupt: the duplicate's `acquire` gets
/// what the table holds now (the key is free: acquired, with a higher
/// fence) and `get` says absent, instead of a `Corrupt` that a consumer
/// would dead-letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_deleted_while_its_chunks_are_read_is_what_the_table_holds_now() {
    let (slow, proxy) = proxied(moto::shared_url()).await;
    let direct = store_on(moto::shared_url(), slow.table()).await;
    let slow = std::sync::Arc::new(slow);
    proxy.delay_requests_to(
        b"DynamoDB_20120810.BatchGetItem",
        Duration::from_millis(1_500),
    );
    for read in ["acquire", "get"] {
        let k = key("deleted-mid-read");
        let lease = acquired(&direct, &k, LONG).await;
        direct
            .complete(&lease, &vec![5u8; 900_000], DAY)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let held = proxy.delayed();
        let reader = {
            let (slow, k) = (slow.clone(), k.clone());
            tokio::spawn(async move {
                match read {
                    "acquire" => slow.acquire(&k, None, LONG).await.map(Some),
                    _ => slow.get(&k).await.map(|_| None),
                }
            })
        };
        for _ in 0..1_000 {
            if proxy.delayed() > held {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            proxy.delayed() > held,
            "{read}: the chunk read was never held"
        );
        assert!(direct.delete(&k).await.unwrap_or_else(|e| panic!("{e}")));
        let got = reader.await.unwrap_or_else(|e| panic!("{e}"));
        match (read, got) {
            ("acquire", Ok(Some(Acquisition::Acquired(l)))) => {
                assert_eq!(l.attempt, 1);
                assert!(l.fence > lease.fence, "{} after {}", l.fence, lease.fence);
            }
            ("get", Ok(None)) => {
                assert!(
                    slow.get(&k)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"))
                        .is_none(),
                    "get: a deleted record is still there"
                );
            }
            (read, other) => panic!(
                "{read} of a record deleted while its chunks were read: {:?}",
                other.map(|a| a.map(|a| format!("{a:?}")))
            ),
        }
    }
}

/// The time left that `acquire` hands a tiered store for its fill is
/// taken after the chunks were read: a slow chunk read does not make a
/// cache entry outlive the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_chunk_read_does_not_lengthen_the_time_left() {
    let (slow, proxy) = proxied(moto::shared_url()).await;
    let k = key("slow-chunks");
    let lease = acquired(&slow, &k, LONG).await;
    slow.complete(&lease, &vec![6u8; 900_000], Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    proxy.delay_requests_to(
        b"DynamoDB_20120810.BatchGetItem",
        Duration::from_millis(1_500),
    );
    let record = match slow.acquire(&k, None, LONG).await {
        Ok(Acquisition::Completed(r)) => r,
        other => panic!("{:?}", other.map(|_| ())),
    };
    assert!(proxy.delayed() > 0, "the chunk read was not held back");
    let left = record
        .expires_at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    assert!(
        record.ttl <= left + Duration::from_millis(100),
        "the fill may live {:?}, the record {left:?}",
        record.ttl
    );
}

/// A delete whose reply was lost (sent once: the caller gets a retryable
/// error) and the caller's retry: the deleted response's chunks are gone
/// after the retry, not left until the deleted record's retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_retried_after_a_lost_reply_leaves_no_chunks() {
    let (store, proxy) = proxied(moto::shared_url()).await;
    let k = key("delete-lost");
    let l = acquired(&store, &k, LONG).await;
    store
        .complete(&l, &vec![3u8; 900_000], Duration::MAX)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    proxy.lose_replies_to(b"DynamoDB_20120810.UpdateItem", 1, 1);
    let first = store.delete(&k).await;
    assert!(
        matches!(&first, Err(e) if e.is_retryable()),
        "a delete whose reply was lost: {first:?}"
    );
    assert_eq!(proxy.lost(), 1);
    let again = store.delete(&k).await;
    assert!(again.is_ok(), "{again:?}");
    assert!(store
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_none());
    let left = chunk_items(&all_items(&store).await, &l.token);
    assert!(
        left.is_empty(),
        "after a retried delete, the deleted record's chunks are still stored: {left:?}"
    );
}

/// The same lost delete reply, but the key is acquired (and completed)
/// again before the caller's retry: the acquisition that writes over the
/// tombstone removes the chunks it still names, so the first record's
/// chunks are not left until its retention (here 100 years), out of
/// reach of `purge_expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_retried_after_the_key_was_acquired_again_leaves_no_chunks() {
    let (store, proxy) = proxied(moto::shared_url()).await;
    let k = key("delete-lost-reacquired");
    let l = acquired(&store, &k, LONG).await;
    store
        .complete(&l, &vec![3u8; 900_000], Duration::MAX)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    proxy.lose_replies_to(b"DynamoDB_20120810.UpdateItem", 1, 1);
    let first = store.delete(&k).await;
    assert!(matches!(&first, Err(e) if e.is_retryable()), "{first:?}");
    assert_eq!(proxy.lost(), 1);
    let again = acquired(&store, &k, LONG).await;
    store
        .complete(&again, b"small", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let retried = store.delete(&k).await;
    assert!(retried.is_ok(), "{retried:?}");
    let purged = store.purge_expired(usize::MAX).await;
    let left = chunk_items(&all_items(&store).await, &l.token);
    assert!(
        left.is_empty(),
        "the first record's {} chunks are still stored after the retried delete (purge: {purged:?})",
        left.len()
    );
}

/// Deleting an item that does not decode keeps the fences rising across
/// clients whose clocks differ (within the margin): the fence stored in
/// the item when it decodes, else one above what any such client's clock
/// can have handed out. The next acquisition, by the client behind, gets
/// a fence above the last one handed out, by the client ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_undecodable_item_keeps_the_fence_rising() {
    let base = store().await.clock_skew_margin(Duration::from_secs(1));
    let ahead = base.clone().clock_offset_ms(400);
    for (what, fence_attr) in [
        ("a fence that decodes", None),
        ("a fence that does not", Some(AttributeValue::S("x".into()))),
    ] {
        let k = key("corrupt-fence");
        let l = acquired(&ahead, &k, LONG).await;
        ahead
            .complete(&l, b"done", DAY)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // The record, its status corrupt (and its fence, the second time).
        let mut attrs = vec![
            ("st", AttributeValue::S("zz".into())),
            (
                "tk",
                AttributeValue::B(Blob::new(l.token.to_bytes().to_vec())),
            ),
            ("fe", AttributeValue::N(l.fence.to_string())),
            ("ex", AttributeValue::N("99999999999999".into())),
            ("rv", AttributeValue::N("1".into())),
        ];
        if let Some(bad) = fence_attr {
            attrs.retain(|(n, _)| *n != "fe");
            attrs.push(("fe", bad));
        }
        overwrite(&base, &k, &attrs).await;
        assert!(base
            .delete(&k)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}")));
        let next = acquired(&base, &k, LONG).await;
        assert!(
            next.fence > l.fence,
            "{what}: fence {} after {} was handed out",
            next.fence,
            l.fence
        );
    }
}

/// `delete` turns a completed record into a tombstone; the chunk items of
/// its large response, referenced by nothing then, are removed too (they
/// would otherwise keep the record's expiry, here the longest retention,
/// `MAX_DURATION`, and no purge would remove them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_leaves_no_orphan_chunks() {
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
    let orphans = chunk_items(&all_items(&store).await, &l.token);
    assert!(
        orphans.is_empty(),
        "after delete and purge, the deleted record's chunks are still stored \
         (until its retention, 100 years): {orphans:?}"
    );
}

/// Items that do not decode are `Corrupt` (naming the key, not
/// retryable) for `acquire` and `get`, never absent; `delete` clears
/// each, even one whose fence is not a number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_items_are_corrupt_never_absent() {
    let store = store().await;
    let n = |v: &str| AttributeValue::N(v.into());
    let s = |v: &str| AttributeValue::S(v.into());
    let bin = |v: &[u8]| AttributeValue::B(Blob::new(v.to_vec()));
    let far = "99999999999999";
    let token = [7u8; 16];
    let live = |extra: Vec<(&'static str, AttributeValue)>| {
        let mut attrs = vec![
            ("st", s("c")),
            ("tk", bin(&token)),
            ("fe", n("5")),
            ("at", n("1")),
            ("cr", n("1")),
            ("co", n("1")),
            ("ex", n(far)),
            ("rv", n("3")),
            ("rs", bin(b"r")),
        ];
        for (name, value) in extra {
            attrs.retain(|(n, _)| *n != name);
            attrs.push((name, value));
        }
        attrs
    };
    let cases: Vec<(&str, Vec<(&'static str, AttributeValue)>)> = vec![
        ("unknown status", live(vec![("st", s("q"))])),
        ("status as a number", live(vec![("st", n("1"))])),
        ("token of 3 bytes", live(vec![("tk", bin(b"abc"))])),
        ("attempt 0", live(vec![("at", n("0"))])),
        ("attempt over u32", live(vec![("at", n("4294967296"))])),
        ("response as a string", live(vec![("rs", s("r"))])),
        ("fingerprint of 5 bytes", live(vec![("fp", bin(b"12345"))])),
        ("fence as a string", live(vec![("fe", s("x"))])),
        ("negative fence", live(vec![("fe", n("-1"))])),
        (
            "in progress with a response",
            live(vec![("st", s("p")), ("le", n(far))]),
        ),
    ];
    for (what, attrs) in cases {
        let k = key("corrupt");
        overwrite(&store, &k, &attrs).await;
        let got = store.acquire(&k, None, LONG).await;
        match &got {
            Err(e @ StoreError::Corrupt { key, .. }) => {
                assert_eq!(*key, k, "{what}");
                assert!(!e.is_retryable(), "{what}");
            }
            other => panic!("{what}: acquire gave {other:?}"),
        }
        let got = store.get(&k).await;
        assert!(
            matches!(&got, Err(StoreError::Corrupt { .. })),
            "{what}: get gave {got:?}"
        );
        assert!(
            store
                .delete(&k)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}")),
            "{what}: delete found nothing"
        );
        let again = store.acquire(&k, None, LONG).await;
        assert!(
            matches!(again, Ok(Acquisition::Acquired(_))),
            "{what}: after delete: {again:?}"
        );
    }
}

/// DESIGN.md 2: the fence **strictly increases** across every acquisition.
/// A tombstone whose fence is u64::MAX (a corrupt or hand-written item)
/// cannot give the next acquisition a higher fence: it is refused
/// (`Corrupt`), never handed out the same fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_at_u64_max_is_never_reused() {
    let store = store().await;
    let k = key("fence-max");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    overwrite(
        &store,
        &k,
        &[
            ("st", AttributeValue::S("r".into())),
            ("tk", AttributeValue::B(Blob::new(vec![7u8; 16]))),
            ("fe", AttributeValue::N(u64::MAX.to_string())),
            ("ex", AttributeValue::N((now_ms + 3_600_000).to_string())),
            ("rv", AttributeValue::N("1".into())),
        ],
    )
    .await;
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

/// `purge_periodically`'s drain ("purges batches until one comes back
/// short, so a backlog drains") leaves no expired item behind, although
/// the purge keeps a scan cursor across calls: a page holding more expired
/// items than `max` must not have its extra items skipped (the cursor
/// moving past them) while the next call, finding nothing expired in the
/// rest of the table, comes back short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_drain_leaves_no_expired_item_behind() {
    let store = store().await;
    // Two records that expire at once, written first, keys sorting before
    // the padding's (moto pages in insertion order, resumes by key order)...
    let id = format!("{:016x}", fastrand::u64(..));
    let k = |scope: &str, n: u32| {
        IdempotencyKey::new(scope, format!("{id}-{n}")).unwrap_or_else(|e| panic!("{e}"))
    };
    let (e1, e2) = (k("a.drain", 1), k("a.drain", 2));
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
        let l = acquired(&store, &k("zz.drain", n), LONG).await;
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
            Some(AttributeValue::S(pk)) if pk.starts_with("a.drain/") => Some(pk.clone()),
            _ => None,
        })
        .collect();
    assert!(
        purged == 2 && left.is_empty(),
        "the drain purged {purged} of 2 expired records in {calls} calls and stopped; \
         still in the table: {left:?}"
    );
}
