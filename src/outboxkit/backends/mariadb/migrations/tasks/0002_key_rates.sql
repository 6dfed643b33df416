-- Schema version 2 of a task table on MariaDB/MySQL: rate limits per enqueue key
-- (`@tasks.handler(name, rate_per_key="5/s")`), PostgreSQL's version 9. One token bucket per
-- (task name, key), kept by the claims of that name under its row of {limits}: `tokens` as
-- of `at`, refilled by the database's clock at `rate` a second up to `burst` (the name's,
-- written by each claim). A key with no row has a full bucket, so a row that has refilled is
-- the same as none: the workers' maintenance deletes those by the row's own numbers.
-- A key is up to 1024 characters, longer than an index key may be: the primary key holds its
-- SHA-256 digest (`key_digest`, written by the claim), the key itself is kept beside it.
-- Placeholders: {key_rates}.

CREATE TABLE IF NOT EXISTS {key_rates} (
    task_name  VARCHAR(200) NOT NULL,
    key_digest BINARY(32) NOT NULL,
    `key`      VARCHAR(1024) NOT NULL,
    tokens     DOUBLE NOT NULL,
    at         DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    rate       DOUBLE NOT NULL,
    burst      DOUBLE NOT NULL,
    PRIMARY KEY (task_name, key_digest)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
