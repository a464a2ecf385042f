//! The stores the command works on, and each subcommand on each of them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use futures::future::join_all;
use idem_core::{IdempotencyKey, IdempotencyStore, Record, RecordState, StoreError};
use idem_postgres::PgStore;
use idem_redis::redis;
use idem_redis::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use idem_redis::redis::cluster_async::ClusterConnection;
use idem_redis::RedisStore;
use idem_tiered::{CacheError, RecordCache, RedisCache, RedisInvalidation, TieredStore};
use serde_json::{json, Value};

use crate::render::{self, escape, millis_between, signed, timestamp};
use crate::{Backend, Failure, StoreArgs};

/// The stores, connected.
pub(crate) struct Stores {
    kind: Kind,
    timeout: Duration,
    /// The Redis backend: its URL and the invalidation channel, on which a
    /// delete is published for the in-process (moka) tiers of proxies and
    /// applications over that Redis.
    channel: Option<(String, String)>,
}

/// How many Redis key names a "not found" reads to find the scopes
/// holding its id (`idem stuck` and `idem stats` read as many by default).
const REDIS_SCAN_MAX: usize = 1_000_000;

enum Kind {
    Postgres(PgStore),
    Redis(RedisStore<ConnectionManager>),
    Cluster(RedisStore<ClusterConnection>),
    Tiered(Box<Tiered>),
}

/// The tiered store as an operator sees it: the source of truth, the
/// Redis cache tier, and the invalidation channel.
struct Tiered {
    source: PgStore,
    cache_prefix: String,
    cache: Cache,
    channel: RedisInvalidation,
}

/// The Redis cache tier, and a store on the same connection to walk its
/// keys with.
enum Cache {
    Redis(RedisCache<ConnectionManager>, RedisStore<ConnectionManager>),
    Cluster(RedisCache<ClusterConnection>, RedisStore<ClusterConnection>),
}

fn redis_failure(e: redis::RedisError, what: &str) -> Failure {
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_cluster_error()
    {
        Failure::Unavailable(format!("{what}: {e}"))
    } else {
        Failure::Other(format!("{what}: {e} (a retry will not help as is)"))
    }
}

fn cache_failure(e: CacheError) -> Failure {
    match e {
        CacheError::Unavailable(e) => Failure::Unavailable(format!("Redis cache tier: {e}")),
        other => Failure::Other(format!("Redis cache tier: {other}")),
    }
}

async fn connect_postgres(args: &StoreArgs, timeout: Duration) -> Result<PgStore, Failure> {
    let Some(url) = &args.postgres_url else {
        return Err(Failure::Usage(
            "this backend needs --postgres-url (or IDEM_POSTGRES_URL)".into(),
        ));
    };
    // idem_postgres::connect fails at once with the cause (refused,
    // authentication, unknown database, TLS), retryable or not, rather than
    // after the pool's acquire timeout.
    let options = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(timeout);
    let pool = idem_postgres::connect_with(options, url)
        .await
        .map_err(|e| match e {
            StoreError::InvalidArgument { detail } => {
                Failure::Usage(format!("invalid --postgres-url: {detail}"))
            }
            StoreError::Unavailable(e) => Failure::Unavailable(e.to_string()),
            other => Failure::Other(format!("{other} (a retry will not help as is)")),
        })?;
    PgStore::builder(pool)
        .schema(args.schema.clone())
        .table(args.table.clone())
        .call_timeout(timeout)
        .connections(2)
        .build()
        .map_err(|e| Failure::Usage(e.to_string()))
}

async fn connection_manager(url: &str, timeout: Duration) -> Result<ConnectionManager, Failure> {
    let client =
        redis::Client::open(url).map_err(|e| Failure::Usage(format!("invalid Redis URL: {e}")))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(None)
        .set_number_of_retries(1);
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| redis_failure(e, "cannot connect to Redis"))
}

async fn cluster_connection(
    urls: &[String],
    timeout: Duration,
) -> Result<ClusterConnection, Failure> {
    let client = redis::cluster::ClusterClient::builder(urls.to_vec())
        .connection_timeout(timeout)
        .retries(2)
        .build()
        .map_err(|e| Failure::Usage(format!("invalid Redis Cluster URLs: {e}")))?;
    client
        .get_async_connection()
        .await
        .map_err(|e| redis_failure(e, "cannot connect to the Redis Cluster"))
}

impl Stores {
    /// Publishes a delete on the Redis backend's invalidation channel:
    /// every in-process tier subscribed to it (a proxy's `--cache moka`)
    /// drops the key and refuses every record of it until its tombstone
    /// ends.
    async fn publish_delete(&self, key: &IdempotencyKey) -> Result<(), Failure> {
        use idem_tiered::InvalidationChannel as _;
        let Some((url, channel)) = &self.channel else {
            return Ok(());
        };
        let unpublished = |e: CacheError| {
            Failure::Unavailable(format!(
                "{e}: the record is deleted, but the delete could not be published on {channel}: \
                 an in-process tier may still replay the key; run the delete again"
            ))
        };
        let publisher = tokio::time::timeout(self.timeout, async {
            let publisher = RedisInvalidation::connect(url)
                .await?
                .channel(channel.clone());
            publisher.publish(key, u64::MAX).await
        })
        .await;
        match publisher {
            Ok(result) => result.map_err(unpublished),
            Err(_) => Err(unpublished(CacheError::Unavailable(
                "the invalidation channel did not answer in time".into(),
            ))),
        }
    }

    /// Picks the backend (explicit, or the only store configured) and
    /// connects to it.
    pub(crate) async fn connect(args: &StoreArgs, timeout: Duration) -> Result<Self, Failure> {
        let backend = match args.backend {
            Some(backend) => backend,
            None => {
                let set: Vec<Backend> = [
                    (args.postgres_url.is_some(), Backend::Postgres),
                    (args.redis_url.is_some(), Backend::Redis),
                    (!args.redis_cluster_urls.is_empty(), Backend::RedisCluster),
                ]
                .into_iter()
                .filter_map(|(set, b)| set.then_some(b))
                .collect();
                match set.as_slice() {
                    [one] => *one,
                    [] => return Err(Failure::Usage(
                        "no store given: set --postgres-url, --redis-url or --redis-cluster-urls \
                             (or IDEM_POSTGRES_URL, IDEM_REDIS_URL, IDEM_REDIS_CLUSTER_URLS)"
                            .into(),
                    )),
                    _ => {
                        return Err(Failure::Usage(
                            "several stores are configured: choose one with --backend \
                             postgres|redis|redis-cluster|tiered (or IDEM_BACKEND)"
                                .into(),
                        ))
                    }
                }
            }
        };
        let kind = match backend {
            Backend::Postgres => Kind::Postgres(connect_postgres(args, timeout).await?),
            Backend::Redis => {
                let url = args.redis_url.as_deref().ok_or_else(|| {
                    Failure::Usage("the redis backend needs --redis-url (or IDEM_REDIS_URL)".into())
                })?;
                let conn = connection_manager(url, timeout).await?;
                Kind::Redis(
                    RedisStore::new(conn)
                        .prefix(args.prefix.clone())
                        .call_timeout(timeout),
                )
            }
            Backend::RedisCluster => {
                if args.redis_cluster_urls.is_empty() {
                    return Err(Failure::Usage(
                        "the redis-cluster backend needs --redis-cluster-urls (or IDEM_REDIS_CLUSTER_URLS)"
                            .into(),
                    ));
                }
                let conn = cluster_connection(&args.redis_cluster_urls, timeout).await?;
                Kind::Cluster(
                    RedisStore::new(conn)
                        .prefix(args.prefix.clone())
                        .call_timeout(timeout),
                )
            }
            Backend::Tiered => {
                let source = connect_postgres(args, timeout).await?;
                let (cache, channel_url) = match (&args.redis_url, args.redis_cluster_urls.first()) {
                    (Some(url), _) => {
                        let conn = connection_manager(url, timeout).await?;
                        let scan = RedisStore::new(conn.clone()).call_timeout(timeout);
                        let tier = RedisCache::new(conn).prefix(args.cache_prefix.clone());
                        (Cache::Redis(tier, scan), url.clone())
                    }
                    (None, Some(first)) => {
                        let conn = cluster_connection(&args.redis_cluster_urls, timeout).await?;
                        let scan = RedisStore::new(conn.clone()).call_timeout(timeout);
                        let tier = RedisCache::new(conn).prefix(args.cache_prefix.clone());
                        (Cache::Cluster(tier, scan), first.clone())
                    }
                    (None, None) => {
                        return Err(Failure::Usage(
                            "the tiered backend needs its cache tier's --redis-url or --redis-cluster-urls"
                                .into(),
                        ))
                    }
                };
                let channel = RedisInvalidation::connect(&channel_url)
                    .await
                    .map_err(cache_failure)?
                    .channel(args.channel.clone());
                Kind::Tiered(Box::new(Tiered {
                    source,
                    cache_prefix: args.cache_prefix.clone(),
                    cache,
                    channel,
                }))
            }
        };
        let channel = match (&kind, &args.redis_url) {
            (Kind::Redis(_), Some(url)) => Some((url.clone(), args.channel.clone())),
            _ => None,
        };
        Ok(Stores {
            kind,
            timeout,
            channel,
        })
    }

    fn backend_name(&self) -> &'static str {
        match self.kind {
            Kind::Postgres(_) => "postgres",
            Kind::Redis(_) => "redis",
            Kind::Cluster(_) => "redis-cluster",
            Kind::Tiered(_) => "tiered",
        }
    }

    /// The record (from the source of truth) and the store's clock.
    async fn record(
        &self,
        key: &IdempotencyKey,
    ) -> Result<(Option<Record>, SystemTime), StoreError> {
        match &self.kind {
            Kind::Postgres(s) => s.get_with_time(key).await,
            Kind::Redis(s) => s.get_with_time(key).await,
            Kind::Cluster(s) => s.get_with_time(key).await,
            Kind::Tiered(t) => t.source.get_with_time(key).await,
        }
    }

    /// Where the record lives, for the operator's eye.
    fn location(&self, key: &IdempotencyKey) -> String {
        match &self.kind {
            Kind::Postgres(s) => format!("{} row", s.qualified_table()),
            Kind::Redis(s) => format!("Redis key {}", s.redis_key(key)),
            Kind::Cluster(s) => format!("Redis Cluster key {}", s.redis_key(key)),
            Kind::Tiered(t) => format!("source {} row", t.source.qualified_table()),
        }
    }

    /// Where else a key's id has records, for a "not found": the scopes
    /// that hold one (a key looked for in the wrong scope, say the HTTP
    /// layer's default `http` when the app set its own), or that none
    /// does. Empty if the store cannot tell.
    async fn elsewhere(&self, key: &IdempotencyKey) -> String {
        const LISTED: usize = 20;
        let found = match &self.kind {
            Kind::Postgres(s) => s.scopes_holding(key.id(), LISTED).await.map(|s| (s, true)),
            Kind::Tiered(t) => t
                .source
                .scopes_holding(key.id(), LISTED)
                .await
                .map(|s| (s, true)),
            Kind::Redis(s) => s.scopes_holding(key.id(), REDIS_SCAN_MAX).await,
            Kind::Cluster(s) => s.scopes_holding(key.id(), REDIS_SCAN_MAX).await,
        };
        let Ok((scopes, complete)) = found else {
            return String::new();
        };
        let others: Vec<String> = scopes
            .into_iter()
            .filter(|s| s != key.scope())
            .take(LISTED)
            .map(|s| escape(&s))
            .collect();
        match (others.is_empty(), complete) {
            (true, true) => "; no other scope holds a record for this id".to_owned(),
            (true, false) => String::new(),
            (false, _) => format!(
                "; this id has records in scope {} (inspect it there: `idem inspect {} ID`, or `--scope {}` with --http-key)",
                others.join(", "),
                others[0],
                others[0]
            ),
        }
    }

    /// `idem inspect`.
    pub(crate) async fn inspect(
        &self,
        key: &IdempotencyKey,
        json: bool,
    ) -> Result<String, Failure> {
        let (record, now) = self.record(key).await?;
        let cache = match &self.kind {
            Kind::Tiered(t) => Some(t.cache.entry(key).await?),
            _ => None,
        };
        let in_cache = cache.as_ref().is_some_and(|c| c.present);
        if record.is_none() && !in_cache {
            return Err(Failure::NotFound(format!(
                "{} has no record{}{}",
                escape(&key.to_string()),
                if cache.is_some() { " in any tier" } else { "" },
                self.elsewhere(key).await
            )));
        }
        let mut doc = json!({
            "backend": self.backend_name(),
            "key": { "scope": key.scope(), "id": key.id() },
            "location": self.location(key),
            "store_time": timestamp(now),
            "found": record.is_some(),
        });
        let mut text = String::new();
        let _ = writeln!(
            text,
            "key          {} {}",
            escape(key.scope()),
            escape(key.id())
        );
        let _ = writeln!(text, "where        {}", escape(&self.location(key)));
        let _ = writeln!(text, "store clock  {}", timestamp(now));
        match &record {
            Some(record) => describe(record, now, &mut doc, &mut text),
            None => {
                let _ = writeln!(
                    text,
                    "state        absent (no live record in the source of truth)"
                );
            }
        }
        if let Some(cache) = cache {
            doc["cache"] = cache.json;
            text.push_str(&cache.text);
            let _ = writeln!(
                text,
                "in-process   moka tiers live in the applications: `idem delete` reaches them through the invalidation channel"
            );
        }
        Ok(if json { pretty(&doc) } else { text })
    }

    /// `idem delete`.
    pub(crate) async fn delete(
        &self,
        key: &IdempotencyKey,
        force: bool,
        json: bool,
    ) -> Result<String, Failure> {
        // What to delete: the record that was checked, by its lease token,
        // so that a takeover between the check and the delete (the lease
        // was over, a duplicate took the key and runs its handler) is left
        // alone; everything only with --force, or for a record that does
        // not decode (no token to compare; nothing can acquire it either).
        let (was, token) = match self.record(key).await {
            Ok((Some(record), now)) => {
                if let RecordState::InProgress { lease_expires_at } = record.state {
                    let left = millis_between(now, lease_expires_at);
                    if left > 0 && !force {
                        return Err(Failure::Other(format!(
                            "{} is in progress (attempt {}, lease left {} by the store's clock): its \
                             handler may still be running, and a delete lets a duplicate run it again. \
                             Wait until the lease is over (`idem stuck` then lists the key; a retry \
                             then helps), or pass --force",
                            escape(&key.to_string()),
                            record.attempt,
                            signed(left)
                        )));
                    }
                }
                let token = (!force).then_some(record.token);
                (Some(state_name(&record, now)), token)
            }
            Ok((None, _)) => (None, None),
            // A corrupt record is what a delete is for.
            Err(StoreError::Corrupt { .. }) => (Some("corrupt"), None),
            Err(e) => return Err(e.into()),
        };
        let changed = || {
            Failure::Other(format!(
                "{} changed after it was checked (a worker took it over, its holder renewed the lease, \
                 or it was deleted and acquired again): nothing deleted. Run the command again to \
                 check it anew",
                escape(&key.to_string())
            ))
        };
        // Nothing to delete when nothing was checked; the token checked, or
        // (--force, a corrupt record) whatever is there.
        macro_rules! checked_delete {
            ($store:expr) => {
                match (&was, &token) {
                    (None, _) => false,
                    (Some(_), Some(token)) => $store.delete_if_token(key, token).await?,
                    (Some(_), None) => $store.delete(key).await?,
                }
            };
        }
        let (deleted, tiers) = match &self.kind {
            Kind::Postgres(s) => (checked_delete!(s), vec!["postgres"]),
            Kind::Redis(s) => {
                let deleted = checked_delete!(s);
                if deleted {
                    self.publish_delete(key).await?;
                }
                (deleted, vec!["redis", "invalidation channel"])
            }
            Kind::Cluster(s) => (checked_delete!(s), vec!["redis-cluster"]),
            Kind::Tiered(t) => {
                let cached = t.cache.entry(key).await?.present;
                let deleted = checked_delete!(t.source);
                if was.is_some() && !deleted && token.is_some() {
                    return Err(changed());
                }
                let store = t.store(self.timeout);
                store
                    .invalidate_after_delete(key)
                    .await
                    .map_err(|e| match e {
                        StoreError::Unavailable(_) => Failure::Unavailable(format!(
                        "{e}; the source's record is deleted, but a tier may still replay the key: \
                         run the delete again"
                    )),
                        other => other.into(),
                    })?;
                (
                    deleted || cached,
                    vec!["postgres", "redis cache", "invalidation channel"],
                )
            }
        };
        if was.is_some() && !deleted && token.is_some() {
            return Err(changed());
        }
        let deleted = deleted || (was.is_some() && token.is_none());
        if !deleted {
            return Err(Failure::NotFound(format!(
                "{} has no record; nothing deleted",
                escape(&key.to_string())
            )));
        }
        Ok(if json {
            pretty(&json!({
                "deleted": true,
                "key": { "scope": key.scope(), "id": key.id() },
                "was": was.unwrap_or("absent"),
                "tiers": tiers,
            }))
        } else {
            format!(
                "deleted {} {} (was {}; {})",
                escape(key.scope()),
                escape(key.id()),
                was.unwrap_or("absent from the source"),
                tiers.join(", ")
            )
        })
    }

    /// `idem stuck`.
    pub(crate) async fn stuck(
        &self,
        limit: usize,
        scan_max: usize,
        json: bool,
    ) -> Result<String, Failure> {
        let mut listed: Vec<(String, String, Result<Record, String>)> = Vec::new();
        let (now, complete, scanned) = match &self.kind {
            Kind::Postgres(s) => pg_stuck(s, limit, &mut listed).await?,
            Kind::Tiered(t) => pg_stuck(&t.source, limit, &mut listed).await?,
            Kind::Redis(s) => redis_stuck(s, limit, scan_max, &mut listed).await?,
            Kind::Cluster(s) => redis_stuck(s, limit, scan_max, &mut listed).await?,
        };
        let mut stuck = Vec::new();
        let mut corrupt = Vec::new();
        let mut text = format!(
            "{:<24} {:<40} {:>7} {:>20} {:>10} {:>10}\n",
            "SCOPE", "ID", "ATTEMPT", "FENCE", "OVERDUE", "EXPIRES IN"
        );
        let mut bad = String::new();
        for (scope, id, record) in &listed {
            match record {
                Ok(record) => {
                    let lease = match record.state {
                        RecordState::InProgress { lease_expires_at } => lease_expires_at,
                        RecordState::Completed { .. } => continue,
                    };
                    let overdue = millis_between(lease, now);
                    let expires = millis_between(now, record.expires_at);
                    let _ = writeln!(
                        text,
                        "{:<24} {:<40} {:>7} {:>20} {:>10} {:>10}",
                        render::cell(scope, 24),
                        render::cell(id, 40),
                        record.attempt,
                        record.fence,
                        signed(overdue),
                        signed(expires)
                    );
                    stuck.push(json!({
                        "scope": scope, "id": id, "attempt": record.attempt, "fence": record.fence,
                        "lease_expires_at": timestamp(lease), "overdue_ms": overdue,
                        "expires_in_ms": expires,
                    }));
                }
                Err(detail) => {
                    let _ = writeln!(
                        bad,
                        "corrupt  {} {}: {}",
                        escape(scope),
                        escape(id),
                        escape(detail)
                    );
                    corrupt.push(json!({ "scope": scope, "id": id, "detail": detail }));
                }
            }
        }
        let _ = write!(
            text,
            "{bad}{} stuck, {} corrupt, by the store's clock {}{}",
            stuck.len(),
            corrupt.len(),
            timestamp(now),
            match (complete, scanned) {
                (true, Some(n)) => format!(" ({n} keys scanned)"),
                (false, Some(n)) =>
                    format!(" (stopped after {n} keys: raise --limit or --scan-max)"),
                (false, None) => " (stopped at --limit)".to_owned(),
                (true, None) => String::new(),
            }
        );
        Ok(if json {
            pretty(&json!({
                "backend": self.backend_name(), "store_time": timestamp(now),
                "complete": complete, "scanned": scanned, "stuck": stuck, "corrupt": corrupt,
            }))
        } else {
            text
        })
    }

    /// `idem purge`.
    pub(crate) async fn purge(&self, max: usize, json: bool) -> Result<String, Failure> {
        let (purged, note) = match &self.kind {
            Kind::Postgres(s) => (s.purge_expired(max).await?, ""),
            Kind::Tiered(t) => (
                t.source.purge_expired(max).await?,
                " (the cache tiers expire their own entries)",
            ),
            Kind::Redis(_) | Kind::Cluster(_) => (
                0,
                " (Redis expires records itself, at their retention: nothing to purge)",
            ),
        };
        Ok(if json {
            pretty(&json!({ "backend": self.backend_name(), "purged": purged }))
        } else {
            format!("purged {purged} expired records{note}")
        })
    }

    /// `idem migrate`.
    pub(crate) async fn migrate(&self, json: bool) -> Result<String, Failure> {
        let store =
            match &self.kind {
                Kind::Postgres(s) => s,
                Kind::Tiered(t) => &t.source,
                Kind::Redis(_) | Kind::Cluster(_) => return Err(Failure::Usage(
                    "migrate is for PostgreSQL (--backend postgres or tiered); Redis needs none"
                        .into(),
                )),
            };
        store.migrate().await?;
        let versions: Vec<i32> = store.migrations().into_iter().map(|(v, _)| v).collect();
        Ok(if json {
            pretty(&json!({ "table": store.qualified_table(), "migrations": versions }))
        } else {
            format!(
                "{} is up to date (migrations {versions:?} applied)",
                store.qualified_table()
            )
        })
    }

    /// `idem stats`.
    pub(crate) async fn stats(&self, scan_max: usize, json: bool) -> Result<String, Failure> {
        let header = format!(
            "{:<32} {:>11} {:>8} {:>10} {:>8} {:>8}\n",
            "SCOPE", "IN PROGRESS", "STUCK", "COMPLETED", "EXPIRED", "CORRUPT"
        );
        let mut text = header.clone();
        let mut doc = json!({ "backend": self.backend_name() });
        match &self.kind {
            Kind::Postgres(s) => pg_stats(s, &mut doc, &mut text).await?,
            Kind::Redis(s) => redis_stats(s, scan_max, &mut doc, &mut text).await?,
            Kind::Cluster(s) => redis_stats(s, scan_max, &mut doc, &mut text).await?,
            Kind::Tiered(t) => {
                let mut source = json!({});
                pg_stats(&t.source, &mut source, &mut text).await?;
                doc["source"] = source;
                let (json_cache, text_cache) = t.cache.stats(&t.cache_prefix, scan_max).await?;
                doc["cache"] = json_cache;
                text.push_str(&text_cache);
            }
        }
        Ok(if json { pretty(&doc) } else { text })
    }
}

fn pretty(doc: &Value) -> String {
    serde_json::to_string_pretty(doc).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

fn state_name(record: &Record, now: SystemTime) -> &'static str {
    match record.state {
        RecordState::Completed { .. } => "completed",
        RecordState::InProgress { lease_expires_at } if lease_expires_at <= now => "stuck",
        RecordState::InProgress { .. } => "in_progress",
    }
}

/// A record's fields, into `doc` and `text`; every time relative to `now`,
/// the store's clock.
fn describe(record: &Record, now: SystemTime, doc: &mut Value, text: &mut String) {
    let state = state_name(record, now);
    let expires_in = millis_between(now, record.expires_at);
    doc["state"] = json!(state);
    doc["attempt"] = json!(record.attempt);
    doc["fence"] = json!(record.fence);
    doc["token"] = json!(record.token.to_hex());
    doc["fingerprint"] = json!(record.fingerprint.map(|f| to_hex(f.as_bytes())));
    doc["created_at"] = json!(timestamp(record.created_at));
    doc["expires_at"] = json!(timestamp(record.expires_at));
    doc["expires_in_ms"] = json!(expires_in);
    match &record.state {
        RecordState::InProgress { lease_expires_at } => {
            let left = millis_between(now, *lease_expires_at);
            doc["lease_expires_at"] = json!(timestamp(*lease_expires_at));
            doc["lease_left_ms"] = json!(left);
            let _ = writeln!(
                text,
                "state        {}",
                if left > 0 {
                    "in progress".to_owned()
                } else {
                    format!(
                        "stuck: in progress, lease over {} ago (a duplicate would take it over)",
                        signed(left)
                    )
                }
            );
            let _ = writeln!(
                text,
                "lease left   {}",
                if left > 0 {
                    signed(left)
                } else {
                    "none".to_owned()
                }
            );
        }
        RecordState::Completed {
            response,
            completed_at,
        } => {
            doc["completed_at"] = json!(timestamp(*completed_at));
            doc["response_bytes"] = json!(response.len());
            doc["preview"] = json!(render::preview(response));
            let not_replayable = idem_core::not_replayable_reason(response);
            doc["not_replayable"] = json!(not_replayable);
            let _ = writeln!(
                text,
                "state        completed at {}",
                timestamp(*completed_at)
            );
            match not_replayable {
                Some(reason) => {
                    let _ = writeln!(
                        text,
                        "response     not replayable: {}",
                        render::cell(&reason, render::PREVIEW_BYTES)
                    );
                }
                None => {
                    let _ = writeln!(text, "response     {} bytes", response.len());
                    let _ = writeln!(
                        text,
                        "preview      \"{}\"{}",
                        render::preview(response),
                        if response.len() > render::PREVIEW_BYTES {
                            format!(" (first {} bytes)", render::PREVIEW_BYTES)
                        } else {
                            String::new()
                        }
                    );
                }
            }
        }
    }
    let _ = writeln!(text, "attempt      {}", record.attempt);
    let _ = writeln!(text, "fence        {}", record.fence);
    let _ = writeln!(text, "token        {}", record.token.to_hex());
    let _ = writeln!(
        text,
        "fingerprint  {}",
        record
            .fingerprint
            .map(|f| to_hex(f.as_bytes()))
            .unwrap_or_else(|| "none".into())
    );
    let _ = writeln!(
        text,
        "created      {} ({} ago)",
        timestamp(record.created_at),
        signed(millis_between(record.created_at, now))
    );
    let _ = writeln!(
        text,
        "expires in   {} ({})",
        signed(expires_in),
        timestamp(record.expires_at)
    );
}

fn to_hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

type Listed = Vec<(String, String, Result<Record, String>)>;

async fn pg_stuck(
    store: &PgStore,
    limit: usize,
    out: &mut Listed,
) -> Result<(SystemTime, bool, Option<u64>), Failure> {
    let rows = store.stuck(limit).await?;
    let complete = rows.records.len() < limit;
    for row in rows.records {
        out.push((row.scope, row.id, row.record));
    }
    Ok((rows.now, complete, None))
}

async fn redis_stuck<C>(
    store: &RedisStore<C>,
    limit: usize,
    scan_max: usize,
    out: &mut Listed,
) -> Result<(SystemTime, bool, Option<u64>), Failure>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let scan = store.stuck(limit, scan_max).await?;
    for found in scan.records {
        match found.record {
            Ok(record) => out.push((
                record.key.scope().to_owned(),
                record.key.id().to_owned(),
                Ok(record),
            )),
            Err(detail) => out.push((found.redis_key, String::new(), Err(detail))),
        }
    }
    Ok((scan.now, scan.complete, Some(scan.scanned)))
}

fn stats_row(text: &mut String, scope: &str, counts: [Option<u64>; 5]) {
    let cell = |n: Option<u64>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
    let _ = writeln!(
        text,
        "{:<32} {:>11} {:>8} {:>10} {:>8} {:>8}",
        render::cell(scope, 32),
        cell(counts[0]),
        cell(counts[1]),
        cell(counts[2]),
        cell(counts[3]),
        cell(counts[4])
    );
}

async fn pg_stats(store: &PgStore, doc: &mut Value, text: &mut String) -> Result<(), Failure> {
    let counts = store.counts().await?;
    let mut scopes = serde_json::Map::new();
    let mut total = [0u64; 5];
    for c in &counts {
        let row = [c.in_progress, c.stuck, c.completed, c.expired, c.corrupt];
        for (t, n) in total.iter_mut().zip(row) {
            *t += n;
        }
        stats_row(text, &c.scope, row.map(Some));
        scopes.insert(
            c.scope.clone(),
            json!({ "in_progress": c.in_progress, "stuck": c.stuck, "completed": c.completed,
                    "expired": c.expired, "corrupt": c.corrupt }),
        );
    }
    stats_row(text, "(all scopes)", total.map(Some));
    let _ = writeln!(text, "table {}", store.qualified_table());
    doc["table"] = json!(store.qualified_table());
    doc["scopes"] = Value::Object(scopes);
    Ok(())
}

async fn redis_stats<C>(
    store: &RedisStore<C>,
    scan_max: usize,
    doc: &mut Value,
    text: &mut String,
) -> Result<(), Failure>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let scan = store.counts(scan_max).await?;
    let mut scopes = serde_json::Map::new();
    let mut total = [0u64; 4];
    for (scope, c) in &scan.by_scope {
        let row = [c.in_progress, c.stuck, c.completed, c.corrupt];
        for (t, n) in total.iter_mut().zip(row) {
            *t += n;
        }
        stats_row(
            text,
            scope,
            [Some(row[0]), Some(row[1]), Some(row[2]), None, Some(row[3])],
        );
        scopes.insert(
            scope.clone(),
            json!({ "in_progress": c.in_progress, "stuck": c.stuck, "completed": c.completed,
                    "corrupt": c.corrupt }),
        );
    }
    stats_row(
        text,
        "(all scopes)",
        [
            Some(total[0]),
            Some(total[1]),
            Some(total[2]),
            None,
            Some(total[3]),
        ],
    );
    for (key, detail) in &scan.corrupt {
        let _ = writeln!(text, "corrupt  {}: {}", escape(key), escape(detail));
    }
    let _ = writeln!(
        text,
        "{} keys scanned{} (Redis expires records itself: no expired column)",
        scan.scanned,
        if scan.complete {
            ""
        } else {
            ", stopped at --scan-max: counts are a lower bound"
        }
    );
    doc["scanned"] = json!(scan.scanned);
    doc["complete"] = json!(scan.complete);
    doc["scopes"] = Value::Object(scopes);
    doc["corrupt"] = json!(scan
        .corrupt
        .iter()
        .map(|(key, detail)| json!({ "redis_key": key, "detail": detail }))
        .collect::<Vec<_>>());
    Ok(())
}

/// A cache tier's entry for a key, as `inspect` shows it.
struct CacheEntry {
    present: bool,
    json: Value,
    text: String,
}

impl Tiered {
    /// The tiered store over the same tiers, with the invalidation channel,
    /// as the applications build it (minus their in-process tiers).
    fn store(&self, timeout: Duration) -> TieredStore<PgStore> {
        let store = TieredStore::new(self.source.clone());
        let store = match &self.cache {
            Cache::Redis(tier, _) => store.with_cache(tier.clone()),
            Cache::Cluster(tier, _) => store.with_cache(tier.clone()),
        };
        store
            .with_invalidation(self.channel.clone())
            .cache_timeout(timeout)
    }
}

impl Cache {
    async fn get(
        &self,
        key: &IdempotencyKey,
    ) -> Result<Option<idem_core::CompletedRecord>, CacheError> {
        match self {
            Cache::Redis(tier, _) => tier.get(key).await,
            Cache::Cluster(tier, _) => tier.get(key).await,
        }
    }

    fn redis_key(&self, key: &IdempotencyKey) -> String {
        match self {
            Cache::Redis(tier, _) => tier.redis_key(key),
            Cache::Cluster(tier, _) => tier.redis_key(key),
        }
    }

    /// The entry of `key` in the Redis cache tier.
    async fn entry(&self, key: &IdempotencyKey) -> Result<CacheEntry, Failure> {
        let redis_key = self.redis_key(key);
        let mut text = String::new();
        let (present, json) = match self.get(key).await {
            Ok(Some(entry)) => {
                let _ = writeln!(
                    text,
                    "cache tier   redis {}: completed, fence {}, attempt {}, {} bytes, time to live {} (Redis's clock)",
                    escape(&redis_key),
                    entry.fence,
                    entry.attempt,
                    entry.response.len(),
                    render::duration(entry.ttl)
                );
                (
                    true,
                    json!({
                        "tier": "redis", "redis_key": redis_key, "entry": "completed",
                        "fence": entry.fence, "attempt": entry.attempt,
                        "response_bytes": entry.response.len(),
                        "preview": render::preview(&entry.response),
                        "ttl_ms": u64::try_from(entry.ttl.as_millis()).unwrap_or(u64::MAX),
                    }),
                )
            }
            Ok(None) => {
                let _ = writeln!(
                    text,
                    "cache tier   redis {}: no entry (or a delete's tombstone)",
                    escape(&redis_key)
                );
                (
                    false,
                    json!({ "tier": "redis", "redis_key": redis_key, "entry": "none" }),
                )
            }
            Err(CacheError::Undecodable(detail)) => {
                let _ = writeln!(
                    text,
                    "cache tier   redis {}: undecodable ({}); the store treats it as a miss",
                    escape(&redis_key),
                    escape(&detail)
                );
                (
                    true,
                    json!({ "tier": "redis", "redis_key": redis_key, "entry": "undecodable", "detail": detail }),
                )
            }
            Err(e) => return Err(cache_failure(e)),
        };
        Ok(CacheEntry {
            present,
            json,
            text,
        })
    }

    /// Counts the cache tier's entries by scope: completed records, and
    /// the rest (tombstones, entries gone since the scan) and undecodable
    /// entries.
    async fn stats(&self, prefix: &str, scan_max: usize) -> Result<(Value, String), Failure> {
        let (names, complete) = match self {
            Cache::Redis(_, scan) => scan.scan_keys(prefix, scan_max).await?,
            Cache::Cluster(_, scan) => scan.scan_keys(prefix, scan_max).await?,
        };
        let mut by_scope: BTreeMap<String, [u64; 3]> = BTreeMap::new();
        for chunk in names.chunks(200) {
            let reads = chunk.iter().map(|name| async move {
                let rest = name.strip_prefix(prefix.as_bytes()).unwrap_or(name);
                let parsed = std::str::from_utf8(rest)
                    .ok()
                    .and_then(|t| t.split_once('/'))
                    .and_then(|(s, i)| IdempotencyKey::new(s, i).ok());
                match parsed {
                    Some(key) => (key.scope().to_owned(), Some(self.get(&key).await)),
                    None => (String::new(), None),
                }
            });
            for (scope, got) in join_all(reads).await {
                let slot = by_scope.entry(scope).or_default();
                match got {
                    Some(Ok(Some(_))) => slot[0] += 1,
                    Some(Ok(None)) => slot[1] += 1,
                    Some(Err(CacheError::Undecodable(_))) | None => slot[2] += 1,
                    Some(Err(e)) => return Err(cache_failure(e)),
                }
            }
        }
        let mut text = format!(
            "cache tier (redis, prefix {}): {} keys scanned{}\n{:<32} {:>11} {:>10} {:>11}\n",
            escape(prefix),
            names.len(),
            if complete {
                ""
            } else {
                ", stopped at --scan-max"
            },
            "SCOPE",
            "COMPLETED",
            "TOMBSTONE",
            "UNDECODABLE"
        );
        let mut scopes = serde_json::Map::new();
        for (scope, [completed, other, bad]) in &by_scope {
            let _ = writeln!(
                text,
                "{:<32} {:>11} {:>10} {:>11}",
                render::cell(scope, 32),
                completed,
                other,
                bad
            );
            scopes.insert(
                scope.clone(),
                json!({ "completed": completed, "tombstone_or_gone": other, "undecodable": bad }),
            );
        }
        Ok((
            json!({ "tier": "redis", "prefix": prefix, "scanned": names.len(),
                    "complete": complete, "scopes": scopes }),
            text,
        ))
    }
}
