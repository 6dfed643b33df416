-- Task table version 4: results and progress (docs/tasks.md "Results and progress").
-- `result`: a handler's return value (JSON), stored by its fenced completion when the
-- handler keeps results (`keep_result=`); `keep_until`: when such a finished task may be
-- purged (the worker's maintenance deletes it then, a batch at a time); `progress`: the
-- last value the running attempt reported (`ctx.progress()`), fenced by its claim token.
-- Nullable columns without defaults: no table rewrite, and writers not yet upgraded
-- insert rows as before.

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS result jsonb;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS progress jsonb;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS keep_until timestamptz;
CREATE INDEX IF NOT EXISTS {index_kept} ON {table} (keep_until) WHERE keep_until IS NOT NULL;
