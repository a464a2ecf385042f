//! RabbitMQ on loopback: the shared broker of `scripts/with-servers`
//! (IDEM_AMQP_URL), or one started here; and brokers of a test's own,
//! which it may kill and start again on the same port and data.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const HOW_TO: &str = "RabbitMQ is needed: run the tests through scripts/with-servers \
(or scripts/test), which installs Debian's rabbitmq-server and exports IDEM_AMQP_URL, or \
`apt-get install rabbitmq-server` and set IDEM_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
(IDEM_RABBITMQ_SERVER names the rabbitmq-server script if it is not in /usr/lib/rabbitmq/bin)";

/// The `rabbitmq-server` script: IDEM_RABBITMQ_SERVER, or Debian's.
fn server_bin() -> String {
    match std::env::var("IDEM_RABBITMQ_SERVER") {
        Ok(bin) if !bin.is_empty() => bin,
        _ => "/usr/lib/rabbitmq/bin/rabbitmq-server".to_owned(),
    }
}

/// The URL of the broker shared by the tests of this process.
pub fn shared_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| match std::env::var("IDEM_AMQP_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            let server = RabbitServer::start();
            let url = server.url.clone();
            std::mem::forget(server); // the watchdog stops it
            url
        }
    })
}

/// A broker of a test's own: a node named for its port, its data in a
/// temporary directory.
pub struct RabbitServer {
    pub port: u16,
    pub url: String,
    dist: u16,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
}

impl RabbitServer {
    /// Starts a broker on a free port and waits until it takes AMQP
    /// connections.
    pub fn start() -> RabbitServer {
        let port = super::free_port();
        let dir = super::temp_dir("rabbitmq");
        std::fs::write(dir.join("enabled_plugins"), "[].\n")
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let server = RabbitServer {
            port,
            url: format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            dist: super::free_port(),
            dir,
            child: Mutex::new(None),
        };
        server.start_again();
        server
    }

    /// Starts the broker again (after [`kill`](Self::kill)), on the same
    /// port and data: durable queues and persistent messages are back.
    pub fn start_again(&self) {
        use std::os::unix::process::CommandExt;
        let d = |name: &str| self.dir.join(name);
        // A process group of its own: the script starts Erlang's VM as a
        // child, and the group is what is killed.
        let child = Command::new(server_bin())
            .process_group(0)
            // Erlang writes its crash dumps to the working directory.
            .current_dir(&self.dir)
            .env("HOME", &self.dir)
            .env(
                "RABBITMQ_NODENAME",
                format!("idem-test-{}@localhost", self.port),
            )
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", d("mnesia"))
            .env("RABBITMQ_LOG_BASE", d("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", d("rabbitmq"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}. {HOW_TO}", server_bin()));
        super::spawn_watchdog(&format!(
            "kill -9 -- -{} 2>/dev/null; rm -rf '{}'",
            child.id(),
            self.dir.display()
        ));
        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        // Erlang boots in seconds; on a loaded machine, tens.
        let deadline = Instant::now() + Duration::from_secs(180);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "RabbitMQ did not listen on {} within 180 s (its log: {}). {HOW_TO}",
                self.port,
                self.dir.join("log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the broker (SIGKILL: no goodbye to its clients) and waits
    /// until its port is closed.
    pub fn kill(&self) {
        self.kill_group();
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "RabbitMQ on {} still listens",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl RabbitServer {
    /// SIGKILL to the broker's process group (the script and Erlang's VM).
    fn kill_group(&self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = Command::new("kill")
                .args(["-9", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        self.kill_group();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
