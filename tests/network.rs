//! Network faults between workers and their store, on real servers in a
//! network namespace made by the test (tests/support/netns.rs): added
//! latency (a userspace forwarder: `tc netem` is not available on these
//! kernels), packet loss and a partition of one worker (`iptables` drops in
//! the namespace), on Redis and PostgreSQL.
//!
//! Each scenario prints a `reliability scenario=... backend=...` line that
//! RELIABILITY.md tabulates. Needs root, iproute2 and iptables (the test
//! command installs them); without them the tests fail and say so.

#[path = "support/mod.rs"]
mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use idem::postgres::PgStore;
use idem::redis::RedisStore;
use idem::{
    IdemError, Idempotency, IdempotencyKey, IdempotencyStore, InProgressPolicy, Processed,
    StoreError,
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

fn report(scenario: &str, backend: Backend, fields: &[(&str, String)], started: Instant) {
    let mut line = format!("reliability scenario={scenario} backend={}", backend.name());
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v}"));
    }
    line.push_str(&format!(" duration_ms={}", started.elapsed().as_millis()));
    println!("{line}");
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
