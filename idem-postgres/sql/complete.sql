-- complete: compare-and-set on the token. $1 scope, $2 key, $3 token,
-- $4 response, $5 retention in microseconds. No row updated = LeaseLost.
-- Completing again with the token that completed the row matches and
-- changes nothing (the first response and its expiry stay): a retry after a
-- lost reply must not look like a lost lease, even when the row's short
-- retention ended before the resend arrived (no other worker can hold this
-- token: a takeover or a new acquisition writes a new one).
UPDATE {{table}} SET
    response = CASE WHEN status = 1 THEN $4 ELSE response END,
    completed_at = CASE WHEN status = 1 THEN clock_timestamp() ELSE completed_at END,
    expires_at = CASE WHEN status = 1
                      THEN clock_timestamp() + $5::int8 * interval '1 microsecond'
                      ELSE expires_at END,
    lease_until = NULL,
    status = 2
WHERE scope = $1 AND key = $2 AND token = $3
  AND (status = 2 OR (status = 1 AND expires_at > clock_timestamp()))
