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
pub mod netns;
pub mod pg;
pub mod pg_replica;
pub mod proxy;
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

/// Runs `script` in `sh` detached: it outlives nothing but is told this
/// process's pid as `$1`, so it can wait for it to exit and clean up.
pub fn spawn_watchdog(script: &str) {
    use std::os::unix::process::CommandExt;
    let spawned = Command::new("sh")
        // A group of its own: scripts/run-tests kills the test's group when
        // it overruns its time, and the watchdog must live on to clean up.
        .process_group(0)
        .arg("-c")
        .arg(script)
        .arg("watchdog")
        .arg(std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    if let Err(e) = spawned {
        panic!("cannot start the cleanup watchdog: {e}");
    }
}
