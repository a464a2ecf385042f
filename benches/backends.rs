//! Criterion benches of the facade, one group per backend. Each bench name
//! says what one iteration does.
//!
//! ```text
//! cargo bench --all-features --bench backends
//! ```
//!
//! Server backends use the servers of `tests/support` (a PostgreSQL of their
//! own, or `IDEM_POSTGRES_URL`). Benches named `c=32` run 32 tasks at once and
//! report the time per operation, so ops/s = 1 / time.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
#[cfg(any(feature = "postgres", feature = "redis"))]
#[path = "../tests/support/mod.rs"]
mod support;
use idem::{Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, MemoryStore};

static NEXT: AtomicU64 = AtomicU64::new(0);

fn fresh_key() -> IdempotencyKey {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    IdempotencyKey::new("bench.fresh", id.to_string()).unwrap_or_else(|e| panic!("{e}"))
}

fn memory(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let lease = Duration::from_secs(60);
    let retention = Duration::from_secs(3600);
    let mut group = c.benchmark_group("memory");

    let store = MemoryStore::new();
    group.bench_function("store: acquire + complete of a fresh key", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = fresh_key();
            let Ok(Acquisition::Acquired(lease)) = store.acquire(&key, None, lease).await else {
                panic!("fresh key not acquired")
            };
            black_box(store.complete(&lease, b"{\"ok\":true}", retention).await)
        })
    });

    let done = IdempotencyKey::new("bench.dup", "done").unwrap_or_else(|e| panic!("{e}"));
    runtime.block_on(async {
        let Ok(Acquisition::Acquired(l)) = store.acquire(&done, None, lease).await else {
            panic!("not acquired")
        };
        store
            .complete(&l, b"{\"ok\":true}", retention)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    });
    group.bench_function("store: acquire of a completed key (duplicate)", |b| {
        b.to_async(&runtime)
            .iter(|| async { black_box(store.acquire(&done, None, lease).await) })
    });

    let idem = Idempotency::new(MemoryStore::new()).heartbeat(false);
    group.bench_function("process: fresh key, trivial handler", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = fresh_key();
            black_box(
                idem.process(
                    &key,
                    42u64,
                    |n| async move { Ok::<_, std::io::Error>(n + 1) },
                )
                .await,
            )
        })
    });

    let dup = IdempotencyKey::new("bench.dup", "process").unwrap_or_else(|e| panic!("{e}"));
    group.bench_function("process: duplicate, replayed", |b| {
        b.to_async(&runtime).iter(|| async {
            black_box(
                idem.process(
                    &dup,
                    42u64,
                    |n| async move { Ok::<_, std::io::Error>(n + 1) },
                )
                .await,
            )
        })
    });

    let beating = Idempotency::new(MemoryStore::new());
    group.bench_function("process: fresh key, trivial handler, heartbeat on", |b| {
        b.to_async(&runtime).iter(|| async {
            let key = fresh_key();
            black_box(
                beating
                    .process(
                        &key,
                        42u64,
                        |n| async move { Ok::<_, std::io::Error>(n + 1) },
                    )
                    .await,
            )
        })
    });
    group.finish();
}

/// Runs `iters` operations spread over `tasks` tasks and returns the
/// elapsed time, for criterion's `iter_custom`.
async fn concurrently<F, Fut>(tasks: u64, iters: u64, op: F) -> Duration
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let started = std::time::Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let op = op.clone();
            let n = iters / tasks + u64::from(t < iters % tasks);
            tokio::spawn(async move {
                for _ in 0..n {
                    op().await;
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap_or_else(|e| panic!("{e}"));
    }
    started.elapsed()
}

#[cfg(feature = "postgres")]
fn postgres(c: &mut Criterion) {
    use idem::postgres::PgStore;
    use std::sync::Arc;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let store = runtime.block_on(async {
        let store = PgStore::new(support::pg::pool(support::pg::shared_url(), 32).await);
        store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        store
    });
    let lease = Duration::from_secs(60);
    let retention = Duration::from_secs(3600);
    let mut group = c.benchmark_group("postgres");

    let fresh = {
        let store = store.clone();
        move || {
            let store = store.clone();
            async move {
                let key = fresh_key();
                let Ok(Acquisition::Acquired(l)) = store.acquire(&key, None, lease).await else {
                    panic!("fresh key not acquired")
                };
                store
                    .complete(&l, b"{\"ok\":true}", retention)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    };
    let done = IdempotencyKey::new("bench.dup", format!("pg-{}", fastrand::u64(..)))
        .unwrap_or_else(|e| panic!("{e}"));
    runtime.block_on(fresh_with(&store, &done, lease, retention));
    let duplicate = {
        let (store, done) = (store.clone(), done.clone());
        move || {
            let (store, done) = (store.clone(), done.clone());
            async move {
                let got = store.acquire(&done, None, lease).await;
                assert!(matches!(got, Ok(Acquisition::Completed(_))), "{got:?}");
            }
        }
    };

    group.bench_function("store: acquire + complete of a fresh key, c=1", |b| {
        let op = fresh.clone();
        b.to_async(&runtime).iter(&op)
    });
    group.bench_function("store: acquire + complete of a fresh key, c=32", |b| {
        let op = fresh.clone();
        b.to_async(&runtime)
            .iter_custom(|iters| concurrently(32, iters, op.clone()))
    });
    group.bench_function("store: acquire of a completed key (duplicate), c=1", |b| {
        let op = duplicate.clone();
        b.to_async(&runtime).iter(&op)
    });
    group.bench_function("store: acquire of a completed key (duplicate), c=32", |b| {
        let op = duplicate.clone();
        b.to_async(&runtime)
            .iter_custom(|iters| concurrently(32, iters, op.clone()))
    });

    let idem = Arc::new(Idempotency::new(store.clone()).heartbeat(false));
    group.bench_function("process: fresh key, trivial handler, c=1", |b| {
        b.to_async(&runtime).iter(|| {
            let idem = idem.clone();
            async move {
                let key = fresh_key();
                black_box(
                    idem.process(
                        &key,
                        42u64,
                        |n| async move { Ok::<_, std::io::Error>(n + 1) },
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{e}")),
                )
            }
        })
    });
    group.finish();
}

/// Fresh-key and duplicate benches at concurrency 1 and 64 for one store.
#[cfg(feature = "redis")]
fn fresh_and_duplicate<S: IdempotencyStore + Clone>(
    c: &mut Criterion,
    group_name: &str,
    runtime: &tokio::runtime::Runtime,
    store: S,
) {
    let lease = Duration::from_secs(60);
    let retention = Duration::from_secs(3600);
    let mut group = c.benchmark_group(group_name);
    let fresh = {
        let store = store.clone();
        move || {
            let store = store.clone();
            async move {
                let key = fresh_key();
                let Ok(Acquisition::Acquired(l)) = store.acquire(&key, None, lease).await else {
                    panic!("fresh key not acquired")
                };
                store
                    .complete(&l, b"{\"ok\":true}", retention)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    };
    let done = IdempotencyKey::new("bench.dup", format!("{group_name}-{}", fastrand::u64(..)))
        .unwrap_or_else(|e| panic!("{e}"));
    runtime.block_on(fresh_with(&store, &done, lease, retention));
    let duplicate = {
        let (store, done) = (store.clone(), done.clone());
        move || {
            let (store, done) = (store.clone(), done.clone());
            async move {
                let got = store.acquire(&done, None, lease).await;
                assert!(matches!(got, Ok(Acquisition::Completed(_))), "{got:?}");
            }
        }
    };
    group.bench_function("store: acquire + complete of a fresh key, c=1", |b| {
        b.to_async(runtime).iter(&fresh)
    });
    group.bench_function("store: acquire + complete of a fresh key, c=64", |b| {
        b.to_async(runtime)
            .iter_custom(|iters| concurrently(64, iters, fresh.clone()))
    });
    group.bench_function("store: acquire of a completed key (duplicate), c=1", |b| {
        b.to_async(runtime).iter(&duplicate)
    });
    group.bench_function("store: acquire of a completed key (duplicate), c=64", |b| {
        b.to_async(runtime)
            .iter_custom(|iters| concurrently(64, iters, duplicate.clone()))
    });
    group.finish();
}

#[cfg(feature = "redis")]
fn redis(c: &mut Criterion) {
    use idem::redis::RedisStore;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let standalone = runtime.block_on(async {
        RedisStore::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    });
    fresh_and_duplicate(c, "redis", &runtime, standalone);
    let cluster = runtime.block_on(async {
        RedisStore::connect_cluster(
            support::redis_server::shared_cluster()
                .iter()
                .map(String::as_str),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    });
    fresh_and_duplicate(c, "redis-cluster", &runtime, cluster);
}

/// A duplicate answered by each tier of a tiered store, from one run: moka
/// in front; Redis when it is the fastest tier; PostgreSQL with no cache.
#[cfg(all(feature = "tiered", feature = "postgres", feature = "redis"))]
fn tiered(c: &mut Criterion) {
    use idem::postgres::PgStore;
    use idem::tiered::{MokaCache, RedisCache, TieredStore};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let lease = Duration::from_secs(60);
    let retention = Duration::from_secs(3600);
    let (pg, redis) = runtime.block_on(async {
        let pg = PgStore::new(support::pg::pool(support::pg::shared_url(), 8).await);
        pg.migrate().await.unwrap_or_else(|e| panic!("{e}"));
        let redis = RedisCache::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        (pg, redis)
    });
    let stacks = [
        (
            "duplicate answered by moka (moka -> redis -> postgres)",
            TieredStore::new(pg.clone())
                .with_cache(MokaCache::new(100_000, 64 << 20))
                .with_cache(redis.clone()),
        ),
        (
            "duplicate answered by redis (redis -> postgres)",
            TieredStore::new(pg.clone()).with_cache(redis.clone()),
        ),
        (
            "duplicate answered by postgres (no cache tier)",
            TieredStore::new(pg.clone()),
        ),
    ];
    let mut group = c.benchmark_group("tiered");
    for (name, store) in stacks {
        let key = IdempotencyKey::new("bench.tier", format!("{}", fastrand::u64(..)))
            .unwrap_or_else(|e| panic!("{e}"));
        runtime.block_on(fresh_with(&store, &key, lease, retention));
        group.bench_function(name, |b| {
            b.to_async(&runtime).iter(|| async {
                let got = store.acquire(&key, None, lease).await;
                assert!(matches!(got, Ok(Acquisition::Completed(_))), "{got:?}");
            })
        });
    }
    group.finish();
}

#[cfg(not(all(feature = "tiered", feature = "postgres", feature = "redis")))]
fn tiered(_: &mut Criterion) {
    eprintln!("tiered benches skipped: build with --features tiered,postgres,redis");
}

#[cfg(not(feature = "redis"))]
fn redis(_: &mut Criterion) {
    eprintln!("redis benches skipped: build with --features redis");
}

#[cfg(any(feature = "postgres", feature = "redis"))]
async fn fresh_with<S: IdempotencyStore>(
    store: &S,
    key: &IdempotencyKey,
    lease: Duration,
    retention: Duration,
) {
    let Ok(Acquisition::Acquired(l)) = store.acquire(key, None, lease).await else {
        panic!("not acquired")
    };
    store
        .complete(&l, b"{\"ok\":true}", retention)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[cfg(not(feature = "postgres"))]
fn postgres(_: &mut Criterion) {
    eprintln!("postgres benches skipped: build with --features postgres");
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = memory, postgres, redis, tiered
}
criterion_main!(benches);
