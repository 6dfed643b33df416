-- Schema version 1 of a task table (task mode: the database as a job queue) and its schedule
-- table: the table with the outbox's queue-table autovacuum settings, the partial index the
-- worker's claim walks, the partial unique index that keeps one live task per unique_key,
-- the per-key index of the serial claim and the dead-letter listing's index.
-- Placeholders: {table}, {schedules}, {index_pending}, {index_unique}, {index_key},
-- {index_failed} (identifiers), {pending}, {running}, {failed} (task states).

CREATE TABLE IF NOT EXISTS {table} (
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_name         text NOT NULL,
    queue             text NOT NULL DEFAULT 'default',
    payload           jsonb NOT NULL DEFAULT 'null',
    priority          smallint NOT NULL DEFAULT 0,
    key               text,
    unique_key        text,
    status            smallint NOT NULL DEFAULT {pending},
    attempts          integer NOT NULL DEFAULT 0,
    max_attempts      integer,
    available_at      timestamptz NOT NULL DEFAULT now(),
    claim_token       uuid,
    claimed_by        text,
    last_error        text,
    error_type        text,
    traceback_excerpt text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    started_at        timestamptz,
    finished_at       timestamptz
) WITH (
    -- a queue table: vacuum after a fixed number of dead rows, not a fraction of the table
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);
-- the claim walks this index per queue, highest priority first, and stops after one batch:
-- a running task's available_at is its lease expiry, so an expired lease is claimable again
CREATE INDEX IF NOT EXISTS {index_pending} ON {table} (queue, priority DESC, available_at, id)
    WHERE status IN ({pending}, {running});
-- one live task per unique_key: a concurrent enqueue waits for the first one's transaction,
-- then inserts nothing (it committed) or its own row (it rolled back). Running counts as live:
-- a retried task goes back to pending and must not collide with a newer one.
CREATE UNIQUE INDEX IF NOT EXISTS {index_unique} ON {table} (unique_key)
    WHERE status IN ({pending}, {running}) AND unique_key IS NOT NULL;
-- the per-key serial claim: is there an earlier live task of this key?
CREATE INDEX IF NOT EXISTS {index_key} ON {table} (key, id)
    WHERE status IN ({pending}, {running}) AND key IS NOT NULL;
CREATE INDEX IF NOT EXISTS {index_failed} ON {table} (id) WHERE status = {failed};
-- periodic tasks: one row per (schedule, slot), inserted with the task it enqueues (the
-- primary key lets exactly one worker win a slot, however many run and however stale)
CREATE TABLE IF NOT EXISTS {schedules} (
    schedule   text NOT NULL,
    slot       timestamptz NOT NULL,
    task_id    bigint,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (schedule, slot)
);
