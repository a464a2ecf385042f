//! Acquire, complete and replay one key: a fresh key, duplicates replayed,
//! another payload a mismatch, a held key in progress.

use std::time::Duration;

use crate::{Acquisition, IdempotencyStore, RecordState};

use super::{acquired, close, completed_response, fp, ok, outlive, unique_key, Harness, DAY, LONG};

/// A fresh key is acquired with attempt 1, and the record is in progress
/// with the fingerprint and the lease's token.
pub async fn fresh_acquire<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("fresh");
    let lease = acquired(
        store.acquire(&key, Some(&fp("a")), LONG).await,
        "fresh acquire",
    );
    assert_eq!(lease.key, key);
    assert_eq!(lease.attempt, 1);
    assert_eq!(
        lease.fingerprint,
        Some(fp("a")),
        "the lease carries the stored fingerprint"
    );
    let record =
        ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("no record after acquire"));
    assert_eq!(record.key, key);
    assert_eq!(record.token, lease.token);
    assert_eq!(record.attempt, 1);
    assert_eq!(record.fingerprint, Some(fp("a")));
    match record.state {
        RecordState::InProgress { lease_expires_at } => assert!(
            close(lease_expires_at, lease.expires_at, Duration::from_millis(2)),
            "record lease {lease_expires_at:?} != lease {:?}",
            lease.expires_at
        ),
        other => panic!("expected InProgress, got {other:?}"),
    }
    let held = lease
        .expires_at
        .duration_since(record.created_at)
        .unwrap_or_default();
    assert!(
        held >= LONG - Duration::from_millis(2) && held <= LONG + Duration::from_secs(1),
        "lease length {held:?}, asked for {LONG:?}"
    );
    assert!(
        record.expires_at >= lease.expires_at,
        "record expires before its lease"
    );
}

/// A completed key replays its response, fingerprint and attempt to every
/// duplicate, with or without a fingerprint.
pub async fn duplicate_replay<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("replay");
    let lease = acquired(
        store.acquire(&key, Some(&fp("p")), LONG).await,
        "first acquire",
    );
    ok(store.complete(&lease, b"receipt-1", DAY).await, "complete");
    for i in 0..3 {
        match store.acquire(&key, Some(&fp("p")), LONG).await {
            Ok(Acquisition::Completed(record)) => {
                assert_eq!(&record.response[..], b"receipt-1");
                assert_eq!(record.fingerprint, Some(fp("p")));
                assert_eq!(record.attempt, 1);
                assert_eq!(record.key, key);
                assert!(record.expires_at > record.completed_at);
            }
            other => panic!("duplicate {i}: expected Completed, got {other:?}"),
        }
    }
    assert_eq!(
        completed_response(
            store.acquire(&key, None, LONG).await,
            "duplicate without fingerprint"
        ),
        b"receipt-1"
    );
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    match record.state {
        RecordState::Completed { response, .. } => assert_eq!(&response[..], b"receipt-1"),
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// A different fingerprint on a live key is `Mismatch`, whether the record
/// is completed, in progress, or in progress with its lease over (the
/// mismatch wins over the takeover).
pub async fn mismatch<H: Harness>(h: &H) {
    let store = h.store().await;
    let lease_len = h.settings().lease;

    let done = unique_key("mismatch-done");
    let lease = acquired(store.acquire(&done, Some(&fp("a")), LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    let got = store.acquire(&done, Some(&fp("b")), LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::Mismatch)),
        "completed: {got:?}"
    );

    let busy = unique_key("mismatch-busy");
    acquired(store.acquire(&busy, Some(&fp("a")), LONG).await, "acquire");
    let got = store.acquire(&busy, Some(&fp("b")), LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::Mismatch)),
        "in progress: {got:?}"
    );

    let stale = unique_key("mismatch-stale");
    acquired(
        store.acquire(&stale, Some(&fp("a")), lease_len).await,
        "acquire",
    );
    outlive(lease_len).await;
    let got = store.acquire(&stale, Some(&fp("b")), LONG).await;
    assert!(
        matches!(got, Ok(Acquisition::Mismatch)),
        "lease over: {got:?}"
    );
    let taken = acquired(
        store.acquire(&stale, Some(&fp("a")), LONG).await,
        "takeover with the right payload",
    );
    assert_eq!(taken.attempt, 2);
}

/// The fingerprint check applies only when both sides carry one.
pub async fn fingerprint_optional<H: Harness>(h: &H) {
    let store = h.store().await;

    let k1 = unique_key("fp-none-stored");
    let lease = acquired(
        store.acquire(&k1, None, LONG).await,
        "acquire without fingerprint",
    );
    assert_eq!(lease.fingerprint, None);
    let got = store.acquire(&k1, Some(&fp("x")), LONG).await;
    assert!(matches!(got, Ok(Acquisition::InProgress { .. })), "{got:?}");
    ok(store.complete(&lease, b"one", DAY).await, "complete");
    assert_eq!(
        completed_response(store.acquire(&k1, Some(&fp("x")), LONG).await, "replay"),
        b"one"
    );

    let k2 = unique_key("fp-none-given");
    let lease = acquired(
        store.acquire(&k2, Some(&fp("y")), LONG).await,
        "acquire with fingerprint",
    );
    ok(store.complete(&lease, b"two", DAY).await, "complete");
    assert_eq!(
        completed_response(store.acquire(&k2, None, LONG).await, "replay"),
        b"two"
    );
}

/// A key held with a live lease is `InProgress`, with the holder's deadline,
/// the time left (at most the lease, plus a store's clock-skew margin of up
/// to a second) and its attempt.
pub async fn in_progress<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("busy");
    let lease = acquired(store.acquire(&key, Some(&fp("a")), LONG).await, "acquire");
    match store.acquire(&key, Some(&fp("a")), LONG).await {
        Ok(Acquisition::InProgress {
            lease_expires_at,
            retry_after,
            attempt,
        }) => {
            assert_eq!(attempt, 1);
            assert!(
                close(lease_expires_at, lease.expires_at, Duration::from_millis(2)),
                "deadline {lease_expires_at:?} != lease {:?}",
                lease.expires_at
            );
            // At most the lease, plus up to a second for a store that lets
            // a takeover wait a clock-skew margin past the deadline (the
            // DynamoDB store: the time left is then the lease's rest plus
            // the margin, a little over the lease when asked at once).
            assert!(
                retry_after > LONG - Duration::from_secs(5)
                    && retry_after <= LONG + Duration::from_secs(1),
                "retry_after {retry_after:?}"
            );
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    // Asking did not change the holder.
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record gone"));
    assert_eq!(record.token, lease.token);
}
