//! The main job: an at-least-once broker delivers payment messages with
//! duplicates, concurrent redeliveries, a consumer that crashes mid-handler
//! and one that stalls past its lease, and idem makes every account be
//! charged exactly once.
//!
//! ```text
//! cargo run -p exactly-once
//! cargo run -p exactly-once -- --messages 2000 --duplicates 4 --concurrency 64
//! cargo run -p exactly-once --features postgres -- --backend postgres --postgres-url postgres://...
//! cargo run -p exactly-once --features redis -- --backend redis --redis-url redis://127.0.0.1:6379/
//! cargo run -p exactly-once --features postgres -- --backend postgres --in-transaction --postgres-url postgres://...
//! ```
//!
//! With `--in-transaction` (PostgreSQL), each delivery claims its key, inserts
//! its charge into a table and records its receipt in one transaction; one
//! consumer dies (its connection cut) between the INSERT and the commit.
//! The check is then the table: one row per payment.
//!
//! It prints a table of what happened and exits with status 1 if any
//! account was charged other than once, or any replay differed from the
//! recorded result.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use idemkit::{
    Fingerprint, IdemError, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy,
    MemoryStore, Processed,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    /// In-process MemoryStore: no server needed.
    Memory,
    /// PgStore (feature `postgres`) on --postgres-url.
    Postgres,
    /// RedisStore (feature `redis`) on --redis-url.
    Redis,
    /// TieredStore (feature `tiered`): moka, then Redis (--redis-url), then
    /// PostgreSQL (--postgres-url) as the source of truth.
    Tiered,
}

#[derive(Debug, Parser)]
#[command(about = "Simulates an at-least-once payment queue and checks exactly-once charging")]
struct Args {
    /// Where idempotency records live.
    #[arg(long, value_enum, default_value = "memory")]
    backend: Backend,
    /// Distinct payment messages.
    #[arg(long, default_value_t = 500)]
    messages: usize,
    /// Up to this many extra deliveries of each message (random, 0..=N).
    #[arg(long, default_value_t = 3)]
    duplicates: usize,
    /// Concurrent consumers.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seed of the delivery order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// PostgreSQL URL for --backend postgres.
    #[arg(long, env = "IDEM_POSTGRES_URL")]
    postgres_url: Option<String>,
    /// Redis URL for --backend redis.
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: Option<String>,
    /// With --backend postgres: claim, charge (an INSERT) and record in one
    /// transaction per delivery (the in-transaction mode); one consumer
    /// dies between its INSERT and the commit.
    #[arg(long)]
    in_transaction: bool,
}

/// A payment message as the producer sent it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Payment {
    message_id: String,
    account: String,
    amount_cents: u64,
}

/// What the charge handler returns; recorded and replayed to duplicates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: u64,
    account: String,
    amount_cents: u64,
    applied: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// The consumer dies while the handler runs, before the charge.
    Crash,
    /// The consumer stalls (a long GC pause, a frozen VM) past its lease
    /// before the charge, then wakes up and carries on.
    Stall,
}

#[derive(Debug, Clone)]
struct Delivery {
    message: usize,
    fault: Option<Fault>,
}

/// An at-least-once queue: unacked deliveries come back after a delay.
struct Broker {
    queue: Mutex<VecDeque<Delivery>>,
    notify: Notify,
    unfinished: AtomicUsize,
    redelivery_delay: Duration,
}

impl Broker {
    fn new(deliveries: Vec<Delivery>) -> Arc<Self> {
        Arc::new(Broker {
            unfinished: AtomicUsize::new(deliveries.len()),
            queue: Mutex::new(deliveries.into()),
            notify: Notify::new(),
            redelivery_delay: Duration::from_millis(20),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Delivery>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next delivery, or `None` once every delivery was acked.
    async fn next(&self) -> Option<Delivery> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(d) = self.lock().pop_front() {
                return Some(d);
            }
            if self.unfinished.load(Ordering::SeqCst) == 0 {
                return None;
            }
            notified.await;
        }
    }

    fn ack(&self) {
        if self.unfinished.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.notify.notify_waiters();
        }
    }

    /// Not acked: the broker delivers it again later, without the fault.
    fn nack(self: &Arc<Self>, delivery: Delivery) {
        let broker = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(broker.redelivery_delay).await;
            broker.lock().push_back(Delivery {
                fault: None,
                ..delivery
            });
            broker.notify.notify_one();
        });
    }
}

/// The payment provider. It takes the acquisition's fence (`Context::fence`,
/// strictly increasing per key across takeovers, releases and expiry) and
/// refuses a charge whose fence is not above the highest it applied for
/// the account. That is the only defence against a stalled worker that
/// wakes up after its lease was taken over (see the README's guarantee).
/// `attempt` would not do: it resets when a record goes away.
#[derive(Default)]
struct Ledger {
    charges: Mutex<HashMap<String, (u32, u64)>>, // account -> (charges, highest fence)
    next_charge_id: AtomicU64,
    stale_refused: AtomicUsize,
}

impl Ledger {
    async fn charge(&self, payment: &Payment, fence: u64) -> Receipt {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(1..=3))).await;
        let mut charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        let entry = charges.entry(payment.account.clone()).or_insert((0, 0));
        let applied = fence > entry.1;
        if applied {
            entry.0 += 1;
            entry.1 = fence;
        } else {
            self.stale_refused.fetch_add(1, Ordering::SeqCst);
        }
        Receipt {
            charge_id: self.next_charge_id.fetch_add(1, Ordering::SeqCst),
            account: payment.account.clone(),
            amount_cents: payment.amount_cents,
            applied,
        }
    }
}

#[derive(Default)]
struct Tally {
    deliveries: AtomicUsize,
    executions: AtomicUsize,
    replays: AtomicUsize,
    in_progress: AtomicUsize,
    crashes: AtomicUsize,
    takeovers: AtomicUsize,
    fenced: AtomicUsize,
    errors: AtomicUsize,
    /// Signalled when a consumer took over a lease that ran out.
    takeover_seen: Notify,
    executed: Mutex<HashMap<usize, Receipt>>,
    replayed: Mutex<Vec<(usize, Receipt)>>,
}

#[tokio::main]
async fn main() {
    if let Err(e) = main_job().await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn main_job() -> Result<(), Box<dyn std::error::Error>> {
    // Errors only: the table below is the output.
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::ERROR)
        .init();
    let args = Args::parse();
    if args.in_transaction {
        if !matches!(args.backend, Backend::Postgres) {
            return Err("--in-transaction needs --backend postgres".into());
        }
        if !in_transaction(&args).await? {
            std::process::exit(1);
        }
        return Ok(());
    }
    let store: Arc<dyn IdempotencyStore> = match args.backend {
        Backend::Memory => Arc::new(MemoryStore::new()),
        Backend::Postgres => postgres_store(&args).await?,
        Backend::Redis => redis_store(&args).await?,
        Backend::Tiered => tiered_store(&args).await?,
    };
    let ok = run(&args, store).await?;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

async fn run(
    args: &Args,
    store: Arc<dyn IdempotencyStore>,
) -> Result<bool, Box<dyn std::error::Error>> {
    let messages = args.messages.max(2);
    let scope_run = format!("{:08x}", fastrand::u32(..));
    let payments: Arc<Vec<Payment>> = Arc::new(
        (0..messages)
            .map(|i| Payment {
                message_id: format!("{scope_run}-{i}"),
                account: format!("acct-{i:05}"),
                amount_cents: 100 + (i as u64 * 37) % 9_900,
            })
            .collect(),
    );

    // Every message 1 + 0..=duplicates times, shuffled; message 0's first
    // delivery crashes its consumer, message 1's stalls past its lease (it
    // gets at least one duplicate, which takes it over).
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let mut deliveries = Vec::new();
    for message in 0..messages {
        let extra = rng.usize(0..=args.duplicates) + usize::from(message == 1);
        deliveries.extend((0..=extra).map(|_| Delivery {
            message,
            fault: None,
        }));
    }
    rng.shuffle(&mut deliveries);
    for (message, fault) in [(1, Fault::Stall), (0, Fault::Crash)] {
        let at = deliveries
            .iter()
            .position(|d| d.message == message)
            .ok_or("no delivery")?;
        let mut d = deliveries.remove(at);
        d.fault = Some(fault);
        deliveries.insert(0, d);
    }
    let total_deliveries = deliveries.len();
    let broker = Broker::new(deliveries);

    let idem = Idempotency::from_arc(store.clone())
        .lease(Duration::from_secs(10))
        .retention(Duration::from_secs(3600))
        .on_in_progress(InProgressPolicy::Reject);
    // The stalled consumer runs with a short lease and no heartbeat: its
    // process is frozen, so nothing renews the lease.
    let frozen = Idempotency::from_arc(store)
        .lease(Duration::from_millis(200))
        .retention(Duration::from_secs(3600))
        .heartbeat(false);

    let ledger = Arc::new(Ledger::default());
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (broker, idem, frozen) = (broker.clone(), idem.clone(), frozen.clone());
        let (payments, ledger, tally) = (payments.clone(), ledger.clone(), tally.clone());
        workers.push(tokio::spawn(async move {
            while let Some(delivery) = broker.next().await {
                tally.deliveries.fetch_add(1, Ordering::SeqCst);
                let payment = payments[delivery.message].clone();
                let key = IdempotencyKey::new("payments.charge", payment.message_id.clone())
                    .unwrap_or_else(|e| panic!("message ids are valid keys: {e}"));
                let fingerprint = Fingerprint::of(&payment).ok();

                let outcome = match delivery.fault {
                    Some(Fault::Crash) => {
                        crash_mid_handler(&idem, key, fingerprint).await;
                        tally.crashes.fetch_add(1, Ordering::SeqCst);
                        broker.nack(delivery);
                        continue;
                    }
                    Some(Fault::Stall) => {
                        let (ledger, tally) = (ledger.clone(), tally.clone());
                        frozen
                            .process_with(&key, fingerprint, |ctx| async move {
                                // Frozen until another consumer has taken the
                                // message over (at most 10 s).
                                let _ = tokio::time::timeout(
                                    Duration::from_secs(10),
                                    tally.takeover_seen.notified(),
                                )
                                .await;
                                Ok::<_, std::convert::Infallible>(
                                    ledger.charge(&payment, ctx.fence).await,
                                )
                            })
                            .await
                    }
                    None => {
                        let (ledger, tally) = (ledger.clone(), tally.clone());
                        idem.process_with(&key, fingerprint, |ctx| async move {
                            let receipt = ledger.charge(&payment, ctx.fence).await;
                            if ctx.attempt > 1 {
                                tally.takeovers.fetch_add(1, Ordering::SeqCst);
                                tally.takeover_seen.notify_one();
                            }
                            Ok::<_, std::convert::Infallible>(receipt)
                        })
                        .await
                    }
                };
                match outcome {
                    Ok(Processed::Executed(receipt))
                    | Ok(Processed::ExecutedNotReplayable { value: receipt, .. }) => {
                        tally.executions.fetch_add(1, Ordering::SeqCst);
                        lock(&tally.executed).insert(delivery.message, receipt);
                        broker.ack();
                    }
                    Ok(Processed::Replayed(receipt)) => {
                        tally.replays.fetch_add(1, Ordering::SeqCst);
                        lock(&tally.replayed).push((delivery.message, receipt));
                        broker.ack();
                    }
                    Err(IdemError::InProgress { .. }) => {
                        tally.in_progress.fetch_add(1, Ordering::SeqCst);
                        broker.nack(delivery);
                    }
                    Err(IdemError::LeaseLost) => {
                        // Another consumer owns the message now and records
                        // its result: ack ours.
                        tally.fenced.fetch_add(1, Ordering::SeqCst);
                        broker.ack();
                    }
                    Err(e) => {
                        eprintln!("delivery of message {} failed: {e}", delivery.message);
                        tally.errors.fetch_add(1, Ordering::SeqCst);
                        broker.nack(delivery);
                    }
                }
            }
        }));
    }
    for worker in workers {
        worker.await?;
    }
    let elapsed = started.elapsed();

    let charges = lock(&ledger.charges);
    let executed = lock(&tally.executed);
    let wrong_accounts: Vec<_> = payments
        .iter()
        .filter(|p| charges.get(&p.account).map(|c| c.0) != Some(1))
        .map(|p| p.account.clone())
        .collect();
    let wrong_replays = lock(&tally.replayed)
        .iter()
        .filter(|(m, r)| executed.get(m) != Some(r))
        .count();

    let n = |a: &AtomicUsize| a.load(Ordering::SeqCst);
    println!("idem exactly-once check");
    println!(
        "  {:<42}{}",
        "backend",
        format!("{:?}", args.backend).to_lowercase()
    );
    println!("  {:<42}{}", "messages", messages);
    // Lines marked "varies" depend on timing (the machine, its load):
    // redeliveries of messages in progress, how many leases ran out and
    // so how many completions were fenced (each delivery ends as an
    // execution, a replay, a crash or a fenced completion). The README's
    // sample is checked against the other lines.
    println!(
        "  {:<42}{} ({} planned, plus redeliveries)",
        "deliveries (varies)",
        n(&tally.deliveries),
        total_deliveries
    );
    println!(
        "  {:<42}{}",
        "concurrent consumers",
        args.concurrency.max(1)
    );
    println!(
        "  {:<42}{}",
        "executions (handler ran and recorded)",
        n(&tally.executions)
    );
    println!("  {:<42}{}", "replays (varies)", n(&tally.replays));
    println!(
        "  {:<42}{}",
        "in-progress rejections (varies)",
        n(&tally.in_progress)
    );
    println!(
        "  {:<42}{}",
        "consumer crashes mid-handler",
        n(&tally.crashes)
    );
    println!(
        "  {:<42}{}",
        "takeovers after a lease ran out (varies)",
        n(&tally.takeovers)
    );
    println!(
        "  {:<42}{}",
        "fenced completions (varies)",
        n(&tally.fenced)
    );
    println!(
        "  {:<42}{}",
        "stale charges refused (varies)",
        n(&ledger.stale_refused)
    );
    println!("  {:<42}{}", "other errors", n(&tally.errors));
    println!("  {:<42}{:.2} s", "elapsed (varies)", elapsed.as_secs_f64());

    // The faults must have happened, or the run proved less than it says.
    let faults_seen = n(&tally.crashes) == 1 && n(&tally.takeovers) >= 1 && n(&tally.fenced) >= 1;
    let ok = wrong_accounts.is_empty()
        && wrong_replays == 0
        && n(&tally.executions) == messages
        && n(&tally.errors) == 0
        && faults_seen;
    if ok {
        println!(
            "check: PASS: each of the {messages} accounts was charged exactly once, every replay returned the recorded receipt, and the crash, the takeover and the fenced completion all happened"
        );
    } else {
        println!(
            "check: FAIL: {} accounts not charged exactly once (first: {:?}), {wrong_replays} replays differ, {} executions for {messages} messages, faults seen: {faults_seen}",
            wrong_accounts.len(),
            wrong_accounts.first(),
            n(&tally.executions)
        );
    }
    Ok(ok)
}

#[cfg(feature = "postgres")]
async fn pg_store(args: &Args) -> Result<idemkit::postgres::PgStore, Box<dyn std::error::Error>> {
    let url = args
        .postgres_url
        .as_deref()
        .ok_or("this backend needs --postgres-url (or IDEM_POSTGRES_URL)")?;
    // Fails at once with the cause (refused, authentication, unknown
    // database), where PgPoolOptions::connect would wait 30 s.
    let options = idemkit::postgres::sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .test_before_acquire(false);
    let pool = idemkit::postgres::connect_with(options, url).await?;
    let store = idemkit::postgres::PgStore::builder(pool)
        .connections(args.concurrency.clamp(2, 64))
        .build()?;
    store.migrate().await?;
    Ok(store)
}

#[cfg(feature = "postgres")]
async fn postgres_store(
    args: &Args,
) -> Result<Arc<dyn IdempotencyStore>, Box<dyn std::error::Error>> {
    Ok(Arc::new(pg_store(args).await?))
}

#[cfg(not(feature = "postgres"))]
async fn postgres_store(_: &Args) -> Result<Arc<dyn IdempotencyStore>, Box<dyn std::error::Error>> {
    Err("this build has no PostgreSQL backend: run with --features postgres".into())
}

#[cfg(feature = "redis")]
async fn redis_store(args: &Args) -> Result<Arc<dyn IdempotencyStore>, Box<dyn std::error::Error>> {
    let url = args
        .redis_url
        .as_deref()
        .ok_or("--backend redis needs --redis-url (or IDEM_REDIS_URL)")?;
    Ok(Arc::new(idemkit::redis::RedisStore::connect(url).await?))
}

#[cfg(not(feature = "redis"))]
async fn redis_store(_: &Args) -> Result<Arc<dyn IdempotencyStore>, Box<dyn std::error::Error>> {
    Err("this build has no Redis backend: run with --features redis".into())
}

#[cfg(all(feature = "tiered", feature = "postgres", feature = "redis"))]
async fn tiered_store(
    args: &Args,
) -> Result<Arc<dyn IdempotencyStore>, Box<dyn std::error::Error>> {
    use idemkit::tiered::{MokaCache, RedisCache, TieredStore};
    let url = args
        .redis_url
        .as_deref()
        .ok_or("--backend tiered needs --redis-url (or IDEM_REDIS_URL) for its Redis tier")?;
    let store = TieredStore::new(pg_store(args).await?)
        .with_cache(MokaCache::new(100_000, 256 << 20))
        .with_cache(RedisCache::connect(url).await?);
    Ok(Arc::new(store))
}

#[cfg(not(all(feature = "tiered", feature = "postgres", feature = "redis")))]
async fn tiered_store(_: &Args) -> Result<Arc<dyn IdempotencyStore>, Box<dyn std::error::Error>> {
    Err("this build has no tiered backend: run with --features tiered,postgres,redis".into())
}

/// The in-transaction mode: every delivery of every payment, 16 consumers
/// at once, each in a transaction of its own that claims the key, inserts
/// the charge and records the receipt; the first delivery of message 0
/// dies between its INSERT and the commit (its connection is cut, as a
/// process that dies cuts it). The table must hold each payment once, and
/// every replay the receipt of the row that was committed.
#[cfg(feature = "postgres")]
async fn in_transaction(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    use idemkit::postgres::sqlx::{self, Connection};
    use idemkit::postgres::Claim;

    let store = pg_store(args).await?;
    let url = args.postgres_url.as_deref().ok_or("needs --postgres-url")?;
    let concurrency = args.concurrency.clamp(1, 64);
    // A connection per consumer: a duplicate waits for the open
    // transaction of its key on its own connection.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(concurrency as u32 + 1)
        .connect(url)
        .await?;
    let messages = args.messages.max(1);
    let run_id = format!("{:08x}", fastrand::u32(..));
    let table = format!("exactly_once_charges_{run_id}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, message_id text NOT NULL, \
         account text NOT NULL, amount_cents bigint NOT NULL, fence bigint NOT NULL)"
    )))
    .execute(&pool)
    .await?;
    let payments: Arc<Vec<Payment>> = Arc::new(
        (0..messages)
            .map(|i| Payment {
                message_id: format!("{run_id}-{i}"),
                account: format!("acct-{i:05}"),
                amount_cents: 100 + (i as u64 * 37) % 9_900,
            })
            .collect(),
    );
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let mut deliveries = Vec::new();
    for message in 0..messages {
        let extra = rng.usize(0..=args.duplicates);
        deliveries.extend((0..=extra).map(|_| Delivery {
            message,
            fault: None,
        }));
    }
    rng.shuffle(&mut deliveries);
    let first = deliveries
        .iter()
        .position(|d| d.message == 0)
        .ok_or("no delivery")?;
    let mut crashing = deliveries.remove(first);
    crashing.fault = Some(Fault::Crash);
    deliveries.insert(0, crashing);
    let planned = deliveries.len();
    let broker = Broker::new(deliveries);
    let in_tx = store.in_transaction().retention(Duration::from_secs(3600));
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (broker, pool, in_tx, tally) =
            (broker.clone(), pool.clone(), in_tx.clone(), tally.clone());
        let (payments, table) = (payments.clone(), table.clone());
        workers.push(tokio::spawn(async move {
            while let Some(delivery) = broker.next().await {
                tally.deliveries.fetch_add(1, Ordering::SeqCst);
                let payment = &payments[delivery.message];
                let key = IdempotencyKey::new("payments.charge", payment.message_id.clone())
                    .unwrap_or_else(|e| panic!("message ids are valid keys: {e}"));
                let done: Result<(), Box<dyn std::error::Error + Send + Sync>> = async {
                    let mut conn = pool.acquire().await?;
                    let mut tx = conn.begin().await?;
                    match in_tx.claim::<_, Receipt>(&mut tx, &key, payment).await? {
                        Claim::Replayed(receipt) => {
                            tally.replays.fetch_add(1, Ordering::SeqCst);
                            lock(&tally.replayed).push((delivery.message, receipt));
                            drop(tx); // nothing written: rolled back
                            broker.ack();
                        }
                        Claim::Acquired(lease) => {
                            let charge_id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                                "INSERT INTO {table} (message_id, account, amount_cents, fence) \
                                 VALUES ($1, $2, $3, $4) RETURNING id"
                            )))
                            .bind(&payment.message_id)
                            .bind(&payment.account)
                            .bind(payment.amount_cents as i64)
                            .bind(lease.fence() as i64)
                            .fetch_one(&mut *tx)
                            .await?;
                            if delivery.fault == Some(Fault::Crash) {
                                // The consumer dies here: its connection is
                                // cut without a rollback or a goodbye; the
                                // server rolls the INSERT back with the claim.
                                std::mem::forget(tx);
                                conn.detach().close_hard().await?;
                                tally.crashes.fetch_add(1, Ordering::SeqCst);
                                broker.nack(delivery.clone());
                                return Ok(());
                            }
                            let receipt = Receipt {
                                charge_id: charge_id as u64,
                                account: payment.account.clone(),
                                amount_cents: payment.amount_cents,
                                applied: true,
                            };
                            lease.complete(&mut tx, &receipt).await?;
                            tx.commit().await?;
                            tally.executions.fetch_add(1, Ordering::SeqCst);
                            lock(&tally.executed).insert(delivery.message, receipt);
                            broker.ack();
                        }
                    }
                    Ok(())
                }
                .await;
                if let Err(e) = done {
                    eprintln!("delivery of message {} failed: {e}", delivery.message);
                    tally.errors.fetch_add(1, Ordering::SeqCst);
                    broker.nack(delivery);
                }
            }
        }));
    }
    for worker in workers {
        worker.await?;
    }
    let elapsed = started.elapsed();
    let doubles: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT message_id FROM {table} GROUP BY message_id HAVING count(*) > 1) d"
    )))
    .fetch_one(&pool)
    .await?;
    let charged: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(DISTINCT message_id) FROM {table}"
    )))
    .fetch_one(&pool)
    .await?;
    let rows: i64 =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&pool)
            .await?;
    let wrong_replays = {
        let executed = lock(&tally.executed);
        lock(&tally.replayed)
            .iter()
            .filter(|(m, r)| executed.get(m) != Some(r))
            .count()
    };
    let n = |a: &AtomicUsize| a.load(Ordering::SeqCst);
    println!("idem exactly-once check, in a transaction");
    println!(
        "  {:<42}postgres (claim, INSERT, record: one transaction)",
        "backend"
    );
    println!("  {:<42}{}", "messages", messages);
    println!(
        "  {:<42}{} ({} planned, plus redeliveries)",
        "deliveries (varies)",
        n(&tally.deliveries),
        planned
    );
    println!("  {:<42}{}", "concurrent consumers", concurrency);
    println!("  {:<42}{}", "executions (committed)", n(&tally.executions));
    println!("  {:<42}{}", "replays (varies)", n(&tally.replays));
    println!(
        "  {:<42}{}",
        "consumers dead between INSERT and commit",
        n(&tally.crashes)
    );
    println!("  {:<42}{}", "rows in the charges table", rows);
    println!("  {:<42}{}", "payments with more than one row", doubles);
    println!("  {:<42}{}", "other errors", n(&tally.errors));
    println!("  {:<42}{:.2} s", "elapsed (varies)", elapsed.as_secs_f64());
    let ok = doubles == 0
        && charged == messages as i64
        && rows == messages as i64
        && wrong_replays == 0
        && n(&tally.executions) == messages
        && n(&tally.crashes) == 1
        && n(&tally.errors) == 0;
    if ok {
        println!(
            "check: PASS: the table holds each of the {messages} payments once, the consumer that died between its INSERT and the commit left nothing, and every replay returned the committed receipt"
        );
    } else {
        println!(
            "check: FAIL: {rows} rows for {messages} payments ({charged} distinct, {doubles} doubled), {wrong_replays} replays differ, {} executions, {} crashes",
            n(&tally.executions),
            n(&tally.crashes)
        );
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await?;
    Ok(ok)
}

#[cfg(not(feature = "postgres"))]
async fn in_transaction(_: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    Err("this build has no PostgreSQL backend: run with --features postgres".into())
}

/// Starts the handler in a task and kills the task once the handler has
/// started, as a consumer process dying would. idem releases the key, so
/// the redelivery runs the handler.
async fn crash_mid_handler<S: IdempotencyStore + ?Sized>(
    idem: &Idempotency<S>,
    key: IdempotencyKey,
    fingerprint: Option<Fingerprint>,
) {
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let idem = idem.clone();
    let task = tokio::spawn(async move {
        idem.process_with(&key, fingerprint, |_| async move {
            let _ = started_tx.send(());
            std::future::pending::<Result<Receipt, std::convert::Infallible>>().await
        })
        .await
    });
    let _ = started_rx.await;
    task.abort();
    let _ = task.await;
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
