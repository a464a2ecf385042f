//! Passwords: a wrong password, and none at all where one is needed, are
//! refused fast with a non-retryable `Backend` naming the cause, on Redis
//! (the default user and an ACL user) and on PostgreSQL (scram-sha-256).

use std::time::{Duration, Instant};

use idemkit::redis::RedisStore;
use idemkit::IdempotencyStore;

use super::{acl_user, expect_refused, key, redis_acl, trusted, ACL_PASSWORD};
use crate::support;
use support::tls::{certs, pg_url, pool_options, verify_full, TlsRedis};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_wrong_password_is_refused_fast() {
    let server = TlsRedis::shared();
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
async fn postgres_wrong_password_is_refused_fast() {
    let url = pg_url("127.0.0.1", "idem:wrong", &verify_full(&certs().ca("a")));
    let started = Instant::now();
    let result = idemkit::postgres::connect_with(pool_options(), &url).await;
    expect_refused(
        "tls_wrong_password",
        "postgres",
        result,
        started,
        &["authentication"],
    );

    // No password at all.
    let url = pg_url("127.0.0.1", "idem", &verify_full(&certs().ca("a")));
    let started = Instant::now();
    let result = idemkit::postgres::connect_with(pool_options(), &url).await;
    expect_refused(
        "tls_no_password",
        "postgres",
        result,
        started,
        &["authentication", "password"],
    );
}
