//! Operator reads: the server's clock, and scans of the records (keys in
//! progress past their lease, counts by scope and state). They are for
//! tools such as the `idem` command, never on a request's path: a scan
//! walks the key space with `SCAN` (on every primary of a cluster),
//! bounded by a number of keys, and reads each record with one `GET`.

use std::any::Any;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::future::join_all;
use idem_core::{IdempotencyKey, LeaseToken, Record, RecordState, StoreError};
use redis::aio::ConnectionLike;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::Value;

use crate::decode::decode_record;
use crate::error::{corrupt, is_wrong_type, unexpected};
use crate::store::RedisStore;

/// How many keys a `SCAN` call is asked for, and how many records are
/// read at once.
const PAGE: usize = 500;

/// A record found by a scan.
#[derive(Debug)]
#[non_exhaustive]
pub struct ScannedRecord {
    /// Its Redis key (lossy UTF-8 if it is not UTF-8).
    pub redis_key: String,
    /// The record, or why it does not decode (a key name that is not
    /// `{prefix}{scope}/{id}`, a value that is not a record): a corrupt
    /// record is reported with its key, never skipped.
    pub record: Result<Record, String>,
}

/// Keys in progress whose lease deadline has passed, by the server's clock.
#[derive(Debug)]
#[non_exhaustive]
pub struct StuckScan {
    /// The server's clock (`TIME`) when the scan started.
    pub now: SystemTime,
    /// Record keys read.
    pub scanned: u64,
    /// Whether the whole key space was walked (`false`: stopped at the
    /// scan limit or the result limit).
    pub complete: bool,
    /// The stuck records, and the corrupt ones met on the way, in the
    /// order found, at most the limit asked.
    pub records: Vec<ScannedRecord>,
}

/// Records by state, for one scope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StateCounts {
    /// In progress, lease not over.
    pub in_progress: u64,
    /// In progress, lease over (a duplicate would take the key over).
    pub stuck: u64,
    /// Completed (live).
    pub completed: u64,
    /// Records that do not decode.
    pub corrupt: u64,
}

/// Counts of the records by scope and state.
#[derive(Debug)]
#[non_exhaustive]
pub struct CountScan {
    /// The server's clock (`TIME`) when the scan started.
    pub now: SystemTime,
    /// Record keys read.
    pub scanned: u64,
    /// Whether the whole key space was walked (`false`: the counts are a
    /// lower bound).
    pub complete: bool,
    /// Counts by scope (corrupt records whose key does not name a scope
    /// count under `""`).
    pub by_scope: BTreeMap<String, StateCounts>,
    /// The first corrupt records met (at most 100), with why.
    pub corrupt: Vec<(String, String)>,
}

/// A node to scan: the connection itself, or a cluster primary.
enum Node {
    Single,
    Primary(String, u16),
}

/// `*`, `?`, `[`, `]` and `\` escaped for a `SCAN MATCH` pattern.
fn glob_escape(literal: &str) -> String {
    let mut out = String::with_capacity(literal.len() + 1);
    for c in literal.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Whether `rest` (a key name after the prefix) is a `delete` call's
/// marker, `delete/{n}/{32 hex}`, whose value is the `0` or `1` it
/// answered.
fn is_delete_marker(rest: &[u8], value: &[u8]) -> bool {
    let Some(tail) = rest.strip_prefix(b"delete/{") else {
        return false;
    };
    let Some(close) = tail.iter().position(|&b| b == b'}') else {
        return false;
    };
    let (digits, id) = (&tail[..close], &tail[close + 1..]);
    !digits.is_empty()
        && digits.iter().all(u8::is_ascii_digit)
        && id.len() == 33
        && id[0] == b'/'
        && id[1..].iter().all(u8::is_ascii_hexdigit)
        && matches!(value, b"0" | b"1")
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The server's clock (`TIME`; on a cluster, of the node the client
    /// picks). One round trip.
    pub async fn server_time(&self) -> Result<SystemTime, StoreError> {
        let mut conn = self.connection();
        let (secs, micros): (u64, u64) = self
            .timed(async { redis::cmd("TIME").query_async(&mut conn).await })
            .await?;
        Ok(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros))
    }

    /// The names of the keys starting with `prefix` (matched literally),
    /// at most `max` of them, from `SCAN` on a standalone server or on
    /// every primary of a [`ClusterConnection`], and whether the walk got
    /// through the whole key space. A key may be listed twice if the
    /// cluster resharded meanwhile (`SCAN`'s own guarantee). Each call is
    /// bounded by the call timeout. For operator tools, not for a
    /// request's path.
    ///
    /// A cluster behind a connection type of the application's own (not
    /// a `ClusterConnection`) cannot be walked node by node: that is a
    /// [`StoreError::Backend`].
    pub async fn scan_keys(
        &self,
        prefix: &str,
        max: usize,
    ) -> Result<(Vec<Vec<u8>>, bool), StoreError> {
        self.scan_matching(&format!("{}*", glob_escape(prefix)), max)
            .await
    }

    /// The scopes holding a record for `id` (under this store's prefix):
    /// what an operator looking for a key in the wrong scope needs. Walks
    /// the key space as [`scan_keys`](Self::scan_keys) does, reading at
    /// most `max_scan` key names, and says whether it got through it all.
    /// Scopes in order; delete markers are not records.
    pub async fn scopes_holding(
        &self,
        id: &str,
        max_scan: usize,
    ) -> Result<(Vec<String>, bool), StoreError> {
        let pattern = format!("{}*/{}", glob_escape(&self.prefix), glob_escape(id));
        let (keys, complete) = self.scan_matching(&pattern, max_scan).await?;
        let mut scopes = std::collections::BTreeSet::new();
        for key in keys {
            let Some(rest) = key.strip_prefix(self.prefix.as_bytes()) else {
                continue;
            };
            let Some(slash) = rest.iter().position(|&b| b == b'/') else {
                continue;
            };
            let (scope, tail) = (&rest[..slash], &rest[slash + 1..]);
            if tail != id.as_bytes() {
                continue;
            }
            if let Ok(scope) = std::str::from_utf8(scope) {
                if IdempotencyKey::new(scope, id).is_ok() {
                    scopes.insert(scope.to_owned());
                }
            }
        }
        Ok((scopes.into_iter().collect(), complete))
    }

    /// The key names matching a `SCAN` pattern on every primary, at most
    /// `max`, and whether the walk got through the whole key space.
    async fn scan_matching(
        &self,
        pattern: &str,
        max: usize,
    ) -> Result<(Vec<Vec<u8>>, bool), StoreError> {
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for node in self.nodes().await? {
            let mut cursor: u64 = 0;
            loop {
                if keys.len() >= max {
                    return Ok((keys, false));
                }
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(PAGE);
                let (next, page): (u64, Vec<Vec<u8>>) = self.on_node(&node, cmd).await?;
                let room = max - keys.len();
                if page.len() > room {
                    keys.extend(page.into_iter().take(room));
                    return Ok((keys, false));
                }
                keys.extend(page);
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok((keys, true))
    }

    /// The records in progress whose lease deadline has passed by the
    /// server's clock (a duplicate would take them over), and every
    /// corrupt record met on the way (with its key), at most `limit` in
    /// all, reading at most `max_scan` record keys. Delete markers (see
    /// the crate docs on `delete`) are not records and are passed over.
    pub async fn stuck(&self, limit: usize, max_scan: usize) -> Result<StuckScan, StoreError> {
        let now = self.server_time().await?;
        let (keys, mut complete) = self.scan_keys(&self.prefix, max_scan).await?;
        let mut records = Vec::new();
        let mut scanned = 0u64;
        for chunk in keys.chunks(PAGE) {
            if records.len() >= limit {
                complete = false;
                break;
            }
            scanned += chunk.len() as u64;
            for found in self.read_records(chunk).await? {
                let keep = match &found.record {
                    Ok(record) => matches!(
                        record.state,
                        RecordState::InProgress { lease_expires_at } if lease_expires_at <= now
                    ),
                    Err(_) => true,
                };
                if keep {
                    if records.len() >= limit {
                        complete = false;
                        break;
                    }
                    records.push(found);
                }
            }
        }
        Ok(StuckScan {
            now,
            scanned,
            complete,
            records,
        })
    }

    /// Counts the records by scope and state (in progress, stuck,
    /// completed, corrupt), reading at most `max_scan` record keys.
    pub async fn counts(&self, max_scan: usize) -> Result<CountScan, StoreError> {
        let now = self.server_time().await?;
        let (keys, complete) = self.scan_keys(&self.prefix, max_scan).await?;
        let mut by_scope: BTreeMap<String, StateCounts> = BTreeMap::new();
        let mut corrupt = Vec::new();
        let mut scanned = 0u64;
        for chunk in keys.chunks(PAGE) {
            scanned += chunk.len() as u64;
            for found in self.read_records(chunk).await? {
                match found.record {
                    Ok(record) => {
                        let counts = by_scope.entry(record.key.scope().to_owned()).or_default();
                        match record.state {
                            RecordState::Completed { .. } => counts.completed += 1,
                            RecordState::InProgress { lease_expires_at }
                                if lease_expires_at <= now =>
                            {
                                counts.stuck += 1
                            }
                            RecordState::InProgress { .. } => counts.in_progress += 1,
                        }
                    }
                    Err(detail) => {
                        let scope = self
                            .scope_of(found.redis_key.as_bytes())
                            .unwrap_or_default();
                        by_scope.entry(scope).or_default().corrupt += 1;
                        if corrupt.len() < 100 {
                            corrupt.push((found.redis_key, detail));
                        }
                    }
                }
            }
        }
        Ok(CountScan {
            now,
            scanned,
            complete,
            by_scope,
            corrupt,
        })
    }

    /// The scope named by a record key, if it has the record key's shape.
    fn scope_of(&self, redis_key: &[u8]) -> Option<String> {
        let rest = redis_key.strip_prefix(self.prefix.as_bytes())?;
        let slash = rest.iter().position(|&b| b == b'/')?;
        String::from_utf8(rest[..slash].to_vec()).ok()
    }

    /// Reads the records of `keys` (concurrent `GET`s); a key gone since
    /// the scan and a delete marker are left out.
    async fn read_records(&self, keys: &[Vec<u8>]) -> Result<Vec<ScannedRecord>, StoreError> {
        let reads = keys.iter().map(|name| async move {
            let mut conn = self.connection();
            let value = self
                .timed(async {
                    redis::cmd("GET")
                        .arg(name.as_slice())
                        .query_async::<Value>(&mut conn)
                        .await
                })
                .await;
            (name, value)
        });
        let mut out = Vec::new();
        for (name, value) in join_all(reads).await {
            let redis_key = String::from_utf8_lossy(name).into_owned();
            let rest = &name[self.prefix.len().min(name.len())..];
            let raw = match value {
                Ok(Value::Nil) => continue,
                Ok(Value::BulkString(raw)) => raw,
                Ok(other) => {
                    out.push(ScannedRecord {
                        redis_key,
                        record: Err(format!("GET returned {other:?}")),
                    });
                    continue;
                }
                Err(StoreError::Backend(e)) if is_wrong_type(&*e) => {
                    out.push(ScannedRecord {
                        redis_key,
                        record: Err("the record is not a string".to_owned()),
                    });
                    continue;
                }
                Err(e) => return Err(e),
            };
            if is_delete_marker(rest, &raw) {
                continue;
            }
            let record = match parse_name(rest) {
                Ok(key) => decode_record(Bytes::from(raw), &key).map_err(|e| match e {
                    StoreError::Corrupt { detail, .. } => detail,
                    other => other.to_string(),
                }),
                Err(why) => Err(why),
            };
            out.push(ScannedRecord { redis_key, record });
        }
        Ok(out)
    }

    /// The nodes to scan: the connection, or every primary of a cluster
    /// (from `CLUSTER SLOTS`).
    async fn nodes(&self) -> Result<Vec<Node>, StoreError> {
        if std::any::TypeId::of::<C>() != std::any::TypeId::of::<ClusterConnection>() {
            if self.cluster.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(StoreError::backend(
                    "a cluster behind a connection type other than ClusterConnection cannot be scanned node by node",
                ));
            }
            return Ok(vec![Node::Single]);
        }
        let mut conn = self.connection();
        let slots: Value = self
            .timed(async {
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(&mut conn)
                    .await
            })
            .await?;
        let mut primaries: Vec<(String, u16)> = Vec::new();
        let Value::Array(ranges) = slots else {
            return Err(unexpected(format!("CLUSTER SLOTS returned {slots:?}")));
        };
        for range in ranges {
            let primary = match range {
                Value::Array(mut parts) if parts.len() >= 3 => parts.swap_remove(2),
                other => {
                    return Err(unexpected(format!(
                        "CLUSTER SLOTS returned a range {other:?}"
                    )))
                }
            };
            let (host, port) = match primary {
                Value::Array(node) if node.len() >= 2 => {
                    let host: String = redis::from_redis_value(node[0].clone())
                        .map_err(|e| unexpected(e.to_string()))?;
                    let port: u16 = redis::from_redis_value(node[1].clone())
                        .map_err(|e| unexpected(e.to_string()))?;
                    (host, port)
                }
                other => {
                    return Err(unexpected(format!(
                        "CLUSTER SLOTS returned a node {other:?}"
                    )))
                }
            };
            if !primaries.contains(&(host.clone(), port)) {
                primaries.push((host, port));
            }
        }
        Ok(primaries
            .into_iter()
            .map(|(host, port)| Node::Primary(host, port))
            .collect())
    }

    /// Runs `cmd` on `node`, within the call timeout.
    async fn on_node<T: redis::FromRedisValue>(
        &self,
        node: &Node,
        cmd: redis::Cmd,
    ) -> Result<T, StoreError> {
        match node {
            Node::Single => {
                let mut conn = self.connection();
                self.timed(async { cmd.query_async(&mut conn).await }).await
            }
            Node::Primary(host, port) => {
                let current = self.connection();
                let Some(cluster) = (&current as &dyn Any).downcast_ref::<ClusterConnection>()
                else {
                    return Err(StoreError::backend("not a cluster connection"));
                };
                let mut conn = cluster.clone();
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let value = self
                    .timed(async { conn.route_command(cmd, routing).await })
                    .await?;
                redis::from_redis_value(value).map_err(|e| unexpected(e.to_string()))
            }
        }
    }
}

/// The key named by a record key's name after the prefix, `{scope}/{id}`.
fn parse_name(rest: &[u8]) -> Result<IdempotencyKey, String> {
    let text = std::str::from_utf8(rest).map_err(|_| "the key name is not UTF-8".to_owned())?;
    let (scope, id) = text
        .split_once('/')
        .ok_or_else(|| "the key name is not {prefix}{scope}/{id}".to_owned())?;
    IdempotencyKey::new(scope, id).map_err(|e| format!("the key name is not a valid key: {e}"))
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Deletes the record of `key` only if it is still held by the
    /// acquisition with lease token `token` and is not in progress with a
    /// live lease (by the server's `TIME`), in one script
    /// (`scripts/delete_if_token.lua`): for tools that check a record, then
    /// delete it. A takeover in between (the lease was over, a duplicate
    /// took the key) gives the record another token, and a late
    /// heartbeat's extend makes its lease live again: either way it is left
    /// alone, `Ok(false)`, as for a record that is gone. Like
    /// [`delete`](idem_core::IdempotencyStore::delete), it leaves its
    /// answer in a marker in the record's slot: a resend after a lost
    /// reply (the cluster client resends scripts) answers what the first
    /// send did, not `false` for the record it deleted.
    pub async fn delete_if_token(
        &self,
        key: &IdempotencyKey,
        token: &LeaseToken,
    ) -> Result<bool, StoreError> {
        static SCRIPT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(include_str!("../scripts/delete_if_token.lua"))
        });
        let redis_key = self.redis_key(key);
        let request = LeaseToken::random().to_hex();
        let marker =
            crate::slots::delete_marker(&self.prefix, &redis_key, &request).ok_or_else(|| {
                StoreError::backend(format!("no call marker in the hash slot of {redis_key}"))
            })?;
        let mut conn = self.connection();
        let mut invocation = SCRIPT.prepare_invoke();
        invocation
            .key(&redis_key)
            .key(&marker)
            .arg(&token.to_bytes()[..])
            .arg(crate::scripts::millis(self.delete_marker_ttl()));
        let removed: i64 = self.timed(invocation.invoke_async(&mut conn)).await?;
        Ok(removed > 0)
    }

    /// The record of `key` (as [`get`](idem_core::IdempotencyStore::get)
    /// reads it) with the server's clock at that moment (`GET` then
    /// `TIME` in one pipeline, routed by the key: on a cluster, the clock
    /// of the node that holds the record). For operator tools that show
    /// how long a lease or a retention has left.
    pub async fn get_with_time(
        &self,
        key: &IdempotencyKey,
    ) -> Result<(Option<Record>, SystemTime), StoreError> {
        let redis_key = self.redis_key(key);
        let mut conn = self.connection();
        let reply: Result<(Value, (u64, u64)), StoreError> = self
            .timed(async {
                redis::pipe()
                    .cmd("GET")
                    .arg(&redis_key)
                    .cmd("TIME")
                    .query_async(&mut conn)
                    .await
            })
            .await;
        let (value, (secs, micros)) = match reply {
            Ok(reply) => reply,
            Err(StoreError::Backend(e)) if is_wrong_type(&*e) => {
                return Err(corrupt(key, "the record is not a string"))
            }
            Err(e) => return Err(e),
        };
        let now = UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros);
        match value {
            Value::Nil => Ok((None, now)),
            Value::BulkString(raw) => Ok((Some(decode_record(Bytes::from(raw), key)?), now)),
            other => Err(unexpected(format!("GET returned {other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_patterns_match_the_prefix_literally() {
        assert_eq!(glob_escape("idem:"), "idem:");
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
        assert_eq!(glob_escape("{tag}x:"), "{tag}x:");
    }

    #[test]
    fn delete_markers_are_told_from_records() {
        let hex = "0123456789abcdef0123456789abcdef";
        let name = format!("delete/{{42}}/{hex}");
        assert!(is_delete_marker(name.as_bytes(), b"1"));
        assert!(is_delete_marker(name.as_bytes(), b"0"));
        // A record of scope "delete" holds a record, not "0"/"1".
        assert!(!is_delete_marker(name.as_bytes(), &[b'c'; 94]));
        for other in [
            "delete/{}/0123456789abcdef0123456789abcdef",
            "delete/{4x}/0123456789abcdef0123456789abcdef",
            "delete/{42}/short",
            "delete/42/0123456789abcdef0123456789abcdef",
            "payments/{42}/0123456789abcdef0123456789abcdef",
        ] {
            assert!(!is_delete_marker(other.as_bytes(), b"1"), "{other}");
        }
    }

    #[test]
    fn record_names_parse_or_say_why() {
        let key = parse_name(b"pay.charge/id/with/slashes").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((key.scope(), key.id()), ("pay.charge", "id/with/slashes"));
        for bad in [&b"noslash"[..], b"/id", b"bad scope/id", b"s/", b"\xff/x"] {
            assert!(parse_name(bad).is_err(), "{bad:?}");
        }
    }
}
