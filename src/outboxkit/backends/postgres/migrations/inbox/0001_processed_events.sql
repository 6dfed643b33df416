-- Schema version 1 of an inbox table (consumer-side dedup). The primary key is the dedup:
-- a second insert of the pair waits for the first transaction, then inserts nothing (or,
-- if the first rolled back, takes its place).
-- Placeholders: {table}, {index_processed_at} (identifiers).

CREATE TABLE IF NOT EXISTS {table} (
    consumer_name text NOT NULL,
    event_id      uuid NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
-- retention deletes the oldest records first, in small batches
CREATE INDEX IF NOT EXISTS {index_processed_at} ON {table} (processed_at);
