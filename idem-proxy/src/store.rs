//! The store, chosen by URL.

use std::sync::Arc;

use idem_core::{IdempotencyStore, MemoryStore, StoreError};
use idem_dynamodb::aws_sdk_dynamodb;
use idem_dynamodb::DynamoDbStore;
use idem_postgres::PgStore;
use idem_redis::RedisStore;
use idem_tiered::{CacheError, MokaCache, RedisCache, RedisInvalidation, TieredStore};

/// Why the store cannot be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The URL names no store this proxy knows, or does not parse. A retry
    /// will not help.
    #[error("{option} {url}: {reason}")]
    Url {
        /// The option that named it: `--store` or `--cache`.
        option: &'static str,
        /// The URL, without its credentials.
        url: String,
        /// Why.
        reason: String,
    },
    /// The store refused or did not answer.
    #[error("the store at {url}: {source}")]
    Store {
        /// The URL, without its credentials.
        url: String,
        /// What the store said.
        #[source]
        source: StoreError,
    },
    /// A cache tier could not be reached.
    #[error("the cache tier {url}: {source}")]
    Cache {
        /// The URL, without its credentials.
        url: String,
        /// What it said.
        #[source]
        source: CacheError,
    },
}

impl OpenError {
    /// Whether trying again later may help (the store did not answer).
    pub fn is_retryable(&self) -> bool {
        match self {
            OpenError::Url { .. } => false,
            OpenError::Store { source, .. } => matches!(source, StoreError::Unavailable(_)),
            OpenError::Cache { .. } => true,
        }
    }
}

/// A URL with its credentials left out, for messages and logs: the user
/// and password before `@`, and the value of every query parameter whose
/// name says it is a secret (`password=`, `sslpassword=`, `token=`...).
pub fn redacted(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut out = match (base.find("://"), base.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &base[..scheme], &base[at + 1..])
        }
        _ => base.to_owned(),
    };
    if let Some(query) = query {
        let secret = |name: &str| {
            let name = name.to_ascii_lowercase();
            ["pass", "secret", "token", "key", "auth"]
                .iter()
                .any(|word| name.contains(word))
        };
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((name, _)) if secret(name) => format!("{name}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&pairs.join("&"));
    }
    out
}

fn url_error(url: &str, reason: impl Into<String>) -> OpenError {
    OpenError::Url {
        option: "--store",
        url: redacted(url),
        reason: reason.into(),
    }
}

/// Opens the store `url` names, with `caches` in front of it (fastest
/// first): `moka` or `redis://...`. PostgreSQL's table is migrated when
/// `migrate` is on, and the store keeps `connections` of its own for its
/// calls (the other stores take no such setting).
pub async fn open(
    url: &str,
    caches: &[String],
    migrate: bool,
    connections: usize,
) -> Result<Arc<dyn IdempotencyStore>, OpenError> {
    let store_error = |source| OpenError::Store {
        url: redacted(url),
        source,
    };
    let source: Arc<dyn IdempotencyStore> = if url == "memory" || url == "memory://" {
        Arc::new(MemoryStore::new())
    } else if let Some(nodes) = url.strip_prefix("redis+cluster://") {
        let nodes: Vec<String> = nodes
            .split(',')
            .filter(|n| !n.is_empty())
            .map(|n| format!("redis://{n}"))
            .collect();
        if nodes.is_empty() {
            return Err(url_error(
                url,
                "redis+cluster://host:port,host:port names no node",
            ));
        }
        Arc::new(
            RedisStore::connect_cluster(nodes)
                .await
                .map_err(store_error)?,
        )
    } else if url.starts_with("redis://") || url.starts_with("rediss://") {
        Arc::new(RedisStore::connect(url).await.map_err(store_error)?)
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = idem_postgres::connect(url).await.map_err(store_error)?;
        let store = PgStore::builder(pool)
            .connections(connections)
            .build()
            .map_err(|e| url_error(url, e.to_string()))?;
        if migrate {
            store.migrate().await.map_err(store_error)?;
        }
        Arc::new(store)
    } else if let Some(rest) = url.strip_prefix("dynamodb://") {
        Arc::new(dynamodb(url, rest).await?)
    } else {
        return Err(url_error(
            url,
            "memory, redis://, rediss://, redis+cluster://, postgres:// or dynamodb://",
        ));
    };
    if caches.is_empty() {
        return Ok(source);
    }
    let mut tiered = TieredStore::new(source);
    let mut invalidation = None;
    for cache in caches {
        if cache == "moka" {
            tiered = tiered.with_cache(MokaCache::new(100_000, 256 << 20));
        } else if cache.starts_with("redis://") || cache.starts_with("rediss://") {
            if url.starts_with("redis") {
                return Err(OpenError::Url {
                    option: "--cache",
                    url: redacted(cache),
                    reason: "a Redis cache tier in front of a Redis store: `idem delete` cannot reach it (the store answers a duplicate in one round trip already); use `moka`, or a PostgreSQL or DynamoDB store".to_owned(),
                });
            }
            let tier = RedisCache::connect(cache)
                .await
                .map_err(|source| OpenError::Cache {
                    url: redacted(cache),
                    source,
                })?;
            tiered = tiered.with_cache(tier);
            invalidation.get_or_insert(cache.clone());
        } else {
            return Err(OpenError::Url {
                option: "--cache",
                url: redacted(cache),
                reason: "a cache tier is `moka` or redis://...".to_owned(),
            });
        }
    }
    // Deletes (another proxy's, `idem delete`'s) reach this proxy's
    // in-process tier over the Redis tier's server, else the store's.
    let in_process = caches.iter().any(|c| c == "moka");
    if in_process && invalidation.is_none() {
        if url.starts_with("redis://") || url.starts_with("rediss://") {
            invalidation = Some(url.to_owned());
        } else {
            return Err(OpenError::Url {
                option: "--cache",
                url: "moka".to_owned(),
                reason: "an in-process tier hears of deletes over Redis: give a redis:// store or a redis:// cache tier too".to_owned(),
            });
        }
    }
    if let Some(redis) = invalidation {
        let channel =
            RedisInvalidation::connect(&redis)
                .await
                .map_err(|source| OpenError::Cache {
                    url: redacted(&redis),
                    source,
                })?;
        tiered = tiered.with_invalidation(channel);
    }
    Ok(Arc::new(tiered))
}

/// `dynamodb://TABLE?region=R&endpoint=URL`: with an endpoint (DynamoDB
/// Local, moto), static test credentials and the table created if it is
/// missing; without one, AWS in `region` with the credentials of
/// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN`.
async fn dynamodb(url: &str, rest: &str) -> Result<DynamoDbStore, OpenError> {
    use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
    let (table, query) = rest.split_once('?').unwrap_or((rest, ""));
    if table.is_empty() {
        return Err(url_error(url, "dynamodb://TABLE?region=...: no table"));
    }
    let (mut region, mut endpoint) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("region", v)) => region = Some(v.to_owned()),
            Some(("endpoint", v)) => endpoint = Some(v.to_owned()),
            _ => {
                return Err(url_error(
                    url,
                    format!("`{pair}`: the options are region= and endpoint="),
                ))
            }
        }
    }
    let client = match endpoint {
        Some(endpoint) => {
            let client = idem_dynamodb::local_client(&endpoint);
            idem_dynamodb::create_table(&client, table)
                .await
                .map_err(|source| OpenError::Store {
                    url: redacted(url),
                    source,
                })?;
            client
        }
        None => {
            let region =
                region.ok_or_else(|| url_error(url, "region= is required without endpoint="))?;
            let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
            let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY"))
            else {
                return Err(url_error(
                    url,
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set",
                ));
            };
            let credentials =
                Credentials::new(id, secret, var("AWS_SESSION_TOKEN"), None, "idem-proxy-env");
            let http = aws_smithy_http_client::Builder::new()
                .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                    aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                ))
                .build_https();
            let config = aws_sdk_dynamodb::Config::builder()
                .behavior_version(BehaviorVersion::latest())
                .region(Region::new(region))
                .credentials_provider(credentials)
                .http_client(http)
                .build();
            aws_sdk_dynamodb::Client::from_conf(config)
        }
    };
    Ok(DynamoDbStore::new(client, table))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_left_out_of_messages() {
        assert_eq!(
            redacted("postgres://u:secret@h:5432/db"),
            "postgres://***@h:5432/db"
        );
        assert_eq!(redacted("redis://h:6379/"), "redis://h:6379/");
        assert_eq!(
            redacted("postgres://u@h/db?sslmode=require&password=s3cret&sslpassword=x@y"),
            "postgres://***@h/db?sslmode=require&password=***&sslpassword=***"
        );
        assert_eq!(
            redacted("dynamodb://t?region=eu-west-1"),
            "dynamodb://t?region=eu-west-1"
        );
    }

    #[tokio::test]
    async fn an_unknown_store_is_refused_and_not_retryable() {
        let Err(e) = open("mysql://x", &[], true, 4).await else {
            panic!("opened");
        };
        assert!(matches!(e, OpenError::Url { .. }) && !e.is_retryable());
        let Err(e) = open("memory", &["memcached://x".into()], true, 4).await else {
            panic!("opened");
        };
        assert!(matches!(e, OpenError::Url { .. }));
    }
}
