-- Task table version 8: rate limits (`@tasks.handler(name, rate="50/s")`). One token bucket
-- per rate-limited task name, kept by the claims of that name under its advisory lock:
-- `tokens` as of `at`, refilled by the database's clock at the name's rate up to its burst.

CREATE TABLE IF NOT EXISTS {limits} (
    task_name text PRIMARY KEY,
    tokens    float8 NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
);
