//! The RabbitMQ consumer's end-to-end rate with idem against the same
//! consumer loop without it, on one broker in one run: for each run, N
//! persistent messages are published to a durable queue of its own, then
//! a consumer takes them all, handles and acks them; the rate is N divided
//! by the time from the first delivery to the last ack. At each prefetch:
//!
//! - `plain`: lapin's consumer with that prefetch, each delivery handled in
//!   a task of its own and acked: `RabbitConsumer`'s loop without idem;
//! - `redis`, `postgres`: `RabbitConsumer` over that store (an acquire and
//!   a completion per message, then the ack).
//!
//! ```text
//! scripts/with-servers --only rabbitmq,redis,postgres cargo run --release --features rabbitmq,redis,postgres --example rabbitmq_rate -- --messages 20000
//! # rabbitmq_rate messages=20000 prefetch=64 plain_per_sec=... redis_per_sec=... redis_ratio=... postgres_per_sec=... postgres_ratio=...
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use idemkit::rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use idemkit::rabbitmq::lapin::types::FieldTable;
use idemkit::rabbitmq::lapin::{BasicProperties, Connection, ConnectionProperties};
use idemkit::rabbitmq::{RabbitConsumer, RabbitMessage};
use idemkit::{Idempotency, IdempotencyStore};

#[derive(Debug, Parser)]
#[command(about = "The RabbitMQ consumer's rate with and without idem")]
struct Args {
    #[arg(long, env = "IDEM_AMQP_URL")]
    amqp_url: String,
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: String,
    #[arg(long, env = "IDEM_POSTGRES_URL")]
    postgres_url: String,
    /// Messages per run.
    #[arg(long, default_value_t = 20_000)]
    messages: u64,
    /// Prefetches to measure (messages in flight).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    prefetch: Vec<u16>,
    /// Stores to measure with idem.
    #[arg(long, value_delimiter = ',', default_value = "redis,postgres")]
    stores: Vec<String>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// First delivery and last ack of a run.
#[derive(Default)]
struct Clock {
    first: Mutex<Option<Instant>>,
    last: Mutex<Option<Instant>>,
    done: AtomicU64,
}

impl Clock {
    fn started(&self) {
        self.first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(Instant::now);
    }

    /// Counts one message done; whether it was the last of `n`.
    fn finished(&self, n: u64) -> bool {
        let last = self.done.fetch_add(1, Ordering::SeqCst) + 1 == n;
        if last {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
        last
    }

    fn rate(&self, n: u64) -> Result<f64, BoxError> {
        let first = self
            .first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ok_or("no delivery")?;
        let last = self
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ok_or("not finished")?;
        Ok(n as f64 / (last - first).as_secs_f64())
    }
}

/// A durable queue of its own with `n` persistent messages, ids `m-0`...
async fn fill(connection: &Connection, n: u64) -> Result<String, BoxError> {
    let queue = format!("rate-{:08x}", fastrand::u32(..));
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.as_str().into(), durable, FieldTable::default())
        .await?;
    let mut confirms = Vec::new();
    for m in 0..n {
        let body = format!("{{\"amount\":{m}}}");
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(format!("m-{m}").into());
        confirms.push(
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    properties,
                )
                .await?,
        );
        if confirms.len() >= 1000 {
            for c in confirms.drain(..) {
                c.await?;
            }
        }
    }
    for c in confirms {
        c.await?;
    }
    channel.close(200, "".into()).await?;
    Ok(queue)
}

/// The loop without idem: each delivery handled in a task, then acked.
async fn plain(
    connection: &Connection,
    queue: &str,
    n: u64,
    prefetch: u16,
) -> Result<f64, BoxError> {
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let clock = Arc::new(Clock::default());
    let (done, mut all_done) = tokio::sync::mpsc::channel::<()>(1);
    loop {
        tokio::select! {
            _ = all_done.recv() => break,
            next = consumer.next() => {
                let delivery = next.ok_or("the consumer ended")??;
                clock.started();
                let (clock, done) = (clock.clone(), done.clone());
                tokio::spawn(async move {
                    let handled: Result<u64, _> = serde_json::from_slice::<serde_json::Value>(&delivery.data)
                        .map(|v| v["amount"].as_u64().unwrap_or(0));
                    std::hint::black_box(handled.ok());
                    if delivery.acker.ack(BasicAckOptions::default()).await.is_ok() && clock.finished(n) {
                        let _ = done.send(()).await;
                    }
                });
            }
        }
    }
    channel.close(200, "".into()).await?;
    clock.rate(n)
}

/// `RabbitConsumer` over `store`.
async fn with_idem(
    args: &Args,
    store: Arc<dyn IdempotencyStore>,
    queue: &str,
    prefetch: u16,
) -> Result<f64, BoxError> {
    let n = args.messages;
    let consumer =
        RabbitConsumer::new(&args.amqp_url, queue, Idempotency::new(store)).prefetch(prefetch);
    let clock = Arc::new(Clock::default());
    let (done, mut all_done) = tokio::sync::mpsc::channel::<()>(1);
    let c = clock.clone();
    let run = consumer.run(
        move |m: RabbitMessage| {
            let (c, done) = (c.clone(), done.clone());
            async move {
                c.started();
                let v: serde_json::Value = m.json()?;
                // Counted when the handler returns: the record and the ack
                // follow, within the next message's time.
                if c.finished(n) {
                    let _ = done.send(()).await;
                }
                Ok::<_, idemkit::rabbitmq::MessageError>(v["amount"].as_u64().unwrap_or(0))
            }
        },
        async move {
            let _ = all_done.recv().await;
        },
    );
    let stats = run.await?;
    if stats.acked != n {
        return Err(format!("acked {} of {n}: {stats:?}", stats.acked).into());
    }
    clock.rate(n)
}

async fn store(
    args: &Args,
    name: &str,
    prefetch: u16,
) -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    Ok(match name {
        "redis" => Arc::new(idemkit::redis::RedisStore::connect(&args.redis_url).await?),
        "postgres" => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(u32::from(prefetch).clamp(2, 64))
                .connect(&args.postgres_url)
                .await?;
            let store = idemkit::postgres::PgStore::builder(pool).build()?;
            store.migrate().await?;
            Arc::new(store)
        }
        other => return Err(format!("unknown store {other} (redis, postgres)").into()),
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if args.messages == 0 || args.prefetch.contains(&0) {
        return Err("--messages and --prefetch must be at least 1".into());
    }
    let connection = Connection::connect(&args.amqp_url, ConnectionProperties::default()).await?;
    for &prefetch in &args.prefetch {
        let queue = fill(&connection, args.messages).await?;
        let base = tokio::time::timeout(
            Duration::from_secs(600),
            plain(&connection, &queue, args.messages, prefetch),
        )
        .await??;
        let mut line = format!(
            "rabbitmq_rate messages={} prefetch={prefetch} plain_per_sec={base:.0}",
            args.messages
        );
        for name in &args.stores {
            let queue = fill(&connection, args.messages).await?;
            let store = store(&args, name, prefetch).await?;
            let rate = tokio::time::timeout(
                Duration::from_secs(600),
                with_idem(&args, store, &queue, prefetch),
            )
            .await??;
            line.push_str(&format!(
                " {name}_per_sec={rate:.0} {name}_ratio={:.2}",
                rate / base
            ));
        }
        println!("{line}");
    }
    Ok(())
}
