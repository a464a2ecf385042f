//! A real PostgreSQL for tests: `initdb` in a temp dir, a free port, run as
//! the `postgres` user when we are root. `IDEM_POSTGRES_URL` replaces the
//! shared server with one of yours.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

const HOW_TO: &str = "PostgreSQL is needed for these tests: run scripts/test (it installs \
     the server), or `apt-get install -y postgresql`, or set IDEM_POSTGRES_URL to a server of yours";

/// A PostgreSQL server owned by this test process.
pub struct PgServer {
    pub url: String,
    pub port: u16,
    bin: PathBuf,
    dir: PathBuf,
    as_postgres: bool,
    /// Settings added to every start (`-c name=value ...`).
    options: String,
}

/// The URL of the server shared by the tests of this process.
pub fn shared_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| match std::env::var("IDEM_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let server = PgServer::start();
            let url = server.url.clone();
            // Lives as long as the process; the watchdog stops it.
            std::mem::forget(server);
            url
        }
    })
}

/// A URL of the shared server through a new proxy (which can cut the
/// connections, lose or delay replies), and the proxy.
pub async fn proxied() -> (super::proxy::CountingProxy, String) {
    let url = shared_url();
    let host_port = url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("cannot parse {url}"));
    let upstream: std::net::SocketAddr = tokio::net::lookup_host(host_port)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| panic!("cannot resolve {host_port}"));
    let proxy = super::proxy::CountingProxy::start(upstream).await;
    let proxied = url.replacen(&upstream.to_string(), &proxy.addr.to_string(), 1);
    let proxied = if proxied.contains(&proxy.addr.to_string()) {
        proxied
    } else {
        format!("postgres://postgres@{}/postgres", proxy.addr)
    };
    (proxy, proxied)
}

/// A pool the way the README recommends: no ping before each use.
pub async fn pool(url: &str, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}. {HOW_TO}"))
}

/// Waits (10 s at most) until `n` sessions of `pool`'s server wait on a
/// lock.
pub async fn until_waiting_on_locks(pool: &PgPool, n: i64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        if waiting >= n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{n} sessions never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn find_bin() -> PathBuf {
    if let Ok(dir) = std::env::var("IDEM_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .filter(|p| p.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
        .pop()
        .unwrap_or_else(|| panic!("no initdb under /usr/lib/postgresql/*/bin. {HOW_TO}"))
}

impl PgServer {
    /// initdb + start on a free port; panics with instructions on failure.
    pub fn start() -> PgServer {
        let server = PgServer::init("");
        server.start_again();
        server
    }

    /// initdb for a server on a free port, not started yet: the caller may
    /// change its files in [`PgServer::data`] (pg_hba.conf, a certificate)
    /// before [`PgServer::start_again`]. `options` (`-c name=value ...`)
    /// are added to the usual settings at every start.
    pub fn init(options: &str) -> PgServer {
        let bin = find_bin();
        let dir = super::temp_dir("pg");
        let as_postgres = super::is_root();
        if as_postgres {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir));
        }
        let port = super::free_port();
        let server = PgServer {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            port,
            bin,
            dir,
            as_postgres,
            options: options.to_owned(),
        };
        let data = server.data();
        run(server.command("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        ]));
        // Stop the server and remove its files once this process is gone.
        super::spawn_watchdog(&format!(
            "if [ -f '{data}/postmaster.pid' ]; then \
               pid=$(head -1 '{data}/postmaster.pid'); \
               tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -qF -- '{data}' && kill -INT \"$pid\"; \
               n=0; while kill -0 \"$pid\" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done; \
             fi; rm -rf '{dir}'",
            data = data.display(),
            dir = server.dir.display()
        ));
        server
    }

    /// The data directory.
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn command(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// Starts the (stopped) server and waits until it accepts connections.
    pub fn start_again(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
             -c full_page_writes=off -c max_connections=300 -c shared_buffers=128MB {}",
            self.port,
            self.dir.display(),
            self.options
        );
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]));
    }

    /// Stops the server (fast shutdown: sessions are disconnected).
    pub fn stop(&self) {
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-w", "-t", "60", "-m", "fast", "stop"]));
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Runs `sql` with psql in database `db` as the superuser, through the
    /// server's socket directory (whatever pg_hba.conf says of TCP); its
    /// output.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        output(
            self.command("psql")
                .args(["-v", "ON_ERROR_STOP=1", "-h"])
                .arg(&self.dir)
                .args(["-p", &self.port.to_string(), "-U", "postgres", "-d", db])
                .args(["-c", sql]),
        )
    }

    /// Sends `signal` (`STOP`, `CONT`) to the postmaster and every backend
    /// process: SIGSTOP freezes the whole server, connections stay open and
    /// nothing is answered, so clients time out.
    pub fn signal(&self, signal: &str) {
        let pid_file = self.data().join("postmaster.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", pid_file.display()));
        let pid = pid.lines().next().unwrap_or_default().trim().to_string();
        let status = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "kill -{signal} {pid} && (pkill -{signal} -P {pid} || true)"
            ))
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "kill -{signal} {pid} failed"
        );
    }
}

pub fn run(command: &mut Command) {
    output(command);
}

/// Runs `command`; its standard output. Panics with its output if it fails.
pub fn output(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}. {HOW_TO}"));
    if !out.status.success() {
        panic!(
            "{command:?} failed: {}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}
