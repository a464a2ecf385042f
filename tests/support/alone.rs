//! Tests that need a process of their own: process-wide state (a rustls
//! crypto provider installed, `tracing`'s cached interest in a log line)
//! that another test of the same binary could set first. Such a test
//! starts with [`in_own_process`]: in the test run it runs the same test
//! again, alone, in a child process of this binary and checks that it
//! passed; in the child it lets the body run.

use std::process::Command;

/// The variable that tells the child which test it runs.
const CHILD: &str = "IDEM_TEST_ALONE";

/// `true` in the child process, where the body of test `name` (its full
/// path in the binary, as `cargo test -- --list` shows it) is to run;
/// `false` in the parent once the child passed. Panics with the child's
/// output when it failed or ran no test.
pub fn in_own_process(name: &str) -> bool {
    if std::env::var(CHILD).is_ok_and(|v| v == name) {
        return true;
    }
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("this test binary: {e}"));
    let out = Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {name} in a process of its own: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} failed in its own process ({}):\n{stdout}\n{stderr}",
        out.status
    );
    false
}

/// A child process that is killed (SIGKILL) when this is dropped, unless
/// [`kill`](Killed::kill) did it first: a test that fails midway leaves
/// no process behind.
pub struct Killed(pub std::process::Child);

impl Killed {
    /// Kills the process (SIGKILL: no cleanup of its own, its connections
    /// closed by the kernel) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        self.kill();
    }
}
