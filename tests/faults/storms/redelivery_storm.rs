//! A redelivery storm without a fault: `support::storm::messages()` (2,500)
//! messages, each delivered 1 to 8 times by 64 workers; every message has its effect once, every replay
//! is the recorded result.

use super::*;

async fn storm_scenario(backend: Backend) {
    let started = Instant::now();
    let messages = support::storm::messages();
    let receiver = backend.receiver(Duration::from_secs(30)).await;
    let s = storm(backend, receiver, messages, 64, None).await;
    assert_eq!(
        s.failures + s.unavailable,
        0,
        "no delivery fails without a fault"
    );
    assert_eq!(s.lost_completions, 0);
    report(
        "redelivery-storm",
        backend,
        &[
            ("messages", messages.to_string()),
            ("deliveries", s.deliveries.to_string()),
            ("in_progress_redeliveries", s.redeliveries.to_string()),
            ("double_effects", s.double_effects.to_string()),
            ("lost_completions", s.lost_completions.to_string()),
        ],
        started,
    );
}

on_backends!(storm_scenario; memory => Backend::Memory, postgres => Backend::Postgres,
    postgres_tx => Backend::PostgresTx, redis => Backend::Redis,
    redis_cluster => Backend::RedisCluster, tiered => Backend::Tiered);
