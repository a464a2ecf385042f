//! Redis and Redis Cluster store for [idem](https://docs.rs/idemkit).
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
//!   narrows that window (`WAIT n ms` after each acquire, extension,
//!   completion and replay, one more round trip each; an acquisition whose
//!   `WAIT` fails, or outlasts its lease, is released, so its retry can
//!   acquire; an extension or a replay whose `WAIT` fails is
//!   `Unavailable`); PostgreSQL, or the tiered store with PostgreSQL
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
//!   `release` and `delete_if_token` leave such a marker too (`release`
//!   only when it freed the key), so their resend answers what the first
//!   send did: released, deleted (without it, the record being gone, the
//!   resend would answer `LeaseLost` or "nothing deleted").
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

mod acl;
mod admin;
mod call;
mod connect;
mod decode;
mod error;
mod format;
mod heal;
mod operations;
mod scripts;
mod slots;
mod store;
pub mod streams;
#[cfg(feature = "tls")]
mod tls;

pub use acl::acl_rules;
pub use admin::{CountScan, ScannedRecord, StateCounts, StuckScan};
pub use error::{CallTimeout, Refused, UnexpectedReply};
pub use heal::STALL_AFTER;
pub use store::{default_batching, RedisStore, DEFAULT_MAX_RESPONSE_BYTES};
#[cfg(feature = "tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
pub use tls::{install_crypto_provider, TlsOptions};

pub use idem_core;
pub use redis;

// Named by the crate docs above.
#[cfg(doc)]
use idem_core::{Lease, StoreError};

// `streams` reaches these at the crate root.
use error::map_error;
use scripts::millis;
