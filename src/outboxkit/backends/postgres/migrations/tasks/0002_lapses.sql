-- Task table version 2: the deaths a task is not charged for. A worker's death takes every
-- task it ran with it, and only a task that ran alone is known to have caused its own.
-- `lapses`: deaths in a row of the task's worker while it ran beside others; from 2 on the
-- task is claimed only by a worker that runs it alone (queue/tasks.py), and reset when an
-- attempt ends with an outcome. `spared`: all such deaths, each a claim not counted
-- against max_attempts (attempt numbers stay one per claim). Constant defaults: no table
-- rewrite, and writers not yet upgraded insert rows that start at 0.

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS lapses smallint NOT NULL DEFAULT 0;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS spared integer NOT NULL DEFAULT 0;
