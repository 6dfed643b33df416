-- Task table version 9: rate limits per enqueue key (`@tasks.handler(name,
-- rate_per_key="5/s")`). One token bucket per (task name, key), kept by the claims of that
-- name under its advisory lock: `tokens` as of `at`, refilled by the database's clock at
-- `rate` a second up to `burst` (the name's, written by each claim). A key with no row has
-- a full bucket, so a row that has refilled is the same as none: the workers' maintenance
-- deletes those by the row's own numbers, and the table holds only keys started lately.

CREATE TABLE IF NOT EXISTS {key_rates} (
    task_name text NOT NULL,
    key       text NOT NULL,
    tokens    float8 NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    rate      float8 NOT NULL,
    burst     float8 NOT NULL,
    PRIMARY KEY (task_name, key)
);
