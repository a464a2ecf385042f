//! The Redis Streams consumer against a real Redis: two consumers of one
//! group, one killed mid-batch; every entry's effect exactly once, every
//! entry acknowledged, nothing left pending.

use crate::support;

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
    // It runs on a runtime of its own, with a store of its own, as a
    // process would: its handlers run detached, so only killing that
    // runtime (the process) stops them.
    let stalled = Arc::new(tokio::sync::Notify::new());
    let a_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    {
        let (effects, done, stalled) = (effects.clone(), done.clone(), stalled.clone());
        let stream = stream.clone();
        a_runtime.spawn(async move {
            let store = RedisStore::connect(support::redis_server::shared_url())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let consumer = StreamConsumer::connect(
                support::redis_server::shared_url(),
                &stream,
                group,
                "consumer-a",
                Idempotency::new(store).lease(Duration::from_secs(2)),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .key_field("message_id")
            .batch(16)
            .concurrency(8);
            consumer
                .run(
                    move |entry: StreamEntry| {
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
        });
    }
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
    a_runtime.shutdown_background();
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
            {
                let (effects, done) = (effects.clone(), done.clone());
                move |entry: StreamEntry| {
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

// ------------------------------------------------------------ issue 13, item 10

/// Runs `consumer` until `done` holds (checked every 20 ms, for at most
/// `limit`), then shuts it down and returns what `run` returned. A `run`
/// that ends before `done` holds is an error.
async fn run_until<S, R, F, Fut, T, E>(
    consumer: &StreamConsumer<S, idem::JsonCodec, R>,
    handler: F,
    limit: Duration,
    done: impl Fn() -> futures::future::BoxFuture<'static, bool>,
) -> Result<idem::redis::streams::ConsumerStats, String>
where
    S: IdempotencyStore + ?Sized,
    R: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    F: Fn(StreamEntry) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<T, E>> + Send + 'static,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(handler, async move {
        let _ = stop_rx.await;
    });
    tokio::pin!(run);
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        tokio::select! {
            ended = &mut run => {
                return Err(format!("run ended before the condition held: {:?}", ended.map_err(|e| e.to_string())));
            }
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        if done().await {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            let _ = stop_tx.send(());
            let stats = tokio::time::timeout(Duration::from_secs(30), run).await;
            return Err(format!(
                "the condition did not hold within {limit:?}; run: {:?}",
                stats.map(|r| r.map_err(|e| e.to_string()))
            ));
        }
    }
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .map_err(|_| "run did not stop within 30 s of the shutdown".to_owned())?
        .map_err(|e| e.to_string())
}

async fn xadd(stream: &str, fields: &[(&str, &str)]) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn redis_store() -> RedisStore {
    RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn consumer_on(
    stream: &str,
    name: &str,
    idem: Idempotency<RedisStore>,
) -> StreamConsumer<RedisStore> {
    StreamConsumer::connect(support::redis_server::shared_url(), stream, "g", name, idem)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
}

/// A handler that counts its runs and answers "ok".
fn counting(
    runs: &Arc<AtomicU64>,
) -> impl Fn(StreamEntry) -> futures::future::BoxFuture<'static, Result<String, std::io::Error>>
       + Send
       + Sync
       + 'static {
    let runs = runs.clone();
    move |_entry: StreamEntry| {
        let runs = runs.clone();
        Box::pin(async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok("ok".to_owned())
        })
    }
}

/// Done once `runs` reached `n` and nothing is pending in group `g`.
fn ran_and_nothing_pending(
    stream: &str,
    runs: &Arc<AtomicU64>,
    n: u64,
) -> impl Fn() -> futures::future::BoxFuture<'static, bool> {
    let (stream, runs) = (stream.to_owned(), runs.clone());
    move || {
        let (stream, runs) = (stream.clone(), runs.clone());
        Box::pin(
            async move { runs.load(Ordering::SeqCst) >= n && pending(&stream, "g").await == 0 },
        )
    }
}

/// Item 10 (a): a read that blocks longer than the connection's old fixed
/// response timeout (5.5 s) waits on an idle stream instead of failing,
/// and the entry that arrives after 6 s idle is processed and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_blocking_longer_than_five_seconds_waits_on_an_idle_stream() {
    let stats =
        late_entry_on_an_idle_stream("idle-long", Duration::from_secs(8), Duration::from_secs(60))
            .await;
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
}

/// Item 10 (a): `block(0)` means "wait for entries without a time limit":
/// on a stream idle for 6 s `run` keeps waiting (before: it failed with
/// `Unavailable` after 5.5 s, and the entry delivered to the abandoned read
/// stayed pending), and the entry is processed and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_zero_waits_for_entries_without_a_time_limit() {
    let stats =
        late_entry_on_an_idle_stream("idle-zero", Duration::ZERO, Duration::from_secs(4)).await;
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
}

/// Item 10 (d): two deliveries of one message in the same batch: the second
/// waits for the first and gets its replay, and both are acked at once
/// (before: the second was answered "in progress" and left pending until
/// `claim_idle`, here a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_the_same_batch_waits_for_its_first_delivery() {
    let stream = format!("batch-dup-{:08x}", fastrand::u32(..));
    for _ in 0..2 {
        xadd(&stream, &[("message_id", "twice"), ("amount", "5")]).await;
    }
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_secs(60));
    let runs = Arc::new(AtomicU64::new(0));
    let slow = {
        let runs = runs.clone();
        move |_entry: StreamEntry| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await; // the work
                Ok::<_, std::io::Error>("charged".to_owned())
            }
        }
    };
    let stats = run_until(
        &consumer,
        slow,
        Duration::from_secs(10),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        (
            stats.executed,
            stats.replayed,
            stats.acked,
            stats.left_pending
        ),
        (1, 1, 2, 0),
        "{stats:?}"
    );
}

/// Item 10 (d), from the review: consumer A is dropped (its task aborted)
/// while its handler runs. The handler runs detached: it finishes, its
/// result is recorded, and consumer B, which reclaims the entry, gets the
/// replay: the entry's handler ran once (before: A's handler was cut off,
/// its lease ran out and B ran the entry again: twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dropped_mid_handler_lets_it_finish_and_the_entry_runs_once() {
    let stream = format!("detached-{:08x}", fastrand::u32(..));
    let lease = Duration::from_millis(500);
    let idem = Idempotency::new(redis_store().await).lease(lease);
    let effects = Arc::new(AtomicU64::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let consumer_a = consumer_on(&stream, "a", idem.clone())
        .await
        .block(Duration::from_millis(100));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let a = {
        let (effects, started) = (effects.clone(), started.clone());
        tokio::spawn(async move {
            consumer_a
                .run(
                    move |_e: StreamEntry| {
                        let (effects, started) = (effects.clone(), started.clone());
                        async move {
                            // The effect starts, then takes a while.
                            effects.fetch_add(1, Ordering::SeqCst);
                            started.notify_one();
                            tokio::time::sleep(Duration::from_millis(800)).await;
                            Ok::<_, std::io::Error>("charged".to_owned())
                        }
                    },
                    std::future::pending::<()>(),
                )
                .await
        })
    };
    tokio::time::timeout(Duration::from_secs(5), started.notified())
        .await
        .unwrap_or_else(|_| panic!("consumer A never ran the entry"));
    // Consumer A goes away (its task is stopped at shutdown).
    a.abort();
    let _ = a.await;

    // Another consumer of the group reclaims the entry once it is idle.
    let consumer_b = consumer_on(&stream, "b", idem)
        .await
        .block(Duration::from_millis(100))
        .claim_idle(Duration::from_millis(300));
    let b_runs = Arc::new(AtomicU64::new(0));
    let done = {
        let stream = stream.clone();
        move || {
            let stream = stream.clone();
            Box::pin(async move { pending(&stream, "g").await == 0 })
                as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(
        &consumer_b,
        counting(&b_runs),
        Duration::from_secs(10),
        done,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let n = effects.load(Ordering::SeqCst) + b_runs.load(Ordering::SeqCst);
    println!("consumer B: {stats:?}; handler executions for one entry: {n}");
    assert_eq!(n, 1, "the entry's handler ran {n} times");
    assert_eq!((stats.replayed, stats.acked), (1, 1), "{stats:?}");
}

/// From the review: `claim_idle(Duration::MAX)` ("never take over another
/// consumer's entries") is saturated, not sent as a number XAUTOCLAIM
/// refuses (before: `run` failed at once with a retryable `Unavailable`,
/// "Invalid min-idle-time argument for XAUTOCLAIM").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_idle_of_duration_max_is_saturated_not_an_error() {
    let stream = format!("claim-max-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .claim_idle(Duration::MAX);
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(10),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((stats.executed, stats.acked), (1, 1), "{stats:?}");
}

/// The entries of a stream (`XRANGE - +`), each as its ID and fields.
async fn entries_of(stream: &str) -> Vec<(String, HashMap<String, String>)> {
    let reply: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    reply
        .into_iter()
        .map(|(id, fields)| (id, fields.into_iter().collect()))
        .collect()
}

/// Item 10 (b): an entry whose handler always fails is delivered
/// `max_deliveries` times (its first read, then reclaims), then goes to the
/// dead-letter stream with its ID, its delivery count and the reason, and
/// is acknowledged: nothing is left pending (before: it was reclaimed every
/// `claim_idle` without end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_always_fails_is_dead_lettered_after_max_deliveries() {
    let stream = format!("poison-{:08x}", fastrand::u32(..));
    let poison = xadd(&stream, &[("message_id", "poison"), ("amount", "1")]).await;
    xadd(&stream, &[("message_id", "fine"), ("amount", "2")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_millis(200))
        .max_deliveries(3);
    let runs = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let handler = {
        let runs = runs.clone();
        move |entry: StreamEntry| {
            let runs = runs.clone();
            async move {
                let id = entry.text("message_id").unwrap_or_default().to_owned();
                *runs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(id.clone())
                    .or_default() += 1;
                if id == "poison" {
                    Err(std::io::Error::other("the gateway refuses it"))
                } else {
                    Ok("charged".to_owned())
                }
            }
        }
    };
    let dead = format!("{stream}:dead");
    let done = {
        let (stream, dead) = (stream.clone(), dead.clone());
        move || {
            let (stream, dead) = (stream.clone(), dead.clone());
            Box::pin(async move {
                pending(&stream, "g").await == 0 && !entries_of(&dead).await.is_empty()
            }) as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(20), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let runs = runs.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let dead_entries = entries_of(&dead).await;
    println!("runs {runs:?}; {stats:?}; dead letter {dead_entries:?}");
    assert_eq!(
        runs.get("poison"),
        Some(&3),
        "the poison ran once per delivery"
    );
    assert_eq!(runs.get("fine"), Some(&1));
    assert_eq!(dead_entries.len(), 1, "{dead_entries:?}");
    let fields = &dead_entries[0].1;
    assert_eq!(fields.get("idem.entry"), Some(&poison));
    assert_eq!(fields.get("idem.stream"), Some(&stream));
    assert_eq!(fields.get("idem.deliveries").map(String::as_str), Some("3"));
    let reason = fields.get("idem.reason").cloned().unwrap_or_default();
    assert!(reason.contains("the gateway refuses it"), "{reason}");
    assert_eq!(fields.get("message_id").map(String::as_str), Some("poison"));
    assert_eq!(fields.get("amount").map(String::as_str), Some("1"));
    assert_eq!(
        (stats.executed, stats.dead_lettered, stats.acked),
        (1, 1, 2),
        "{stats:?}"
    );
    assert_eq!(pending(&stream, "g").await, 0);
}

/// Item 10 (b): entries that can never succeed go to the dead-letter
/// stream at once (delivery 1), without running the handler: one without
/// the key field, and one that reuses a key with another payload
/// (mismatch). A duplicate of a key whose result was not recordable is
/// acknowledged (`ResultUnavailable`), never dead-lettered nor run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_that_can_never_succeed_are_dead_lettered_at_once() {
    let stream = format!("never-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "m-1"), ("amount", "10")]).await;
    let no_key = xadd(&stream, &[("amount", "20")]).await;
    let nan_first = xadd(&stream, &[("message_id", "nan"), ("amount", "30")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_secs(60))
        .max_deliveries(5);
    let runs = Arc::new(AtomicU64::new(0));
    // m-1 answers a number; "nan" answers NaN, which JSON cannot record.
    let handler = {
        let runs = runs.clone();
        move |entry: StreamEntry| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(if entry.text("message_id") == Some("nan") {
                    f64::NAN
                } else {
                    1.0
                })
            }
        }
    };
    let dead = format!("{stream}:dead");
    let first_batch = {
        let (stream, runs) = (stream.clone(), runs.clone());
        move || {
            let (stream, runs) = (stream.clone(), runs.clone());
            Box::pin(
                async move { runs.load(Ordering::SeqCst) == 2 && pending(&stream, "g").await == 0 },
            ) as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(
        &consumer,
        handler.clone(),
        Duration::from_secs(10),
        first_batch,
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (stats.executed, stats.dead_lettered, stats.acked),
        (2, 1, 3),
        "{stats:?}"
    );
    // Later: m-1 again with another amount (a mismatch), and a duplicate
    // of "nan" (not replayable).
    let mismatch = xadd(&stream, &[("message_id", "m-1"), ("amount", "11")]).await;
    let nan_again = xadd(&stream, &[("message_id", "nan"), ("amount", "30")]).await;
    let second_batch = {
        let stream = stream.clone();
        move || {
            let stream = stream.clone();
            Box::pin(async move { pending(&stream, "g").await == 0 })
                as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(10), second_batch)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dead_entries = entries_of(&dead).await;
    println!("{stats:?}; dead letter {dead_entries:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "no handler ran again");
    let dead_ids: Vec<&str> = dead_entries
        .iter()
        .filter_map(|(_, f)| f.get("idem.entry").map(String::as_str))
        .collect();
    assert_eq!(dead_ids, vec![no_key.as_str(), mismatch.as_str()]);
    for (_, fields) in &dead_entries {
        assert_eq!(fields.get("idem.deliveries").map(String::as_str), Some("1"));
    }
    let reasons: Vec<&str> = dead_entries
        .iter()
        .filter_map(|(_, f)| f.get("idem.reason").map(String::as_str))
        .collect();
    assert!(reasons[0].contains("no usable key"), "{reasons:?}");
    assert!(reasons[1].contains("different payload"), "{reasons:?}");
    assert!(!dead_ids.contains(&nan_first.as_str()) && !dead_ids.contains(&nan_again.as_str()));
    assert_eq!(
        (
            stats.executed,
            stats.replayed,
            stats.dead_lettered,
            stats.acked
        ),
        (2, 1, 2, 5),
        "{stats:?}"
    );
    assert_eq!(pending(&stream, "g").await, 0);
}

/// Item 10 (c): a consumer over a connection of yours: a
/// `MultiplexedConnection` (made without a response timeout) and a Redis
/// Cluster connection. Both process, dead-letter and acknowledge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_takes_an_existing_standalone_or_cluster_connection() {
    use idem::redis::redis::AsyncConnectionConfig;
    // Standalone.
    let stream = format!("own-conn-{:08x}", fastrand::u32(..));
    xadd(&stream, &[("message_id", "m-1")]).await;
    xadd(&stream, &[("amount", "no key")]).await;
    let mine = redis::Client::open(support::redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection_with_config(
            &AsyncConnectionConfig::new().set_response_timeout(None),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::new(
        mine,
        &stream,
        "g",
        "c",
        Idempotency::new(redis_store().await),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_field("message_id")
    .block(Duration::from_millis(50));
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(10),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (stats.executed, stats.dead_lettered, stats.acked),
        (1, 1, 2),
        "{stats:?}"
    );

    // Redis Cluster: the stream and its dead-letter stream on their own
    // slots.
    let nodes = support::redis_server::shared_cluster().to_vec();
    let mut cluster = redis::cluster::ClusterClient::builder(nodes)
        .build()
        .unwrap_or_else(|e| panic!("{e}"))
        .get_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let stream = format!("cluster-conn-{:08x}", fastrand::u32(..));
    for fields in [
        &[("message_id", "m-1")][..],
        &[("message_id", "m-1")],
        &[("amount", "no key")],
    ] {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&stream).arg("*");
        for (k, v) in fields {
            cmd.arg(*k).arg(*v);
        }
        let _: String = cmd
            .query_async(&mut cluster)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let store = RedisStore::connect_cluster(
        support::redis_server::shared_cluster()
            .iter()
            .map(String::as_str),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::new(cluster.clone(), &stream, "g", "c", Idempotency::new(store))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
        .block(Duration::from_millis(50));
    let runs = Arc::new(AtomicU64::new(0));
    let done = {
        let (stream, runs, cluster) = (stream.clone(), runs.clone(), cluster.clone());
        move || {
            let (stream, runs, mut cluster) = (stream.clone(), runs.clone(), cluster.clone());
            Box::pin(async move {
                let summary: (i64, redis::Value, redis::Value, redis::Value) =
                    redis::cmd("XPENDING")
                        .arg(&stream)
                        .arg("g")
                        .query_async(&mut cluster)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                runs.load(Ordering::SeqCst) == 1 && summary.0 == 0
            }) as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(&consumer, counting(&runs), Duration::from_secs(10), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let dead: i64 = redis::cmd("XLEN")
        .arg(format!("{stream}:dead"))
        .query_async(&mut cluster)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dead, 1);
    assert_eq!(
        (
            stats.executed,
            stats.replayed,
            stats.dead_lettered,
            stats.acked
        ),
        (1, 1, 1, 3),
        "{stats:?}"
    );
}

/// Review 2, R2-3. The consumer's default scope is `stream.{stream}`, so
/// that one stream's keys never meet another's; but a stream whose name is
/// not a valid scope (a `/`, a space, over 57 bytes) silently fell back to
/// the one scope `stream`, shared by every such stream. Two consumers of
/// one app (same store, same key field) on `orders/eu` and `refunds/eu`
/// then share keys: the refund whose message ID equals an order's is never
/// run. With the same fields it is "replayed" (the order's result is
/// returned and the entry acked); with other fields it is a payload
/// mismatch, dead-lettered without running. DESIGN 2: `scope` names the
/// operation and the pair is unique; a consumer must not merge two
/// streams' operations behind the user's back (refuse the name, or make a
/// valid, distinct scope from it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streams_whose_names_are_not_scopes_never_share_keys() {
    // Now each gets `stream:` and a hash of its name (`default_scope`).
    let tag = format!("{:08x}", fastrand::u32(..));
    let (orders, refunds) = (format!("orders/eu-{tag}"), format!("refunds/eu-{tag}"));
    let idem = Idempotency::new(redis_store().await);
    let id = format!("msg-{tag}");
    // Same message ID on both streams: one with the same fields, one not.
    xadd(&orders, &[("message_id", &id), ("amount", "10")]).await;
    xadd(&refunds, &[("message_id", &id), ("amount", "10")]).await;
    let id2 = format!("msg2-{tag}");
    xadd(&orders, &[("message_id", &id2), ("amount", "20")]).await;
    xadd(&refunds, &[("message_id", &id2), ("amount", "5")]).await;

    let mut runs = Vec::new();
    for stream in [&orders, &refunds] {
        let consumer = consumer_on(stream, "c", idem.clone())
            .await
            .block(Duration::from_millis(50));
        let n = Arc::new(AtomicU64::new(0));
        let done = {
            let stream = stream.to_string();
            move || {
                let stream = stream.clone();
                Box::pin(async move { pending(&stream, "g").await == 0 })
                    as futures::future::BoxFuture<'static, bool>
            }
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let stats = run_until(&consumer, counting(&n), Duration::from_secs(10), done)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        println!(
            "{stream}: handler ran {} times; {stats:?}",
            n.load(Ordering::SeqCst)
        );
        runs.push(n.load(Ordering::SeqCst));
    }
    let dead = entries_of(&format!("{refunds}:dead")).await;
    println!("refunds dead letter: {dead:?}");
    assert_eq!(
        runs,
        vec![2, 2],
        "each stream has two distinct messages; the refunds' handler ran {} times",
        runs[1]
    );
}

/// Review 2, R2-4. Stream field names are binary-safe in Redis, but the
/// consumer turned each name into a `String` with `from_utf8_lossy`: two
/// distinct non-UTF-8 names became the same "\u{FFFD}". So (a) an entry
/// with two such fields reached the handler with one of them gone, and
/// (b) with `key_from_content`, two different messages got one key and
/// one fingerprint: the second was "replayed" and its handler never ran.
/// Now such an entry is never merged: it is dead-lettered at once, with
/// the reason and its fields byte for byte, and its handler never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_with_non_utf8_field_names_are_dead_lettered_never_merged() {
    let stream = format!("binary-{:08x}", fastrand::u32(..));
    let tag = format!("{:08x}", fastrand::u32(..));
    for name in [&b"\xffname"[..], &b"\xfename"[..]] {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg(name)
            .arg(tag.as_bytes())
            .query_async(&mut conn().await)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg(&b"\xffa"[..])
        .arg("1")
        .arg(&b"\xfea"[..])
        .arg("2")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let consumer = StreamConsumer::connect(
        support::redis_server::shared_url(),
        &stream,
        "g",
        "c",
        Idempotency::new(redis_store().await),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_from_content()
    .block(Duration::from_millis(50));
    let seen = Arc::new(Mutex::new(Vec::<usize>::new()));
    let handler = {
        let seen = seen.clone();
        move |entry: StreamEntry| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(entry.fields.len());
                Ok::<_, std::io::Error>(format!("{:?}", entry.fields))
            }
        }
    };
    let done = {
        let stream = stream.clone();
        move || {
            let stream = stream.clone();
            Box::pin(async move { pending(&stream, "g").await == 0 })
                as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(10), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    println!("field counts seen by the handler: {seen:?}; {stats:?}");
    assert!(
        seen.is_empty(),
        "an entry with merged field names reached the handler: {seen:?}"
    );
    assert_eq!(stats.dead_lettered, 3, "{stats:?}");
    // The dead letters carry the reason and every field, byte for byte.
    let dead: redis::Value = redis::cmd("XRANGE")
        .arg(format!("{stream}:dead"))
        .arg("-")
        .arg("+")
        .query_async(&mut conn().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    fn flat(v: &redis::Value, out: &mut Vec<Vec<u8>>) {
        match v {
            redis::Value::BulkString(b) => out.push(b.clone()),
            redis::Value::Array(items) => items.iter().for_each(|i| flat(i, out)),
            redis::Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
                flat(k, out);
                flat(v, out)
            }),
            _ => {}
        }
    }
    let mut words = Vec::new();
    flat(&dead, &mut words);
    let reasons = words
        .iter()
        .filter(|w| String::from_utf8_lossy(w).contains("is not UTF-8"))
        .count();
    assert_eq!(reasons, 3, "{words:?}");
    for name in [
        &b"\xffname"[..],
        &b"\xfename"[..],
        &b"\xffa"[..],
        &b"\xfea"[..],
    ] {
        assert!(
            words.iter().any(|w| w == name),
            "{name:?} is not in the dead letters: {words:?}"
        );
    }
}

/// A consumer with `block` and `claim_idle` reads a stream that stays idle
/// for 6 s before one entry arrives; returns its stats once the entry ran
/// and nothing is pending (checked by `ran_and_nothing_pending`).
async fn late_entry_on_an_idle_stream(
    tag: &str,
    block: Duration,
    claim_idle: Duration,
) -> idem::redis::streams::ConsumerStats {
    let stream = format!("{tag}-{:08x}", fastrand::u32(..));
    let consumer = consumer_on(&stream, "c", Idempotency::new(redis_store().await))
        .await
        .block(block)
        .claim_idle(claim_idle);
    let producer = {
        let stream = stream.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(6)).await; // the stream stays idle
            xadd(&stream, &[("message_id", "late")]).await
        })
    };
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(30),
        ran_and_nothing_pending(&stream, &runs, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    producer.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pending(&stream, "g").await, 0);
    stats
}

/// Issue 14: a read batch costs one `acquire_many` for all its entries
/// (and a duplicate of one of them in the batch one more), not one acquire
/// per entry; completions go in batches as the handlers finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_batch_is_acquired_with_one_acquire_many() {
    let stream = format!("batched-{:08x}", fastrand::u32(..));
    for i in 0..20 {
        xadd(&stream, &[("message_id", &format!("m-{i}"))]).await;
    }
    xadd(&stream, &[("message_id", "m-3")]).await; // a duplicate in the batch
    let store = Arc::new(idem::testkit::Tap::new(redis_store().await));
    let idem = Idempotency::from_arc(store.clone());
    let consumer =
        StreamConsumer::connect(support::redis_server::shared_url(), &stream, "g", "c", idem)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .key_field("message_id")
            .batch(32);
    let runs = Arc::new(AtomicU64::new(0));
    let stats = run_until(
        &consumer,
        counting(&runs),
        Duration::from_secs(30),
        ran_and_nothing_pending(&stream, &runs, 20),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    println!(
        "{stats:?}; acquire_many calls {}, items {}; complete_many calls {}, items {}",
        store.acquire_batches(),
        store.acquires(),
        store.complete_batches(),
        store.completes()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 20);
    assert_eq!((stats.executed, stats.replayed, stats.acked), (20, 1, 21));
    assert_eq!(
        store.acquire_batches(),
        2,
        "the batch, then the duplicate's round"
    );
    assert_eq!(store.acquires(), 21, "no acquire of its own");
    assert_eq!(store.completes(), 20);
    assert!(store.complete_batches() <= 20);
}

/// Review (issue 14): the consumer acquires a whole batch at once
/// (`acquire_many`), then starts its handlers `concurrency` at a time
/// (a semaphore inside the handler). An entry queued behind a slow
/// handler holds a lease that counts down while it waits: with the
/// heartbeat off (a handler faster than the lease, the case that setting
/// is for) the lease ends before its handler starts, another consumer
/// takes the key over and runs the handler, and then this consumer starts
/// the same handler anyway, with a lease already taken over: the effect
/// runs twice. Before issue 14 a key was acquired when its handler was
/// about to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_queued_behind_a_slow_handler_never_runs_after_its_lease_was_taken_over() {
    let run = format!("{:08x}", fastrand::u32(..));
    let stream = format!("queued-{run}");
    let scope = "review.queued";
    let mut c = conn().await;
    for id in ["x-1", "x-2"] {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("message_id")
            .arg(format!("{run}-{id}"))
            .query_async(&mut c)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let store = || async {
        RedisStore::connect(support::redis_server::shared_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let lease = Duration::from_millis(400);
    let consumer = Arc::new(
        StreamConsumer::connect(
            support::redis_server::shared_url(),
            &stream,
            "g",
            "consumer-a",
            Idempotency::new(store().await)
                .lease(lease)
                .heartbeat(false),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .key_field("message_id")
        .scope(scope)
        .batch(2)
        .concurrency(1)
        .block(Duration::from_millis(50))
        .claim_idle(Duration::from_secs(60)),
    );
    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let gate = Arc::new(tokio::sync::Notify::new());
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = {
        let (consumer, effects, gate) = (consumer.clone(), effects.clone(), gate.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    move |entry: StreamEntry| {
                        let (effects, gate, first, started_tx) = (
                            effects.clone(),
                            gate.clone(),
                            first.clone(),
                            started_tx.clone(),
                        );
                        async move {
                            let id = entry.text("message_id").unwrap_or_default().to_owned();
                            let _ = started_tx.send(id.clone());
                            // The first handler to run is slow (it holds
                            // the only slot); the other waits behind it.
                            if first.swap(false, Ordering::SeqCst) {
                                gate.notified().await;
                            }
                            *effects
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .entry(id)
                                .or_default() += 1;
                            Ok::<_, std::io::Error>(())
                        }
                    },
                    async move {
                        let _ = stop_rx.await;
                    },
                )
                .await
        })
    };
    let slow = started_rx
        .recv()
        .await
        .unwrap_or_else(|| panic!("no handler ran"));
    let queued = if slow.ends_with("x-1") {
        format!("{run}-x-2")
    } else {
        format!("{run}-x-1")
    };
    // Another consumer's delivery of the queued entry's key: it waits
    // while the key is held, and takes it over once the lease is over.
    let other = Idempotency::new(store().await)
        .lease(Duration::from_secs(30))
        .on_in_progress(idem::InProgressPolicy::Wait {
            max_wait: Duration::from_secs(20),
            poll: Duration::from_millis(20),
        });
    let key = idem::IdempotencyKey::new(scope, queued.as_str()).unwrap_or_else(|e| panic!("{e}"));
    let taken = other
        .process_with(&key, None, |_| {
            let (effects, queued) = (effects.clone(), queued.clone());
            async move {
                *effects
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(queued)
                    .or_default() += 1;
                Ok::<_, std::io::Error>(())
            }
        })
        .await;
    assert!(
        matches!(taken, Ok(idem::Processed::Executed(()))),
        "the other consumer: {taken:?}"
    );
    // The slow handler ends; wait until the consumer settled both entries.
    gate.notify_one();
    let settled = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let s = consumer.stats();
            if s.executed + s.replayed + s.left_pending + s.dead_lettered >= 2 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let _ = stop_tx.send(());
    let _ = running.await;
    assert!(
        settled.is_ok(),
        "the consumer never settled its batch: {:?}",
        consumer.stats()
    );
    let ran = effects
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&queued)
        .copied();
    assert_eq!(
        ran,
        Some(1),
        "the queued entry's effect ran {ran:?} times (stats {:?})",
        consumer.stats()
    );
}

/// The store goes away right after the handler's effect, for 3 s, three
/// times the 1 s lease: the executor gives up completing before the lease
/// ends (`IdemError::Unrecorded`). The entry stays pending and comes back
/// to this consumer (XAUTOCLAIM after 300 ms idle) while the lease is over:
/// it must not run again (before: processed again, the expired lease taken
/// over, the effect run a second time). Its completion is written with the
/// first run's lease once the store is back, then the entry is acked, and
/// a duplicate gets the recorded result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_past_the_lease_during_completion_never_runs_the_entry_twice() {
    let stream = format!("outage-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idem::MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = StreamConsumer::connect(
        support::redis_server::shared_url(),
        &stream,
        "g",
        "a",
        idem.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_field("message_id")
    .block(Duration::from_millis(100))
    .claim_idle(Duration::from_millis(300));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move |_e: StreamEntry| {
            let (effects, down) = (effects.clone(), down.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The first run: the store goes down now, for 3 s.
                    down.store(true, Ordering::SeqCst);
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(3));
                        down.store(false, Ordering::SeqCst);
                    });
                }
                Ok::<_, std::io::Error>("charged".to_owned())
            }
        }
    };
    let stats = run_until(
        &consumer,
        handler,
        Duration::from_secs(20),
        ran_and_nothing_pending(&stream, &effects, 1),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect ran twice: {stats:?}"
    );
    assert_eq!(stats.executed, 1, "{stats:?}");
    let key = idem::IdempotencyKey::new(format!("stream.{stream}"), "m-1")
        .unwrap_or_else(|e| panic!("{e}"));
    let record = idem.get(&key).await.unwrap_or_else(|e| panic!("{e}"));
    let response = match record.map(|r| r.state) {
        Some(idem::RecordState::Completed { response, .. }) => response,
        other => panic!("the entry's record: {other:?}"),
    };
    assert_eq!(&response[..], b"\"charged\"", "the first run's result");
}

// review16
/// Entry A (`message_id` m-1) runs; the store goes down right after its
/// effect, so its completion is not written before the 1 s lease ends
/// (`IdemError::Unrecorded`): A is kept in the consumer's `unfinished` map,
/// to be finished with its own lease. While the consumer waits in its
/// `XREADGROUP BLOCK`, the store comes back and the producer sends the
/// same message again (entry B, a retry with the same `message_id`).
/// Expected: B gets "in progress" or the replay of A, never a second
/// effect (DESIGN 2/4/5b: one effect per key; `Unrecorded`: "do not run
/// the message again"). The skip of unfinished deliveries is by entry ID
/// only, and `finish_unfinished` runs only at the top of the loop, so B is
/// processed first and takes the expired lease over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review16_a_duplicate_entry_of_an_unfinished_key_does_not_run_it_again() {
    let stream = format!("rv16-dup-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idem::MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = StreamConsumer::connect(
        support::redis_server::shared_url(),
        &stream,
        "g",
        "a",
        idem.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_field("message_id")
    .block(Duration::from_secs(3))
    .claim_idle(Duration::from_secs(60));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move |_e: StreamEntry| {
            let (effects, down) = (effects.clone(), down.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The first run: the store goes down after the effect.
                    down.store(true, Ordering::SeqCst);
                }
                Ok::<_, std::io::Error>("charged".to_owned())
            }
        }
    };
    // The producer's retry, sent while the consumer blocks on its read,
    // once the first run's lease is over and the store is back.
    let retry = {
        let (effects, down, stream) = (effects.clone(), down.clone(), stream.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while effects.load(Ordering::SeqCst) == 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(1600)).await;
            down.store(false, Ordering::SeqCst);
            xadd(&stream, &[("message_id", "m-1")]).await;
        })
    };
    let t0 = tokio::time::Instant::now();
    let done = {
        let effects = effects.clone();
        move || {
            let effects = effects.clone();
            Box::pin(async move {
                effects.load(Ordering::SeqCst) >= 2 || t0.elapsed() > Duration::from_secs(8)
            }) as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(30), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    retry.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the effect of m-1 ran twice (its duplicate entry took the unfinished key over): {stats:?}"
    );
}

// review16b
/// Entry A (m-1) runs; the store goes down right after its effect, so its
/// completion is not written (`Unrecorded`, A kept to finish). While the
/// store is still down the producer retries (entry B, same m-1): B is
/// held back (its key is unfinished) and left pending in this consumer's
/// PEL. The store comes back, A is finished and acked: B's key now has a
/// recorded result, and B only needs its replay and its ack. Expected: B
/// is settled soon after (DESIGN 5b: ack after the result is recorded or
/// replayed). With `claim_idle` of 60 s (or `Duration::MAX`, "never take
/// over") the consumer never looks at its own held-back entry again until
/// claim_idle passes (or a restart): B stays pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review16b_a_duplicate_held_back_by_an_unfinished_key_is_settled_once_it_finishes() {
    let stream = format!("rv16b-held-{:08x}", fastrand::u32(..));
    let (store, down) = support::flaky::FlakyStore::new(idem::MemoryStore::new());
    let idem = Idempotency::new(store).lease(Duration::from_secs(1));
    let consumer = StreamConsumer::connect(
        support::redis_server::shared_url(),
        &stream,
        "g",
        "a",
        idem.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .key_field("message_id")
    .block(Duration::from_millis(100))
    .claim_idle(Duration::from_secs(60));
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let handler = {
        let (effects, down) = (effects.clone(), down.clone());
        move |_e: StreamEntry| {
            let (effects, down) = (effects.clone(), down.clone());
            async move {
                if effects.fetch_add(1, Ordering::SeqCst) == 0 {
                    down.store(true, Ordering::SeqCst);
                }
                Ok::<_, std::io::Error>("charged".to_owned())
            }
        }
    };
    let came_back = Arc::new(std::sync::Mutex::new(None::<tokio::time::Instant>));
    let producer = {
        let (effects, down, stream, came_back) = (
            effects.clone(),
            down.clone(),
            stream.clone(),
            came_back.clone(),
        );
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while effects.load(Ordering::SeqCst) == 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // A's completion given up (Unrecorded) while the store is down.
            tokio::time::sleep(Duration::from_millis(1500)).await;
            xadd(&stream, &[("message_id", "m-1")]).await;
            // B read and held back, the store still down.
            tokio::time::sleep(Duration::from_millis(1000)).await;
            down.store(false, Ordering::SeqCst);
            *came_back.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(tokio::time::Instant::now());
        })
    };
    let t0 = tokio::time::Instant::now();
    let done = {
        let (stream, came_back) = (stream.clone(), came_back.clone());
        move || {
            let (stream, came_back) = (stream.clone(), came_back.clone());
            Box::pin(async move {
                let back = *came_back.lock().unwrap_or_else(|p| p.into_inner());
                t0.elapsed() > Duration::from_secs(20)
                    || back.is_some_and(|b| b.elapsed() > Duration::from_secs(10))
                    || (back.is_some() && pending(&stream, "g").await == 0)
            }) as futures::future::BoxFuture<'static, bool>
        }
    };
    let stats = run_until(&consumer, handler, Duration::from_secs(40), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    producer.await.unwrap_or_else(|e| panic!("{e}"));
    let left = pending(&stream, "g").await;
    assert_eq!(
        (effects.load(Ordering::SeqCst), left),
        (1, 0),
        "(effects, entries still pending) 10 s after the store came back and A was finished: {stats:?}"
    );
}
