//! The `idem` binary against real PostgreSQL, Redis and Redis Cluster:
//! records made through the real stores (and the HTTP layer, and the
//! tiered store) are inspected, listed, counted, deleted and purged by
//! running the command as an operator would.

// The facade's test support; its `feature = "postgres"` gate is the
// facade's feature (off here: that module is not needed).
#[path = "../../../tests/support/mod.rs"]
#[allow(unexpected_cfgs)]
mod support;

// `idem proxy` against a real upstream (tests/cli/proxy/upstream.py) and
// real stores.
mod proxy;

use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime};

use idemkit::postgres::PgStore;
use idemkit::redis::redis;
use idemkit::redis::RedisStore;
use idemkit::tiered::{MokaCache, RecordCache, RedisCache, RedisInvalidation, TieredStore};
use idemkit::{Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease};
use serde_json::Value;

/// Runs the binary with `args`, no `IDEM_*` variable inherited.
async fn idem(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
        for (name, _) in std::env::vars() {
            if name.starts_with("IDEM_") {
                cmd.env_remove(name);
            }
        }
        cmd.args(&args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run idem: {e}"))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

fn args(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|s| s.to_string()).collect()
}

fn with(mut base: Vec<String>, more: &[&str]) -> Vec<String> {
    base.extend(more.iter().map(|s| s.to_string()));
    base
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `args` and expects exit `code`.
async fn expect(code: i32, args: Vec<String>) -> Output {
    let out = idem(args.clone()).await;
    assert_eq!(
        out.status.code(),
        Some(code),
        "idem {args:?}\nstdout: {}\nstderr: {}",
        stdout(&out),
        stderr(&out)
    );
    out
}

/// Runs `args` with `--json`, expects exit 0, and parses the output.
async fn json(args: Vec<String>) -> Value {
    let out = expect(0, with(args, &["--json"])).await;
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(&out)))
}

/// No byte of the output can drive a terminal: no control character but
/// the line ends, no escape sequence.
fn assert_printable(out: &Output) {
    let text = stdout(out);
    assert!(
        text.chars()
            .all(|c| c == '\n' || !(c.is_control() || ('\u{202A}'..='\u{202E}').contains(&c))),
        "control characters reach the terminal: {text:?}"
    );
}

fn unique(tag: &str) -> String {
    format!("cli.{tag}.{:08x}", fastrand::u32(..))
}

fn key(scope: &str, id: &str) -> IdempotencyKey {
    IdempotencyKey::new(scope, id).unwrap_or_else(|e| panic!("{e}"))
}

async fn acquire<S: IdempotencyStore>(store: &S, key: &IdempotencyKey, lease: Duration) -> Lease {
    let fp = Fingerprint::of_bytes(key.id().as_bytes());
    match store.acquire(key, Some(&fp), lease).await {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("acquire {key}: {other:?}"),
    }
}

async fn completed<S: IdempotencyStore>(
    store: &S,
    key: &IdempotencyKey,
    response: &[u8],
    retention: Duration,
) -> Lease {
    let lease = acquire(store, key, Duration::from_secs(60)).await;
    store
        .complete(&lease, response, retention)
        .await
        .unwrap_or_else(|e| panic!("complete {key}: {e}"));
    lease
}

/// Waits until the store's clock is past `t`: the condition a lease or a
/// retention ending is judged by.
async fn until_past<F, Fut>(t: SystemTime, clock: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = SystemTime>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while clock().await <= t {
        assert!(
            Instant::now() < deadline,
            "the store's clock never passed {t:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn pg_store() -> PgStore {
    let pool = support::pg::pool(support::pg::shared_url(), 4).await;
    let store = PgStore::new(pool);
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
}

fn pg_args() -> Vec<String> {
    args(&[
        "--backend",
        "postgres",
        "--postgres-url",
        support::pg::shared_url(),
    ])
}

/// A store on the shared Redis, with a call timeout a loaded machine never
/// reaches (these tests are about the command, not about timeouts).
async fn redis_store(prefix: &str) -> RedisStore {
    RedisStore::connect(support::redis_server::shared_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .prefix(prefix)
        .call_timeout(Duration::from_secs(30))
}

fn redis_args(prefix: &str) -> Vec<String> {
    args(&[
        "--backend",
        "redis",
        "--redis-url",
        support::redis_server::shared_url(),
        "--prefix",
        prefix,
    ])
}

async fn redis_conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(support::redis_server::shared_url())
        .unwrap_or_else(|e| panic!("{e}"))
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A response no terminal should see raw: escape sequences, a bell, NUL,
/// CR, a bidi override.
const NASTY: &[u8] = b"{\"ok\":true}\x1b[2J\x1b]0;pwned\x07\r\n\0\xe2\x80\xae";

#[tokio::test(flavor = "multi_thread")]
async fn postgres_records_are_inspected_listed_counted_deleted_and_purged() {
    let store = pg_store().await;
    let scope = unique("pg");
    let done = completed(
        &store,
        &key(&scope, "done"),
        NASTY,
        Duration::from_secs(3_600),
    )
    .await;
    let stuck = acquire(&store, &key(&scope, "stuck"), Duration::from_millis(50)).await;
    let live = acquire(&store, &key(&scope, "live"), Duration::from_secs(3_600)).await;
    completed(
        &store,
        &key(&scope, "gone"),
        b"x",
        Duration::from_millis(20),
    )
    .await;
    // Completed before this reading of the clock: expired 20 ms after it at the latest.
    let gone_by =
        store.server_time().await.unwrap_or_else(|e| panic!("{e}")) + Duration::from_millis(20);
    sqlx::query(
        "INSERT INTO idem_records (scope, key, status, token, attempt, created_at, expires_at)
         VALUES ($1, 'bad', 9, '\\x00'::bytea, 1, now(), now() + interval '1 hour')",
    )
    .bind(&scope)
    .execute(store.pool())
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let clock = || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) };
    until_past(stuck.expires_at, clock).await;
    until_past(gone_by, clock).await;

    // A completed record: every field, and a preview that cannot harm.
    let doc = json(with(pg_args(), &["inspect", &scope, "done"])).await;
    assert_eq!(doc["state"], "completed");
    assert_eq!(doc["attempt"], 1);
    assert_eq!(doc["fence"], done.fence);
    assert_eq!(doc["token"], done.token.to_hex());
    assert_eq!(doc["response_bytes"], NASTY.len());
    let preview = doc["preview"].as_str().unwrap_or_default();
    assert!(preview.starts_with("{\"ok\":true}\\u{1b}[2J"), "{preview}");
    assert!(!preview.chars().any(char::is_control), "{preview:?}");
    let expires_in = doc["expires_in_ms"].as_i64().unwrap_or(0);
    assert!(
        expires_in > 3_500_000 && expires_in <= 3_600_000,
        "{expires_in}"
    );
    let text = expect(0, with(pg_args(), &["inspect", &scope, "done"])).await;
    assert_printable(&text);
    assert!(stdout(&text).contains("completed at"), "{}", stdout(&text));

    // In progress, and stuck: lease left by the server's clock.
    let doc = json(with(pg_args(), &["inspect", &scope, "live"])).await;
    assert_eq!(doc["state"], "in_progress");
    let left = doc["lease_left_ms"].as_i64().unwrap_or(0);
    assert!(left > 3_500_000 && left <= 3_600_000, "{left}");
    assert_eq!(doc["fence"], live.fence);
    let doc = json(with(pg_args(), &["inspect", &scope, "stuck"])).await;
    assert_eq!(doc["state"], "stuck");
    assert!(doc["lease_left_ms"].as_i64().unwrap_or(1) <= 0);

    // The stuck list holds the stuck key and the corrupt row, nothing else of ours.
    let doc = json(with(pg_args(), &["stuck", "--limit", "100000"])).await;
    let ours = |list: &Value| -> Vec<String> {
        list.as_array()
            .map(|a| {
                a.iter()
                    .filter(|e| e["scope"] == scope.as_str())
                    .map(|e| e["id"].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(ours(&doc["stuck"]), vec!["stuck".to_owned()], "{doc}");
    assert_eq!(ours(&doc["corrupt"]), vec!["bad".to_owned()], "{doc}");

    // Counts by state.
    let doc = json(with(pg_args(), &["stats"])).await;
    assert_eq!(
        doc["scopes"][&scope],
        serde_json::json!({"in_progress": 1, "stuck": 1, "completed": 1, "expired": 1, "corrupt": 1}),
        "{doc}"
    );

    // A corrupt record is reported with its key: exit 4, not "absent".
    let out = expect(4, with(pg_args(), &["inspect", &scope, "bad"])).await;
    assert!(
        stderr(&out).contains("corrupt") && stderr(&out).contains(&format!("{scope}/bad")),
        "{}",
        stderr(&out)
    );

    // A live lease is not deleted without --force: its handler may run.
    let out = expect(4, with(pg_args(), &["delete", &scope, "live"])).await;
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    assert!(store
        .get(&key(&scope, "live"))
        .await
        .ok()
        .flatten()
        .is_some());
    expect(0, with(pg_args(), &["delete", &scope, "live", "--force"])).await;
    assert!(store
        .get(&key(&scope, "live"))
        .await
        .ok()
        .flatten()
        .is_none());

    // Deleted once; then not found.
    expect(0, with(pg_args(), &["delete", &scope, "done"])).await;
    expect(1, with(pg_args(), &["inspect", &scope, "done"])).await;
    expect(1, with(pg_args(), &["delete", &scope, "done"])).await;
    // The next acquisition runs the key again, with a higher fence.
    let again = acquire(&store, &key(&scope, "done"), Duration::from_secs(60)).await;
    assert!(again.fence > done.fence);
    // The corrupt row can be deleted (that is what deleting is for), stuck too.
    expect(0, with(pg_args(), &["delete", &scope, "bad"])).await;
    expect(0, with(pg_args(), &["delete", &scope, "stuck"])).await;

    // Purge deletes the expired row.
    let doc = json(with(pg_args(), &["purge", "--max", "1000000"])).await;
    assert!(doc["purged"].as_u64().unwrap_or(0) >= 1, "{doc}");
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_records WHERE scope = $1 AND key = 'gone'")
            .bind(&scope)
            .fetch_one(store.pool())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(left, 0);
}

/// A key looked for in the wrong scope (the HTTP layer's default `http`
/// when the app set its own, say): "not found" names the scopes that hold
/// a record for its id, on PostgreSQL and on Redis; an id no scope holds
/// says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_not_found_names_the_scopes_that_hold_its_id() {
    let (scope, other) = (unique("held"), unique("asked"));
    let id = format!("order-{:08x}", fastrand::u32(..));
    let prefix = format!("{}:", unique("scopes"));
    let pg = pg_store().await;
    let redis = redis_store(&prefix).await;
    completed(&pg, &key(&scope, &id), b"done", Duration::from_secs(600)).await;
    completed(&redis, &key(&scope, &id), b"done", Duration::from_secs(600)).await;
    for base in [pg_args(), redis_args(&prefix)] {
        let out = expect(1, with(base.clone(), &["inspect", &other, &id])).await;
        assert!(
            stderr(&out).contains(&format!("this id has records in scope {scope}")),
            "{base:?}: {}",
            stderr(&out)
        );
        let nowhere = format!("nowhere-{:08x}", fastrand::u32(..));
        let out = expect(1, with(base.clone(), &["inspect", &other, &nowhere])).await;
        assert!(
            stderr(&out).contains("no other scope holds a record for this id"),
            "{base:?}: {}",
            stderr(&out)
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_creates_a_table_of_its_own_and_runs_again() {
    let table = format!("cli_{:08x}", fastrand::u32(..));
    for _ in 0..2 {
        let doc = json(with(pg_args(), &["--table", &table, "migrate"])).await;
        assert_eq!(doc["migrations"], serde_json::json!([1, 2]));
    }
    let pool = support::pg::pool(support::pg::shared_url(), 1).await;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("public.{table}"))
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(exists);
    // The new table is empty and usable.
    let doc = json(with(pg_args(), &["--table", &table, "stats"])).await;
    assert_eq!(doc["scopes"], serde_json::json!({}));
    // A name PostgreSQL would not take as is: usage.
    expect(2, with(pg_args(), &["--table", "Bad-Name", "stats"])).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_records_corrupt_values_and_delete_markers() {
    let prefix = format!("{}:", unique("r"));
    let store = redis_store(&prefix).await;
    let scope = "orders";
    let done = completed(
        &store,
        &key(scope, "done"),
        NASTY,
        Duration::from_secs(3_600),
    )
    .await;
    let stuck = acquire(&store, &key(scope, "stuck"), Duration::from_millis(50)).await;
    acquire(&store, &key(scope, "live"), Duration::from_secs(3_600)).await;
    // A delete leaves a marker under the prefix: not a record, not corrupt.
    completed(
        &store,
        &key(scope, "deleted"),
        b"x",
        Duration::from_secs(60),
    )
    .await;
    assert!(store.delete(&key(scope, "deleted")).await.unwrap_or(false));
    let mut conn = redis_conn().await;
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}{scope}/bad"))
        .arg("not a record")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}{scope}/hash"))
        .arg("f")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}no-slash"))
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let clock = || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) };
    until_past(stuck.expires_at, clock).await;
    let a = redis_args(&prefix);

    let doc = json(with(a.clone(), &["inspect", scope, "done"])).await;
    assert_eq!(doc["state"], "completed");
    assert_eq!(doc["fence"], done.fence);
    assert_eq!(doc["response_bytes"], NASTY.len());
    assert_eq!(doc["location"], format!("Redis key {prefix}{scope}/done"));
    assert_printable(&expect(0, with(a.clone(), &["inspect", scope, "done"])).await);
    let doc = json(with(a.clone(), &["inspect", scope, "stuck"])).await;
    assert_eq!(doc["state"], "stuck");

    let doc = json(with(a.clone(), &["stats"])).await;
    assert_eq!(
        doc["scopes"][scope],
        serde_json::json!({"in_progress": 1, "stuck": 1, "completed": 1, "corrupt": 2}),
        "{doc}"
    );
    assert_eq!(doc["scopes"][""]["corrupt"], 1, "{doc}");
    assert_eq!(doc["complete"], true);
    let corrupt: Vec<&str> = doc["corrupt"]
        .as_array()
        .map(|a| a.iter().filter_map(|c| c["redis_key"].as_str()).collect())
        .unwrap_or_default();
    for name in ["bad", "hash"] {
        assert!(
            corrupt.contains(&format!("{prefix}{scope}/{name}").as_str()),
            "{doc}"
        );
    }

    let doc = json(with(a.clone(), &["stuck"])).await;
    let stuck_ids: Vec<&str> = doc["stuck"]
        .as_array()
        .map(|a| a.iter().filter_map(|c| c["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(stuck_ids, vec!["stuck"], "{doc}");
    assert_eq!(doc["corrupt"].as_array().map(Vec::len), Some(3), "{doc}");
    // The limit bounds the list.
    let doc = json(with(a.clone(), &["stuck", "--limit", "1"])).await;
    assert_eq!(
        doc["stuck"].as_array().map(Vec::len).unwrap_or(0)
            + doc["corrupt"].as_array().map(Vec::len).unwrap_or(0),
        1
    );
    assert_eq!(doc["complete"], false);

    let out = expect(4, with(a.clone(), &["inspect", scope, "bad"])).await;
    assert!(stderr(&out).contains("corrupt"), "{}", stderr(&out));
    expect(4, with(a.clone(), &["inspect", scope, "hash"])).await;
    expect(4, with(a.clone(), &["delete", scope, "live"])).await;
    expect(0, with(a.clone(), &["delete", scope, "bad"])).await;
    expect(0, with(a.clone(), &["delete", scope, "done"])).await;
    expect(1, with(a.clone(), &["inspect", scope, "done"])).await;
    expect(1, with(a.clone(), &["delete", scope, "done"])).await;
    // Nothing to purge on Redis, and no migration.
    assert_eq!(json(with(a.clone(), &["purge"])).await["purged"], 0);
    expect(2, with(a.clone(), &["migrate"])).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster_is_scanned_on_every_primary() {
    let nodes = support::redis_server::shared_cluster();
    let prefix = format!("{}:", unique("c"));
    let store = RedisStore::connect_cluster(nodes.iter().map(String::as_str))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .prefix(prefix.clone());
    let scope = "events";
    for i in 0..40 {
        completed(
            &store,
            &key(scope, &format!("k{i}")),
            b"ok",
            Duration::from_secs(600),
        )
        .await;
    }
    let stuck = acquire(&store, &key(scope, "stuck"), Duration::from_millis(50)).await;
    // The keys live on more than one primary.
    let mut owners = std::collections::HashSet::new();
    for url in nodes {
        let mut conn = redis::Client::open(url.as_str())
            .unwrap_or_else(|e| panic!("{e}"))
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if !keys.is_empty() {
            owners.insert(url.clone());
        }
    }
    assert!(owners.len() > 1, "all keys on one node: {owners:?}");
    let clock = || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) };
    until_past(stuck.expires_at + Duration::from_millis(50), clock).await;
    let a = args(&[
        "--backend",
        "redis-cluster",
        "--redis-cluster-urls",
        &nodes.join(","),
        "--prefix",
        &prefix,
    ]);
    let doc = json(with(a.clone(), &["stats"])).await;
    assert_eq!(
        doc["scopes"][scope],
        serde_json::json!({"in_progress": 0, "stuck": 1, "completed": 40, "corrupt": 0}),
        "{doc}"
    );
    let doc = json(with(a.clone(), &["stuck"])).await;
    assert_eq!(doc["stuck"][0]["id"], "stuck", "{doc}");
    let doc = json(with(a.clone(), &["inspect", scope, "k7"])).await;
    assert_eq!(doc["state"], "completed");
    expect(0, with(a.clone(), &["delete", scope, "k7"])).await;
    expect(1, with(a.clone(), &["inspect", scope, "k7"])).await;
    // The scan limit is honoured and said.
    let doc = json(with(a, &["stats", "--scan-max", "5"])).await;
    assert_eq!(doc["complete"], false);
    assert_eq!(doc["scanned"], 5);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_finds_the_record_the_http_layer_wrote() {
    use axum::routing::post;
    use tower::ServiceExt as _;

    let store = pg_store().await;
    let scope = unique("http");
    let router = axum::Router::new()
        .route(
            "/payments/{id}",
            post(|| async { (axum::http::StatusCode::CREATED, "charged") }),
        )
        .layer(
            idemkit::http::IdempotencyLayer::new(idemkit::Idempotency::new(store.clone()))
                .scope(scope.clone())
                .unwrap_or_else(|e| panic!("{e}"))
                .tenant(|req| {
                    req.headers
                        .get("x-api-key")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                }),
        );
    let request = axum::http::Request::post("/payments/7")
        .header("x-api-key", "tenant-1")
        .header("idempotency-key", "\"order-7/a\"")
        .header("content-type", "application/json")
        .body(axum::body::Body::from("{\"amount\":5}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let response = router
        .oneshot(request)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(response.status(), 201);

    let find = with(
        pg_args(),
        &[
            "inspect",
            "--http-key",
            "--tenant",
            "tenant-1",
            "--method",
            "POST",
            "--path",
            "/payments/7",
            "--header",
            "\"order-7/a\"",
            "--scope",
            &scope,
        ],
    );
    // The layer records the response as the handler returns (detached):
    // wait for the completion.
    let deadline = Instant::now() + Duration::from_secs(30);
    let doc = loop {
        let out = idem(with(find.clone(), &["--json"])).await;
        if out.status.code() == Some(0) {
            let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}"));
            if doc["state"] == "completed" {
                break doc;
            }
        }
        assert!(Instant::now() < deadline, "{}", stderr(&out));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(doc["key"]["scope"], scope.as_str());
    // Another tenant's, path's or key's request is another record.
    for (flag, other) in [
        ("--tenant", "tenant-2"),
        ("--path", "/payments/8"),
        ("--header", "order-7"),
    ] {
        let mut changed = find.clone();
        let at = changed.iter().position(|a| a == flag).unwrap_or(0) + 1;
        changed[at] = other.to_owned();
        expect(1, changed).await;
    }
    // http-key prints the same key the record is under.
    let printed = json(args(&[
        "http-key",
        "--tenant",
        "tenant-1",
        "--method",
        "POST",
        "--path",
        "/payments/7",
        "--header",
        "\"order-7/a\"",
        "--scope",
        &scope,
    ]))
    .await;
    assert_eq!(printed["id"], doc["key"]["id"]);
    let found = store
        .get(&key(&scope, printed["id"].as_str().unwrap_or_default()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(found.is_some_and(|r| r.is_completed()));
    // A malformed header value is a usage error.
    expect(
        2,
        args(&[
            "http-key",
            "--tenant",
            "t",
            "--method",
            "POST",
            "--path",
            "/p",
            "--header",
            "bad\u{7f}",
        ]),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tiered_delete_clears_every_tier_and_the_running_apps_moka() {
    let source = pg_store().await;
    let url = support::redis_server::shared_url();
    let cache_prefix = format!("{}:", unique("cache"));
    let channel = unique("inv");
    let moka = MokaCache::new(1_000, 1 << 20);
    let redis_tier = RedisCache::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .prefix(cache_prefix.clone());
    // The running application: moka, Redis, PostgreSQL, invalidations.
    let app = TieredStore::new(source.clone())
        .with_cache(moka.clone())
        .with_cache(redis_tier.clone())
        .with_invalidation(
            RedisInvalidation::connect(url)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .channel(channel.clone()),
        );
    let mut conn = redis_conn().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, subscribers): (String, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(&channel)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if subscribers > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the app never subscribed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let scope = unique("tier");
    let k = key(&scope, "order-1");
    completed(&app, &k, b"receipt", Duration::from_secs(600)).await;
    let cached = moka.get(&k).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(cached.is_some(), "written through into moka");
    assert!(redis_tier.get(&k).await.ok().flatten().is_some());

    let a = args(&[
        "--backend",
        "tiered",
        "--postgres-url",
        support::pg::shared_url(),
        "--redis-url",
        url,
        "--cache-prefix",
        &cache_prefix,
        "--channel",
        &channel,
    ]);
    let doc = json(with(a.clone(), &["inspect", &scope, "order-1"])).await;
    assert_eq!(doc["state"], "completed");
    assert_eq!(doc["cache"]["entry"], "completed", "{doc}");
    assert_eq!(doc["cache"]["response_bytes"], 7);
    let doc = json(with(a.clone(), &["stats"])).await;
    assert_eq!(doc["source"]["scopes"][&scope]["completed"], 1, "{doc}");
    assert_eq!(doc["cache"]["scopes"][&scope]["completed"], 1, "{doc}");

    expect(0, with(a.clone(), &["delete", &scope, "order-1"])).await;
    assert!(source.get(&k).await.ok().flatten().is_none(), "source");
    assert!(
        redis_tier.get(&k).await.ok().flatten().is_none(),
        "Redis tier"
    );
    // The app's moka got the delete's tombstone: it drops the entry and
    // refuses the old record, even written again.
    let record = cached.unwrap_or_else(|| unreachable!());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let _ = moka.put(&record, Duration::from_secs(600)).await;
        if moka.get(&k).await.ok().flatten().is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the app's moka still replays {k}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The app runs the key again.
    assert!(matches!(
        app.acquire(&k, None, Duration::from_secs(60)).await,
        Ok(Acquisition::Acquired(_))
    ));
    expect(
        0,
        with(a.clone(), &["delete", &scope, "order-1", "--force"]),
    )
    .await;
    expect(1, with(a, &["inspect", &scope, "order-1"])).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mebibyte_binary_response_and_a_512_byte_id_print_safely() {
    let mut big = Vec::with_capacity(1 << 20);
    while big.len() < 1 << 20 {
        big.push(fastrand::u8(..));
    }
    big[..3].copy_from_slice(b"\x1b[H");
    let id = format!("{}{}", "é", "x".repeat(510));
    assert_eq!(id.len(), 512);
    let pg = pg_store().await;
    let scope = unique("big");
    let prefix = format!("{}:", unique("big"));
    let redis = redis_store(&prefix).await;
    completed(&pg, &key(&scope, &id), &big, Duration::from_secs(600)).await;
    completed(&redis, &key(&scope, &id), &big, Duration::from_secs(600)).await;
    for a in [pg_args(), redis_args(&prefix)] {
        let out = expect(0, with(a.clone(), &["inspect", &scope, &id])).await;
        assert_printable(&out);
        assert!(
            out.stdout.len() < 4_096,
            "{} bytes printed",
            out.stdout.len()
        );
        assert!(stdout(&out).contains("1048576 bytes"));
        let doc = json(with(a.clone(), &["inspect", &scope, &id])).await;
        assert_eq!(doc["response_bytes"], 1 << 20);
        assert_eq!(doc["key"]["id"], id.as_str());
        let preview = doc["preview"].as_str().unwrap_or_default();
        assert!(preview.starts_with("\\u{1b}[H"), "{preview}");
        assert!(preview.chars().count() <= 200 * 8, "{preview}");
        expect(0, with(a.clone(), &["delete", &scope, &id])).await;
        expect(1, with(a, &["inspect", &scope, &id])).await;
    }
    // An id of 513 bytes is not a key: usage.
    expect(2, with(pg_args(), &["inspect", &scope, &"y".repeat(513)])).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unreachable_servers_exit_3_quickly() {
    let port = support::free_port().to_string();
    for a in [
        args(&[
            "--backend",
            "postgres",
            "--postgres-url",
            &format!("postgres://postgres@127.0.0.1:{port}/x"),
        ]),
        args(&[
            "--backend",
            "redis",
            "--redis-url",
            &format!("redis://127.0.0.1:{port}/"),
        ]),
        args(&[
            "--backend",
            "redis-cluster",
            "--redis-cluster-urls",
            &format!("redis://127.0.0.1:{port}/"),
        ]),
        args(&[
            "--backend",
            "tiered",
            "--postgres-url",
            support::pg::shared_url(),
            "--redis-url",
            &format!("redis://127.0.0.1:{port}/"),
        ]),
    ] {
        let started = Instant::now();
        let out = expect(3, with(a.clone(), &["--timeout", "5", "stats"])).await;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{a:?} took {:?}",
            started.elapsed()
        );
        assert!(
            stderr(&out).contains("a retry may help"),
            "{}",
            stderr(&out)
        );
        let out = expect(
            3,
            with(a, &["--timeout", "5", "--json", "inspect", "s", "k"]),
        )
        .await;
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(doc["error"], "unavailable");
        assert_eq!(doc["retry_may_help"], true);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn usage_errors_exit_2_and_say_so() {
    // No store, or two without --backend.
    let out = expect(2, args(&["stats"])).await;
    assert!(stderr(&out).contains("no store given"), "{}", stderr(&out));
    let two = args(&[
        "--postgres-url",
        support::pg::shared_url(),
        "--redis-url",
        support::redis_server::shared_url(),
    ]);
    let out = expect(2, with(two, &["stats"])).await;
    assert!(stderr(&out).contains("--backend"), "{}", stderr(&out));
    // Bad keys, missing parts, unknown commands, bad numbers.
    expect(2, with(pg_args(), &["inspect", "bad scope", "k"])).await;
    expect(2, with(pg_args(), &["inspect", "s"])).await;
    expect(
        2,
        with(pg_args(), &["inspect", "--http-key", "--tenant", "t"]),
    )
    .await;
    expect(2, with(pg_args(), &["frobnicate"])).await;
    expect(2, with(pg_args(), &["stuck", "--limit", "-1"])).await;
    expect(2, with(pg_args(), &["--timeout", "0", "stats"])).await;
    expect(2, with(pg_args(), &["--timeout", "NaN", "stats"])).await;
    expect(
        2,
        args(&[
            "--backend",
            "postgres",
            "--postgres-url",
            "not a url",
            "stats",
        ]),
    )
    .await;
    // --help is not an error.
    let out = expect(0, args(&["--help"])).await;
    assert!(stdout(&out).contains("inspect"));
}

// ---------------------------------------------------------------------------
// `idem delete` without --force.

/// A key of a fresh scope whose lease is over (by the store's clock), its
/// row locked by a transaction (`FOR UPDATE`) that the caller rolls back:
/// whatever writes the row next queues behind it, in order, so a test can
/// pin the interleaving of two writers without a mock.
async fn stuck_row_held(
    store: &PgStore,
    tag: &str,
) -> (
    String,
    IdempotencyKey,
    Lease,
    sqlx::PgPool,
    sqlx::Transaction<'static, sqlx::Postgres>,
    i32,
) {
    let scope = unique(tag);
    let k = key(&scope, "k");
    let stuck = acquire(store, &k, Duration::from_millis(50)).await;
    let clock = || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) };
    until_past(stuck.expires_at, clock).await;

    let pool = support::pg::pool(support::pg::shared_url(), 2).await;
    let mut holder = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *holder)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("SELECT 1 FROM idem_records WHERE scope = $1 AND key = 'k' FOR UPDATE")
        .bind(&scope)
        .execute(&mut *holder)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (scope, k, stuck, pool, holder, holder_pid)
}

/// The backend waiting on a lock that backend `blocker` holds (or is
/// queued ahead for), once there is one.
async fn waiter_on(pool: &sqlx::PgPool, blocker: i32) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiter: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
        )
        .bind(blocker)
        .fetch_optional(pool)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        if let Some(pid) = waiter {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "nobody waits on backend {blocker}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `idem delete` without `--force` is meant to refuse a key whose lease is
/// live ("its handler may still be running, and a delete lets a duplicate
/// run it again"). But it checks with one statement (`get_with_time`) and
/// deletes with another (`DELETE ... WHERE scope AND key`, whatever the
/// state): a client retry that takes a stuck key over between the two has
/// its live lease deleted, and the next duplicate runs the handler a
/// second time while the first still runs.
///
/// The window is pinned, not widened by a mock: a transaction holds the
/// stuck row for a moment (as any concurrent writer may), the takeover
/// queues on the row first, the CLI's check runs (the lease is over: no
/// --force needed, as `idem stuck` advises) and its DELETE queues second.
#[tokio::test(flavor = "multi_thread")]
async fn delete_without_force_never_deletes_a_lease_taken_over_after_its_check() {
    let store = pg_store().await;
    let (scope, k, _stuck, pool, holder, holder_pid) = stuck_row_held(&store, "race").await;

    // The client's retry takes the stuck key over (it waits on the row).
    let takeover = tokio::spawn({
        let (store, k) = (store.clone(), k.clone());
        async move {
            let fp = Fingerprint::of_bytes(k.id().as_bytes());
            store
                .acquire(&k, Some(&fp), Duration::from_secs(3_600))
                .await
        }
    });
    let takeover_pid = waiter_on(&pool, holder_pid).await;
    // The operator deletes the stuck key, without --force.
    let cli = tokio::spawn(idem(with(pg_args(), &["delete", &scope, "k", "--json"])));
    // Its DELETE queues behind the takeover.
    waiter_on(&pool, takeover_pid).await;
    holder.rollback().await.unwrap_or_else(|e| panic!("{e}"));

    let lease = match takeover.await.unwrap_or_else(|e| panic!("{e}")) {
        Ok(Acquisition::Acquired(lease)) => lease,
        other => panic!("the takeover: {other:?}"),
    };
    assert_eq!(lease.attempt, 2, "a takeover of the stuck key");
    let out = cli.await.unwrap_or_else(|e| panic!("{e}"));
    // The new holder's handler now runs, its lease live for an hour. A
    // duplicate must get "in progress", never the key.
    let fp = Fingerprint::of_bytes(k.id().as_bytes());
    let duplicate = store
        .acquire(&k, Some(&fp), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(duplicate, Acquisition::InProgress { .. }),
        "without --force, `idem delete` deleted a live lease (exit {:?}, {}): a duplicate got {duplicate:?}, \
         so the handler runs twice",
        out.status.code(),
        stdout(&out).trim()
    );
}

/// `idem` against a PostgreSQL URL that asks for TLS (`sslmode=require`):
/// this build has no TLS, so no retry can ever connect, yet the command
/// exits 3, "store unavailable ... (a retry may help)" (`connect_postgres`
/// maps every error but `Configuration`/`Database` to `Unavailable`). An
/// operator script that retries on 3 loops for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_url_that_requires_tls_is_not_called_retryable() {
    let base = support::pg::shared_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}sslmode=require");
    let out = idem(args(&[
        "--backend",
        "postgres",
        "--postgres-url",
        &url,
        "stats",
        "--json",
    ]))
    .await;
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_ne!(
        out.status.code(),
        Some(3),
        "exit 3 (retry may help) for a permanent configuration error: {doc}\n{}",
        stderr(&out)
    );
    assert_eq!(doc["retry_may_help"], false, "{doc}");
}

// ---------------------------------------------------------------------------
// `idem delete` compares lease tokens, and an extend keeps its token.

/// `idem delete` without `--force` refuses a live lease ("its handler may
/// still be running"), and since the fix it deletes only the record it
/// checked, by its lease token. But the token names the acquisition, not
/// the lease's state: a holder whose lease ran out (a late heartbeat) may
/// still extend it (DESIGN §2: a passed deadline only allows a takeover),
/// and that keeps its token. An extend that lands between the CLI's check
/// (lease over: no --force needed) and its `delete_if_token` makes the
/// lease live again, and the CLI deletes it: the next duplicate acquires
/// the key while the first handler still runs.
///
/// Pinned as the takeover test above: a transaction holds the row, the
/// holder's extend queues on it first, the CLI's DELETE second.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_delete_without_force_never_deletes_a_lease_extended_after_its_check() {
    let store = pg_store().await;
    let (scope, k, stuck, pool, holder, holder_pid) = stuck_row_held(&store, "race2").await;

    // The running handler's heartbeat, late, renews its lease (it waits on the row).
    let heartbeat = tokio::spawn({
        let (store, stuck) = (store.clone(), stuck.clone());
        async move { store.extend(&stuck, Duration::from_secs(3_600)).await }
    });
    let extend_pid = waiter_on(&pool, holder_pid).await;
    // The operator deletes the stuck key, without --force.
    let cli = tokio::spawn(idem(with(pg_args(), &["delete", &scope, "k", "--json"])));
    waiter_on(&pool, extend_pid).await;
    holder.rollback().await.unwrap_or_else(|e| panic!("{e}"));

    let renewed = heartbeat
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("the holder's extend: {e}"));
    assert_eq!(renewed.token, stuck.token);
    let out = cli.await.unwrap_or_else(|e| panic!("{e}"));
    let fp = Fingerprint::of_bytes(k.id().as_bytes());
    let duplicate = store
        .acquire(&k, Some(&fp), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(duplicate, Acquisition::InProgress { .. }),
        "without --force, `idem delete` deleted a lease its holder had just renewed for an hour \
         (exit {:?}, {}): a duplicate got {duplicate:?}, so the handler runs twice",
        out.status.code(),
        stdout(&out).trim()
    );
}

/// Clients of the Redis server at `url` held by `CLIENT PAUSE` (flag `b`)
/// whose command is `cmd`, once there are `n` of them.
async fn paused_clients(conn: &mut redis::aio::MultiplexedConnection, cmd: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let held = list
            .lines()
            .filter(|l| {
                l.split(' ')
                    .any(|f| f.starts_with("flags=") && f.contains('b'))
                    && l.split(' ').any(|f| f == format!("cmd={cmd}"))
            })
            .count();
        if held >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{held} paused {cmd} clients, not {n}:\n{list}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The same on Redis: the window between the CLI's check (`GET` + `TIME`)
/// and its `delete_if_token` script is pinned with `CLIENT PAUSE WRITE`
/// (reads go on, scripts are held and then run in arrival order): the
/// holder's extend arrives first, the CLI's delete second.
#[tokio::test(flavor = "multi_thread")]
async fn redis_delete_without_force_never_deletes_a_lease_extended_after_its_check() {
    let prefix = format!("{}:", unique("race2"));
    let store = redis_store(&prefix).await;
    let k = key("orders", "k");
    let first = acquire(&store, &k, Duration::from_secs(60)).await;
    // Both scripts known to the server, so neither is reloaded after the pause.
    let stuck = store
        .extend(&first, Duration::from_millis(50))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut admin = redis_conn().await;
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(include_str!(
            "../../../idem-redis/scripts/delete_if_token.lua"
        ))
        .query_async(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let clock = || async { store.server_time().await.unwrap_or_else(|e| panic!("{e}")) };
    until_past(stuck.expires_at, clock).await;

    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(30_000)
        .arg("WRITE")
        .query_async(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let heartbeat = tokio::spawn({
        let (store, stuck) = (store.clone(), stuck.clone());
        async move { store.extend(&stuck, Duration::from_secs(3_600)).await }
    });
    paused_clients(&mut admin, "evalsha", 1).await;
    let cli = tokio::spawn(idem(with(
        redis_args(&prefix),
        &["delete", "orders", "k", "--json"],
    )));
    paused_clients(&mut admin, "evalsha", 2).await;
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let renewed = heartbeat
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("the holder's extend: {e}"));
    assert_eq!(renewed.token, stuck.token);
    let out = cli.await.unwrap_or_else(|e| panic!("{e}"));
    let fp = Fingerprint::of_bytes(k.id().as_bytes());
    let duplicate = store
        .acquire(&k, Some(&fp), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(duplicate, Acquisition::InProgress { .. }),
        "without --force, `idem delete` deleted a lease its holder had just renewed for an hour \
         (exit {:?}, {}): a duplicate got {duplicate:?}, so the handler runs twice",
        out.status.code(),
        stdout(&out).trim()
    );
}
