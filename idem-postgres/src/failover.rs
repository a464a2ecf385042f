//! Several servers, the writable one used: a primary and its standbys,
//! followed across a failover (`target_session_attrs=read-write`
//! semantics, which sqlx 0.9 does not offer).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use idem_core::StoreError;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::time::Instant;

use crate::PgStoreBuilder;

/// The default of [`Failover::probe_timeout`].
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The default of [`Failover::check_interval`].
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// After a search that found no writable server, the next one waits this
/// long (calls in between fail at once with [`NoWritableServer`]), so many
/// callers do not flood the servers with connection attempts.
const SEARCH_PAUSE: Duration = Duration::from_millis(50);

/// A primary and its standbys, of which the store uses the one that accepts
/// writes, and follows it when a standby is promoted.
///
/// PostgreSQL's own clients do this with several hosts and
/// `target_session_attrs=read-write`; sqlx 0.9 takes one host. A
/// `Failover` takes several URLs (same database, same credentials or not)
/// and, each time it needs a server, **searches** them: the server in use
/// first, then the others in the order given; the first that answers
/// that it takes read-write transactions (`pg_is_in_recovery()` false and
/// `transaction_read_only` off, libpq's test for `read-write`) within
/// [`probe_timeout`](Self::probe_timeout) is the one used. Every pool it
/// opens ([`connect_with`](Self::connect_with)), and every [`PgStore`](crate::PgStore)
/// built with it ([`PgStoreBuilder::failover`]), then connects there:
///
/// - **every new connection is checked**: the pool's and the store's own
///   connections run that check when they are opened, and one to a
///   read-only server (a standby, a demoted primary, a server with
///   `default_transaction_read_only = on`) is closed and never used;
/// - **a server that fails is left**: when a store call loses its
///   connection (the primary was killed, the network failed), or a
///   statement is refused as read-only (SQLSTATE 25006, a server that
///   turned into a standby), the connection is dropped, the call fails
///   with the retryable [`StoreError::Unavailable`] (or is resent once on
///   a fresh connection, as after any lost connection), and the next
///   connection is opened only after a new search. Until a standby is
///   promoted, the search finds no writable server and calls fail at
///   once with `Unavailable` ([`NoWritableServer`]); the first call after
///   the promotion reaches the new primary;
/// - **the pools follow too**: a pool opened by `connect_with` (which the
///   in-transaction mode and `migrate` use) is pointed at the server each
///   search finds, and a watcher task checks the server in use every
///   [`check_interval`](Self::check_interval) (and at once when a
///   connection saw it fail), so a transaction begun on the pool after a
///   failover reaches the new primary even if no store call noticed it.
///
/// The promotion itself is not the store's job: it is your failover
/// manager's (Patroni, pg_auto_failover, a cloud service, `pg_ctl
/// promote`). With `synchronous_commit = on` and a synchronous standby,
/// a completion the store reported is on the standby before the call
/// returns, so it survives the failover; with asynchronous replication the
/// last commits before a crash can be lost (see RELIABILITY.md).
///
/// A failover address (a DNS name or a virtual IP that your failover
/// manager moves, a proxy such as PgBouncer or HAProxy in front of the
/// primary) needs none of this: give [`connect`](crate::connect) that one
/// URL; the store reconnects after a lost connection by itself.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_postgres::{Failover, PgStore};
///
/// let failover = Failover::new([
///     "postgres://app@db1.internal:5432/app",
///     "postgres://app@db2.internal:5432/app",
/// ])?;
/// let pool = failover
///     .connect_with(sqlx::postgres::PgPoolOptions::new().max_connections(16))
///     .await?;
/// let store = PgStore::builder(pool).failover(failover).build()?;
/// store.migrate().await?;
/// // Or in one line: idem_postgres::connect_any(&[a, b]).await?.build()?
/// # Ok(()) }
/// ```
///
/// `connect_with` replaces the pool options' `after_connect` callback with
/// the check above: put per-connection settings in the URLs instead
/// (`?options=-c%20search_path%3Dapp`). Cloning a `Failover` shares it.
/// The watcher ends when every `Failover` clone and every store built with
/// it is dropped.
#[derive(Clone)]
pub struct Failover {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Failover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failover")
            .field("servers", &self.shared.names)
            .field("current", &self.current())
            .field("switches", &self.switches())
            .finish()
    }
}

/// No server of a [`Failover`] accepted writes: every one refused the
/// connection, did not answer within the probe timeout, or is read-only
/// (in recovery: a standby not promoted yet; or
/// `default_transaction_read_only = on`). Comes as the source of
/// [`StoreError::Unavailable`] (retryable), or of [`StoreError::Backend`]
/// if every server refused the credentials or the database (no retry
/// helps).
#[derive(Debug, thiserror::Error)]
#[error("no writable PostgreSQL server among {}", .tried.join("; "))]
pub struct NoWritableServer {
    /// Per server: `host:port: what happened`.
    pub tried: Vec<String>,
}

/// What the watcher and the searches share.
pub(crate) struct Shared {
    servers: Vec<PgConnectOptions>,
    names: Vec<String>,
    current: AtomicUsize,
    /// Set when a connection saw the server in use fail: the next
    /// connection is opened after a search.
    suspect: AtomicBool,
    search: tokio::sync::Mutex<SearchState>,
    pools: Mutex<Vec<PgPool>>,
    probe_timeout_us: AtomicU64,
    check_interval_us: AtomicU64,
    switches: AtomicU64,
    wake: Arc<tokio::sync::Notify>,
    watcher: AtomicBool,
}

#[derive(Default)]
struct SearchState {
    /// When the last search found no writable server, and what it saw.
    failed: Option<(Instant, Vec<String>, bool)>,
}

impl Failover {
    /// The servers, as URLs (`postgres://` or `postgresql://`), in the
    /// order to try them. At least one; each must parse.
    pub fn new<I, S>(urls: I) -> Result<Failover, StoreError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut servers = Vec::new();
        let mut names = Vec::new();
        for url in urls {
            let url = url.as_ref();
            if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                return Err(StoreError::InvalidArgument {
                    detail: "a PostgreSQL URL starts with postgres:// or postgresql://".to_owned(),
                });
            }
            let options: PgConnectOptions =
                url.parse().map_err(|e| StoreError::InvalidArgument {
                    detail: format!("not a PostgreSQL URL: {e}"),
                })?;
            names.push(format!("{}:{}", options.get_host(), options.get_port()));
            servers.push(options);
        }
        if servers.is_empty() {
            return Err(StoreError::InvalidArgument {
                detail: "Failover::new needs at least one URL".to_owned(),
            });
        }
        Ok(Failover {
            shared: Arc::new(Shared {
                servers,
                names,
                current: AtomicUsize::new(0),
                suspect: AtomicBool::new(true),
                search: tokio::sync::Mutex::new(SearchState::default()),
                pools: Mutex::new(Vec::new()),
                probe_timeout_us: AtomicU64::new(micros(DEFAULT_PROBE_TIMEOUT)),
                check_interval_us: AtomicU64::new(micros(DEFAULT_CHECK_INTERVAL)),
                switches: AtomicU64::new(0),
                wake: Arc::new(tokio::sync::Notify::new()),
                watcher: AtomicBool::new(false),
            }),
        })
    }

    /// How long one server may take to accept a connection and answer
    /// whether it takes writes before the search moves on to the next
    /// (default [`DEFAULT_PROBE_TIMEOUT`], 5 s; at least 1 ms). A server
    /// that refuses connections is passed at once.
    pub fn probe_timeout(self, timeout: Duration) -> Self {
        self.shared
            .probe_timeout_us
            .store(micros(timeout).max(1_000), Ordering::SeqCst);
        self
    }

    /// How often the watcher checks that the server in use still accepts
    /// writes (default [`DEFAULT_CHECK_INTERVAL`], 1 s; at least 10 ms), one
    /// check on a connection of its own. It also
    /// wakes at once when a connection saw the server fail, and then
    /// searches every 50 ms until a writable server is found. It starts with
    /// the first pool opened by [`connect_with`](Self::connect_with).
    pub fn check_interval(self, interval: Duration) -> Self {
        self.shared
            .check_interval_us
            .store(micros(interval).max(10_000), Ordering::SeqCst);
        self
    }

    /// [`connect_with`](Self::connect_with) with sqlx's default pool
    /// options.
    pub async fn connect(&self) -> Result<PgPool, StoreError> {
        self.connect_with(PgPoolOptions::new()).await
    }

    /// Searches the servers for the writable one and opens a pool there
    /// that checks every new connection and follows the writable server
    /// (see the type's documentation). The pool options' `after_connect`
    /// is replaced by the check. Fails fast, as [`connect`](crate::connect)
    /// does, if no server accepts writes: [`StoreError::Unavailable`] with
    /// [`NoWritableServer`], or [`StoreError::Backend`] if every server
    /// refused the credentials or the database.
    pub async fn connect_with(&self, options: PgPoolOptions) -> Result<PgPool, StoreError> {
        self.shared.suspect.store(true, Ordering::SeqCst);
        let index = self.shared.search().await?;
        let weak = Arc::downgrade(&self.shared);
        let options = options.after_connect(move |conn, _meta| {
            let weak = weak.clone();
            Box::pin(async move {
                if in_recovery(conn).await? {
                    if let Some(shared) = weak.upgrade() {
                        shared.suspect();
                    }
                    return Err(read_only_error());
                }
                Ok(())
            })
        });
        let pool = options
            .connect_with(self.shared.servers[index].clone())
            .await
            .map_err(|e| crate::connect_error(e, self.shared.names[index].clone()))?;
        self.shared.register(&pool);
        self.start_watcher();
        Ok(pool)
    }

    /// The server in use now, as `host:port`.
    pub fn current(&self) -> String {
        self.shared.names[self.shared.current.load(Ordering::SeqCst)].clone()
    }

    /// How many times a search moved to another server.
    pub fn switches(&self) -> u64 {
        self.shared.switches.load(Ordering::SeqCst)
    }

    pub(crate) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    fn start_watcher(&self) {
        if self.shared.watcher.swap(true, Ordering::SeqCst) {
            return;
        }
        let weak: Weak<Shared> = Arc::downgrade(&self.shared);
        let wake = self.shared.wake.clone();
        tokio::spawn(async move {
            let mut conn: Option<(usize, PgConnection)> = None;
            loop {
                let wait = match weak.upgrade() {
                    Some(shared) if shared.suspect.load(Ordering::SeqCst) => SEARCH_PAUSE,
                    Some(shared) => {
                        Duration::from_micros(shared.check_interval_us.load(Ordering::SeqCst))
                    }
                    None => return,
                };
                let _ = tokio::time::timeout(wait, wake.notified()).await;
                let Some(shared) = weak.upgrade() else { return };
                if shared.suspect.load(Ordering::SeqCst) {
                    conn = None;
                    let _ = shared.search().await;
                    continue;
                }
                let current = shared.current.load(Ordering::SeqCst);
                if conn.as_ref().is_some_and(|(i, _)| *i != current) {
                    conn = None;
                }
                let timeout = shared.probe_timeout();
                let ok = match conn.as_mut() {
                    Some((_, c)) => matches!(
                        tokio::time::timeout(timeout, in_recovery(c)).await,
                        Ok(Ok(false))
                    ),
                    None => match shared.probe(current, timeout).await {
                        Ok(c) => {
                            conn = Some((current, c));
                            true
                        }
                        Err(_) => false,
                    },
                };
                if !ok {
                    conn = None;
                    shared.suspect();
                }
            }
        });
    }
}

impl Shared {
    fn probe_timeout(&self) -> Duration {
        Duration::from_micros(self.probe_timeout_us.load(Ordering::SeqCst))
    }

    /// The server in use may have failed: search before the next
    /// connection, and wake the watcher.
    pub(crate) fn suspect(&self) {
        if !self.suspect.swap(true, Ordering::SeqCst) {
            tracing::info!(server = %self.names[self.current.load(Ordering::SeqCst)],
                "a PostgreSQL connection failed or found the server read-only; searching for the writable server");
        }
        self.wake.notify_one();
    }

    /// Points `pool` (and later searches) at the server in use.
    pub(crate) fn register(&self, pool: &PgPool) {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        if !pools
            .iter()
            .any(|p| Arc::ptr_eq(&p.connect_options(), &pool.connect_options()))
        {
            pool.set_connect_options(self.servers[self.current.load(Ordering::SeqCst)].clone());
            pools.push(pool.clone());
        }
    }

    /// A connection to server `index` that accepts writes.
    /// Fails with what happened and whether a retry may resolve it.
    async fn probe(&self, index: usize, timeout: Duration) -> Result<PgConnection, (String, bool)> {
        let attempt = async {
            let mut conn = self.servers[index]
                .connect()
                .await
                .map_err(|e| (e.to_string(), crate::map_error_kind(&e) || transient(&e)))?;
            match in_recovery(&mut conn).await {
                Ok(false) => Ok(conn),
                Ok(true) => Err((
                    "read-only (in recovery: a standby; or default_transaction_read_only)"
                        .to_owned(),
                    true,
                )),
                Err(e) => Err((e.to_string(), true)),
            }
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err((format!("no answer within {timeout:?}"), true)),
        }
    }

    /// If a connection saw the server in use fail, searches the servers
    /// (the one in use first, then the others in order) for one that
    /// accepts writes and points every pool there. One search at a time;
    /// callers that waited for another's search take its result.
    pub(crate) async fn search(&self) -> Result<usize, StoreError> {
        self.find().await.map_err(|(e, retryable)| {
            if retryable {
                StoreError::Unavailable(Box::new(e))
            } else {
                StoreError::Backend(Box::new(e))
            }
        })
    }

    async fn find(&self) -> Result<usize, (NoWritableServer, bool)> {
        let mut state = self.search.lock().await;
        if !self.suspect.load(Ordering::SeqCst) {
            return Ok(self.current.load(Ordering::SeqCst));
        }
        if let Some((at, tried, retryable)) = &state.failed {
            if at.elapsed() < SEARCH_PAUSE {
                return Err((
                    NoWritableServer {
                        tried: tried.clone(),
                    },
                    *retryable,
                ));
            }
        }
        let timeout = self.probe_timeout();
        let start = self.current.load(Ordering::SeqCst);
        let order = std::iter::once(start).chain((0..self.servers.len()).filter(|&i| i != start));
        let mut tried = Vec::new();
        let mut retryable = false;
        for index in order {
            match self.probe(index, timeout).await {
                Ok(conn) => {
                    let _ = conn.close().await;
                    if index != start {
                        self.switches.fetch_add(1, Ordering::SeqCst);
                        tracing::warn!(from = %self.names[start], to = %self.names[index],
                            "PostgreSQL failover: the store now uses another server");
                    }
                    self.current.store(index, Ordering::SeqCst);
                    for pool in self.pools.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                        pool.set_connect_options(self.servers[index].clone());
                    }
                    self.suspect.store(false, Ordering::SeqCst);
                    state.failed = None;
                    return Ok(index);
                }
                Err((cause, may_pass)) => {
                    retryable |= may_pass;
                    tried.push(format!("{}: {cause}", self.names[index]));
                }
            }
        }
        state.failed = Some((Instant::now(), tried.clone(), retryable));
        Err((NoWritableServer { tried }, retryable))
    }

    /// Opens one of the store's own connections through `factory` (the
    /// pool options, so `after_connect` runs) on the writable server:
    /// searches first if the server in use is suspect, and checks the new
    /// connection.
    pub(crate) async fn open(
        &self,
        factory: &PgPool,
        pool: &PgPool,
    ) -> Result<PgConnection, sqlx::Error> {
        let mut last = None;
        for _ in 0..2 {
            if self.suspect.load(Ordering::SeqCst) {
                if let Err((e, _)) = self.find().await {
                    return Err(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        e,
                    )));
                }
            }
            factory.set_connect_options(pool.connect_options().as_ref().clone());
            let opened = tokio::time::timeout(self.probe_timeout(), factory.acquire()).await;
            let mut conn = match opened {
                Ok(Ok(conn)) => conn.detach(),
                Ok(Err(e)) => {
                    self.suspect();
                    last = Some(e);
                    continue;
                }
                Err(_) => {
                    self.suspect();
                    last = Some(sqlx::Error::PoolTimedOut);
                    continue;
                }
            };
            match in_recovery(&mut conn).await {
                Ok(false) => return Ok(conn),
                Ok(true) => {
                    self.suspect();
                    last = Some(read_only_error());
                }
                Err(e) => {
                    self.suspect();
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(sqlx::Error::PoolTimedOut))
    }
}

impl PgStoreBuilder {
    /// Follows the writable server of `failover` (see [`Failover`]): the
    /// store's own connections are opened on the server a search found
    /// writable and checked, a connection that fails or is refused as
    /// read-only sends the store searching again, and the builder's pool
    /// is pointed at the server found too. Build the pool with
    /// [`Failover::connect_with`], so its own new connections are checked.
    pub fn failover(mut self, failover: Failover) -> Self {
        failover.shared.register(&self.pool);
        self.failover = Some(failover);
        self
    }
}

/// Opens a pool (sqlx's default options) on the writable server of `urls`
/// and returns a store builder that follows it across failovers: a
/// shorthand for [`Failover::new`], [`Failover::connect`] and
/// [`PgStoreBuilder::failover`].
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = idem_postgres::connect_any(&[
///     "postgres://app@db1.internal/app",
///     "postgres://app@db2.internal/app",
/// ])
/// .await?
/// .build()?;
/// # Ok(()) }
/// ```
pub async fn connect_any<S: AsRef<str>>(urls: &[S]) -> Result<PgStoreBuilder, StoreError> {
    let failover = Failover::new(urls)?;
    let pool = failover.connect().await?;
    Ok(crate::PgStore::builder(pool).failover(failover))
}

/// Whether the session is read-only: its server is in recovery (a
/// standby), or its transactions are read-only by default.
async fn in_recovery(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool",
    )
    .fetch_one(conn)
    .await
}

fn read_only_error() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        "the server is read-only (in recovery, or default_transaction_read_only); searching for the writable one",
    ))
}

/// A server error at connect time that a retry may resolve.
fn transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|c| crate::retryable_code(&c)),
        _ => false,
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
