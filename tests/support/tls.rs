//! TLS servers for the access and failover tests: certificate authorities
//! made with the `openssl` command, a TLS-only `redis-server` with a
//! password, and a PostgreSQL with `ssl=on`, scram-sha-256 and only
//! `hostssl` lines in pg_hba.conf.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::pg::PgServer;

pub const HOW_TO: &str = "these tests need the openssl command, redis-server 7 built with TLS, \
     and PostgreSQL binaries under /usr/lib/postgresql/*/bin: run scripts/test, or \
     `apt-get install -y openssl redis-server postgresql`";

/// The password of the TLS Redis's default user and of the TLS
/// PostgreSQL's user `idem`.
pub const PASSWORD: &str = "s3cret-Pa55";

// ------------------------------------------------------------ certificates

/// Certificates made by the test: CA `a` (trusted by the clients) and CA `b`
/// (not trusted), each with a server certificate for `localhost` and
/// `127.0.0.1` (also good as a client certificate: the nodes of a TLS
/// Redis Cluster present it on the cluster bus).
pub struct Certs {
    dir: PathBuf,
}

impl Certs {
    pub fn ca(&self, which: &str) -> PathBuf {
        self.dir.join(format!("ca-{which}.crt"))
    }
    pub fn cert(&self, which: &str) -> PathBuf {
        self.dir.join(format!("server-{which}.crt"))
    }
    pub fn key(&self, which: &str) -> PathBuf {
        self.dir.join(format!("server-{which}.key"))
    }
    pub fn ca_pem(&self, which: &str) -> Vec<u8> {
        std::fs::read(self.ca(which)).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The certificates of this test process, made on first use.
pub fn certs() -> &'static Certs {
    static CERTS: OnceLock<Certs> = OnceLock::new();
    CERTS.get_or_init(|| {
        let dir = super::temp_dir("tls");
        super::spawn_watchdog(&format!(
            "rm -rf '{}'",
            dir.display()
        ));
        let ext = dir.join("server.ext");
        std::fs::write(
            &ext,
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        // `openssl req` arguments for a new P-256 key, written to the
        // file that follows.
        let new_key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
        ];
        for which in ["a", "b"] {
            let p = |name: String| dir.join(name).display().to_string();
            let (ca_key, ca_crt) = (p(format!("ca-{which}.key")), p(format!("ca-{which}.crt")));
            let subject = format!("/CN=idem test CA {which}");
            openssl(
                &[
                    &["req", "-x509"],
                    &new_key[..],
                    &[&ca_key, "-out", &ca_crt, "-days", "2", "-subj", &subject],
                    &["-addext", "basicConstraints=critical,CA:TRUE"],
                    &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                ]
                .concat(),
            );
            let (key, csr) = (p(format!("server-{which}.key")), p(format!("server-{which}.csr")));
            openssl(
                &[
                    &["req"],
                    &new_key[..],
                    &[&key, "-out", &csr, "-subj", "/CN=localhost"],
                ]
                .concat(),
            );
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

// ------------------------------------------------------------ Redis

/// A TLS-only redis-server of the test's own, killed on drop.
pub struct TlsRedis {
    pub port: u16,
    child: Child,
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl TlsRedis {
    /// Starts `redis-server --port 0 --tls-port P` with the server
    /// certificate of CA `which` and `requirepass` [`PASSWORD`].
    pub fn start(which: &str) -> TlsRedis {
        TlsRedis::start_on(super::free_port(), which, &[])
    }

    /// The same on `port`, with `extra` arguments.
    pub fn start_on(port: u16, which: &str, extra: &[&str]) -> TlsRedis {
        let certs = certs();
        let dir = super::temp_dir("redis-tls");
        let child = super::redis_server::spawn(
            Command::new("redis-server")
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
                .args(extra),
            &dir,
        );
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

    /// The TLS Redis shared by the tests of this process (CA `a`).
    pub fn shared() -> &'static TlsRedis {
        static SERVER: OnceLock<TlsRedis> = OnceLock::new();
        SERVER.get_or_init(|| TlsRedis::start("a"))
    }
}

// ------------------------------------------------------------ PostgreSQL

/// The PostgreSQL with TLS shared by the tests of this process: `ssl=on`
/// with the server certificate of CA `a`, scram-sha-256, pg_hba `hostssl`
/// only (no plaintext TCP; the local socket is trusted, for the test's own
/// setup), a user `idem` with the password [`PASSWORD`] and a database
/// `idem` it owns.
pub fn shared_pg() -> &'static PgServer {
    static SERVER: OnceLock<PgServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let certs = certs();
        let server = PgServer::init("-c ssl=on -c password_encryption=scram-sha-256");
        // The server's certificate and key, in the data directory (where
        // `ssl_cert_file` and `ssl_key_file` look by default), the key
        // readable by the server only.
        let data = server.data();
        let (cert, key) = (data.join("server.crt"), data.join("server.key"));
        std::fs::copy(certs.cert("a"), &cert).unwrap_or_else(|e| panic!("{e}"));
        std::fs::copy(certs.key("a"), &key).unwrap_or_else(|e| panic!("{e}"));
        super::pg::run(Command::new("chmod").arg("600").arg(&key));
        if super::is_root() {
            super::pg::run(
                Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(&cert)
                    .arg(&key),
            );
        }
        let hba = "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n";
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap_or_else(|e| panic!("{e}"));
        server.start_again();
        server.psql(
            "postgres",
            &format!("CREATE ROLE idem LOGIN PASSWORD '{PASSWORD}'"),
        );
        server.psql("postgres", "CREATE DATABASE idem OWNER idem");
        server
    })
}

/// A URL of the TLS PostgreSQL's database `idem` on `host`, logging in as
/// `userinfo` (`idem:password`, or `idem` without a password), with
/// `params` (`sslmode=...`).
pub fn pg_url(host: &str, userinfo: &str, params: &str) -> String {
    format!(
        "postgres://{userinfo}@{host}:{}/idem?{params}",
        shared_pg().port
    )
}

/// The parameters that make a client verify the server against `ca`.
pub fn verify_full(ca: &Path) -> String {
    format!("sslmode=verify-full&sslrootcert={}", ca.display())
}

/// The pool options of the TLS tests: 4 connections, a 10 s acquire
/// timeout (far above what a connection refused at once takes).
pub fn pool_options() -> sqlx::postgres::PgPoolOptions {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
}
