//! Criterion benches of the facade: the same benches for every backend, one
//! group per backend. Each bench name says what one iteration does.
//!
//! ```text
//! cargo bench --features postgres,redis --bench backends              # everything
//! cargo bench --features postgres,redis --bench backends -- redis/    # one group
//! ```
//!
//! Server backends use the servers of `tests/support`: a PostgreSQL, a Redis
//! and a 3-master Redis Cluster of their own on free loopback ports, or the
//! ones in `IDEM_POSTGRES_URL`, `IDEM_REDIS_URL` and
//! `IDEM_REDIS_CLUSTER_URLS`. Benches named `c=64` run 64 tasks at once and
//! report the time per operation (ops/s = 1 / time); `contention` benches
//! report the time for one round of 64 tasks delivering one new key.
//! The `*-batch` groups deliver batches of 100 keys (`acquire_many` +
//! `complete_many`, `process_batch`) and report keys/s (criterion's
//! element throughput); `c=8` runs 8 tasks at once.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
#[cfg(any(feature = "postgres", feature = "redis"))]
#[path = "../tests/support/mod.rs"]
mod support;
use idemkit::{
    AcquireItem, Acquisition, IdemError, Idempotency, IdempotencyKey, IdempotencyStore,
    InProgressPolicy, MemoryStore, Processed,
};
use tokio::runtime::Runtime;

const LEASE: Duration = Duration::from_secs(60);
const RETENTION: Duration = Duration::from_secs(3600);
const TASKS: u64 = 64;

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A key no earlier run used (the servers may be shared between runs).
fn fresh_key(scope: &str) -> IdempotencyKey {
    static RUN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let run = RUN.get_or_init(|| fastrand::u64(..));
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    IdempotencyKey::new(scope, format!("{run:x}-{id}")).unwrap_or_else(|e| panic!("{e}"))
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Every sample runs the same number of iterations, enough for 64 tasks to
/// do many each: criterion's default (1, 2, 3... iterations per sample)
/// would measure little but spawning and draining 64 tasks.
fn flat(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    group.sampling_mode(SamplingMode::Flat).sample_size(20);
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

async fn acquire_and_complete<S: IdempotencyStore + ?Sized>(store: &S, key: &IdempotencyKey) {
    let Ok(Acquisition::Acquired(l)) = store.acquire(key, None, LEASE).await else {
        panic!("fresh key not acquired")
    };
    store
        .complete(&l, b"43", RETENTION)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The benches every store gets: fresh and duplicate through the store at
/// c=1 and c=64, the whole `process` path, and 64 tasks on one key.
fn store_benches(
    c: &mut Criterion,
    group_name: &str,
    runtime: &Runtime,
    store: Arc<dyn IdempotencyStore>,
) {
    let mut group = c.benchmark_group(group_name);
    flat(&mut group);
    let fresh = {
        let store = store.clone();
        move || {
            let store = store.clone();
            async move { acquire_and_complete(&*store, &fresh_key("bench.fresh")).await }
        }
    };
    let done = fresh_key("bench.dup");
    runtime.block_on(acquire_and_complete(&*store, &done));
    let duplicate = {
        let (store, done) = (store.clone(), done.clone());
        move || {
            let (store, done) = (store.clone(), done.clone());
            async move {
                let got = store.acquire(&done, None, LEASE).await;
                assert!(matches!(got, Ok(Acquisition::Completed(_))), "{got:?}");
            }
        }
    };
    group.bench_function("store: acquire + complete of a fresh key, c=1", |b| {
        b.to_async(runtime).iter(&fresh)
    });
    group.bench_function("store: acquire + complete of a fresh key, c=64", |b| {
        b.to_async(runtime)
            .iter_custom(|iters| concurrently(TASKS, iters, fresh.clone()))
    });
    group.bench_function("store: acquire of a completed key (duplicate), c=1", |b| {
        b.to_async(runtime).iter(&duplicate)
    });
    group.bench_function("store: acquire of a completed key (duplicate), c=64", |b| {
        b.to_async(runtime)
            .iter_custom(|iters| concurrently(TASKS, iters, duplicate.clone()))
    });

    let idem: Idempotency<dyn IdempotencyStore> = Idempotency::from_arc(store.clone())
        .lease(LEASE)
        .retention(RETENTION)
        .on_in_progress(InProgressPolicy::Reject);
    group.bench_function("process: fresh key, trivial handler, c=1", |b| {
        b.to_async(runtime).iter(|| async {
            let out = idem
                .process(&fresh_key("bench.process"), &42u64, |n| async move {
                    Ok::<_, std::io::Error>(n + 1)
                })
                .await;
            assert!(matches!(out, Ok(Processed::Executed(43))), "{out:?}");
        })
    });
    let replayed = fresh_key("bench.process");
    runtime.block_on(async {
        let out = idem
            .process(&replayed, &42u64, |n| async move {
                Ok::<_, std::io::Error>(n + 1)
            })
            .await;
        assert!(matches!(out, Ok(Processed::Executed(43))), "{out:?}");
    });
    group.bench_function("process: duplicate, replayed, c=1", |b| {
        b.to_async(runtime).iter(|| async {
            let out = idem
                .process(&replayed, &42u64, |n| async move {
                    Ok::<_, std::io::Error>(n + 1)
                })
                .await;
            assert!(matches!(out, Ok(Processed::Replayed(43))), "{out:?}");
        })
    });
    group.bench_function(
        "contention: 64 tasks process one fresh key at once (one round)",
        |b| {
            b.to_async(runtime).iter(|| {
                let idem = idem.clone();
                async move { black_box(contended_round(idem).await) }
            })
        },
    );
    group.finish();
}

/// Keys per batch in the `*-batch` groups.
const BATCH: u64 = 100;
/// Tasks of the `c=8` batch benches.
const BATCH_TASKS: u64 = 8;

fn fresh_keys(scope: &str) -> Vec<IdempotencyKey> {
    (0..BATCH).map(|_| fresh_key(scope)).collect()
}

/// One batch of fresh keys: `acquire_many`, then `complete_many`.
async fn acquire_and_complete_many<S: IdempotencyStore + ?Sized>(
    store: &S,
    keys: &[IdempotencyKey],
) {
    let items: Vec<AcquireItem<'_>> = keys.iter().map(|k| AcquireItem::new(k, None)).collect();
    let got = store
        .acquire_many(&items, LEASE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let leases: Vec<idemkit::Lease> = got
        .into_iter()
        .map(|o| match o {
            Ok(Acquisition::Acquired(l)) => l,
            other => panic!("fresh key not acquired: {other:?}"),
        })
        .collect();
    let done: Vec<(&idemkit::Lease, &[u8])> =
        leases.iter().map(|l| (l, b"43".as_slice())).collect();
    let completed = store
        .complete_many(&done, RETENTION)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(completed.iter().all(Result::is_ok), "{completed:?}");
}

/// The batch operations: 100 keys per iteration, fresh or completed,
/// through the store and through `process_batch`, at c=1 and c=8.
fn batch_benches(
    c: &mut Criterion,
    group_name: &str,
    runtime: &Runtime,
    store: Arc<dyn IdempotencyStore>,
) {
    let mut group = c.benchmark_group(format!("{group_name}-batch"));
    flat(&mut group);
    group.throughput(Throughput::Elements(BATCH));
    let fresh = {
        let store = store.clone();
        move || {
            let store = store.clone();
            async move { acquire_and_complete_many(&*store, &fresh_keys("bench.batch")).await }
        }
    };
    let done = fresh_keys("bench.batch-dup");
    runtime.block_on(acquire_and_complete_many(&*store, &done));
    let done = Arc::new(done);
    let duplicate = {
        let (store, done) = (store.clone(), done.clone());
        move || {
            let (store, done) = (store.clone(), done.clone());
            async move {
                let items: Vec<AcquireItem<'_>> =
                    done.iter().map(|k| AcquireItem::new(k, None)).collect();
                let got = store
                    .acquire_many(&items, LEASE)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                assert!(got
                    .iter()
                    .all(|o| matches!(o, Ok(Acquisition::Completed(_)))));
            }
        }
    };
    group.bench_function(
        "store: acquire_many + complete_many of 100 fresh keys, c=1",
        |b| b.to_async(runtime).iter(&fresh),
    );
    group.bench_function(
        "store: acquire_many + complete_many of 100 fresh keys, c=8",
        |b| {
            b.to_async(runtime)
                .iter_custom(|iters| concurrently(BATCH_TASKS, iters, fresh.clone()))
        },
    );
    group.bench_function(
        "store: acquire_many of 100 completed keys (duplicates), c=1",
        |b| b.to_async(runtime).iter(&duplicate),
    );
    group.bench_function(
        "store: acquire_many of 100 completed keys (duplicates), c=8",
        |b| {
            b.to_async(runtime)
                .iter_custom(|iters| concurrently(BATCH_TASKS, iters, duplicate.clone()))
        },
    );
    let idem: Idempotency<dyn IdempotencyStore> = Idempotency::from_arc(store.clone())
        .lease(LEASE)
        .retention(RETENTION)
        .on_in_progress(InProgressPolicy::Reject);
    group.bench_function("process_batch: 100 fresh keys, trivial handler, c=1", |b| {
        b.to_async(runtime).iter(|| async {
            let out = idem
                .process_batch(
                    fresh_keys("bench.batch-process")
                        .into_iter()
                        .map(|k| (k, 42u64)),
                    |n| async move { Ok::<_, std::io::Error>(n + 1) },
                )
                .await;
            assert!(out.iter().all(|o| matches!(o, Ok(Processed::Executed(43)))));
        })
    });
    let replayed = fresh_keys("bench.batch-process");
    runtime.block_on(async {
        let out = idem
            .process_batch(
                replayed.iter().cloned().map(|k| (k, 42u64)),
                |n| async move { Ok::<_, std::io::Error>(n + 1) },
            )
            .await;
        assert!(out.iter().all(|o| matches!(o, Ok(Processed::Executed(43)))));
    });
    group.bench_function("process_batch: 100 duplicates, replayed, c=1", |b| {
        b.to_async(runtime).iter(|| async {
            let out = idem
                .process_batch(
                    replayed.iter().cloned().map(|k| (k, 42u64)),
                    |n| async move { Ok::<_, std::io::Error>(n + 1) },
                )
                .await;
            assert!(out.iter().all(|o| matches!(o, Ok(Processed::Replayed(43)))));
        })
    });
    group.finish();
}

/// 64 tasks deliver one new key at once; exactly one runs the handler, the
/// others are told it is in progress or get the replay.
async fn contended_round(idem: Idempotency<dyn IdempotencyStore>) -> u64 {
    let key = fresh_key("bench.contended");
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (idem, key) = (idem.clone(), key.clone());
            tokio::spawn(async move {
                match idem
                    .process(
                        &key,
                        &42u64,
                        |n| async move { Ok::<_, std::io::Error>(n + 1) },
                    )
                    .await
                {
                    Ok(Processed::Executed(_)) | Ok(Processed::ExecutedNotReplayable { .. }) => 1,
                    Ok(Processed::Replayed(_)) | Err(IdemError::InProgress { .. }) => 0,
                    Err(e) => panic!("{e}"),
                }
            })
        })
        .collect();
    let mut executed = 0;
    for task in tasks {
        executed += task.await.unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(executed, 1, "one of the 64 deliveries executes");
    executed
}

fn memory(c: &mut Criterion) {
    let runtime = runtime();
    store_benches(c, "memory", &runtime, Arc::new(MemoryStore::new()));
    batch_benches(c, "memory", &runtime, Arc::new(MemoryStore::new()));
}

#[cfg(feature = "postgres")]
async fn pg_store(connections: usize) -> idemkit::postgres::PgStore {
    let pool = support::pg::pool(support::pg::shared_url(), connections as u32).await;
    let store = idemkit::postgres::PgStore::builder(pool)
        .connections(connections)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

#[cfg(feature = "postgres")]
fn postgres(c: &mut Criterion) {
    let runtime = runtime();
    let store = runtime.block_on(pg_store(TASKS as usize));
    store_benches(c, "postgres", &runtime, Arc::new(store.clone()));
    batch_benches(c, "postgres", &runtime, Arc::new(store.clone()));
    postgres_in_transaction(c, &runtime, store);
}

/// The in-transaction mode: one transaction per delivery (BEGIN, claim,
/// complete, COMMIT; a duplicate: BEGIN, claim, ROLLBACK).
#[cfg(feature = "postgres")]
fn postgres_in_transaction(
    c: &mut Criterion,
    runtime: &Runtime,
    store: idemkit::postgres::PgStore,
) {
    use idemkit::postgres::Claim;
    let deliver = |store: idemkit::postgres::PgStore, key: IdempotencyKey| async move {
        let mut tx = store.pool().begin().await.unwrap_or_else(|e| panic!("{e}"));
        match store
            .in_transaction()
            .claim::<_, u64>(&mut tx, &key, &42u64)
            .await
        {
            Ok(Claim::Acquired(lease)) => {
                lease
                    .complete(&mut tx, &43u64)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
                1u64
            }
            Ok(Claim::Replayed(n)) => {
                assert_eq!(n, 43);
                tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
                0
            }
            Err(e) => panic!("{e}"),
        }
    };
    let mut group = c.benchmark_group("postgres-in-transaction");
    flat(&mut group);
    group.bench_function("claim + complete + commit of a fresh key, c=1", |b| {
        b.to_async(runtime).iter(|| {
            let store = store.clone();
            async move { assert_eq!(deliver(store, fresh_key("bench.tx")).await, 1) }
        })
    });
    group.bench_function("claim + complete + commit of a fresh key, c=64", |b| {
        let store = store.clone();
        b.to_async(runtime).iter_custom(move |iters| {
            let store = store.clone();
            concurrently(TASKS, iters, move || {
                let store = store.clone();
                async move { assert_eq!(deliver(store, fresh_key("bench.tx")).await, 1) }
            })
        })
    });
    let done = fresh_key("bench.tx");
    runtime.block_on(deliver(store.clone(), done.clone()));
    group.bench_function(
        "claim of a completed key (duplicate) + rollback, c=1",
        |b| {
            b.to_async(runtime).iter(|| {
                let (store, done) = (store.clone(), done.clone());
                async move { assert_eq!(deliver(store, done).await, 0) }
            })
        },
    );
    group.bench_function(
        "claim of a completed key (duplicate) + rollback, c=64",
        |b| {
            let (store, done) = (store.clone(), done.clone());
            b.to_async(runtime).iter_custom(move |iters| {
                let (store, done) = (store.clone(), done.clone());
                concurrently(TASKS, iters, move || {
                    let (store, done) = (store.clone(), done.clone());
                    async move { assert_eq!(deliver(store, done).await, 0) }
                })
            })
        },
    );
    group.bench_function(
        "contention: 64 transactions claim one fresh key at once (one round)",
        |b| {
            b.to_async(runtime).iter(|| {
                let store = store.clone();
                async move {
                    let key = fresh_key("bench.tx-contended");
                    let tasks: Vec<_> = (0..TASKS)
                        .map(|_| tokio::spawn(deliver(store.clone(), key.clone())))
                        .collect();
                    let mut executed = 0;
                    for t in tasks {
                        executed += t.await.unwrap_or_else(|e| panic!("{e}"));
                    }
                    assert_eq!(executed, 1, "one of the 64 transactions executes");
                }
            })
        },
    );
    group.finish();
}

#[cfg(feature = "redis")]
fn redis(c: &mut Criterion) {
    use idemkit::redis::RedisStore;
    let runtime = runtime();
    let standalone = runtime.block_on(async {
        RedisStore::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    });
    store_benches(c, "redis", &runtime, Arc::new(standalone.clone()));
    batch_benches(c, "redis", &runtime, Arc::new(standalone));
    let cluster = runtime.block_on(async {
        RedisStore::connect_cluster(
            support::redis_server::shared_cluster()
                .iter()
                .map(String::as_str),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    });
    store_benches(c, "redis-cluster", &runtime, Arc::new(cluster));
}

/// A duplicate answered by each tier of a tiered store: moka in front;
/// Redis when it is the fastest tier; PostgreSQL with no cache tier. Then
/// the whole benches on moka -> Redis -> PostgreSQL.
#[cfg(all(feature = "tiered", feature = "postgres", feature = "redis"))]
fn tiered(c: &mut Criterion) {
    use idemkit::tiered::{MokaCache, RedisCache, TieredStore};
    let runtime = runtime();
    let (pg, redis) = runtime.block_on(async {
        let pg = pg_store(TASKS as usize).await;
        let redis = RedisCache::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        (pg, redis)
    });
    let full = || {
        TieredStore::new(pg.clone())
            .with_cache(MokaCache::new(100_000, 64 << 20))
            .with_cache(redis.clone())
    };
    let stacks = [
        (
            "duplicate answered by moka (moka -> redis -> postgres)",
            full(),
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
    let mut group = c.benchmark_group("tiered-hit");
    for (name, store) in stacks {
        let key = fresh_key("bench.tier");
        runtime.block_on(acquire_and_complete(&store, &key));
        group.bench_function(name, |b| {
            b.to_async(&runtime).iter(|| async {
                let got = store.acquire(&key, None, LEASE).await;
                assert!(matches!(got, Ok(Acquisition::Completed(_))), "{got:?}");
            })
        });
    }
    group.finish();
    store_benches(c, "tiered", &runtime, Arc::new(full()));
}

#[cfg(not(all(feature = "tiered", feature = "postgres", feature = "redis")))]
fn tiered(_: &mut Criterion) {
    eprintln!("tiered benches skipped: build with --features tiered,postgres,redis");
}

#[cfg(not(feature = "redis"))]
fn redis(_: &mut Criterion) {
    eprintln!("redis benches skipped: build with --features redis");
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
