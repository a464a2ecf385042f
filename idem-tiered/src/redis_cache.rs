//! The Redis tier: completed records as compact strings with a TTL.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{CompletedRecord, Fingerprint, IdempotencyKey};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};

use crate::{CacheError, RecordCache};

const MAGIC: &[u8; 2] = b"I1";
const HEADER: usize = 2 + 4 + 8 + 8 + 1;

/// A Redis cache tier: one string per completed record under its own
/// prefix (default `idem-cache:`, apart from a `RedisStore`'s records),
/// `SET ... PX ttl NX`. Works on any shared connection of the `redis` crate,
/// cluster included (one key per call).
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
    pub async fn connect(url: &str) -> Result<Self, CacheError> {
        let client = redis::Client::open(url).map_err(|e| CacheError::Unavailable(Box::new(e)))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|e| CacheError::Unavailable(Box::new(e)))?;
        Ok(RedisCache::new(conn))
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

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `I1`, attempt, completed ms, expires ms, fingerprint flag (+32 bytes),
/// then the response.
fn encode(record: &CompletedRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + 32 + record.response.len());
    out.extend_from_slice(MAGIC);
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

fn decode(key: &IdempotencyKey, bytes: Vec<u8>) -> Result<CompletedRecord, CacheError> {
    let bad = |what: &str| CacheError::Undecodable(format!("{key}: {what}"));
    if bytes.len() < HEADER || &bytes[..2] != MAGIC {
        return Err(bad("not an idem cache entry"));
    }
    let u32_at =
        |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i..i + 8]);
        u64::from_be_bytes(b)
    };
    let attempt = u32_at(2);
    let completed = UNIX_EPOCH + Duration::from_millis(u64_at(6));
    let expires = UNIX_EPOCH + Duration::from_millis(u64_at(14));
    let (fingerprint, body) = match bytes[22] {
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
    Ok(CompletedRecord::new(
        key.clone(),
        response,
        fingerprint,
        attempt,
        completed,
        expires,
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

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<CompletedRecord>, CacheError> {
        let mut conn = self.conn.clone();
        let reply: Result<Option<Vec<u8>>, _> = redis::cmd("GET")
            .arg(self.redis_key(key))
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(Some(bytes)) => decode(key, bytes).map(Some),
            Ok(None) => Ok(None),
            Err(e) if e.code() == Some("WRONGTYPE") => {
                Err(CacheError::Undecodable(format!("{key}: not a string")))
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn put(&self, record: &CompletedRecord, ttl: Duration) -> Result<(), CacheError> {
        let ttl_ms = (ttl.as_millis() as u64).max(1);
        let mut conn = self.conn.clone();
        redis::cmd("SET")
            .arg(self.redis_key(&record.key))
            .arg(encode(record))
            .arg("PX")
            .arg(ttl_ms)
            .arg("NX")
            .query_async::<()>(&mut conn)
            .await
            .map_err(unavailable)
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
            );
            let back = decode(&key, encode(&record));
            assert_eq!(back.ok(), Some(record));
        }
        for garbage in [
            &b""[..],
            b"I1",
            b"XX0000000000000000000000",
            b"I1\x00\x00\x00\x01aaaaaaaabbbbbbbb\x07",
        ] {
            assert!(matches!(
                decode(&key, garbage.to_vec()),
                Err(CacheError::Undecodable(_))
            ));
        }
    }
}
