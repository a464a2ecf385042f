//! The Redis Streams consumer against a real Redis: two consumers of one
//! group, one killed mid-batch; every entry's effect exactly once, every
//! entry acknowledged, nothing left pending.

#[path = "support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::redis::redis;
use idem::redis::streams::{StreamConsumer, StreamEntry};
use idem::redis::RedisStore;
use idem::{Idempotency, IdempotencyStore};

async fn conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(support::redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Pending entries of the group (`XPENDING` summary count).
async fn pending(stream: &str, group: &str) -> i64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    match reply {
        redis::Value::Array(items) => match items.first() {
            Some(redis::Value::Int(n)) => *n,
            other => panic!("XPENDING: {other:?}"),
        },
        other => panic!("XPENDING: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_one_killed_mid_batch_every_entry_once_and_acked() {
    let run = format!("{:08x}", fastrand::u32(..));
    let stream = format!("payments-{run}");
    let group = "billing";
    let messages = 200u64;
    // The producer sends every message, and 100 of them again (a retry
    // after a lost reply): 300 entries.
    let mut c = conn().await;
    let mut sent = 0;
    for m in (0..messages).chain((0..messages).step_by(2)) {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("message_id")
            .arg(format!("m-{m}"))
            .arg("amount")
            .arg(m * 100)
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        sent += 1;
    }
    let store: Arc<dyn IdempotencyStore> = Arc::new(
        RedisStore::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let store_view = store.clone();
    let idem = Idempotency::from_arc(store).lease(Duration::from_secs(2));
    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let done = Arc::new(AtomicU64::new(0));

    // Consumer A processes 50 messages, then its handlers stall (before
    // their effect) and it is killed with entries of its batch in flight.
    let stalled = Arc::new(tokio::sync::Notify::new());
    let a = {
        let (effects, done, stalled) = (effects.clone(), done.clone(), stalled.clone());
        let consumer = StreamConsumer::connect(
            support::redis_server::shared_url(),
            &stream,
            group,
            "consumer-a",
            idem.clone(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
        .batch(16)
        .concurrency(8);
        tokio::spawn(async move {
            consumer
                .run(
                    |entry: StreamEntry| {
                        let (effects, done, stalled) =
                            (effects.clone(), done.clone(), stalled.clone());
                        async move {
                            if done.load(Ordering::SeqCst) >= 50 {
                                stalled.notify_one();
                                std::future::pending::<()>().await;
                            }
                            let id = entry.text("message_id").unwrap_or_default().to_owned();
                            *effects
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .entry(id)
                                .or_default() += 1;
                            done.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, std::io::Error>(
                                entry.text("amount").unwrap_or_default().to_owned(),
                            )
                        }
                    },
                    std::future::pending::<()>(),
                )
                .await
        })
    };
    stalled.notified().await;
    // Killed once the effects that ran are recorded: a kill between an
    // effect and its record is the at-least-once hazard of any receiver
    // (RELIABILITY.md), not what this test is about.
    let scope = format!("stream.{stream}");
    loop {
        let ran: Vec<String> = effects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        let mut recorded = 0;
        for id in &ran {
            let key = idem::IdempotencyKey::new(scope.as_str(), id.as_str())
                .unwrap_or_else(|e| panic!("{e}"));
            if let Ok(Some(record)) = store_view.get(&key).await {
                if matches!(record.state, idem::RecordState::Completed { .. }) {
                    recorded += 1;
                }
            }
        }
        let now = effects.lock().unwrap_or_else(|p| p.into_inner()).len();
        if recorded == ran.len() && now == ran.len() {
            break;
        }
        tokio::task::yield_now().await;
    }
    a.abort();
    let _ = a.await;
    let after_kill = done.load(Ordering::SeqCst);
    assert!(
        pending(&stream, group).await > 0,
        "the killed consumer left entries pending"
    );

    // Consumer B takes over what A left pending (after 300 ms idle) and
    // reads the rest.
    let b = StreamConsumer::connect(
        support::redis_server::shared_url(),
        &stream,
        group,
        "consumer-b",
        idem,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_field("message_id")
    .batch(16)
    .concurrency(8)
    .block(Duration::from_millis(100))
    .claim_idle(Duration::from_millis(300));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let watcher = {
        let (effects, stream) = (effects.clone(), stream.clone());
        tokio::spawn(async move {
            // Stop B once every message ran and nothing is pending.
            loop {
                let all_ran =
                    effects.lock().unwrap_or_else(|p| p.into_inner()).len() as u64 == messages;
                if all_ran && pending(&stream, group).await == 0 {
                    let _ = stop_tx.send(());
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let stats = tokio::time::timeout(
        Duration::from_secs(60),
        b.run(
            |entry: StreamEntry| {
                let (effects, done) = (effects.clone(), done.clone());
                async move {
                    let id = entry.text("message_id").unwrap_or_default().to_owned();
                    *effects
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(id)
                        .or_default() += 1;
                    done.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>(entry.text("amount").unwrap_or_default().to_owned())
                }
            },
            async {
                let _ = stop_rx.await;
            },
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("consumer B did not finish the stream within 60 s"))
    .unwrap_or_else(|e| panic!("{e}"));
    watcher.await.unwrap_or_else(|e| panic!("{e}"));

    let effects = effects.lock().unwrap_or_else(|p| p.into_inner()).clone();
    assert_eq!(effects.len() as u64, messages, "every message ran");
    let doubled: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "messages whose effect ran twice: {doubled:?}"
    );
    assert_eq!(pending(&stream, group).await, 0, "nothing left pending");
    assert!(stats.reclaimed > 0, "B reclaimed what A left: {stats:?}");
    assert!(
        stats.replayed > 0,
        "the producer's duplicates were replayed: {stats:?}"
    );
    assert_eq!(stats.executed, messages - after_kill, "{stats:?}");
    // Everything sent was delivered to the group and acknowledged.
    let info: redis::Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(&stream)
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let entries_read = match info {
        redis::Value::Array(groups) => groups.into_iter().find_map(|g| match g {
            redis::Value::Array(fields) => fields.chunks(2).find_map(|kv| match kv {
                [redis::Value::BulkString(k), redis::Value::Int(n)] if k == b"entries-read" => {
                    Some(*n)
                }
                _ => None,
            }),
            _ => None,
        }),
        _ => None,
    };
    assert_eq!(
        entries_read,
        Some(sent),
        "every entry sent was delivered to the group"
    );
    println!(
        "streams: {sent} entries, {messages} messages, killed consumer ran {after_kill}; \
         survivor: {stats:?}"
    );
}

/// A shutdown while an entry is in flight: `run` returns only after that
/// entry completed and was acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_entries_in_flight() {
    let stream = format!("shutdown-{:08x}", fastrand::u32(..));
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("message_id")
        .arg("only")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::connect(
        support::redis_server::shared_url(),
        &stream,
        "g",
        "c",
        Idempotency::new(store),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_field("message_id")
    .block(Duration::from_millis(50));
    let started = Arc::new(tokio::sync::Notify::new());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = {
        let (started, gate) = (started.clone(), gate.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    move |_entry: StreamEntry| {
                        let (started, gate) = (started.clone(), gate.clone());
                        async move {
                            started.notify_one();
                            let _permit = gate.acquire().await;
                            Ok::<_, std::io::Error>(1u8)
                        }
                    },
                    async {
                        let _ = stop_rx.await;
                    },
                )
                .await
        })
    };
    started.notified().await;
    let _ = stop_tx.send(());
    assert!(!run.is_finished(), "the entry in flight holds the shutdown");
    gate.add_permits(1);
    let stats = run
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
    assert_eq!(pending(&stream, "g").await, 0);
}
