-- complete_many: complete.sql over arrays, one statement for a batch.
-- $1 scopes (text[]), $2 keys (text[]), $3 tokens (bytea[]), $4 responses
-- (bytea[]), $5 retention in microseconds. A key appears at most once per
-- statement (the store sends a key's later items in later statements), so
-- no row is matched by two items. Returns the 1-based positions of the
-- items that completed (or had completed with this same token: a retry
-- after a lost reply); every other item lost its lease.
WITH input AS (
    SELECT i.ord, i.scope, i.key, i.token, i.response
    FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[])
         WITH ORDINALITY AS i(scope, key, token, response, ord)
)
UPDATE {{table}} AS r SET
    response = CASE WHEN r.status = 1 THEN i.response ELSE r.response END,
    completed_at = CASE WHEN r.status = 1 THEN clock_timestamp() ELSE r.completed_at END,
    expires_at = CASE WHEN r.status = 1
                      THEN clock_timestamp() + $5::int8 * interval '1 microsecond'
                      ELSE r.expires_at END,
    lease_until = NULL,
    status = 2
FROM input i
WHERE r.scope = i.scope AND r.key = i.key AND r.token = i.token
  AND (r.status = 2 OR (r.status = 1 AND r.expires_at > clock_timestamp()))
RETURNING i.ord
