-- acquire: one statement for every outcome.
-- $1 scope, $2 key, $3 fingerprint (or NULL), $4 new token,
-- $5 lease in microseconds, $6 in-progress grace in microseconds (both
-- saturated by the client to idem_core::MAX_DURATION, so the deadlines fit
-- a timestamptz with room to spare).
--
-- Every acquisition takes its fence from {{sequence}}: strictly above the
-- fence of every earlier acquisition of the key (the sequence never goes
-- back, whatever happened to the row). In `taken` nextval() runs when the
-- row is updated, after any wait for its lock. A completed row comes back
-- with its fence and the time it has left by the server's clock (ttl_us).
--
-- `fresh` inserts an absent key. `taken` takes over a row that expired or
-- whose lease is over (unless the fingerprint differs); being an UPDATE it
-- re-checks the newest row version, so two racers cannot both win.
-- Otherwise the existing row comes back as it is, without a lock or a write.
-- A row committed by another transaction after this statement's snapshot
-- can be invisible to the last branch; the store then runs the statement
-- again (with a new snapshot).
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now),
fresh AS (
    INSERT INTO {{table}} AS r
        (scope, key, status, fingerprint, token, attempt, lease_until, created_at, expires_at,
         fence)
    SELECT $1, $2, 1, $3::bytea, $4::bytea, 1,
           c.now + $5::int8 * interval '1 microsecond',
           c.now,
           c.now + ($5::int8 + $6::int8) * interval '1 microsecond',
           nextval('{{sequence}}')
    FROM clock c
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING r.attempt, r.lease_until, r.created_at, r.expires_at, r.fingerprint, r.fence
),
taken AS (
    UPDATE {{table}} AS r SET
        status = 1,
        token = $4::bytea,
        attempt = CASE WHEN r.expires_at <= c.now THEN 1 ELSE r.attempt + 1 END,
        fingerprint = CASE WHEN r.expires_at <= c.now THEN $3::bytea
                           ELSE coalesce(r.fingerprint, $3::bytea) END,
        created_at = CASE WHEN r.expires_at <= c.now THEN c.now ELSE r.created_at END,
        lease_until = c.now + $5::int8 * interval '1 microsecond',
        response = NULL,
        completed_at = NULL,
        expires_at = c.now + ($5::int8 + $6::int8) * interval '1 microsecond',
        fence = nextval('{{sequence}}')
    FROM clock c
    WHERE r.scope = $1 AND r.key = $2 AND r.status IN (1, 2)
      AND (r.expires_at <= c.now
           OR (r.status = 1 AND r.lease_until <= c.now
               AND (r.fingerprint IS NULL OR $3::bytea IS NULL OR r.fingerprint = $3::bytea)))
    RETURNING r.attempt, r.lease_until, r.created_at, r.expires_at, r.fingerprint, r.fence
)
SELECT true AS acquired, 1::int2 AS status, f.fingerprint, f.attempt,
       (extract(epoch FROM f.lease_until) * 1000000)::int8 AS lease_until_us,
       NULL::bytea AS response,
       NULL::int8 AS completed_us,
       (extract(epoch FROM f.expires_at) * 1000000)::int8 AS expires_us,
       (extract(epoch FROM c.now) * 1000000)::int8 AS now_us,
       f.fence,
       NULL::int8 AS ttl_us
FROM fresh f, clock c
UNION ALL
SELECT true, 1::int2, t.fingerprint, t.attempt,
       (extract(epoch FROM t.lease_until) * 1000000)::int8,
       NULL::bytea,
       NULL::int8,
       (extract(epoch FROM t.expires_at) * 1000000)::int8,
       (extract(epoch FROM c.now) * 1000000)::int8,
       t.fence,
       NULL::int8
FROM taken t, clock c
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
       (extract(epoch FROM r.expires_at - c.now) * 1000000)::int8
FROM {{table}} r, clock c
WHERE r.scope = $1 AND r.key = $2
  AND NOT EXISTS (SELECT 1 FROM fresh)
  AND NOT EXISTS (SELECT 1 FROM taken)
