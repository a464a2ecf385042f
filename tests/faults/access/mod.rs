//! Access: TLS and authentication on Redis and PostgreSQL.
//!
//! The servers come from `support::tls`: certificate authorities made with
//! the `openssl` command (a trusted one, and an untrusted one for the
//! negative cases), a TLS-only redis-server (`--port 0 --tls-port P`,
//! `requirepass`, ACL users) and a PostgreSQL with `ssl=on`,
//! scram-sha-256 and only `hostssl` lines in pg_hba.conf. The modules check
//! that:
//! - `tls`: the stores connect and a round (process, acquire, complete,
//!   replay) works over TLS with authentication; an untrusted certificate,
//!   a malformed PEM and a plaintext attempt on a TLS-only server fail fast
//!   (well under the call timeout) with a non-retryable
//!   `StoreError::Backend` whose message names the cause, while a refused
//!   connection stays `Unavailable` (retryable);
//! - `passwords`: a wrong or missing password is refused fast, not
//!   retryable;
//! - `acl`: the Redis store runs as an ACL user limited to exactly the
//!   commands and the key pattern it needs (`idem_redis::acl_rules`), for
//!   every prefix it accepts, and that user cannot touch a key outside the
//!   pattern; a prefix no ACL pattern can name is refused;
//! - `connections`: the store's own connections to Redis (the probe of
//!   `connect` is closed; a server full of clients is retryable, not a
//!   wrong password);
//! - `provider`: `rediss://` URLs in a build with two rustls crypto
//!   providers.
//!
//! Each negative case prints `reliability scenario=... backend=... fail_ms=...`
//! (`cargo test --all-features --test faults access -- --nocapture`).

use crate::support;

use std::time::{Duration, Instant};

use idemkit::redis::redis;
use idemkit::redis::TlsOptions;
use idemkit::{
    AcquireItem, Acquisition, Idempotency, IdempotencyKey, IdempotencyStore, Processed, StoreError,
};
use support::report::{chain, report};
use support::tls::{certs, PASSWORD};

mod acl;
mod connections;
mod passwords;
#[cfg(all(feature = "tiered", feature = "dynamodb"))]
mod provider;
mod tls;

/// The password of the limited Redis ACL user `idem`.
const ACL_PASSWORD: &str = "acl-Pa55";

/// The ACL of the Redis store (standalone), as `idem_redis::acl_rules`
/// documents it: the commands it sends, those its scripts run, and its key
/// pattern (the default prefix `idem:`). `CONFIG GET` (the eviction-policy
/// check at connect) is left out on purpose: the store logs a warning and
/// goes on.
fn redis_acl() -> String {
    format!("on {}", idemkit::redis::acl_rules("idem:", false))
}

/// A fresh key in `scope`.
fn key(scope: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope, format!("{:016x}", fastrand::u64(..)))
        .unwrap_or_else(|e| panic!("{e}"))
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
    let done: Vec<(&idemkit::Lease, &[u8])> = leases.iter().map(|l| (l, &b"ok"[..])).collect();
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

/// TLS options that trust CA `a` (the shared servers' CA).
fn trusted() -> TlsOptions {
    TlsOptions::new().root_ca_pem(certs().ca_pem("a"))
}

/// An admin connection (the default user) to the TLS server.
async fn redis_admin(port: u16) -> redis::aio::MultiplexedConnection {
    // rustls needs a process-wide provider for the redis crate's own TLS
    // connections (an application may have two: ring, and aws-lc-rs from
    // the AWS SDK's HTTPS client).
    idemkit::redis::install_crypto_provider();
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
