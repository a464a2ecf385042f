//! `MokaCache`'s byte budget counts what an entry really takes.
//! The cache is filled with 200,000 completed records (200-byte responses,
//! keys like the load command's; `IDEM_MOKA_ENTRIES` sets the count), then
//! a quarter as many with 4,000-byte responses, and its own weight is compared with the
//! growth of the process's resident memory (what an operator sees).
//!
//! The test runs in a process of its own (`support::alone`): the RSS
//! reading sees this test alone.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idemkit::tiered::{MokaCache, RecordCache};
use idemkit::{CompletedRecord, IdempotencyKey};

/// Resident memory of this process, in bytes.
fn rss() -> i64 {
    let statm =
        std::fs::read_to_string("/proc/self/statm").unwrap_or_else(|e| panic!("statm: {e}"));
    let pages: i64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("statm: {statm:?}"));
    pages * 4096
}

/// Fills a fresh cache with `n` records of `size`-byte responses; returns
/// (the cache's weight, the growth of RSS), per entry, and the cache and
/// records, which the caller keeps until every fill is measured (memory
/// they freed would be reused by the next fill, which would then not grow
/// the RSS by what it takes).
async fn fill(n: u64, size: usize) -> ((f64, f64), (MokaCache, Vec<CompletedRecord>)) {
    // Entry and byte bounds far above the test's: no floor weight per entry.
    let cache = MokaCache::new(1 << 40, 64 << 30);
    // Records as a store hands them out: the response may share a larger
    // buffer (a Redis reply holds the record's header too).
    let records: Vec<CompletedRecord> = (0..n)
        .map(|i| {
            let key = IdempotencyKey::new("load.duplicate", format!("1763859000123456789-{i}"))
                .unwrap_or_else(|e| panic!("{e}"));
            let reply = Bytes::from(vec![b'x'; 94 + size]);
            CompletedRecord::new(
                key,
                reply.slice(94..),
                None,
                1,
                SystemTime::now(),
                SystemTime::now() + Duration::from_secs(3600),
            )
            .with_fence(i)
        })
        .collect();
    let rss_before = rss();
    for record in &records {
        cache
            .put(record, Duration::from_secs(3600))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let weighed = cache.weighted_bytes().await;
    let rss_after = rss();
    assert_eq!(cache.entry_count(), n, "the cache refused entries");
    let per = |total: i64| total as f64 / n as f64;
    (
        (per(weighed as i64), per(rss_after - rss_before)),
        (cache, records),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_budget_counts_what_entries_really_take() {
    if !crate::support::alone::in_own_process(
        "moka_weight::the_byte_budget_counts_what_entries_really_take",
    ) {
        return;
    }
    // IDEM_MOKA_ENTRIES=1000000 for the README's figure (default 200,000).
    let n: u64 = std::env::var("IDEM_MOKA_ENTRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let mut keep = Vec::new();
    for (n, size) in [(n, 200), (n / 4, 4_000)] {
        let ((by_cache, by_rss), kept) = fill(n, size).await;
        keep.push(kept);
        println!(
            "moka memory entries={n} response_bytes={size} weigher_bytes_per_entry={by_cache:.0} rss_bytes_per_entry={by_rss:.0}"
        );
        let ratio = by_cache / by_rss;
        assert!(
            (0.75..=1.25).contains(&ratio),
            "{size}-byte responses: the weigher counts {by_cache:.0} bytes per entry, the RSS grew {by_rss:.0} ({ratio:.2}x)"
        );
    }
}
