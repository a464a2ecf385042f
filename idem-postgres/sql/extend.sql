-- extend: compare-and-set lease renewal. $1 scope, $2 key, $3 token,
-- $4 lease in microseconds, $5 in-progress grace in microseconds.
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
UPDATE {{table}} AS r SET
    lease_until = c.now + $4::int8 * interval '1 microsecond',
    expires_at = c.now + ($4::int8 + $5::int8) * interval '1 microsecond'
FROM clock c
WHERE r.scope = $1 AND r.key = $2 AND r.token = $3
  AND r.status = 1 AND r.expires_at > c.now
RETURNING r.attempt, (extract(epoch FROM r.lease_until) * 1000000)::int8 AS lease_until_us,
          r.fence
