//! TLS on Redis and PostgreSQL: a round over TLS with a password (Redis,
//! Redis Cluster with TLS on its bus too, PostgreSQL with scram-sha-256);
//! an untrusted certificate, a malformed PEM and plaintext to a TLS-only
//! server are refused fast and are not retryable; a refused connection
//! stays `Unavailable`.

use std::process::Command;
use std::time::{Duration, Instant};

use idemkit::postgres::PgStore;
use idemkit::redis::{RedisStore, TlsOptions};
use idemkit::{IdempotencyStore, StoreError};

use super::{certs, chain, expect_refused, key, report, round, trusted, PASSWORD};
use crate::support;
use support::tls::{pg_url, pool_options, verify_full, TlsRedis, HOW_TO};

// ------------------------------------------------------------ Redis

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_tls_with_password_round() {
    let server = TlsRedis::shared();
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
async fn redis_untrusted_certificate_is_refused_fast() {
    // A server whose certificate comes from CA b, which the client does not trust.
    let other = TlsRedis::start("b");
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
    let server = TlsRedis::shared();
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

/// A CA (or client identity) PEM that does not parse is a setting no
/// retry cures: `connect_tls` fails with `InvalidArgument` or `Backend`,
/// never the retryable `Unavailable` (a consumer would retry it forever
/// instead of failing at start). No server is needed: the PEM is parsed
/// before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_malformed_pem_is_not_retryable() {
    let started = Instant::now();
    let url = format!("rediss://127.0.0.1:{}/", support::free_port());
    let bad = b"-----BEGIN CERTIFICATE-----\n!!! not base64 !!!\n-----END CERTIFICATE-----\n";
    let cases = [
        ("root_ca_pem", TlsOptions::new().root_ca_pem(bad.to_vec())),
        (
            "client_identity_pem",
            TlsOptions::new().client_identity_pem(bad.to_vec(), b"not a key".to_vec()),
        ),
    ];
    let mut seen = Vec::new();
    for (what, tls) in cases {
        let result = RedisStore::connect_tls(&url, &tls).await;
        let verdict = match &result {
            Ok(_) => "connected".to_owned(),
            Err(e) => format!("retryable={} ({e})", e.is_retryable()),
        };
        seen.push((what, verdict, result.err()));
    }
    report(
        "redis-tls-malformed-pem",
        "redis",
        &seen
            .iter()
            .map(|(w, v, _)| (*w, format!("{:?}", v)))
            .collect::<Vec<_>>(),
        started,
    );
    for (what, verdict, err) in seen {
        assert!(
            matches!(
                err,
                Some(StoreError::InvalidArgument { .. }) | Some(StoreError::Backend(_))
            ),
            "a malformed {what} must fail as a setting (InvalidArgument or Backend), got {verdict}"
        );
    }
}

/// `redis-cli` over TLS (trusting CA `a`) to the node on `port`, with the
/// password.
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
    let ports: Vec<u16> = (0..3)
        .map(|_| support::redis_server::cluster_port())
        .collect();
    let nodes: Vec<TlsRedis> = ports
        .iter()
        .map(|&port| {
            let conf = format!("nodes-{port}.conf");
            TlsRedis::start_on(
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_scram_round() {
    let ca = certs().ca("a");
    for host in ["127.0.0.1", "localhost"] {
        let url = pg_url(host, &format!("idem:{PASSWORD}"), &verify_full(&ca));
        let pool = idemkit::postgres::connect_with(pool_options(), &url)
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
async fn postgres_untrusted_certificate_is_refused_fast() {
    // The client trusts CA b only; the server's certificate comes from CA a.
    let url = pg_url(
        "127.0.0.1",
        &format!("idem:{PASSWORD}"),
        &verify_full(&certs().ca("b")),
    );
    let started = Instant::now();
    let result = idemkit::postgres::connect_with(pool_options(), &url).await;
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
    let url = pg_url("127.0.0.1", &format!("idem:{PASSWORD}"), "sslmode=disable");
    let started = Instant::now();
    let result = idemkit::postgres::connect_with(pool_options(), &url).await;
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
    match idemkit::postgres::connect_with(pool_options(), &url).await {
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
