//! The error classes of `Failover` and `connect`: what no retry cures (a
//! TLS setting, a missing CA file, a wrong password on every server, a role
//! that may not run the probe's queries) is `Backend`; what may pass (a
//! server down among others) stays `Unavailable`. Most run on the TLS
//! PostgreSQL of `support::tls`.

use crate::support;

use std::time::{Duration, Instant};

use idemkit::postgres::{Failover, PgStore};
use idemkit::{IdempotencyStore, StoreError};
use sqlx::postgres::PgPoolOptions;
use sqlx::Connection;
use support::pg::PgServer;
use support::report::{chain, report};
use support::storm::run_id;
use support::tls::{certs, pg_url, pool_options, shared_pg, verify_full, PASSWORD};

use super::key;

/// How a connection attempt ended: `connected`, `Backend`, `Unavailable`,
/// or the error.
fn class<T>(result: &Result<T, StoreError>) -> String {
    match result {
        Ok(_) => "connected".to_owned(),
        Err(StoreError::Backend(_)) => "Backend".to_owned(),
        Err(StoreError::Unavailable(_)) => "Unavailable".to_owned(),
        Err(e) => format!("{e:?}"),
    }
}

/// A TLS setting that no retry cures (`sslmode=require` to a server
/// without TLS, an `sslrootcert` file that does not exist) is `Backend`
/// from `idem_postgres::connect`, and from `connect_any` (the search of
/// `Failover`) too: not the retryable `Unavailable` of a server that may
/// come back, which an application retrying `Unavailable` at start would
/// retry forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_misconfiguration_is_not_retryable() {
    let started = Instant::now();
    let url = support::pg::shared_url().to_owned();
    let sep = if url.contains('?') { '&' } else { '?' };
    let cases = [
        (
            "require-to-plaintext-server",
            format!("{url}{sep}sslmode=require"),
        ),
        (
            "missing-rootcert",
            format!("{url}{sep}sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"),
        ),
    ];
    let mut rows = Vec::new();
    for (what, bad) in &cases {
        let single = idemkit::postgres::connect(bad).await.map(|_| ());
        let any = idemkit::postgres::connect_any(&[bad.as_str()])
            .await
            .map(|_| ());
        rows.push((*what, single, any));
    }
    let fields: Vec<(&str, String)> = rows
        .iter()
        .flat_map(|(what, single, any)| {
            let r = |x: &Result<(), StoreError>| match x {
                Ok(()) => "ok".to_owned(),
                Err(e) => format!("retryable={}", e.is_retryable()),
            };
            [(
                *what,
                format!("connect:{},connect_any:{}", r(single), r(any)),
            )]
        })
        .collect();
    report(
        "postgres-failover-tls-setting",
        "postgres",
        &fields,
        started,
    );
    for (what, single, any) in rows {
        if let Err(e) = &single {
            assert!(!e.is_retryable(), "{what}: connect says retryable: {e}");
        }
        match any {
            Err(e) => assert!(
                !e.is_retryable(),
                "{what}: connect says {:?} but connect_any says retryable: {e}",
                single.as_ref().err().map(|e| e.to_string())
            ),
            Ok(()) => panic!("{what}: connect_any connected"),
        }
    }
}

/// A CA file that does not exist (`sslrootcert=` a typo) is a TLS setting
/// no retry cures, like an untrusted certificate: it must be
/// `StoreError::Backend`, through `connect` and through `Failover`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_ca_file_is_not_retryable() {
    let idem = format!("idem:{PASSWORD}");
    // Control: the right CA connects.
    let good = pg_url("127.0.0.1", &idem, &verify_full(&certs().ca("a")));
    let pool = idemkit::postgres::connect_with(pool_options(), &good)
        .await
        .unwrap_or_else(|e| panic!("control connect: {}", chain(&e)));
    pool.close().await;

    let missing = pg_url("127.0.0.1", &idem, &verify_full(&certs().ca("no-such")));
    let mut failures = Vec::new();
    let started = Instant::now();
    let direct = idemkit::postgres::connect_with(pool_options(), &missing).await;
    let direct_ms = started.elapsed().as_millis();
    let started2 = Instant::now();
    let failover = Failover::new([missing.as_str()]).unwrap_or_else(|e| panic!("{e}"));
    let through = failover.connect_with(pool_options()).await;
    let failover_ms = started2.elapsed().as_millis();
    for (path, result, ms) in [
        ("connect", direct, direct_ms),
        ("failover", through, failover_ms),
    ] {
        let class = class(&result);
        let text = result.as_ref().err().map(|e| chain(e)).unwrap_or_default();
        eprintln!("{path}: {class} in {ms} ms: {text}");
        report(
            "pg_missing_ca_file",
            "postgres",
            &[
                ("path", path.into()),
                ("error", class.clone()),
                ("fail_ms", ms.to_string()),
            ],
            started,
        );
        if class != "Backend" {
            failures.push(format!("{path}: {class} ({text})"));
        }
    }
    assert!(
        failures.is_empty(),
        "a missing sslrootcert file is classed retryable: {failures:?}"
    );
}

/// Control for the Failover classes: a wrong password on every server is
/// not retryable; one server with a wrong password and one down (refused)
/// is retryable (the down one may come back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_backend_unless_another_server_is_down() {
    let started = Instant::now();
    let wrong = pg_url("127.0.0.1", "idem:wrong", &verify_full(&certs().ca("a")));
    let r = Failover::new([wrong.as_str()])
        .unwrap_or_else(|e| panic!("{e}"))
        .connect_with(pool_options())
        .await;
    assert!(
        matches!(r, Err(StoreError::Backend(_))),
        "wrong password through Failover: {:?}",
        r.err()
    );
    let down = format!(
        "postgres://idem:{PASSWORD}@127.0.0.1:{}/idem",
        support::free_port()
    );
    let r = Failover::new([wrong.as_str(), down.as_str()])
        .unwrap_or_else(|e| panic!("{e}"))
        .connect_with(pool_options())
        .await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(_))),
        "wrong password + a server down through Failover: {:?}",
        r.err()
    );
    report(
        "pg_failover_password_classes",
        "postgres",
        &[("held", "true".into())],
        started,
    );
}

/// The timeline query on a role that may not run `pg_current_wal_lsn()`
/// (a hardened server: `REVOKE EXECUTE ... FROM PUBLIC`). Every server
/// answers "permission denied" to the probe, for ever: that is not a fault
/// a retry cures, yet the Failover must not panic, and the caller must be
/// able to tell it from a server that is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeline_query_without_privilege_is_not_retryable() {
    let started = Instant::now();
    shared_pg().psql(
        "idem",
        "CREATE ROLE nopriv LOGIN PASSWORD 'np-Pa55'; \
         REVOKE EXECUTE ON FUNCTION pg_current_wal_lsn() FROM PUBLIC;",
    );
    let url = pg_url(
        "127.0.0.1",
        "nopriv:np-Pa55",
        &verify_full(&certs().ca("a")),
    );
    let first = Instant::now();
    let r = Failover::new([url.as_str()])
        .unwrap_or_else(|e| panic!("{e}"))
        .connect_with(pool_options())
        .await;
    let ms = first.elapsed().as_millis();
    let class = class(&r);
    let text = r.as_ref().err().map(|e| chain(e)).unwrap_or_default();
    eprintln!("nopriv through Failover: {class} in {ms} ms: {text}");
    report(
        "pg_failover_timeline_without_privilege",
        "postgres",
        &[("error", class.clone()), ("fail_ms", ms.to_string())],
        started,
    );
    assert!(
        class == "connected" || class == "Backend",
        "a permission refused on the probe's timeline query is classed {class} (retried for ever): {text}"
    );
}

/// A server of its own where the role `idem` logs in over TCP with a
/// password (scram-sha-256) and owns the database `idem`; returns it and
/// an admin connection (as `postgres`, trusted).
async fn pg_with_password() -> (PgServer, sqlx::PgConnection) {
    let server = tokio::task::block_in_place(PgServer::start);
    let mut admin = sqlx::PgConnection::connect(&server.url)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for sql in [
        "SET password_encryption = 'scram-sha-256'",
        "CREATE ROLE idem LOGIN PASSWORD 'first'",
        "CREATE DATABASE idem OWNER idem",
    ] {
        sqlx::raw_sql(sql)
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let hba = server.data().join("pg_hba.conf");
    let rules = "local all all trust\nhost all postgres 127.0.0.1/32 trust\n\
                 host all idem 127.0.0.1/32 scram-sha-256\n";
    std::fs::write(&hba, rules).unwrap_or_else(|e| panic!("{e}"));
    sqlx::raw_sql("SELECT pg_reload_conf()")
        .execute(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (server, admin)
}

/// The role's password is changed while the store runs (a rotation done on
/// the server before the app's configuration). Without `Failover`, the
/// store's next connection fails `Backend` ("authentication failed", as
/// documented: no retry helps). With `Failover` too: the failed connection
/// sends the store searching, and the search's verdict (every server
/// refused the credentials: not retryable) is the call's, not a retryable
/// `Unavailable` retried forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_at_runtime_is_not_retryable() {
    let started = Instant::now();
    let (server, mut admin) = pg_with_password().await;
    let url = format!("postgres://idem:first@127.0.0.1:{}/idem", server.port);
    let plain = PgStore::builder(
        PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .connections(1)
    .call_timeout(Duration::from_secs(2))
    .build()
    .unwrap_or_else(|e| panic!("{e}"));
    plain.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let failover = Failover::new([&url]).unwrap_or_else(|e| panic!("{e}"));
    let with_failover = PgStore::builder(
        failover
            .connect_with(PgPoolOptions::new().max_connections(2))
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .failover(failover)
    .connections(1)
    .call_timeout(Duration::from_secs(2))
    .build()
    .unwrap_or_else(|e| panic!("{e}"));
    let run = run_id();
    for store in [&plain, &with_failover] {
        assert!(store
            .acquire(&key(&run, fastrand::u64(..)), None, Duration::from_secs(30))
            .await
            .is_ok());
    }
    // The password changes on the server; the store's connections are
    // closed (a restart, an idle timeout, a network blip).
    for sql in [
        "ALTER ROLE idem PASSWORD 'second'",
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'idem'",
    ] {
        sqlx::raw_sql(sql)
            .execute(&mut admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let mut verdicts = Vec::new();
    for (name, store) in [("plain", &plain), ("failover", &with_failover)] {
        // The first call may fail on its dead connection: the verdict is
        // the one once only new connections are tried.
        let mut last = None;
        for i in 0..3 {
            last = Some(
                store
                    .acquire(&key(&run, 100 + i), None, Duration::from_secs(30))
                    .await
                    .map(|_| ()),
            );
        }
        verdicts.push((name, last.unwrap_or(Ok(()))));
    }
    report(
        "postgres-password-rotated-at-runtime",
        "postgres",
        &verdicts
            .iter()
            .map(|(n, r)| {
                (
                    *n,
                    match r {
                        Ok(()) => "ok".to_owned(),
                        Err(e) if e.is_retryable() => "Unavailable".to_owned(),
                        Err(_) => "Backend".to_owned(),
                    },
                )
            })
            .collect::<Vec<_>>(),
        started,
    );
    for (name, r) in verdicts {
        match r {
            Err(e) => assert!(
                !e.is_retryable(),
                "{name}: a refused password at runtime must be Backend (as documented), got {e}"
            ),
            Ok(()) => panic!("{name}: connected with the old password"),
        }
    }
}
