-- purge: one bounded batch of expired rows. $1 batch size. Rows locked by
-- someone else are skipped, so a purge never waits on live traffic. The
-- time is statement_timestamp(), which is stable within the statement, so
-- the expires_at index finds the batch; clock_timestamp() (volatile) would
-- make every batch scan the whole table.
DELETE FROM {{table}}
WHERE (scope, key) IN (
    SELECT scope, key FROM {{table}}
    WHERE expires_at <= statement_timestamp()
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
