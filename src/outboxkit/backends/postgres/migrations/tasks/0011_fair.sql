-- Task table version 11: the fair task names (`@tasks.handler(name, fair=True)`), kept by
-- the workers that have their handlers (each writes its fair names and their share at its
-- first claim, and deletes the names it handles without fair=). An enqueue of a keyed task
-- reads its name's row (a primary-key probe): a fair key's task is pending at once while
-- fewer than `share` of its key are pending and none waits, instead of waiting for a
-- promotion whenever a task of its key is live.

CREATE TABLE IF NOT EXISTS {fair} (
    task_name text PRIMARY KEY,
    share     integer NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
);
