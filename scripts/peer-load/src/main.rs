//! The peer's side of `scripts/peer`: drives the `idempotent` crate's
//! Valkey store the way `examples/load.rs --via store` drives idem's
//! RedisStore, and prints the same one-line format.
//!
//! ```text
//! peer-load --redis-url redis://127.0.0.1:6379 --mix duplicate --concurrency 64 --seconds 10
//! ```
//!
//! - `fresh`: `try_insert` of a new key, then `complete` with the response.
//! - `duplicate`: `try_insert` of one of 1,024 keys completed before the
//!   run, answered with the recorded entry (which is checked against the
//!   request's fingerprint, as a replay must).
//!
//! Each operation's latency goes into a histogram, as in the load command,
//! so both sides do the same bookkeeping per operation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use idempotent::valkey::ValkeyStore;
use idempotent::{
    CachedResponse, FencedOutcome, Fingerprint, IdempotencyEntry,
    IdempotencyKey, IdempotencyStore, InsertResult, Metadata,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const LEASE: Duration = Duration::from_secs(60);
const RETENTION: Duration = Duration::from_secs(3600);
const DUPLICATE_KEYS: u64 = 1024;

struct Args {
    redis_url: String,
    mix: String,
    concurrency: usize,
    seconds: f64,
    warmup: f64,
    response_bytes: usize,
}

fn parse() -> Result<Args, BoxError> {
    let mut args = Args {
        redis_url: std::env::var("IDEM_REDIS_URL").unwrap_or_default(),
        mix: "fresh".into(),
        concurrency: 64,
        seconds: 10.0,
        warmup: 1.0,
        response_bytes: 200,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--redis-url" => args.redis_url = value,
            "--mix" => args.mix = value,
            "--concurrency" => args.concurrency = value.parse()?,
            "--seconds" => args.seconds = value.parse()?,
            "--warmup" => args.warmup = value.parse()?,
            "--response-bytes" => args.response_bytes = value.parse()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if args.redis_url.is_empty() {
        return Err("--redis-url (or IDEM_REDIS_URL) is required".into());
    }
    if args.mix != "fresh" && args.mix != "duplicate" {
        return Err("--mix is fresh or duplicate".into());
    }
    if args.concurrency == 0 {
        return Err("--concurrency must be at least 1".into());
    }
    Ok(args)
}

struct Run {
    store: ValkeyStore,
    run: String,
    next: AtomicU64,
    fingerprint: Fingerprint,
    body: Bytes,
}

impl Run {
    fn key(&self, n: u64) -> IdempotencyKey {
        IdempotencyKey::new(format!("load.{}-{n}", self.run))
            .unwrap_or_else(|e| panic!("generated key: {e}"))
    }

    /// One delivery: true when it executed, false when it replayed.
    async fn deliver(&self, key: &IdempotencyKey) -> Result<bool, BoxError> {
        let entry = IdempotencyEntry::new(self.fingerprint, LEASE);
        match self.store.try_insert(key, entry.clone()).await? {
            InsertResult::Claimed { fencing_token } => {
                let response = CachedResponse::new(200, Metadata::default(), self.body.clone());
                match self
                    .store
                    .complete(key, entry.complete(response, RETENTION), fencing_token)
                    .await?
                {
                    FencedOutcome::Applied => Ok(true),
                    other => Err(format!("complete: {other:?}").into()),
                }
            }
            InsertResult::Exists(existing) => match existing.replay(self.fingerprint) {
                idempotent::ReplayOutcome::Replayed(_) => Ok(false),
                other => Err(format!("replay: {other:?}").into()),
            },
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = parse()?;
    let store = ValkeyStore::with_url(args.redis_url.clone())
        .prefix("peer")
        .try_build()
        .await?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let run = Arc::new(Run {
        store,
        run: format!("{nanos}"),
        next: AtomicU64::new(DUPLICATE_KEYS),
        fingerprint: Fingerprint::new(0x5eed_u128 << 64 | 42),
        body: Bytes::from(vec![b'x'; args.response_bytes]),
    });
    if args.mix == "duplicate" {
        for n in 0..DUPLICATE_KEYS {
            run.deliver(&run.key(n)).await?;
        }
    }
    if args.warmup > 0.0 {
        phase(&run, &args, args.warmup).await?;
    }
    let started = Instant::now();
    let (ops, executed, replayed, latency) = phase(&run, &args, args.seconds).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let us = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "load backend=peer via=store mix={} concurrency={} seconds={elapsed:.2} ops={ops} ops_per_sec={:.0} p50_us={:.1} p99_us={:.1} executed={executed} replayed={replayed} errors=0",
        args.mix,
        args.concurrency,
        ops as f64 / elapsed,
        us(0.5),
        us(0.99),
    );
    Ok(())
}

fn histogram() -> Histogram<u64> {
    // nanoseconds, 3 significant digits, up to 100 s (as the load command)
    Histogram::new_with_bounds(1, 100_000_000_000, 3).unwrap_or_else(|e| panic!("histogram: {e}"))
}

async fn phase(
    run: &Arc<Run>,
    args: &Args,
    seconds: f64,
) -> Result<(u64, u64, u64, Histogram<u64>), BoxError> {
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let fresh = args.mix == "fresh";
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|t| {
            let run = run.clone();
            tokio::spawn(async move {
                let (mut executed, mut replayed) = (0u64, 0u64);
                let mut latency = histogram();
                let mut n = t as u64 % DUPLICATE_KEYS;
                while Instant::now() < deadline {
                    let key = if fresh {
                        run.key(run.next.fetch_add(1, Ordering::Relaxed))
                    } else {
                        n = (n + 1) % DUPLICATE_KEYS;
                        run.key(n)
                    };
                    let started = Instant::now();
                    let fresh = run.deliver(&key).await?;
                    let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    latency.saturating_record(nanos.max(1));
                    if fresh {
                        executed += 1;
                    } else {
                        replayed += 1;
                    }
                }
                Ok::<_, BoxError>((executed, replayed, latency))
            })
        })
        .collect();
    let (mut executed, mut replayed, mut latency) = (0, 0, histogram());
    for task in tasks {
        let (e, r, l) = task.await??;
        executed += e;
        replayed += r;
        latency.add(&l)?;
    }
    Ok((executed + replayed, executed, replayed, latency))
}
