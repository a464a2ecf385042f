-- idem fences: every acquisition of a key gets a number strictly greater
-- than every earlier one, including those before a release, a delete or
-- the row's expiry, from a sequence. {{sequence}} is the schema-qualified,
-- quoted sequence name; PgStore::migrate() fills it in.
--
-- CACHE 1 (the default, written out): values are handed out in the order
-- nextval() is called, whatever the session. A session-local cache would
-- let a later acquisition in another session get a lower value.
CREATE SEQUENCE IF NOT EXISTS {{sequence}} AS bigint MINVALUE 1 START 1 CACHE 1 NO CYCLE;

-- Rows written before this migration have fence 0: their next acquisition
-- gets a value from the sequence, above it. A constant default adds the
-- column without rewriting the table.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS fence bigint NOT NULL DEFAULT 0;

-- Dropped with the table.
ALTER SEQUENCE {{sequence}} OWNED BY {{table}}.fence;
