//! Deletes carried to every instance over Redis pub/sub.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use idem_core::IdempotencyKey;
use redis::aio::ConnectionManager;

use crate::{CacheError, Invalidation, InvalidationChannel, Subscription};

/// An [`InvalidationChannel`] on Redis pub/sub: `delete` in one instance
/// publishes the key and the deleted record's fence on a channel (default
/// `idem:invalidate`), and every instance subscribed to it tombstones the
/// key in its in-process tiers.
///
/// Pub/sub delivers to the subscribers connected at that moment: an
/// instance that is reconnecting misses the message. So after every
/// (re)subscription the instance drops all its in-process entries (they
/// only ever speed up answers), and [`MokaCache::max_ttl`](crate::MokaCache::max_ttl)
/// bounds what a lost message could leave behind in the meantime.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::MemoryStore;
/// use idem_tiered::{MokaCache, RedisCache, RedisInvalidation, TieredStore};
///
/// let url = "redis://127.0.0.1:6379/";
/// let store = TieredStore::new(MemoryStore::new()) // in production: a PgStore
///     .with_cache(MokaCache::new(100_000, 256 << 20))
///     .with_cache(RedisCache::connect(url).await?)
///     .with_invalidation(RedisInvalidation::connect(url).await?);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisInvalidation {
    client: redis::Client,
    publisher: ConnectionManager,
    channel: String,
}

impl std::fmt::Debug for RedisInvalidation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisInvalidation")
            .field("channel", &self.channel)
            .finish()
    }
}

impl RedisInvalidation {
    /// Connects the publisher (a reconnecting `ConnectionManager`); the
    /// subscriber connects when the channel is given to
    /// [`TieredStore::with_invalidation`](crate::TieredStore::with_invalidation).
    /// A `rediss://` URL connects over TLS (feature `tls`).
    pub async fn connect(url: &str) -> Result<Self, CacheError> {
        let client = redis::Client::open(url).map_err(|e| CacheError::Unavailable(Box::new(e)))?;
        let publisher = crate::redis_cache::connection_manager(client.clone()).await?;
        Ok(RedisInvalidation {
            client,
            publisher,
            channel: "idem:invalidate".to_owned(),
        })
    }

    /// The pub/sub channel (default `idem:invalidate`); every instance of
    /// one application must use the same.
    pub fn channel(mut self, channel: impl Into<String>) -> Self {
        self.channel = channel.into();
        self
    }
}

/// `fence \n scope \n id`: scopes hold no newline and ids no control
/// character, so the split is unambiguous.
fn encode(key: &IdempotencyKey, fence: u64) -> String {
    format!("{fence}\n{}\n{}", key.scope(), key.id())
}

fn decode(payload: &[u8]) -> Option<(IdempotencyKey, u64)> {
    let text = std::str::from_utf8(payload).ok()?;
    let mut parts = text.splitn(3, '\n');
    let fence = parts.next()?.parse().ok()?;
    let key = IdempotencyKey::new(parts.next()?, parts.next()?).ok()?;
    Some((key, fence))
}

#[async_trait]
impl InvalidationChannel for RedisInvalidation {
    async fn publish(&self, key: &IdempotencyKey, fence: u64) -> Result<(), CacheError> {
        let mut conn = self.publisher.clone();
        redis::cmd("PUBLISH")
            .arg(&self.channel)
            .arg(encode(key, fence))
            .query_async::<i64>(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| CacheError::Unavailable(Box::new(e)))
    }

    fn subscribe(&self, deliver: Box<dyn Fn(Invalidation) -> bool + Send + Sync>) -> Subscription {
        let client = self.client.clone();
        let channel = self.channel.clone();
        let task = tokio::spawn(async move {
            let mut backoff = Duration::from_millis(50);
            loop {
                match client.get_async_pubsub().await {
                    Ok(mut pubsub) => match pubsub.subscribe(&channel).await {
                        Ok(()) => {
                            backoff = Duration::from_millis(50);
                            // Whatever was published while we were not
                            // subscribed is lost: forget every entry.
                            if !deliver(Invalidation::All) {
                                return;
                            }
                            let mut messages = pubsub.on_message();
                            while let Some(message) = messages.next().await {
                                match decode(message.get_payload_bytes()) {
                                    Some((key, fence)) => {
                                        if !deliver(Invalidation::Key { key, fence }) {
                                            return;
                                        }
                                    }
                                    None => {
                                        tracing::warn!(%channel, "undecodable invalidation message ignored")
                                    }
                                }
                            }
                            tracing::warn!(%channel, "invalidation subscription lost; reconnecting");
                        }
                        Err(e) => {
                            tracing::warn!(%channel, error = %e, "cannot subscribe to invalidations")
                        }
                    },
                    Err(e) => {
                        tracing::warn!(%channel, error = %e, "cannot connect the invalidation subscriber")
                    }
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        });
        Subscription::new(task.abort_handle())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let key =
            IdempotencyKey::new("http", "tenant/POST/%2Fpay/k 1").unwrap_or_else(|e| panic!("{e}"));
        let text = encode(&key, u64::MAX);
        assert_eq!(decode(text.as_bytes()), Some((key, u64::MAX)));
        for garbage in [&b""[..], b"x\ns\ni", b"1\nbad scope\ni", b"1\ns", b"\xff"] {
            assert_eq!(decode(garbage), None);
        }
    }
}
