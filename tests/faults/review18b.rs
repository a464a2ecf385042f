//! Adversarial review of the issue-18 review fixes (second round): the
//! cluster connection healer of `RedisStore::connect_cluster`, and the
//! error classes of `Failover` / `connect` on a TLS PostgreSQL.
//!
//! Every scenario prints `reliability scenario=... backend=... duration_ms=...`.

use crate::support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use idem::postgres::Failover;
use idem::redis::RedisStore;
use idem::{IdempotencyKey, IdempotencyStore, StoreError};
use support::redis_server::{command, start_cluster_servers};

const HOW_TO: &str = "needs `openssl`, `redis-server`/`redis-cli` 7 and PostgreSQL binaries \
     under /usr/lib/postgresql/*/bin: run scripts/test, or \
     `apt-get install -y openssl redis-server postgresql`";
const PASSWORD: &str = "s3cret-Pa55";

fn report(scenario: &str, backend: &str, fields: &[(&str, String)], started: Instant) {
    let mut line = format!("reliability scenario={scenario} backend={backend}");
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v}"));
    }
    line.push_str(&format!(" duration_ms={}", started.elapsed().as_millis()));
    println!("{line}");
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(" <- ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn key(scope: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope, format!("{:016x}", fastrand::u64(..)))
        .unwrap_or_else(|e| panic!("{e}"))
}

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

fn connected_clients(port: u16) -> u64 {
    command(port, "INFO clients")
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

// ------------------------------------------------------------ Redis healer

/// The whole cluster frozen (SIGSTOP: connections stay open, nothing is
/// answered) for 14 s while calls keep coming: the healer tries to replace
/// the connection every time a call times out after STALL_AFTER, each try
/// bounded by its connect timeout. Nothing may pile up: sockets and tasks
/// stay bounded while frozen, and go back near the start once thawed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_frozen_healer_piles_nothing_up() {
    let started = Instant::now();
    let nodes = start_cluster_servers();
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    let store = RedisStore::connect_cluster(nodes.iter().map(|n| n.url.clone()))
        .await
        .unwrap_or_else(|e| panic!("connect_cluster: {e}. {HOW_TO}"))
        .call_timeout(Duration::from_millis(300));
    for _ in 0..20 {
        store
            .get(&key("review18b.warm"))
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
        let r = store.get(&key("review18b.frozen")).await;
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
        if store.get(&key("review18b.thaw")).await.is_ok() {
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
        let _ = store.get(&key("review18b.after")).await;
        socks = sockets_to(&ports);
    }
    let clients: u64 = ports.iter().map(|p| connected_clients(*p)).sum();
    report(
        "review18b_cluster_frozen_14s",
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
/// it replaced are closed. It is not: `RedisStore::conn` keeps the first
/// connection for the store's whole life (`connection()` reads the healer,
/// but the field made by `RedisStore::new(conn.clone())` stays), so the
/// stalled connection the healer meant to get rid of is never closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_replaced_connection_is_closed() {
    let started = Instant::now();
    let nodes = start_cluster_servers();
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    let store = RedisStore::connect_cluster(nodes.iter().map(|n| n.url.clone()))
        .await
        .unwrap_or_else(|e| panic!("connect_cluster: {e}. {HOW_TO}"))
        .call_timeout(Duration::from_millis(300));
    for _ in 0..10 {
        store
            .acquire(&key("review18b.warm"), None, Duration::from_secs(30))
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
            .acquire(&key("review18b.slow"), None, Duration::from_secs(30))
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
            .acquire(&key("review18b.fast"), None, Duration::from_secs(30))
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
        "review18b_cluster_slow_writes_12s",
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

// ------------------------------------------------------------ PostgreSQL TLS

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl: {e}. {HOW_TO}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// CA and server certificate for localhost/127.0.0.1, made by the test.
fn certs() -> &'static PathBuf {
    static CERTS: OnceLock<PathBuf> = OnceLock::new();
    CERTS.get_or_init(|| {
        let dir = support::temp_dir("r18b-tls");
        support::spawn_watchdog(&format!(
            "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; rm -rf '{}'",
            dir.display()
        ));
        let ext = dir.join("server.ext");
        std::fs::write(
            &ext,
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = |name: &str| dir.join(name).display().to_string();
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &p("ca.key"),
            "-out",
            &p("ca.crt"),
            "-days",
            "2",
            "-subj",
            "/CN=r18b CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &p("server.key"),
            "-out",
            &p("server.csr"),
            "-subj",
            "/CN=localhost",
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &p("server.csr"),
            "-CA",
            &p("ca.crt"),
            "-CAkey",
            &p("ca.key"),
            "-CAcreateserial",
            "-out",
            &p("server.crt"),
            "-days",
            "2",
            "-extfile",
            &ext.display().to_string(),
        ]);
        dir
    })
}

fn run(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}. {HOW_TO}"));
    assert!(
        out.status.success(),
        "{command:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A PostgreSQL with ssl=on, scram-sha-256, `hostssl` lines only.
fn tls_pg_port() -> u16 {
    tls_pg().0
}

/// Runs `sql` as the superuser through the server's socket directory.
fn psql_super(sql: &str) -> String {
    let (port, dir) = tls_pg();
    let bin = support::pg::find_bin();
    let mut c = if support::is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin.join("psql"));
        c
    } else {
        Command::new(bin.join("psql"))
    };
    run(c.args(["-v", "ON_ERROR_STOP=1", "-h"]).arg(dir).args([
        "-p",
        &port.to_string(),
        "-U",
        "postgres",
        "-d",
        "idem",
        "-c",
        sql,
    ]))
}

fn tls_pg() -> &'static (u16, PathBuf) {
    static PG: OnceLock<(u16, PathBuf)> = OnceLock::new();
    PG.get_or_init(|| {
        let certs = certs();
        let bin = support::pg::find_bin();
        let dir = support::temp_dir("r18b-pg");
        let data = dir.join("data");
        let as_postgres = support::is_root();
        let key = dir.join("server.key");
        let cert = dir.join("server.crt");
        std::fs::copy(certs.join("server.key"), &key).unwrap_or_else(|e| panic!("{e}"));
        std::fs::copy(certs.join("server.crt"), &cert).unwrap_or_else(|e| panic!("{e}"));
        run(Command::new("chmod").arg("600").arg(&key));
        if as_postgres {
            run(Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir));
        }
        let tool = |name: &str| {
            let path = bin.join(name);
            if as_postgres {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(path);
                c
            } else {
                Command::new(path)
            }
        };
        run(tool("initdb").arg("-D").arg(&data).args([
            "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions",
        ]));
        let hba = "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n";
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap_or_else(|e| panic!("{e}"));
        let port = support::free_port();
        support::spawn_watchdog(&format!(
            "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; \
             if [ -f '{data}/postmaster.pid' ]; then \
               pid=$(head -1 '{data}/postmaster.pid'); kill -INT \"$pid\" 2>/dev/null; \
               n=0; while kill -0 \"$pid\" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done; \
             fi; rm -rf '{dir}'",
            data = data.display(),
            dir = dir.display()
        ));
        let options = format!(
            "-p {port} -k {dir} -c listen_addresses=127.0.0.1 -c fsync=off \
             -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key} \
             -c password_encryption=scram-sha-256",
            dir = dir.display(),
            cert = cert.display(),
            key = key.display(),
        );
        run(tool("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("server.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]));
        let psql = |sql: &str| {
            run(tool("psql")
                .args(["-v", "ON_ERROR_STOP=1", "-h"])
                .arg(&dir)
                .args(["-p", &port.to_string(), "-U", "postgres", "-d", "postgres", "-c", sql]))
        };
        psql(&format!("CREATE ROLE idem LOGIN PASSWORD '{PASSWORD}'"));
        psql("CREATE DATABASE idem OWNER idem");
        (port, dir)
    })
}

fn pool_options() -> sqlx::postgres::PgPoolOptions {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
}

/// A CA file that does not exist (`sslrootcert=` a typo) is a TLS setting
/// no retry cures, like an untrusted certificate: it must be
/// `StoreError::Backend`, through `connect` and through `Failover`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_missing_ca_file_is_not_retryable() {
    let port = tls_pg_port();
    // Control: the right CA connects.
    let good = format!(
        "postgres://idem:{PASSWORD}@127.0.0.1:{port}/idem?sslmode=verify-full&sslrootcert={}",
        certs().join("ca.crt").display()
    );
    let pool = idem::postgres::connect_with(pool_options(), &good)
        .await
        .unwrap_or_else(|e| panic!("control connect: {}", chain(&e)));
    pool.close().await;

    let missing = format!(
        "postgres://idem:{PASSWORD}@127.0.0.1:{port}/idem?sslmode=verify-full&sslrootcert={}",
        certs().join("no-such-ca.crt").display()
    );
    let mut failures = Vec::new();
    let started = Instant::now();
    let direct = idem::postgres::connect_with(pool_options(), &missing).await;
    let direct_ms = started.elapsed().as_millis();
    let started2 = Instant::now();
    let failover = Failover::new([missing.as_str()]).unwrap_or_else(|e| panic!("{e}"));
    let through = failover.connect_with(pool_options()).await;
    let failover_ms = started2.elapsed().as_millis();
    for (path, result, ms) in [
        ("connect", direct, direct_ms),
        ("failover", through, failover_ms),
    ] {
        let class = match &result {
            Ok(_) => "connected".to_owned(),
            Err(StoreError::Backend(_)) => "Backend".to_owned(),
            Err(StoreError::Unavailable(_)) => "Unavailable".to_owned(),
            Err(e) => format!("{e:?}"),
        };
        let text = result.as_ref().err().map(|e| chain(e)).unwrap_or_default();
        eprintln!("{path}: {class} in {ms} ms: {text}");
        report(
            "review18b_pg_missing_ca_file",
            "postgres",
            &[
                ("path", path.into()),
                ("error", class.clone()),
                ("fail_ms", ms.to_string()),
            ],
            started,
        );
        if class != "Backend" {
            failures.push(format!("{path}: {class} ({text})"));
        }
    }
    assert!(
        failures.is_empty(),
        "a missing sslrootcert file is classed retryable: {failures:?}"
    );
}

/// Control for the Failover classes: a wrong password on every server is
/// not retryable; one server with a wrong password and one down (refused)
/// is retryable (the down one may come back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failover_password_classes() {
    let started = Instant::now();
    let port = tls_pg_port();
    let ca = certs().join("ca.crt");
    let wrong = format!(
        "postgres://idem:wrong@127.0.0.1:{port}/idem?sslmode=verify-full&sslrootcert={}",
        ca.display()
    );
    let r = Failover::new([wrong.as_str()])
        .unwrap_or_else(|e| panic!("{e}"))
        .connect_with(pool_options())
        .await;
    assert!(
        matches!(r, Err(StoreError::Backend(_))),
        "wrong password through Failover: {:?}",
        r.err()
    );
    let down = format!(
        "postgres://idem:{PASSWORD}@127.0.0.1:{}/idem",
        support::free_port()
    );
    let r = Failover::new([wrong.as_str(), down.as_str()])
        .unwrap_or_else(|e| panic!("{e}"))
        .connect_with(pool_options())
        .await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(_))),
        "wrong password + a server down through Failover: {:?}",
        r.err()
    );
    report(
        "review18b_pg_failover_password_classes",
        "postgres",
        &[("held", "true".into())],
        started,
    );
}

/// The timeline query on a role that may not run `pg_current_wal_lsn()`
/// (a hardened server: `REVOKE EXECUTE ... FROM PUBLIC`). Every server
/// answers "permission denied" to the probe, for ever: that is not a fault
/// a retry cures, yet the Failover must not panic, and the caller must be
/// able to tell it from a server that is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failover_timeline_query_without_privilege() {
    let started = Instant::now();
    let port = tls_pg_port();
    let ca = certs().join("ca.crt");
    let admin = format!(
        "postgres://idem:{PASSWORD}@127.0.0.1:{port}/idem?sslmode=verify-full&sslrootcert={}",
        ca.display()
    );
    let _ = admin;
    psql_super(
        "CREATE ROLE nopriv LOGIN PASSWORD 'np-Pa55'; \
         REVOKE EXECUTE ON FUNCTION pg_current_wal_lsn() FROM PUBLIC;",
    );
    let url = format!(
        "postgres://nopriv:np-Pa55@127.0.0.1:{port}/idem?sslmode=verify-full&sslrootcert={}",
        ca.display()
    );
    let first = Instant::now();
    let r = Failover::new([url.as_str()])
        .unwrap_or_else(|e| panic!("{e}"))
        .connect_with(pool_options())
        .await;
    let ms = first.elapsed().as_millis();
    let class = match &r {
        Ok(_) => "connected".to_owned(),
        Err(StoreError::Backend(_)) => "Backend".to_owned(),
        Err(StoreError::Unavailable(_)) => "Unavailable".to_owned(),
        Err(e) => format!("{e:?}"),
    };
    let text = r.as_ref().err().map(|e| chain(e)).unwrap_or_default();
    eprintln!("nopriv through Failover: {class} in {ms} ms: {text}");
    report(
        "review18b_pg_failover_timeline_without_privilege",
        "postgres",
        &[("error", class.clone()), ("fail_ms", ms.to_string())],
        started,
    );
    assert!(
        class == "connected" || class == "Backend",
        "a permission refused on the probe's timeline query is classed {class} (retried for ever): {text}"
    );
}

/// Connections of other sessions to the server of `url`, by application
/// name (sqlx's default: the binary's name is not set, so count every
/// client backend but ours).
async fn other_sessions(admin: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
    )
    .fetch_one(admin)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The watcher ends, and its connection closes, when every Failover and
/// store is dropped and the pool closed: no session is left on the server.
/// And a store whose Failover found a server keeps working on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failover_watcher_ends_on_drop() {
    let started = Instant::now();
    let server = support::pg::PgServer::start();
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let before = other_sessions(&admin).await;
    let mut during = 0;
    for round in 0..3 {
        let failover = Failover::new([server.url.as_str()])
            .unwrap_or_else(|e| panic!("{e}"))
            .check_interval(Duration::from_millis(10));
        let pool = failover
            .connect_with(pool_options())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let store = idem::postgres::PgStore::builder(pool.clone())
            .failover(failover.clone())
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        if round == 0 {
            store
                .migrate()
                .await
                .unwrap_or_else(|e| panic!("migrate: {e}"));
        }
        let k = key("review18b.watcher");
        match store.acquire(&k, None, Duration::from_secs(30)).await {
            Ok(idem::Acquisition::Acquired(lease)) => store
                .complete(&lease, b"ok", Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("complete: {e}")),
            other => panic!("acquire: {other:?}"),
        }
        // Let the watcher run a few checks.
        tokio::time::sleep(Duration::from_millis(100)).await;
        during = during.max(other_sessions(&admin).await);
        drop(store);
        drop(failover);
        pool.close().await;
    }
    let settle = Instant::now();
    let mut after = other_sessions(&admin).await;
    while after > before && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = other_sessions(&admin).await;
    }
    report(
        "review18b_pg_failover_watcher_drop",
        "postgres",
        &[
            ("sessions_before", before.to_string()),
            ("sessions_during", during.to_string()),
            ("sessions_after", after.to_string()),
        ],
        started,
    );
    assert!(
        after <= before,
        "sessions left on the server after 3 Failovers were dropped: {before} -> {after}"
    );
}

/// One master frozen (SIGSTOP: a host that stops answering, as behind a
/// network partition) in a cluster with replicas: the cluster promotes its
/// replica after `cluster-node-timeout`. Calls for the frozen shard's keys
/// time out, calls for the other shards answer. The healer looks at the
/// whole connection ("no call had an answer for STALL_AFTER"), so it never
/// replaces it; does the store reach the promoted replica for that shard
/// (within 20 s of the promotion), or does the shard stay unavailable
/// while the master stays frozen?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_frozen_master_shard_served_after_promotion() {
    use support::redis_replicas::{query, ReplicatedCluster};
    let started = Instant::now();
    let cluster = ReplicatedCluster::start(Duration::from_secs(2));
    cluster.wait_healthy(Duration::from_secs(30));
    let store = RedisStore::connect_cluster(cluster.urls())
        .await
        .unwrap_or_else(|e| panic!("connect_cluster: {e}. {HOW_TO}"))
        .call_timeout(Duration::from_millis(300));
    let k_frozen = key("review18b.shard");
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
        let k = key("review18b.shard");
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
    cluster.servers[victim].signal("STOP");
    let frozen = Instant::now();
    // Traffic on both shards while the cluster fails over.
    let promoted_after = loop {
        let _ = store.get(&k_frozen).await;
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
        if store.get(&k_frozen).await.is_ok() {
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
        "review18b_cluster_frozen_master_shard",
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
