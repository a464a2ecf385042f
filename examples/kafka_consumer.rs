//! A Kafka consumer made idempotent: a producer sends payment messages,
//! each one to four times (resends after lost acknowledgements),
//! to any partition of the topic; a consumer charges them, is killed
//! mid-run with charges in flight and nothing committed since its last
//! commit, and is started again. It checks that every message was charged
//! exactly once and the group's committed lag is 0.
//!
//! ```text
//! cargo run --features kafka,redis --example kafka_consumer -- \
//!     --brokers 127.0.0.1:9092 --redis-url redis://127.0.0.1:6379/
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use idemkit::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idemkit::kafka::rdkafka::client::DefaultClientContext;
use idemkit::kafka::rdkafka::config::ClientConfig;
use idemkit::kafka::rdkafka::message::{Header, OwnedHeaders};
use idemkit::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idemkit::kafka::{group_committed, KafkaConsumer, KafkaRecord, RecordError};
use idemkit::redis::RedisStore;
use idemkit::{Idempotency, IdempotencyStore};

#[derive(Debug, Parser)]
#[command(about = "A payment topic with duplicates and a consumer killed mid-run")]
struct Args {
    /// The Kafka brokers, host:port[,host:port...].
    #[arg(long, env = "IDEM_KAFKA_BROKERS")]
    brokers: String,
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: String,
    /// Distinct payment messages.
    #[arg(long, default_value_t = 500)]
    messages: u64,
    /// The consumer is killed once this many charges are done.
    #[arg(long, default_value_t = 150)]
    kill_after: u64,
    /// Partitions of the topic.
    #[arg(long, default_value_t = 3)]
    partitions: i32,
}

type Ledger = Arc<Mutex<HashMap<String, u32>>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The charge handler: "calls the gateway", then books the charge. Once
/// `kill_after` charges are done, calls wait before they charge, as calls
/// in flight to a gateway would when the process dies.
async fn charge(
    record: KafkaRecord,
    ledger: Ledger,
    charged: Arc<AtomicU64>,
    kill_after: u64,
    in_flight: Arc<tokio::sync::Notify>,
) -> Result<String, RecordError> {
    if charged.load(Ordering::SeqCst) >= kill_after {
        in_flight.notify_one();
        std::future::pending::<()>().await;
    }
    let id = record.header_text("message-id")?.to_owned();
    let amount: u64 = record.json()?;
    *ledger
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(id.clone())
        .or_default() += 1;
    charged.fetch_add(1, Ordering::SeqCst);
    Ok(format!(
        "charged {amount} for {id} (fence {})",
        record.fence
    ))
}

fn client_config(brokers: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000");
    c
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if args.partitions < 1 || args.messages == 0 {
        return Err("--partitions and --messages must be at least 1".into());
    }
    let run = format!("{:08x}", fastrand::u32(..));
    let topic = format!("payments-{run}");
    let group = format!("billing-{run}");
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

    // The producer: each payment one to four times, to any partition.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("linger.ms", "5")
        .create()?;
    let mut sends = Vec::new();
    for m in 0..args.messages {
        for _ in 0..fastrand::u64(1..=4) {
            let id = format!("pay-{m}");
            let amount = (100 + m).to_string();
            let partition = fastrand::i32(0..args.partitions);
            let producer = producer.clone();
            let topic = topic.clone();
            sends.push(async move {
                let headers = OwnedHeaders::new().insert(Header {
                    key: "message-id",
                    value: Some(&id),
                });
                let record: FutureRecord<'_, str, str> = FutureRecord::to(&topic)
                    .partition(partition)
                    .key(id.as_str())
                    .payload(amount.as_str())
                    .headers(headers);
                producer
                    .send(record, Duration::from_secs(30))
                    .await
                    .map_err(|(e, _)| e)
            });
        }
    }
    let sent = sends.len();
    // One past the last offset written, per partition, from the delivery
    // reports: what the group must have committed at the end. (Not the
    // broker's high watermark: Tansu 0.6 under-reports it for a batch of
    // several records.)
    let mut ends: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for r in futures::future::join_all(sends).await {
        let d = r?;
        let end = ends.entry((topic.clone(), d.partition)).or_default();
        *end = (*end).max(d.offset + 1);
    }
    println!(
        "producer: {sent} records on {topic} ({} partitions) for {} payments",
        args.partitions, args.messages
    );

    let store: Arc<dyn IdempotencyStore> = Arc::new(RedisStore::connect(&args.redis_url).await?);
    let store_view = store.clone();
    let ledger: Ledger = Arc::default();
    let charged = Arc::new(AtomicU64::new(0));
    // First run: killed once `kill_after` charges are done, with charges in
    // flight. Handlers run detached (a dropped `run` lets them finish), so
    // the kill is a process's death: the consumer, its store and its
    // handlers live on a runtime of their own, which is shut down; its
    // client goes without committing what it did since its last commit.
    let first_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let in_flight = Arc::new(tokio::sync::Notify::new());
    {
        let (ledger, charged, in_flight) = (ledger.clone(), charged.clone(), in_flight.clone());
        let kill_after = args.kill_after;
        let (url, config, topic) = (
            args.redis_url.clone(),
            client_config(&args.brokers, &group),
            topic.clone(),
        );
        first_runtime.spawn(async move {
            let store = RedisStore::connect(&url).await?;
            let idem = Idempotency::new(store).lease(Duration::from_secs(3));
            let first = KafkaConsumer::new(&config, &[&topic], idem)?
                .key_header("message-id")
                .concurrency(16)
                .commit_interval(Duration::from_millis(200));
            first
                .run(
                    move |record| {
                        charge(
                            record,
                            ledger.clone(),
                            charged.clone(),
                            kill_after,
                            in_flight.clone(),
                        )
                    },
                    std::future::pending::<()>(),
                )
                .await?;
            Ok::<_, BoxError>(())
        });
    }
    tokio::time::timeout(Duration::from_secs(120), in_flight.notified())
        .await
        .map_err(|_| "the first consumer did not reach --kill-after within 120 s")?;
    // Killed once the charges that ran are recorded, with the rest in
    // flight before their charge. (A kill between a charge and its record
    // would make that charge run again after the takeover: the
    // at-least-once hazard that RELIABILITY.md describes; the handler is
    // told by the record's `attempt`.)
    let scope = idemkit::kafka::default_scope(&topic);
    loop {
        let ran: Vec<String> = ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        let mut recorded = 0;
        for id in &ran {
            let key = idemkit::IdempotencyKey::new(scope.as_str(), id.as_str())?;
            if let Ok(Some(record)) = store_view.get(&key).await {
                recorded += usize::from(record.is_completed());
            }
        }
        if recorded == ran.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first_runtime.shutdown_background();
    let at_kill = charged.load(Ordering::SeqCst);
    println!("consumer killed after {at_kill} charges, with charges in flight");

    // Restarted in the same group: reads from the last commit; what the
    // first one recorded is replayed, what it left in flight runs once its
    // lease is over.
    let idem = Idempotency::from_arc(store).lease(Duration::from_secs(3));
    let second = KafkaConsumer::new(&client_config(&args.brokers, &group), &[&topic], idem)?
        .key_header("message-id")
        .concurrency(16)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(500));
    let group_config = client_config(&args.brokers, &group);
    let messages = args.messages;
    let (ledger2, charged2) = (ledger.clone(), charged.clone());
    let watch_ledger = ledger.clone();
    let stats = tokio::time::timeout(
        Duration::from_secs(180),
        second.run(
            move |record| {
                charge(
                    record,
                    ledger2.clone(),
                    charged2.clone(),
                    u64::MAX,
                    Arc::default(),
                )
            },
            async {
                loop {
                    let all = watch_ledger.lock().unwrap_or_else(|p| p.into_inner()).len() as u64
                        == messages;
                    let committed =
                        group_committed(&group_config, &topic, Duration::from_secs(5)).await;
                    if all && committed.is_ok_and(|c| c == ends) {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        ),
    )
    .await
    .map_err(|_| "the restarted consumer did not finish within 180 s")??;
    println!(
        "consumer restarted: received {}, charged {}, replayed {} (duplicates and the first run's uncommitted records), committed {}",
        stats.received, stats.executed, stats.replayed, stats.committed
    );

    let charges = ledger.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let once = charges.values().filter(|&&n| n == 1).count() as u64;
    let twice = charges.values().filter(|&&n| n > 1).count();
    let committed = group_committed(
        &client_config(&args.brokers, &group),
        &topic,
        Duration::from_secs(5),
    )
    .await?;
    let lag: i64 = ends
        .iter()
        .map(|(tp, end)| end - committed.get(tp).copied().unwrap_or(0))
        .sum();
    let ok = once == args.messages && twice == 0 && lag == 0;
    println!("check: {}", if ok { "PASS" } else { "FAIL" });
    println!(
        "  payments charged exactly once   {once} of {}",
        args.messages
    );
    println!("  payments charged more than once {twice}");
    println!("  committed lag of the group      {lag}");
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
