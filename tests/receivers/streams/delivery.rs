//! Delivery: a consumer killed or dropped while its handlers run (another
//! reclaims its entries and gets the replays), a duplicate in the same
//! batch, a batch acquired in one call, an entry whose lease was taken
//! over while it waited, and two streams whose names are not scopes.
//! Every entry's effect once, every entry acknowledged.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use idemkit::redis::redis;
use idemkit::redis::streams::{StreamConsumer, StreamEntry};
use idemkit::redis::RedisStore;
use idemkit::{Acquisition, Idempotency, IdempotencyKey, IdempotencyStore};

use super::{
    conn, consumer_on, counting, entries_of, nothing_pending, pending, pending_of,
    ran_and_nothing_pending, redis_store, run_until, xadd, Check,
};

/// Counts an effect of `entry`'s message (its `message_id` field).
fn count_effect(effects: &Mutex<HashMap<String, u32>>, entry: &StreamEntry) {
    let id = entry.text("message_id").unwrap_or_default().to_owned();
    *effects
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(id)
        .or_default() += 1;
}

/// 200 messages, 100 of them sent twice (300 entries); two consumers of one
/// group on a Redis store, the first killed (its runtime shut down) with
/// entries of its batch in flight. The second reclaims what the first left
/// pending: every message's effect once, every entry acknowledged, the
/// duplicates replayed.
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
                            count_effect(&effects, &entry);
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
            let key = idemkit::IdempotencyKey::new(scope.as_str(), id.as_str())
                .unwrap_or_else(|e| panic!("{e}"));
            if let Ok(Some(record)) = store_view.get(&key).await {
                if matches!(record.state, idemkit::RecordState::Completed { .. }) {
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
                        count_effect(&effects, &entry);
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

/// Two deliveries of one message in the same batch: the second waits for
/// the first and gets its replay, and both are acked at once (not "in
/// progress", left pending until `claim_idle`, here a minute).
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

/// Consumer A is dropped (its task aborted) while its handler runs. The
/// handler runs detached: it finishes, its result is recorded, and consumer
/// B, which reclaims the entry, gets the replay: the entry's handler ran
/// once.
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
    let done = nothing_pending(&stream);
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

/// A read batch costs one `acquire_many` for all its entries
/// (and a duplicate of one of them in the batch one more), not one acquire
/// per entry; completions go in batches as the handlers finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_batch_is_acquired_with_one_acquire_many() {
    let stream = format!("batched-{:08x}", fastrand::u32(..));
    for i in 0..20 {
        xadd(&stream, &[("message_id", &format!("m-{i}"))]).await;
    }
    xadd(&stream, &[("message_id", "m-3")]).await; // a duplicate in the batch
    let store = Arc::new(idemkit::testkit::Tap::new(redis_store().await));
    let idem = Idempotency::from_arc(store.clone());
    let consumer = consumer_on(&stream, "c", idem).await.batch(32);
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

/// The consumer acquires a whole batch at once (`acquire_many`), then
/// starts its handlers `concurrency` at a time. An entry queued behind a
/// slow handler holds a lease that counts down while it waits: with the
/// heartbeat off (a handler faster than the lease, the case that setting is
/// for) the lease ends before its handler starts and another consumer takes
/// the key over and runs it. The queued entry must then not run (its lease
/// was taken over): the effect runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_queued_behind_a_slow_handler_never_runs_after_its_lease_was_taken_over() {
    let run = format!("{:08x}", fastrand::u32(..));
    let stream = format!("queued-{run}");
    let scope = "queued.entries";
    for id in ["x-1", "x-2"] {
        xadd(&stream, &[("message_id", &format!("{run}-{id}"))]).await;
    }
    let lease = Duration::from_millis(400);
    let consumer = Arc::new(
        consumer_on(
            &stream,
            "consumer-a",
            Idempotency::new(redis_store().await)
                .lease(lease)
                .heartbeat(false),
        )
        .await
        .scope(scope)
        .unwrap_or_else(|e| panic!("{e}"))
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
    let other = Idempotency::new(redis_store().await)
        .lease(Duration::from_secs(30))
        .on_in_progress(idemkit::InProgressPolicy::Wait {
            max_wait: Duration::from_secs(20),
            poll: Duration::from_millis(20),
        });
    let key =
        idemkit::IdempotencyKey::new(scope, queued.as_str()).unwrap_or_else(|e| panic!("{e}"));
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
        matches!(taken, Ok(idemkit::Processed::Executed(()))),
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

/// The consumer's default scope is `stream.{stream}`, so that one stream's
/// keys never meet another's. Two streams whose names are not valid scopes
/// (a `/`, a space, over 57 bytes), read by two consumers of one app (same
/// store, same key field), must not fall back to one shared scope: each
/// gets its own (`default_scope`: `stream:` and a hash of the name), so a
/// refund whose message ID equals an order's runs, whether its fields are
/// the same or not.
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
        let done = nothing_pending(stream);
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

/// A's `run` future is dropped (a task aborted at shutdown) while entry
/// E's handler runs detached. While A is down, B (same group) reclaims E
/// after `claim_idle`, gets "in progress" (the handler still runs) and
/// leaves it pending in B's list. A's `run` is started again. E is no
/// longer in A's hands (its batch was dropped): A's keeper does not claim
/// it back, so B replays and acks it once the handler recorded. (Before,
/// A's keeper kept claiming E into A's list, which A never read again: E
/// stayed pending as long as A ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_restarted_after_its_run_was_dropped_strands_no_entry() {
    let stream = format!("restart-{:08x}", fastrand::u32(..));
    let idem = Idempotency::new(idemkit::MemoryStore::new()).lease(Duration::from_secs(20));
    let claim_idle = Duration::from_millis(500);
    let a = consumer_on(&stream, "a", idem.clone())
        .await
        .block(Duration::from_millis(100))
        .claim_idle(claim_idle);
    let b = consumer_on(&stream, "b", idem.clone())
        .await
        .block(Duration::from_millis(100))
        .claim_idle(claim_idle);
    xadd(&stream, &[("message_id", "m-1")]).await;
    let effects = Arc::new(AtomicU64::new(0));
    let started = Arc::new(AtomicBool::new(false));
    let handler = {
        let (effects, started) = (effects.clone(), started.clone());
        move |_e: StreamEntry| {
            let (effects, started) = (effects.clone(), started.clone());
            Box::pin(async move {
                started.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(2)).await;
                effects.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>("ok".to_owned())
            }) as BoxFuture<'static, _>
        }
    };
    // A's first run, dropped 100 ms after the handler started.
    {
        let started = started.clone();
        tokio::select! {
            r = a.run(handler.clone(), std::future::pending::<()>()) => panic!("run ended: {r:?}"),
            _ = async move {
                while !started.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            } => {}
        }
    }
    let t0 = tokio::time::Instant::now();
    let run_b = b.run(handler.clone(), tokio::time::sleep(Duration::from_secs(14)));
    let rest = async {
        // B reclaimed E and left it pending (in progress).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while pending_of(&stream, "b").await < 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "B never reclaimed E"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // A starts again.
        let stop =
            tokio::time::sleep(Duration::from_secs(12) - t0.elapsed().min(Duration::from_secs(11)));
        let run_a = a.run(handler.clone(), stop);
        let watch = async {
            // Well after the handler ended and recorded (at ~2 s).
            tokio::time::sleep(Duration::from_secs(8)).await;
            (
                effects.load(Ordering::SeqCst),
                pending(&stream, "g").await,
                pending_of(&stream, "a").await,
                pending_of(&stream, "b").await,
            )
        };
        tokio::join!(run_a, watch)
    };
    let (stats_b, (stats_a, (ran, pending_all, with_a, with_b))) = tokio::join!(run_b, rest);
    assert_eq!(
        (ran, pending_all),
        (1, 0),
        "8 s after the restart E is still pending (with A: {with_a}, with B: {with_b}); A {stats_a:?}, B {stats_b:?}"
    );
}

/// The handler gets its acquisition's attempt and fence, as a Kafka or SQS
/// handler does: 1 and the record's fence on a fresh key; on a key whose
/// earlier worker died holding it (its lease ended), attempt 2 and a fence
/// above the dead worker's, so a downstream system refuses that worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_gets_the_attempt_and_fence_of_its_acquisition() {
    let stream = format!("context-{:08x}", fastrand::u32(..));
    let store = Arc::new(redis_store().await);
    let scope = format!("stream.{stream}");
    let dead_key = IdempotencyKey::new(scope.clone(), "m-dead").unwrap_or_else(|e| panic!("{e}"));
    let lease = Duration::from_millis(300);
    let dead = match store.acquire(&dead_key, None, lease).await {
        Ok(Acquisition::Acquired(l)) => l,
        other => panic!("the dead worker's acquire: {other:?}"),
    };
    tokio::time::sleep(lease + Duration::from_millis(50)).await; // its lease ends
    xadd(&stream, &[("message_id", "m-fresh")]).await;
    xadd(&stream, &[("message_id", "m-dead")]).await;
    let consumer = consumer_on(&stream, "c", Idempotency::from_arc(store.clone())).await;
    let seen = Arc::new(std::sync::Mutex::new(HashMap::new()));
    let handler = {
        let seen = seen.clone();
        move |entry: StreamEntry| {
            let seen = seen.clone();
            async move {
                let id = entry.text("message_id").unwrap_or_default().to_owned();
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id, (entry.attempt, entry.fence));
                Ok::<_, std::io::Error>("ok".to_owned())
            }
        }
    };
    let done = {
        let seen = seen.clone();
        move || -> Check {
            let n = seen.lock().unwrap_or_else(|p| p.into_inner()).len();
            Box::pin(async move { n == 2 })
        }
    };
    run_until(&consumer, handler, Duration::from_secs(30), done)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let fresh_key = IdempotencyKey::new(scope, "m-fresh").unwrap_or_else(|e| panic!("{e}"));
    let recorded = |key: IdempotencyKey| {
        let store = store.clone();
        async move {
            match store.get(&key).await {
                Ok(Some(record)) => record.fence,
                other => panic!("{key}: {other:?}"),
            }
        }
    };
    let fresh = seen["m-fresh"];
    assert_eq!(fresh.0, 1, "a fresh key's first attempt");
    assert_eq!(
        fresh.1,
        recorded(fresh_key).await,
        "the fence recorded for the key"
    );
    let taken_over = seen["m-dead"];
    assert_eq!(taken_over.0, 2, "a takeover of the dead worker's key");
    assert!(
        taken_over.1 > dead.fence,
        "fence {} above the dead worker's {}",
        taken_over.1,
        dead.fence
    );
    assert_eq!(taken_over.1, recorded(dead_key).await);
}
