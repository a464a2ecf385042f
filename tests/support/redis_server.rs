//! Real Redis servers for tests: `redis-server` on a free port in a temp
//! dir, and a 3-master Redis Cluster made with `redis-cli --cluster create`.
//! `IDEM_REDIS_URL` and `IDEM_REDIS_CLUSTER_URLS` (comma-separated) replace
//! the shared ones with servers of yours.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const HOW_TO: &str = "Redis is needed for these tests: run scripts/test (it installs \
     redis-server), or `apt-get install -y redis-server`, or set IDEM_REDIS_URL / \
     IDEM_REDIS_CLUSTER_URLS to servers of yours";

/// A redis-server owned by this test process.
pub struct RedisServer {
    pub port: u16,
    pub url: String,
    dir: PathBuf,
    args: Vec<String>,
    child: Mutex<Option<Child>>,
}

/// The URL of the standalone server shared by the tests of this process.
pub fn shared_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| match std::env::var("IDEM_REDIS_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let server = RedisServer::start(&[]);
            let url = server.url.clone();
            std::mem::forget(server); // the watchdog stops it
            url
        }
    })
}

/// The node URLs of the cluster shared by the tests of this process.
pub fn shared_cluster() -> &'static [String] {
    static NODES: OnceLock<Vec<String>> = OnceLock::new();
    NODES.get_or_init(|| match std::env::var("IDEM_REDIS_CLUSTER_URLS") {
        Ok(urls) if !urls.is_empty() => urls.split(',').map(str::to_owned).collect(),
        _ => start_cluster(),
    })
}

impl RedisServer {
    /// Starts redis-server with `extra` arguments (`--appendonly yes`...).
    pub fn start(extra: &[&str]) -> RedisServer {
        Self::start_on(super::free_port(), extra)
    }

    /// Starts redis-server on `port` with `extra` arguments.
    pub fn start_on(port: u16, extra: &[&str]) -> RedisServer {
        let dir = super::temp_dir("redis");
        let mut args: Vec<String> = vec![
            "--port".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--dir".into(),
            dir.display().to_string(),
            "--save".into(),
            String::new(),
            "--appendonly".into(),
            "no".into(),
            "--protected-mode".into(),
            "no".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let server = RedisServer {
            port,
            url: format!("redis://127.0.0.1:{port}/"),
            dir,
            args,
            child: Mutex::new(None),
        };
        server.start_again();
        server
    }

    /// Starts the server (again, after `kill`) and waits until it answers.
    pub fn start_again(&self) {
        let child = spawn(Command::new("redis-server").args(&self.args), &self.dir);
        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        wait_until_ready(self.port);
    }

    /// Kills the server with SIGKILL (a crash: no shutdown save).
    pub fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: connections stay
    /// open but nothing is answered, so clients time out.
    pub fn signal(&self, signal: &str) {
        if let Some(child) = self
            .child
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            let status = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(child.id().to_string())
                .status();
            assert!(status.is_ok_and(|s| s.success()), "kill -{signal} failed");
        }
    }

    /// Sends one inline command and returns the raw reply.
    pub fn command(&self, line: &str) -> String {
        command(self.port, line)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Spawns `redis_server` (a `redis-server` command with its arguments),
/// its output discarded; a watchdog kills it and removes `dir` once this
/// process is gone.
pub fn spawn(redis_server: &mut Command, dir: &Path) -> Child {
    let child = redis_server
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start redis-server: {e}. {HOW_TO}"));
    super::spawn_watchdog(&format!(
        "{kill}; rm -rf '{dir}'",
        kill = super::kill_if_running(child.id(), "9"),
        dir = dir.display()
    ));
    child
}

/// Sends one inline command to 127.0.0.1:port and returns the raw reply.
pub fn command(port: u16, line: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("cannot reach redis on {port}: {e}"));
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    stream
        .write_all(format!("{line}\r\n").as_bytes())
        .unwrap_or_else(|e| panic!("write to redis: {e}"));
    let mut buf = vec![0u8; 64 * 1024];
    let n = stream.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn try_ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(stream.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}

fn wait_until_ready(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !try_ping(port) {
        if Instant::now() > deadline {
            panic!("redis-server on port {port} did not answer PING within 30 s. {HOW_TO}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A port whose cluster bus port (port + 10000) is free too.
pub fn cluster_port() -> u16 {
    for _ in 0..1000 {
        let port = super::free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair for a cluster node");
}

fn start_cluster() -> Vec<String> {
    start_cluster_servers()
        .into_iter()
        .map(|server| {
            let url = server.url.clone();
            std::mem::forget(server); // the watchdog stops it
            url
        })
        .collect()
}

/// A 3-master cluster of its own (no replicas), its servers returned so a
/// test can freeze or kill one. Up to three tries, each on new ports: a
/// node's cluster bus port (its port + 10000) can be taken by another
/// process between the choice of the port and the node's start, and the
/// nodes then never join (seen once: "port 47119 may be unreachable").
pub fn start_cluster_servers() -> Vec<RedisServer> {
    let mut failures = Vec::new();
    for _ in 0..3 {
        match try_start_cluster_servers() {
            Ok(nodes) => return nodes,
            Err(e) => failures.push(e), // its nodes are stopped (dropped)
        }
    }
    panic!(
        "a 3-master cluster did not form in three tries:\n{}",
        failures.join("\n")
    );
}

fn try_start_cluster_servers() -> Result<Vec<RedisServer>, String> {
    let mut nodes = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..3 {
        let port = cluster_port();
        let conf = format!("nodes-{port}.conf");
        let server = RedisServer::start_on(
            port,
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &conf,
                "--cluster-node-timeout",
                "5000",
            ],
        );
        nodes.push(server);
        ports.push(port);
    }
    // Bounded: `--cluster create` waits for the nodes to join forever.
    let out = Command::new("timeout")
        .args(["30", "redis-cli"])
        .arg("--cluster")
        .arg("create")
        .args(ports.iter().map(|p| format!("127.0.0.1:{p}")))
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}. {HOW_TO}"));
    if !out.status.success() {
        return Err(format!(
            "redis-cli --cluster create on {ports:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for port in &ports {
        while !command(*port, "CLUSTER INFO").contains("cluster_state:ok") {
            if Instant::now() > deadline {
                return Err(format!(
                    "the cluster on ports {ports:?} did not reach cluster_state:ok"
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(nodes)
}

/// A 3-master cluster of its own whose nodes announce the ports of loopback
/// proxies (`cluster-announce-port`): a cluster client learns the topology
/// from the nodes, so it reaches every node through that node's proxy,
/// which can lose replies. Connect with the proxies' addresses as seeds.
pub async fn start_cluster_behind_proxies() -> (Vec<RedisServer>, Vec<super::proxy::CountingProxy>)
{
    let servers = tokio::task::spawn_blocking(start_cluster_servers)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut proxies = Vec::new();
    for server in &servers {
        let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], server.port));
        proxies.push(super::proxy::CountingProxy::start(upstream).await);
    }
    for (server, proxy) in servers.iter().zip(&proxies) {
        let reply = server.command(&format!(
            "CONFIG SET cluster-announce-port {}",
            proxy.addr.port()
        ));
        assert!(reply.starts_with("+OK"), "cluster-announce-port: {reply}");
    }
    // Every node announces its proxy, and every node knows all of them.
    let deadline = Instant::now() + Duration::from_secs(30);
    for server in &servers {
        loop {
            let nodes = server.command("CLUSTER NODES");
            if proxies
                .iter()
                .all(|p| nodes.contains(&format!(":{}@", p.addr.port())))
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the nodes did not learn the announced proxy ports: {nodes}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    (servers, proxies)
}

/// The index of the cluster node (in `servers`) that owns `key`'s slot: the
/// one that does not answer `MOVED`.
pub fn owner_of(servers: &[RedisServer], key: &str) -> usize {
    servers
        .iter()
        .position(|s| !s.command(&format!("EXISTS {key}")).starts_with("-MOVED"))
        .unwrap_or_else(|| panic!("no node owns {key}"))
}

/// How many times `command` ran on this server (`INFO commandstats`).
pub fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let stats = server.command("INFO commandstats");
    let needle = format!("cmdstat_{}:calls=", command.to_ascii_lowercase());
    stats
        .split(needle.as_str())
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Waits until `replica` is attached to its primary and caught up.
pub fn wait_for_replication(primary: &RedisServer, replica: &RedisServer) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let up = replica
            .command("INFO replication")
            .contains("master_link_status:up");
        let attached = primary
            .command("INFO replication")
            .contains("connected_slaves:1");
        if up && attached {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the replica did not attach within 30 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
