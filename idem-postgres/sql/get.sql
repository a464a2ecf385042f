-- get: the row as stored, with the server's clock; expiry is judged by
-- the caller from now_us. $1 scope, $2 key.
SELECT status, fingerprint, token, attempt,
       (extract(epoch FROM lease_until) * 1000000)::int8 AS lease_until_us,
       response,
       (extract(epoch FROM created_at) * 1000000)::int8 AS created_us,
       (extract(epoch FROM completed_at) * 1000000)::int8 AS completed_us,
       (extract(epoch FROM expires_at) * 1000000)::int8 AS expires_us,
       (extract(epoch FROM clock_timestamp()) * 1000000)::int8 AS now_us,
       fence
FROM {{table}}
WHERE scope = $1 AND key = $2
