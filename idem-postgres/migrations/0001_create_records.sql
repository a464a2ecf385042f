-- idem records: one row per idempotency key.
-- {{table}} is the schema-qualified, quoted table name; {{index}} the
-- quoted name of its expiry index. PgStore::migrate() fills them in.
CREATE TABLE IF NOT EXISTS {{table}} (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    -- 1 = in progress, 2 = completed
    status       smallint    NOT NULL,
    -- SHA-256 of the payload (32 bytes), if the caller gave one
    fingerprint  bytea,
    -- fencing token of the latest acquisition (16 random bytes)
    token        bytea       NOT NULL,
    attempt      integer     NOT NULL,
    -- lease deadline while in progress
    lease_until  timestamptz,
    -- the recorded response once completed
    response     bytea,
    created_at   timestamptz NOT NULL,
    completed_at timestamptz,
    -- past this the row is as good as absent; purge_expired deletes it
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

CREATE INDEX IF NOT EXISTS {{index}} ON {{table}} (expires_at);
