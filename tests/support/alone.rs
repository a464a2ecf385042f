//! Tests that need a process of their own: process-wide state (a rustls
//! crypto provider installed, `tracing`'s cached interest in a log line)
//! that another test of the same binary could set first. Such a test
//! starts with [`in_own_process`]: in the test run it runs the same test
//! again, alone, in a child process of this binary and checks that it
//! passed; in the child it lets the body run.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The longest a test may run in its own process.
const ALONE_LIMIT: Duration = Duration::from_secs(300);

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
    let child = Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {name} in a process of its own: {e}"));
    let mut child = Killed(child);
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = read(child.0.stdout.take().map(|p| Box::new(p) as _));
    let stderr = read(child.0.stderr.take().map(|p| Box::new(p) as _));
    // Bounded: a child that hangs is killed and fails the test.
    let deadline = Instant::now() + ALONE_LIMIT;
    let status = loop {
        match child.0.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => break None,
            Err(e) => panic!("{name} in its own process: {e}"),
        }
    };
    if status.is_none() {
        child.kill();
    }
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    print!("{stdout}");
    eprint!("{stderr}");
    let Some(status) = status else {
        panic!("{name} did not end within {ALONE_LIMIT:?} in its own process:\n{stdout}\n{stderr}")
    };
    assert!(
        status.success() && stdout.contains("1 passed"),
        "{name} failed in its own process ({status}):\n{stdout}\n{stderr}"
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

/// A child process of this binary that runs test `name` with `var` set to
/// `value` (the test sees it and plays its part, say a consumer to be
/// killed), with the servers of this process (`servers`: the variables
/// that name them, such as `IDEM_KAFKA_BROKERS`; PostgreSQL's is added);
/// its output lines are read on a thread. Killed (SIGKILL) when dropped.
pub struct Part {
    process: Killed,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Part {
    /// Starts test `name` (its full path) in a child with `var=value`.
    pub fn start(name: &str, var: &str, value: &str, servers: &[(&str, &str)]) -> Part {
        let exe = std::env::current_exe().unwrap_or_else(|e| panic!("this test binary: {e}"));
        let mut command = Command::new(exe);
        command
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(var, value)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        // The servers this process uses (perhaps started by it), so the
        // child starts none of its own.
        #[cfg(feature = "postgres")]
        command.env("IDEM_POSTGRES_URL", super::pg::shared_url());
        command.envs(servers.iter().copied());
        let mut process = Killed(
            command
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {name} in a child: {e}")),
        );
        let out = process
            .0
            .stdout
            .take()
            .unwrap_or_else(|| panic!("the child's stdout"));
        let (send, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                println!("child: {line}");
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Part { process, lines }
    }

    /// The rest of the first line (from here on) that holds `prefix`;
    /// fails after `limit`, or when the child ends first.
    pub fn line_with(&mut self, prefix: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some((_, rest)) = line.split_once(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("no {prefix:?} from the child in {limit:?}")
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("the child ended before {prefix:?}")
                }
            }
        }
    }

    /// Kills the child (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}
