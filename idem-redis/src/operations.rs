//! The [`IdempotencyStore`] implementation: one script per operation, one
//! round trip (per hash slot for a batch on Redis Cluster).

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::within_response_limit;
use idem_core::{
    AcquireItem, Acquisition, Fingerprint, IdempotencyKey, IdempotencyStore, Lease, LeaseToken,
    Record, StoreError, IN_PROGRESS_GRACE,
};
use redis::aio::ConnectionLike;
use redis::{Cmd, Value};

use crate::decode::{
    attempt_of, decode_acquire, decode_batch_acquire, decode_record, fence_of, int, time_of,
    BatchClock,
};
use crate::error::{corrupt, is_cross_slot, is_wrong_type, unexpected};
use crate::scripts::{millis, RecordKey};
use crate::slots::delete_marker;
use crate::store::RedisStore;

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
        let alone = self.acquire_alone(key, fingerprint, lease);
        self.batcher
            .acquire(self, key, fingerprint, lease, alone)
            .await
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        if !within_response_limit(response, self.max_response_bytes) {
            return Err(StoreError::ResponseTooLarge {
                size: response.len(),
                limit: self.max_response_bytes,
            });
        }
        let alone = self.complete_alone(lease, response, retention);
        self.batcher
            .complete(self, lease, response, retention, alone)
            .await
    }

    // One script, one round trip, harmless to resend: a release that freed
    // the key leaves a marker (see `delete_marker` and
    // `scripts/release.lua`), so a resend after a lost reply answers done,
    // not `LeaseLost`.
    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let redis_key = self.redis_key(&lease.key);
        let request = LeaseToken::random().to_hex();
        let marker = delete_marker(&self.prefix, &redis_key, &request)
            .ok_or_else(|| unexpected(format!("no call marker in the hash slot of {redis_key}")))?;
        let mut cmd = Cmd::with_capacity(7, 96 + 2 * redis_key.len());
        cmd.arg("EVALSHA")
            .arg(self.scripts.release.get_hash())
            .arg(2)
            .arg(&redis_key)
            .arg(&marker)
            .arg(&lease.token.to_bytes()[..])
            .arg(millis(self.delete_marker_ttl()));
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
                // Under WAIT, an extension is reported only once the
                // replicas have it: one they lack ends at the old deadline
                // after a failover, and a duplicate could take the key over
                // while its holder counts on the new one.
                if self.wait.is_some() {
                    self.wait_replicas(&self.redis_key(key), Some((lease_for, until)), false)
                        .await?;
                }
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
        let lease_ms = millis(lease);
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
                    cmd.arg(lease_ms).arg(millis(IN_PROGRESS_GRACE));
                    for &i in &group {
                        let fp: &[u8] = items[i]
                            .fingerprint
                            .map(|f| f.as_bytes().as_slice())
                            .unwrap_or(&[]);
                        cmd.arg(fp).arg(&tokens[i].to_bytes()[..]);
                    }
                    async move {
                        match self.run_script(&self.scripts.acquire_many, &cmd).await {
                            Ok(reply) => Ok::<(Vec<usize>, Value), _>((group, reply)),
                            Err(e) => Err((group, e)),
                        }
                    }
                });
            let answers = futures_util::future::join_all(calls).await;
            if !per_slot
                && answers
                    .iter()
                    .any(|a| matches!(a, Err((_, e)) if is_cross_slot(e)))
            {
                self.cluster.store(true, Ordering::Relaxed);
                continue;
            }
            break answers;
        };
        // A script call that Redis refused (an ACL that denies one of its
        // keys, a write refused at `maxmemory`) failed as a whole for what
        // may be one key's reason: each of its keys goes alone, with its
        // token, so each caller gets the answer its own call would have.
        // (A command the ACL refuses to the scripts fails every batch: its
        // error stays, for the operator to see.)
        let mut answers_kept = Vec::with_capacity(answers.len());
        for answer in answers {
            match answer {
                Err((group, e)) if group.len() > 1 && refused_for_one_key(&e) => {
                    let alone = group.iter().map(|&i| {
                        self.acquire_with_token(
                            items[i].key,
                            items[i].fingerprint,
                            lease,
                            tokens[i],
                        )
                    });
                    let got = futures_util::future::join_all(alone).await;
                    for (&i, got) in group.iter().zip(got) {
                        out[i] = Some(got);
                    }
                }
                other => answers_kept.push(other),
            }
        }
        let mut groups = Vec::new();
        for answer in answered_groups(answers_kept)? {
            let (group, reply) = match answer {
                Ok(answer) => answer,
                Err((group, e)) => {
                    for i in group {
                        out[i] = Some(Err(e.replicate()));
                    }
                    continue;
                }
            };
            // The time, then each key's reply (a replay's followed by its
            // time left): at least 2 + one value per key, at most 2 + two.
            let (clock, replies) = match reply {
                Value::Array(replies)
                    if (group.len() + 2..=2 * group.len() + 2).contains(&replies.len()) =>
                {
                    let mut replies = replies.into_iter();
                    let clock = match (replies.next(), replies.next()) {
                        (Some(ms), Some(us)) => BatchClock::of(&ms, &us)?,
                        _ => return Err(unexpected("acquire_many returned no time".into())),
                    };
                    (clock, replies)
                }
                other => {
                    return Err(unexpected(format!(
                        "acquire_many returned {other:?} for {} keys",
                        group.len()
                    )))
                }
            };
            let mut replies = replies.peekable();
            for &i in &group {
                let Some(reply) = replies.next() else {
                    return Err(unexpected(format!(
                        "acquire_many answered fewer than {} keys",
                        group.len()
                    )));
                };
                let ttl = if matches!(reply, Value::BulkString(_)) {
                    replies.next()
                } else {
                    None
                };
                out[i] = Some(decode_batch_acquire(
                    reply,
                    ttl,
                    items[i].key,
                    tokens[i],
                    items[i].fingerprint,
                    lease_ms,
                    clock,
                ));
            }
            if replies.peek().is_some() {
                return Err(unexpected(format!(
                    "acquire_many answered more than {} keys",
                    group.len()
                )));
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
            // A group's replays are of completions the replicas have: the
            // WAIT after its acquisitions (written after those completions
            // were read) covers them, or one after a write of its own.
            for group in groups {
                let held: Vec<usize> = group
                    .iter()
                    .copied()
                    .filter(|&i| matches!(out[i], Ok(Acquisition::Acquired(_))))
                    .collect();
                let replays: Vec<usize> = group
                    .iter()
                    .copied()
                    .filter(|&i| matches!(out[i], Ok(Acquisition::Completed(_))))
                    .collect();
                let deadline = held
                    .iter()
                    .filter_map(|&i| match &out[i] {
                        Ok(Acquisition::Acquired(l)) => Some(l.expires_at),
                        _ => None,
                    })
                    .min();
                let Some(&first) = held.first().or(replays.first()) else {
                    continue;
                };
                let redis_key = self.redis_key(items[first].key);
                let waited = match deadline {
                    Some(deadline) => {
                        self.wait_replicas(&redis_key, Some((lease, deadline)), false)
                            .await
                    }
                    None => self.wait_replicas(&redis_key, None, true).await,
                };
                if let Err(e) = waited {
                    // Alone, a replay waits the whole configured time, not
                    // one bounded by another key's lease: the replays get
                    // a WAIT of their own before they fail.
                    let replayed = match deadline {
                        Some(_) if !replays.is_empty() => {
                            let redis_key = self.redis_key(items[replays[0]].key);
                            self.wait_replicas(&redis_key, None, true).await
                        }
                        _ => Err(e.replicate()),
                    };
                    if let Err(e) = replayed {
                        for &i in &replays {
                            out[i] = Err(e.replicate());
                        }
                    }
                    for i in held {
                        if let Ok(Acquisition::Acquired(l)) = &out[i] {
                            if let Err(released) = self.release(l).await {
                                tracing::warn!(
                                    key = %self.redis_key(items[i].key), error = %released,
                                    "WAIT failed and the reservation could not be released: the key stays in progress until its lease ends"
                                );
                            }
                        }
                        out[i] = Err(e.replicate());
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
                (!within_response_limit(response, self.max_response_bytes)).then(|| {
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
                        match self.run_script(&self.scripts.complete_many, &cmd).await {
                            Ok(done) => Ok::<(Vec<usize>, Vec<i64>), _>((group, done)),
                            Err(e) => Err((group, e)),
                        }
                    }
                });
            let answers = futures_util::future::join_all(calls).await;
            if !per_slot
                && answers
                    .iter()
                    .any(|a| matches!(a, Err((_, e)) if is_cross_slot(e)))
            {
                self.cluster.store(true, Ordering::Relaxed);
                continue;
            }
            break answers;
        };
        // As in `acquire_many`: a script call that Redis refused goes key
        // by key (completing again with the same token is harmless).
        let mut answers_kept = Vec::with_capacity(answers.len());
        for answer in answers {
            match answer {
                Err((group, e)) if group.len() > 1 && refused_for_one_key(&e) => {
                    let alone = group
                        .iter()
                        .map(|&i| self.complete_alone(items[i].0, items[i].1, retention));
                    let got = futures_util::future::join_all(alone).await;
                    for (&i, got) in group.iter().zip(got) {
                        out[i] = Some(got);
                    }
                }
                other => answers_kept.push(other),
            }
        }
        let mut groups = Vec::new();
        for answer in answered_groups(answers_kept)? {
            let (group, done) = match answer {
                Ok(answer) => answer,
                Err((group, e)) => {
                    for i in group {
                        out[i] = Some(Err(e.replicate()));
                    }
                    continue;
                }
            };
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
                if let Err(e) = self.wait_replicas(&redis_key, None, false).await {
                    for i in done {
                        out[i] = Err(e.replicate());
                    }
                }
            }
        }
        Ok(out)
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// `acquire` as one call of its own (`acquire.lua`).
    pub(crate) async fn acquire_alone(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
    ) -> Result<Acquisition, StoreError> {
        // Refused here, before the round trip: nothing is written.
        if lease.is_zero() {
            return Err(StoreError::zero_lease());
        }
        self.acquire_with_token(key, fingerprint, lease, LeaseToken::random())
            .await
    }

    /// `acquire` alone with `token`: a resend of a batch's item after its
    /// script call failed (a key the script reserved for that token before
    /// it failed answers acquired to it, as a resend does).
    async fn acquire_with_token(
        &self,
        key: &IdempotencyKey,
        fingerprint: Option<&Fingerprint>,
        lease: Duration,
        token: LeaseToken,
    ) -> Result<Acquisition, StoreError> {
        let lease_length = lease;
        let fp: &[u8] = fingerprint.map(|f| f.as_bytes().as_slice()).unwrap_or(&[]);
        let mut cmd = self.evalsha(&self.scripts.acquire, key, 4, 48);
        cmd.arg(fp)
            .arg(&token.to_bytes()[..])
            .arg(millis(lease))
            .arg(millis(IN_PROGRESS_GRACE));
        let reply: Value = self.run_script(&self.scripts.acquire, &cmd).await?;
        let outcome = decode_acquire(reply, key, token)?;
        // Under WAIT, a replay is of a completion the replicas have: a
        // completion whose own WAIT failed may be lost in a failover, and
        // the key run again, after this caller got its result.
        if let (Acquisition::Completed(_), Some(_)) = (&outcome, self.wait) {
            self.wait_replicas(&self.redis_key(key), None, true).await?;
        }
        if let (Acquisition::Acquired(lease), Some(_)) = (&outcome, self.wait) {
            let redis_key = self.redis_key(key);
            if let Err(e) = self
                .wait_replicas(&redis_key, Some((lease_length, lease.expires_at)), false)
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

    /// `complete` as one call of its own (`complete.lua`).
    pub(crate) async fn complete_alone(
        &self,
        lease: &Lease,
        response: &[u8],
        retention: Duration,
    ) -> Result<(), StoreError> {
        // The size was checked by `complete`, before the batcher.
        let mut cmd = self.evalsha(&self.scripts.complete, &lease.key, 3, 32 + response.len());
        cmd.arg(&lease.token.to_bytes()[..])
            .arg(response)
            .arg(millis(retention));
        let done: i64 = self.run_script(&self.scripts.complete, &cmd).await?;
        if done != 1 {
            return Err(StoreError::LeaseLost);
        }
        if self.wait.is_some() {
            self.wait_replicas(&self.redis_key(&lease.key), None, false)
                .await?;
        }
        Ok(())
    }
}

/// Whether Redis refused a batch's script call for what may be the reason
/// of one of its keys: a key the ACL denies, a write refused at
/// `maxmemory` (any error reply but one that a setting of the store's own
/// causes, such as a command the scripts run that the ACL refuses, which
/// would refuse every batch).
fn refused_for_one_key(e: &StoreError) -> bool {
    let StoreError::Backend(source) = e else {
        return false;
    };
    match source.downcast_ref::<crate::error::Refused>() {
        Some(refused) => refused
            .source
            .detail()
            .is_some_and(|d| d.contains("access") && d.contains("key")),
        None => true,
    }
}

/// The answers of a batch's script calls (one per hash slot): the call
/// fails as a whole only if every one failed (nothing answered); else a
/// failed one is its own items' error, and the others keep their answers,
/// as their keys' calls made alone would.
#[allow(clippy::type_complexity)]
fn answered_groups<T>(
    answers: Vec<Result<(Vec<usize>, T), (Vec<usize>, StoreError)>>,
) -> Result<Vec<Result<(Vec<usize>, T), (Vec<usize>, StoreError)>>, StoreError> {
    if answers.iter().all(|a| a.is_err()) {
        if let Some(Err((_, e))) = answers.into_iter().next() {
            return Err(e);
        }
        return Ok(Vec::new());
    }
    Ok(answers)
}
