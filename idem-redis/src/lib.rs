//! Redis and Redis Cluster store for [idem](https://docs.rs/idem).
//!
//! [`RedisStore`] keeps one string per idempotency key, `{prefix}{scope}/{id}`
//! (default prefix `idem:`), and runs every operation as one Lua script, one
//! round trip: `acquire` returns every outcome (acquired, completed with its
//! response, in progress with its deadline, mismatch) in its single call.
//! Lease deadlines come from Redis `TIME` inside the scripts, never from the
//! client's clock. Retention is the key's expiry (`PXAT`), so there is no
//! cleanup job. The record is a 94-byte header then the response (layout in
//! `scripts/acquire.lua`); a completed record with a 200-byte response takes
//! about 370 bytes of Redis memory (`MEMORY USAGE`), and a duplicate costs
//! the script one `GET` and one `PTTL`. Format 2: records written by the
//! unreleased format 1 (a hash per key) read as `Corrupt`, never as absent. Tokens are random 128-bit values made by the client: no
//! shared counter, so no hot key and nothing cross-slot in a cluster.
//!
//! ```no_run
//! use idem_core::{Idempotency, IdempotencyKey};
//! use idem_redis::RedisStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
//! let idem = Idempotency::new(store);
//! let key = IdempotencyKey::new("emails.send", "msg-1")?;
//! idem.process(&key, "hello", |m| async move { Ok::<_, std::io::Error>(m.len()) }).await?;
//! # Ok(()) }
//! ```
//!
//! # Guarantees and their limits
//!
//! - **Eviction**: a record evicted under memory pressure is a key that can
//!   run again. Run Redis with `maxmemory-policy noeviction`; `connect` reads
//!   the policy and logs a warning otherwise.
//! - **Failover**: Redis replicates asynchronously. A reservation or a
//!   completion acknowledged by a primary that fails before replicating it
//!   is lost, and a redelivery can run again. [`RedisStore::wait_for_replicas`]
//!   narrows that window (`WAIT n ms` after each acquire and completion, one
//!   more round trip each; an acquisition whose `WAIT` fails, or outlasts
//!   its lease, is released, so its retry can acquire); PostgreSQL, or the tiered store with PostgreSQL
//!   as its source of truth, closes it. With `WAIT`, set
//!   `min-replicas-to-write` on the servers too: a master without enough
//!   replicas (a replica just promoted) then refuses writes at once
//!   (`NOREPLICAS`, answered [`StoreError::Unavailable`]) instead of each
//!   write waiting out its `WAIT` on the shared connection.
//! - **Timeouts**: every call is bounded by the store's settings
//!   ([`RedisStore::call_timeout`], and for `WAIT` its timeout on top), not by
//!   a response timeout fixed when the connection was made; `connect` and
//!   `connect_cluster` make connections without one.
//! - **Persistence**: a Redis restarted without AOF (`appendonly yes`) or
//!   RDB loses every record; duplicates after that run again.
//! - **Fences**: the fence of an acquisition ([`Lease::fence`]) is the
//!   server's `TIME` in microseconds, or the record's stored fence + 1 if
//!   that is higher. While the record exists (in progress, completed, or
//!   taken over) fences strictly increase whatever the clock does. After a
//!   release, a `delete` or the record's expiry the record is gone, and the
//!   next fence rests on the server's clock alone: it is higher as long as
//!   that clock does not go back. A failover to a replica whose clock is
//!   behind the old primary's (or a clock stepped backwards) can hand out a
//!   fence lower than one already given for the same key, so keep the
//!   servers' clocks synchronised (NTP, slewing rather than stepping). A
//!   record written before fences existed reads as fence 0.
//! - **Durations**: a zero lease is refused with
//!   [`StoreError::InvalidArgument`] before anything is sent. Leases,
//!   extensions and retentions are saturated to
//!   [`MAX_DURATION`](idem_core::MAX_DURATION) (`Duration::MAX` means "as
//!   long as the store can hold") and rounded up to whole milliseconds.
//!   The scripts check every argument before their first write and answer
//!   an out-of-range one with an `IDEM_INVALID` error reply
//!   ([`StoreError::InvalidArgument`]): no record is ever half written.
//! - **Resent calls**: an `acquire` that reaches Redis twice (a retry
//!   after a lost reply) finds its own token holding the key and answers
//!   "acquired" with the same fence. `delete` is a script (`delete.lua`,
//!   one round trip) that deletes the record and leaves a marker under a
//!   random id of the call, in the record's cluster slot
//!   (`{prefix}delete/{n}/{id}`, where the hash tag `{n}` maps to that
//!   slot; `{n}{prefix}delete/{id}` if the prefix has a hash tag of its
//!   own), for `max(2 × call timeout, 60 s)`: a resend finds the marker and
//!   returns the first answer without deleting again (a plain `DEL` resent
//!   would delete a reservation made since, and its key would run twice).
//! - **`WAIT` and leases**: an acquisition's `WAIT` lasts at most half the
//!   lease, and a `TIME` in the same pipeline checks that the lease is not
//!   over by the server's clock; a lease that ended while waiting (it may
//!   be taken over already) is released and answered
//!   [`StoreError::Unavailable`], never handed out.
//!
//! # Access: TLS, passwords and ACL users
//!
//! The password, or an ACL user and its password, go in the URL:
//! `redis://idem:secret@host:6379/`. TLS (feature `tls`, on rustls) is a
//! `rediss://` URL: [`RedisStore::connect`] trusts the system's roots;
//! `RedisStore::connect_tls(url, &TlsOptions::new().root_ca_file(path)?)`
//! trusts your CA only (`connect_cluster_tls` for a cluster run with
//! `tls-cluster yes`). The server's certificate must name the URL's host
//! (a DNS name, or an IP address SAN for `127.0.0.1`).
//!
//! A setting that does not match fails at once (well under the call
//! timeout) with [`StoreError::Backend`], not retryable, its message naming
//! the cause: a wrong password or user (`authentication failed`), no
//! password where one is needed (`authentication required`), a
//! certificate not signed by a trusted CA (`TLS: the server's certificate
//! is not trusted`), `redis://` to a port that speaks TLS only (`it speaks
//! TLS on this port, use a rediss:// URL`), a command or key the ACL
//! refuses (`permission denied by the ACL`). A refused or dropped
//! connection, or one that does not answer, stays
//! [`StoreError::Unavailable`] (retryable).
//!
//! The least an ACL user needs is [`acl_rules`]: for the default prefix,
//! `ACL SETUSER idem on >secret resetkeys ~idem:* resetchannels -@all
//! +evalsha +script|load +get +set +del +mget +pttl +time` (and `+wait
//! +exists` with [`RedisStore::wait_for_replicas`]).
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod format;
mod heal;
pub mod streams;
#[cfg(feature = "tls")]
mod tls;

pub use admin::{CountScan, ScannedRecord, StateCounts, StuckScan};
pub use heal::STALL_AFTER;
#[cfg(feature = "tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
pub use tls::{install_crypto_provider, TlsOptions};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    saturate, AcquireItem, Acquisition, CompletedRecord, Fingerprint, IdempotencyKey,
    IdempotencyStore, Lease, LeaseToken, Record, RecordState, StoreError, IN_PROGRESS_GRACE,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{
    Cmd, ErrorKind, FromRedisValue, RedisError, RedisWrite, Script, ServerErrorKind, ToRedisArgs,
    Value,
};

pub use idem_core;
pub use redis;

/// The Redis ACL rules the store needs for record keys under `prefix`
/// (`idem:` by default), on a standalone Redis: exactly the commands it
/// sends (`EVALSHA`, `SCRIPT LOAD` when a script is not loaded yet, `GET`
/// for [`get`](idem_core::IdempotencyStore::get)) and those its scripts run
/// (`GET SET DEL MGET PTTL TIME`), and the keys under the prefix (its
/// `delete` markers included). With `wait` ([`RedisStore::wait_for_replicas`]),
/// `WAIT`, `EXISTS` and `TIME` too. `CONFIG GET` is not needed: without it
/// the eviction check at connect logs a warning and the store goes on.
/// The operator scans (`idem` command) need `+scan` besides; Redis Streams
/// consumers their stream commands and keys.
///
/// Each rule is one argument of `ACL SETUSER` (they are joined by single
/// spaces, none holds one): paste them into `redis-cli`, a `users.acl`
/// file or a `user` line of `redis.conf`, or split them on whitespace to
/// send them from code. The store refuses a prefix with whitespace or a
/// control character ([`RedisStore::prefix`]): Redis refuses a key pattern
/// with whitespace, so no rule could name exactly such a prefix.
///
/// ```
/// assert_eq!(
///     idem_redis::acl_rules("idem:", false),
///     "resetkeys ~idem:* resetchannels -@all +evalsha +script|load +get +set +del +mget +pttl +time"
/// );
/// // ACL SETUSER idem on >password resetkeys ~idem:* resetchannels -@all +evalsha ...
/// ```
pub fn acl_rules(prefix: &str, wait: bool) -> String {
    let mut escaped = String::with_capacity(prefix.len() + 4);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    let mut rules = format!("resetkeys ~{escaped}*");
    if prefix.contains('{') {
        // `delete` markers of a prefix with a hash tag: `{n}{prefix}delete/...`.
        rules.push_str(&format!(" ~{{*}}{escaped}delete/*"));
    }
    rules.push_str(" resetchannels -@all +evalsha +script|load +get +set +del +mget +pttl +time");
    if wait {
        rules.push_str(" +wait +exists");
    }
    rules
}

/// Whether `prefix` can be a record key prefix: no whitespace (a Redis
/// ACL key pattern cannot hold it, so [`acl_rules`] could not express the
/// prefix) and no control character.
fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    match prefix
        .char_indices()
        .find(|(_, c)| c.is_whitespace() || c.is_control())
    {
        None => Ok(()),
        Some((at, c)) => Err(StoreError::InvalidArgument {
            detail: format!(
                "the key prefix {prefix:?} holds {c:?} at byte {at}: a Redis ACL key pattern cannot hold whitespace, so no ACL could give a user exactly these keys; choose a prefix without whitespace or control characters"
            ),
        }),
    }
}

/// A call that did not finish within the store's call timeout; the source
/// of [`StoreError::Unavailable`].
///
/// ```
/// use idem_core::StoreError;
/// use idem_redis::CallTimeout;
///
/// fn waited_too_long(e: &StoreError) -> bool {
///     matches!(e, StoreError::Unavailable(source) if source.downcast_ref::<CallTimeout>().is_some())
/// }
/// # let e = StoreError::Unavailable(Box::new(CallTimeout(std::time::Duration::from_millis(500))));
/// # assert!(waited_too_long(&e) && e.is_retryable());
/// ```
#[derive(Debug, thiserror::Error)]
#[error("Redis did not answer within {0:?}")]
pub struct CallTimeout(pub Duration);

/// A reply of a shape the scripts never produce (a different script loaded
/// under the same SHA, a proxy in the way); the source of
/// [`StoreError::Backend`].
///
/// ```
/// use idem_core::StoreError;
/// use idem_redis::UnexpectedReply;
///
/// fn is_unexpected_reply(e: &StoreError) -> bool {
///     matches!(e, StoreError::Backend(source) if source.downcast_ref::<UnexpectedReply>().is_some())
/// }
/// # assert!(!is_unexpected_reply(&StoreError::LeaseLost));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("unexpected reply from Redis: {0}")]
pub struct UnexpectedReply(String);

struct Scripts {
    acquire: Script,
    acquire_many: Script,
    complete_many: Script,
    complete: Script,
    release: Script,
    extend: Script,
    delete: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            acquire: Script::new(include_str!("../scripts/acquire.lua")),
            acquire_many: Script::new(include_str!("../scripts/acquire_many.lua")),
            complete_many: Script::new(include_str!("../scripts/complete_many.lua")),
            complete: Script::new(include_str!("../scripts/complete.lua")),
            release: Script::new(include_str!("../scripts/release.lua")),
            extend: Script::new(include_str!("../scripts/extend.lua")),
            delete: Script::new(include_str!("../scripts/delete.lua")),
        }
    }
}

/// The Redis [`IdempotencyStore`], over any async connection of the `redis`
/// crate that can be cloned and shared: a [`ConnectionManager`] (the
/// default of [`connect`](RedisStore::connect): one multiplexed connection
/// that pipelines concurrent calls and reconnects after a server restart),
/// a `MultiplexedConnection`, or a [`ClusterConnection`]
/// ([`connect_cluster`](RedisStore::connect_cluster)). Cloning is cheap.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Idempotency, IdempotencyKey, Processed};
/// use idem_redis::RedisStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379/")
///     .await?
///     .prefix("orders-api:")
///     .call_timeout(Duration::from_millis(500));
/// let idem = Idempotency::new(store);
/// let key = IdempotencyKey::new("orders.ship", "order-17")?;
/// match idem.process(&key, &17u64, |order| async move { Ok::<_, std::io::Error>(*order * 2) }).await? {
///     Processed::Executed(n) => println!("shipped: {n}"),
///     Processed::Replayed(n) => println!("a duplicate, already shipped: {n}"),
///     other => println!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore<C = ConnectionManager> {
    conn: Conn<C>,
    prefix: Arc<str>,
    scripts: Arc<Scripts>,
    call_timeout: Duration,
    wait: Option<(u32, Duration)>,
    max_response_bytes: usize,
    /// Batches go per hash slot: a [`ClusterConnection`], or any
    /// connection that once refused a batch with CROSSSLOT (shared by
    /// clones).
    cluster: Arc<AtomicBool>,
    /// Whether the prefix holds whitespace or a control character (see
    /// [`prefix`](Self::prefix)): checked once there, not per call.
    bad_prefix: bool,
}

/// The store's connection: one given, or one replaced when it stops
/// answering (`connect_cluster`; see the `heal` module).
#[derive(Clone)]
enum Conn<C> {
    Fixed(C),
    Healing(Arc<heal::Healer<C>>),
}

impl<C> std::fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("call_timeout", &self.call_timeout)
            .field("wait", &self.wait)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// How many times the cluster client retries a call (a resend after a lost
/// reply, a redirection, a reconnection), within the call timeout.
const CLUSTER_RETRIES: u32 = 6;
/// The default largest response: 64 MiB. A larger one is refused
/// (`StoreError::ResponseTooLarge`) before anything is written.
///
/// ```
/// assert_eq!(idem_redis::DEFAULT_MAX_RESPONSE_BYTES, 64 * 1024 * 1024);
/// ```
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 << 20;

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
        store.conn = Conn::Healing(Arc::new(heal::Healer::new(
            conn,
            connect,
            DEFAULT_TIMEOUT * 5,
        )));
        store.check_eviction_policy().await;
        Ok(store.fit_response_limit().await)
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A store over a connection you made. Defaults: prefix `idem:`, 2 s
    /// call timeout, no `WAIT`.
    ///
    /// Every call is bounded by the store's settings
    /// ([`call_timeout`](Self::call_timeout), and for `WAIT` the timeout of
    /// [`wait_for_replicas`](Self::wait_for_replicas) on top of it). A
    /// response timeout of the connection's own (the `redis` crate gives a
    /// `MultiplexedConnection` 500 ms unless told otherwise) cuts calls
    /// shorter than that: make the connection without one
    /// (`AsyncConnectionConfig::set_response_timeout(None)`), or with one
    /// longer than those settings, as [`connect`](RedisStore::connect) and
    /// [`connect_cluster`](RedisStore::connect_cluster) do.
    pub fn new(conn: C) -> Self {
        RedisStore {
            conn: Conn::Fixed(conn),
            prefix: Arc::from("idem:"),
            scripts: Arc::new(Scripts::new()),
            call_timeout: DEFAULT_TIMEOUT,
            wait: None,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            // A cluster connection takes a batch's keys per hash slot; so
            // does any other connection once Redis answered CROSSSLOT to a
            // batch (a cluster behind a type of the application's own).
            bad_prefix: false,
            cluster: Arc::new(AtomicBool::new(
                std::any::TypeId::of::<C>() == std::any::TypeId::of::<ClusterConnection>(),
            )),
        }
    }

    /// The hash slot of `key` for the silence watch of a store that
    /// replaces its connection; `None` (nothing computed) for the others.
    fn watched_slot(&self, key: &[u8]) -> Option<u16> {
        match self.conn {
            Conn::Healing(_) => Some(slot_of(key)),
            Conn::Fixed(_) => None,
        }
    }

    /// The connection to send a call on.
    pub(crate) fn connection(&self) -> C {
        match &self.conn {
            Conn::Healing(healer) => healer.current(),
            Conn::Fixed(conn) => conn.clone(),
        }
    }

    /// How many times the store replaced a connection on which no call
    /// had had an answer for [`STALL_AFTER`] (stores made by
    /// [`connect_cluster`](RedisStore::connect_cluster) do: see its docs);
    /// 0 for other stores.
    pub fn connections_replaced(&self) -> u64 {
        match &self.conn {
            Conn::Healing(healer) => healer.replaced(),
            Conn::Fixed(_) => 0,
        }
    }

    /// The largest response `complete` sends (default
    /// [`DEFAULT_MAX_RESPONSE_BYTES`]; `connect` lowers it to a quarter of
    /// the server's `maxmemory` when one is set). A larger one is refused
    /// with [`StoreError::ResponseTooLarge`] before anything is sent, and
    /// the executor completes the key as not replayable. Without the
    /// limit, a response Redis cannot hold is refused by Redis itself
    /// (OOM), whose query buffer can then refuse the small "not
    /// replayable" marker too, leaving the key in progress until its lease
    /// ends.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.max_response_bytes = max;
        self
    }

    /// Lowers the response limit to a quarter of the server's `maxmemory`,
    /// when one is set and `CONFIG GET` is allowed.
    async fn fit_response_limit(mut self) -> Self {
        let mut conn = self.connection();
        let reply: Result<Vec<String>, _> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory")
            .query_async(&mut conn)
            .await;
        if let Ok(pair) = reply {
            if let Some(max) = pair.get(1).and_then(|m| m.parse::<u64>().ok()) {
                if max > 0 {
                    let quarter = usize::try_from(max / 4).unwrap_or(usize::MAX);
                    self.max_response_bytes = self.max_response_bytes.min(quarter.max(1));
                }
            }
        }
        self
    }

    /// The prefix of every record key (default `idem:`). Give each
    /// application or environment sharing a Redis its own.
    ///
    /// A prefix with whitespace or a control character is refused: a Redis
    /// ACL key pattern cannot hold whitespace (`ACL SETUSER` answers
    /// "Syntax error"), so no ACL could give a user exactly those keys
    /// ([`acl_rules`]). This method keeps its chaining signature: with such
    /// a prefix, every call of the store fails with
    /// [`StoreError::InvalidArgument`] naming it (a consumer stops at its
    /// first entry, as for any setting that cannot work). Use
    /// [`try_prefix`](Self::try_prefix) to have the error here.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        let refused = check_prefix(&prefix);
        self.bad_prefix = refused.is_err();
        if let Err(e) = refused {
            tracing::error!(error = %e, "RedisStore: key prefix refused: every call will fail");
        }
        self.prefix = Arc::from(prefix);
        self
    }

    /// [`prefix`](Self::prefix), with a prefix that holds whitespace or a
    /// control character refused here, as [`StoreError::InvalidArgument`].
    ///
    /// ```
    /// # use idem_redis::RedisStore;
    /// # fn check(store: RedisStore) {
    /// assert!(store.clone().try_prefix("orders-api:").is_ok());
    /// assert!(store.try_prefix("orders api:").is_err());
    /// # }
    /// ```
    pub fn try_prefix(self, prefix: impl Into<String>) -> Result<Self, StoreError> {
        let prefix = prefix.into();
        check_prefix(&prefix)?;
        Ok(self.prefix(prefix))
    }

    /// The longest one call may take before it fails with
    /// [`StoreError::Unavailable`] (default 2 s).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// How long a `delete` call's marker lives: longer than any resend of
    /// that call (the client resends only within the call, bounded by the
    /// call timeout), at least a minute.
    fn delete_marker_ttl(&self) -> Duration {
        self.call_timeout
            .saturating_mul(2)
            .max(Duration::from_secs(60))
    }

    /// After each acquisition and completion, wait until `replicas` replicas
    /// acknowledged it (`WAIT`), for at most `timeout`; fewer acknowledgements
    /// give [`StoreError::Unavailable`]. Narrows, but cannot close, the
    /// failover window (Redis replication is asynchronous). One more round
    /// trip per acquisition and completion.
    ///
    /// The `WAIT` call may take `timeout` plus the
    /// [`call_timeout`](Self::call_timeout) before the client gives up.
    ///
    /// **After an acquisition, `WAIT` never outlasts the lease**: its
    /// timeout is `min(timeout, lease / 2)` (at least 1 ms), and a `TIME`
    /// sent in the same pipeline (run when `WAIT` returns) checks the
    /// lease's deadline, which the acquire script computed by the same
    /// server clock. A lease that is over by then (a takeover may already
    /// hold the key) is never reported: the acquisition is released and
    /// the caller gets [`StoreError::Unavailable`]. Under a replica lag
    /// longer than half the lease, acquisitions fail with `Unavailable`
    /// until the replica catches up; give a longer lease to wait longer.
    /// An acquisition whose `WAIT` fails is released before the error is
    /// returned (one more round trip, on that path only), so the retry can
    /// acquire the key; if the release fails too, the key stays in
    /// progress until its lease ends. A completion whose `WAIT` fails
    /// stays completed: the executor's retry of the completion finds it
    /// done and waits again. `timeout` is saturated to
    /// [`MAX_DURATION`](idem_core::MAX_DURATION), and a zero one is taken
    /// as 1 ms (Redis reads `WAIT n 0` as "wait forever").
    ///
    /// **While a master has fewer replicas than `replicas`** (one just
    /// promoted by a failover has none), every write to its slots fails
    /// with `Unavailable` until a replica is back: with one replica per
    /// master, a failover makes `wait_for_replicas(1, ..)` refuse that
    /// shard's writes until the old master (or a new node) rejoins as its
    /// replica. Give each master two replicas to stay writable through
    /// one failover. And `WAIT` blocks the connection it is sent on until
    /// it returns: on the multiplexed connection, every call to that node
    /// (replays and reads too) queues behind `WAIT`s that each last their
    /// full timeout, and an acquisition that ran on the server after its
    /// caller gave up holds its key until its lease ends. Set
    /// `min-replicas-to-write` to the same `replicas` on the servers: a
    /// master without enough replicas then refuses writes at once
    /// (`NOREPLICAS`, answered [`StoreError::Unavailable`]), and replays
    /// and reads keep working (figures in the repository's RELIABILITY.md,
    /// `tests/failover_redis.rs`).
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some((replicas, saturate(timeout).max(Duration::from_millis(1))));
        self
    }

    /// The Redis key of a record: `{prefix}{scope}/{id}`. Scopes may hold
    /// `:` but never `/`, so the first `/` ends the scope and no two keys
    /// share a record.
    pub fn redis_key(&self, key: &IdempotencyKey) -> String {
        let mut k =
            String::with_capacity(self.prefix.len() + key.scope().len() + key.id().len() + 1);
        k.push_str(&self.prefix);
        k.push_str(key.scope());
        k.push('/');
        k.push_str(key.id());
        k
    }

    /// Reads `maxmemory-policy` and logs a warning unless it is
    /// `noeviction`: with an eviction policy, Redis may drop live records
    /// under memory pressure, and a dropped record is a key that can run
    /// again. Returns the policy, or `None` if `CONFIG GET` is not allowed
    /// (managed services often forbid it).
    pub async fn check_eviction_policy(&self) -> Option<String> {
        let mut conn = self.connection();
        let reply: Result<Vec<String>, _> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(pair) if pair.len() == 2 => {
                let policy = pair[1].clone();
                if policy != "noeviction" {
                    tracing::warn!(
                        policy = %policy,
                        "Redis maxmemory-policy is not noeviction: live idempotency records can be evicted under memory pressure, and an evicted key runs again"
                    );
                }
                Some(policy)
            }
            Ok(_) => None,
            Err(e) => {
                // A user limited by an ACL (see the crate docs), or a
                // managed service: the store works without it.
                tracing::warn!(
                    error = %e,
                    "cannot read maxmemory-policy (CONFIG GET refused?): make sure this Redis runs with noeviction, or live idempotency records can be evicted"
                );
                None
            }
        }
    }

    async fn timed<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, RedisError>>,
    {
        self.timed_for(self.call_timeout, None, call).await
    }

    /// `call` within `limit`; `slot`: the hash slot of its key, if it
    /// has one (a store that replaces a silent connection watches each
    /// slot too: one master frozen while its replica takes over leaves
    /// only its slots silent).
    async fn timed_for<T, F>(
        &self,
        limit: Duration,
        slot: Option<u16>,
        call: F,
    ) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, RedisError>>,
    {
        // Every call to the server comes here: a refused prefix fails them
        // all, before anything is sent (see `prefix`).
        if self.bad_prefix {
            check_prefix(&self.prefix)?;
        }
        match tokio::time::timeout(limit, call).await {
            Ok(result) => {
                if let Conn::Healing(healer) = &self.conn {
                    healer.answered(slot);
                }
                result.map_err(map_error)
            }
            Err(_) => {
                if let Conn::Healing(healer) = &self.conn {
                    healer.timed_out(slot);
                }
                Err(StoreError::Unavailable(Box::new(CallTimeout(limit))))
            }
        }
    }

    /// The batch's items grouped for one script call each: all in one
    /// group, or on Redis Cluster one group per hash slot (a script's keys
    /// must share a slot). Indexes into the items, in order within a group.
    fn slot_groups<'k>(&self, keys: impl Iterator<Item = &'k IdempotencyKey>) -> Vec<Vec<usize>> {
        if !self.cluster.load(Ordering::Relaxed) {
            return vec![keys.enumerate().map(|(i, _)| i).collect()];
        }
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, key) in keys.enumerate() {
            let slot = slot_of(self.redis_key(key).as_bytes());
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, group)) => group.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups.into_iter().map(|(_, group)| group).collect()
    }

    /// An `EVALSHA` of `script` on the record of `key`, its name written
    /// straight into the command (no `String` per call); the caller appends
    /// `args` arguments of about `bytes` bytes in all.
    fn evalsha(&self, script: &Script, key: &IdempotencyKey, args: usize, bytes: usize) -> Cmd {
        let name = self.prefix.len() + key.scope().len() + 1 + key.id().len();
        let mut cmd = Cmd::with_capacity(4 + args, 48 + name + bytes);
        cmd.arg("EVALSHA")
            .arg(script.get_hash())
            .arg(1)
            .arg(RecordKey {
                prefix: &self.prefix,
                key,
            });
        cmd
    }

    /// Runs a command made by [`evalsha`](Self::evalsha) within the call
    /// timeout; a server that does not know the script (restarted,
    /// `SCRIPT FLUSH`) gets it loaded and the command again, as
    /// `redis::Script` does.
    async fn run_script<T: FromRedisValue>(
        &self,
        script: &Script,
        cmd: &Cmd,
    ) -> Result<T, StoreError> {
        let mut conn = self.connection();
        // EVALSHA sha 1 key ...: the slot of the key.
        let slot = match cmd.args_iter().nth(3) {
            Some(redis::Arg::Simple(key)) => self.watched_slot(key),
            _ => None,
        };
        self.timed_for(self.call_timeout, slot, async {
            match cmd.query_async(&mut conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    script.load_async(&mut conn).await?;
                    cmd.query_async(&mut conn).await
                }
                other => other,
            }
        })
        .await
    }

    /// `WAIT`s for the replicas. For an acquisition (`lease`: its length
    /// and its deadline, by the server's clock, as the script returned
    /// it), the `WAIT` lasts at most half the lease, and a `TIME` in the
    /// same pipeline (run when `WAIT` returns) checks that the lease is
    /// not over by the server's clock: a lease that ended while waiting
    /// may already be taken over, and is never reported.
    async fn wait_replicas(
        &self,
        redis_key: &str,
        lease: Option<(Duration, SystemTime)>,
    ) -> Result<(), StoreError> {
        let Some((replicas, configured)) = self.wait else {
            return Ok(());
        };
        let timeout = match lease {
            Some((length, _)) => configured.min((length / 2).max(Duration::from_millis(1))),
            None => configured,
        };
        let mut conn = self.connection();
        // Routed by the key, so a cluster sends it to the primary that owns it.
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(replicas).arg(millis(timeout));
        // WAIT itself may take `timeout`: the client's limit is on top.
        let limit = timeout.saturating_add(self.call_timeout);
        let (acked, now): (i64, Option<Duration>) = self
            .timed_for(limit, self.watched_slot(redis_key.as_bytes()), async {
                let mut pipe = redis::pipe();
                // An EXISTS on the key in front routes the pipeline to the
                // key's node in a cluster; WAIT's reply is the second.
                pipe.cmd("EXISTS").arg(redis_key).ignore().add_command(cmd);
                if lease.is_some() {
                    pipe.cmd("TIME");
                    let (acked, (secs, micros)): (i64, (u64, u64)) =
                        pipe.query_async(&mut conn).await?;
                    let now =
                        Duration::from_secs(secs).saturating_add(Duration::from_micros(micros));
                    Ok((acked, Some(now)))
                } else {
                    let (acked,): (i64,) = pipe.query_async(&mut conn).await?;
                    Ok((acked, None))
                }
            })
            .await?;
        if acked < i64::from(replicas) {
            return Err(StoreError::Unavailable(
                format!("WAIT: {acked} of {replicas} replicas acknowledged within {timeout:?}")
                    .into(),
            ));
        }
        if let (Some((_, until)), Some(now)) = (lease, now) {
            let until = until.duration_since(UNIX_EPOCH).unwrap_or_default();
            if now >= until {
                return Err(StoreError::Unavailable(
                    format!(
                        "the lease ended while waiting for the replicas ({:?} past its deadline by the server's clock)",
                        now - until
                    )
                    .into(),
                ));
            }
        }
        Ok(())
    }
}

#[async_trait]
impl<C> IdempotencyStore for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn backend_name(&self) -> &'static str {
        "redis"
    }

    async fn acquire(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        // Refused here, before the round trip: nothing is written.
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let lease_length = lease;
        let token = LeaseToken::random();
        let fp: &[u8] = fingerprint.map(|f| f.as_bytes().as_slice()).unwrap_or(&[]);
        let mut cmd = self.evalsha(&self.scripts.acquire, key, 4, 48);
        cmd.arg(fp)
            .arg(&token.to_bytes()[..])
            .arg(millis(lease))
            .arg(millis(IN_PROGRESS_GRACE));
        let reply: Value = self.run_script(&self.scripts.acquire, &cmd).await?;
        let outcome = decode_acquire(reply, key, token)?;
        if let (Acquisition::Acquired(lease), Some(_)) = (&outcome, self.wait) {
            let redis_key = self.redis_key(key);
            if let Err(e) = self
                .wait_replicas(&redis_key, Some((lease_length, lease.expires_at)))
                .await
            {
                // Not durable enough, or the lease ended meanwhile: the
                // caller is told Unavailable and will not run the handler,
                // so the reservation goes too, or the retry would find the
                // key in progress for a lease. (A lease taken over answers
                // LeaseLost: the new holder keeps the key.)
                if let Err(released) = self.release(lease).await {
                    tracing::warn!(
                        key = %redis_key, error = %released,
                        "WAIT failed and the reservation could not be released: the key stays in progress until its lease ends"
                    );
                }
                return Err(e);
            }
        }
        Ok(outcome)
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        if response.len() > self.max_response_bytes {
            return Err(StoreError::ResponseTooLarge {
                size: response.len(),
                limit: self.max_response_bytes,
            });
        }
        let mut cmd = self.evalsha(&self.scripts.complete, &lease.key, 3, 32 + response.len());
        cmd.arg(&lease.token.to_bytes()[..])
            .arg(response)
            .arg(millis(retention));
        let done: i64 = self.run_script(&self.scripts.complete, &cmd).await?;
        if done != 1 {
            return Err(StoreError::LeaseLost);
        }
        if self.wait.is_some() {
            self.wait_replicas(&self.redis_key(&lease.key), None)
                .await?;
        }
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let mut cmd = self.evalsha(&self.scripts.release, &lease.key, 1, 16);
        cmd.arg(&lease.token.to_bytes()[..]);
        let done: i64 = self.run_script(&self.scripts.release, &cmd).await?;
        if done == 1 {
            Ok(())
        } else {
            Err(StoreError::LeaseLost)
        }
    }

    async fn extend(&self, lease: &Lease, lease_for: Duration) -> Result<Lease, StoreError> {
        // Refused here, before the round trip: the lease stays as it was.
        if lease_for.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let mut cmd = self.evalsha(&self.scripts.extend, &lease.key, 3, 48);
        cmd.arg(&lease.token.to_bytes()[..])
            .arg(millis(lease_for))
            .arg(millis(IN_PROGRESS_GRACE));
        let reply: Value = self.run_script(&self.scripts.extend, &cmd).await?;
        let key = &lease.key;
        match reply {
            Value::Int(0) => Err(StoreError::LeaseLost),
            Value::Array(items) if items.len() == 3 => {
                let attempt = attempt_of(int(&items[0], key)?, key)?;
                let until = time_of(int(&items[1], key)?, key)?;
                let fence = fence_of(int(&items[2], key)?, key)?;
                Ok(Lease::new(key.clone(), lease.token, attempt, until)
                    .with_fence(fence)
                    .with_fingerprint(lease.fingerprint))
            }
            other => Err(unexpected(format!("extend returned {other:?}"))),
        }
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let redis_key = self.redis_key(key);
        let mut conn = self.connection();
        let slot = self.watched_slot(redis_key.as_bytes());
        let reply = self
            .timed_for(self.call_timeout, slot, async {
                redis::cmd("GET")
                    .arg(&redis_key)
                    .query_async::<Value>(&mut conn)
                    .await
            })
            .await;
        match reply {
            Ok(Value::Nil) => Ok(None),
            Ok(Value::BulkString(raw)) => decode_record(Bytes::from(raw), key).map(Some),
            Ok(other) => Err(unexpected(format!("GET returned {other:?}"))),
            Err(StoreError::Backend(e)) if is_wrong_type(&*e) => {
                Err(corrupt(key, "the record is not a string"))
            }
            Err(e) => Err(e),
        }
    }

    // One script, one round trip, harmless to resend: see `delete_marker`
    // and `scripts/delete.lua`.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let redis_key = self.redis_key(key);
        let mut conn = self.connection();
        let request = LeaseToken::random().to_hex();
        let removed: i64 = match delete_marker(&self.prefix, &redis_key, &request) {
            Some(marker) => {
                let mut invocation = self.scripts.delete.prepare_invoke();
                invocation
                    .key(&redis_key)
                    .key(&marker)
                    .arg(millis(self.delete_marker_ttl()));
                let slot = self.watched_slot(redis_key.as_bytes());
                self.timed_for(self.call_timeout, slot, invocation.invoke_async(&mut conn))
                    .await?
            }
            // Unreachable (a marker in the record's slot always exists);
            // kept so that a bug there degrades to the old plain DEL.
            None => {
                tracing::warn!(key = %redis_key, "no delete marker in the record's slot: plain DEL, not safe to resend");
                self.timed(async {
                    redis::cmd("DEL")
                        .arg(&redis_key)
                        .query_async(&mut conn)
                        .await
                })
                .await?
            }
        };
        Ok(removed > 0)
    }

    /// Redis expires records by itself (`PEXPIREAT`): nothing to purge.
    async fn purge_expired(&self, _max: usize) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// One `acquire_many.lua` call for the whole batch (on Redis Cluster,
    /// one per hash slot, all sent at once), each key processed as
    /// `acquire` would, in order. With [`wait_for_replicas`](Self::wait_for_replicas)
    /// set, each acquired lease is then confirmed as `acquire` confirms it.
    async fn acquire_many(
        &self,
        items: &[AcquireItem<'_>],
        lease: Duration,
    ) -> Result<Vec<Result<Acquisition, StoreError>>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        let tokens: Vec<LeaseToken> = items.iter().map(|_| LeaseToken::random()).collect();
        let mut out: Vec<Option<Result<Acquisition, StoreError>>> =
            items.iter().map(|_| None).collect();
        // Per hash slot on a cluster. A single call for every key that
        // Redis refused with CROSSSLOT (a cluster behind another
        // connection type) ran nothing: sent again per slot, and every
        // later batch of this store goes per slot.
        let answers = loop {
            let per_slot = self.cluster.load(Ordering::Relaxed);
            let calls = self
                .slot_groups(items.iter().map(|item| item.key))
                .into_iter()
                .map(|group| {
                    let mut cmd = Cmd::with_capacity(3 + 3 * group.len(), 64 + 120 * group.len());
                    cmd.arg("EVALSHA")
                        .arg(self.scripts.acquire_many.get_hash())
                        .arg(group.len());
                    for &i in &group {
                        cmd.arg(RecordKey {
                            prefix: &self.prefix,
                            key: items[i].key,
                        });
                    }
                    cmd.arg(millis(lease)).arg(millis(IN_PROGRESS_GRACE));
                    for &i in &group {
                        let fp: &[u8] = items[i]
                            .fingerprint
                            .map(|f| f.as_bytes().as_slice())
                            .unwrap_or(&[]);
                        cmd.arg(fp).arg(&tokens[i].to_bytes()[..]);
                    }
                    async move {
                        let reply: Value =
                            self.run_script(&self.scripts.acquire_many, &cmd).await?;
                        Ok::<_, StoreError>((group, reply))
                    }
                });
            let answers = futures_util::future::join_all(calls).await;
            if !per_slot
                && answers
                    .iter()
                    .any(|a| matches!(a, Err(e) if is_cross_slot(e)))
            {
                self.cluster.store(true, Ordering::Relaxed);
                continue;
            }
            break answers;
        };
        let mut groups = Vec::new();
        for answer in answers {
            let (group, reply) = answer?;
            let replies = match reply {
                Value::Array(replies) if replies.len() == group.len() => replies,
                other => {
                    return Err(unexpected(format!(
                        "acquire_many returned {other:?} for {} keys",
                        group.len()
                    )))
                }
            };
            for (&i, reply) in group.iter().zip(replies) {
                out[i] = Some(decode_acquire(reply, items[i].key, tokens[i]));
            }
            groups.push(group);
        }
        let mut out: Vec<Result<Acquisition, StoreError>> = out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Err(unexpected("acquire_many left a key unanswered".into())))
            })
            .collect();
        if self.wait.is_some() {
            // One WAIT per script call (it covers every write made before
            // it on that node), bounded by the leases as `acquire`'s is.
            for group in groups {
                let held: Vec<usize> = group
                    .into_iter()
                    .filter(|&i| matches!(out[i], Ok(Acquisition::Acquired(_))))
                    .collect();
                let Some(deadline) = held
                    .iter()
                    .filter_map(|&i| match &out[i] {
                        Ok(Acquisition::Acquired(l)) => Some(l.expires_at),
                        _ => None,
                    })
                    .min()
                else {
                    continue;
                };
                let redis_key = self.redis_key(items[held[0]].key);
                if let Err(e) = self
                    .wait_replicas(&redis_key, Some((lease, deadline)))
                    .await
                {
                    let detail = e.to_string();
                    for i in held {
                        if let Ok(Acquisition::Acquired(l)) = &out[i] {
                            if let Err(released) = self.release(l).await {
                                tracing::warn!(
                                    key = %self.redis_key(items[i].key), error = %released,
                                    "WAIT failed and the reservation could not be released: the key stays in progress until its lease ends"
                                );
                            }
                        }
                        out[i] = Err(StoreError::unavailable(detail.clone()));
                    }
                }
            }
        }
        Ok(out)
    }

    /// One `complete_many.lua` call for the whole batch (per hash slot on
    /// Redis Cluster), each lease completed as `complete` would.
    async fn complete_many(
        &self,
        items: &[(&Lease, &[u8])],
        retention: Duration,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out: Vec<Option<Result<(), StoreError>>> = items
            .iter()
            .map(|(_, response)| {
                (response.len() > self.max_response_bytes).then(|| {
                    Err(StoreError::ResponseTooLarge {
                        size: response.len(),
                        limit: self.max_response_bytes,
                    })
                })
            })
            .collect();
        let sent: Vec<usize> = (0..items.len()).filter(|&i| out[i].is_none()).collect();
        if sent.is_empty() {
            return Ok(out.into_iter().flatten().collect());
        }
        // Per hash slot on a cluster. A single call for every key that
        // Redis refused with CROSSSLOT (a cluster behind another
        // connection type) ran nothing: sent again per slot, and every
        // later batch of this store goes per slot.
        let answers = loop {
            let per_slot = self.cluster.load(Ordering::Relaxed);
            let calls = self
                .slot_groups(sent.iter().map(|&i| &items[i].0.key))
                .into_iter()
                .map(|group| {
                    // `group` indexes `sent`.
                    let group: Vec<usize> = group.into_iter().map(|g| sent[g]).collect();
                    let bytes: usize = group.iter().map(|&i| items[i].1.len() + 80).sum();
                    let mut cmd = Cmd::with_capacity(3 + 3 * group.len(), 64 + bytes);
                    cmd.arg("EVALSHA")
                        .arg(self.scripts.complete_many.get_hash())
                        .arg(group.len());
                    for &i in &group {
                        cmd.arg(RecordKey {
                            prefix: &self.prefix,
                            key: &items[i].0.key,
                        });
                    }
                    cmd.arg(millis(retention));
                    for &i in &group {
                        cmd.arg(&items[i].0.token.to_bytes()[..]).arg(items[i].1);
                    }
                    async move {
                        let done: Vec<i64> =
                            self.run_script(&self.scripts.complete_many, &cmd).await?;
                        Ok::<_, StoreError>((group, done))
                    }
                });
            let answers = futures_util::future::join_all(calls).await;
            if !per_slot
                && answers
                    .iter()
                    .any(|a| matches!(a, Err(e) if is_cross_slot(e)))
            {
                self.cluster.store(true, Ordering::Relaxed);
                continue;
            }
            break answers;
        };
        let mut groups = Vec::new();
        for answer in answers {
            let (group, done) = answer?;
            if done.len() != group.len() {
                return Err(unexpected(format!(
                    "complete_many returned {} answers for {} keys",
                    done.len(),
                    group.len()
                )));
            }
            for (&i, done) in group.iter().zip(done) {
                out[i] = Some(if done == 1 {
                    Ok(())
                } else {
                    Err(StoreError::LeaseLost)
                });
            }
            groups.push(group);
        }
        let mut out: Vec<Result<(), StoreError>> = out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Err(unexpected("complete_many left a key unanswered".into())))
            })
            .collect();
        if self.wait.is_some() {
            for group in groups {
                let done: Vec<usize> = group.into_iter().filter(|&i| out[i].is_ok()).collect();
                let Some(&first) = done.first() else { continue };
                let redis_key = self.redis_key(&items[first].0.key);
                if let Err(e) = self.wait_replicas(&redis_key, None).await {
                    let detail = e.to_string();
                    for i in done {
                        out[i] = Err(StoreError::unavailable(detail.clone()));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A record's Redis key, `{prefix}{scope}/{id}`, as a command argument
/// written in place.
struct RecordKey<'a> {
    prefix: &'a str,
    key: &'a IdempotencyKey,
}

impl ToRedisArgs for RecordKey<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut w = out.writer_for_next_arg();
        // Writes into a Vec: they cannot fail.
        let _ = w.write_all(self.prefix.as_bytes());
        let _ = w.write_all(self.key.scope().as_bytes());
        let _ = w.write_all(b"/");
        let _ = w.write_all(self.key.id().as_bytes());
    }
}

/// The number of Redis Cluster hash slots.
const SLOTS: u16 = 16384;

/// CRC16 (XMODEM), the hash of Redis Cluster's key slots.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The cluster slot of a key: of its hash tag (the bytes between the first
/// `{` and the first `}` after it, when not empty), else of the whole key.
fn slot_of(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&c| c == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let len = rest.iter().position(|&c| c == b'}')?;
            (len > 0).then(|| &rest[..len])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS
}

/// For every slot, the smallest number whose decimal digits hash to it:
/// a hash tag `{n}` that puts a key in that slot. Made once (about 170,000
/// CRCs of a few bytes).
fn slot_tags() -> &'static [u32] {
    static TAGS: OnceLock<Vec<u32>> = OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags = vec![u32::MAX; usize::from(SLOTS)];
        let mut left = usize::from(SLOTS);
        let mut n: u32 = 0;
        while left > 0 && n < u32::MAX {
            let slot = usize::from(slot_of(n.to_string().as_bytes()));
            if tags[slot] == u32::MAX {
                tags[slot] = n;
                left -= 1;
            }
            n += 1;
        }
        tags
    })
}

/// The key of one `delete` call's marker (`request` is its random id): in
/// the record's hash slot, so the script touching both works on Redis
/// Cluster. `{prefix}delete/{n}/{request}`, where the hash tag `{n}` maps
/// to the record's slot; if the prefix holds a hash tag of its own (then
/// the record key's tag too), `{n}{prefix}delete/{request}`. Checked
/// against the `redis` crate's own slot computation; `None` (never seen:
/// the table covers every slot) means no such key was found.
fn delete_marker(prefix: &str, redis_key: &str, request: &str) -> Option<String> {
    let slot = slot_of(redis_key.as_bytes());
    let tag = *slot_tags().get(usize::from(slot))?;
    if tag == u32::MAX {
        return None;
    }
    let same_slot = |marker: &str| {
        redis::cluster_routing::Slot::for_key(marker)
            == redis::cluster_routing::Slot::for_key(redis_key)
    };
    [
        format!("{prefix}delete/{{{tag}}}/{request}"),
        format!("{{{tag}}}{prefix}delete/{request}"),
    ]
    .into_iter()
    .find(|marker| same_slot(marker))
}

/// `d` in whole milliseconds for a script: saturated to
/// [`MAX_DURATION`](idem_core::MAX_DURATION) (so no deadline the script
/// computes overflows what `PEXPIREAT` takes), and rounded up, so a lease of
/// less than a millisecond is not a zero lease.
fn millis(d: Duration) -> u64 {
    let d = saturate(d);
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    // MAX_DURATION is about 3.2e12 ms: always fits.
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// The code of the scripts' error reply for an argument they refuse.
const INVALID_CODE: &str = "IDEM_INVALID";

/// The code of Redis's refusal of a write for want of good replicas
/// (`min-replicas-to-write`).
const NO_REPLICAS_CODE: &str = "NOREPLICAS";

fn map_error(e: RedisError) -> StoreError {
    if e.code() == Some(INVALID_CODE) {
        // A script refused an argument before writing anything.
        return StoreError::InvalidArgument {
            detail: e.detail().unwrap_or("refused by the script").to_owned(),
        };
    }
    if let Some(cause) = refused_setting(&e) {
        // Wrong credentials, an ACL that refuses a command or a key, a
        // certificate not trusted: every retry fails alike.
        return StoreError::Backend(Box::new(Refused { cause, source: e }));
    }
    if is_transient(&e) {
        StoreError::Unavailable(Box::new(e))
    } else {
        StoreError::Backend(Box::new(e))
    }
}

/// Whether trying again later can succeed: a connection refused, dropped
/// or timed out, a cluster redirection or reconfiguration, or a master
/// under `min-replicas-to-write` without enough good replicas (one just
/// promoted, a replica away), which refuses writes until one is back: a
/// passing condition, like `WAIT` falling short.
fn is_transient(e: &RedisError) -> bool {
    use redis::RetryMethod;
    e.code() == Some(NO_REPLICAS_CODE)
        || e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.retry_method(),
            RetryMethod::Reconnect
                | RetryMethod::RetryImmediately
                | RetryMethod::WaitAndRetry
                | RetryMethod::ReconnectFromInitialConnections
                | RetryMethod::RefreshSlotsAndRetry
        )
}

/// A call or a connection refused because of a setting (credentials, ACL,
/// TLS): the source of [`StoreError::Backend`], its message the cause in
/// words.
///
/// ```
/// use idem_core::StoreError;
/// use idem_redis::Refused;
///
/// fn misconfigured(e: &StoreError) -> bool {
///     matches!(e, StoreError::Backend(source) if source.downcast_ref::<Refused>().is_some())
/// }
/// # assert!(!misconfigured(&StoreError::LeaseLost));
/// ```
#[derive(Debug, thiserror::Error)]
#[error("{cause}")]
pub struct Refused {
    cause: String,
    #[source]
    source: RedisError,
}

impl Refused {
    /// The cause, in words: `authentication failed: ...`, `permission
    /// denied by the ACL: ...`, `TLS: ...`.
    pub fn cause(&self) -> &str {
        &self.cause
    }
}

/// The cause, if `e` is a refusal that only a change of settings cures.
fn refused_setting(e: &RedisError) -> Option<String> {
    #[cfg(feature = "tls")]
    if let Some(tls) = tls::tls_error(e) {
        if tls::is_setting(tls) {
            return Some(tls::describe(tls));
        }
    }
    if e.kind() == ErrorKind::AuthenticationFailed {
        return Some(format!(
            "authentication failed: wrong password or user name, or the user is disabled (give them in the URL: redis[s]://user:password@host:port/) [{e}]"
        ));
    }
    // A command refused to a script (Redis 7.0 answers ERR, not NOPERM).
    let acl_in_script = e.code() != Some("NOPERM")
        && e.detail()
            .is_some_and(|d| d.contains("user executing the script can't run"));
    if acl_in_script {
        return Some(format!(
            "permission denied by the ACL: a command the store's scripts run is not allowed to this user (the idem-redis docs list the ACL the store needs) [{e}]"
        ));
    }
    match e.code() {
        Some("NOAUTH") => Some(format!(
            "authentication required: the server has a password (requirepass or an ACL user) and the URL gives none [{e}]"
        )),
        Some("WRONGPASS") => Some(format!(
            "authentication failed: wrong password or user name [{e}]"
        )),
        Some("NOPERM") => Some(format!(
            "permission denied by the ACL: the user may not run this command or touch this key (the idem-redis docs list the ACL the store needs) [{e}]"
        )),
        _ => None,
    }
}

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

/// Whether Redis (or the cluster client) refused a call whose keys span
/// hash slots: refused before anything ran.
fn is_cross_slot(e: &StoreError) -> bool {
    match e {
        StoreError::Backend(e) | StoreError::Unavailable(e) => e
            .downcast_ref::<RedisError>()
            .is_some_and(|r| r.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot)),
        _ => false,
    }
}

fn is_wrong_type(e: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    e.downcast_ref::<RedisError>()
        .is_some_and(|r| r.code() == Some("WRONGTYPE"))
}

fn corrupt(key: &IdempotencyKey, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        key: key.clone(),
        detail: detail.into(),
    }
}

fn unexpected(detail: String) -> StoreError {
    StoreError::Backend(Box::new(UnexpectedReply(detail)))
}

fn int(v: &Value, key: &IdempotencyKey) -> Result<i64, StoreError> {
    match v {
        Value::Int(n) => Ok(*n),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(key, "a number field is not a number")),
        other => Err(unexpected(format!("expected a number, got {other:?}"))),
    }
}

fn bytes_of(v: Value) -> Result<Vec<u8>, StoreError> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.into_bytes()),
        other => Err(unexpected(format!("expected a string, got {other:?}"))),
    }
}

fn time_of(ms: i64, key: &IdempotencyKey) -> Result<SystemTime, StoreError> {
    u64::try_from(ms)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
        .map_err(|_| corrupt(key, format!("time {ms} ms is before 1970")))
}

/// A stored time in ms (decoded as u64, at most 2^53 - 1: no overflow).
fn time_ms(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

fn fence_of(n: i64, key: &IdempotencyKey) -> Result<u64, StoreError> {
    u64::try_from(n).map_err(|_| corrupt(key, format!("fence {n} is negative")))
}

fn attempt_of(a: i64, key: &IdempotencyKey) -> Result<u32, StoreError> {
    u32::try_from(a)
        .ok()
        .filter(|a| *a > 0)
        .ok_or_else(|| corrupt(key, format!("attempt {a} is not positive")))
}

fn fingerprint_of(b: &[u8], key: &IdempotencyKey) -> Result<Option<Fingerprint>, StoreError> {
    if b.is_empty() {
        return Ok(None);
    }
    Fingerprint::from_slice(b)
        .map(Some)
        .ok_or_else(|| corrupt(key, format!("fingerprint is {} bytes, not 32", b.len())))
}

fn decode_acquire(
    reply: Value,
    key: &IdempotencyKey,
    token: LeaseToken,
) -> Result<Acquisition, StoreError> {
    let Value::Array(items) = reply else {
        return Err(unexpected(format!("acquire returned {reply:?}")));
    };
    let mut items = items.into_iter();
    let tag = items.next().map(bytes_of).transpose()?.unwrap_or_default();
    let rest: Vec<Value> = items.collect();
    match (tag.as_slice(), rest.len()) {
        (b"acquired", 4) => {
            let attempt = attempt_of(int(&rest[0], key)?, key)?;
            let until = time_of(int(&rest[1], key)?, key)?;
            let fence = fence_of(int(&rest[3], key)?, key)?;
            let stored = rest
                .into_iter()
                .nth(2)
                .map(bytes_of)
                .transpose()?
                .unwrap_or_default();
            Ok(Acquisition::Acquired(
                Lease::new(key.clone(), token, attempt, until)
                    .with_fence(fence)
                    .with_fingerprint(fingerprint_of(&stored, key)?),
            ))
        }
        (b"completed", 2) => {
            let mut rest = rest.into_iter();
            let raw = match rest.next() {
                Some(Value::BulkString(b)) => Bytes::from(b),
                other => return Err(unexpected(format!("acquire returned a record {other:?}"))),
            };
            // Time left by the server's clock (its PTTL, or expiry minus TIME).
            let ttl = match rest.next() {
                Some(v) => Duration::from_millis(u64::try_from(int(&v, key)?).unwrap_or(0)),
                None => Duration::ZERO,
            };
            let stored = format::decode(raw).map_err(|detail| corrupt(key, detail))?;
            if !stored.completed {
                return Err(unexpected("acquire replayed a record in progress".into()));
            }
            Ok(Acquisition::Completed(
                CompletedRecord::new(
                    key.clone(),
                    stored.response,
                    stored.fingerprint.map(Fingerprint::from_array),
                    stored.attempt,
                    time_ms(stored.completed_ms),
                    time_ms(stored.expires_ms),
                )
                .with_fence(stored.fence)
                .with_ttl(ttl),
            ))
        }
        (b"in_progress", 3) => {
            let until_ms = int(&rest[0], key)?;
            let attempt = attempt_of(int(&rest[1], key)?, key)?;
            let now_ms = int(&rest[2], key)?;
            Ok(Acquisition::InProgress {
                lease_expires_at: time_of(until_ms, key)?,
                retry_after: Duration::from_millis(until_ms.saturating_sub(now_ms).max(0) as u64),
                attempt,
            })
        }
        (b"mismatch", 0) => Ok(Acquisition::Mismatch),
        (b"corrupt", 1) => {
            let detail = rest
                .into_iter()
                .next()
                .map(bytes_of)
                .transpose()?
                .unwrap_or_default();
            Err(corrupt(key, String::from_utf8_lossy(&detail).into_owned()))
        }
        (tag, n) => Err(unexpected(format!(
            "acquire returned {:?} with {n} values",
            String::from_utf8_lossy(tag)
        ))),
    }
}

fn decode_record(raw: Bytes, key: &IdempotencyKey) -> Result<Record, StoreError> {
    let stored = format::decode(raw).map_err(|detail| corrupt(key, detail))?;
    let state = if stored.completed {
        RecordState::Completed {
            response: stored.response,
            completed_at: time_ms(stored.completed_ms),
        }
    } else {
        RecordState::InProgress {
            lease_expires_at: time_ms(stored.lease_until_ms),
        }
    };
    Ok(Record::new(
        key.clone(),
        state,
        stored.fingerprint.map(Fingerprint::from_array),
        LeaseToken::from_u128(u128::from_be_bytes(stored.token)),
        stored.attempt,
        time_ms(stored.created_ms),
        time_ms(stored.expires_ms),
    )
    .with_fence(stored.fence))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_with_whitespace_or_control_characters_are_refused() {
        for good in [
            "idem:",
            "",
            "{tag}app:",
            "glob*?[x]\\:",
            "quote\"d'app:",
            "é:",
        ] {
            assert!(check_prefix(good).is_ok(), "{good:?}");
            // Every rule is one whitespace-free argument.
            let rules = acl_rules(good, true);
            assert!(rules.split(' ').all(|r| !r.is_empty()), "{rules:?}");
        }
        for bad in [
            "billing app:",
            "tab\tx:",
            "nl\n",
            "nul\0",
            "nbsp\u{a0}x",
            "\u{1}",
        ] {
            assert!(
                matches!(check_prefix(bad), Err(StoreError::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn scripts_know_max_duration() {
        let max_ms = idem_core::MAX_DURATION.as_millis().to_string();
        for (name, script) in [
            ("acquire", include_str!("../scripts/acquire.lua")),
            ("complete", include_str!("../scripts/complete.lua")),
            ("extend", include_str!("../scripts/extend.lua")),
        ] {
            assert!(
                script.contains(&format!("local MAX_MS = {max_ms} ")),
                "{name}.lua does not cap durations at MAX_DURATION ({max_ms} ms)"
            );
        }
        assert_eq!(
            millis(Duration::MAX),
            idem_core::MAX_DURATION.as_millis() as u64
        );
    }

    /// The key written in place into a script command is exactly
    /// `redis_key`, byte for byte, and is the command's key argument.
    #[test]
    fn record_keys_are_written_in_place_as_redis_key() {
        let key = IdempotencyKey::new("pay.charge", "id/with:odd{chars}")
            .unwrap_or_else(|e| panic!("{e}"));
        let scripts = Scripts::new();
        for prefix in ["", "idem:", "{tag}app:"] {
            let expected = {
                let mut k = String::from(prefix);
                k.push_str(key.scope());
                k.push('/');
                k.push_str(key.id());
                k
            };
            let mut cmd = Cmd::with_capacity(8, 64);
            cmd.arg("EVALSHA")
                .arg(scripts.acquire.get_hash())
                .arg(1)
                .arg(RecordKey { prefix, key: &key });
            let args: Vec<Vec<u8>> = cmd
                .args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(b) => b.to_vec(),
                    _ => Vec::new(),
                })
                .collect();
            assert_eq!(args.len(), 4);
            assert_eq!(args[3], expected.as_bytes());
        }
    }

    #[test]
    fn delete_markers_live_in_the_record_slot() {
        // Known values: CRC16/XMODEM("123456789") = 0x31C3; Redis's
        // `CLUSTER KEYSLOT foo` = 12182.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{foo}bar"), 12182);
        assert_eq!(slot_of(b"a{}foo"), slot_of(b"a{}foo"));
        assert!(
            slot_tags().iter().all(|&t| t != u32::MAX),
            "a slot without a tag"
        );
        for prefix in ["idem:", "", "{app}:", "a{", "}{", "{}", "x{y"] {
            for id in ["k", "{k}", "}", "{", "a{b}c", "{}x"] {
                let record = format!("{prefix}scope/{id}");
                let marker = delete_marker(prefix, &record, "00ff")
                    .unwrap_or_else(|| panic!("no marker for {record:?}"));
                assert_eq!(
                    slot_of(marker.as_bytes()),
                    slot_of(record.as_bytes()),
                    "{record:?} {marker:?}"
                );
                assert!(marker.contains("00ff"));
            }
        }
        assert!(
            delete_marker("idem:", "idem:s/k", "r").is_some_and(|m| m.starts_with("idem:delete/{"))
        );
    }

    #[test]
    fn durations_are_saturated_and_rounded_up() {
        assert_eq!(millis(Duration::ZERO), 0);
        assert_eq!(millis(Duration::from_nanos(1)), 1);
        assert_eq!(millis(Duration::from_micros(1_500)), 2);
        assert_eq!(millis(Duration::from_millis(7)), 7);
        let max = idem_core::MAX_DURATION.as_millis() as u64;
        for huge in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            idem_core::MAX_DURATION + Duration::from_nanos(1),
        ] {
            assert_eq!(millis(huge), max, "{huge:?}");
        }
    }

    #[test]
    fn refused_script_arguments_are_invalid_argument() {
        let e = redis::make_extension_error(
            INVALID_CODE.to_owned(),
            Some("lease must be ...".to_owned()),
        );
        match map_error(e) {
            StoreError::InvalidArgument { detail } => assert_eq!(detail, "lease must be ..."),
            other => panic!("{other:?}"),
        }
        let other = redis::make_extension_error("OTHER".to_owned(), None);
        assert!(matches!(map_error(other), StoreError::Backend(_)));
    }
}
