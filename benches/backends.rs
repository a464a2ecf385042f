//! Criterion benches of the facade, one group per backend. Each bench name
//! says what one iteration does.
//!
//! ```text
//! cargo bench --bench backends
//! ```

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
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

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = memory
}
criterion_main!(benches);
