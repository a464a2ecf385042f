//! Network faults between workers and their store, on real servers in a
//! network namespace made by the test (tests/support/netns.rs): added
//! latency (a userspace forwarder: `tc netem` is not available on these
//! kernels), packet loss and a partition of one worker (`iptables` drops in
//! the namespace), on Redis and PostgreSQL.
//!
//! Each scenario prints a `reliability scenario=... backend=...` line that
//! RELIABILITY.md tabulates. Needs root, iproute2 and iptables (the test
//! command installs them); without them the tests fail and say so.

use crate::support;

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idemkit::postgres::PgStore;
use idemkit::redis::RedisStore;
use idemkit::{
    IdemError, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy, Processed,
    RecordState, StoreError,
};
use support::netns::{DelayProxy, Netns};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Redis,
    Postgres,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Redis => "redis",
            Backend::Postgres => "postgres",
        }
    }
}

/// The namespace of this test process, with one Redis and one PostgreSQL
/// listening on both of its addresses.
struct Servers {
    netns: Netns,
    redis_port: u16,
    pg_port: u16,
}

fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    SERVERS.get_or_init(|| {
        let netns = Netns::create();
        let redis_port = support::free_port();
        netns.start_redis(redis_port);
        let pg_port = support::free_port();
        netns.start_postgres(pg_port);
        Servers {
            netns,
            redis_port,
            pg_port,
        }
    })
}

/// The tests share one namespace: the ones that change its rules run one
/// at a time.
static RULES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Servers {
    fn addr(&self, backend: Backend, ip: Ipv4Addr) -> SocketAddr {
        match backend {
            Backend::Redis => SocketAddr::from((ip, self.redis_port)),
            Backend::Postgres => SocketAddr::from((ip, self.pg_port)),
        }
    }
}

/// A store that reaches `backend` at `addr`, with `call_timeout`.
async fn store_at(
    backend: Backend,
    addr: SocketAddr,
    call_timeout: Duration,
) -> Arc<dyn IdempotencyStore> {
    match backend {
        Backend::Redis => Arc::new(
            RedisStore::connect(&format!("redis://{addr}/"))
                .await
                .unwrap_or_else(|e| panic!("redis at {addr}: {e}"))
                .call_timeout(call_timeout),
        ),
        Backend::Postgres => {
            let url = format!("postgres://postgres@{addr}/postgres");
            let store = PgStore::builder(support::pg::pool(&url, 16).await)
                .connections(16)
                .call_timeout(call_timeout)
                .build()
                .unwrap_or_else(|e| panic!("{e}"));
            store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
            Arc::new(store)
        }
    }
}

/// Prints the figures of one scenario (`support::report`).
fn report(scenario: &str, backend: Backend, fields: &[(&str, String)], started: Instant) {
    support::report::report(scenario, backend.name(), fields, started)
}

// ------------------------------------------------------------ latency

/// A storm through a forwarder that holds the server's replies `delay`
/// (switched on once a third of the keys ran): every key runs once, every
/// replay is the run's value.
async fn latency_scenario(backend: Backend, delay: Duration, keys: usize, tasks: usize) {
    let _rules = RULES.lock().await;
    let servers = servers();
    let proxy = Arc::new(DelayProxy::start(servers.addr(backend, servers.netns.a)).await);
    let store = store_at(backend, proxy.addr, Duration::from_secs(2)).await;
    let idem = Idempotency::from_arc(store)
        .lease(Duration::from_secs(30))
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(60),
            poll: Duration::from_millis(20),
        });
    let started = Instant::now();
    let slow = proxy.clone();
    let report_ = support::chaos::storm_through_fault(
        idem,
        keys,
        tasks,
        Box::new(move || slow.set_delay(delay)),
        None,
    )
    .await;
    report(
        &format!("latency_{}ms", delay.as_millis()),
        backend,
        &[
            ("keys", keys.to_string()),
            ("deliveries", (keys * tasks).to_string()),
            ("double", "0".into()),
            ("lost", "0".into()),
            ("unavailable", report_.unavailable.to_string()),
        ],
        started,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_50ms_redis() {
    latency_scenario(Backend::Redis, Duration::from_millis(50), 150, 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_50ms_postgres() {
    latency_scenario(Backend::Postgres, Duration::from_millis(50), 150, 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_500ms_redis() {
    latency_scenario(Backend::Redis, Duration::from_millis(500), 24, 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_500ms_postgres() {
    latency_scenario(Backend::Postgres, Duration::from_millis(500), 24, 8).await;
}

// ------------------------------------------------------------ packet loss

/// A storm while 5% of the packets each way are dropped in the namespace
/// (from a third of the keys on): every key runs once.
async fn loss_scenario(backend: Backend) {
    let _rules = RULES.lock().await;
    let servers = servers();
    let store = store_at(
        backend,
        servers.addr(backend, servers.netns.a),
        Duration::from_secs(2),
    )
    .await;
    let idem = Idempotency::from_arc(store)
        .lease(Duration::from_secs(30))
        .on_in_progress(InProgressPolicy::Wait {
            max_wait: Duration::from_secs(60),
            poll: Duration::from_millis(20),
        });
    let started = Instant::now();
    let outcome = support::chaos::storm_through_fault(
        idem,
        300,
        16,
        Box::new(move || servers.netns.loss(5)),
        None,
    )
    .await;
    let dropped = servers.netns.dropped_packets();
    servers.netns.loss(0);
    assert!(dropped > 0, "the loss rules dropped no packet");
    report(
        "packet_loss_5pct",
        backend,
        &[
            ("keys", "300".into()),
            ("deliveries", (300 * 16).to_string()),
            ("double", "0".into()),
            ("lost", "0".into()),
            ("unavailable", outcome.unavailable.to_string()),
            ("packets_dropped", dropped.to_string()),
        ],
        started,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packet_loss_5pct_redis() {
    loss_scenario(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packet_loss_5pct_postgres() {
    loss_scenario(Backend::Postgres).await;
}

// ------------------------------------------------------------ partition

/// Worker 1 (address a) runs a handler; mid-handler it is partitioned from
/// the store for longer than its lease; worker 2 (address b) takes the key
/// over after the lease and records its result; the partition heals and
/// worker 1's late completion is fenced (`LeaseLost`). While cut off,
/// worker 1's calls fail `Unavailable` within its call timeout.
async fn partition_scenario(backend: Backend) {
    let _rules = RULES.lock().await;
    let servers = servers();
    let netns = &servers.netns;
    let call_timeout = Duration::from_millis(500);
    let lease = Duration::from_secs(1);
    let store1 = store_at(backend, servers.addr(backend, netns.a), call_timeout).await;
    let store2 = store_at(backend, servers.addr(backend, netns.b), call_timeout).await;
    let worker1 = Idempotency::from_arc(store1.clone()).lease(lease);
    let worker2 = Idempotency::from_arc(store2.clone()).lease(lease);
    let key = IdempotencyKey::new(
        "net.partition",
        format!("{}-{:x}", backend.name(), fastrand::u64(..)),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let effects = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();

    let (running_tx, running_rx) = tokio::sync::oneshot::channel::<()>();
    let healed = Arc::new(tokio::sync::Notify::new());
    let first = {
        let (key, effects, healed) = (key.clone(), effects.clone(), healed.clone());
        tokio::spawn(async move {
            worker1
                .process(&key, "payload", |_| async move {
                    effects.fetch_add(1, Ordering::SeqCst);
                    let _ = running_tx.send(());
                    healed.notified().await;
                    Ok::<_, std::io::Error>("worker 1".to_string())
                })
                .await
        })
    };
    running_rx
        .await
        .unwrap_or_else(|_| panic!("worker 1's handler never started"));
    netns.partition(netns.a, true);
    let cut_at = Instant::now();

    // While worker 2 tries the key, worker 1's calls fail Unavailable
    // within its call timeout.
    let probe = {
        let (store1, key) = (store1.clone(), key.clone());
        async move {
            let mut slowest = Duration::ZERO;
            for _ in 0..3 {
                let t = Instant::now();
                match store1.get(&key).await {
                    Err(StoreError::Unavailable(_)) => {}
                    other => panic!("a partitioned worker's get returned {other:?}"),
                }
                slowest = slowest.max(t.elapsed());
            }
            slowest
        }
    };
    // Worker 2 takes over once worker 1's lease has passed.
    let take_over = async {
        let mut in_progress_answers = 0u32;
        loop {
            assert!(
                cut_at.elapsed() < Duration::from_secs(20),
                "worker 2 never took the key over"
            );
            let effects = effects.clone();
            match worker2
                .process(&key, "payload", |_| async move {
                    effects.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::io::Error>("worker 2".to_string())
                })
                .await
            {
                Ok(Processed::Executed(v)) => {
                    assert_eq!(v, "worker 2");
                    break (cut_at.elapsed(), in_progress_answers);
                }
                Err(IdemError::InProgress { .. }) => {
                    in_progress_answers += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => panic!("worker 2 got {other:?}"),
            }
        }
    };
    let (slowest_failure, (takeover, in_progress_answers)) = tokio::join!(probe, take_over);
    assert!(
        slowest_failure < call_timeout + Duration::from_millis(300),
        "a partitioned call took {slowest_failure:?} to fail (call timeout {call_timeout:?})"
    );
    assert!(
        in_progress_answers > 0,
        "worker 2 was never told the key is in progress"
    );
    assert!(
        takeover >= lease.saturating_sub(call_timeout),
        "worker 2 took over {takeover:?} after the cut, before worker 1's lease could end"
    );

    // Healed: worker 1 finishes and is told its lease was lost.
    netns.partition(netns.a, false);
    // Worker 1's handler ends once its store answers again (its
    // connection may need a reconnect first): the completion that follows
    // reaches the store and is fenced, not left `Unrecorded`.
    let back = Instant::now();
    while store1.get(&key).await.is_err() {
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "worker 1's store never answered after the partition healed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    healed.notify_one();
    let late = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .unwrap_or_else(|_| panic!("worker 1 never returned"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(late, Err(IdemError::LeaseLost)),
        "worker 1's late completion: {late:?}"
    );

    // Every later delivery, through either address, replays worker 2's
    // result: the completion was not lost and not overwritten.
    for worker in [&store1, &store2] {
        let replay = Idempotency::from_arc(worker.clone())
            .process(&key, "payload", |_| async {
                Ok::<_, std::io::Error>("a third run".to_string())
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(replay, Processed::Replayed("worker 2".to_string()));
    }
    let ran = effects.load(Ordering::SeqCst);
    assert_eq!(ran, 2, "worker 1 (cut off mid-handler) and worker 2 only");
    report(
        "partition_one_worker_past_its_lease",
        backend,
        &[
            ("lease_ms", lease.as_millis().to_string()),
            ("call_timeout_ms", call_timeout.as_millis().to_string()),
            (
                "slowest_failed_call_ms",
                slowest_failure.as_millis().to_string(),
            ),
            ("takeover_after_cut_ms", takeover.as_millis().to_string()),
            ("in_progress_answers", in_progress_answers.to_string()),
            ("late_completion", "LeaseLost".into()),
            ("effects", ran.to_string()),
            ("lost", "0".into()),
        ],
        started,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_one_worker_past_its_lease_redis() {
    partition_scenario(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_one_worker_past_its_lease_postgres() {
    partition_scenario(Backend::Postgres).await;
}

// ------------------------------------------------------------ partition storm

/// What the storm's deliveries saw.
#[derive(Default)]
struct StormLedger {
    /// Effects per message (the handler counts them).
    effects: Vec<AtomicUsize>,
    /// Messages one of whose runs was not confirmed to its worker (the
    /// handler ran, then the worker was told `LeaseLost`, or could not
    /// record the result before its lease ended): the documented
    /// at-least-once window.
    unconfirmed: Vec<AtomicUsize>,
    /// The result each message's successful delivery returned.
    results: Mutex<HashMap<usize, String>>,
    unavailable: AtomicUsize,
    first_unavailable_ms: AtomicU64,
    last_unavailable_ms: AtomicU64,
}

/// 2,000 messages, 1-8 deliveries each in random order, 64 workers in two
/// groups that reach the store on two addresses; once 30% of the
/// deliveries ran, group A is partitioned from the store for 2.5 leases,
/// then healed. A message runs twice only when a group-A worker was cut
/// off after its handler started (its run unconfirmed); no completion is
/// lost and every success agrees with the record.
async fn partition_storm_scenario(backend: Backend) {
    let _rules = RULES.lock().await;
    let servers = servers();
    let netns = &servers.netns;
    let (messages, workers) = (2_000usize, 64usize);
    let lease = Duration::from_secs(1);
    let call_timeout = Duration::from_millis(300);
    let idem_at = |ip: Ipv4Addr| {
        let addr = servers.addr(backend, ip);
        async move {
            Idempotency::from_arc(store_at(backend, addr, call_timeout).await)
                .lease(lease)
                .on_in_progress(InProgressPolicy::Reject)
        }
    };
    let groups = [idem_at(netns.a).await, idem_at(netns.b).await];
    let run = format!("{:x}", fastrand::u64(..));
    let mut deliveries: Vec<usize> = (0..messages)
        .flat_map(|m| std::iter::repeat_n(m, fastrand::usize(1..=8)))
        .collect();
    fastrand::shuffle(&mut deliveries);
    let total = deliveries.len();
    let queue = Arc::new(Mutex::new(VecDeque::from(deliveries)));
    let ledger = Arc::new(StormLedger {
        effects: (0..messages).map(|_| AtomicUsize::new(0)).collect(),
        unconfirmed: (0..messages).map(|_| AtomicUsize::new(0)).collect(),
        ..StormLedger::default()
    });
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();

    // The fault: group A cut off for 2.5 leases once 30% ran, then healed.
    let cut_for = lease * 5 / 2;
    let chaos = {
        let done = done.clone();
        tokio::spawn(async move {
            while done.load(Ordering::SeqCst) < total * 3 / 10 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::task::spawn_blocking(move || servers.netns.partition(servers.netns.a, true))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let cut_at = Instant::now();
            tokio::time::sleep(cut_for).await;
            tokio::task::spawn_blocking(move || servers.netns.partition(servers.netns.a, false))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            cut_at.elapsed()
        })
    };

    let mut tasks = Vec::new();
    for w in 0..workers {
        let group = w % 2;
        let idem = groups[group].clone();
        let (queue, ledger, done, run) = (queue.clone(), ledger.clone(), done.clone(), run.clone());
        tasks.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let next = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                let Some(m) = next else { break };
                assert!(Instant::now() < deadline, "the storm did not end in 120 s");
                let key = IdempotencyKey::new("net.storm", format!("{run}-{m}"))
                    .unwrap_or_else(|e| panic!("{e}"));
                let ran = Arc::new(AtomicUsize::new(0));
                let (ledger_, ran_) = (ledger.clone(), ran.clone());
                let outcome = idem
                    .process(&key, m, |m| async move {
                        ledger_.effects[m].fetch_add(1, Ordering::SeqCst);
                        ran_.store(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        Ok::<_, std::io::Error>(format!(
                            "{m} by group {group} {:x}",
                            fastrand::u32(..)
                        ))
                    })
                    .await;
                let redeliver = match outcome {
                    Ok(Processed::Executed(v)) | Ok(Processed::Replayed(v)) => {
                        let mut results = ledger.results.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some(seen) = results.get(&m) {
                            assert_eq!(seen, &v, "message {m}: two different results");
                        }
                        results.insert(m, v);
                        false
                    }
                    Err(IdemError::Store(StoreError::Unavailable(_))) => {
                        let at = started.elapsed().as_millis() as u64;
                        ledger.unavailable.fetch_add(1, Ordering::SeqCst);
                        let _ = ledger.first_unavailable_ms.compare_exchange(
                            0,
                            at.max(1),
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                        ledger.last_unavailable_ms.fetch_max(at, Ordering::SeqCst);
                        true
                    }
                    Err(IdemError::InProgress { .. }) => true,
                    // The handler ran but its result is not the record's:
                    // this run is unconfirmed (the message's window).
                    Err(IdemError::LeaseLost) | Err(IdemError::Unrecorded(_)) => {
                        assert_eq!(
                            ran.load(Ordering::SeqCst),
                            1,
                            "message {m}: told so without a run"
                        );
                        ledger.unconfirmed[m].fetch_add(1, Ordering::SeqCst);
                        true
                    }
                    other => panic!("message {m}: {other:?}"),
                };
                if redeliver {
                    // Back in the queue, as a broker redelivers.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    queue.lock().unwrap_or_else(|p| p.into_inner()).push_back(m);
                } else {
                    done.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap_or_else(|e| panic!("{e}"));
    }
    let cut_lasted = chaos.await.unwrap_or_else(|e| panic!("{e}"));

    // Every message completed on the store with the result its deliveries
    // got (through group B's address: A's was cut, now healed).
    let results = ledger
        .results
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    assert_eq!(
        results.len(),
        messages,
        "every message had a successful delivery"
    );
    let mut lost = 0;
    for (m, v) in &results {
        let key = IdempotencyKey::new("net.storm", format!("{run}-{m}"))
            .unwrap_or_else(|e| panic!("{e}"));
        let record = groups[1].get(&key).await.unwrap_or_else(|e| panic!("{e}"));
        let recorded = match record.map(|r| r.state) {
            Some(RecordState::Completed { response, .. }) => {
                Some(serde_json::from_slice::<String>(&response).unwrap_or_else(|e| panic!("{e}")))
            }
            _ => None,
        };
        if recorded.as_deref() != Some(v.as_str()) {
            lost += 1;
        }
    }
    let mut double = 0;
    let mut window = 0;
    for m in 0..messages {
        let ran = ledger.effects[m].load(Ordering::SeqCst);
        let unconfirmed = ledger.unconfirmed[m].load(Ordering::SeqCst);
        assert!(ran >= 1, "message {m} never ran");
        if unconfirmed > 0 {
            window += 1;
        }
        if ran > 1 {
            double += 1;
            assert!(
                ran <= 1 + unconfirmed,
                "message {m} ran {ran} times with {unconfirmed} unconfirmed runs"
            );
        }
    }
    assert_eq!(lost, 0, "completions lost");
    let unavailable = ledger.unavailable.load(Ordering::SeqCst);
    assert!(unavailable > 0, "group A never saw the partition");
    let (first, last) = (
        ledger.first_unavailable_ms.load(Ordering::SeqCst),
        ledger.last_unavailable_ms.load(Ordering::SeqCst),
    );
    report(
        "partition_storm_group_cut_2.5_leases",
        backend,
        &[
            ("messages", messages.to_string()),
            ("deliveries", total.to_string()),
            ("workers", workers.to_string()),
            ("lease_ms", lease.as_millis().to_string()),
            ("cut_ms", cut_lasted.as_millis().to_string()),
            ("double", double.to_string()),
            ("unconfirmed_runs_window", window.to_string()),
            ("lost", lost.to_string()),
            ("unavailable", unavailable.to_string()),
            (
                "unavailable_window_ms",
                last.saturating_sub(first).to_string(),
            ),
        ],
        started,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_storm_redis() {
    partition_storm_scenario(Backend::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_storm_postgres() {
    partition_storm_scenario(Backend::Postgres).await;
}
