//! [`RedisStore`]: its connection and settings.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

#[cfg(doc)]
use idem_core::IdempotencyStore;
use idem_core::{saturate, Batcher, Batching, IdempotencyKey, StoreError};
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;

#[cfg(doc)]
use crate::acl::acl_rules;
use crate::acl::check_prefix;
use crate::heal;
#[cfg(doc)]
use crate::heal::STALL_AFTER;
use crate::scripts::Scripts;

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
    pub(crate) conn: Conn<C>,
    pub(crate) prefix: Arc<str>,
    pub(crate) scripts: Arc<Scripts>,
    pub(crate) call_timeout: Duration,
    pub(crate) wait: Option<(u32, Duration)>,
    pub(crate) max_response_bytes: usize,
    /// Batches go per hash slot: a [`ClusterConnection`], or any
    /// connection that once refused a batch with CROSSSLOT (shared by
    /// clones).
    pub(crate) cluster: Arc<AtomicBool>,
    /// Whether the prefix holds whitespace or a control character (see
    /// [`prefix`](Self::prefix)): checked once there, not per call.
    pub(crate) bad_prefix: bool,
    /// The batching of concurrent `acquire`s and `complete`s (shared by
    /// clones).
    pub(crate) batcher: Batcher,
}

/// The store's connection: one given, or one replaced when it stops
/// answering (`connect_cluster`; see the `heal` module).
#[derive(Clone)]
pub(crate) enum Conn<C> {
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

pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// The batching a [`RedisStore`] on one Redis server starts with: on, with
/// at most 4 batched calls of each kind in flight before new calls wait
/// (and the other limits of [`Batching::default`]). On the machine of the
/// repository's docs/guide/performance.md, 64 concurrent store calls went
/// 1.22x as fast with it for duplicates and 1.02x for fresh keys (medians
/// of 5 runs). A store on a Redis Cluster connection starts with batching
/// **off**: a batch's keys spread over the hash slots and go as one script
/// call per slot, which measured 0.6-0.7x; turn it on with
/// [`RedisStore::batching`] where keys share a hash tag.
///
/// ```
/// let batching = idem_redis::default_batching();
/// assert!(batching.is_on());
/// assert_eq!(batching.calls_in_flight(), 4);
/// ```
pub fn default_batching() -> Batching {
    Batching::default().in_flight(4)
}

/// The default largest response: 64 MiB. A larger one is refused
/// (`StoreError::ResponseTooLarge`) before anything is written.
///
/// ```
/// assert_eq!(idem_redis::DEFAULT_MAX_RESPONSE_BYTES, 64 * 1024 * 1024);
/// ```
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 << 20;

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
        let cluster = std::any::TypeId::of::<C>() == std::any::TypeId::of::<ClusterConnection>();
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
            batcher: Batcher::new(
                if cluster {
                    Batching::off()
                } else {
                    default_batching()
                },
                "redis",
            ),
            cluster: Arc::new(AtomicBool::new(cluster)),
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
        self.own_batcher()
    }

    /// A batcher of its own, after a setting changed: a batch is sent with
    /// the settings of the store that starts it, so stores that differ
    /// (a clone given another prefix, `WAIT`, timeout or response limit)
    /// never batch together.
    fn own_batcher(mut self) -> Self {
        self.batcher = Batcher::new(self.batcher.settings(), "redis");
        self
    }

    /// Lowers the response limit to a quarter of the server's `maxmemory`,
    /// when one is set and `CONFIG GET` is allowed.
    pub(crate) async fn fit_response_limit(mut self) -> Self {
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
        self.own_batcher()
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
        self.own_batcher()
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

    /// How concurrent single calls are batched (default: on, see
    /// [`default_batching`]; off on a Redis Cluster connection). With `Batching::default()`, while an
    /// `acquire` (a `complete`) is in flight, the ones other tasks make
    /// meanwhile wait and then go together as one `acquire_many.lua`
    /// (`complete_many.lua`) call, one per hash slot on Redis Cluster; each
    /// caller gets the answer its own call would have got. A call that
    /// finds room goes at once. A store changed by any setting gets queues
    /// of its own: stores that differ never batch together.
    pub fn batching(mut self, batching: Batching) -> Self {
        self.batcher = Batcher::new(batching, "redis");
        self
    }

    /// The batching of this store's calls: its settings, and the calls
    /// waiting now for the one in flight.
    pub fn batcher(&self) -> &Batcher {
        &self.batcher
    }

    /// The longest one call may take before it fails with
    /// [`StoreError::Unavailable`] (default 2 s).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self.own_batcher()
    }

    /// How long a `delete` call's marker lives: longer than any resend of
    /// that call (the client resends only within the call, bounded by the
    /// call timeout), at least a minute.
    pub(crate) fn delete_marker_ttl(&self) -> Duration {
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
    /// done and waits again. **A replay is of a completion the replicas
    /// have**: a duplicate that finds the key completed writes a
    /// short-lived marker in its slot and `WAIT`s (one more round trip):
    /// if the replicas do not acknowledge it, the duplicate gets
    /// `Unavailable`, never the result of a completion a failover could
    /// lose (and the key then run again). **An extension is reported only
    /// once the replicas have it** (`WAIT`, bounded as an acquisition's):
    /// else `Unavailable`, and the holder keeps counting on its old
    /// deadline. `timeout` is saturated to
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
    /// (`NOREPLICAS`, answered [`StoreError::Unavailable`]); reads keep
    /// working, and replays answer `Unavailable` until a replica is back
    /// (figures in the repository's RELIABILITY.md,
    /// `tests/faults/failover/redis/`).
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some((replicas, saturate(timeout).max(Duration::from_millis(1))));
        self.own_batcher()
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
}
