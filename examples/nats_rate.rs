//! The JetStream consumer's end-to-end rate with idem against the same
//! consumer loop without it, on one server in one run: N messages are
//! published once to a stream, then each run reads them all through a
//! durable consumer of its own, handles and acks them, and the rate is N
//! divided by the time from its first message to its last ack (the best
//! of `--rounds`, the runs taking turns). At each concurrency:
//!
//! - `plain`: pulls of up to 64 messages (no more than the room left),
//!   each message handled in a task of its own (at most `concurrency` at
//!   once) and acked: the loop of `NatsConsumer` without idem;
//! - `memory`, `redis`, `postgres`: `NatsConsumer` over that store (an
//!   acquire and a completion per message, in-progress acks on).
//!
//! ```text
//! scripts/with-servers --only nats,redis,postgres cargo run --release --features nats,redis,postgres --example nats_rate -- --messages 20000
//! # nats_rate messages=20000 concurrency=64 rounds=3 plain_per_sec=... memory_per_sec=... memory_ratio=... redis_per_sec=... redis_ratio=... postgres_per_sec=... postgres_ratio=...
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use idemkit::nats::async_nats::jetstream::{self, consumer, stream};
use idemkit::nats::async_nats::{self, HeaderMap};
use idemkit::nats::{NatsConsumer, NatsMessage};
use idemkit::{Idempotency, IdempotencyStore, MemoryStore};

#[derive(Debug, Parser)]
#[command(about = "The JetStream consumer's rate with and without idem")]
struct Args {
    #[arg(long, env = "IDEM_NATS_URL")]
    nats_url: String,
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: String,
    #[arg(long, env = "IDEM_POSTGRES_URL")]
    postgres_url: String,
    /// Messages in the stream.
    #[arg(long, default_value_t = 20_000)]
    messages: u64,
    /// Concurrencies to measure (messages in flight).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    concurrency: Vec<usize>,
    /// Stores to measure with idem.
    #[arg(long, value_delimiter = ',', default_value = "memory,redis,postgres")]
    stores: Vec<String>,
    /// Rounds of every run, in turn; each rate is the best round's (the
    /// first round warms the server's caches and the connections).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The work of one message, the same in every run.
fn handle(payload: &[u8]) -> usize {
    payload.len()
}

/// The loop of `NatsConsumer` without idem. Returns messages per second.
async fn plain(
    js: &jetstream::Context,
    stream: &str,
    messages: u64,
    concurrency: usize,
) -> Result<f64, BoxError> {
    let durable = format!("plain-{concurrency}-{:08x}", fastrand::u32(..));
    let consumer: consumer::PullConsumer = js
        .get_stream(stream)
        .await?
        .create_consumer(consumer::pull::Config {
            durable_name: Some(durable),
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 1000,
            ..Default::default()
        })
        .await?;
    let room = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let acked = Arc::new(AtomicU64::new(0));
    let work = Arc::new(AtomicU64::new(0));
    let mut started = None;
    let last = Arc::new(std::sync::OnceLock::new());
    let mut tasks = tokio::task::JoinSet::new();
    while acked.load(Ordering::Relaxed) < messages {
        let mut permits = room.clone().acquire_owned().await?;
        let more = room.available_permits().min(63);
        if more > 0 {
            if let Ok(extra) = room.clone().try_acquire_many_owned(more as u32) {
                permits.merge(extra);
            }
        }
        let mut batch = consumer
            .batch()
            .max_messages(permits.num_permits())
            .expires(Duration::from_millis(200))
            .messages()
            .await?;
        while let Some(m) = batch.next().await {
            let m = m?;
            started.get_or_insert_with(Instant::now);
            let Some(permit) = permits.split(1) else {
                break;
            };
            let (acked, work, last) = (acked.clone(), work.clone(), last.clone());
            tasks.spawn(async move {
                work.fetch_add(handle(&m.payload) as u64, Ordering::Relaxed);
                if m.ack().await.is_ok() && acked.fetch_add(1, Ordering::Relaxed) + 1 == messages {
                    // The last ack: the end of the run (the loop itself
                    // may still wait in a pull that finds nothing).
                    let _ = last.set(Instant::now());
                }
                drop(permit);
            });
        }
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let (Some(started), Some(last)) = (started, last.get()) else {
        return Err("the plain run ended without its last ack".into());
    };
    Ok(messages as f64 / last.duration_since(started).as_secs_f64())
}

/// `NatsConsumer` over `store`. Returns messages per second.
async fn with_idem(
    js: &jetstream::Context,
    stream: &str,
    messages: u64,
    concurrency: usize,
    store: Arc<dyn IdempotencyStore>,
    name: &str,
) -> Result<f64, BoxError> {
    let durable = format!("{name}-{concurrency}-{:08x}", fastrand::u32(..));
    let consumer = Arc::new(
        NatsConsumer::new(js.clone(), stream, &durable, Idempotency::from_arc(store))
            .scope(format!("rate.{durable}"))
            .concurrency(concurrency)
            .pull_wait(Duration::from_millis(200)),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let c = consumer.clone();
    let run = tokio::spawn(async move {
        c.run(
            |m: NatsMessage| async move { Ok::<_, std::io::Error>(handle(&m.payload)) },
            async {
                let _ = stopped.await;
            },
        )
        .await
    });
    let mut started = None;
    loop {
        let s = consumer.stats();
        if s.received > 0 {
            started.get_or_insert_with(Instant::now);
        }
        if s.acked >= messages {
            break;
        }
        if run.is_finished() {
            return Err(format!("the consumer stopped: {:?}", run.await?).into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    let _ = stop.send(());
    run.await??;
    Ok(messages as f64 / elapsed.as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let js = jetstream::new(async_nats::connect(&args.nats_url).await?);
    let stream = format!("RATE-{:08x}", fastrand::u32(..));
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.in")],
        ..Default::default()
    })
    .await?;
    let mut acks = Vec::new();
    for m in 0..args.messages {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("m-{m}"));
        acks.push(
            js.publish_with_headers(
                format!("{stream}.in"),
                headers,
                format!("{{\"n\":{m}}}").into(),
            )
            .await?,
        );
        if acks.len() >= 512 {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    let redis: Arc<dyn IdempotencyStore> =
        Arc::new(idemkit::redis::RedisStore::connect(&args.redis_url).await?);
    let postgres: Option<Arc<dyn IdempotencyStore>> = if args.stores.iter().any(|s| s == "postgres")
    {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(64)
            .connect(&args.postgres_url)
            .await?;
        let store = idemkit::postgres::PgStore::builder(pool).build()?;
        store.migrate().await?;
        Some(Arc::new(store))
    } else {
        None
    };
    for &concurrency in &args.concurrency {
        let mut base: f64 = 0.0;
        let mut rates = vec![0.0f64; args.stores.len()];
        for _ in 0..args.rounds.max(1) {
            // On a worker thread, as the consumer's loop is (the main
            // thread's wake-ups are slower).
            let (js2, stream2, n) = (js.clone(), stream.clone(), args.messages);
            let r =
                tokio::spawn(async move { plain(&js2, &stream2, n, concurrency).await }).await??;
            base = base.max(r);
            for (rate, name) in rates.iter_mut().zip(&args.stores) {
                let store: Arc<dyn IdempotencyStore> = match name.as_str() {
                    "memory" => Arc::new(MemoryStore::new()),
                    "redis" => redis.clone(),
                    "postgres" => postgres.clone().ok_or("no PostgreSQL store")?,
                    other => {
                        return Err(
                            format!("unknown store {other:?} (memory, redis, postgres)").into()
                        )
                    }
                };
                let r = with_idem(&js, &stream, args.messages, concurrency, store, name).await?;
                *rate = rate.max(r);
            }
        }
        let mut line = format!(
            "nats_rate messages={} concurrency={concurrency} rounds={} plain_per_sec={base:.0}",
            args.messages, args.rounds
        );
        for (rate, name) in rates.iter().zip(&args.stores) {
            line.push_str(&format!(
                " {name}_per_sec={rate:.0} {name}_ratio={:.2}",
                rate / base
            ));
        }
        println!("{line}");
    }
    js.delete_stream(&stream).await?;
    Ok(())
}
