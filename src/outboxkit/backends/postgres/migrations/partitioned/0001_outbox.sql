-- Schema version 1 of a range-partitioned outbox (`outboxkit migrate --partition-by`): the
-- columns and indexes of outbox/0001_outbox.sql with the two changes PostgreSQL requires
-- of a partitioned table: the primary key includes the partition key, (id, created_at),
-- and the autovacuum settings go on each partition (backends/postgres/partitions_sql.py,
-- PARTITION_STORAGE), not on the parent, which has no storage. id stays an identity:
-- PostgreSQL 10-16 fill it for every row inserted through the parent, the only way
-- outboxkit writes. The indexes are created on the parent: PostgreSQL builds them on every
-- partition, present and future. Later versions are the plain outbox's (outbox/0002...).
-- tests/integration/test_migration_files.py holds the two tables' columns and indexes equal.

CREATE TABLE IF NOT EXISTS {table} (
    id             bigint GENERATED ALWAYS AS IDENTITY,
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
    published_at   timestamptz,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);
-- the claim walks this index in (available_at, id) order and stops after one batch
CREATE INDEX IF NOT EXISTS {index_pending} ON {table} (available_at, id) WHERE status = {pending};
CREATE INDEX IF NOT EXISTS {index_failed} ON {table} (id) WHERE status = {failed};
CREATE INDEX IF NOT EXISTS {index_published} ON {table} (published_at) WHERE status = {published};
