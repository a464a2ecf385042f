//! How a record ends: its retention runs out, `delete`, `purge_expired`;
//! and the time a completed record has left.

use std::time::Duration;

use crate::{Acquisition, IdempotencyStore};

use super::{
    acquired, completed_response, fp, lease_lost, ok, outlive, unique_key, Harness, DAY, LONG,
};

/// A completed record is replayed until its retention ends, then the key is
/// absent: `get` finds nothing and `acquire` starts over at attempt 1,
/// without the old fingerprint.
pub async fn retention_expiry<H: Harness>(h: &H) {
    let store = h.store().await;
    let short = h.settings().lease;
    // The record is found while its retention runs: seen on a key whose
    // `complete` and `get` both answered within it (a loaded machine may
    // take longer than a short retention for one of them; then a fresh key
    // is tried, five at most).
    let mut found = None;
    for _ in 0..5 {
        let key = unique_key("retention");
        let lease = acquired(store.acquire(&key, Some(&fp("a")), LONG).await, "acquire");
        let sent = tokio::time::Instant::now();
        ok(store.complete(&lease, b"r", short).await, "complete");
        let got = ok(store.get(&key).await, "get");
        if sent.elapsed() < short {
            assert!(got.is_some(), "a record within its retention was not found");
            found = Some((key, lease));
            break;
        }
    }
    let Some((key, lease)) = found else {
        panic!("five tries: `complete` then `get` never answered within the retention ({short:?})");
    };
    outlive(short).await;
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "expired record returned as live"
    );
    let again = acquired(
        store.acquire(&key, Some(&fp("b")), LONG).await,
        "acquire after retention",
    );
    assert_eq!(again.attempt, 1);
    assert_ne!(again.token, lease.token);
}

/// `get` and `delete` of present and absent keys; a deleted in-progress key
/// fences its old holder.
pub async fn get_and_delete<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("delete");
    assert!(ok(store.get(&key).await, "get absent").is_none());
    assert!(!ok(store.delete(&key).await, "delete absent"));

    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    assert!(ok(store.delete(&key).await, "delete completed"));
    assert!(ok(store.get(&key).await, "get deleted").is_none());
    assert!(!ok(store.delete(&key).await, "delete twice"));

    let lease = acquired(
        store.acquire(&key, None, LONG).await,
        "acquire after delete",
    );
    assert_eq!(lease.attempt, 1);
    assert!(ok(store.delete(&key).await, "delete in progress"));
    lease_lost(
        store.complete(&lease, b"r", DAY).await,
        "complete after delete",
    );
}

/// `purge_expired(max)` removes at most `max` expired records per call and
/// never a live one; expired records are never returned, purged or not.
pub async fn purge_expired<H: Harness>(h: &H) {
    let settings = h.settings();
    let short = settings.lease;
    let store = h.store().await;
    let mut expiring = Vec::new();
    for i in 0..5 {
        let key = unique_key(&format!("purge-{i}"));
        let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
        ok(store.complete(&lease, b"r", short).await, "complete");
        expiring.push(key);
    }
    let kept = unique_key("purge-kept");
    let lease = acquired(store.acquire(&kept, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"kept", DAY).await, "complete");
    let busy = unique_key("purge-busy");
    acquired(store.acquire(&busy, None, LONG).await, "acquire");
    outlive(short).await;

    let mut total = 0;
    for _ in 0..1_000 {
        let removed = ok(store.purge_expired(2).await, "purge");
        assert!(removed <= 2, "purge_expired(2) removed {removed}");
        total += removed;
        if removed == 0 {
            break;
        }
    }
    if settings.purge_reports_removed {
        assert!(total >= 5, "purge removed {total} records, 5 had expired");
    }
    for key in &expiring {
        assert!(
            ok(store.get(key).await, "get expired").is_none(),
            "{key} returned after expiry"
        );
    }
    assert_eq!(
        completed_response(store.acquire(&kept, None, LONG).await, "kept"),
        b"kept"
    );
    let got = store.acquire(&busy, None, LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::InProgress { .. })),
        "busy: {got:?}"
    );
}

/// A completed record handed out by `acquire` carries its fence and the
/// time it has left by the store's clock, no more than its retention.
pub async fn completed_record_carries_fence_and_store_ttl<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("ttl");
    let retention = Duration::from_secs(3_600);
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", retention).await, "complete");
    match store.acquire(&key, None, LONG).await {
        Ok(Acquisition::Completed(record)) => {
            assert_eq!(record.fence, lease.fence);
            assert!(
                record.ttl <= retention && record.ttl + Duration::from_secs(5) >= retention,
                "ttl {:?} for a retention of {retention:?}",
                record.ttl
            );
        }
        other => panic!("expected Completed, got {other:?}"),
    }
}
