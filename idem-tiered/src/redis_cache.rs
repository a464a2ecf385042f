//! The Redis tier: completed records as compact strings with a TTL.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{CompletedRecord, Fingerprint, IdempotencyKey};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};

use crate::{CacheError, RecordCache};

const MAGIC: &[u8; 2] = b"I2";
const TOMBSTONE: &[u8; 2] = b"T2";
/// Magic, fence (20 decimal digits), attempt, completed ms, expires ms,
/// fingerprint flag.
const HEADER: usize = 2 + 20 + 4 + 8 + 8 + 1;

/// Fence-ordered put and tombstone.
static PUT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("../scripts/cache_put.lua")));

/// A Redis cache tier: one string per completed record under its own
/// prefix (default `idem-cache:`, apart from a `RedisStore`'s records),
/// written by a script that keeps the entry with the highest fence (a delete
/// leaves a tombstone that refuses stale fills). Works on any shared
/// connection of the `redis` crate, cluster included (one key per call).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::MemoryStore;
/// use idem_tiered::{RedisCache, TieredStore};
///
/// let tier = RedisCache::connect("redis://127.0.0.1:6379/").await?;
/// let store = TieredStore::new(MemoryStore::new()).with_cache(tier); // in production: a PgStore
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisCache<C = ConnectionManager> {
    conn: C,
    prefix: String,
}

impl<C> std::fmt::Debug for RedisCache<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCache")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisCache<ConnectionManager> {
    /// Connects with a reconnecting `ConnectionManager`.
    ///
    /// A `rediss://` URL connects over TLS (feature `tls`), trusting the
    /// system's root certificates; for a CA of your own, make the
    /// connection yourself and give it to [`new`](Self::new).
    pub async fn connect(url: &str) -> Result<Self, CacheError> {
        let client = redis::Client::open(url).map_err(|e| CacheError::Unavailable(Box::new(e)))?;
        Ok(RedisCache::new(connection_manager(client).await?))
    }
}

impl<C> RedisCache<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A tier over a connection you made.
    pub fn new(conn: C) -> Self {
        RedisCache {
            conn,
            prefix: "idem-cache:".to_owned(),
        }
    }

    /// The prefix of cache keys (default `idem-cache:`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The Redis key of `key`'s entry.
    pub fn redis_key(&self, key: &IdempotencyKey) -> String {
        format!("{}{}/{}", self.prefix, key.scope(), key.id())
    }
}

/// A reconnecting connection with the short timeouts of a cache tier: a
/// slow cache is skipped, not waited for.
pub(crate) async fn connection_manager(
    client: redis::Client,
) -> Result<ConnectionManager, CacheError> {
    #[cfg(feature = "tls")]
    if matches!(
        client.get_connection_info().addr(),
        redis::ConnectionAddr::TcpTls { .. }
    ) {
        install_crypto_provider();
    }
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(200));
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| CacheError::Unavailable(Box::new(e)))
}

/// Makes sure rustls has a process-wide crypto provider before a
/// `rediss://` connection is made, installing ring's (the one the `tls`
/// feature brings) if none is installed; an application's own provider is
/// kept. The `redis` crate builds its TLS configuration with the
/// process-wide provider, and rustls panics when it has to pick one itself
/// in a build with two (an application's AWS SDK HTTPS client, from
/// `aws-config`, brings aws-lc-rs). The same as
/// `idem_redis::install_crypto_provider`, which this crate cannot call
/// (it does not depend on idem-redis).
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err: another thread installed one meanwhile; that one is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn fence_digits(fence: u64) -> [u8; 20] {
    let mut out = [b'0'; 20];
    let text = fence.to_string();
    out[20 - text.len()..].copy_from_slice(text.as_bytes());
    out
}

/// `I2`, fence (20 digits), attempt, completed ms, expires ms, fingerprint
/// flag (+32 bytes), then the response.
fn encode(record: &CompletedRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + 32 + record.response.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&fence_digits(record.fence));
    out.extend_from_slice(&record.attempt.to_be_bytes());
    out.extend_from_slice(&ms(record.completed_at).to_be_bytes());
    out.extend_from_slice(&ms(record.expires_at).to_be_bytes());
    match record.fingerprint {
        Some(fp) => {
            out.push(1);
            out.extend_from_slice(fp.as_bytes());
        }
        None => out.push(0),
    }
    out.extend_from_slice(&record.response);
    out
}

/// A tombstone: `T2` and the fence it refuses records up to.
fn encode_tombstone(fence: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(22);
    out.extend_from_slice(TOMBSTONE);
    out.extend_from_slice(&fence_digits(fence));
    out
}

/// The record of an entry; `None` for a tombstone.
fn decode(key: &IdempotencyKey, bytes: Vec<u8>) -> Result<Option<CompletedRecord>, CacheError> {
    let bad = |what: &str| CacheError::Undecodable(format!("{key}: {what}"));
    if bytes.len() == 22 && &bytes[..2] == TOMBSTONE {
        return Ok(None);
    }
    if bytes.len() < HEADER || &bytes[..2] != MAGIC {
        return Err(bad("not an idem cache entry"));
    }
    let fence = std::str::from_utf8(&bytes[2..22])
        .ok()
        .and_then(|d| d.parse::<u64>().ok())
        .ok_or_else(|| bad("bad fence"))?;
    let u32_at =
        |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i..i + 8]);
        u64::from_be_bytes(b)
    };
    let attempt = u32_at(22);
    let completed = UNIX_EPOCH + Duration::from_millis(u64_at(26));
    let expires = UNIX_EPOCH + Duration::from_millis(u64_at(34));
    let (fingerprint, body) = match bytes[42] {
        0 => (None, HEADER),
        1 if bytes.len() >= HEADER + 32 => (
            Fingerprint::from_slice(&bytes[HEADER..HEADER + 32]),
            HEADER + 32,
        ),
        _ => return Err(bad("bad fingerprint flag")),
    };
    if attempt == 0 {
        return Err(bad("attempt 0"));
    }
    let mut bytes = bytes;
    let response = Bytes::from(bytes.split_off(body));
    Ok(Some(
        CompletedRecord::new(
            key.clone(),
            response,
            fingerprint,
            attempt,
            completed,
            expires,
        )
        .with_fence(fence),
    ))
}

fn unavailable(e: redis::RedisError) -> CacheError {
    CacheError::Unavailable(Box::new(e))
}

#[async_trait]
impl<C> RecordCache for RedisCache<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn name(&self) -> &str {
        "redis"
    }

    /// `GET` and `PTTL` in one pipelined round trip: the time left comes
    /// from Redis's own clock.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<CompletedRecord>, CacheError> {
        let mut conn = self.conn.clone();
        let redis_key = self.redis_key(key);
        let reply: Result<(Option<Vec<u8>>, i64), _> = redis::pipe()
            .cmd("GET")
            .arg(&redis_key)
            .cmd("PTTL")
            .arg(&redis_key)
            .query_async(&mut conn)
            .await;
        match reply {
            Ok((Some(bytes), pttl)) => {
                let Some(record) = decode(key, bytes)? else {
                    return Ok(None);
                };
                // -1: no expiry (written by something else): not ours to trust.
                if pttl <= 0 {
                    return Err(CacheError::Undecodable(format!(
                        "{key}: entry without a TTL"
                    )));
                }
                Ok(Some(record.with_ttl(Duration::from_millis(pttl as u64))))
            }
            Ok((None, _)) => Ok(None),
            Err(e) if e.code() == Some("WRONGTYPE") => {
                Err(CacheError::Undecodable(format!("{key}: not a string")))
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn put(&self, record: &CompletedRecord, ttl: Duration) -> Result<(), CacheError> {
        let ttl = idem_core::saturate(ttl);
        if ttl.is_zero() {
            return Ok(());
        }
        self.write_ordered(&record.key, encode(record), ttl, "keep-equal")
            .await
    }

    async fn tombstone(
        &self,
        key: &IdempotencyKey,
        fence: u64,
        ttl: Duration,
    ) -> Result<(), CacheError> {
        let ttl = idem_core::saturate(ttl).max(Duration::from_millis(1));
        self.write_ordered(key, encode_tombstone(fence), ttl, "replace-equal")
            .await
    }

    async fn invalidate(&self, key: &IdempotencyKey) -> Result<(), CacheError> {
        let mut conn = self.conn.clone();
        redis::cmd("DEL")
            .arg(self.redis_key(key))
            .query_async::<()>(&mut conn)
            .await
            .map_err(unavailable)
    }
}

impl<C> RedisCache<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    async fn write_ordered(
        &self,
        key: &IdempotencyKey,
        value: Vec<u8>,
        ttl: Duration,
        equal: &str,
    ) -> Result<(), CacheError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut conn = self.conn.clone();
        let written: Result<i64, _> = PUT
            .key(self.redis_key(key))
            .arg(value)
            .arg(ttl_ms)
            .arg(equal)
            .invoke_async(&mut conn)
            .await;
        match written {
            Ok(_) => Ok(()),
            // A key of another type under our prefix: replace it.
            Err(e) if e.code() == Some("WRONGTYPE") => {
                self.invalidate(key).await?;
                Err(CacheError::Undecodable(format!("{key}: not a string")))
            }
            Err(e) => Err(unavailable(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_garbage_is_undecodable() {
        let key = IdempotencyKey::new("s", "k").unwrap_or_else(|e| panic!("{e}"));
        let now = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        for fp in [None, Some(Fingerprint::of_bytes(b"p"))] {
            let record = CompletedRecord::new(
                key.clone(),
                Bytes::from_static(b"\x00\xffresponse"),
                fp,
                3,
                now,
                now + Duration::from_secs(60),
            )
            .with_fence(u64::MAX);
            let back = decode(&key, encode(&record));
            assert_eq!(back.ok(), Some(Some(record)));
        }
        assert!(matches!(decode(&key, encode_tombstone(42)), Ok(None)));
        assert_eq!(&fence_digits(42)[..], b"00000000000000000042");
        assert_eq!(&fence_digits(u64::MAX)[..], b"18446744073709551615");
        for garbage in [
            &b""[..],
            b"I2",
            b"XX0000000000000000000000",
            b"I2000000000000000000x1\x00\x00\x00\x01aaaaaaaabbbbbbbb\x00",
            b"I200000000000000000001\x00\x00\x00\x01aaaaaaaabbbbbbbb\x07",
        ] {
            assert!(matches!(
                decode(&key, garbage.to_vec()),
                Err(CacheError::Undecodable(_))
            ));
        }
    }
}
