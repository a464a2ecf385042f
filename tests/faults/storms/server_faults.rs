//! Servers killed, restarted, frozen (SIGSTOP) and thawed mid-storm: every
//! failed call is `Unavailable`, no effect runs twice, no completed record
//! is lost.

use super::*;
use support::pg::PgServer;
use support::redis_server::RedisServer;

async fn redis_at(url: &str) -> Arc<dyn IdempotencyStore> {
    Arc::new(
        RedisStore::connect(url)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .call_timeout(Duration::from_millis(500)),
    )
}

async fn pg_at(url: &str) -> PgStore {
    let store = PgStore::builder(support::pg::pool(url, 16).await)
        .connections(16)
        .call_timeout(Duration::from_millis(500))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

/// A fault on `server` (of a storm of `FAULT_MESSAGES`) that starts
/// (`start`) once a third of the messages ran, and ends (`end`) once a
/// delivery has seen it (`Unavailable`), so every run really crosses it.
fn fault<S: Send + Sync + 'static>(server: &Arc<S>, start: fn(&S), end: fn(&S)) -> Fault {
    fault_until(server, start, end, |seen, p| {
        p.unavailable.load(Ordering::SeqCst) > seen
    })
}

/// A fault on `server` that starts once a third of the messages ran and
/// ends when `over(unavailable count at the start, progress)` holds.
fn fault_until<S: Send + Sync + 'static>(
    server: &Arc<S>,
    start: fn(&S),
    end: fn(&S),
    over: impl Fn(u64, &Progress) -> bool + Send + Sync + 'static,
) -> Fault {
    let (a, b) = (server.clone(), server.clone());
    Box::new(move |progress: Arc<Progress>| {
        Box::pin(async move {
            progress
                .until("a third of the messages executed", STORM_LIMIT, |p| {
                    p.executed.load(Ordering::SeqCst) >= FAULT_MESSAGES / 3
                })
                .await;
            let seen = progress.unavailable.load(Ordering::SeqCst);
            tokio::task::spawn_blocking(move || start(&a))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            progress
                .until("a delivery saw the fault", Duration::from_secs(60), |p| {
                    over(seen, p)
                })
                .await;
            tokio::task::spawn_blocking(move || end(&b))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        })
    })
}

async fn fault_storm(scenario: &str, backend: Backend, receiver: Receiver, fault: Fault) {
    fault_storm_expecting(scenario, backend, receiver, fault, true).await
}

async fn fault_storm_expecting(
    scenario: &str,
    backend: Backend,
    receiver: Receiver,
    fault: Fault,
    calls_fail: bool,
) {
    let started = Instant::now();
    let s = storm(backend, receiver, FAULT_MESSAGES, 32, Some(fault)).await;
    if calls_fail {
        assert!(
            s.unavailable > 0,
            "calls failed with Unavailable during the fault"
        );
    } else {
        assert_eq!(s.unavailable, 0, "the fault is invisible to callers");
    }
    assert_eq!(
        s.failures, 0,
        "every failure during the fault is Unavailable"
    );
    assert_eq!(s.lost_completions, 0, "no completed record was lost");
    report(
        scenario,
        backend,
        &[
            ("messages", FAULT_MESSAGES.to_string()),
            ("deliveries", s.deliveries.to_string()),
            ("unavailable", s.unavailable.to_string()),
            ("double_effects", s.double_effects.to_string()),
            ("lost_completions", s.lost_completions.to_string()),
        ],
        started,
    );
}

/// Redis with an append-only file synced on every write: killed with
/// SIGKILL mid-storm and started again, it comes back with every
/// record. (Without persistence a restart loses every record: see
/// RELIABILITY.md.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted() {
    let server = Arc::new(RedisServer::start(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ]));
    let receiver = fault_receiver(redis_at(&server.url).await);
    let fault = fault(&server, |s| s.kill(), |s| s.start_again());
    fault_storm(
        "redis-killed-restarted-aof",
        Backend::Redis,
        receiver,
        fault,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_then_thawed() {
    let server = Arc::new(RedisServer::start(&[]));
    let receiver = fault_receiver(redis_at(&server.url).await);
    let fault = fault(&server, |s| s.signal("STOP"), |s| s.signal("CONT"));
    fault_storm("redis-sigstop-sigcont", Backend::Redis, receiver, fault).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted() {
    let server = Arc::new(PgServer::start());
    let receiver = fault_receiver(Arc::new(pg_at(&server.url).await));
    let fault = fault(&server, |s| s.stop(), |s| s.start_again());
    fault_storm("postgres-restarted", Backend::Postgres, receiver, fault).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_frozen_then_thawed() {
    let server = Arc::new(PgServer::start());
    let receiver = fault_receiver(Arc::new(pg_at(&server.url).await));
    let fault = fault(&server, |s| s.signal("STOP"), |s| s.signal("CONT"));
    fault_storm(
        "postgres-sigstop-sigcont",
        Backend::Postgres,
        receiver,
        fault,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_restarted() {
    let server = Arc::new(PgServer::start());
    let receiver = Receiver::tx(pg_at(&server.url).await).await;
    let fault = fault(&server, |s| s.stop(), |s| s.start_again());
    fault_storm("postgres-restarted", Backend::PostgresTx, receiver, fault).await;
}

/// One master of a 3-master cluster frozen and thawed (within the
/// cluster's node timeout, so no failover): calls for its slots time
/// out, the others go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_node_frozen_then_thawed() {
    let servers = Arc::new(support::redis_server::start_cluster_servers());
    let store = RedisStore::connect_cluster(servers.iter().map(|s| s.url.as_str()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .call_timeout(Duration::from_millis(500));
    let receiver = fault_receiver(Arc::new(store));
    let fault = fault(&servers, |s| s[1].signal("STOP"), |s| s[1].signal("CONT"));
    fault_storm(
        "redis-node-sigstop-sigcont",
        Backend::RedisCluster,
        receiver,
        fault,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tx_frozen_then_thawed() {
    let server = Arc::new(PgServer::start());
    let receiver = Receiver::tx(pg_at(&server.url).await).await;
    let fault = fault(&server, |s| s.signal("STOP"), |s| s.signal("CONT"));
    fault_storm(
        "postgres-sigstop-sigcont",
        Backend::PostgresTx,
        receiver,
        fault,
    )
    .await;
}

/// The tiered store's Redis cache tier killed mid-storm and started
/// again: callers never see it (the tier is skipped), and nothing runs
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_cache_tier_killed_and_restarted() {
    let redis = Arc::new(RedisServer::start(&[]));
    let store = TieredStore::new(pg_store().await)
        .with_cache(MokaCache::new(100_000, 64 << 20))
        .with_cache(
            RedisCache::connect(&redis.url)
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        );
    let receiver = fault_receiver(Arc::new(store));
    let fault = fault_until(
        &redis,
        |s| s.kill(),
        |s| s.start_again(),
        |_, p| p.executed.load(Ordering::SeqCst) >= 2 * FAULT_MESSAGES / 3,
    );
    fault_storm_expecting(
        "redis-tier-killed-restarted",
        Backend::Tiered,
        receiver,
        fault,
        false,
    )
    .await;
}

/// The tiered store with its source of truth restarted: duplicates of
/// completed keys keep being answered by moka and Redis meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiered_source_restarted() {
    let server = Arc::new(PgServer::start());
    let store = TieredStore::new(pg_at(&server.url).await)
        .with_cache(MokaCache::new(100_000, 64 << 20))
        .with_cache(
            RedisCache::connect(support::redis_server::shared_url())
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        );
    let receiver = fault_receiver(Arc::new(store));
    let fault = fault(&server, |s| s.stop(), |s| s.start_again());
    fault_storm("postgres-restarted", Backend::Tiered, receiver, fault).await;
}
