//! The Kafka consumer's end-to-end rate with idem against the same consumer
//! loop without it (issue 16), on one broker in one run: N records are
//! produced once, then each consumer reads them all in a consumer group of
//! its own, handles them and commits, and the rate is N divided by the
//! time from its first record to its last committed offset (the group join
//! before the first record is left out). At each concurrency:
//!
//! - `plain`: rdkafka's `StreamConsumer`, records taken 64 at a time, each
//!   handled in a task of its own (at most `concurrency` at once), offsets
//!   committed contiguously per partition every 100 ms: the loop of
//!   `KafkaConsumer` without idem;
//! - `redis`, `postgres`, `tiered` (moka, Redis, PostgreSQL): `KafkaConsumer`
//!   over that store, at `--batch 1` (an acquire and a completion per
//!   record) and `--batch 64` (a partition's records read together acquired
//!   with one `acquire_many` and recorded with one `complete_many`).
//!
//! ```text
//! scripts/with-servers cargo run --release --features kafka,redis,postgres,tiered --example kafka_rate -- --records 50000
//! # kafka_rate records=50000 partitions=8 concurrency=64 plain_per_sec=... redis_b1_per_sec=... redis_b1_ratio=... redis_b64_per_sec=...
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use futures::FutureExt;
use idemkit::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemkit::kafka::rdkafka::client::DefaultClientContext;
use idemkit::kafka::rdkafka::config::ClientConfig;
use idemkit::kafka::rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use idemkit::kafka::rdkafka::message::Message;
use idemkit::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idemkit::kafka::rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use idemkit::kafka::{KafkaConsumer, KafkaRecord};
use idemkit::{Idempotency, IdempotencyStore};

#[derive(Debug, Parser)]
#[command(about = "The Kafka consumer's rate with and without idem")]
struct Args {
    #[arg(long, env = "IDEM_KAFKA_BROKERS")]
    brokers: String,
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: String,
    #[arg(long, env = "IDEM_POSTGRES_URL")]
    postgres_url: String,
    /// Records in the topic.
    #[arg(long, default_value_t = 20_000)]
    records: u64,
    /// Partitions of the topic.
    #[arg(long, default_value_t = 8)]
    partitions: i32,
    /// Concurrencies to measure (records in flight).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    concurrency: Vec<usize>,
    /// Batch sizes of the idem runs (`KafkaConsumer::batch`: records of a
    /// partition acquired together; 1: each on its own).
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    batch: Vec<usize>,
    /// Stores to measure with idem.
    #[arg(long, value_delimiter = ',', default_value = "redis,postgres,tiered")]
    stores: Vec<String>,
    /// The stores' natural batching of concurrent single calls: `on`
    /// (each store's default) or `off`.
    #[arg(long, default_value = "on")]
    batching: String,
}

/// The batching the flags ask for, or the store's own default.
fn batching(args: &Args, default: idemkit::Batching) -> idemkit::Batching {
    if args.batching == "off" {
        idemkit::Batching::off()
    } else {
        default
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The work of one record, the same in every run.
fn handle(key: &[u8]) -> usize {
    key.len()
}

fn config(brokers: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false");
    c
}

/// A partition of the plain loop: its offsets in flight (done or not), its
/// commit point, and the last offset committed.
type Track = Arc<Mutex<(BTreeMap<i64, bool>, i64, i64)>>;

/// The loop of `KafkaConsumer` without idem. Returns records per second.
async fn plain(args: &Args, topic: &str, concurrency: usize) -> Result<f64, BoxError> {
    let group = format!("plain-{concurrency}-{:08x}", fastrand::u32(..));
    let consumer: StreamConsumer = config(&args.brokers, &group).create()?;
    consumer.subscribe(&[topic])?;
    let permits = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut tracks: HashMap<i32, Track> = HashMap::new();
    let committed = Arc::new(AtomicU64::new(0));
    let mut started = None;
    let mut last_commit = Instant::now();
    let work = Arc::new(AtomicU64::new(0));
    while committed.load(Ordering::Relaxed) < args.records {
        let mut batch = Vec::new();
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), consumer.recv()).await {
            batch.push(m?.detach());
        }
        while batch.len() < 64 {
            match consumer.recv().now_or_never() {
                Some(m) => batch.push(m?.detach()),
                None => break,
            }
        }
        if !batch.is_empty() {
            started.get_or_insert_with(Instant::now);
        }
        for m in batch {
            let track = tracks.entry(m.partition()).or_default().clone();
            let permit = permits.clone().acquire_owned().await?;
            let offset = m.offset();
            track
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .insert(offset, false);
            let work = work.clone();
            tokio::spawn(async move {
                work.fetch_add(
                    handle(m.key().unwrap_or_default()) as u64,
                    Ordering::Relaxed,
                );
                let mut t = track.lock().unwrap_or_else(|p| p.into_inner());
                t.0.insert(offset, true);
                while let Some((&o, &true)) = t.0.iter().next() {
                    t.0.remove(&o);
                    t.1 = o + 1;
                }
                drop(permit);
            });
        }
        let all = batch_done(&tracks, args);
        if last_commit.elapsed() >= Duration::from_millis(100) || all {
            // Every 100 ms, asynchronously; the last one (everything
            // handled) waits for the broker's answer.
            let mut tpl = TopicPartitionList::new();
            for (p, t) in &tracks {
                let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
                if t.1 > t.2 || all {
                    tpl.add_partition_offset(topic, *p, Offset::Offset(t.1))?;
                    t.2 = t.1;
                }
            }
            if all {
                consumer.commit(&tpl, CommitMode::Sync)?;
                committed.store(args.records, Ordering::Relaxed);
            } else if tpl.count() > 0 {
                consumer.commit(&tpl, CommitMode::Async)?;
            }
            last_commit = Instant::now();
        }
    }
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    Ok(args.records as f64 / elapsed.as_secs_f64())
}

/// Whether every record has been handled (the last commit is due).
fn batch_done(tracks: &HashMap<i32, Track>, args: &Args) -> bool {
    tracks
        .values()
        .map(|t| t.lock().unwrap_or_else(|p| p.into_inner()).1 as u64)
        .sum::<u64>()
        >= args.records
}

/// `KafkaConsumer` over `store`. Returns records per second.
async fn with_idem(
    args: &Args,
    topic: &str,
    concurrency: usize,
    batch: usize,
    store: Arc<dyn IdempotencyStore>,
    name: &str,
) -> Result<f64, BoxError> {
    let group = format!("{name}-{concurrency}-{batch}-{:08x}", fastrand::u32(..));
    let consumer = KafkaConsumer::new(
        &config(&args.brokers, &group),
        &[topic],
        Idempotency::from_arc(store),
    )?
    .concurrency(concurrency)
    .partition_concurrency(concurrency)
    .batch(batch)
    .scope(format!("rate.{group}"))?;
    let started: Arc<Mutex<Option<Instant>>> = Arc::default();
    let finished: Arc<Mutex<Option<Instant>>> = Arc::default();
    let records = args.records;
    let stats = {
        let (started, finished) = (started.clone(), finished.clone());
        let consumer = &consumer;
        consumer
            .run(
                move |record: KafkaRecord| {
                    started
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert_with(Instant::now);
                    async move {
                        Ok::<_, std::io::Error>(handle(record.key.as_deref().unwrap_or_default()))
                    }
                },
                async move {
                    loop {
                        let s = consumer.stats();
                        if s.committed_offsets.values().map(|o| *o as u64).sum::<u64>() >= records {
                            finished
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert_with(Instant::now);
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                },
            )
            .await?
    };
    if stats.executed != records {
        return Err(format!("{name}: {stats:?}").into());
    }
    let s = started
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .ok_or("no record")?;
    let f = finished
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .ok_or("not finished")?;
    Ok(records as f64 / (f - s).as_secs_f64())
}

async fn store(
    args: &Args,
    name: &str,
    concurrency: usize,
) -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    let pg = || async {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(concurrency.clamp(2, 128) as u32)
            .connect(&args.postgres_url)
            .await?;
        let store = idemkit::postgres::PgStore::builder(pool)
            .batching(batching(args, idemkit::postgres::default_batching()))
            .build()?;
        store.migrate().await?;
        Ok::<_, BoxError>(store)
    };
    Ok(match name {
        "redis" => Arc::new(
            idemkit::redis::RedisStore::connect(&args.redis_url)
                .await?
                .batching(batching(args, idemkit::redis::default_batching())),
        ),
        "postgres" => Arc::new(pg().await?),
        "tiered" => {
            use idemkit::tiered::{MokaCache, RedisCache, TieredStore};
            Arc::new(
                TieredStore::new(pg().await?)
                    .with_cache(MokaCache::new(100_000, 256 << 20))
                    .with_cache(RedisCache::connect(&args.redis_url).await?),
            )
        }
        other => return Err(format!("unknown store {other} (redis, postgres, tiered)").into()),
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if args.records == 0
        || args.partitions < 1
        || args.concurrency.contains(&0)
        || args.batch.contains(&0)
    {
        return Err("--records, --partitions, --concurrency and --batch must be at least 1".into());
    }
    let topic = format!("rate-{:08x}", fastrand::u32(..));
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .create()?;
    for created in admin
        .create_topics(
            &[NewTopic::new(
                &topic,
                args.partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?
    {
        created.map_err(|(t, e)| format!("create topic {t}: {e}"))?;
    }
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("linger.ms", "5")
        .create()?;
    for from in (0..args.records).step_by(5000) {
        let sends = (from..(from + 5000).min(args.records)).map(|i| {
            let key = format!("m-{i}");
            let producer = producer.clone();
            let topic = topic.clone();
            async move {
                let record: FutureRecord<'_, str, str> = FutureRecord::to(&topic)
                    .partition((i % args.partitions as u64) as i32)
                    .key(key.as_str())
                    .payload("{\"amount\":1999}");
                producer
                    .send(record, Duration::from_secs(30))
                    .await
                    .map(|_| ())
                    .map_err(|(e, _)| e)
            }
        });
        for r in futures::future::join_all(sends).await {
            r?;
        }
    }
    for &c in &args.concurrency {
        let base = plain(&args, &topic, c).await?;
        eprintln!("concurrency {c}: plain {base:.0}/s");
        let mut line = format!(
            "kafka_rate records={} partitions={} concurrency={c} plain_per_sec={base:.0}",
            args.records, args.partitions
        );
        for name in &args.stores {
            for &b in &args.batch {
                if b > 1 && c == 1 {
                    continue; // one record in flight: nothing to batch
                }
                let s = store(&args, name, c).await?;
                let rate = with_idem(&args, &topic, c, b, s, name).await?;
                eprintln!("concurrency {c}: {name} batch {b}: {rate:.0}/s");
                line.push_str(&format!(
                    " {name}_b{b}_per_sec={rate:.0} {name}_b{b}_ratio={:.2}",
                    rate / base
                ));
            }
        }
        println!("{line}");
    }
    Ok(())
}
