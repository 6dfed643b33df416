-- Schema version 1 of ordered mode on a MariaDB/MySQL outbox (`outboxkit migrate --ordered`).
-- Every key hashes into one of {partitions} partitions (a stored generated column: NULL for a
-- keyless event); live relays divide them through {relays_table} heartbeats and
-- {partitions_table} leases. {key_locks_table} holds 65 536 lock rows: an ordered write locks
-- its keys' rows (FOR UPDATE, held to COMMIT) before its rows take their ids, so one key's
-- ids follow its commit order (GET_LOCK is session-scoped: a row lock is the transaction's).
-- Placeholders: {table}, the three tables and two indexes (quoted), {partitions}, {hex_digit}.

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS `partition` SMALLINT
    AS (CRC32(`key`) % {partitions}) STORED;
-- the ordered claim: a relay's partitions' pending rows in id order
CREATE INDEX IF NOT EXISTS {index_ordered} ON {table} (status, `partition`, id);
-- a key's earlier rows (the heads that block it)
CREATE INDEX IF NOT EXISTS {index_key_head} ON {table} (`key`(255), id);
CREATE TABLE IF NOT EXISTS {partitions_table} (
    `partition` SMALLINT NOT NULL PRIMARY KEY,
    owner       VARCHAR(255),
    epoch       BIGINT NOT NULL DEFAULT 0,
    expires_at  DATETIME(6)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {relays_table} (
    relay_id   VARCHAR(255) NOT NULL PRIMARY KEY,
    expires_at DATETIME(6) NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
CREATE TABLE IF NOT EXISTS {key_locks_table} (
    slot INT NOT NULL PRIMARY KEY
) ENGINE = InnoDB;
INSERT IGNORE INTO {key_locks_table} (slot)
SELECT a.n * 4096 + b.n * 256 + c.n * 16 + d.n
FROM {hex_digit} AS a, {hex_digit} AS b, {hex_digit} AS c, {hex_digit} AS d;
INSERT IGNORE INTO {partitions_table} (`partition`)
SELECT slot FROM {key_locks_table} WHERE slot < {partitions};
