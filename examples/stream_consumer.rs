//! A Redis Streams consumer made idempotent: a producer sends payment
//! messages, some of them twice or three times (retries after lost
//! replies); a consumer charges them, is killed mid-run with charges in
//! flight, and is started again. It checks that every message was charged
//! exactly once, every entry acknowledged, and nothing is left pending.
//!
//! ```text
//! cargo run --features redis --example stream_consumer -- --redis-url redis://127.0.0.1:6379/
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use idemkit::redis::redis;
use idemkit::redis::streams::{StreamConsumer, StreamEntry};
use idemkit::redis::RedisStore;
use idemkit::{Idempotency, IdempotencyStore};

#[derive(Debug, Parser)]
#[command(about = "A payment stream with duplicates and a consumer killed mid-run")]
struct Args {
    #[arg(long, env = "IDEM_REDIS_URL")]
    redis_url: String,
    /// Distinct payment messages.
    #[arg(long, default_value_t = 300)]
    messages: u64,
    /// The consumer is killed once this many charges are done.
    #[arg(long, default_value_t = 100)]
    kill_after: u64,
}

type Ledger = Arc<Mutex<HashMap<String, u32>>>;

/// The charge handler: "calls the gateway", then books the charge. While
/// `gate` is closed (the consumer is being killed) calls wait before they
/// charge, as calls in flight to a gateway would.
async fn charge(
    entry: StreamEntry,
    ledger: Ledger,
    charged: Arc<AtomicU64>,
    kill_after: u64,
    in_flight: Arc<tokio::sync::Notify>,
) -> Result<String, std::io::Error> {
    if charged.load(Ordering::SeqCst) >= kill_after {
        in_flight.notify_one();
        std::future::pending::<()>().await;
    }
    let id = entry.text("message_id").unwrap_or_default().to_owned();
    *ledger
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(id.clone())
        .or_default() += 1;
    charged.fetch_add(1, Ordering::SeqCst);
    Ok(format!(
        "charged {} for {id}",
        entry.text("amount").unwrap_or("?")
    ))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let stream = format!("payments-{:08x}", fastrand::u32(..));
    let group = "billing";
    let mut conn = redis::Client::open(args.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let mut sent = 0u64;
    for m in 0..args.messages {
        for _ in 0..fastrand::u64(1..=3) {
            let _: String = redis::cmd("XADD")
                .arg(&stream)
                .arg("*")
                .arg("message_id")
                .arg(format!("pay-{m}"))
                .arg("amount")
                .arg(100 + m)
                .query_async(&mut conn)
                .await?;
            sent += 1;
        }
    }
    println!(
        "producer: {sent} entries on {stream} for {} payments",
        args.messages
    );

    let store: Arc<dyn IdempotencyStore> = Arc::new(RedisStore::connect(&args.redis_url).await?);
    let store_view = store.clone();
    let idem = Idempotency::from_arc(store).lease(Duration::from_secs(5));
    let ledger: Ledger = Arc::default();
    let charged = Arc::new(AtomicU64::new(0));
    // First run: killed once `kill_after` charges are done, with charges in
    // flight and entries of its batch unacknowledged. The consumer runs its
    // handlers detached (a dropped `run` lets them finish), so the kill is
    // a process's death: the consumer, its store and its handlers live on a
    // runtime of their own, which is shut down.
    let first_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let in_flight = Arc::new(tokio::sync::Notify::new());
    {
        let (ledger, charged, in_flight) = (ledger.clone(), charged.clone(), in_flight.clone());
        let kill_after = args.kill_after;
        let (url, stream) = (args.redis_url.clone(), stream.clone());
        first_runtime.spawn(async move {
            let store = RedisStore::connect(&url).await?;
            let idem = Idempotency::new(store).lease(Duration::from_secs(5));
            let first = StreamConsumer::connect(&url, &stream, group, "consumer-1", idem)
                .await?
                .key_field("message_id")
                .batch(32)
                .concurrency(8)
                .block(Duration::from_millis(100))
                .claim_idle(Duration::from_secs(1));
            first
                .run(
                    move |entry| {
                        charge(
                            entry,
                            ledger.clone(),
                            charged.clone(),
                            kill_after,
                            in_flight.clone(),
                        )
                    },
                    std::future::pending::<()>(),
                )
                .await
        });
    }
    in_flight.notified().await;
    // Kill it once the charges that ran are recorded, with the rest of the
    // batch in flight before their charge. (A kill between a charge and its
    // record would make that charge run again after the takeover: the
    // at-least-once hazard that RELIABILITY.md describes, and the handler is
    // told by `Context::attempt`.)
    let scope = format!("stream.{stream}");
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
                recorded += usize::from(matches!(
                    record.state,
                    idemkit::RecordState::Completed { .. }
                ));
            }
        }
        if recorded == ran.len()
            && ran.len() == ledger.lock().unwrap_or_else(|p| p.into_inner()).len()
        {
            break;
        }
        tokio::task::yield_now().await;
    }
    first_runtime.shutdown_background();
    let at_kill = charged.load(Ordering::SeqCst);
    println!("consumer killed after {at_kill} charges, with charges in flight");

    // Restarted under the same name: takes its dead predecessor's pending
    // entries back at once (its own pending list), runs them once their
    // keys' leases are over, and reads the rest.
    let second = StreamConsumer::connect(&args.redis_url, &stream, group, "consumer-1", idem)
        .await?
        .key_field("message_id")
        .batch(32)
        .concurrency(8)
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_secs(1));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let watcher = {
        let (ledger, stream, url) = (ledger.clone(), stream.clone(), args.redis_url.clone());
        let messages = args.messages;
        tokio::spawn(async move {
            let mut conn = redis::Client::open(url.as_str())?
                .get_multiplexed_async_connection()
                .await?;
            loop {
                let all = ledger.lock().unwrap_or_else(|p| p.into_inner()).len() as u64 == messages;
                let pending: (i64, redis::Value, redis::Value, redis::Value) =
                    redis::cmd("XPENDING")
                        .arg(&stream)
                        .arg(group)
                        .query_async(&mut conn)
                        .await?;
                if all && pending.0 == 0 {
                    let _ = stop_tx.send(());
                    return Ok::<_, redis::RedisError>(());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let (ledger2, charged2) = (ledger.clone(), charged.clone());
    let stats = tokio::time::timeout(
        Duration::from_secs(120),
        second.run(
            move |entry| {
                charge(
                    entry,
                    ledger2.clone(),
                    charged2.clone(),
                    u64::MAX,
                    Arc::default(),
                )
            },
            async {
                let _ = stop_rx.await;
            },
        ),
    )
    .await
    .map_err(|_| "the restarted consumer did not finish within 120 s")??;
    watcher.await??;
    println!(
        "consumer restarted: reclaimed {}, charged {}, replayed {} duplicates, acked {}",
        stats.reclaimed, stats.executed, stats.replayed, stats.acked
    );

    let charges = ledger.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let once = charges.values().filter(|&&n| n == 1).count() as u64;
    let twice = charges.values().filter(|&&n| n > 1).count();
    let pending: (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(&stream)
        .arg(group)
        .query_async(&mut conn)
        .await?;
    let ok = once == args.messages && twice == 0 && pending.0 == 0;
    println!("check: {}", if ok { "PASS" } else { "FAIL" });
    println!(
        "  payments charged exactly once   {once} of {}",
        args.messages
    );
    println!("  payments charged more than once {twice}");
    println!("  entries left pending            {}", pending.0);
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await?;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
