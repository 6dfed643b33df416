-- Task table version 5: dependencies (`enqueue(after=[...])`, docs/tasks.md "Dependencies
-- and fan-in"), and keyed tasks waiting for their key's turn. A task with upstream tasks waits in status {waiting} (outside the claim
-- index, so 100 000 of them cost the claim nothing) until every upstream task is done; its
-- edges are rows of {deps}. `has_dependents` tells a worker that settles a task to release
-- its dependents right after; `after_failure` says what a failed or cancelled upstream task
-- does to the dependent (0: cancel it, 1: run it anyway; NULL: no upstream). The waiting
-- tasks' index names after_failure (every waiting task has it), so that dropping the
-- column drops the index too.
-- No foreign keys: a done upstream task is deleted (its dependents count it done).

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS has_dependents boolean NOT NULL DEFAULT false;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS after_failure smallint;
CREATE TABLE IF NOT EXISTS {deps} (
    task_id  bigint NOT NULL,
    after_id bigint NOT NULL,
    PRIMARY KEY (task_id, after_id)
);
CREATE INDEX IF NOT EXISTS {index_deps_after} ON {deps} (after_id);
CREATE INDEX IF NOT EXISTS {index_waiting} ON {table} (id)
    WHERE status = {waiting} AND after_failure IS NOT NULL;
-- A keyed task behind a live one of its key waits too (after_failure NULL), out of the
-- claim index: its key's head's settle makes the next one pending. This index finds a
-- key's next one, and the keys that have any (a skip scan). It names after_failure, so
-- that dropping the column drops it.
CREATE INDEX IF NOT EXISTS {index_key_waiting} ON {table} (key, id)
    WHERE status = {waiting} AND key IS NOT NULL AND after_failure IS NULL;
