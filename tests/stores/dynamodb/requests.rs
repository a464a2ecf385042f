//! What each operation costs, counted as request/reply turns at a proxy in
//! front of moto: what the crate docs say, refused completions included.

use crate::support;

use std::time::Duration;

use idemkit::{Acquisition, IdempotencyStore, StoreError};
use support::moto;

use super::{acquired, fp, key, proxied, DAY, LONG};

/// Every operation costs the requests the crate docs say, counted as
/// request/reply turns at a proxy: a fresh key and every duplicate one
/// request, complete/release/extend/get/delete one, a takeover two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operation_costs_the_requests_the_docs_say() {
    let (store, proxy) = proxied(moto::shared_url()).await;
    let mut last = proxy.turns();
    let mut cost = |what: &str, want: u64| {
        let now = proxy.turns();
        assert_eq!(
            now - last,
            want,
            "{what}: {} requests, expected {want}",
            now - last
        );
        last = now;
    };
    let k = key("cost");
    let lease = match store.acquire(&k, Some(&fp("a")), LONG).await {
        Ok(Acquisition::Acquired(l)) => l,
        other => panic!("{other:?}"),
    };
    cost("fresh acquire", 1);
    let got = store.acquire(&k, Some(&fp("a")), LONG).await;
    assert!(matches!(got, Ok(Acquisition::InProgress { .. })), "{got:?}");
    cost("duplicate in progress", 1);
    let lease = store
        .extend(&lease, LONG)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    cost("extend", 1);
    store
        .complete(&lease, b"done", DAY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    cost("complete", 1);
    let got = store.acquire(&k, Some(&fp("a")), LONG).await;
    assert!(matches!(got, Ok(Acquisition::Completed(_))), "{got:?}");
    cost("duplicate replay", 1);
    let got = store.acquire(&k, Some(&fp("b")), LONG).await;
    assert!(matches!(got, Ok(Acquisition::Mismatch)), "{got:?}");
    cost("mismatch", 1);
    assert!(store
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_some());
    cost("get", 1);
    assert!(store.delete(&k).await.unwrap_or_else(|e| panic!("{e}")));
    cost("delete", 1);
    let lease = acquired(&store, &k, Duration::from_millis(100)).await;
    cost("acquire after a delete (the tombstone, then the write)", 2);
    store
        .release(&lease)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    cost("release", 1);
    let lease = acquired(&store, &k, Duration::from_millis(100)).await;
    cost("acquire after a release", 2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let taken = acquired(&store, &k, LONG).await;
    assert_eq!(taken.attempt, 2);
    assert!(taken.fence > lease.fence);
    cost("takeover", 2);
    // A large response: one transaction; its replay: the item, then the
    // chunks.
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 253) as u8).collect();
    store
        .complete(&taken, &big, DAY)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    cost("complete of 1 MB (one transaction)", 1);
    match store.acquire(&k, None, LONG).await {
        Ok(Acquisition::Completed(r)) => assert!(r.response == big),
        other => panic!("{other:?}"),
    }
    cost("replay of 1 MB (the item, then its chunks)", 2);
}

/// The crate docs: "`complete`, `release`, `extend` | 1" and "`complete` of
/// a response over INLINE_RESPONSE_BYTES | 1 | TransactWriteItems". A
/// completion refused because its lease was taken over costs one request,
/// inline or chunked (the chunked one answers from the cancelled
/// transaction, not from a second `GetItem`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_chunked_complete_costs_one_request() {
    let (store, proxy) = proxied(moto::shared_url()).await;
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
