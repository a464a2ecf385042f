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

use crate::builder::PgStoreBuilder;

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
/// and, each time it needs a server, **searches** them: it probes every
/// server at once, each within [`probe_timeout`](Self::probe_timeout)
/// (so a search takes as long as the slowest answer, at most that
/// timeout), and uses, among those that answer that they take read-write
/// transactions (`pg_is_in_recovery()` false and `transaction_read_only`
/// off, libpq's test for `read-write`), the one on the **highest
/// timeline**; on a tie, the one in use, then the first in the order
/// given. Every pool it opens ([`connect_with`](Self::connect_with)), and
/// every [`PgStore`](crate::PgStore) built with it
/// ([`PgStoreBuilder::failover`]), then connects there:
///
/// - **every new connection is checked**: the pool's and the store's own
///   connections run that check when they are opened, and one to a
///   read-only server (a standby, a demoted primary, a server with
///   `default_transaction_read_only = on`) or to a former primary (below)
///   is closed and never used;
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
///   search finds, and a watcher task checks every server (the one in
///   use, and whether another took a higher timeline) every
///   [`check_interval`](Self::check_interval) (and at once when a
///   connection saw it fail), so a transaction begun on the pool after a
///   failover reaches the new primary even if no store call noticed it;
///   after a move, a connection the pool (or the store) opened before it
///   is closed instead of being handed out again, since it may be on the
///   server left.
///
/// **Never back to a former primary.** A promotion starts a new timeline
/// (the standby's history forks from the old primary's). The `Failover`
/// reads the timeline of every writable server it checks (the one of its
/// WAL insert position: `pg_walfile_name(pg_current_wal_lsn())`, exact at
/// once after a promotion) and keeps the highest it has seen; a writable
/// server on a lower timeline is refused ([`NoWritableServer`] says "a
/// former primary on timeline X < Y"). This is the old primary that comes
/// back writable after a failover (a host reboot that starts it from its
/// old data directory): a record completed on the new primary is not
/// there, so using it would run a handler twice. Calls fail with
/// `Unavailable` rather than go there, until a server on the highest
/// timeline answers again. Because a search probes every server, a new
/// process given both (in any order) picks the promoted one when both
/// answer. A standby promoted while the primary in use stays writable
/// and reachable (no fencing: a split brain) is seen at the watcher's next
/// check, which asks every server (every
/// [`check_interval`](Self::check_interval), each within the probe
/// timeout): the store then moves to it. Until then (one interval and a
/// probe), a running process may still write to the old primary while a
/// new one uses the promoted server: fence the old primary. What this
/// cannot tell: a process (a fresh start, or a new
/// `Failover`) that reaches **only** the old primary takes it (it has
/// seen no higher timeline); two servers on the same
/// timeline number with different histories (two standbys both promoted)
/// are not told apart; and a cluster restored from a backup or rebuilt
/// onto a lower timeline is refused by a running `Failover` (make a new
/// one, or restart the process). Fence the old primary (stop it, or make
/// it a standby of the new one: `pg_rewind`) as your failover manager
/// should.
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
/// the check above, and their `before_acquire` callback with the one that
/// closes connections opened before a move (sqlx offers no way to call
/// yours from ours): put per-connection settings in the URLs instead
/// (`?options=-c%20search_path%3Dapp`). Cloning a `Failover` shares it.
///
/// **Lifetimes.** The watcher ends as soon as every `Failover` clone and
/// every store built with it is dropped, and closes its connections. A
/// pool opened by `connect_with` (or given to
/// [`PgStoreBuilder::failover`]) is held by the `Failover`, which points
/// it at each new server, **until the pool is closed**: sqlx has no weak
/// pool handle, so a `Failover` cannot tell that you dropped your last
/// handle of a pool. Close a pool you are done with (`pool.close().await`)
/// while the `Failover` lives on; dropped without closing, it stays open,
/// with its connections, as long as the `Failover` does.
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
            .field("timeline", &self.timeline())
            .field("pools", &self.shared.pool_count())
            .finish()
    }
}

/// No server of a [`Failover`] accepted writes: every one refused the
/// connection, did not answer within the probe timeout, is read-only
/// (in recovery: a standby not promoted yet; or
/// `default_transaction_read_only = on`), or is a former primary (on a
/// timeline lower than the highest seen). Comes as the source of
/// [`StoreError::Unavailable`] (retryable), or of [`StoreError::Backend`]
/// if every server refused the credentials, the database or the TLS
/// settings (no retry helps).
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
    /// The pools to point at the server in use; closed ones are let go.
    pools: Mutex<Vec<PgPool>>,
    probe_timeout_us: AtomicU64,
    check_interval_us: AtomicU64,
    switches: AtomicU64,
    /// When the last move to another server was made (the pools' idle
    /// connections opened before it are not handed out).
    switched_at: Mutex<Option<std::time::Instant>>,
    /// The highest timeline seen on a writable server (0: none yet).
    timeline: AtomicU64,
    wake: Arc<tokio::sync::Notify>,
    watcher: AtomicBool,
}

impl Drop for Shared {
    /// The last handle is gone: the watcher ends now, not at its next tick.
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

#[derive(Default)]
struct SearchState {
    /// When the last search found no writable server, and what it saw.
    failed: Option<(Instant, Vec<String>, bool)>,
}

/// What a server said about itself.
struct Role {
    /// In recovery, or read-only transactions by default.
    read_only: bool,
    /// The timeline of its WAL insert position (a writable server only).
    timeline: Option<u64>,
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
                switched_at: Mutex::new(None),
                timeline: AtomicU64::new(0),
                wake: Arc::new(tokio::sync::Notify::new()),
                watcher: AtomicBool::new(false),
            }),
        })
    }

    /// How long one server may take to accept a connection and answer
    /// whether it takes writes before the search gives up on it
    /// (default [`DEFAULT_PROBE_TIMEOUT`], 5 s; at least 1 ms). A server
    /// that refuses connections is passed at once.
    pub fn probe_timeout(self, timeout: Duration) -> Self {
        self.shared
            .probe_timeout_us
            .store(micros(timeout).max(1_000), Ordering::SeqCst);
        self
    }

    /// How often the watcher checks that the server in use still accepts
    /// writes and that no other server took a higher timeline (default
    /// [`DEFAULT_CHECK_INTERVAL`], 1 s; at least 10 ms): every server at
    /// once, each on a connection of its own that it keeps. It also
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
    /// and `before_acquire` are replaced. Fails fast, as
    /// [`connect`](crate::connect) does, if no server accepts writes:
    /// [`StoreError::Unavailable`] with [`NoWritableServer`], or
    /// [`StoreError::Backend`] if every server refused the credentials,
    /// the database or the TLS settings.
    pub async fn connect_with(&self, options: PgPoolOptions) -> Result<PgPool, StoreError> {
        self.shared.suspect.store(true, Ordering::SeqCst);
        let index = self.shared.search().await?;
        let weak = Arc::downgrade(&self.shared);
        let on_acquire = weak.clone();
        let options = options
            .after_connect(move |conn, _meta| {
                let weak = weak.clone();
                Box::pin(async move {
                    let role = role(conn).await?;
                    match weak.upgrade() {
                        Some(shared) => {
                            if let Err(why) = shared.accept(&role) {
                                shared.suspect();
                                return Err(refused_error(why));
                            }
                        }
                        None if role.read_only => return Err(refused_error(READ_ONLY.to_owned())),
                        None => {}
                    }
                    Ok(())
                })
            })
            .before_acquire(move |_conn, meta| {
                let keep = on_acquire
                    .upgrade()
                    .is_none_or(|shared| !shared.opened_before_switch(meta.age));
                Box::pin(async move { Ok(keep) })
            });
        let pool = options
            .connect_with(self.shared.servers[index].clone())
            .await
            .map_err(|e| crate::connect::connect_error(e, self.shared.names[index].clone()))?;
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
        self.shared.switch_count()
    }

    /// The highest timeline seen on a writable server (0 before the first
    /// search): a writable server on a lower one is a former primary and
    /// is never used.
    pub fn timeline(&self) -> u64 {
        self.shared.timeline.load(Ordering::SeqCst)
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
            // A connection to each server, kept between checks.
            let mut conns: Vec<Option<PgConnection>> = Vec::new();
            loop {
                let wait = match weak.upgrade() {
                    Some(shared) if shared.suspect.load(Ordering::SeqCst) => SEARCH_PAUSE,
                    Some(shared) => {
                        Duration::from_micros(shared.check_interval_us.load(Ordering::SeqCst))
                    }
                    None => break,
                };
                let _ = tokio::time::timeout(wait, wake.notified()).await;
                let Some(shared) = weak.upgrade() else { break };
                if conns.len() != shared.servers.len() {
                    conns = (0..shared.servers.len()).map(|_| None).collect();
                }
                let current = shared.current.load(Ordering::SeqCst);
                if shared.suspect.load(Ordering::SeqCst) {
                    conns[current] = None;
                    let _ = shared.search().await;
                    continue;
                }
                // Every server at once, each within the probe timeout: the
                // one in use, and the others, so that a standby promoted
                // beside a primary that stays writable (a split brain: no
                // fencing) is seen by its higher timeline at this check.
                let timeout = shared.probe_timeout();
                let mut checks = tokio::task::JoinSet::new();
                for (index, slot) in conns.iter_mut().enumerate() {
                    let conn = slot.take();
                    let options = shared.servers[index].clone();
                    checks.spawn(async move {
                        let checked = match conn {
                            Some(mut c) => {
                                match tokio::time::timeout(timeout, role(&mut c)).await {
                                    Ok(Ok(r)) => Some((c, r)),
                                    _ => None,
                                }
                            }
                            None => probe(options, timeout).await.ok(),
                        };
                        (index, checked)
                    });
                }
                let mut in_use = None;
                while let Some(joined) = checks.join_next().await {
                    let Ok((index, Some((c, r)))) = joined else {
                        continue;
                    };
                    if index == current {
                        in_use = Some(r);
                    } else if !r.read_only {
                        // Raises the highest timeline seen, if it is higher.
                        let _ = shared.accept(&r);
                    }
                    conns[index] = Some(c);
                }
                // The server in use still takes writes and is on the
                // highest timeline seen: else search (which takes the
                // highest).
                if in_use.is_none_or(|r| shared.accept(&r).is_err()) {
                    conns[current] = None;
                    shared.suspect();
                }
            }
            // Every Failover and store is gone: so are the watcher's
            // connections (a clean goodbye if a server answers at once).
            for c in conns.into_iter().flatten() {
                let _ = tokio::time::timeout(Duration::from_secs(1), c.close()).await;
            }
        });
    }
}

impl Shared {
    fn probe_timeout(&self) -> Duration {
        Duration::from_micros(self.probe_timeout_us.load(Ordering::SeqCst))
    }

    pub(crate) fn switch_count(&self) -> u64 {
        self.switches.load(Ordering::SeqCst)
    }

    fn pool_list(&self) -> std::sync::MutexGuard<'_, Vec<PgPool>> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        // A closed pool opens no connection again: let it go.
        pools.retain(|p| !p.is_closed());
        pools
    }

    fn pool_count(&self) -> usize {
        self.pool_list().len()
    }

    /// Whether a pool connection `age` old was opened before the last
    /// move to another server (so it may be on the server left).
    fn opened_before_switch(&self, age: Duration) -> bool {
        self.switched_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|at| age > at.elapsed())
    }

    /// Whether a server that said `role` may be used: writable, and not
    /// on a timeline lower than the highest seen (a former primary). The
    /// highest timeline is raised to its own.
    fn accept(&self, role: &Role) -> Result<(), String> {
        if role.read_only {
            return Err(READ_ONLY.to_owned());
        }
        let timeline = role.timeline.unwrap_or(0);
        let highest = self.timeline.fetch_max(timeline, Ordering::SeqCst);
        if timeline < highest {
            return Err(former_primary(timeline, highest));
        }
        Ok(())
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
        let mut pools = self.pool_list();
        if !pools
            .iter()
            .any(|p| Arc::ptr_eq(&p.connect_options(), &pool.connect_options()))
        {
            pool.set_connect_options(self.servers[self.current.load(Ordering::SeqCst)].clone());
            pools.push(pool.clone());
        }
    }

    /// If a connection saw the server in use fail, searches the servers
    /// (every one at once) for the writable one on the highest timeline
    /// and points every pool there. One search at a time; callers that
    /// waited for another's search take its result.
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
        // Every server at once, so a search takes the slowest answer (at
        // most the probe timeout), not their sum.
        let mut probes = tokio::task::JoinSet::new();
        for (index, options) in self.servers.iter().enumerate() {
            let options = options.clone();
            probes.spawn(async move { (index, probe(options, timeout).await) });
        }
        let mut answers: Vec<Option<_>> = (0..self.servers.len()).map(|_| None).collect();
        while let Some(joined) = probes.join_next().await {
            if let Ok((index, answer)) = joined {
                answers[index] = Some(answer);
            }
        }
        let highest = self.timeline.load(Ordering::SeqCst);
        let mut tried = Vec::new();
        let mut retryable = false;
        let mut writable: Vec<(usize, u64)> = Vec::new();
        let mut conns = Vec::new();
        for (index, answer) in answers.into_iter().enumerate() {
            let cause = match answer {
                None => {
                    retryable = true;
                    "the probe did not finish".to_owned()
                }
                Some(Err((cause, may_pass))) => {
                    retryable |= may_pass;
                    cause
                }
                Some(Ok((conn, role))) => {
                    conns.push(conn);
                    retryable = true;
                    let timeline = role.timeline.unwrap_or(0);
                    if role.read_only {
                        READ_ONLY.to_owned()
                    } else if timeline < highest {
                        former_primary(timeline, highest)
                    } else {
                        writable.push((index, timeline));
                        continue;
                    }
                }
            };
            tried.push(format!("{}: {cause}", self.names[index]));
        }
        // The probes' connections are not needed: close them aside.
        tokio::spawn(async move {
            for conn in conns {
                let _ = tokio::time::timeout(timeout, conn.close()).await;
            }
        });
        // The highest timeline; on a tie the one in use, then the first.
        let best = writable
            .iter()
            .copied()
            .max_by_key(|&(index, timeline)| (timeline, index == start, std::cmp::Reverse(index)));
        let Some((index, timeline)) = best else {
            for line in &tried {
                tracing::debug!(server = %line, "PostgreSQL failover search: not writable");
            }
            state.failed = Some((Instant::now(), tried.clone(), retryable));
            return Err((NoWritableServer { tried }, retryable));
        };
        for &(other, other_timeline) in writable.iter().filter(|(i, _)| *i != index) {
            tracing::warn!(server = %self.names[other], timeline = other_timeline,
                used = %self.names[index], used_timeline = timeline,
                "another PostgreSQL server accepts writes too (a former primary not fenced?); not used");
        }
        self.timeline.fetch_max(timeline, Ordering::SeqCst);
        for pool in self.pool_list().iter() {
            pool.set_connect_options(self.servers[index].clone());
        }
        if index != start {
            // After the pools were pointed away: a connection opened
            // since is on the new server.
            *self.switched_at.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(std::time::Instant::now());
            self.switches.fetch_add(1, Ordering::SeqCst);
            tracing::warn!(from = %self.names[start], to = %self.names[index], timeline,
                "PostgreSQL failover: the store now uses another server");
        }
        self.current.store(index, Ordering::SeqCst);
        self.suspect.store(false, Ordering::SeqCst);
        state.failed = None;
        Ok(index)
    }

    /// Opens one of the store's own connections through `factory` (the
    /// pool options, so `after_connect` runs) on the writable server:
    /// searches first if the server in use is suspect, and checks the new
    /// connection. A search that says no retry helps (every server
    /// refused the credentials, the database or the TLS settings) is
    /// passed on as such (a `Configuration` error, which the store maps to
    /// [`StoreError::Backend`]).
    pub(crate) async fn open(
        &self,
        factory: &PgPool,
        pool: &PgPool,
    ) -> Result<PgConnection, sqlx::Error> {
        let mut last = None;
        for _ in 0..2 {
            if self.suspect.load(Ordering::SeqCst) {
                if let Err((e, retryable)) = self.find().await {
                    return Err(if retryable {
                        sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::NotConnected, e))
                    } else {
                        sqlx::Error::Configuration(Box::new(e))
                    });
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
            match role(&mut conn).await {
                Ok(role) => match self.accept(&role) {
                    Ok(()) => return Ok(conn),
                    Err(why) => {
                        self.suspect();
                        last = Some(refused_error(why));
                    }
                },
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
    /// read-only sends the store searching again, a connection opened
    /// before a move to another server is not used again, and the
    /// builder's pool is pointed at the server found too (and held by the
    /// `Failover` until it is closed). Build the pool with
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

/// A connection to the server of `options` and what it says it is, within
/// `timeout`. Fails with what happened and whether a retry may resolve
/// it (classified as [`connect`](crate::connect) does: a TLS setting, a
/// password or a database refused is not retryable).
async fn probe(
    options: PgConnectOptions,
    timeout: Duration,
) -> Result<(PgConnection, Role), (String, bool)> {
    let attempt = async {
        let mut conn = options
            .connect()
            .await
            .map_err(|e| crate::connect::connect_failure(&e))?;
        match role(&mut conn).await {
            Ok(role) => Ok((conn, role)),
            // A refusal of the role query itself (the timeline function's
            // EXECUTE revoked: 42501) fails alike on every retry.
            Err(sqlx::Error::Database(db)) => {
                let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
                let hint = if code == "42501" {
                    " (the store's role needs EXECUTE on pg_is_in_recovery(), \
                     pg_current_wal_lsn() and pg_walfile_name())"
                } else {
                    ""
                };
                Err((
                    format!("the read-write check failed: {}{hint}", db.message()),
                    crate::error::retryable_code(&code),
                ))
            }
            Err(e) => Err((e.to_string(), true)),
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err((format!("no answer within {timeout:?}"), true)),
    }
}

const READ_ONLY: &str = "read-only (in recovery: a standby; or default_transaction_read_only)";

fn former_primary(timeline: u64, highest: u64) -> String {
    format!(
        "a former primary on timeline {timeline} < {highest} (the highest seen): never used, \
         it lacks the writes made since the promotion"
    )
}

/// Whether the session is read-only (its server is in recovery: a
/// standby; or its transactions are read-only by default), and the
/// timeline of a writable server's WAL insert position (the first 8 hex
/// digits of a WAL file name; exact at once after a promotion, unlike
/// `pg_control_checkpoint()`, which waits for the next checkpoint).
async fn role(conn: &mut PgConnection) -> Result<Role, sqlx::Error> {
    let (read_only, timeline): (bool, Option<i64>) = sqlx::query_as(
        "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only')::bool, \
         CASE WHEN pg_is_in_recovery() THEN NULL \
         ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8 END",
    )
    .fetch_one(conn)
    .await?;
    Ok(Role {
        read_only,
        timeline: timeline.and_then(|t| u64::try_from(t).ok()),
    })
}

fn refused_error(why: String) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        format!("{why}; searching for the writable server"),
    ))
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
