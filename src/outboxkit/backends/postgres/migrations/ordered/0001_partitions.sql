-- Ordered mode (`outboxkit migrate --ordered`), on top of an outbox at any version: the
-- partition of a key (NULL for a keyless row: hashtext is strict, else 0..P-1). hashtext()
-- is PostgreSQL's own, immutable: the same key lands in the same partition whatever writes
-- it. The column is STORED: adding it rewrites the table once. Then the ordered claim's
-- indexes and the partition lease tables, with exactly {partitions} rows.
-- Placeholders: {table}, {partitions_table}, {relays_table}, {index_key_head},
-- {index_ordered}, {index_keyless} (identifiers), {pending}, {failed} (row states),
-- {partitions} (the partition count P).

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS partition smallint
    GENERATED ALWAYS AS (mod(hashtext(key)::bigint + 2147483648, {partitions})::smallint) STORED;
-- the head-of-key probe: the earliest rows of one key that are not published
CREATE INDEX IF NOT EXISTS {index_key_head} ON {table} (key, id)
    WHERE status IN ({pending}, {failed}) AND key IS NOT NULL;
-- the keyed claim walks pending keyed rows in id (commit) order
CREATE INDEX IF NOT EXISTS {index_ordered} ON {table} (id)
    WHERE status = {pending} AND partition IS NOT NULL;
-- keyless rows keep the unordered claim, without walking past keyed ones
CREATE INDEX IF NOT EXISTS {index_keyless} ON {table} (available_at, id)
    WHERE status = {pending} AND key IS NULL;
CREATE TABLE IF NOT EXISTS {partitions_table} (
    partition  smallint PRIMARY KEY,
    owner      text,
    epoch      bigint NOT NULL DEFAULT 0,
    expires_at timestamptz
);
CREATE TABLE IF NOT EXISTS {relays_table} (
    relay_id   text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
INSERT INTO {partitions_table} (partition)
SELECT p FROM generate_series(0, {partitions} - 1) AS p ON CONFLICT DO NOTHING;
DELETE FROM {partitions_table} WHERE partition >= {partitions};
