-- complete: compare-and-set on the token. $1 scope, $2 key, $3 token,
-- $4 response, $5 retention in microseconds. No row updated = LeaseLost.
UPDATE {{table}} SET
    status = 2,
    response = $4,
    lease_until = NULL,
    completed_at = clock_timestamp(),
    expires_at = clock_timestamp() + $5::int8 * interval '1 microsecond'
WHERE scope = $1 AND key = $2 AND token = $3
  AND status = 1 AND expires_at > clock_timestamp()
