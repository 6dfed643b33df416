-- Schema version 1 of an outbox table: the table, its queue-table autovacuum settings and
-- the partial indexes the relay's claim, the dead-letter listing and the purge walk.
-- Placeholders: {table}, {index_pending}, {index_failed}, {index_published} (identifiers),
-- {pending}, {published}, {failed} (row states); {{}} is a literal pair of braces.

CREATE TABLE IF NOT EXISTS {table} (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id       uuid NOT NULL,
    topic          text NOT NULL,
    key            text,
    event_type     text NOT NULL,
    aggregate_type text,
    aggregate_id   text,
    payload        bytea NOT NULL,
    headers        jsonb NOT NULL DEFAULT '{{}}',
    status         smallint NOT NULL DEFAULT {pending},
    attempts       integer NOT NULL DEFAULT 0,
    available_at   timestamptz NOT NULL DEFAULT now(),
    claim_token    uuid,
    claimed_by     text,
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz
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
-- the claim walks this index in (available_at, id) order and stops after one batch
CREATE INDEX IF NOT EXISTS {index_pending} ON {table} (available_at, id) WHERE status = {pending};
CREATE INDEX IF NOT EXISTS {index_failed} ON {table} (id) WHERE status = {failed};
CREATE INDEX IF NOT EXISTS {index_published} ON {table} (published_at) WHERE status = {published};
