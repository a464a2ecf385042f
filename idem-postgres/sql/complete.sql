-- complete: compare-and-set on the token. $1 scope, $2 key, $3 token,
-- $4 response, $5 retention in microseconds. No row updated = LeaseLost.
-- Completing again with the token that completed the row matches and
-- changes nothing (the first response and its expiry stay): a retry after a
-- lost reply must not look like a lost lease.
UPDATE {{table}} SET
    response = CASE WHEN status = 1 THEN $4 ELSE response END,
    completed_at = CASE WHEN status = 1 THEN clock_timestamp() ELSE completed_at END,
    expires_at = CASE WHEN status = 1
                      THEN clock_timestamp() + $5::int8 * interval '1 microsecond'
                      ELSE expires_at END,
    lease_until = NULL,
    status = 2
WHERE scope = $1 AND key = $2 AND token = $3
  AND status IN (1, 2) AND expires_at > clock_timestamp()
