-- Schema version 1 of a task table on MariaDB/MySQL (task mode: the database as a job queue):
-- PostgreSQL's columns (its versions 1 to 8) in MariaDB types, and its side tables (paused
-- queues, dependency edges, rate-limit buckets, periodic slots, key locks). Times are UTC
-- DATETIME(6), written and compared with UTC_TIMESTAMP(6).
-- MariaDB has no partial indexes. Each of PostgreSQL's partial indexes becomes an index on a
-- stored generated column that is NULL outside the index's predicate: a finished task's
-- entry sits in the NULL range, which no claim reads (its cost: one index entry per row, and
-- the column rewritten when the status changes).
-- Placeholders: {table}, {schedules}, {queues}, {deps}, {limits}, {key_locks}, the indexes
-- (quoted identifiers), {pending}, {running}, {failed}, {waiting}, {hex_digit}.

CREATE TABLE IF NOT EXISTS {table} (
    id                BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    task_name         VARCHAR(200) NOT NULL,
    queue             VARCHAR(200) NOT NULL DEFAULT 'default',
    payload           LONGTEXT NOT NULL,
    priority          SMALLINT NOT NULL DEFAULT 0,
    `key`             VARCHAR(1024),
    unique_key        VARCHAR(1024),
    status            SMALLINT NOT NULL DEFAULT {pending},
    attempts          INT NOT NULL DEFAULT 0,
    max_attempts      INT,
    available_at      DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    claim_token       CHAR(36) CHARACTER SET ascii,
    claimed_by        TEXT,
    last_error        TEXT,
    error_type        TEXT,
    traceback_excerpt TEXT,
    created_at        DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    started_at        DATETIME(6),
    finished_at       DATETIME(6),
    lapses            SMALLINT NOT NULL DEFAULT 0,
    spared            INT NOT NULL DEFAULT 0,
    result            LONGTEXT,
    progress          LONGTEXT,
    keep_until        DATETIME(6),
    has_dependents    BOOLEAN NOT NULL DEFAULT FALSE,
    after_failure     SMALLINT,
    trace             TEXT,
    -- PostgreSQL's claim index (queue, priority DESC, available_at, id) WHERE status IN
    -- (pending, running): the queue only while the task is live, else NULL
    live_queue        VARCHAR(200) AS (IF(status IN ({pending}, {running}), queue, NULL)) STORED,
    -- PostgreSQL's unique index on unique_key WHERE live: a digest (any length of key fits)
    live_unique       BINARY(32)
                      AS (IF(status IN ({pending}, {running}), UNHEX(SHA2(unique_key, 256)), NULL))
                      STORED,
    -- the claim walks this index per queue, highest priority first, and stops after a batch
    INDEX {index_pending} (live_queue, priority DESC, available_at, id),
    -- one live task per unique_key: a concurrent enqueue waits for the first one's
    -- transaction on the duplicate key, then inserts nothing (it committed) or its row
    UNIQUE INDEX {index_unique} (live_unique),
    -- the per-key serial claim and the promotion of a key's next waiting task
    INDEX {index_key} (`key`(255), status, id),
    -- limits count a name's running tasks; the sweeps find failed, waiting and kept ones
    INDEX {index_running} (task_name, status, available_at),
    INDEX {index_status} (status, id),
    INDEX {index_kept} (keep_until)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
-- paused queues: a row every claim reads by its primary key
CREATE TABLE IF NOT EXISTS {queues} (
    queue      VARCHAR(200) NOT NULL PRIMARY KEY,
    paused     BOOLEAN NOT NULL DEFAULT FALSE,
    changed_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    changed_by TEXT
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
-- dependency edges (enqueue(after=[...])): no foreign keys, a done upstream task is deleted
CREATE TABLE IF NOT EXISTS {deps} (
    task_id  BIGINT NOT NULL,
    after_id BIGINT NOT NULL,
    PRIMARY KEY (task_id, after_id),
    INDEX {index_deps_after} (after_id)
) ENGINE = InnoDB;
-- a limited name's row: its claims lock it (FOR UPDATE, to COMMIT) one at a time, and a
-- rate-limited name keeps its token bucket in it (refilled by the database's clock)
CREATE TABLE IF NOT EXISTS {limits} (
    task_name VARCHAR(200) NOT NULL PRIMARY KEY,
    tokens    DOUBLE NOT NULL,
    at        DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
-- periodic tasks: one row per (schedule, slot), inserted with the task it enqueues
CREATE TABLE IF NOT EXISTS {schedules} (
    schedule   VARCHAR(255) NOT NULL,
    slot       DATETIME(6) NOT NULL,
    task_id    BIGINT,
    created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (schedule, slot)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
-- PostgreSQL's per-key advisory lock at enqueue (GET_LOCK is the session's, not the
-- transaction's): a keyed enqueue locks one of 65 536 rows to its COMMIT, so one key's ids
-- follow its commit order and the serial claim runs them in that order
CREATE TABLE IF NOT EXISTS {key_locks} (
    slot INT NOT NULL PRIMARY KEY
) ENGINE = InnoDB;
INSERT IGNORE INTO {key_locks} (slot)
SELECT a.n * 4096 + b.n * 256 + c.n * 16 + d.n
FROM {hex_digit} AS a, {hex_digit} AS b, {hex_digit} AS c, {hex_digit} AS d;
