//! PostgreSQL store for [idem](https://docs.rs/idemkit), on sqlx.
//!
//! [`PgStore`] keeps one row per idempotency key in a table
//! (`public.idem_records` by default; schema and name configurable) with the
//! primary key `(scope, key)`, so the table can be hash-partitioned or
//! distributed by key. Every [`IdempotencyStore`] operation is one SQL
//! statement, one round trip: `acquire` inserts a fresh key, takes over a
//! key whose lease is over, or returns the stored state (completed response,
//! in-progress deadline or mismatch) in the same statement. Time is the
//! server's (`clock_timestamp()`), never the client's.
//!
//! ```no_run
//! use idem_core::{Idempotency, IdempotencyKey};
//! use idem_postgres::PgStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::postgres::PgPoolOptions::new()
//!     .max_connections(16)
//!     .connect("postgres://app@127.0.0.1/app")
//!     .await?;
//! let store = PgStore::new(pool);
//! store.migrate().await?; // safe from several processes at once
//! let idem = Idempotency::new(store);
//! let key = IdempotencyKey::new("orders.create", "client-key-1")?;
//! let out = idem.process(&key, 42u32, |n| async move { Ok::<_, std::io::Error>(n) }).await?;
//! # Ok(()) }
//! ```
//!
//! The **in-transaction mode** ([`PgStore::in_transaction`]) goes further:
//! the reservation, your business writes and the completion share your
//! `sqlx::Transaction`, so they commit or roll back together.
//!
//! Expired rows are invisible but stay until deleted: run
//! [`purge_periodically`](idem_core::purge_periodically) (or call
//! `purge_expired`) to delete them in bounded batches (each found through
//! the `expires_at` index).
//!
//! **Connections.** The store runs its statements on a small set of
//! connections of its own, at most [`PgStoreBuilder::connections`] (default
//! [`DEFAULT_CONNECTIONS`], 4, or the pool's `max_connections` if smaller),
//! **in addition to** the pool's, which `migrate` and the in-transaction
//! mode use: budget `max_connections + connections` server connections per
//! store. They are opened the way the pool opens its own (connect options
//! and `after_connect`), closed after the pool's `idle_timeout` and
//! `max_lifetime`, and reused without the pool's ping on return (which
//! would be a second round trip per call). `connections` is taken up to
//! [`MAX_CONNECTIONS`] (10,000; larger values are clamped). A connection
//! counts as open once its session setup succeeded (one whose setup fails
//! is closed and never counted): [`PgStore::connection_stats`] and the
//! gauge `idem_postgres_connections` (label `table`) show them.
//!
//! **Timeouts.** A call takes at most `call_timeout` (default 10 s), and
//! the server enforces it too: the store's connections run with
//! `statement_timeout` and `lock_timeout` at half of it (or the
//! connection's own, if lower), set once when a connection is opened, and a
//! statement (a first send, a resend, or a re-run of `acquire`) is only
//! sent while enough of the call is left for the server to stop it first. So a statement whose caller was told "unavailable"
//! never commits later, and callers retrying behind a frozen lock holder
//! never pile up server backends. Timeouts (57014, 55P03, 57P05),
//! connection failures and a server shutting down are
//! [`StoreError::Unavailable`] (retryable).
//!
//! **Restarts and lost replies.** When a call's connection fails, fresh
//! or reused (the server closed it while it sat idle, a restart,
//! `idle_session_timeout`, a terminated backend, a reply lost on the
//! network), the store sends the call once more on a fresh connection,
//! under the same time rule as the first send, so a restart costs no
//! failed call and a lost `acquire` reply leaves no reservation that
//! nobody holds. This is safe whether or not the first statement ran:
//! `acquire`, `complete`, `extend` and `release` carry the call's token
//! (`acquire` with the token that holds the key answers "acquired",
//! `complete` with the same token changes nothing, a resent `release`
//! answers `LeaseLost` if the first send did the work), and `get` and
//! `purge_expired` only read or delete expired rows.
//!
//! **`delete` is never resent**: it has no token, so a second send would
//! delete whatever holds the key by then (a reservation made after the
//! first send deleted the record, whose handler would then run twice). A
//! connection failure during `delete` is [`StoreError::Unavailable`], and
//! the delete **may or may not have happened**; calling it again is safe
//! for an operator who decides to (it deletes the key's record as it is
//! then).
//!
//! **Leases and fences under waits.** Every acquisition of a key first
//! takes a transaction-scoped advisory lock on it (released when its
//! statement commits; an in-transaction claim holds it until your
//! transaction ends), then reads the server's clock and takes its fence.
//! So a lease is counted from after any wait, never from the statement's
//! start, and the fences of a key strictly increase in the order its rows
//! are written. If a lock taken on the row by something else delays the
//! write anyway, the statement reports when it wrote, and an acquisition
//! that lost more than half its lease to the wait is renewed by a second
//! run of the statement (same token) before it is handed out: a lease that
//! is already over is never reported. A re-run (this renewal, or a new
//! snapshot after a row committed during the wait) obeys the same time
//! rule as the first send: too late in the call, an acquisition is handed
//! out with what is left of its lease, or, if nothing is, the call is
//! `Unavailable`, as is one whose statement had written nothing.
//!
//! **Batches.** `acquire_many` sends one statement over arrays
//! (`unnest(...) WITH ORDINALITY`, `sql/acquire_many.sql`) for up to
//! [`PgStoreBuilder::batch_statement`] items (default 256), with every
//! guarantee of `acquire` per item: the advisory lock of each key (taken in
//! one sorted order, so batches sharing keys queue instead of
//! deadlocking), the lease counted from after the waits, the re-runs of
//! items that saw a stale view or lost half their lease to a wait, the time
//! rule and the resend (each item keeps its token). A key repeated in a
//! batch goes into a later statement for each repetition, so every item
//! sees the effect of those before it, as calls in order would.
//! `complete_many` is one statement the same way. A key held by a long
//! transaction (an in-transaction claim) holds up its whole statement, up
//! to the server's `lock_timeout`.
//!
//! **Fences** are the server's clock in microseconds when the key is
//! acquired (after its lock is held), raised to the next value of a
//! sequence (`<table>_fence_seq`, created by migration 2 next to the
//! table: every acquisition, in a transaction or not, takes one) and, over
//! an existing row, to its fence + 1. So a key's fences strictly increase
//! across takeovers (whatever the clock does), releases, deletes and
//! expiries (there by the clock and the sequence together), and **across a
//! failover**: a promoted standby that lacks the last acquisitions
//! (asynchronous replication, a standby that was away, an in-transaction
//! claim whose transaction never committed), and with them the sequence's
//! advance, still hands out fences above them by its clock. That last
//! part rests on the servers' clocks (NTP): a standby whose clock is
//! behind the old primary's by more than the failover took could repeat a
//! fence. Rows written before migration 2 have fence 0. A completed record
//! handed out by `acquire` carries its fence and the time it has left,
//! computed by the server (`expires_at - clock_timestamp()`).
//!
//! **Failover.** Give [`connect`] one failover address (a DNS name or
//! virtual IP your failover manager moves, or a proxy in front of the
//! primary), or give [`connect_any`] / [`Failover`] the URLs of the primary
//! and its standbys: every new connection goes to the server that answers
//! `pg_is_in_recovery() = false` (`target_session_attrs=read-write`
//! semantics), and a connection lost or refused as read-only (25006) sends
//! the store looking for the new primary; meanwhile calls fail with the
//! retryable [`StoreError::Unavailable`].
//!
//! Requires PostgreSQL 13 or later (`client_connection_check_interval` is
//! used from 14 on).
//!
//! **Durations**: a zero lease (or extension) is refused with
//! [`StoreError::InvalidArgument`] before anything is sent; leases,
//! extensions and retentions are saturated to
//! [`MAX_DURATION`](idem_core::MAX_DURATION) and rounded up to whole
//! microseconds, so `Duration::MAX` means "as long as the store can hold"
//! and no deadline overflows.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admin;
mod batch;
mod builder;
mod connect;
mod connection;
mod decode;
mod error;
mod failover;
mod in_tx;
mod migrate;
mod operations;
mod statements;
mod store;
mod timeouts;

#[cfg(doc)]
use idem_core::{IdempotencyStore, StoreError};

pub use admin::{ListedRecord, ScopeCounts, StuckRows};
pub use builder::{
    default_batching, PgStoreBuilder, DEFAULT_BATCH_STATEMENT, DEFAULT_CONNECTIONS,
    MAX_BATCH_STATEMENT, MAX_CONNECTIONS,
};
pub use connect::{connect, connect_with};
pub use connection::ConnectionStats;
pub use error::{CallTimeout, ConfigError, MissingTable, NoConnection, TlsRefused};
pub use failover::{
    connect_any, Failover, NoWritableServer, DEFAULT_CHECK_INTERVAL, DEFAULT_PROBE_TIMEOUT,
};
pub use idem_core;
pub use in_tx::{Claim, Completion, InTransaction, PgTx, TxLease};
/// The sqlx this crate is built on: a `PgPool` given to [`PgStore`] must come
/// from this version (a pool of another sqlx major version is a different
/// type). Name it as `idemkit::postgres::sqlx` to be sure.
pub use sqlx;
pub use store::PgStore;
