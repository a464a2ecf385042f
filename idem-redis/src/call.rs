//! How one call reaches Redis: bounded by the call timeout, watched for
//! silence (a store that replaces its connection), a script loaded when
//! the server does not know it, and `WAIT` for replicas.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::{IdempotencyKey, StoreError};
use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, Script, ServerErrorKind};

use crate::acl::check_prefix;
use crate::error::{map_error, CallTimeout};
use crate::scripts::{millis, RecordKey};
use crate::slots::slot_of;
use crate::store::{Conn, RedisStore};

/// How long the marker a replay writes before its `WAIT` lives
/// ([`RedisStore::wait_replicas`]): long enough to be written, short
/// enough that replays leave nothing behind.
const WAIT_MARKER_TTL: Duration = Duration::from_secs(1);

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The hash slot of `key` for the silence watch of a store that
    /// replaces its connection; `None` (nothing computed) for the others.
    pub(crate) fn watched_slot(&self, key: &[u8]) -> Option<u16> {
        match self.conn {
            Conn::Healing(_) => Some(slot_of(key)),
            Conn::Fixed(_) => None,
        }
    }

    pub(crate) async fn timed<T, F>(&self, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, RedisError>>,
    {
        self.timed_for(self.call_timeout, None, call).await
    }

    /// `call` within `limit`; `slot`: the hash slot of its key, if it
    /// has one (a store that replaces a silent connection watches each
    /// slot too: one master frozen while its replica takes over leaves
    /// only its slots silent).
    pub(crate) async fn timed_for<T, F>(
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

    /// An `EVALSHA` of `script` on the record of `key`, its name written
    /// straight into the command (no `String` per call); the caller appends
    /// `args` arguments of about `bytes` bytes in all.
    pub(crate) fn evalsha(
        &self,
        script: &Script,
        key: &IdempotencyKey,
        args: usize,
        bytes: usize,
    ) -> Cmd {
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
    pub(crate) async fn run_script<T: FromRedisValue>(
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
    ///
    /// `WAIT` covers the writes this connection made. A call that wrote
    /// nothing (a replay, which only read a completion someone else wrote)
    /// passes `write_first`: a marker is written in the record's slot
    /// first, so the `WAIT` covers everything the node wrote before it,
    /// that completion included. The marker lives [`WAIT_MARKER_TTL`]:
    /// its write, not its value, is what counts, so replays leave no key
    /// behind for longer than that.
    pub(crate) async fn wait_replicas(
        &self,
        redis_key: &str,
        lease: Option<(Duration, SystemTime)>,
        write_first: bool,
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
                // A command on the key (or in its slot) in front routes the
                // pipeline to the key's node in a cluster; WAIT's reply is
                // the second.
                match write_first
                    .then(|| {
                        // A random id, as a call's marker: a fixed one is
                        // the name of a valid record (scope `delete`),
                        // which the marker would overwrite.
                        let request = idem_core::LeaseToken::random().to_hex();
                        crate::slots::delete_marker(&self.prefix, redis_key, &request)
                    })
                    .flatten()
                {
                    Some(marker) => pipe
                        .cmd("SET")
                        .arg(marker)
                        .arg(1)
                        .arg("PX")
                        .arg(millis(WAIT_MARKER_TTL))
                        .ignore(),
                    None => pipe.cmd("EXISTS").arg(redis_key).ignore(),
                };
                pipe.add_command(cmd);
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
