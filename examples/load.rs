//! The load command: drives one backend from many tasks for a fixed time
//! and prints one line per run with ops/s and latency percentiles.
//!
//! ```text
//! cargo run --release --features redis --example load -- --backend redis --concurrency 64 --seconds 10 --mix fresh
//! ```
//!
//! Output (one line, `name=value` pairs, stable for scripts):
//!
//! ```text
//! load backend=redis via=process mix=fresh concurrency=64 batch=1 seconds=10.00 ops=412345 ops_per_sec=41234 p50_us=1480.1 p99_us=3010.5 p999_us=4020.2 max_us=9001.0 executed=412345 replayed=0 in_progress=0 errors=0
//! ```
//!
//! Mixes:
//! - `fresh`: every operation is a new key (acquire, handler, complete:
//!   2 round trips to the store).
//! - `duplicate`: every operation is a delivery of one of 1,024 keys
//!   completed before the run (one acquire, answered with the recorded
//!   response: 1 round trip).
//! - `contended`: rounds in which all tasks deliver the same new key at
//!   once; one executes, the others are told it is in progress or get the
//!   replay. An operation is one delivery.
//!
//! `--via process` (the default) goes through `Idempotency::process` with
//! its default settings (heartbeat on, JSON codec, payload fingerprint);
//! `--via store` calls the store's `acquire` and `complete` directly.
//! `--backend postgres-tx` runs each delivery in its own transaction with
//! the in-transaction mode (BEGIN, claim, complete, COMMIT).
//!
//! `--batch N` (default 1) makes every operation of a task a batch of N
//! keys (a broker poll): through `Idempotency::process_batch` (`--via
//! process`) or the store's `acquire_many` then `complete_many` (`--via
//! store`). `ops` and `ops_per_sec` then count keys, and the latency
//! percentiles are those of whole batches. A `contended` round delivers the
//! same N new keys from every task.
//!
//! `--batching off` turns off the Redis and PostgreSQL stores' natural
//! batching (concurrent single calls sent together while one is in
//! flight), `--batching on` turns it on where the store's default is off
//! (Redis Cluster); `--batch-in-flight N` lets N batched calls of each kind
//! run at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use idemkit::{
    AcquireItem, Acquisition, Fingerprint, IdemError, Idempotency, IdempotencyKey,
    IdempotencyStore, InProgressPolicy, MemoryStore, Processed,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// In-process MemoryStore.
    Memory,
    /// PgStore on --postgres-url.
    Postgres,
    /// PgStore's in-transaction mode on --postgres-url, one transaction per delivery.
    PostgresTx,
    /// RedisStore on --redis-url.
    Redis,
    /// RedisStore on the Redis Cluster of --redis-cluster-urls.
    RedisCluster,
    /// TieredStore: moka, then Redis, then PostgreSQL (duplicates answered by moka).
    Tiered,
    /// TieredStore: a Redis cache tier, then PostgreSQL (duplicates answered by Redis).
    TieredRedis,
    /// TieredStore with no cache tier (duplicates answered by PostgreSQL).
    TieredPostgres,
    /// DynamoDbStore on --dynamodb-url (moto, DynamoDB Local).
    Dynamodb,
    /// TieredStore: moka, then DynamoDB (duplicates answered by moka).
    TieredDynamodb,
    /// No idem: the same conditional PutItem the store's acquire sends,
    /// from the bare SDK (a fresh key written, a duplicate refused with
    /// the old item), the floor the store is compared with.
    DynamodbBare,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mix {
    /// A new key per operation.
    Fresh,
    /// Deliveries of keys completed before the run.
    Duplicate,
    /// All tasks deliver the same new key at once, round after round.
    Contended,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Via {
    /// `Idempotency::process` with a trivial handler.
    Process,
    /// The store's `acquire` (and `complete`) called directly.
    Store,
}

#[derive(Debug, Parser)]
#[command(about = "Drives one idem backend and prints ops/s and latency percentiles")]
struct Args {
    #[arg(long, value_enum, default_value = "memory")]
    backend: Backend,
    #[arg(long, value_enum, default_value = "fresh")]
    mix: Mix,
    #[arg(long, value_enum, default_value = "process")]
    via: Via,
    /// Concurrent tasks.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Keys per operation: 1 delivers one key at a time; more delivers
    /// batches through process_batch or acquire_many + complete_many.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Measured seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Unmeasured seconds before the measurement.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Size of the recorded response in bytes (the peer comparison uses
    /// 200): `--via store` completes with that many bytes, `--via process`
    /// returns a string whose JSON is that long.
    #[arg(long, default_value_t = 2)]
    response_bytes: usize,
    /// Natural batching of concurrent single calls in the Redis and
    /// PostgreSQL stores: each store's default (on, but off on Redis
    /// Cluster), on or off.
    #[arg(long, value_enum, default_value = "default")]
    batching: Batch,
    /// Batched calls of each kind in flight at once (default: the
    /// store's: 4 on Redis, 2 on PostgreSQL, 1 on Redis Cluster).
    #[arg(long)]
    batch_in_flight: Option<usize>,
    /// PgStore's own connections (default: the store's default, 4; the
    /// callers queue for them).
    #[arg(long)]
    pg_connections: Option<usize>,
    /// Runtime worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long, env = "IDEM_POSTGRES_URL")]
    postgres_url: Option<String>,
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: Option<String>,
    /// Comma-separated node URLs of a Redis Cluster.
    #[arg(long, env = "IDEM_REDIS_CLUSTER_URLS")]
    redis_cluster_urls: Option<String>,
    /// A DynamoDB endpoint (moto's server mode, DynamoDB Local).
    #[arg(long, env = "IDEM_MOTO_URL")]
    dynamodb_url: Option<String>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A store's batching: its own default, on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Batch {
    Default,
    On,
    Off,
}

/// The stores' batching, as the flags ask: the store's own default, or on
/// (the store's default, `Batching::default()` where that is off), or off;
/// with `--batch-in-flight`.
fn batching(args: &Args, default: idemkit::Batching) -> idemkit::Batching {
    let batching = match args.batching {
        Batch::Off => return idemkit::Batching::off(),
        Batch::On if !default.is_on() => idemkit::Batching::default(),
        Batch::On | Batch::Default => default,
    };
    if !batching.is_on() {
        return batching;
    }
    match args.batch_in_flight {
        Some(n) => batching.in_flight(n),
        None => batching,
    }
}

/// What a delivery got.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Executed,
    Replayed,
    InProgress,
}

/// What the tasks drive.
#[derive(Clone)]
enum Target {
    Store(
        Arc<dyn IdempotencyStore>,
        Arc<Idempotency<dyn IdempotencyStore>>,
        Arc<Response>,
    ),
    #[cfg(feature = "postgres")]
    PgTx(idemkit::postgres::PgStore),
    #[cfg(feature = "dynamodb")]
    Bare(idemkit::dynamodb::aws_sdk_dynamodb::Client),
}

/// What a delivery records: the raw bytes (`--via store`, with the
/// fingerprint of the payload, as `process` sends it) or the handler's
/// string (`--via process`).
struct Response {
    bytes: Vec<u8>,
    text: String,
    fingerprint: Fingerprint,
}

impl Response {
    fn new(size: usize) -> Result<Self, BoxError> {
        Ok(Response {
            bytes: vec![b'x'; size],
            text: "x".repeat(size.saturating_sub(2)),
            fingerprint: Fingerprint::of(&42u64)?,
        })
    }
}

const LEASE: Duration = Duration::from_secs(60);
const RETENTION: Duration = Duration::from_secs(3600);
const DUPLICATE_KEYS: u64 = 1024;

impl Target {
    async fn deliver(&self, via: Via, key: &IdempotencyKey) -> Result<Outcome, BoxError> {
        match self {
            Target::Store(store, idem, response) => match via {
                Via::Process => {
                    let text = response.text.clone();
                    let out = idem
                        .process(
                            key,
                            &42u64,
                            |_| async move { Ok::<_, std::io::Error>(text) },
                        )
                        .await;
                    match out {
                        Ok(Processed::Executed(_))
                        | Ok(Processed::ExecutedNotReplayable { .. }) => Ok(Outcome::Executed),
                        Ok(Processed::Replayed(_)) => Ok(Outcome::Replayed),
                        Err(IdemError::InProgress { .. }) => Ok(Outcome::InProgress),
                        Err(e) => Err(e.into()),
                    }
                }
                Via::Store => match store
                    .acquire(key, Some(&response.fingerprint), LEASE)
                    .await?
                {
                    Acquisition::Acquired(lease) => {
                        store.complete(&lease, &response.bytes, RETENTION).await?;
                        Ok(Outcome::Executed)
                    }
                    Acquisition::Completed(_) => Ok(Outcome::Replayed),
                    Acquisition::InProgress { .. } => Ok(Outcome::InProgress),
                    other => Err(format!("unexpected {other:?}").into()),
                },
            },
            #[cfg(feature = "postgres")]
            Target::PgTx(store) => {
                use idemkit::postgres::Claim;
                let mut tx = store.pool().begin().await?;
                let fingerprint = Fingerprint::of(&42u64)?;
                match store
                    .in_transaction()
                    .retention(RETENTION)
                    .claim_with::<u64>(&mut tx, key, Some(fingerprint))
                    .await?
                {
                    Claim::Acquired(lease) => {
                        lease.complete(&mut tx, &43u64).await?;
                        tx.commit().await?;
                        Ok(Outcome::Executed)
                    }
                    Claim::Replayed(_) => {
                        tx.rollback().await?;
                        Ok(Outcome::Replayed)
                    }
                }
            }
            #[cfg(feature = "dynamodb")]
            Target::Bare(client) => bare_put(client, key).await,
        }
    }
}

/// The conditional `PutItem` of a fresh acquire, from the bare SDK: a new
/// key is written, an existing one refused with its old item returned.
#[cfg(feature = "dynamodb")]
async fn bare_put(
    client: &idemkit::dynamodb::aws_sdk_dynamodb::Client,
    key: &IdempotencyKey,
) -> Result<Outcome, BoxError> {
    use idemkit::dynamodb::aws_sdk_dynamodb::error::ProvideErrorMetadata;
    use idemkit::dynamodb::aws_sdk_dynamodb::primitives::Blob;
    use idemkit::dynamodb::aws_sdk_dynamodb::types::{
        AttributeValue, ReturnValuesOnConditionCheckFailure,
    };
    let pk = format!("bare/{}/{}", key.scope(), key.id());
    let sent = client
        .put_item()
        .table_name(DYNAMODB_TABLE)
        .item("pk", AttributeValue::S(pk))
        .item("st", AttributeValue::S("p".into()))
        .item("tk", AttributeValue::B(Blob::new(vec![7u8; 16])))
        .item("fp", AttributeValue::B(Blob::new(vec![9u8; 32])))
        .item("le", AttributeValue::N("1763859000123".into()))
        .item("ex", AttributeValue::N("1763945400123".into()))
        .condition_expression("attribute_not_exists(#pk)")
        .expression_attribute_names("#pk", "pk")
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await;
    match sent {
        Ok(_) => Ok(Outcome::Executed),
        Err(e) if e.code() == Some("ConditionalCheckFailedException") => Ok(Outcome::Replayed),
        Err(e) => Err(e.into()),
    }
}

/// The table the DynamoDB backends use (made if missing).
#[cfg(feature = "dynamodb")]
const DYNAMODB_TABLE: &str = "idem_load";

impl Target {
    /// Delivers a batch of keys in one operation; one outcome per key.
    async fn deliver_batch(
        &self,
        via: Via,
        keys: Vec<IdempotencyKey>,
    ) -> Result<Vec<Result<Outcome, BoxError>>, BoxError> {
        // Irrefutable in a build without postgres and dynamodb.
        #[allow(irrefutable_let_patterns)]
        let Target::Store(store, idem, response) = self
        else {
            return Err("--batch needs a store backend (not postgres-tx or dynamodb-bare)".into());
        };
        match via {
            Via::Process => {
                let text = &response.text;
                let out = idem
                    .process_batch(keys.into_iter().map(|k| (k, 42u64)), |_| async move {
                        Ok::<_, std::io::Error>(text.clone())
                    })
                    .await;
                Ok(out
                    .into_iter()
                    .map(|o| match o {
                        Ok(Processed::Executed(_))
                        | Ok(Processed::ExecutedNotReplayable { .. }) => Ok(Outcome::Executed),
                        Ok(Processed::Replayed(_)) => Ok(Outcome::Replayed),
                        Err(IdemError::InProgress { .. }) => Ok(Outcome::InProgress),
                        Err(e) => Err(e.into()),
                    })
                    .collect())
            }
            Via::Store => {
                let items: Vec<AcquireItem<'_>> = keys
                    .iter()
                    .map(|k| AcquireItem::new(k, Some(&response.fingerprint)))
                    .collect();
                let got = store.acquire_many(&items, LEASE).await?;
                let mut out: Vec<Result<Outcome, BoxError>> = Vec::with_capacity(got.len());
                let mut leases = Vec::new();
                for (i, outcome) in got.into_iter().enumerate() {
                    out.push(match outcome {
                        Ok(Acquisition::Acquired(lease)) => {
                            leases.push((i, lease));
                            Ok(Outcome::Executed)
                        }
                        Ok(Acquisition::Completed(_)) => Ok(Outcome::Replayed),
                        Ok(Acquisition::InProgress { .. }) => Ok(Outcome::InProgress),
                        other => Err(format!("unexpected {other:?}").into()),
                    });
                }
                if !leases.is_empty() {
                    let done: Vec<(&idemkit::Lease, &[u8])> = leases
                        .iter()
                        .map(|(_, l)| (l, response.bytes.as_slice()))
                        .collect();
                    let completed = store.complete_many(&done, RETENTION).await?;
                    for ((i, _), c) in leases.iter().zip(completed) {
                        if let Err(e) = c {
                            out[*i] = Err(e.into());
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// Counts and latencies of one task.
struct Tally {
    latency: Histogram<u64>,
    executed: u64,
    replayed: u64,
    in_progress: u64,
    errors: u64,
}

impl Tally {
    fn new() -> Self {
        Tally {
            // nanoseconds, 3 significant digits, up to 100 s
            latency: Histogram::new_with_bounds(1, 100_000_000_000, 3)
                .unwrap_or_else(|e| panic!("histogram bounds: {e}")),
            executed: 0,
            replayed: 0,
            in_progress: 0,
            errors: 0,
        }
    }

    fn record(&mut self, started: Instant, outcome: &Result<Outcome, BoxError>) {
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.latency.saturating_record(nanos.max(1));
        match outcome {
            Ok(Outcome::Executed) => self.executed += 1,
            Ok(Outcome::Replayed) => self.replayed += 1,
            Ok(Outcome::InProgress) => self.in_progress += 1,
            Err(e) => {
                if self.errors == 0 {
                    eprintln!("load: first error of a task: {e}");
                }
                self.errors += 1;
            }
        }
    }

    /// A batch: one latency sample, one count per key.
    fn record_batch(
        &mut self,
        started: Instant,
        outcome: Result<Vec<Result<Outcome, BoxError>>, BoxError>,
        keys: usize,
    ) {
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.latency.saturating_record(nanos.max(1));
        match outcome {
            Ok(outcomes) => {
                for outcome in outcomes {
                    match outcome {
                        Ok(Outcome::Executed) => self.executed += 1,
                        Ok(Outcome::Replayed) => self.replayed += 1,
                        Ok(Outcome::InProgress) => self.in_progress += 1,
                        Err(e) => {
                            if self.errors == 0 {
                                eprintln!("load: first error of a task: {e}");
                            }
                            self.errors += 1;
                        }
                    }
                }
            }
            Err(e) => {
                if self.errors == 0 {
                    eprintln!("load: first error of a task: {e}");
                }
                self.errors += keys as u64;
            }
        }
    }

    fn merge(&mut self, other: Tally) {
        if let Err(e) = self.latency.add(&other.latency) {
            eprintln!("load: histogram merge: {e}");
        }
        self.executed += other.executed;
        self.replayed += other.replayed;
        self.in_progress += other.in_progress;
        self.errors += other.errors;
    }
}

/// Names keys apart from earlier runs on the same servers.
struct Keys {
    run: String,
    scope: &'static str,
    next: AtomicU64,
}

impl Keys {
    fn key(&self, n: u64) -> IdempotencyKey {
        IdempotencyKey::new(self.scope, format!("{}-{n}", self.run))
            .unwrap_or_else(|e| panic!("generated key: {e}"))
    }
    fn next(&self) -> IdempotencyKey {
        self.key(self.next.fetch_add(1, Ordering::Relaxed))
    }
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.threads {
        builder.worker_threads(threads);
    }
    let runtime = builder.enable_all().build()?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> Result<(), BoxError> {
    if args.concurrency == 0 {
        return Err("--concurrency must be at least 1".into());
    }
    if args.batch == 0 || args.batch > 100_000 {
        return Err("--batch must be between 1 and 100000".into());
    }
    let target = target(&args).await?;
    let scope = match args.mix {
        Mix::Fresh => "load.fresh",
        Mix::Duplicate => "load.duplicate",
        Mix::Contended => "load.contended",
    };
    let keys = Arc::new(Keys {
        run: format!("{:016x}", fastrand::u64(..)),
        scope,
        next: AtomicU64::new(0),
    });
    if args.mix == Mix::Duplicate {
        for n in 0..DUPLICATE_KEYS {
            target.deliver(args.via, &keys.key(n)).await?;
        }
    }
    let contended_round = Arc::new(AtomicU64::new(1 << 40));
    if args.warmup > 0.0 {
        phase(&args, &target, &keys, &contended_round, args.warmup).await;
    }
    let started = Instant::now();
    let tally = phase(&args, &target, &keys, &contended_round, args.seconds).await;
    let elapsed = started.elapsed().as_secs_f64();
    let ops = tally.executed + tally.replayed + tally.in_progress;
    let us = |q: f64| tally.latency.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "load backend={} via={} mix={} concurrency={} batch={} seconds={:.2} ops={} ops_per_sec={:.0} \
         p50_us={:.1} p99_us={:.1} p999_us={:.1} max_us={:.1} executed={} replayed={} in_progress={} errors={} \
         max_rss_kb={}",
        name(args.backend),
        name(args.via),
        name(args.mix),
        args.concurrency,
        args.batch,
        elapsed,
        ops,
        ops as f64 / elapsed,
        us(0.5),
        us(0.99),
        us(0.999),
        tally.latency.max() as f64 / 1000.0,
        tally.executed,
        tally.replayed,
        tally.in_progress,
        tally.errors,
        max_rss_kb(),
    );
    if tally.errors > 0 {
        return Err(format!("{} operations failed", tally.errors).into());
    }
    Ok(())
}

/// Runs every task for `seconds` and merges their tallies.
async fn phase(
    args: &Args,
    target: &Target,
    keys: &Arc<Keys>,
    contended_round: &Arc<AtomicU64>,
    seconds: f64,
) -> Tally {
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let barrier = Arc::new(tokio::sync::Barrier::new(args.concurrency));
    let go_on = Arc::new(AtomicBool::new(true));
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (target, keys, via, mix) = (target.clone(), keys.clone(), args.via, args.mix);
            let batch = args.batch as u64;
            let (barrier, go_on, round) = (barrier.clone(), go_on.clone(), contended_round.clone());
            tokio::spawn(async move {
                let mut tally = Tally::new();
                let mut n = fastrand::u64(..DUPLICATE_KEYS);
                loop {
                    let mut delivery = Vec::with_capacity(batch as usize);
                    match mix {
                        Mix::Fresh => {
                            if Instant::now() >= deadline {
                                break;
                            }
                            for _ in 0..batch {
                                delivery.push(keys.next());
                            }
                        }
                        Mix::Duplicate => {
                            if Instant::now() >= deadline {
                                break;
                            }
                            for _ in 0..batch {
                                n = (n + 1) % DUPLICATE_KEYS;
                                delivery.push(keys.key(n));
                            }
                        }
                        Mix::Contended => {
                            // The leader of each round decides for everyone
                            // whether it runs; the second wait makes every
                            // task read that decision before the next one.
                            if barrier.wait().await.is_leader() {
                                go_on.store(Instant::now() < deadline, Ordering::SeqCst);
                                round.fetch_add(1, Ordering::SeqCst);
                            }
                            barrier.wait().await;
                            if !go_on.load(Ordering::SeqCst) {
                                break;
                            }
                            let first = round.load(Ordering::SeqCst) * batch;
                            for i in 0..batch {
                                delivery.push(keys.key(first + i));
                            }
                        }
                    }
                    let started = Instant::now();
                    if batch == 1 {
                        let outcome = target.deliver(via, &delivery[0]).await;
                        tally.record(started, &outcome);
                    } else {
                        let outcome = target.deliver_batch(via, delivery).await;
                        tally.record_batch(started, outcome, batch as usize);
                    }
                }
                tally
            })
        })
        .collect();
    let mut total = Tally::new();
    for task in tasks {
        match task.await {
            Ok(tally) => total.merge(tally),
            Err(e) => {
                eprintln!("load: a task failed: {e}");
                total.errors += 1;
            }
        }
    }
    total
}

/// The most resident memory this process has had (VmHWM), in KiB; 0 where
/// /proc does not say.
fn max_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse().ok())
        })
        .unwrap_or(0)
}

fn name<V: ValueEnum>(v: V) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_owned())
        .unwrap_or_default()
}

/// The Cargo features a backend needs.
fn features_of(backend: Backend) -> &'static str {
    match backend {
        Backend::Memory => "(none)",
        Backend::Postgres | Backend::PostgresTx => "postgres",
        Backend::Redis | Backend::RedisCluster => "redis",
        Backend::Tiered | Backend::TieredRedis => "tiered,postgres,redis",
        Backend::TieredPostgres => "tiered,postgres",
        Backend::Dynamodb | Backend::DynamodbBare => "dynamodb",
        Backend::TieredDynamodb => "dynamodb,tiered",
    }
}

async fn target(args: &Args) -> Result<Target, BoxError> {
    let store: Arc<dyn IdempotencyStore> = match args.backend {
        Backend::Memory => Arc::new(MemoryStore::new()),
        #[cfg(feature = "postgres")]
        Backend::Postgres => Arc::new(pg_store(args).await?),
        #[cfg(feature = "postgres")]
        Backend::PostgresTx => return Ok(Target::PgTx(pg_store(args).await?)),
        #[cfg(feature = "redis")]
        Backend::Redis => Arc::new(
            idemkit::redis::RedisStore::connect(redis_url(args)?)
                .await?
                .batching(batching(args, idemkit::redis::default_batching())),
        ),
        #[cfg(feature = "redis")]
        Backend::RedisCluster => {
            let urls = args.redis_cluster_urls.as_deref().ok_or(
                "--backend redis-cluster needs --redis-cluster-urls (or IDEM_REDIS_CLUSTER_URLS)",
            )?;
            Arc::new(
                idemkit::redis::RedisStore::connect_cluster(urls.split(','))
                    .await?
                    .batching(batching(args, idemkit::Batching::off())),
            )
        }
        #[cfg(all(feature = "tiered", feature = "postgres", feature = "redis"))]
        Backend::Tiered => {
            use idemkit::tiered::{MokaCache, RedisCache, TieredStore};
            Arc::new(
                TieredStore::new(pg_store(args).await?)
                    .with_cache(MokaCache::new(100_000, 256 << 20))
                    .with_cache(RedisCache::connect(redis_url(args)?).await?),
            )
        }
        #[cfg(all(feature = "tiered", feature = "postgres", feature = "redis"))]
        Backend::TieredRedis => {
            use idemkit::tiered::{RedisCache, TieredStore};
            Arc::new(
                TieredStore::new(pg_store(args).await?)
                    .with_cache(RedisCache::connect(redis_url(args)?).await?),
            )
        }
        #[cfg(all(feature = "tiered", feature = "postgres"))]
        Backend::TieredPostgres => {
            Arc::new(idemkit::tiered::TieredStore::new(pg_store(args).await?))
        }
        #[cfg(feature = "dynamodb")]
        Backend::Dynamodb => Arc::new(dynamodb_store(args).await?),
        #[cfg(all(feature = "dynamodb", feature = "tiered"))]
        Backend::TieredDynamodb => Arc::new(
            idemkit::tiered::TieredStore::new(dynamodb_store(args).await?)
                .with_cache(idemkit::tiered::MokaCache::new(100_000, 256 << 20)),
        ),
        #[cfg(feature = "dynamodb")]
        Backend::DynamodbBare => {
            return Ok(Target::Bare(dynamodb_store(args).await?.client().clone()))
        }
        #[allow(unreachable_patterns)]
        other => {
            return Err(format!(
                "this build has no {} backend: build it with --features {}",
                name(other),
                features_of(other)
            )
            .into())
        }
    };
    let idem: Arc<Idempotency<dyn IdempotencyStore>> = Arc::new(
        Idempotency::from_arc(store.clone())
            .lease(LEASE)
            .retention(RETENTION)
            .on_in_progress(InProgressPolicy::Reject),
    );
    Ok(Target::Store(
        store,
        idem,
        Arc::new(Response::new(args.response_bytes)?),
    ))
}

#[cfg(feature = "dynamodb")]
async fn dynamodb_store(args: &Args) -> Result<idemkit::dynamodb::DynamoDbStore, BoxError> {
    let url = args
        .dynamodb_url
        .as_deref()
        .ok_or("this backend needs --dynamodb-url (or IDEM_MOTO_URL)")?;
    let client = idemkit::dynamodb::local_client(url);
    idemkit::dynamodb::create_table(&client, DYNAMODB_TABLE).await?;
    // A load command measures slow answers rather than failing on them:
    // moto on a loaded machine took over the default 2 s for one call.
    Ok(
        idemkit::dynamodb::DynamoDbStore::new(client, DYNAMODB_TABLE)
            .call_timeout(std::time::Duration::from_secs(30)),
    )
}

#[cfg(feature = "redis")]
fn redis_url(args: &Args) -> Result<&str, BoxError> {
    Ok(args
        .redis_url
        .as_deref()
        .ok_or("this backend needs --redis-url (or IDEM_REDIS_URL)")?)
}

#[cfg(feature = "postgres")]
async fn pg_store(args: &Args) -> Result<idemkit::postgres::PgStore, BoxError> {
    let url = args
        .postgres_url
        .as_deref()
        .ok_or("this backend needs --postgres-url (or IDEM_POSTGRES_URL)")?;
    // The in-transaction mode runs on the pool; the store's own calls on
    // its own connections.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(args.concurrency.clamp(2, 128) as u32)
        .test_before_acquire(false)
        .connect(url)
        .await?;
    let mut builder = idemkit::postgres::PgStore::builder(pool)
        .batching(batching(args, idemkit::postgres::default_batching()));
    if let Some(n) = args.pg_connections {
        builder = builder.connections(n);
    }
    let store = builder.build()?;
    store.migrate().await?;
    Ok(store)
}
