-- purge: one bounded batch of expired rows. $1 batch size. Rows locked by
-- someone else are skipped, so a purge never waits on live traffic.
DELETE FROM {{table}}
WHERE (scope, key) IN (
    SELECT scope, key FROM {{table}}
    WHERE expires_at <= clock_timestamp()
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
