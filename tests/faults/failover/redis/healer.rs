//! The cluster connection healer of `RedisStore::connect_cluster`: a
//! connection that has had no answer for `STALL_AFTER` is replaced. A
//! frozen cluster piles nothing up (sockets, tasks), a replaced connection
//! is closed, and a frozen master's shard is served again once its replica
//! is promoted, while the other shards keep answering.
//!
//! Every scenario prints `reliability scenario=... backend=... duration_ms=...`.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit::redis::redis::cluster_async::ClusterConnection;
use idemkit::redis::RedisStore;
use idemkit::{IdempotencyStore, StoreError};
use support::redis_server::{command, start_cluster_servers};
use support::report::report;

use super::key;

const HOW_TO: &str = "needs `redis-server` and `redis-cli` 7: run scripts/test, or \
     `apt-get install -y redis-server`";

/// A store on the cluster of `urls`, with a 300 ms call timeout.
async fn connect(urls: impl IntoIterator<Item = String>) -> RedisStore<ClusterConnection> {
    RedisStore::connect_cluster(urls)
        .await
        .unwrap_or_else(|e| panic!("connect_cluster: {e}. {HOW_TO}"))
        .call_timeout(Duration::from_millis(300))
}

/// File descriptors open in this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Established TCP connections of this process to one of `ports`
/// (counted through /proc/self/fd socket inodes and /proc/net/tcp).
fn sockets_to(ports: &[u16]) -> usize {
    let mut inodes = std::collections::HashSet::new();
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        for entry in dir.flatten() {
            if let Ok(target) = std::fs::read_link(entry.path()) {
                let t = target.display().to_string();
                if let Some(inode) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                    inodes.insert(inode.to_owned());
                }
            }
        }
    }
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                return false;
            }
            let remote_port = f[2]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                .unwrap_or(0);
            ports.contains(&remote_port) && inodes.contains(f[9])
        })
        .count()
}

/// The clients the Redis on `port` counts (`INFO clients`).
fn connected_clients(port: u16) -> u64 {
    command(port, "INFO clients")
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The whole cluster frozen (SIGSTOP: connections stay open, nothing is
/// answered) for 14 s while calls keep coming: the healer tries to replace
/// the connection every time a call times out after STALL_AFTER, each try
/// bounded by its connect timeout. Nothing may pile up: sockets and tasks
/// stay bounded while frozen, and go back near the start once thawed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_cluster_piles_nothing_up() {
    let started = Instant::now();
    let nodes = start_cluster_servers();
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    let store = connect(nodes.iter().map(|n| n.url.clone())).await;
    for _ in 0..20 {
        store
            .get(&key("healer.warm"))
            .await
            .unwrap_or_else(|e| panic!("warm-up get: {e}"));
    }
    let metrics = tokio::runtime::Handle::current().metrics();
    let (fds0, socks0, tasks0) = (open_fds(), sockets_to(&ports), metrics.num_alive_tasks());

    for n in &nodes {
        n.signal("STOP");
    }
    let frozen = Instant::now();
    let (mut calls, mut max_socks, mut max_fds, mut max_tasks) = (0u64, 0, 0, 0);
    while frozen.elapsed() < Duration::from_secs(14) {
        let r = store.get(&key("healer.frozen")).await;
        assert!(
            matches!(r, Err(StoreError::Unavailable(_))),
            "a call on a frozen cluster: {r:?}"
        );
        calls += 1;
        max_socks = max_socks.max(sockets_to(&ports));
        max_fds = max_fds.max(open_fds());
        max_tasks = max_tasks.max(metrics.num_alive_tasks());
    }
    let replaced_frozen = store.connections_replaced();
    for n in &nodes {
        n.signal("CONT");
    }
    // Serving again.
    let thawed = Instant::now();
    let recovered_ms = loop {
        if store.get(&key("healer.thaw")).await.is_ok() {
            break thawed.elapsed().as_millis();
        }
        assert!(
            thawed.elapsed() < Duration::from_secs(30),
            "the store did not serve again within 30 s of the thaw"
        );
    };
    // Settled: give closed sockets a moment to go.
    let settle = Instant::now();
    let mut socks = sockets_to(&ports);
    while socks > socks0 + 3 && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = store.get(&key("healer.after")).await;
        socks = sockets_to(&ports);
    }
    let clients: u64 = ports.iter().map(|p| connected_clients(*p)).sum();
    report(
        "cluster_frozen_14s",
        "redis-cluster",
        &[
            ("calls", calls.to_string()),
            ("replaced_while_frozen", replaced_frozen.to_string()),
            ("replaced_total", store.connections_replaced().to_string()),
            ("sockets_before", socks0.to_string()),
            ("sockets_max_frozen", max_socks.to_string()),
            ("sockets_after", socks.to_string()),
            ("fds_before", fds0.to_string()),
            ("fds_max_frozen", max_fds.to_string()),
            ("tasks_before", tasks0.to_string()),
            ("tasks_max_frozen", max_tasks.to_string()),
            ("server_clients_after", clients.to_string()),
            ("recovered_ms", recovered_ms.to_string()),
        ],
        started,
    );
    assert!(
        max_socks <= socks0 + 12,
        "sockets to the frozen cluster piled up: {socks0} -> {max_socks}"
    );
    assert!(
        max_tasks <= tasks0 + 20,
        "tasks piled up while frozen: {tasks0} -> {max_tasks}"
    );
    assert!(
        socks <= socks0 + 3,
        "sockets not closed after the thaw: {socks0} -> {socks}"
    );
}

/// A merely slow cluster: every write (every script) is held by `CLIENT
/// PAUSE WRITE` longer than the call timeout, for 12 s, while reads and new
/// connections are served. No call has an answer, so the healer replaces
/// the connection every STALL_AFTER although nothing is wrong with it
/// (measured, not asserted: one reconnect per 4 s, bounded). Then, once
/// the cluster is fast again, the store must hold ONE connection: the ones
/// it replaced are closed (the store keeps no handle on a replaced
/// connection, which would keep it open for the store's whole life).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_connection_is_closed() {
    let started = Instant::now();
    let nodes = start_cluster_servers();
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    let store = connect(nodes.iter().map(|n| n.url.clone())).await;
    for _ in 0..10 {
        store
            .acquire(&key("healer.warm"), None, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("warm-up acquire: {e}"));
    }
    let clients0: u64 = ports.iter().map(|p| connected_clients(*p)).sum();
    let socks0 = sockets_to(&ports);

    // A thread keeps every node's writes paused (1 s at a time, renewed).
    let stop = Arc::new(AtomicBool::new(false));
    let pauser = {
        let stop = stop.clone();
        let ports = ports.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                for p in &ports {
                    command(*p, "CLIENT PAUSE 1000 WRITE");
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            for p in &ports {
                command(*p, "CLIENT UNPAUSE");
            }
        })
    };
    let slow = Instant::now();
    let (mut calls, mut timeouts, mut max_clients, mut max_socks) = (0u64, 0u64, 0u64, 0usize);
    while slow.elapsed() < Duration::from_secs(12) {
        if let Err(StoreError::Unavailable(_)) = store
            .acquire(&key("healer.slow"), None, Duration::from_secs(30))
            .await
        {
            timeouts += 1;
        }
        calls += 1;
        if calls.is_multiple_of(5) {
            max_clients = max_clients.max(ports.iter().map(|p| connected_clients(*p)).sum());
            max_socks = max_socks.max(sockets_to(&ports));
        }
    }
    let replaced = store.connections_replaced();
    stop.store(true, Ordering::SeqCst);
    let _ = pauser.join();
    // Fast again: calls answer; give dropped connections time to close.
    let settle = Instant::now();
    let mut socks = sockets_to(&ports);
    while settle.elapsed() < Duration::from_secs(8) {
        store
            .acquire(&key("healer.fast"), None, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("after the pause: {e}"));
        socks = sockets_to(&ports);
        if socks <= socks0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let clients: u64 = ports.iter().map(|p| connected_clients(*p)).sum();
    report(
        "cluster_slow_writes_12s",
        "redis-cluster",
        &[
            ("calls", calls.to_string()),
            ("timeouts", timeouts.to_string()),
            ("replaced", replaced.to_string()),
            ("server_clients_before", clients0.to_string()),
            ("server_clients_max", max_clients.to_string()),
            ("server_clients_after", clients.to_string()),
            ("sockets_before", socks0.to_string()),
            ("sockets_max", max_socks.to_string()),
            ("sockets_after", socks.to_string()),
        ],
        started,
    );
    assert!(
        replaced >= 1,
        "the healer never replaced the connection: the scenario did not happen"
    );
    assert!(
        max_socks <= socks0 * 3,
        "the store's sockets piled up under a slow cluster: {socks0} -> {max_socks}, {replaced} replacements"
    );
    assert!(
        socks <= socks0,
        "after {replaced} replacement(s) the store still holds {socks} sockets to the cluster \
         (one connection holds {socks0}): a replaced connection is never closed"
    );
}

/// One master frozen (SIGSTOP: a host that stops answering, as behind a
/// network partition) in a cluster with replicas: the cluster promotes its
/// replica after `cluster-node-timeout`. Calls for the frozen shard's keys
/// time out, calls for the other shards answer, so the connection as a
/// whole never goes silent; each call has a fresh key, so no hash slot
/// sees two calls either: the healer watches each master's slots
/// together, and the store must reach the promoted replica for that shard
/// within 20 s of the promotion (not leave the shard unavailable while the
/// master stays frozen).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_master_shard_is_served_after_promotion() {
    use support::redis_replicas::{query, ReplicatedCluster};
    let started = Instant::now();
    let cluster = ReplicatedCluster::start(Duration::from_secs(2));
    cluster.wait_healthy(Duration::from_secs(30));
    let store = connect(cluster.urls()).await;
    let k_frozen = key("healer.shard");
    let victim = cluster.master_for_key(&store.redis_key(&k_frozen));
    // The replica of `victim`, as any node sees it (a master's own view
    // may lag behind the gossip for a moment).
    let victim_id = cluster
        .nodes(victim)
        .into_iter()
        .find(|n| n.myself)
        .map(|n| n.id)
        .unwrap_or_else(|| panic!("no myself in CLUSTER NODES"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let replica = loop {
        let found = (0..cluster.servers.len()).find_map(|via| {
            cluster
                .nodes(via)
                .into_iter()
                .find(|n| n.master_id.as_deref() == Some(victim_id.as_str()))
                .and_then(|n| cluster.servers.iter().position(|s| s.port == n.port))
        });
        if let Some(i) = found {
            break i;
        }
        assert!(
            Instant::now() < deadline,
            "master {victim} has no replica after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let k_live = loop {
        let k = key("healer.shard");
        if cluster.master_for_key(&store.redis_key(&k)) != victim {
            break k;
        }
    };
    for k in [&k_frozen, &k_live] {
        store
            .get(k)
            .await
            .unwrap_or_else(|e| panic!("warm-up get: {e}"));
    }
    // Fresh keys of the frozen shard, each in a hash slot of its own
    // (taken before the freeze: the slots are the victim's own).
    let victim_view = cluster
        .nodes(victim)
        .into_iter()
        .find(|n| n.myself)
        .unwrap_or_else(|| panic!("no myself in CLUSTER NODES"));
    let mut slots_seen = std::collections::HashSet::new();
    let mut pool = Vec::new();
    while pool.len() < 400 {
        let k = key("healer.shard");
        let slot = cluster.slot_of(&store.redis_key(&k));
        if victim_view.serves(slot) && slots_seen.insert(slot) {
            pool.push(k);
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let fresh_frozen = || {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        pool.get(i)
            .cloned()
            .unwrap_or_else(|| panic!("more than {} calls on the frozen shard", pool.len()))
    };
    cluster.servers[victim].signal("STOP");
    let frozen = Instant::now();
    // Traffic on both shards while the cluster fails over.
    let promoted_after = loop {
        let _ = store.get(&fresh_frozen()).await;
        let _ = store.get(&k_live).await;
        if query(cluster.servers[replica].port, "ROLE").starts_with("*") {
            let role = command(cluster.servers[replica].port, "ROLE");
            if role.contains("master") {
                break frozen.elapsed();
            }
        }
        assert!(
            frozen.elapsed() < Duration::from_secs(30),
            "the replica was not promoted within 30 s"
        );
    };
    let promoted = Instant::now();
    let (mut live_ok, mut frozen_ok_at) = (0u64, None);
    while promoted.elapsed() < Duration::from_secs(20) {
        if store.get(&fresh_frozen()).await.is_ok() {
            frozen_ok_at = Some(promoted.elapsed());
            break;
        }
        if store.get(&k_live).await.is_ok() {
            live_ok += 1;
        }
    }
    let replaced = store.connections_replaced();
    // A fresh client, meanwhile, reaches the promoted replica at once.
    let fresh_ok = match RedisStore::connect_cluster(
        cluster
            .urls()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i != victim)
            .map(|(_, u)| u),
    )
    .await
    {
        Ok(fresh) => fresh
            .call_timeout(Duration::from_millis(300))
            .get(&k_frozen)
            .await
            .is_ok(),
        Err(_) => false,
    };
    cluster.servers[victim].signal("CONT");
    report(
        "cluster_frozen_master_shard",
        "redis-cluster-replicas",
        &[
            ("promoted_ms", promoted_after.as_millis().to_string()),
            ("live_shard_answers", live_ok.to_string()),
            ("replaced", replaced.to_string()),
            ("fresh_client_served", fresh_ok.to_string()),
            (
                "frozen_shard_served_ms",
                frozen_ok_at.map_or("never".to_owned(), |d| d.as_millis().to_string()),
            ),
        ],
        started,
    );
    assert!(
        frozen_ok_at.is_some(),
        "the frozen master's shard was not served within 20 s of its replica's promotion \
         ({live_ok} answers from the other shards kept the healer from replacing the connection; \
         replaced={replaced})"
    );
}
