//! The servers the tests start are stopped by a watchdog once their test
//! process exits; the watchdog names a process by its pid *and* its start
//! time, so it never signals a later process that got a stopped server's
//! pid (pids are reused: a run starts thousands of processes).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{kill_if_running, start_time, still_running, still_running_since};

fn sleeper() -> Child {
    Command::new("sleep")
        .arg("60")
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start sleep: {e}"))
}

fn sh(script: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .status()
        .unwrap_or_else(|e| panic!("cannot run sh: {e}"))
        .success()
}

/// Whether `child` exits within `within`.
fn exits(child: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if child.try_wait().unwrap_or_else(|e| panic!("{e}")).is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn a_running_process_is_known_and_signalled() {
    let mut child = sleeper();
    assert!(
        sh(&still_running(child.id())),
        "a live process reads as running"
    );
    assert!(sh(&kill_if_running(child.id(), "9")));
    assert!(
        exits(&mut child, Duration::from_secs(10)),
        "the process was not killed"
    );
    assert!(
        !sh(&still_running(child.id())),
        "a reaped process reads as running"
    );
}

#[test]
fn a_process_that_reuses_the_pid_is_never_signalled() {
    let mut child = sleeper();
    let start = start_time(child.id()).expect("a live process has a start time");
    // The pid as a stopped server had it, with an earlier start: the
    // process that holds the pid now is another one.
    let earlier: u64 = start.parse::<u64>().expect("a number") - 1;
    let other = still_running_since(child.id(), &earlier.to_string());
    assert!(!sh(&other), "another process with the pid reads as running");
    sh(&format!("if {other}; then kill -9 {}; fi", child.id()));
    assert!(
        !exits(&mut child, Duration::from_millis(300)),
        "the watchdog killed a process that only reused the pid"
    );
    let _ = child.kill();
    let _ = child.wait();
}
