//! `idem proxy` as an operator runs it: the real binary in front of a real
//! upstream (`upstream.py`, a Python stdlib server that counts what it
//! sees) on real stores (Redis at `IDEM_REDIS_URL`, PostgreSQL at
//! `IDEM_POSTGRES_URL`, both from `scripts/with-servers`; moto and a Redis
//! Cluster for the stores by URL, from it too or started here).
//!
//! Every test starts its own upstream and proxy on free ports and uses a
//! scope of its own, so the tests run in parallel on one server. Every
//! process is SIGKILLed when its handle drops, and by a watchdog if the
//! test binary dies first.

mod config;
mod crash;
mod disconnect;
mod duplicates;
mod framing;
mod headers;
mod observability;
mod protocols;
mod routes;
mod shutdown;
mod stores;
mod streaming;
mod tenants;
mod upstream_errors;
mod wire;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use serde_json::Value;
use tokio::io::AsyncReadExt;

use crate::support;

const UPSTREAM_PY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cli/proxy/upstream.py");

const HOW_TO: &str = "run the tests under scripts/with-servers: \
     scripts/with-servers --only redis,postgres,moto,redis-cluster cargo test -p idem-cli --test cli proxy::";

/// The Redis the proxies store their records in.
pub(crate) fn redis_url() -> String {
    match std::env::var("IDEM_REDIS_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!("IDEM_REDIS_URL is not set: {HOW_TO}"),
    }
}

/// The PostgreSQL some proxies store their records in, its table created
/// as an operator would (`idem migrate`).
pub(crate) fn postgres_url() -> String {
    let url = match std::env::var("IDEM_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!("IDEM_POSTGRES_URL is not set: {HOW_TO}"),
    };
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--backend", "postgres", "--postgres-url", &url, "migrate"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run idem migrate: {e}"));
    assert!(
        out.status.success(),
        "idem migrate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    url
}

/// A scope no other test uses.
pub(crate) fn scope(tag: &str) -> String {
    format!("proxy.{tag}.{:08x}", fastrand::u32(..))
}

/// The proxy's options for `upstream`, `store` and `scope`, then `more`.
pub(crate) fn options(upstream: &str, store: &str, scope: &str, more: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        upstream,
        "--store",
        store,
        "--scope",
        scope,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

/// The options most tests use: Redis, no tenants (`--allow-anonymous`).
pub(crate) fn anonymous(upstream: &Upstream, scope: &str, more: &[&str]) -> Vec<String> {
    let mut args = options(&upstream.url(), &redis_url(), scope, &["--allow-anonymous"]);
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

/// A child process with its stderr in a file, killed when dropped.
struct Process {
    name: String,
    child: Child,
    stderr: PathBuf,
    stdout_lines: mpsc::Receiver<String>,
}

impl Process {
    /// Starts `program args` and waits (`within`) for a stdout line that
    /// contains `ready`, returned.
    fn start(
        name: &str,
        program: &str,
        args: &[String],
        ready: &str,
        within: Duration,
    ) -> (Self, String) {
        let dir = support::temp_dir(name);
        let stderr = dir.join("stderr.log");
        let file = std::fs::File::create(&stderr)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", stderr.display()));
        let mut cmd = Command::new(program);
        for (var, _) in std::env::vars() {
            if var.starts_with("IDEM_") {
                cmd.env_remove(var);
            }
        }
        let mut child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({program}): {e}"));
        support::spawn_watchdog(&support::kill_if_running(child.id(), "KILL"));
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().expect("stdout is piped");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut process = Process {
            name: name.to_owned(),
            child,
            stderr,
            stdout_lines: rx,
        };
        let deadline = Instant::now() + within;
        let mut before = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match process.stdout_lines.recv_timeout(left) {
                Ok(line) if line.contains(ready) => return (process, line),
                Ok(line) => before.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = process.wait_exit(Duration::from_secs(10));
                    panic!(
                        "{name} exited ({status}) before printing a `{ready}` line\n\
                         args: {args:?}\nstdout: {before:?}\nstderr:\n{}",
                        process.logs()
                    );
                }
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "{name} printed no `{ready}` line within {within:?}\n\
                     args: {args:?}\nstdout: {before:?}\nstderr:\n{}",
                    process.logs()
                ),
            }
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                other => {
                    self.kill();
                    panic!(
                        "{} did not exit within {within:?} ({other:?})\nstderr:\n{}",
                        self.name,
                        self.logs()
                    );
                }
            }
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The Python upstream (`upstream.py`).
pub(crate) struct Upstream {
    /// Killed when dropped.
    _process: Process,
    pub(crate) port: u16,
}

impl Upstream {
    /// On a free port.
    pub(crate) fn start() -> Self {
        Self::start_on(0)
    }

    pub(crate) fn start_on(port: u16) -> Self {
        let args = vec![UPSTREAM_PY.to_owned(), port.to_string()];
        let (process, line) = Process::start(
            "upstream",
            "python3",
            &args,
            "upstream: listening on ",
            Duration::from_secs(20),
        );
        let port = line
            .rsplit(' ')
            .next()
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("no port in {line:?}"));
        Upstream {
            _process: process,
            port,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn control(&self, path_and_query: &str) -> Value {
        let url = format!("{}{path_and_query}", self.url());
        let answer = send(client().get(&url)).await;
        assert_eq!(answer.status, 200, "{url}: {}", answer.text());
        answer.json()
    }

    /// Every request the upstream saw with Idempotency-Key `key`, in
    /// arrival order (method, path, query, key, headers by lower-case
    /// name: lists of values, body_sha256).
    pub(crate) async fn seen(&self, key: &str) -> Vec<Value> {
        let doc = self.control(&format!("/_control/seen?key={key}")).await;
        doc["requests"].as_array().cloned().unwrap_or_default()
    }

    /// Every request the upstream saw on `path` without a key.
    pub(crate) async fn seen_on(&self, path: &str) -> Vec<Value> {
        let doc = self.control(&format!("/_control/seen?path={path}")).await;
        doc["requests"]
            .as_array()
            .map(|a| a.iter().filter(|r| r["key"] == "").cloned().collect())
            .unwrap_or_default()
    }

    /// Waits (20 s at most) until the upstream has seen `n` requests with
    /// `key`.
    pub(crate) async fn until_seen(&self, key: &str, n: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let seen = self.seen(key).await;
            if seen.len() >= n {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "the upstream saw {} request(s) with key {key} in 20 s, not {n}: {seen:?}",
                seen.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Lets the requests held at `/block?id=ID` answer (and later ones
    /// answer at once).
    pub(crate) async fn release(&self, id: &str) {
        let url = format!("{}/_control/release?id={id}", self.url());
        let answer = send(client().post(&url)).await;
        assert_eq!(answer.status, 200, "{url}");
    }
}

/// A running `idem proxy`.
pub(crate) struct Proxy {
    process: Process,
    /// `http://127.0.0.1:PORT`, from its `listening on` line.
    pub(crate) url: String,
}

impl Proxy {
    /// Runs `idem proxy ARGS` and waits for its `listening on` line.
    pub(crate) fn start(args: &[String]) -> Self {
        let mut all = vec!["proxy".to_owned()];
        all.extend(args.iter().cloned());
        let (process, line) = Process::start(
            "proxy",
            env!("CARGO_BIN_EXE_idem"),
            &all,
            "idem proxy: listening on ",
            Duration::from_secs(30),
        );
        let url = line
            .split("listening on ")
            .nth(1)
            .map(|u| u.trim().trim_end_matches('/').to_owned())
            .unwrap_or_default();
        assert!(
            url.starts_with("http://127.0.0.1:") || url.starts_with("https://127.0.0.1:"),
            "ready line: {line:?}"
        );
        Proxy { process, url }
    }

    /// `127.0.0.1:PORT`, for raw TCP.
    pub(crate) fn addr(&self) -> String {
        self.url
            .trim_start_matches("https://")
            .trim_start_matches("http://")
            .to_owned()
    }

    pub(crate) fn at(&self, path_and_query: &str) -> String {
        format!("{}{path_and_query}", self.url)
    }

    /// SIGKILL, and waits until it is gone.
    pub(crate) fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGTERM (with the `kill` command).
    pub(crate) fn terminate(&self) {
        let pid = self.process.child.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap_or_else(|e| panic!("cannot run kill: {e}"));
        assert!(status.success(), "kill -TERM {pid}: {status}");
    }

    pub(crate) fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        self.process.wait_exit(within)
    }

    /// Whether it has exited already.
    pub(crate) fn has_exited(&mut self) -> bool {
        !matches!(self.process.child.try_wait(), Ok(None))
    }

    /// What it logged on stderr so far.
    pub(crate) fn logs(&self) -> String {
        self.process.logs()
    }

    /// The lines it printed on stdout after its ready line, so far (all of
    /// them once it has exited).
    pub(crate) fn stdout_after_ready(&self) -> Vec<String> {
        self.process.stdout_lines.try_iter().collect()
    }
}

/// Runs `idem proxy ARGS`, which must exit within 20 s: its exit code,
/// stdout and stderr. A proxy that starts instead is killed and the test
/// fails.
pub(crate) fn run_to_exit(args: &[String]) -> (Option<i32>, String, String) {
    let dir = support::temp_dir("proxy-exit");
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let create = |p: &PathBuf| {
        std::fs::File::create(p).unwrap_or_else(|e| panic!("cannot create {}: {e}", p.display()))
    };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    for (var, _) in std::env::vars() {
        if var.starts_with("IDEM_") {
            cmd.env_remove(var);
        }
    }
    let mut child = cmd
        .arg("proxy")
        .args(args)
        .stdin(Stdio::null())
        .stdout(create(&out_path))
        .stderr(create(&err_path))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run idem proxy: {e}"));
    support::spawn_watchdog(&support::kill_if_running(child.id(), "KILL"));
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            other => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "idem proxy {args:?} did not exit within 20 s ({other:?}): it started?\n\
                     stdout: {}\nstderr: {}",
                    std::fs::read_to_string(&out_path).unwrap_or_default(),
                    std::fs::read_to_string(&err_path).unwrap_or_default()
                );
            }
        }
    };
    (
        status.code(),
        std::fs::read_to_string(&out_path).unwrap_or_default(),
        std::fs::read_to_string(&err_path).unwrap_or_default(),
    )
}

/// A client with no connection pool (a killed proxy leaves no stale
/// connection behind) and no proxy from the environment.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_else(|e| panic!("cannot build the HTTP client: {e}"))
}

/// A whole answer.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): status {} {}", self.status, self.text()))
    }

    pub(crate) fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }

    /// Whether it carries `Idempotent-Replayed: true`.
    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotent-replayed").as_deref() == Some("true")
    }
}

/// Sends `request` and reads the whole answer; a transport error fails.
pub(crate) async fn send(request: reqwest::RequestBuilder) -> Answer {
    try_send(request)
        .await
        .unwrap_or_else(|e| panic!("request failed: {e}"))
}

pub(crate) async fn try_send(request: reqwest::RequestBuilder) -> Result<Answer, reqwest::Error> {
    let response = request.send().await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await?.to_vec();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// Sends `request`, again while the answer is "in progress" (409 with
/// Retry-After), for 5 s at most: the answer once the key has settled.
///
/// A key's record is completed a moment after its caller got the last
/// byte of the answer, and a retry sent at once can land in between (see
/// `duplicates::a_retry_sent_as_soon_as_the_whole_answer_arrived_is_the_replay`,
/// which holds the proxy to it): the tests of other behaviours retry
/// through that window.
pub(crate) async fn settled(request: reqwest::RequestBuilder) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let again = request.try_clone().expect("a request with a buffered body");
        let answer = send(again).await;
        let in_progress = answer.status == 409 && answer.header("retry-after").is_some();
        if !in_progress || Instant::now() >= deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `POST url` with `Idempotency-Key: key` and a JSON body.
pub(crate) fn post(url: &str, key: &str, body: &Value) -> reqwest::RequestBuilder {
    client().post(url).header("Idempotency-Key", key).json(body)
}

/// Sends `request()` until its answer is not `409` (every 50 ms, 20 s at
/// most): the 409s (each with its time since `since`), then the answer.
pub(crate) async fn until_not_409<F>(
    since: Instant,
    request: F,
) -> (Vec<(Duration, Answer)>, Answer)
where
    F: Fn() -> reqwest::RequestBuilder,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut conflicts = Vec::new();
    loop {
        let at = since.elapsed();
        let answer = send(request()).await;
        if answer.status != 409 {
            return (conflicts, answer);
        }
        assert!(
            Instant::now() < deadline,
            "still 409 after 20 s ({} times): {}",
            conflicts.len() + 1,
            answer.text()
        );
        conflicts.push((at, answer));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The values the upstream saw for header `name` (lower case) on one
/// request it recorded.
pub(crate) fn header_values(request: &Value, name: &str) -> Vec<String> {
    request["headers"][name]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// One answer read off a raw connection.
#[derive(Debug)]
pub(crate) struct RawAnswer {
    pub(crate) status: u16,
    /// Names in lower case, in order, repeats kept.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
}

impl RawAnswer {
    pub(crate) fn values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// Writes `request` (which asks for `Connection: close`) on a new
/// connection to `addr` and reads the answer until the proxy closes it
/// (20 s at most).
pub(crate) async fn raw_exchange(addr: &str, request: &[u8]) -> RawAnswer {
    parse_answer(&raw_read_all(addr, request).await)
}

/// [`raw_exchange`] for requests sent one after another on one
/// connection (the last asks for `Connection: close`): every answer.
pub(crate) async fn raw_exchanges(addr: &str, requests: &[u8]) -> Vec<RawAnswer> {
    parse_answers(&raw_read_all(addr, requests).await)
}

async fn raw_read_all(addr: &str, request: &[u8]) -> Vec<u8> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {addr}: {e}"));
    stream
        .write_all(request)
        .await
        .unwrap_or_else(|e| panic!("cannot write to {addr}: {e}"));
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut raw)).await;
    match read {
        Ok(Ok(_)) => raw,
        Ok(Err(e)) => panic!(
            "reading from {addr}: {e} (read so far: {:?})",
            String::from_utf8_lossy(&raw)
        ),
        Err(_) => panic!(
            "{addr} did not close the connection within 20 s (read: {:?})",
            String::from_utf8_lossy(&raw)
        ),
    }
}

fn parse_answer(raw: &[u8]) -> RawAnswer {
    parse_one(raw).0
}

/// Every answer on a connection whose requests were sent one after
/// another (pipelined), in order: each framed by its own head.
pub(crate) fn parse_answers(raw: &[u8]) -> Vec<RawAnswer> {
    let mut answers = Vec::new();
    let mut at = 0;
    while at < raw.len() {
        let (answer, used) = parse_one(&raw[at..]);
        answers.push(answer);
        at += used;
    }
    answers
}

/// The first answer in `raw`, and how many bytes it took. A body with
/// neither a length nor chunks runs to the end, but for the statuses that
/// have none (1xx, 204, 304).
fn parse_one(raw: &[u8]) -> (RawAnswer, usize) {
    let shown = || String::from_utf8_lossy(raw).into_owned();
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of head in {:?}", shown()));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {:?}", shown()));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let rest = &raw[end + 4..];
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let (body, used) = if chunked {
        let mut body = Vec::new();
        let mut at = 0;
        loop {
            let line_end = rest[at..]
                .windows(2)
                .position(|w| w == b"\r\n")
                .map(|p| at + p)
                .unwrap_or_else(|| panic!("bad chunked body in {:?}", shown()));
            let size_text = String::from_utf8_lossy(&rest[at..line_end]).into_owned();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .unwrap_or_else(|e| panic!("bad chunk size {size_text:?}: {e}"));
            at = line_end + 2;
            if size == 0 {
                // Trailers, if any, end with an empty line.
                let trailers_end = rest[at..]
                    .windows(2)
                    .position(|w| w == b"\r\n")
                    .map(|p| if p == 0 { at + 2 } else { at })
                    .unwrap_or(rest.len());
                let end_at = if trailers_end == at {
                    rest[at..]
                        .windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .map_or(rest.len(), |p| at + p + 4)
                } else {
                    trailers_end
                };
                break (body, end_at);
            }
            body.extend_from_slice(&rest[at..at + size]);
            at += size + 2;
        }
    } else {
        let none = status < 200 || status == 204 || status == 304;
        let length = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(if none { 0 } else { rest.len() });
        let length = length.min(rest.len());
        (rest[..length].to_vec(), length)
    };
    (
        RawAnswer {
            status,
            headers,
            body,
        },
        end + 4 + used,
    )
}

/// An answer from the `curl` command (TLS client certificates and HTTP/2,
/// which the tests' reqwest is built without).
pub(crate) async fn curl(args: &[&str]) -> Result<Answer, String> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sS", "--max-time", "30", "--noproxy", "*", "-i"])
            .args(&args)
            .output()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
    .unwrap_or_else(|e| panic!("cannot run curl (scripts/test installs it): {e}"));
    if !out.status.success() {
        return Err(format!(
            "curl {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = out.stdout;
    let split = text
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(&text)));
    let head = String::from_utf8_lossy(&text[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let mut headers = HeaderMap::new();
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            if let (Ok(name), Ok(value)) = (
                reqwest::header::HeaderName::from_bytes(name.trim().as_bytes()),
                reqwest::header::HeaderValue::from_str(value.trim()),
            ) {
                headers.append(name, value);
            }
        }
    }
    Ok(Answer {
        status,
        headers,
        body: text[split + 4..].to_vec(),
    })
}
