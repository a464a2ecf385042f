//! The Redis Streams consumer's end-to-end rate with idem against the same
//! consumer loop without it (issue 14): N entries are added to a stream,
//! then read by a consumer group in batches, handled and acknowledged,
//! once by a plain loop (`XREADGROUP COUNT`, the handler, one `XACK` per
//! batch) and once by [`StreamConsumer`] (the same reads and acks, plus one
//! `acquire_many` and `complete_many` per batch on a `RedisStore`).
//!
//! ```text
//! cargo run --release --features redis --example stream_rate -- --redis-url redis://127.0.0.1:6379/ --entries 50000 --batch 100
//! # stream_rate entries=50000 batch=100 plain_per_sec=... idem_per_sec=... ratio=...
//! ```
//!
//! With `--postgres-url` (feature `postgres`), the same entries go twice
//! more through the consumer with the keys in PostgreSQL: with a lease
//! (`run`) and in a transaction per entry (`run_in_transaction`, the
//! handler's work beside it, no statement of its own), `concurrency`
//! entries at once on a pool of as many connections:
//!
//! ```text
//! cargo run --release --features redis,postgres --example stream_rate -- --redis-url ... --postgres-url postgres://... --entries 5000
//! # stream_rate_postgres entries=5000 concurrency=8 lease_per_sec=... in_transaction_per_sec=... ratio=...
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use idemkit::redis::redis::{self, streams::StreamReadReply, AsyncCommands};
use idemkit::redis::streams::{StreamConsumer, StreamEntry};
use idemkit::redis::RedisStore;
use idemkit::Idempotency;

#[derive(Debug, Parser)]
#[command(about = "The Streams consumer's rate with and without idem")]
struct Args {
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: String,
    /// Entries in the stream.
    #[arg(long, default_value_t = 50_000)]
    entries: u64,
    /// Entries per read.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Also measure the consumer with the keys in this PostgreSQL, with a
    /// lease and in a transaction (feature `postgres`).
    #[arg(long)]
    postgres_url: Option<String>,
    /// Entries at once in the PostgreSQL runs (and the pool's size).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The work of one entry, the same in both runs.
fn handle(message_id: &str) -> usize {
    message_id.len()
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if args.entries == 0 || args.batch == 0 {
        return Err("--entries and --batch must be at least 1".into());
    }
    let client = redis::Client::open(args.redis_url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let stream = format!("stream-rate-{run}");
    for from in (0..args.entries).step_by(1000) {
        let mut pipe = redis::pipe();
        for i in from..(from + 1000).min(args.entries) {
            pipe.cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("message_id")
                .arg(format!("m-{run}-{i}"))
                .arg("amount")
                .arg(i)
                .ignore();
        }
        let () = pipe.query_async(&mut conn).await?;
    }

    // Without idem: read, handle, acknowledge.
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("plain")
        .arg("0")
        .query_async(&mut conn)
        .await?;
    let started = Instant::now();
    let mut done = 0u64;
    let mut work = 0usize;
    while done < args.entries {
        let reply: StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("plain")
            .arg("c1")
            .arg("COUNT")
            .arg(args.batch)
            .arg("STREAMS")
            .arg(&stream)
            .arg(">")
            .query_async(&mut conn)
            .await?;
        let mut ids = Vec::new();
        for key in reply.keys {
            for entry in key.ids {
                let id: String = entry.get("message_id").unwrap_or_default();
                work += handle(&id);
                ids.push(entry.id);
            }
        }
        if ids.is_empty() {
            return Err("the plain consumer read nothing before the end".into());
        }
        done += ids.len() as u64;
        let _: u64 = conn.xack(&stream, "plain", &ids).await?;
    }
    let plain = args.entries as f64 / started.elapsed().as_secs_f64();

    // With idem: the StreamConsumer on a RedisStore.
    let store = RedisStore::connect(&args.redis_url).await?;
    let consumer = StreamConsumer::connect(
        &args.redis_url,
        &stream,
        "idem",
        "c1",
        Idempotency::new(store),
    )
    .await?
    .key_field("message_id")
    .batch(args.batch)
    .block(Duration::from_millis(10));
    let handled = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let stats = {
        let handled = handled.clone();
        let consumer = &consumer;
        consumer
            .run(
                move |entry: StreamEntry| {
                    let handled = handled.clone();
                    async move {
                        handled.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, std::io::Error>(handle(
                            entry.text("message_id").unwrap_or_default(),
                        ))
                    }
                },
                async move {
                    while consumer.stats().acked < args.entries {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                },
            )
            .await?
    };
    let with_idem = args.entries as f64 / started.elapsed().as_secs_f64();
    if stats.executed != args.entries || handled.load(Ordering::Relaxed) != args.entries {
        return Err(format!(
            "idem run: {stats:?}, handler ran {} times",
            handled.load(Ordering::Relaxed)
        )
        .into());
    }
    println!(
        "stream_rate entries={} batch={} plain_per_sec={plain:.0} idem_per_sec={with_idem:.0} ratio={:.2} work={work}",
        args.entries,
        args.batch,
        with_idem / plain,
    );
    if let Some(url) = &args.postgres_url {
        postgres_rates(&args, url, &stream).await?;
    }
    let _: u64 = conn.del(&stream).await?;
    Ok(())
}

/// The consumer with the keys in PostgreSQL: with a lease, then in a
/// transaction per entry; each reads the whole stream in a group of its
/// own.
#[cfg(feature = "postgres")]
async fn postgres_rates(args: &Args, url: &str, stream: &str) -> Result<(), BoxError> {
    use idemkit::postgres::{PgStore, PgTx};

    let concurrency = args.concurrency.clamp(1, 64);
    let pool = idemkit::postgres::sqlx::postgres::PgPoolOptions::new()
        .max_connections(concurrency as u32)
        .connect(url)
        .await?;
    let store = PgStore::new(pool);
    store.migrate().await?;
    let consumer = |group: &'static str| {
        let store = store.clone();
        async move {
            Ok::<_, BoxError>(
                StreamConsumer::connect(
                    &args.redis_url,
                    stream,
                    group,
                    "c1",
                    Idempotency::new(store),
                )
                .await?
                // A scope per run: each runs every key.
                .scope(format!("stream-rate.{group}"))?
                .key_field("message_id")
                .batch(args.batch)
                .concurrency(concurrency)
                .block(Duration::from_millis(10)),
            )
        }
    };

    let lease = consumer("pg-lease").await?;
    let started = Instant::now();
    lease
        .run(
            |entry: StreamEntry| async move {
                Ok::<_, std::io::Error>(handle(entry.text("message_id").unwrap_or_default()))
            },
            wait_acked(&lease, args.entries),
        )
        .await?;
    let lease_rate = args.entries as f64 / started.elapsed().as_secs_f64();

    let in_tx = consumer("pg-tx").await?;
    let started = Instant::now();
    in_tx
        .run_in_transaction(
            // The same work as the other runs: no statement of its own on
            // the entry's transaction, so the difference is idem's.
            |entry: StreamEntry, _tx: PgTx| async move {
                Ok::<_, BoxError>(handle(entry.text("message_id").unwrap_or_default()))
            },
            wait_acked(&in_tx, args.entries),
        )
        .await?;
    let tx_rate = args.entries as f64 / started.elapsed().as_secs_f64();
    let (l, t) = (lease.stats(), in_tx.stats());
    if l.executed != args.entries || t.executed != args.entries {
        return Err(format!("postgres runs: lease {l:?}, in a transaction {t:?}").into());
    }
    println!(
        "stream_rate_postgres entries={} concurrency={concurrency} lease_per_sec={lease_rate:.0} in_transaction_per_sec={tx_rate:.0} ratio={:.2}",
        args.entries,
        tx_rate / lease_rate,
    );
    Ok(())
}

/// Done once `consumer` acknowledged `entries` entries.
#[cfg(feature = "postgres")]
async fn wait_acked<S: idemkit::IdempotencyStore + ?Sized>(
    consumer: &StreamConsumer<S>,
    entries: u64,
) {
    while consumer.stats().acked < entries {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[cfg(not(feature = "postgres"))]
async fn postgres_rates(_: &Args, _: &str, _: &str) -> Result<(), BoxError> {
    Err("--postgres-url needs the feature postgres".into())
}
