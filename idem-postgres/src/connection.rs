//! The store's own connections: opened the way the pool opens its own,
//! set up with the server-side timeouts, lent to one call at a time,
//! reused without the pool's ping, closed when idle or old.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, PgConnection};
use tokio::time::Instant;

use crate::failover;
#[cfg(doc)]
use crate::store::PgStore;
use crate::timeouts::Timeouts;

/// The store's own connections, as [`PgStore::connection_stats`] reports
/// them (also the gauge `idem_postgres_connections`, labelled `table`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionStats {
    /// Connections open now, lent to a call or idle.
    pub open: usize,
    /// Of those, idle.
    pub idle: usize,
    /// The most the store opens at once (`PgStoreBuilder::connections`).
    pub max: usize,
    /// Connections opened since the store was built (a reconnect after a
    /// failure, the idle timeout or the maximum lifetime adds one).
    pub opened: u64,
}

/// The store's own connections: at most `max` open at once, idle ones kept
/// for reuse (newest first), new ones opened on demand the way the pool
/// opens its own: through a private sqlx pool built from the pool's
/// options (so its `after_connect` runs), taken out of it at once. Each
/// new connection gets the server-side timeouts in one statement before
/// its first call. Idle connections past the pool's `idle_timeout`, and
/// connections past its `max_lifetime`, are closed: when a call would take
/// them, and by a task that wakes up for it.
pub(crate) struct ConnectionSet {
    pool: PgPool,
    factory: OnceLock<PgPool>,
    idle: Mutex<Vec<IdleConnection>>,
    slots: tokio::sync::Semaphore,
    pub(crate) max: usize,
    open: AtomicUsize,
    opened: AtomicU64,
    idle_timeout: Option<Duration>,
    max_lifetime: Option<Duration>,
    timeouts: Timeouts,
    table: String,
    reaper: AtomicBool,
    /// Set by [`PgStoreBuilder::failover`]: where new connections go.
    failover: Option<Arc<failover::Shared>>,
}

struct IdleConnection {
    conn: PgConnection,
    born: Instant,
    since: Instant,
    /// [`ConnectionSet::switches`] when it was opened.
    switches: u64,
}

/// A connection lent for one call (counted as open; its session set up);
/// back to the idle set only if kept.
pub(crate) struct Lent<'a> {
    set: &'a ConnectionSet,
    /// Present until dropped.
    conn: Option<PgConnection>,
    born: Instant,
    /// [`ConnectionSet::switches`] when it was opened.
    switches: u64,
    reused: bool,
    keep: bool,
    _slot: tokio::sync::SemaphorePermit<'a>,
}

impl ConnectionSet {
    pub(crate) fn new(
        pool: PgPool,
        max: usize,
        timeouts: Timeouts,
        table: String,
        failover: Option<Arc<failover::Shared>>,
    ) -> Self {
        let options = pool.options();
        ConnectionSet {
            idle_timeout: options.get_idle_timeout(),
            max_lifetime: options.get_max_lifetime(),
            pool,
            factory: OnceLock::new(),
            idle: Mutex::new(Vec::new()),
            slots: tokio::sync::Semaphore::new(max),
            max,
            open: AtomicUsize::new(0),
            opened: AtomicU64::new(0),
            timeouts,
            table,
            reaper: AtomicBool::new(false),
            failover,
        }
    }

    pub(crate) fn stats(&self) -> ConnectionStats {
        ConnectionStats {
            open: self.open.load(Ordering::SeqCst),
            idle: self.idle_list().len(),
            max: self.max,
            opened: self.opened.load(Ordering::SeqCst),
        }
    }

    fn idle_list(&self) -> std::sync::MutexGuard<'_, Vec<IdleConnection>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gauge(&self) {
        metrics::gauge!("idem_postgres_connections", "table" => self.table.clone())
            .set(self.open.load(Ordering::SeqCst) as f64);
    }

    fn closed(&self, n: usize) {
        if n > 0 {
            self.open.fetch_sub(n, Ordering::SeqCst);
            self.gauge();
        }
    }

    /// Whether a connection born at `born`, idle since `since`, is past the
    /// pool's `max_lifetime` or `idle_timeout`.
    fn stale(&self, born: Instant, since: Option<Instant>) -> bool {
        self.max_lifetime.is_some_and(|max| born.elapsed() > max)
            || matches!((self.idle_timeout, since), (Some(max), Some(since)) if since.elapsed() > max)
    }

    /// The server failed a connection or refused a write as read-only:
    /// with a [`Failover`], the next connection is opened after a search.
    pub(crate) fn suspect_server(&self) {
        if let Some(failover) = &self.failover {
            failover.suspect();
        }
    }

    /// How many times the [`Failover`] moved to another server (0
    /// without one): a connection opened before the last move is never
    /// reused, it may be on the server left.
    fn switches(&self) -> u64 {
        self.failover.as_ref().map_or(0, |f| f.switch_count())
    }

    /// Closes every idle connection.
    pub(crate) fn close_idle(&self) {
        let gone = std::mem::take(&mut *self.idle_list());
        self.closed(gone.len());
    }

    /// Closes idle connections past the idle timeout or the lifetime.
    fn reap(&self) {
        let mut gone = Vec::new();
        {
            let mut idle = self.idle_list();
            let mut i = 0;
            while i < idle.len() {
                if self.stale(idle[i].born, Some(idle[i].since)) {
                    gone.push(idle.swap_remove(i));
                } else {
                    i += 1;
                }
            }
        }
        self.closed(gone.len());
    }

    /// Starts the task that closes stale idle connections, once, if the
    /// pool has an idle timeout or a maximum lifetime. It holds the set
    /// weakly and ends with the store.
    fn start_reaper(self: &Arc<Self>) {
        let period = match (self.idle_timeout, self.max_lifetime) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => return,
        };
        if self.reaper.swap(true, Ordering::SeqCst) {
            return;
        }
        let period = (period / 2).max(Duration::from_millis(10));
        let set: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                match set.upgrade() {
                    Some(set) => set.reap(),
                    None => return,
                }
            }
        });
    }

    /// The private pool new connections come from: the pool's options
    /// (after_connect included), taken out of it as soon as they are open.
    fn factory(&self) -> &PgPool {
        self.factory.get_or_init(|| {
            self.pool
                .options()
                .clone()
                .max_connections(u32::try_from(self.max).unwrap_or(u32::MAX))
                .min_connections(0)
                .idle_timeout(None)
                .max_lifetime(None)
                .test_before_acquire(false)
                .acquire_timeout(self.timeouts.call)
                .connect_lazy_with(self.pool.connect_options().as_ref().clone())
        })
    }

    /// A connection for one call: an idle one unless `fresh`, or a new one.
    pub(crate) async fn lend(self: &Arc<Self>, fresh: bool) -> Result<Lent<'_>, sqlx::Error> {
        let slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        self.start_reaper();
        if !fresh {
            loop {
                let Some(idle) = self.idle_list().pop() else {
                    break;
                };
                if self.stale(idle.born, Some(idle.since)) || idle.switches != self.switches() {
                    self.closed(1);
                    continue;
                }
                return Ok(Lent {
                    set: self,
                    conn: Some(idle.conn),
                    born: idle.born,
                    switches: idle.switches,
                    reused: true,
                    keep: false,
                    _slot: slot,
                });
            }
        }
        // Read before opening: a move during the opening makes it old.
        let switches = self.switches();
        // The pool's current connect options (a rotated password, say).
        let factory = self.factory();
        let mut conn = match &self.failover {
            // On the writable server, after a search if the one in use failed.
            Some(failover) => failover.open(factory, &self.pool).await?,
            None => {
                factory.set_connect_options(self.pool.connect_options().as_ref().clone());
                factory.acquire().await?.detach()
            }
        };
        let born = Instant::now();
        self.opened.fetch_add(1, Ordering::SeqCst);
        // Counted as open only once its session is set up: a connection
        // whose setup fails (or is cancelled) is dropped here, uncounted.
        let setup = self.session_setup(conn.server_version_num().unwrap_or(0));
        sqlx::raw_sql(AssertSqlSafe(setup))
            .execute(&mut conn)
            .await?;
        self.open.fetch_add(1, Ordering::SeqCst);
        self.gauge();
        Ok(Lent {
            set: self,
            conn: Some(conn),
            born,
            switches,
            reused: false,
            keep: false,
            _slot: slot,
        })
    }

    /// One statement for a new connection: `statement_timeout` and
    /// `lock_timeout` at the server timeout, or the connection's own
    /// setting where it is lower; `client_connection_check_interval`
    /// (PostgreSQL 14+) unless set.
    fn session_setup(&self, server_version: u32) -> String {
        let ms = self.timeouts.server_ms.min(i32::MAX as u64);
        let capped = |setting: &str| {
            format!(
                "set_config('{setting}', (CASE WHEN s.{setting} > 0 AND s.{setting} < {ms} \
                 THEN s.{setting} ELSE {ms} END)::text || 'ms', false)"
            )
        };
        let mut sql = format!(
            "SELECT {}, {}",
            capped("statement_timeout"),
            capped("lock_timeout")
        );
        if server_version >= 140_000 {
            let check = (ms / 4).clamp(10, 1_000);
            sql.push_str(&format!(
                ", CASE WHEN current_setting('client_connection_check_interval') = '0' \
                 THEN set_config('client_connection_check_interval', '{check}ms', false) END"
            ));
        }
        sql.push_str(
            " FROM (SELECT \
             ceil(extract(epoch FROM current_setting('statement_timeout')::interval) * 1000)::int8 \
             AS statement_timeout, \
             ceil(extract(epoch FROM current_setting('lock_timeout')::interval) * 1000)::int8 \
             AS lock_timeout) s",
        );
        sql
    }
}

impl Lent<'_> {
    pub(crate) fn connection(&mut self) -> &mut PgConnection {
        match self.conn.as_mut() {
            Some(conn) => conn,
            None => unreachable!("a lent connection is present until dropped"),
        }
    }

    /// Whether the connection sat idle in the set before this call.
    pub(crate) fn reused(&self) -> bool {
        self.reused
    }

    /// Back to the idle set after the call (unless too old by then).
    pub(crate) fn keep(&mut self) {
        self.keep = true;
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.keep && !self.set.stale(self.born, None) && self.switches == self.set.switches() {
            self.set.idle_list().push(IdleConnection {
                conn,
                born: self.born,
                since: Instant::now(),
                switches: self.switches,
            });
        } else {
            // Dropped: its socket closes. A call cancelled mid-statement
            // ends here too; the server stops the statement within its
            // timeout, or sooner once it notices the client left.
            drop(conn);
            self.set.closed(1);
        }
    }
}
