-- Schema version 1 of an inbox table (consumer-side dedup) on MariaDB/MySQL. The primary key
-- is the dedup: a second insert of the pair waits for the first transaction, then fails
-- as a duplicate (or, if the first rolled back, takes its place).
-- Placeholders: {table}, {index_processed_at} (quoted identifiers).

CREATE TABLE IF NOT EXISTS {table} (
    consumer_name VARCHAR(255) NOT NULL,
    event_id      CHAR(36) CHARACTER SET ascii NOT NULL,
    processed_at  DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer_name, event_id),
    -- retention deletes the oldest records first, in small batches
    INDEX {index_processed_at} (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
