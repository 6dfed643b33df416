-- Task table version 9: rate limits per enqueue key (`@tasks.handler(name,
-- rate_per_key="5/s")`). One token bucket per (task name, key), kept by the claims of that
-- name under its advisory lock: `tokens` as of `at`, refilled by the database's clock at the
-- name's per-key rate up to its burst. A key with no row has a full bucket; a row that has
-- refilled since is the same as none, and the worker's maintenance deletes such rows.

CREATE TABLE IF NOT EXISTS {key_rates} (
    task_name text NOT NULL,
    key       text NOT NULL,
    tokens    float8 NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_name, key)
);
