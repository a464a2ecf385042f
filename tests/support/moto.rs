//! moto's server mode (DynamoDB, SQS) on loopback: the shared server of
//! `scripts/with-servers` (IDEM_MOTO_URL), or one started here.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const HOW_TO: &str = "moto's server mode is needed: run the tests through scripts/with-servers \
(or scripts/test), which installs moto and exports IDEM_MOTO_URL, or install it with \
`python3 -m venv ~/.cache/idem/moto && ~/.cache/idem/moto/bin/pip install 'moto[server]==5.2.5'` \
and start `moto_server -H 127.0.0.1 -p PORT` with IDEM_MOTO_URL=http://127.0.0.1:PORT";

/// The moto binary: IDEM_MOTO_BIN, the venv of scripts/lib.sh, or PATH.
fn moto_bin() -> String {
    if let Ok(bin) = std::env::var("IDEM_MOTO_BIN") {
        if !bin.is_empty() {
            return bin;
        }
    }
    let home = std::env::var("HOME").unwrap_or_default();
    let venv = std::env::var("IDEM_MOTO_VENV").unwrap_or(format!("{home}/.cache/idem/moto"));
    let in_venv = format!("{venv}/bin/moto_server");
    if std::path::Path::new(&in_venv).exists() {
        return in_venv;
    }
    "moto_server".to_owned()
}

/// The URL of the moto server shared by the tests of this process.
pub fn shared_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| match std::env::var("IDEM_MOTO_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let server = MotoServer::start();
            let url = server.url.clone();
            std::mem::forget(server); // the watchdog stops it
            url
        }
    })
}

/// A moto server of a test's own, which it may freeze and thaw.
pub struct MotoServer {
    pub port: u16,
    pub url: String,
    child: Mutex<Option<Child>>,
}

impl MotoServer {
    /// Starts moto_server on a free port and waits until it answers.
    pub fn start() -> MotoServer {
        let port = super::free_port();
        let child = Command::new(moto_bin())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start moto_server: {e}. {HOW_TO}"));
        super::spawn_watchdog(&format!(
            "{}; {}",
            super::kill_if_running(child.id(), "CONT"),
            super::kill_if_running(child.id(), "9")
        ));
        let server = MotoServer {
            port,
            url: format!("http://127.0.0.1:{port}"),
            child: Mutex::new(Some(child)),
        };
        // moto imports much of boto at start: tens of seconds on a loaded
        // machine.
        let deadline = Instant::now() + Duration::from_secs(180);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "moto_server did not listen on {port} within 180 s. {HOW_TO}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = self
            .child
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            let status = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
            assert!(
                matches!(status, Ok(s) if s.success()),
                "kill {signal}: {status:?}"
            );
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is
    /// answered, so calls time out.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Thaws a frozen server (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
