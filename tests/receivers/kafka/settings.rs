//! Settings at their extremes and scopes that cannot be keys: clamped or
//! refused when the consumer is built, never a panic in `run` or in the
//! rebalance callback, never a topic dead-lettered for a setting.

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemkit::kafka::{KafkaRecord, MAX_IN_FLIGHT};
use idemkit::{Idempotency, KeyError, MemoryStore};

use super::{consumer, name, produce, run_until_committed};

/// `concurrency`, `partition_concurrency` and `batch` of `usize::MAX` are
/// clamped to `MAX_IN_FLIGHT`: `run` reads, runs and commits every record
/// (a semaphore of `usize::MAX` permits panics in `run`, and in the
/// rebalance callback it aborts the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_settings_of_usize_max_are_clamped_not_a_panic() {
    let topic = name("clamped");
    let group = name("clamped-g");
    support::kafka::create_topic(&topic, 1);
    let ends = produce(
        &topic,
        (0..3)
            .map(|i| (0, Some(format!("k-{i}")), vec![], format!("{i}")))
            .collect(),
    )
    .await;
    let consumer = consumer(&group, &topic, Idempotency::new(MemoryStore::new()))
        .concurrency(usize::MAX)
        .partition_concurrency(usize::MAX)
        .batch(usize::MAX);
    assert!(format!("{consumer:?}").contains(&MAX_IN_FLIGHT.to_string()));
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let handler = {
        let runs = runs.clone();
        move |record: KafkaRecord| {
            let runs = runs.clone();
            async move {
                let key = record.key_text()?.to_owned();
                *runs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(key)
                    .or_default() += 1;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            }
        }
    };
    let stats = run_until_committed(
        &consumer,
        handler,
        (&group, &topic),
        ends[&0],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(stats.executed, 3, "{stats:?}");
    let runs = runs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(runs.len(), 3, "{runs:?}");
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");
}

/// A scope that is not a valid key scope is refused when the consumer is
/// built (before, every record was dead-lettered and committed with "no
/// usable key"); a valid one is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_scope_is_refused_when_the_consumer_is_built() {
    let topic = name("scoped");
    let build = || {
        consumer(
            &name("scoped-g"),
            &topic,
            Idempotency::new(MemoryStore::new()),
        )
    };
    for bad in ["orders v2", "", &"s".repeat(65), "orders/v2"] {
        match build().scope(bad) {
            Err(
                KeyError::EmptyScope
                | KeyError::ScopeTooLong { .. }
                | KeyError::InvalidScopeChar { .. },
            ) => {}
            other => panic!("scope {bad:?}: {:?}", other.map(|_| "accepted")),
        }
    }
    assert!(build().scope("orders.v2").is_ok());
}
