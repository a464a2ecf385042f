//! A network namespace made by the test, joined to this one by a veth pair:
//! servers run inside it on their own addresses, the test reaches them over
//! the veth, and faults are applied with `iptables` inside the namespace, so
//! only the test's own traffic is touched.
//!
//! The namespace holds two addresses, `a` and `b`, for the same servers:
//! cutting one address partitions the workers that use it and leaves the
//! others connected. `tc netem` is not available on every kernel (it is not
//! on the CI machines: "Specified qdisc kind is unknown"), so added latency
//! comes from [`DelayProxy`], a userspace forwarder; packet loss and
//! partitions are real (`iptables` drops in the namespace).
//!
//! Needs root, `ip` (iproute2) and `iptables`: the test command installs
//! them; without them the test fails and says so (it never skips).

use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const HOW_TO: &str = "network namespace tests need root, `ip` (apt-get install -y iproute2) and \
     `iptables` (apt-get install -y iptables): run scripts/test, which installs them";

/// A network namespace with servers on two addresses.
pub struct Netns {
    pub name: String,
    /// This side of the veth pair.
    pub host: Ipv4Addr,
    /// The two addresses in the namespace.
    pub a: Ipv4Addr,
    pub b: Ipv4Addr,
    host_if: String,
}

fn run(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}. {HOW_TO}"));
    if !out.status.success() {
        panic!(
            "{command:?} failed: {}\n{}{}\n{HOW_TO}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(args: &[&str]) {
    run(Command::new("ip").args(args));
}

impl Netns {
    /// Makes the namespace and its veth pair (a random /29 of 10.200.0.0/13),
    /// removed (with every process in it) when this process exits.
    pub fn create() -> Netns {
        assert!(super::is_root(), "{HOW_TO} (not root)");
        let tag = format!("{:x}", fastrand::u32(..) & 0xff_ffff);
        let name = format!("idem-{tag}");
        let host_if = format!("idh{tag}");
        let ns_if = format!("idn{tag}");
        let (x, y, z) = (
            200 + fastrand::u8(..8),
            fastrand::u8(..),
            fastrand::u8(..32) * 8,
        );
        let addr = |last: u8| Ipv4Addr::new(10, x, y, z + last);
        let netns = Netns {
            name: name.clone(),
            host: addr(1),
            a: addr(2),
            b: addr(3),
            host_if: host_if.clone(),
        };
        ip(&["netns", "add", &name]);
        super::spawn_watchdog(&format!(
            "for p in $(ip netns pids {name}); do kill -9 $p; done; \
             ip netns del {name}; ip link del {host_if} 2>/dev/null"
        ));
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
        ]);
        ip(&["link", "set", &ns_if, "netns", &name]);
        ip(&[
            "addr",
            "add",
            &format!("{}/29", netns.host),
            "dev",
            &host_if,
        ]);
        ip(&["link", "set", &host_if, "up"]);
        for (addr, dev) in [(netns.a, &ns_if), (netns.b, &ns_if)] {
            netns.exec(&["ip", "addr", "add", &format!("{addr}/29"), "dev", dev]);
        }
        netns.exec(&["ip", "link", "set", &ns_if, "up"]);
        netns.exec(&["ip", "link", "set", "lo", "up"]);
        // iptables present and working in the namespace (no rule yet).
        netns.exec(&["iptables", "-L", "INPUT", "-n"]);
        netns
    }

    /// Runs a command in the namespace to its end; panics if it fails.
    pub fn exec(&self, args: &[&str]) -> String {
        run(Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args))
    }

    /// A command that runs in the namespace (for servers: spawn it).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c.stdin(Stdio::null());
        c
    }

    /// Drops every packet to address `to` in the namespace (`true`): the
    /// workers using it are partitioned (no reset, no answer: their calls
    /// hang until their own timeouts); `false` heals it.
    pub fn partition(&self, to: Ipv4Addr, on: bool) {
        let to = to.to_string();
        let verb = if on { "-I" } else { "-D" };
        self.exec(&["iptables", verb, "INPUT", "-d", &to, "-j", "DROP"]);
        self.exec(&["iptables", verb, "OUTPUT", "-s", &to, "-j", "DROP"]);
    }

    /// Drops `percent` of the packets each way on the namespace's side of
    /// the veth (`0` removes the rules).
    pub fn loss(&self, percent: u32) {
        self.exec(&["iptables", "-F", "INPUT"]);
        self.exec(&["iptables", "-F", "OUTPUT"]);
        if percent > 0 {
            let p = format!("{:.4}", f64::from(percent) / 100.0);
            for chain in ["INPUT", "OUTPUT"] {
                self.exec(&[
                    "iptables",
                    "-A",
                    chain,
                    "-p",
                    "tcp",
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    &p,
                    "-j",
                    "DROP",
                ]);
            }
        }
    }

    /// Packets dropped by the namespace's rules so far (both chains).
    pub fn dropped_packets(&self) -> u64 {
        let out = self.exec(&["iptables", "-L", "-n", "-v", "-x"]);
        out.lines()
            .filter(|l| l.contains("DROP"))
            .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    /// Starts redis-server in the namespace on `port` of every address;
    /// waits until it answers on `a`.
    pub fn start_redis(&self, port: u16) {
        let dir = super::temp_dir("netns-redis");
        let child = self
            .command("redis-server")
            .args(["--port", &port.to_string(), "--bind", "0.0.0.0"])
            .args(["--protected-mode", "no", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server in {}: {e}", self.name));
        std::mem::forget(child); // the watchdog kills every process of the namespace
        wait_for_port(SocketAddr::from((self.a, port)), "redis-server");
    }

    /// Makes a PostgreSQL cluster (initdb, trust for the veth's /29) and
    /// starts it in the namespace on `port` of every address, as the
    /// `postgres` user when root. Returns its URL on address `addr`.
    pub fn start_postgres(&self, port: u16) -> PgInNetns {
        let bin = super::pg::find_bin();
        let dir = super::temp_dir("netns-pg");
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir));
        let data = dir.join("data");
        run(Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8"])
            .args(["--no-sync", "--no-instructions"]));
        let hba = data.join("pg_hba.conf");
        let mut rules = std::fs::read_to_string(&hba)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", hba.display()));
        rules.push_str(&format!("host all all {}/29 trust\n", self.host));
        std::fs::write(&hba, rules)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", hba.display()));
        let child = self
            .command("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(&dir)
            .args(["-c", "listen_addresses=*", "-c", "fsync=off"])
            .args(["-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
            .args(["-c", "max_connections=200"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start postgres in {}: {e}", self.name));
        std::mem::forget(child);
        wait_for_port(SocketAddr::from((self.a, port)), "postgres");
        PgInNetns { port }
    }
}

/// A PostgreSQL server in a [`Netns`].
pub struct PgInNetns {
    pub port: u16,
}

impl PgInNetns {
    /// Its URL on `addr` (one of the namespace's addresses).
    pub fn url(&self, addr: Ipv4Addr) -> String {
        format!("postgres://postgres@{addr}:{}/postgres", self.port)
    }
}

fn wait_for_port(addr: SocketAddr, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} never listened on {addr}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A forwarder on loopback that holds every chunk of the server's replies
/// for `delay` before passing it on (added latency, as `tc netem delay` on
/// the server's side would add; order and bytes are kept). The delay can
/// be changed while connections are open.
pub struct DelayProxy {
    pub addr: SocketAddr,
    delay_ms: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl DelayProxy {
    pub async fn start(upstream: SocketAddr) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("proxy bind: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("proxy addr: {e}"));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let delay = delay_ms.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(delayed_pipe(client, server, delay.clone()));
            }
        });
        DelayProxy {
            addr,
            delay_ms,
            task,
        }
    }

    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn delayed_pipe(client: TcpStream, server: TcpStream, delay_ms: Arc<AtomicU64>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if server_write.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    // Replies are read at once and released at arrival + delay, in order.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let due = tokio::time::Instant::now()
                        + Duration::from_millis(delay_ms.load(Ordering::SeqCst));
                    if tx.send((due, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if client_write.write_all(&chunk).await.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        _ = upstream => {}
        _ = async { tokio::join!(reader, writer) } => {}
    }
}
