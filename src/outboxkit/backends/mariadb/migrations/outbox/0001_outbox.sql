-- Schema version 1 of an outbox table on MariaDB/MySQL: PostgreSQL's columns (its versions 1
-- and 2) in MariaDB types. Times are UTC DATETIME(6), written and compared with
-- UTC_TIMESTAMP(6) whatever the session's time zone. No partial indexes here: the claim's
-- index leads with status, so it reads pending rows only, in (available_at, id) order.
-- Placeholders: {table}, {index_pending}, {index_published} (quoted identifiers), {pending}.

CREATE TABLE IF NOT EXISTS {table} (
    id             BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id       CHAR(36) CHARACTER SET ascii NOT NULL,
    topic          TEXT NOT NULL,
    `key`          TEXT,
    event_type     TEXT NOT NULL,
    aggregate_type TEXT,
    aggregate_id   TEXT,
    payload        LONGBLOB NOT NULL,
    headers        LONGTEXT NOT NULL,
    status         SMALLINT NOT NULL DEFAULT {pending},
    attempts       INT NOT NULL DEFAULT 0,
    available_at   DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    claim_token    CHAR(36) CHARACTER SET ascii,
    claimed_by     TEXT,
    last_error     TEXT,
    created_at     DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    published_at   DATETIME(6),
    occurred_at    DATETIME(6) DEFAULT (UTC_TIMESTAMP(6)),
    schema_version TEXT,
    -- the claim walks this index (status = pending, then available_at, then the primary key)
    INDEX {index_pending} (status, available_at),
    INDEX {index_published} (status, published_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
