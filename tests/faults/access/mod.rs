//! Access: TLS and authentication on Redis and PostgreSQL (issue 18, item 5).
//!
//! The test makes its own certificate authorities with the `openssl` command
//! (a trusted one, and an untrusted one for the negative cases), starts a
//! TLS-only redis-server (`--port 0 --tls-port P`, `requirepass`, ACL users)
//! and a PostgreSQL with `ssl=on`, scram-sha-256 and only `hostssl` lines in
//! pg_hba.conf, and checks that:
//! - the stores connect and a round (process, acquire, complete, replay)
//!   works over TLS with authentication;
//! - a wrong password, an untrusted certificate and a plaintext attempt on a
//!   TLS-only server fail fast (well under the call timeout) with a
//!   non-retryable `StoreError::Backend` whose message names the cause,
//!   while a refused connection stays `Unavailable` (retryable);
//! - the Redis store runs as an ACL user limited to exactly the commands and
//!   the key pattern it needs (`idem_redis::acl_rules`), and that user cannot touch a
//!   key outside the pattern.
//!
//! Each negative case prints `reliability scenario=... backend=... fail_ms=...`.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use idem::postgres::PgStore;
use idem::redis::redis;
use idem::redis::{RedisStore, TlsOptions};
use idem::{
    AcquireItem, Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, Processed, StoreError,
};

const HOW_TO: &str = "these tests need the openssl command, redis-server 7 built with TLS, and \
     PostgreSQL binaries under /usr/lib/postgresql/*/bin: run scripts/test, or \
     `apt-get install -y openssl redis-server postgresql`";

/// The password of Redis's default user and of PostgreSQL's user `idem`.
const PASSWORD: &str = "s3cret-Pa55";
/// The password of the limited Redis ACL user `idem`.
const ACL_PASSWORD: &str = "acl-Pa55";

/// The ACL of the Redis store (standalone), as `idem_redis::acl_rules`
/// documents it: the commands it sends, those its scripts run, and its key
/// pattern (the default prefix `idem:`). `CONFIG GET` (the eviction-policy
/// check at connect) is left out on purpose: the store logs a warning and
/// goes on.
fn redis_acl() -> String {
    format!("on {}", idem::redis::acl_rules("idem:", false))
}

// ------------------------------------------------------------ certificates

/// Certificates made by the test: CA `a` (trusted by the clients) and CA `b`
/// (not trusted), each with a server certificate for `localhost` and
/// `127.0.0.1`.
struct Certs {
    dir: PathBuf,
}

impl Certs {
    fn ca(&self, which: &str) -> PathBuf {
        self.dir.join(format!("ca-{which}.crt"))
    }
    fn cert(&self, which: &str) -> PathBuf {
        self.dir.join(format!("server-{which}.crt"))
    }
    fn key(&self, which: &str) -> PathBuf {
        self.dir.join(format!("server-{which}.key"))
    }
    fn ca_pem(&self, which: &str) -> Vec<u8> {
        std::fs::read(self.ca(which)).unwrap_or_else(|e| panic!("{e}"))
    }
}

fn certs() -> &'static Certs {
    static CERTS: OnceLock<Certs> = OnceLock::new();
    CERTS.get_or_init(|| {
        let dir = support::temp_dir("tls");
        support::spawn_watchdog(&format!(
            "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; rm -rf '{}'",
            dir.display()
        ));
        let ext = dir.join("server.ext");
        std::fs::write(
            &ext,
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        for which in ["a", "b"] {
            let p = |name: String| dir.join(name).display().to_string();
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &p(format!("ca-{which}.key")),
                "-out",
                &p(format!("ca-{which}.crt")),
                "-days",
                "2",
                "-subj",
                &format!("/CN=idem test CA {which}"),
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
            openssl(&[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &p(format!("server-{which}.key")),
                "-out",
                &p(format!("server-{which}.csr")),
                "-subj",
                "/CN=localhost",
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &p(format!("server-{which}.csr")),
                "-CA",
                &p(format!("ca-{which}.crt")),
                "-CAkey",
                &p(format!("ca-{which}.key")),
                "-CAcreateserial",
                "-out",
                &p(format!("server-{which}.crt")),
                "-days",
                "2",
                "-extfile",
                &ext.display().to_string(),
            ]);
        }
        Certs { dir }
    })
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl: {e}. {HOW_TO}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

// ------------------------------------------------------------ helpers

fn key(scope: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope, format!("{:016x}", fastrand::u64(..)))
        .unwrap_or_else(|e| panic!("{e}"))
}

fn report(scenario: &str, backend: &str, fields: &[(&str, String)], started: Instant) {
    let mut line = format!("reliability scenario={scenario} backend={backend}");
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v}"));
    }
    line.push_str(&format!(" duration_ms={}", started.elapsed().as_millis()));
    println!("{line}");
}

/// The whole chain of an error's messages.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(" <- ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Asserts a fast, non-retryable `Backend` error whose message names
/// `cause` (any of the words, case-insensitive); prints the reliability
/// line.
fn expect_refused<T>(
    scenario: &str,
    backend: &str,
    result: Result<T, StoreError>,
    started: Instant,
    words: &[&str],
) {
    let fail_ms = started.elapsed().as_millis();
    let e = match result {
        Ok(_) => panic!("{scenario} on {backend}: connected, but should have failed"),
        Err(e) => e,
    };
    let text = chain(&e);
    eprintln!("{scenario} on {backend}: {text}");
    assert!(
        matches!(e, StoreError::Backend(_)),
        "{scenario} on {backend}: expected StoreError::Backend (not retryable), got {e:?}"
    );
    assert!(!e.is_retryable(), "{scenario}: {e:?} is retryable");
    let lower = text.to_lowercase();
    assert!(
        words.iter().any(|w| lower.contains(&w.to_lowercase())),
        "{scenario} on {backend}: the message does not name the cause ({words:?}): {text}"
    );
    // Fast: under the Redis store's connection and call timeout (2 s), and
    // far under the PostgreSQL pool's acquire timeout (10 s here), which a
    // connection retried until it gives up would take. Typical: 2-250 ms
    // (scram-sha-256 in a debug build costs ~100 ms; a loaded machine more).
    assert!(
        fail_ms < 1_500,
        "{scenario} on {backend}: took {fail_ms} ms to fail: not fast"
    );
    report(
        scenario,
        backend,
        &[
            ("error", "Backend".into()),
            ("retryable", "false".into()),
            ("fail_ms", fail_ms.to_string()),
        ],
        started,
    );
}

/// A round on `store`: the executor runs a handler once and replays it;
/// acquire, complete, replay, release, extend, get, delete and purge.
async fn round(store: impl IdempotencyStore) {
    let idem = Idempotency::new(store);
    let k = key("access.round");
    let mut runs = 0;
    for _ in 0..2 {
        let out = idem
            .process(&k, &7u32, |n| {
                runs += 1;
                async move { Ok::<_, std::io::Error>(*n * 6) }
            })
            .await
            .unwrap_or_else(|e| panic!("process: {e}"));
        match out {
            Processed::Executed(v) | Processed::Replayed(v) => assert_eq!(v, 42),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs, 1, "the handler ran more than once");
    let store = idem.store();
    let lease_for = Duration::from_secs(30);

    // acquire, extend, complete, replay
    let k = key("access.round");
    let Acquisition::Acquired(lease) = store
        .acquire(&k, None, lease_for)
        .await
        .unwrap_or_else(|e| panic!("acquire: {e}"))
    else {
        panic!("a fresh key was not acquired")
    };
    let lease = store
        .extend(&lease, lease_for)
        .await
        .unwrap_or_else(|e| panic!("extend: {e}"));
    store
        .complete(&lease, b"done", Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("complete: {e}"));
    match store.acquire(&k, None, lease_for).await {
        Ok(Acquisition::Completed(record)) => assert_eq!(&record.response[..], b"done"),
        other => panic!("replay: {other:?}"),
    }
    assert!(store
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("get: {e}"))
        .is_some());
    assert!(store
        .delete(&k)
        .await
        .unwrap_or_else(|e| panic!("delete: {e}")));
    assert!(store
        .get(&k)
        .await
        .unwrap_or_else(|e| panic!("get: {e}"))
        .is_none());

    // acquire, release, acquire again
    let k = key("access.round");
    let Ok(Acquisition::Acquired(lease)) = store.acquire(&k, None, lease_for).await else {
        panic!("a fresh key was not acquired")
    };
    store
        .release(&lease)
        .await
        .unwrap_or_else(|e| panic!("release: {e}"));
    assert!(matches!(
        store.acquire(&k, None, lease_for).await,
        Ok(Acquisition::Acquired(_))
    ));
    store
        .purge_expired(100)
        .await
        .unwrap_or_else(|e| panic!("purge: {e}"));

    // batches: acquire_many, complete_many, then a replay in a batch
    let keys = [key("access.batch"), key("access.batch")];
    let items: Vec<AcquireItem<'_>> = keys.iter().map(|k| AcquireItem::new(k, None)).collect();
    let leases: Vec<_> = store
        .acquire_many(&items, lease_for)
        .await
        .unwrap_or_else(|e| panic!("acquire_many: {e}"))
        .into_iter()
        .map(|a| match a {
            Ok(Acquisition::Acquired(lease)) => lease,
            other => panic!("acquire_many: {other:?}"),
        })
        .collect();
    let done: Vec<(&idem::Lease, &[u8])> = leases.iter().map(|l| (l, &b"ok"[..])).collect();
    for r in store
        .complete_many(&done, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("complete_many: {e}"))
    {
        r.unwrap_or_else(|e| panic!("complete_many: {e}"));
    }
    for a in store
        .acquire_many(&items, lease_for)
        .await
        .unwrap_or_else(|e| panic!("acquire_many: {e}"))
    {
        assert!(matches!(a, Ok(Acquisition::Completed(_))), "{a:?}");
    }
}

// ------------------------------------------------------------ Redis

/// A TLS-only redis-server of the test's own.
struct TlsRedis {
    port: u16,
    child: std::process::Child,
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `redis-server --port 0 --tls-port P` with the server certificate
/// of CA `which` and `requirepass`.
fn start_tls_redis(which: &str) -> TlsRedis {
    start_tls_redis_on(support::free_port(), which, &[])
}

fn start_tls_redis_on(port: u16, which: &str, extra: &[&str]) -> TlsRedis {
    let certs = certs();
    let dir = support::temp_dir("redis-tls");
    let child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .arg("--tls-cert-file")
        .arg(certs.cert(which))
        .arg("--tls-key-file")
        .arg(certs.key(which))
        .arg("--tls-ca-cert-file")
        .arg(certs.ca(which))
        .args(["--tls-auth-clients", "no", "--requirepass", PASSWORD])
        .arg("--dir")
        .arg(&dir)
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory-policy",
            "noeviction",
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start redis-server: {e}. {HOW_TO}"));
    support::spawn_watchdog(&format!(
        "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; kill -9 {pid} 2>/dev/null; rm -rf '{dir}'",
        pid = child.id(),
        dir = dir.display()
    ));
    let mut server = TlsRedis { port, child };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!(
                "redis-server with TLS exited ({status}): is it built with TLS (redis-server --tls-port)? {HOW_TO}"
            );
        }
        assert!(
            Instant::now() < deadline,
            "redis-server with TLS did not listen on {port}. {HOW_TO}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    server
}

fn shared_redis() -> &'static TlsRedis {
    static SERVER: OnceLock<TlsRedis> = OnceLock::new();
    SERVER.get_or_init(|| start_tls_redis("a"))
}

fn trusted() -> TlsOptions {
    TlsOptions::new().root_ca_pem(certs().ca_pem("a"))
}

/// An admin connection (the default user) to the TLS server.
async fn redis_admin(port: u16) -> redis::aio::MultiplexedConnection {
    // rustls needs a process-wide provider for the redis crate's own TLS
    // connections (this build has two: ring, and aws-lc-rs from the AWS SDK).
    idem::redis::install_crypto_provider();
    let client = redis::Client::build_with_tls(
        format!("rediss://:{PASSWORD}@127.0.0.1:{port}/"),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(certs().ca_pem("a")),
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("admin connection: {e}"))
}

/// Creates (or resets) an ACL user with `rules` and `password`.
async fn acl_user(port: u16, name: &str, password: &str, rules: &str) {
    let mut admin = redis_admin(port).await;
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg(name).arg("reset");
    for rule in rules.split_whitespace() {
        cmd.arg(rule);
    }
    cmd.arg(format!(">{password}"));
    let _: () = cmd
        .query_async(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("ACL SETUSER {name} {rules}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_tls_with_password_round() {
    let server = shared_redis();
    for host in ["127.0.0.1", "localhost"] {
        let url = format!("rediss://:{PASSWORD}@{host}:{}/", server.port);
        let store = RedisStore::connect_tls(&url, &trusted())
            .await
            .unwrap_or_else(|e| panic!("connect_tls {host}: {}", chain(&e)));
        assert_eq!(
            store.check_eviction_policy().await.as_deref(),
            Some("noeviction")
        );
        round(store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_wrong_password_is_refused_fast() {
    let server = shared_redis();
    let started = Instant::now();
    let result = RedisStore::connect_tls(
        &format!("rediss://:wrong@127.0.0.1:{}/", server.port),
        &trusted(),
    )
    .await;
    expect_refused(
        "tls_wrong_password",
        "redis",
        result,
        started,
        &["authentication"],
    );

    // An ACL user with a wrong password (WRONGPASS), and no password at all
    // (NOAUTH on the first command).
    acl_user(server.port, "idem-wrong", ACL_PASSWORD, &redis_acl()).await;
    let started = Instant::now();
    let result = RedisStore::connect_tls(
        &format!("rediss://idem-wrong:nope@127.0.0.1:{}/", server.port),
        &trusted(),
    )
    .await;
    expect_refused(
        "tls_acl_wrong_password",
        "redis",
        result,
        started,
        &["authentication"],
    );
    let started = Instant::now();
    let result =
        RedisStore::connect_tls(&format!("rediss://127.0.0.1:{}/", server.port), &trusted()).await;
    match result {
        // The connection needs no command to open: the first call says it.
        Ok(store) => {
            let result = store
                .acquire(&key("access.noauth"), None, Duration::from_secs(5))
                .await;
            expect_refused(
                "tls_no_password",
                "redis",
                result,
                started,
                &["authentication"],
            );
        }
        Err(_) => expect_refused(
            "tls_no_password",
            "redis",
            result,
            started,
            &["authentication"],
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_untrusted_certificate_is_refused_fast() {
    // A server whose certificate comes from CA b, which the client does not trust.
    let other = start_tls_redis("b");
    let started = Instant::now();
    let result = RedisStore::connect_tls(
        &format!("rediss://:{PASSWORD}@127.0.0.1:{}/", other.port),
        &trusted(),
    )
    .await;
    expect_refused(
        "tls_untrusted_certificate",
        "redis",
        result,
        started,
        &["certificate"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_plaintext_to_tls_port_is_refused_fast() {
    let server = shared_redis();
    let started = Instant::now();
    let result =
        RedisStore::connect(&format!("redis://:{PASSWORD}@127.0.0.1:{}/", server.port)).await;
    expect_refused(
        "plaintext_to_tls_only",
        "redis",
        result,
        started,
        &["rediss://", "tls"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_refused_connection_stays_unavailable() {
    // Nothing listens there: a fault that can pass, retryable.
    let port = support::free_port();
    let started = Instant::now();
    for result in [
        RedisStore::connect_tls(
            &format!("rediss://:{PASSWORD}@127.0.0.1:{port}/"),
            &trusted(),
        )
        .await,
        RedisStore::connect(&format!("redis://127.0.0.1:{port}/")).await,
    ] {
        match result {
            Err(e @ StoreError::Unavailable(_)) => {
                assert!(e.is_retryable());
                eprintln!("refused: {}", chain(&e));
            }
            other => panic!("a refused connection should be Unavailable: {other:?}"),
        }
    }
    report(
        "connection_refused",
        "redis",
        &[
            ("error", "Unavailable".into()),
            ("retryable", "true".into()),
        ],
        started,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_runs_as_a_minimal_acl_user() {
    let server = shared_redis();
    acl_user(server.port, "idem", ACL_PASSWORD, &redis_acl()).await;
    let url = format!("rediss://idem:{ACL_PASSWORD}@127.0.0.1:{}/", server.port);
    let store = RedisStore::connect_tls(&url, &trusted())
        .await
        .unwrap_or_else(|e| panic!("connect_tls as the ACL user: {}", chain(&e)));
    // CONFIG GET is not in the ACL: the eviction check degrades (a warning).
    assert_eq!(store.check_eviction_policy().await, None);
    round(store.clone()).await;

    // With WAIT: three commands more.
    acl_user(
        server.port,
        "idem-wait",
        ACL_PASSWORD,
        &format!("on {}", idem::redis::acl_rules("idem:", true)),
    )
    .await;
    let waiting = RedisStore::connect_tls(
        &format!(
            "rediss://idem-wait:{ACL_PASSWORD}@127.0.0.1:{}/",
            server.port
        ),
        &trusted(),
    )
    .await
    .unwrap_or_else(|e| panic!("{}", chain(&e)))
    .wait_for_replicas(0, Duration::from_millis(100));
    round(waiting).await;

    // Without the WAIT commands, wait_for_replicas is refused: not retryable.
    let refused = store
        .clone()
        .wait_for_replicas(0, Duration::from_millis(100));
    let started = Instant::now();
    let result = refused
        .acquire(&key("access.acl"), None, Duration::from_secs(5))
        .await;
    expect_refused(
        "acl_command_refused",
        "redis",
        result,
        started,
        &["permission", "noperm"],
    );

    // A key outside the pattern: refused to the store (another prefix) and
    // to the user's own commands.
    let outside = store.clone().prefix("other:");
    let started = Instant::now();
    let result = outside
        .acquire(&key("access.acl"), None, Duration::from_secs(5))
        .await;
    expect_refused(
        "acl_key_outside_pattern",
        "redis",
        result,
        started,
        &["permission", "noperm"],
    );
    let client = redis::Client::build_with_tls(
        url.as_str(),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(certs().ca_pem("a")),
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    idem::redis::install_crypto_provider();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for cmd in [
        redis::cmd("SET").arg("other:key").arg("1").clone(),
        redis::cmd("GET").arg("other:key").clone(),
        redis::cmd("DEL").arg("other:key").clone(),
        redis::cmd("KEYS").arg("*").clone(),
        redis::cmd("FLUSHALL").clone(),
        redis::cmd("EVAL").arg("return 1").arg(0).clone(),
    ] {
        let reply: Result<redis::Value, _> = cmd.query_async(&mut conn).await;
        match reply {
            Err(e) if e.code() == Some("NOPERM") => {}
            other => panic!("the ACL user ran {:?}: {other:?}", cmd.args_iter().count()),
        }
    }
    // Its own keys: allowed.
    let _: Option<String> = redis::cmd("GET")
        .arg("idem:access.acl/x")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_acl_has_no_command_to_spare() {
    // A server of its own: no script is loaded yet, so SCRIPT LOAD is needed.
    let server = start_tls_redis("a");
    let started = Instant::now();
    let acl = redis_acl();
    let rules: Vec<&str> = acl.split_whitespace().collect();
    let commands: Vec<&str> = rules
        .iter()
        .copied()
        .filter(|r| r.starts_with('+'))
        .collect();
    for (n, left_out) in commands.iter().enumerate() {
        let fewer: Vec<&str> = rules.iter().copied().filter(|r| r != left_out).collect();
        let user = format!("idem-less-{n}");
        acl_user(server.port, &user, ACL_PASSWORD, &fewer.join(" ")).await;
        let url = format!("rediss://{user}:{ACL_PASSWORD}@127.0.0.1:{}/", server.port);
        let store = RedisStore::connect_tls(&url, &trusted())
            .await
            .unwrap_or_else(|e| panic!("{}", chain(&e)));
        let round = tokio::spawn(round(store));
        match round.await {
            Ok(()) => {
                panic!("the store works without {left_out}: acl_rules has a command to spare")
            }
            Err(panicked) => {
                let text = panicked
                    .into_panic()
                    .downcast::<String>()
                    .map(|s| *s)
                    .unwrap_or_default();
                eprintln!("without {left_out}: {text}");
                assert!(
                    text.contains("permission denied by the ACL"),
                    "without {left_out}: {text}"
                );
            }
        }
        // The admin flushes the scripts between users (one loaded by an
        // earlier user would hide a missing SCRIPT LOAD).
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut redis_admin(server.port).await)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    report(
        "acl_minimal",
        "redis",
        &[
            ("commands", commands.len().to_string()),
            ("each_needed", "true".into()),
        ],
        started,
    );
}

/// A port whose cluster bus port (port + 10000) is free too.
fn cluster_port() -> u16 {
    for _ in 0..1000 {
        let port = support::free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair for a cluster node");
}

fn redis_cli_tls(port: u16) -> Command {
    // Bounded: `--cluster create` waits for the nodes to join forever.
    let mut c = Command::new("timeout");
    c.args(["60", "redis-cli", "--tls", "--cacert"])
        .arg(certs().ca("a"))
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "--no-auth-warning",
            "-a",
            PASSWORD,
        ]);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_over_tls_with_password() {
    // Three masters speaking TLS only, clients and cluster bus alike (the
    // nodes present their certificate as clients on the bus: hence
    // clientAuth in its extended key usage).
    let ports: Vec<u16> = (0..3).map(|_| cluster_port()).collect();
    let nodes: Vec<TlsRedis> = ports
        .iter()
        .map(|&port| {
            let conf = format!("nodes-{port}.conf");
            start_tls_redis_on(
                port,
                "a",
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-node-timeout",
                    "5000",
                    "--tls-cluster",
                    "yes",
                    "--masterauth",
                    PASSWORD,
                ],
            )
        })
        .collect();
    let out = redis_cli_tls(ports[0])
        .arg("--cluster")
        .arg("create")
        .args(ports.iter().map(|p| format!("127.0.0.1:{p}")))
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run redis-cli: {e}. {HOW_TO}"));
    assert!(
        out.status.success(),
        "redis-cli --cluster create over TLS failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    for &port in &ports {
        loop {
            let info = redis_cli_tls(port)
                .args(["CLUSTER", "INFO"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the TLS cluster did not reach cluster_state:ok"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("rediss://:{PASSWORD}@127.0.0.1:{p}/"))
        .collect();
    let store = RedisStore::connect_cluster_tls(urls.clone(), &trusted())
        .await
        .unwrap_or_else(|e| panic!("connect_cluster_tls: {}", chain(&e)));
    round(store).await;

    let wrong: Vec<String> = ports
        .iter()
        .map(|p| format!("rediss://:wrong@127.0.0.1:{p}/"))
        .collect();
    let started = Instant::now();
    let result = RedisStore::connect_cluster_tls(wrong, &trusted()).await;
    expect_refused(
        "tls_wrong_password",
        "redis-cluster",
        result,
        started,
        &["authentication"],
    );
    let started = Instant::now();
    let result =
        RedisStore::connect_cluster_tls(urls, &TlsOptions::new().root_ca_pem(certs().ca_pem("b")))
            .await;
    expect_refused(
        "tls_untrusted_certificate",
        "redis-cluster",
        result,
        started,
        &["certificate"],
    );
    drop(nodes);
}

// ------------------------------------------------------------ PostgreSQL

struct TlsPg {
    port: u16,
}

fn run(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}. {HOW_TO}"));
    assert!(
        out.status.success(),
        "{command:?} failed: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A PostgreSQL with `ssl=on`, scram-sha-256, pg_hba `hostssl` only (no
/// plaintext TCP), a user `idem` with a password and a database it owns.
fn shared_pg() -> &'static TlsPg {
    static SERVER: OnceLock<TlsPg> = OnceLock::new();
    SERVER.get_or_init(|| {
        let certs = certs();
        let bin = support::pg::find_bin();
        let dir = support::temp_dir("pg-tls");
        let data = dir.join("data");
        let as_postgres = support::is_root();
        // The server's key, readable by the server only.
        let key = dir.join("server.key");
        let cert = dir.join("server.crt");
        std::fs::copy(certs.key("a"), &key).unwrap_or_else(|e| panic!("{e}"));
        std::fs::copy(certs.cert("a"), &cert).unwrap_or_else(|e| panic!("{e}"));
        run(Command::new("chmod").arg("600").arg(&key));
        if as_postgres {
            run(Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir));
        }
        let tool = |name: &str| {
            let path = bin.join(name);
            if as_postgres {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(path);
                c
            } else {
                Command::new(path)
            }
        };
        run(tool("initdb").arg("-D").arg(&data).args([
            "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions",
        ]));
        // Local socket for the test's setup; TCP only with TLS and a password.
        let hba = "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n";
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap_or_else(|e| panic!("{e}"));
        let port = support::free_port();
        support::spawn_watchdog(&format!(
            "while kill -0 \"$1\" 2>/dev/null; do sleep 0.5; done; \
             if [ -f '{data}/postmaster.pid' ]; then \
               pid=$(head -1 '{data}/postmaster.pid'); kill -INT \"$pid\" 2>/dev/null; \
               n=0; while kill -0 \"$pid\" 2>/dev/null && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done; \
             fi; rm -rf '{dir}'",
            data = data.display(),
            dir = dir.display()
        ));
        let options = format!(
            "-p {port} -k {dir} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off \
             -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key} \
             -c password_encryption=scram-sha-256",
            dir = dir.display(),
            cert = cert.display(),
            key = key.display(),
        );
        run(tool("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("server.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]));
        let psql = |sql: &str| {
            run(tool("psql")
                .args(["-v", "ON_ERROR_STOP=1", "-h"])
                .arg(&dir)
                .args(["-p", &port.to_string(), "-U", "postgres", "-d", "postgres", "-c", sql]))
        };
        psql(&format!("CREATE ROLE idem LOGIN PASSWORD '{PASSWORD}'"));
        psql("CREATE DATABASE idem OWNER idem");
        TlsPg { port }
    })
}

fn pg_url(host: &str, user_password: &str, params: &str) -> String {
    format!(
        "postgres://idem:{user_password}@{host}:{}/idem?{params}",
        shared_pg().port
    )
}

fn verify_full(ca: &Path) -> String {
    format!("sslmode=verify-full&sslrootcert={}", ca.display())
}

fn pool_options() -> sqlx::postgres::PgPoolOptions {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_scram_round() {
    let ca = certs().ca("a");
    for host in ["127.0.0.1", "localhost"] {
        let url = pg_url(host, PASSWORD, &verify_full(&ca));
        let pool = idem::postgres::connect_with(pool_options(), &url)
            .await
            .unwrap_or_else(|e| panic!("connect {host}: {}", chain(&e)));
        let (ssl, version): (bool, String) =
            sqlx::query_as("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                .fetch_one(&pool)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        assert!(ssl, "the session is not encrypted");
        eprintln!("PostgreSQL session over {version}");
        let store = PgStore::new(pool);
        store
            .migrate()
            .await
            .unwrap_or_else(|e| panic!("migrate: {e}"));
        round(store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_wrong_password_is_refused_fast() {
    let url = pg_url("127.0.0.1", "wrong", &verify_full(&certs().ca("a")));
    let started = Instant::now();
    let result = idem::postgres::connect_with(pool_options(), &url).await;
    expect_refused(
        "tls_wrong_password",
        "postgres",
        result,
        started,
        &["authentication"],
    );

    // No password at all.
    let url = format!(
        "postgres://idem@127.0.0.1:{}/idem?{}",
        shared_pg().port,
        verify_full(&certs().ca("a"))
    );
    let started = Instant::now();
    let result = idem::postgres::connect_with(pool_options(), &url).await;
    expect_refused(
        "tls_no_password",
        "postgres",
        result,
        started,
        &["authentication", "password"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_untrusted_certificate_is_refused_fast() {
    // The client trusts CA b only; the server's certificate comes from CA a.
    let url = pg_url("127.0.0.1", PASSWORD, &verify_full(&certs().ca("b")));
    let started = Instant::now();
    let result = idem::postgres::connect_with(pool_options(), &url).await;
    expect_refused(
        "tls_untrusted_certificate",
        "postgres",
        result,
        started,
        &["certificate"],
    );

    // A store on a lazy pool meets it on its first call: not retryable either.
    let pool = pool_options()
        .connect_lazy(&url)
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::new(pool);
    let started = Instant::now();
    let result = store
        .acquire(&key("access.pg"), None, Duration::from_secs(5))
        .await;
    expect_refused(
        "tls_untrusted_certificate_call",
        "postgres",
        result,
        started,
        &["certificate"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_plaintext_to_tls_only_is_refused_fast() {
    let url = pg_url("127.0.0.1", PASSWORD, "sslmode=disable");
    let started = Instant::now();
    let result = idem::postgres::connect_with(pool_options(), &url).await;
    expect_refused(
        "plaintext_to_tls_only",
        "postgres",
        result,
        started,
        &["tls", "ssl", "encryption"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refused_connection_stays_unavailable() {
    let port = support::free_port();
    let url = format!(
        "postgres://idem:{PASSWORD}@127.0.0.1:{port}/idem?{}",
        verify_full(&certs().ca("a"))
    );
    let started = Instant::now();
    match idem::postgres::connect_with(pool_options(), &url).await {
        Err(e @ StoreError::Unavailable(_)) => eprintln!("refused: {}", chain(&e)),
        other => panic!("a refused connection should be Unavailable: {other:?}"),
    }
    report(
        "connection_refused",
        "postgres",
        &[
            ("error", "Unavailable".into()),
            ("retryable", "true".into()),
        ],
        started,
    );
}

#[cfg(all(feature = "tiered", feature = "dynamodb"))]
mod provider;
