//! A Redis Cluster with replicas for failover tests: 3 masters and 3
//! replicas (`redis-cli --cluster create ... --cluster-replicas 1`), each
//! node a `redis-server` of this test process on free ports in its own temp
//! dir, without persistence, stopped by a watchdog when the process exits.
//! Helpers find the master of a key, kill it with SIGKILL, and wait (with a
//! deadline) until its replica is promoted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::redis_server::{cluster_port, RedisServer};

/// One line of `CLUSTER NODES`, as one node sees the cluster.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub id: String,
    pub port: u16,
    pub myself: bool,
    pub master: bool,
    /// Flagged `fail` or `fail?` by the node that answered.
    pub failing: bool,
    /// The id of its master, for a replica.
    pub master_id: Option<String>,
    pub connected: bool,
    /// Slot ranges it serves, inclusive.
    pub slots: Vec<(u16, u16)>,
}

impl NodeView {
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
    }
}

/// 3 masters with one replica each.
pub struct ReplicatedCluster {
    pub servers: Vec<RedisServer>,
    alive: Mutex<Vec<bool>>,
}

impl ReplicatedCluster {
    /// Starts 6 nodes with `cluster-node-timeout` `node_timeout`, makes the
    /// cluster, and waits (30 s at most) until it is `cluster_state:ok`
    /// everywhere and every master has an online replica.
    ///
    /// Up to three tries, each on new ports: another test's server can take
    /// a port between its choice and the node's start, and `--cluster
    /// create` then finds that server ("Node ... is not empty").
    pub fn start(node_timeout: Duration) -> ReplicatedCluster {
        let mut failures = Vec::new();
        for _ in 0..3 {
            match Self::try_start(node_timeout) {
                Ok(cluster) => return cluster,
                Err(e) => failures.push(e), // its nodes are stopped (dropped)
            }
        }
        panic!(
            "a replicated cluster did not form in three tries:\n{}",
            failures.join("\n")
        );
    }

    fn try_start(node_timeout: Duration) -> Result<ReplicatedCluster, String> {
        let timeout_ms = node_timeout.as_millis().to_string();
        let mut servers = Vec::new();
        for _ in 0..6 {
            let port = cluster_port();
            let conf = format!("nodes-{port}.conf");
            servers.push(RedisServer::start_on(
                port,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    &timeout_ms,
                    // A replica (re)joining syncs at once, not 5 s later.
                    "--repl-diskless-sync-delay",
                    "0",
                    "--maxmemory-policy",
                    "noeviction",
                ],
            ));
        }
        // Bounded: `--cluster create` waits for the nodes to join forever.
        let out = Command::new("timeout")
            .args(["60", "redis-cli"])
            .arg("--cluster")
            .arg("create")
            .args(servers.iter().map(|s| format!("127.0.0.1:{}", s.port)))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run redis-cli: {e}. Install it with `apt-get install -y redis-server`"
                )
            });
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create --cluster-replicas 1 failed:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let cluster = ReplicatedCluster {
            alive: Mutex::new(vec![true; servers.len()]),
            servers,
        };
        cluster.wait_healthy(Duration::from_secs(30));
        Ok(cluster)
    }

    /// The nodes' URLs, as seeds for a cluster client.
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.url.clone()).collect()
    }

    pub fn is_alive(&self, i: usize) -> bool {
        self.alive.lock().unwrap_or_else(|p| p.into_inner())[i]
    }

    fn index_of_port(&self, port: u16) -> Option<usize> {
        self.servers.iter().position(|s| s.port == port)
    }

    fn first_alive(&self) -> usize {
        (0..self.servers.len())
            .find(|&i| self.is_alive(i))
            .unwrap_or_else(|| panic!("no cluster node is alive"))
    }

    /// `CLUSTER NODES` as server `via` sees it.
    pub fn nodes(&self, via: usize) -> Vec<NodeView> {
        query(self.servers[via].port, "CLUSTER NODES")
            .lines()
            .filter_map(parse_node)
            .collect()
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub fn slot_of(&self, key: &str) -> u16 {
        let reply = query(
            self.servers[self.first_alive()].port,
            &format!("CLUSTER KEYSLOT {key}"),
        );
        reply
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("CLUSTER KEYSLOT {key}: {reply:?}: {e}"))
    }

    /// The index of the server that is master for `slot`, as a live node
    /// sees it.
    pub fn master_for_slot(&self, slot: u16) -> usize {
        let view = self.nodes(self.first_alive());
        let node = view
            .iter()
            .find(|n| n.master && !n.failing && n.serves(slot))
            .unwrap_or_else(|| panic!("no master serves slot {slot}: {view:?}"));
        self.index_of_port(node.port)
            .unwrap_or_else(|| panic!("unknown node port {}", node.port))
    }

    /// The index of the master of `key`'s slot.
    pub fn master_for_key(&self, key: &str) -> usize {
        self.master_for_slot(self.slot_of(key))
    }

    /// The index of the replica of master `master`.
    pub fn replica_of(&self, master: usize) -> usize {
        let view = self.nodes(master);
        let me = view
            .iter()
            .find(|n| n.myself)
            .unwrap_or_else(|| panic!("CLUSTER NODES without myself: {view:?}"));
        let replica = view
            .iter()
            .find(|n| n.master_id.as_deref() == Some(me.id.as_str()))
            .unwrap_or_else(|| panic!("master {} has no replica: {view:?}", me.port));
        self.index_of_port(replica.port)
            .unwrap_or_else(|| panic!("unknown node port {}", replica.port))
    }

    /// Kills server `i` with SIGKILL (no shutdown, no save).
    pub fn kill(&self, i: usize) {
        self.alive.lock().unwrap_or_else(|p| p.into_inner())[i] = false;
        self.servers[i].kill();
    }

    /// Starts a killed server again with its cluster config file: it
    /// rejoins (as a replica of whoever took its slots over), empty.
    pub fn restart(&self, i: usize) {
        self.servers[i].start_again();
        self.alive.lock().unwrap_or_else(|p| p.into_inner())[i] = true;
    }

    /// Waits until server `replica` is a master serving slots in the view
    /// of every live node, and every live node says `cluster_state:ok`.
    /// Panics after `timeout`; returns how long it waited.
    pub fn wait_promoted(&self, replica: usize, timeout: Duration) -> Duration {
        let started = Instant::now();
        let port = self.servers[replica].port;
        loop {
            let live: Vec<usize> = (0..self.servers.len())
                .filter(|&i| self.is_alive(i))
                .collect();
            let promoted = live.iter().all(|&via| {
                self.nodes(via)
                    .iter()
                    .any(|n| n.port == port && n.master && !n.failing && !n.slots.is_empty())
                    && query(self.servers[via].port, "CLUSTER INFO").contains("cluster_state:ok")
            });
            if promoted {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < timeout,
                "the replica on port {port} was not promoted within {timeout:?}: {:?}",
                self.nodes(replica)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until every live node says `cluster_state:ok`, and every
    /// master (as live nodes see it) has an online replica (`INFO
    /// replication`). Panics after `timeout`; returns how long it waited.
    pub fn wait_healthy(&self, timeout: Duration) -> Duration {
        let started = Instant::now();
        loop {
            match self.unhealthy() {
                None => return started.elapsed(),
                Some(why) => assert!(
                    started.elapsed() < timeout,
                    "the cluster was not healthy within {timeout:?}: {why}"
                ),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Why the cluster is not healthy yet, or `None`.
    fn unhealthy(&self) -> Option<String> {
        let live: Vec<usize> = (0..self.servers.len())
            .filter(|&i| self.is_alive(i))
            .collect();
        for &i in &live {
            if !query(self.servers[i].port, "CLUSTER INFO").contains("cluster_state:ok") {
                return Some(format!(
                    "node {} is not cluster_state:ok",
                    self.servers[i].port
                ));
            }
        }
        let view = self.nodes(live[0]);
        let masters: Vec<&NodeView> = view
            .iter()
            .filter(|n| n.master && !n.slots.is_empty())
            .collect();
        if masters.len() != 3 {
            return Some(format!("{} masters with slots: {view:?}", masters.len()));
        }
        for m in masters {
            let Some(i) = self.index_of_port(m.port).filter(|&i| self.is_alive(i)) else {
                return Some(format!("master {} is not a live node", m.port));
            };
            let info = query(self.servers[i].port, "INFO replication");
            if !info
                .lines()
                .any(|l| l.starts_with("slave") && l.contains("state=online"))
            {
                return Some(format!("master {} has no online replica", m.port));
            }
        }
        None
    }
}

/// Parses one `CLUSTER NODES` line.
fn parse_node(line: &str) -> Option<NodeView> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        return None;
    }
    let addr = fields[1].split(['@', ',']).next()?;
    let port = addr.rsplit(':').next()?.parse().ok()?;
    let flags: Vec<&str> = fields[2].split(',').collect();
    Some(NodeView {
        id: fields[0].to_owned(),
        port,
        myself: flags.contains(&"myself"),
        master: flags.contains(&"master"),
        failing: flags.contains(&"fail") || flags.contains(&"fail?"),
        master_id: (fields[3] != "-").then(|| fields[3].to_owned()),
        connected: fields[7] == "connected",
        slots: fields[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => s.parse().ok().map(|n| (n, n)),
            })
            .collect(),
    })
}

/// Sends one inline command to 127.0.0.1:port and returns its reply: the
/// payload of a bulk string (read in full), the text of a simple string or
/// integer, or the error line.
pub fn query(port: u16, line: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("cannot reach redis on {port}: {e}"));
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    stream
        .write_all(format!("{line}\r\n").as_bytes())
        .unwrap_or_else(|e| panic!("write to redis on {port}: {e}"));
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    reader
        .read_line(&mut head)
        .unwrap_or_else(|e| panic!("read from redis on {port} ({line}): {e}"));
    let head = head.trim_end();
    match head.split_at_checked(1) {
        Some(("$", len)) => {
            let len: usize = len
                .parse()
                .unwrap_or_else(|e| panic!("{line}: bad bulk length {head:?}: {e}"));
            let mut body = vec![0u8; len];
            reader
                .read_exact(&mut body)
                .unwrap_or_else(|e| panic!("read from redis on {port} ({line}): {e}"));
            String::from_utf8_lossy(&body).into_owned()
        }
        Some(("+" | ":", text)) => text.to_owned(),
        _ => head.to_owned(),
    }
}
