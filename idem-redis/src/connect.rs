//! Connecting: [`RedisStore::connect`] and [`RedisStore::connect_cluster`]
//! (and their TLS forms), and why a first connection failed.

use std::time::Duration;

use idem_core::StoreError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::RedisError;

use crate::error::{is_transient, map_error, refused_setting, Refused};
use crate::heal;
#[cfg(doc)]
use crate::heal::STALL_AFTER;
use crate::store::{Conn, RedisStore, DEFAULT_TIMEOUT};
#[cfg(feature = "tls")]
use crate::tls;
#[cfg(feature = "tls")]
use crate::tls::TlsOptions;

impl RedisStore<ConnectionManager> {
    /// Connects to a standalone Redis (`redis://host:port/db`, or
    /// `redis://user:password@host:port/db` with a password or an ACL user)
    /// through a [`ConnectionManager`] that reconnects after errors, and
    /// checks the eviction policy (see [`check_eviction_policy`](Self::check_eviction_policy)).
    ///
    /// A `rediss://` URL connects over TLS, trusting the system's root
    /// certificates (feature `tls`; for a CA of your own, see
    /// `connect_tls`).
    ///
    /// Fails fast, with a message naming the cause: a refused or
    /// unanswered connection is [`StoreError::Unavailable`] (retryable);
    /// a wrong password or user name, a certificate that is not trusted,
    /// or `redis://` to a port that speaks only TLS is
    /// [`StoreError::Backend`] (not retryable: the settings must change),
    /// its source a [`Refused`] or a connection error naming the cause.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(map_error)?;
        Self::connect_client(client).await
    }

    /// Connects over TLS (`rediss://[user:password@]host:port/db`) with the
    /// CA and client identity of `tls` (see [`TlsOptions`]). The server's
    /// certificate must chain to the CA and name the URL's host. Errors as
    /// [`connect`](Self::connect).
    ///
    /// ```no_run
    /// use idem_redis::{RedisStore, TlsOptions};
    ///
    /// # async fn run() -> Result<(), idem_core::StoreError> {
    /// let tls = TlsOptions::new().root_ca_file("/etc/idem/redis-ca.pem")?;
    /// let store = RedisStore::connect_tls("rediss://idem:secret@127.0.0.1:6380/", &tls).await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub async fn connect_tls(url: &str, tls: &TlsOptions) -> Result<Self, StoreError> {
        if !url.starts_with("rediss://") {
            return Err(StoreError::InvalidArgument {
                detail: "connect_tls takes a rediss:// URL (redis:// is plaintext)".to_owned(),
            });
        }
        let client = redis::Client::build_with_tls(url, tls.certificates()?).map_err(map_error)?;
        Self::connect_client(client).await
    }

    async fn connect_client(client: redis::Client) -> Result<Self, StoreError> {
        #[cfg(feature = "tls")]
        if matches!(
            client.get_connection_info().addr(),
            redis::ConnectionAddr::TcpTls { .. }
        ) {
            tls::install_crypto_provider();
        }
        let target = describe_target(client.get_connection_info());
        // One connection first, not retried: a setting that does not match
        // (a wrong password, a certificate not trusted) fails at once,
        // where the manager below would try it three times with backoff.
        // A transient failure goes on to the manager, which retries it.
        let probe = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(DEFAULT_TIMEOUT))
            .set_response_timeout(Some(DEFAULT_TIMEOUT));
        if let Err(e) = client
            .get_multiplexed_async_connection_with_config(&probe)
            .await
        {
            let error = connect_error(e, &target, &client).await;
            if !error.is_retryable() {
                return Err(error);
            }
        }
        // No response timeout on the connection: every call is bounded by
        // the store's own settings (`call_timeout`, plus the `WAIT` timeout
        // for `WAIT`), which may be set after connecting.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(DEFAULT_TIMEOUT))
            .set_response_timeout(None)
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
        let conn = match ConnectionManager::new_with_config(client.clone(), config).await {
            Ok(conn) => conn,
            Err(e) => return Err(connect_error(e, &target, &client).await),
        };
        let store = RedisStore::new(conn);
        store.check_eviction_policy().await;
        Ok(store.fit_response_limit().await)
    }
}

impl RedisStore<ClusterConnection> {
    /// Connects to a Redis Cluster given some of its nodes.
    ///
    /// The store watches its connection: when calls have timed out for
    /// [`STALL_AFTER`] with no answer in between, on any key or on keys of
    /// the same hash slot (a master frozen while its replica took over),
    /// it makes a new connection in the background for the calls that follow
    /// ([`connections_replaced`](RedisStore::connections_replaced) counts
    /// them). The `redis` crate's cluster client was seen to stop answering
    /// for good after a master was killed and its replica promoted. Every script
    /// touches one key (`delete` also its marker, in the same slot), so
    /// every slot works and no hash tags are needed in your keys.
    pub async fn connect_cluster<I, T>(nodes: I) -> Result<Self, StoreError>
    where
        I: IntoIterator<Item = T>,
        T: redis::IntoConnectionInfo,
    {
        Self::connect_cluster_with(redis::cluster::ClusterClient::builder(nodes)).await
    }

    /// [`connect_cluster`](Self::connect_cluster) over TLS (`rediss://`
    /// node URLs, the cluster run with `tls-cluster yes`), with the CA and
    /// client identity of `tls`.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub async fn connect_cluster_tls<I, T>(nodes: I, tls: &TlsOptions) -> Result<Self, StoreError>
    where
        I: IntoIterator<Item = T>,
        T: redis::IntoConnectionInfo,
    {
        Self::connect_cluster_with(
            redis::cluster::ClusterClient::builder(nodes).certs(tls.certificates()?),
        )
        .await
    }

    async fn connect_cluster_with(
        builder: redis::cluster::ClusterClientBuilder,
    ) -> Result<Self, StoreError> {
        #[cfg(feature = "tls")]
        tls::install_crypto_provider();
        // No response timeout on the connections (the builder's default):
        // every call is bounded by the store's own settings, as with
        // `connect`.
        //
        // Retries: after a lost reply the client resends the script (every
        // script is safe to run twice: see the crate docs), but the resend
        // may first hit the dead connection (broken pipe), then a random
        // node while the owner's connection is rebuilt (MOVED), before it
        // reaches the owner again: two retries were often not enough. The
        // call timeout bounds them all.
        let client = builder
            .connection_timeout(DEFAULT_TIMEOUT)
            .retries(CLUSTER_RETRIES)
            .build()
            .map_err(map_error)?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(cluster_connect_error)?;
        let mut store = RedisStore::new(conn.clone());
        // The store keeps no other handle on the first connection: once
        // replaced, it closes when its last call ends.
        // The cluster client was seen to stop answering for good after a
        // failover (see the `heal` module): a silent connection is
        // replaced by a new one from the same client.
        let connect: heal::Connect<ClusterConnection> = Box::new(move || {
            let client = client.clone();
            Box::pin(async move { client.get_async_connection().await })
        });
        // A new connection may first wait out the connection timeout of a
        // node that does not answer (a frozen master in the seed list):
        // its own limit is longer.
        // Which master serves which slots: a master that stops answering
        // is seen on all its slots together.
        let read_slots: heal::ReadSlots<ClusterConnection> = Box::new(|mut conn| {
            Box::pin(async move {
                let reply: redis::Value = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(&mut conn)
                    .await?;
                Ok(heal::slot_ranges(&reply))
            })
        });
        store.conn = Conn::Healing(heal::Healer::new(
            conn,
            connect,
            DEFAULT_TIMEOUT * 5,
            Some(read_slots),
        ));
        store.check_eviction_policy().await;
        Ok(store.fit_response_limit().await)
    }
}

/// How many times the cluster client retries a call (a resend after a lost
/// reply, a redirection, a reconnection), within the call timeout.
const CLUSTER_RETRIES: u32 = 6;

/// Where a connection goes, and as whom: never the password.
fn describe_target(info: &redis::ConnectionInfo) -> String {
    let addr = match info.addr() {
        redis::ConnectionAddr::Tcp(host, port) => format!("redis://{host}:{port}"),
        redis::ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{host}:{port}"),
        other => format!("{other}"),
    };
    match info.redis_settings().username() {
        Some(user) => format!("Redis at {addr} (user {user:?})"),
        None => format!("Redis at {addr}"),
    }
}

/// Why [`RedisStore::connect`] could not connect, with where it tried.
#[derive(Debug)]
struct ConnectError {
    target: String,
    cause: String,
    source: RedisError,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot connect to {}: {}", self.target, self.cause)
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// A failed first connection: a setting (credentials, TLS, plaintext to a
/// TLS port) is `Backend`; a refused, dropped or timed out connection is
/// `Unavailable`.
async fn connect_error(e: RedisError, target: &str, client: &redis::Client) -> StoreError {
    let (cause, retryable) = if let Some(cause) = refused_setting(&e) {
        (cause, false)
    } else if e.is_connection_refusal() {
        (
            format!("connection refused (is the server running, on this port?) [{e}]"),
            true,
        )
    } else if e.is_connection_dropped() && speaks_tls(client).await {
        (
            format!(
                "the server closed the connection: it speaks TLS on this port, use a rediss:// URL [{e}]"
            ),
            false,
        )
    } else {
        (e.to_string(), is_transient(&e))
    };
    let error = Box::new(ConnectError {
        target: target.to_owned(),
        cause,
        source: e,
    });
    if retryable {
        StoreError::Unavailable(error)
    } else {
        StoreError::Backend(error)
    }
}

/// A failed first connection to a cluster. The cluster client keeps only
/// the text of the nodes' errors ("Failed to create initial connections -
/// Io: <the last node's error>"), so the causes that no retry cures are
/// told by that text: a wrong password, a certificate not trusted.
fn cluster_connect_error(e: RedisError) -> StoreError {
    let detail = e.detail().unwrap_or_default();
    let cause = if detail.contains("AuthenticationFailed")
        || detail.contains("WRONGPASS")
        || detail.contains("NOAUTH")
    {
        Some(format!(
            "authentication failed on the cluster's nodes: wrong password or user name, or the user is disabled [{e}]"
        ))
    } else if detail.contains("invalid peer certificate") {
        Some(format!(
            "TLS: the nodes' certificate is not trusted: give the CA that signed it (TlsOptions::root_ca_pem / root_ca_file) and certificates naming the nodes' hosts [{e}]"
        ))
    } else {
        None
    };
    match cause {
        Some(cause) => StoreError::Backend(Box::new(Refused { cause, source: e })),
        None => map_error(e),
    }
}

/// Whether a server reached with `redis://` (plaintext) dropped the
/// connection because it speaks TLS on that port: one probe, the start of
/// a TLS handshake, answered with a TLS record (a handshake or an alert)
/// by a TLS server; a Redis speaking RESP answers an error, or nothing
/// like it. Asked only after a first connection was dropped, bounded by a
/// second.
async fn speaks_tls(client: &redis::Client) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let redis::ConnectionAddr::Tcp(host, port) = client.get_connection_info().addr() else {
        return false;
    };
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
        stream.write_all(&CLIENT_HELLO).await?;
        let mut reply = [0u8; 3];
        stream.read_exact(&mut reply).await?;
        Ok::<_, std::io::Error>(reply)
    };
    // A handshake record (0x16) or an alert (0x15), TLS 1.0 to 1.3.
    matches!(
        tokio::time::timeout(Duration::from_secs(1), probe).await,
        Ok(Ok([0x15 | 0x16, 0x03, 0x00..=0x04]))
    )
}

/// The start of a TLS 1.2 ClientHello (one cipher suite, no extensions):
/// enough for a TLS server to answer with a handshake record or an alert.
const CLIENT_HELLO: [u8; 50] = [
    0x16, 0x03, 0x01, 0x00, 0x2d, // a handshake record of 45 bytes
    0x01, 0x00, 0x00, 0x29, // ClientHello, 41 bytes
    0x03, 0x03, // TLS 1.2
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // random
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,    // random
    0x00, // no session id
    0x00, 0x02, 0xc0, 0x2f, // TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
    0x01, 0x00, // null compression
];
