-- Schema version 2: when the fact happened (set by the application, distinct from
-- created_at) and the payload's schema version. Rows written before this version keep
-- occurred_at NULL (the claim falls back to created_at): no table rewrite, and the default
-- applies only to rows inserted from now on, including by writers not yet upgraded.
-- Also applies to a partitioned outbox (partitioned/0001_outbox.sql is its version 1).

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS occurred_at timestamptz;
ALTER TABLE {table} ALTER COLUMN occurred_at SET DEFAULT now();
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS schema_version text;
