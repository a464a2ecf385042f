-- acquire: one statement for every outcome.
-- $1 scope, $2 key, $3 fingerprint (or NULL), $4 new token,
-- $5 lease in microseconds, $6 in-progress grace in microseconds (both
-- saturated by the client to idem_core::MAX_DURATION, so the deadlines fit
-- a timestamptz with room to spare). A lease of 0 means a claim inside the
-- caller's transaction (the in-transaction mode; the plain store refuses a
-- zero lease before sending anything).
--
-- keylock: every acquisition of a key first takes a transaction-scoped
-- advisory lock on it (released at commit; an in-transaction claim holds
-- it until its transaction ends). So the waits come first, and everything
-- computed after them is current: the clock, hence the lease, is read once
-- the lock is held (a lease is never counted from before a wait), and the
-- fence is taken after every earlier acquisition of the key committed: the
-- server's clock in microseconds then, raised to {{sequence}}'s next value
-- and, over a row, to its fence + 1. So fences strictly increase in the
-- order the rows are written, across takeovers, releases, deletes and
-- expiries, and across a failover too: a promoted standby that lacks the
-- last acquisitions (asynchronous replication, a claim whose transaction
-- never committed) and so the sequence's advance, still hands out fences
-- above them by its clock (servers kept in step by NTP: a clock behind by
-- more than the failover took could repeat one). A lock held on
-- the row by something else (a plain SELECT ... FOR UPDATE) can still delay
-- the write: `taken` computes the lease with clock_timestamp() when it
-- writes (re-evaluated after a concurrent update), and both writes return
-- the time they were written, so the store can see a lease shortened by a
-- wait and renew it with a second run of this statement (same token).
--
-- tok: in the in-transaction mode the token starts with 8 bytes naming the
-- transaction (its 64-bit id), so a second claim of the key in the same
-- transaction recognises its own row (`mine`) instead of taking it over.
--
-- `fresh` inserts an absent key. `taken` takes over a row that expired or
-- whose lease is over (unless the fingerprint differs), or renews this
-- call's own reservation (same token: a re-run); being an UPDATE it
-- re-checks the newest row version, so two racers cannot both win.
-- Otherwise the existing row comes back as it is, without a write. A row
-- committed by another transaction after this statement's snapshot can be
-- invisible to the last branch; the store then runs the statement again
-- (with a new snapshot). A completed row comes back with its fence and the
-- time it has left by the server's clock (ttl_us).
WITH keylock AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(hashtext('{{table}}' || $1::text), hashtext($2::text))::text
           AS held
),
clock AS MATERIALIZED (SELECT clock_timestamp() AS now, l.held FROM keylock l),
me AS MATERIALIZED (
    SELECT CASE WHEN $5::int8 = 0 THEN int8send(pg_current_xact_id()::text::int8) END AS tag
),
tok AS MATERIALIZED (
    SELECT coalesce(m.tag || substring($4::bytea FROM 9 FOR 8), $4::bytea) AS token, m.tag
    FROM me m
),
fresh AS (
    INSERT INTO {{table}} AS r
        (scope, key, status, fingerprint, token, attempt, lease_until, created_at, expires_at,
         fence)
    SELECT $1, $2, 1, $3::bytea, t.token, 1,
           c.now + $5::int8 * interval '1 microsecond',
           c.now,
           c.now + ($5::int8 + $6::int8) * interval '1 microsecond',
           greatest(nextval('{{sequence}}'), (extract(epoch FROM c.now) * 1000000)::int8)
    FROM clock c, tok t
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING r.token, r.attempt, r.lease_until, r.expires_at, r.fingerprint, r.fence,
              clock_timestamp() AS written_at
),
taken AS (
    UPDATE {{table}} AS r SET
        status = 1,
        token = t.token,
        attempt = CASE WHEN r.expires_at <= c.now THEN 1
                       WHEN r.token = t.token THEN r.attempt
                       ELSE r.attempt + 1 END,
        fingerprint = CASE WHEN r.expires_at <= c.now THEN $3::bytea
                           ELSE coalesce(r.fingerprint, $3::bytea) END,
        created_at = CASE WHEN r.expires_at <= c.now THEN clock_timestamp() ELSE r.created_at END,
        lease_until = clock_timestamp() + $5::int8 * interval '1 microsecond',
        response = NULL,
        completed_at = NULL,
        expires_at = clock_timestamp() + ($5::int8 + $6::int8) * interval '1 microsecond',
        fence = CASE WHEN r.token = t.token AND r.expires_at > c.now THEN r.fence
                     ELSE greatest(nextval('{{sequence}}'),
                                   (extract(epoch FROM c.now) * 1000000)::int8,
                                   r.fence + 1) END
    FROM clock c, tok t
    WHERE r.scope = $1 AND r.key = $2 AND r.status IN (1, 2)
      AND ((r.status = 1 AND r.token = t.token AND r.expires_at > c.now)
           OR (substring(r.token FROM 1 FOR 8) IS DISTINCT FROM t.tag
               AND (r.expires_at <= c.now
                    OR (r.status = 1 AND r.lease_until <= c.now
                        AND (r.fingerprint IS NULL OR $3::bytea IS NULL
                             OR r.fingerprint = $3::bytea)))))
    RETURNING r.token, r.attempt, r.lease_until, r.expires_at, r.fingerprint, r.fence,
              clock_timestamp() AS written_at
)
SELECT true AS acquired, 1::int2 AS status, f.fingerprint, f.attempt,
       (extract(epoch FROM f.lease_until) * 1000000)::int8 AS lease_until_us,
       NULL::bytea AS response,
       NULL::int8 AS completed_us,
       (extract(epoch FROM f.expires_at) * 1000000)::int8 AS expires_us,
       (extract(epoch FROM f.written_at) * 1000000)::int8 AS now_us,
       f.fence,
       NULL::int8 AS ttl_us,
       f.token,
       false AS mine
FROM fresh f
UNION ALL
SELECT true, 1::int2, t.fingerprint, t.attempt,
       (extract(epoch FROM t.lease_until) * 1000000)::int8,
       NULL::bytea,
       NULL::int8,
       (extract(epoch FROM t.expires_at) * 1000000)::int8,
       (extract(epoch FROM t.written_at) * 1000000)::int8,
       t.fence,
       NULL::int8,
       t.token,
       false
FROM taken t
UNION ALL
SELECT false, r.status, r.fingerprint, r.attempt,
       (extract(epoch FROM r.lease_until) * 1000000)::int8,
       -- the response travels only when it is going to be replayed
       CASE WHEN r.fingerprint IS NULL OR $3::bytea IS NULL OR r.fingerprint = $3::bytea
            THEN r.response END,
       (extract(epoch FROM r.completed_at) * 1000000)::int8,
       (extract(epoch FROM r.expires_at) * 1000000)::int8,
       (extract(epoch FROM c.now) * 1000000)::int8,
       r.fence,
       (extract(epoch FROM r.expires_at - c.now) * 1000000)::int8,
       r.token,
       (r.status = 1 AND substring(r.token FROM 1 FOR 8) = t.tag) IS TRUE
FROM {{table}} r, clock c, tok t
WHERE r.scope = $1 AND r.key = $2
  AND NOT EXISTS (SELECT 1 FROM fresh)
  AND NOT EXISTS (SELECT 1 FROM taken)
