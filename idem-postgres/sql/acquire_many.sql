-- acquire_many: acquire.sql over arrays, one statement for a batch, one
-- row per item. $1 scopes (text[]), $2 keys (text[]), $3 fingerprints
-- (bytea[], NULL elements for none), $4 new tokens (bytea[], one per
-- item), $5 lease in microseconds, $6 in-progress grace in microseconds,
-- $7 whether the keys' locks are only tried (see keylock).
-- A key appears at most once per statement: the store sends a key's later
-- items of a batch in later statements, so that each sees the effect of
-- the earlier ones (and ON CONFLICT / UPDATE ... FROM never meet a row
-- twice). Only the plain store sends it (no in-transaction claims: no
-- transaction tag in the tokens).
--
-- keylock: the advisory lock of every key, as acquire.sql takes it, in
-- ascending order of the lock's id (a volatile function in the select
-- list is evaluated after the ORDER BY, in output order), so that two
-- batches that share keys queue instead of deadlocking. With $7 true (a
-- batch of other callers' single calls, batched by the store), the locks
-- are only tried: a key whose lock is held elsewhere (an in-transaction
-- claim, another statement acquiring it) comes back `busy`, untouched,
-- and its caller sends it alone with acquire.sql, which waits for it, so
-- one held key never holds up the other callers. Then the clock is read:
-- every lease counts from after every wait, and fences are taken after
-- every earlier acquisition of each key committed (the clock in
-- microseconds, raised to {{sequence}}'s next value and to a row's fence
-- + 1, as acquire.sql explains).
--
-- `fresh`, `taken` and the existing rows are acquire.sql's branches, per
-- item. An item whose key has no visible row and nothing written (a row
-- committed after this statement's snapshot) comes back with `acquired`
-- NULL: the store runs it again, as acquire.sql's empty answer.
-- Column 13 is the item's 1-based position in the arrays; column 14 is
-- true for a busy item (every other column NULL).
WITH input AS MATERIALIZED (
    SELECT i.ord, i.scope, i.key, i.fp, i.token
    FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[])
         WITH ORDINALITY AS i(scope, key, fp, token, ord)
),
keylock AS MATERIALIZED (
    SELECT l.k1, l.k2,
           CASE WHEN $7::bool THEN pg_try_advisory_xact_lock(l.k1, l.k2)
                ELSE pg_advisory_xact_lock(l.k1, l.k2)::text IS NOT NULL END AS held
    FROM (SELECT DISTINCT hashtext('{{table}}' || scope) AS k1, hashtext(key) AS k2
          FROM input) l
    ORDER BY l.k1, l.k2
),
locked AS MATERIALIZED (
    SELECT i.ord, i.scope, i.key, i.fp, i.token
    FROM input i
    JOIN keylock k ON k.k1 = hashtext('{{table}}' || i.scope) AND k.k2 = hashtext(i.key)
    WHERE k.held
),
clock AS MATERIALIZED (
    SELECT clock_timestamp() AS now, (SELECT count(*) FROM keylock) AS held
),
fresh AS (
    INSERT INTO {{table}} AS r
        (scope, key, status, fingerprint, token, attempt, lease_until, created_at, expires_at,
         fence)
    SELECT i.scope, i.key, 1, i.fp, i.token, 1,
           c.now + $5::int8 * interval '1 microsecond',
           c.now,
           c.now + ($5::int8 + $6::int8) * interval '1 microsecond',
           greatest(nextval('{{sequence}}'), (extract(epoch FROM c.now) * 1000000)::int8)
    FROM locked i, clock c
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING r.scope, r.key, r.token, r.attempt, r.lease_until, r.expires_at, r.fingerprint,
              r.fence, clock_timestamp() AS written_at
),
taken AS (
    UPDATE {{table}} AS r SET
        status = 1,
        token = i.token,
        attempt = CASE WHEN r.expires_at <= c.now THEN 1
                       WHEN r.token = i.token THEN r.attempt
                       ELSE r.attempt + 1 END,
        fingerprint = CASE WHEN r.expires_at <= c.now THEN i.fp
                           ELSE coalesce(r.fingerprint, i.fp) END,
        created_at = CASE WHEN r.expires_at <= c.now THEN clock_timestamp() ELSE r.created_at END,
        lease_until = clock_timestamp() + $5::int8 * interval '1 microsecond',
        response = NULL,
        completed_at = NULL,
        expires_at = clock_timestamp() + ($5::int8 + $6::int8) * interval '1 microsecond',
        fence = CASE WHEN r.token = i.token AND r.expires_at > c.now THEN r.fence
                     ELSE greatest(nextval('{{sequence}}'),
                                   (extract(epoch FROM c.now) * 1000000)::int8,
                                   r.fence + 1) END
    FROM locked i, clock c
    WHERE r.scope = i.scope AND r.key = i.key AND r.status IN (1, 2)
      AND ((r.status = 1 AND r.token = i.token AND r.expires_at > c.now)
           OR r.expires_at <= c.now
           OR (r.status = 1 AND r.lease_until <= c.now
               AND (r.fingerprint IS NULL OR i.fp IS NULL OR r.fingerprint = i.fp)))
    RETURNING r.scope, r.key, r.token, r.attempt, r.lease_until, r.expires_at, r.fingerprint,
              r.fence, clock_timestamp() AS written_at
),
written AS (
    SELECT * FROM fresh
    UNION ALL
    SELECT * FROM taken
)
SELECT true AS acquired, 1::int2 AS status, w.fingerprint, w.attempt,
       (extract(epoch FROM w.lease_until) * 1000000)::int8 AS lease_until_us,
       NULL::bytea AS response,
       NULL::int8 AS completed_us,
       (extract(epoch FROM w.expires_at) * 1000000)::int8 AS expires_us,
       (extract(epoch FROM w.written_at) * 1000000)::int8 AS now_us,
       w.fence,
       NULL::int8 AS ttl_us,
       w.token,
       false AS mine,
       i.ord,
       false AS busy
FROM locked i JOIN written w ON w.scope = i.scope AND w.key = i.key
UNION ALL
SELECT CASE WHEN r.key IS NOT NULL THEN false END, r.status, r.fingerprint, r.attempt,
       (extract(epoch FROM r.lease_until) * 1000000)::int8,
       -- the response travels only when it is going to be replayed
       CASE WHEN r.fingerprint IS NULL OR i.fp IS NULL OR r.fingerprint = i.fp
            THEN r.response END,
       (extract(epoch FROM r.completed_at) * 1000000)::int8,
       (extract(epoch FROM r.expires_at) * 1000000)::int8,
       (extract(epoch FROM c.now) * 1000000)::int8,
       r.fence,
       (extract(epoch FROM r.expires_at - c.now) * 1000000)::int8,
       r.token,
       false,
       i.ord,
       false
FROM locked i
CROSS JOIN clock c
LEFT JOIN {{table}} r ON r.scope = i.scope AND r.key = i.key
WHERE NOT EXISTS (SELECT 1 FROM written w WHERE w.scope = i.scope AND w.key = i.key)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, i.ord, true
FROM input i
WHERE NOT EXISTS (SELECT 1 FROM locked l WHERE l.ord = i.ord)
