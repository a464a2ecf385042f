//! A PostgreSQL primary and a streaming standby for failover tests: the
//! primary made by `initdb` (as the `postgres` user when we are root), the
//! standby by `pg_basebackup -R` from it, each on its own free port in one
//! temp dir. Replication is synchronous (`synchronous_standby_names = '*'`,
//! `synchronous_commit = on`: a commit returns once the standby has flushed
//! it) or asynchronous. `kill_primary` is a crash (SIGKILL to the
//! postmaster and every backend), `promote_standby` is `pg_ctl promote`. A
//! watchdog stops both servers and removes the files when the test process
//! exits.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::pg::{find_bin, run};

/// How the primary waits for its standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// A commit returns once the standby flushed its WAL.
    Sync,
    /// A commit returns once it is on the primary's disk; the standby
    /// follows when it can.
    Async,
}

/// A primary and its standby, owned by this test process.
pub struct PgReplicaPair {
    pub primary_url: String,
    pub standby_url: String,
    pub primary_port: u16,
    pub standby_port: u16,
    pub replication: Replication,
    bin: PathBuf,
    dir: PathBuf,
    as_postgres: bool,
    primary_options: std::sync::OnceLock<String>,
    standby_options: std::sync::OnceLock<String>,
}

impl PgReplicaPair {
    /// Starts the primary, takes the standby from it and waits until the
    /// standby streams (and, in `Sync` mode, is the synchronous one).
    pub fn start(replication: Replication) -> PgReplicaPair {
        let bin = find_bin();
        let dir = super::temp_dir("pg-replica");
        let as_postgres = super::is_root();
        if as_postgres {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir));
        }
        let (primary_port, standby_port) = (super::free_port(), super::free_port());
        let pair = PgReplicaPair {
            primary_url: format!("postgres://postgres@127.0.0.1:{primary_port}/postgres"),
            standby_url: format!("postgres://postgres@127.0.0.1:{standby_port}/postgres"),
            primary_port,
            standby_port,
            replication,
            bin,
            dir,
            as_postgres,
            primary_options: std::sync::OnceLock::new(),
            standby_options: std::sync::OnceLock::new(),
        };
        // Stop both servers and remove their files once this process is gone.
        super::spawn_watchdog(&format!(
            "for d in '{p}' '{s}'; do \
               if [ -f \"$d/postmaster.pid\" ]; then \
                 pid=$(head -1 \"$d/postmaster.pid\"); \
                 tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -qF -- \"$d\" && kill -INT \"$pid\"; \
                 n=0; while kill -0 \"$pid\" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done; \
               fi; \
             done; rm -rf '{dir}'",
            p = pair.primary_data().display(),
            s = pair.standby_data().display(),
            dir = pair.dir.display()
        ));
        let primary = pair.primary_data();
        run(pair.command("initdb").arg("-D").arg(&primary).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        ]));
        // Trust on loopback, replication connections included.
        let hba = primary.join("pg_hba.conf");
        let mut rules = std::fs::read_to_string(&hba)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", hba.display()));
        rules.push_str(
            "\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n",
        );
        std::fs::write(&hba, rules)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", hba.display()));
        let mut options = format!(
            "-p {primary_port} -k {} -c listen_addresses=127.0.0.1 -c wal_level=replica \
             -c max_wal_senders=4 -c synchronous_commit=on -c max_connections=300 \
             -c shared_buffers=128MB -c full_page_writes=off",
            pair.dir.display()
        );
        if replication == Replication::Sync {
            options.push_str(" -c synchronous_standby_names='*'");
        }
        pair.pg_ctl_start(&primary, "primary.log", &options);
        let _ = pair.primary_options.set(options.clone());
        run(pair
            .command("pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &primary_port.to_string()])
            .args(["-U", "postgres", "-D"])
            .arg(pair.standby_data())
            .args(["-R", "-X", "stream", "--no-sync", "-c", "fast"]));
        // The standby's own settings: never a synchronous standby list of
        // its own (once promoted it would wait for a standby it has not).
        let standby_options = format!(
            "-p {standby_port} -k {} -c listen_addresses=127.0.0.1 -c hot_standby=on \
             -c synchronous_commit=on -c synchronous_standby_names='' -c max_connections=300 \
             -c shared_buffers=128MB -c full_page_writes=off",
            pair.dir.display()
        );
        pair.pg_ctl_start(&pair.standby_data(), "standby.log", &standby_options);
        let _ = pair.standby_options.set(standby_options.clone());
        pair.until_streaming();
        pair
    }

    fn primary_data(&self) -> PathBuf {
        self.dir.join("primary")
    }

    fn standby_data(&self) -> PathBuf {
        self.dir.join("standby")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
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

    /// Runs one statement on the primary with psql; its output.
    pub fn psql_primary(&self, sql: &str) -> String {
        self.psql(self.primary_port, sql)
            .unwrap_or_else(|| panic!("psql on the primary failed: {sql}"))
    }

    fn psql(&self, port: u16, sql: &str) -> Option<String> {
        let out = self
            .command("psql")
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-XAtq", "-c", sql])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn pg_ctl_start(&self, data: &Path, log: &str, options: &str) {
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(data)
            .arg("-l")
            .arg(self.dir.join(log))
            .args(["-w", "-t", "60", "-o", options, "start"]));
    }

    /// Waits (60 s at most) until the primary reports the standby streaming,
    /// as its synchronous standby in `Sync` mode.
    fn until_streaming(&self) {
        let wanted = match self.replication {
            Replication::Sync => "sync",
            Replication::Async => "async",
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let state = self.psql(
                self.primary_port,
                "SELECT state || '/' || sync_state FROM pg_stat_replication",
            );
            if state.as_deref() == Some(&format!("streaming/{wanted}")) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the standby did not stream ({wanted}) within 60 s: pg_stat_replication says {state:?}; see {}",
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A crash of the primary: SIGKILL to the postmaster and to every one
    /// of its processes at once (no shutdown checkpoint, no goodbye to
    /// clients or to the standby).
    pub fn kill_primary(&self) {
        let pid_file = self.primary_data().join("postmaster.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", pid_file.display()));
        let pid = pid.lines().next().unwrap_or_default().trim().to_owned();
        let status = Command::new("sh")
            .arg("-c")
            .arg(format!("kill -9 {pid} && (pkill -9 -P {pid} || true)"))
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "kill -9 {pid} (the primary's postmaster) failed"
        );
    }

    /// `pg_ctl promote` on the standby, then waits (60 s at most) until it
    /// answers `pg_is_in_recovery() = false`.
    pub fn promote_standby(&self) {
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.standby_data())
            .args(["-w", "-t", "60", "promote"]));
        let deadline = Instant::now() + Duration::from_secs(60);
        while self
            .psql(self.standby_port, "SELECT pg_is_in_recovery()")
            .as_deref()
            != Some("f")
        {
            assert!(
                Instant::now() < deadline,
                "the standby was not out of recovery 60 s after pg_ctl promote; see {}",
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl PgReplicaPair {
    /// Starts the old primary's data directory again, as it was (after
    /// `kill_primary`: crash recovery, then a writable primary again: what
    /// a host reboot with the server enabled in systemd does).
    pub fn start_old_primary_again(&self) {
        let options = self.primary_options.get().expect("started").clone();
        // The killed server's processes may hold its shared memory or port
        // a little while: try again until it starts (30 s at most).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self
                .command("pg_ctl")
                .arg("-D")
                .arg(self.primary_data())
                .arg("-l")
                .arg(self.dir.join("primary2.log"))
                .args(["-w", "-t", "60", "-o", &options, "start"])
                .output()
                .unwrap_or_else(|e| panic!("cannot run pg_ctl: {e}"));
            if out.status.success() {
                return;
            }
            let log = std::fs::read_to_string(self.dir.join("primary2.log")).unwrap_or_default();
            assert!(
                Instant::now() < deadline,
                "the old primary did not start again within 30 s: {}",
                log.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops the standby (fast shutdown).
    pub fn stop_standby(&self) {
        run(self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.standby_data())
            .args(["-w", "-t", "60", "-m", "fast", "stop"]));
    }

    /// Starts the (stopped) standby again with its own settings.
    pub fn start_standby_again(&self) {
        let options = self.standby_options.get().expect("started").clone();
        self.pg_ctl_start(&self.standby_data(), "standby2.log", &options);
    }

    /// Runs one statement on the standby (or the promoted standby).
    pub fn psql_standby(&self, sql: &str) -> String {
        self.psql(self.standby_port, sql)
            .unwrap_or_else(|| panic!("psql on the standby failed: {sql}"))
    }
}
