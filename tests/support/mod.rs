//! Test support: real servers on loopback, started by the tests themselves.
//!
//! Shared by `tests/` and `benches/` (`#[path = "../tests/support/mod.rs"]`).
//! Every server runs in a temporary directory on a free port and is stopped
//! by a watchdog process when the test process exits, however it exits.
#![allow(dead_code, unreachable_pub)]

pub mod alone;
pub mod chaos;
pub mod flaky;
pub mod kafka;
#[cfg(feature = "postgres")]
pub mod ledger;
pub mod logs;
pub mod moto;
pub mod nats;
pub mod netns;
pub mod pg;
pub mod pg_replica;
pub mod proxy;
pub mod rabbitmq;
pub mod redis_replicas;
pub mod redis_server;
pub mod report;
#[cfg(feature = "postgres")]
pub mod storm;
pub mod tls;

use std::net::TcpListener;
use std::process::{Command, Stdio};

/// A TCP port on 127.0.0.1 that nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port on 127.0.0.1: {e}"))
}

/// Whether this process runs as root (servers such as PostgreSQL refuse to).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A fresh directory under the system temp dir.
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idem-{tag}-{}-{:08x}",
        std::process::id(),
        fastrand::u32(..)
    ));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// Runs `cleanup` in `sh`, detached, once this process has exited.
///
/// Pids are reused (32768 of them here, and a test run starts thousands
/// of processes): the wait and every kill in `cleanup` must name a process
/// by more than its pid (see [`still_running`]), or a watchdog kills
/// whatever program got the pid of a server that a test already stopped.
pub fn spawn_watchdog(cleanup: &str) {
    let script = format!(
        "while {}; do sleep 0.5; done; {cleanup}",
        still_running(std::process::id())
    );
    use std::os::unix::process::CommandExt;
    let spawned = Command::new("sh")
        // A group of its own: scripts/run-tests kills the test's group when
        // it overruns its time, and the watchdog must live on to clean up.
        .process_group(0)
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    if let Err(e) = spawned {
        panic!("cannot start the cleanup watchdog: {e}");
    }
}

/// A shell test, true while `pid` is still the process it was when this
/// was called: the same start time in `/proc/<pid>/stat` (its 22nd field,
/// read after the command name, which may hold spaces). False once that
/// process is gone, even if another one has its pid now.
pub fn still_running(pid: u32) -> String {
    still_running_since(pid, &start_time(pid).unwrap_or_else(|| "gone".into()))
}

/// [`still_running`] for a process that started at `start`.
pub fn still_running_since(pid: u32, start: &str) -> String {
    format!("[ \"$(sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f20)\" = '{start}' ]")
}

/// `kill -<signal> pid` in shell, sent only while [`still_running`] holds.
pub fn kill_if_running(pid: u32, signal: &str) -> String {
    format!(
        "if {}; then kill -{signal} {pid} 2>/dev/null; fi",
        still_running(pid)
    )
}

/// The start time of `pid` (clock ticks after boot), as `/proc` gives it.
pub fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = &stat[stat.rfind(") ")? + 2..];
    fields.split(' ').nth(19).map(str::to_owned)
}
