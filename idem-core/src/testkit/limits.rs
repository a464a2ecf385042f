//! Inputs at and past the limits: records that do not decode, keys at
//! their length limits and bad keys, a 1 MiB response, zero and
//! `Duration::MAX` durations.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::{
    saturate, Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy,
    KeyError, Processed, StoreError,
};

use super::{acquired, completed_response, fp, ok, unique_key, Harness, DAY, LONG};

/// A record that does not decode is reported as `Corrupt` naming its key by
/// `get` and `acquire`, never treated as absent; other keys work; `delete`
/// clears it.
pub async fn corrupt_record<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("corrupt");
    let other = unique_key("corrupt-neighbour");
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, b"r", DAY).await, "complete");
    h.corrupt(&store, &key).await;

    match store.get(&key).await {
        Err(StoreError::Corrupt { key: k, .. }) => assert_eq!(k, key),
        other => panic!("get of a corrupt record: expected Corrupt, got {other:?}"),
    }
    match store.acquire(&key, None, LONG).await {
        Err(e @ StoreError::Corrupt { .. }) => assert!(!e.is_retryable()),
        other => panic!("acquire of a corrupt record: expected Corrupt, got {other:?}"),
    }
    let lease = acquired(store.acquire(&other, None, LONG).await, "neighbour acquire");
    ok(
        store.complete(&lease, b"fine", DAY).await,
        "neighbour complete",
    );

    assert!(ok(store.delete(&key).await, "delete corrupt"));
    acquired(
        store.acquire(&key, None, LONG).await,
        "acquire after delete",
    );
}

/// Keys at the length limits, with the characters allowed, round trip; keys
/// that differ only by scope are independent; bad keys are refused before
/// reaching the store.
pub async fn key_limits<H: Harness>(h: &H) {
    let store = h.store().await;
    let tag = format!("{:08x}", fastrand::u32(..));
    let long_scope = format!("{tag}.{}", "s".repeat(64 - tag.len() - 1));
    // 512 bytes: a 2-byte character, a 4-byte one, and ASCII punctuation.
    let mut long_id = format!("{tag}é🦀/%:{{}}\"' \\");
    long_id.push_str(&"x".repeat(512 - long_id.len()));
    let keys = [
        IdempotencyKey::new(long_scope.clone(), long_id.clone()),
        IdempotencyKey::new("A-z_0.9:x", format!("{tag}-id")),
        IdempotencyKey::composite("idem.conformance", [tag.as_str(), "a/b", "100%"]),
        IdempotencyKey::new("idem.conformance.other", long_id.clone()),
    ];
    for (i, key) in keys.into_iter().enumerate() {
        let key = key.unwrap_or_else(|e| panic!("key {i} should be valid: {e}"));
        let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
        ok(
            store
                .complete(&lease, format!("r{i}").as_bytes(), DAY)
                .await,
            "complete",
        );
        assert_eq!(
            completed_response(store.acquire(&key, None, LONG).await, "replay"),
            format!("r{i}").as_bytes()
        );
        let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("record {i} gone"));
        assert_eq!(record.key, key, "the key round trips exactly");
    }
    let bad: [Result<IdempotencyKey, KeyError>; 6] = [
        IdempotencyKey::new("", "x"),
        IdempotencyKey::new("s".repeat(65), "x"),
        IdempotencyKey::new("with space", "x"),
        IdempotencyKey::new("s", ""),
        IdempotencyKey::new("s", "x".repeat(513)),
        IdempotencyKey::new("s", "tab\there"),
    ];
    for (i, result) in bad.into_iter().enumerate() {
        assert!(result.is_err(), "bad key {i} was accepted");
    }
}

/// A 1 MiB response with every byte value round trips exactly.
pub async fn large_response<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("large");
    let response: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    ok(store.complete(&lease, &response, DAY).await, "complete");
    let replayed = completed_response(store.acquire(&key, None, LONG).await, "replay");
    assert!(replayed == response, "large response changed in the store");
}

/// A zero lease is refused with `InvalidArgument` and writes nothing;
/// extending by zero is refused too and leaves the lease as it was.
pub async fn zero_lease_refused<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("zero");
    let refused = store.acquire(&key, None, Duration::ZERO).await;
    assert!(
        matches!(refused, Err(StoreError::InvalidArgument { .. })),
        "zero lease: {refused:?}"
    );
    assert!(
        ok(store.get(&key).await, "get").is_none(),
        "a refused acquire wrote a record"
    );
    let lease = acquired(store.acquire(&key, None, LONG).await, "acquire");
    let refused = store.extend(&lease, Duration::ZERO).await;
    assert!(
        matches!(refused, Err(StoreError::InvalidArgument { .. })),
        "zero extend: {refused:?}"
    );
    assert!(
        matches!(
            store.acquire(&key, None, LONG).await,
            Ok(Acquisition::InProgress { .. })
        ),
        "the lease still holds after a refused extend"
    );
}

/// `Duration::MAX` as a lease, an extension or a retention is accepted
/// (saturated to `MAX_DURATION`), never an error, a panic or a half-written
/// record: the key is held, then completed and replayed.
pub async fn durations_at_the_extremes<H: Harness>(h: &H) {
    let store = h.store().await;
    let key = unique_key("max");
    let lease = acquired(
        store.acquire(&key, Some(&fp("m")), Duration::MAX).await,
        "acquire with Duration::MAX",
    );
    let far = SystemTime::now() + saturate(Duration::MAX) - DAY;
    assert!(
        lease.expires_at > far,
        "lease of Duration::MAX ends {:?}",
        lease.expires_at
    );
    assert!(
        matches!(
            store.acquire(&key, Some(&fp("m")), LONG).await,
            Ok(Acquisition::InProgress { .. })
        ),
        "a Duration::MAX lease holds the key"
    );
    let lease = ok(
        store.extend(&lease, Duration::MAX).await,
        "extend Duration::MAX",
    );
    ok(
        store.complete(&lease, b"forever", Duration::MAX).await,
        "complete with Duration::MAX",
    );
    let record = ok(store.get(&key).await, "get").unwrap_or_else(|| panic!("no record"));
    assert!(record.is_completed(), "{record:?}");
    assert!(
        record.expires_at > far,
        "retention of Duration::MAX ends {:?}",
        record.expires_at
    );
    assert_eq!(
        completed_response(store.acquire(&key, Some(&fp("m")), LONG).await, "replay"),
        b"forever"
    );
    // Executor-level: the same extremes through `process`.
    let idem = Idempotency::from_arc(Arc::new(store))
        .lease(Duration::MAX)
        .retention(Duration::MAX)
        .complete_retry(Duration::MAX)
        .heartbeat_interval(Duration::MAX)
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::MAX,
            poll: Duration::MAX,
        });
    let key = unique_key("max-process");
    let first = idem
        .process(&key, 1u8, |_| async { Ok::<_, Infallible>(7u8) })
        .await;
    assert!(matches!(first, Ok(Processed::Executed(7))), "{first:?}");
    let again = idem
        .process(&key, 1u8, |_| async { Ok::<_, Infallible>(8u8) })
        .await;
    assert!(matches!(again, Ok(Processed::Replayed(7))), "{again:?}");
}
