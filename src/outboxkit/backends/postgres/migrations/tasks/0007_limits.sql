-- Task table version 7: concurrency limits (`@tasks.handler(name, concurrency=N)`). The
-- running tasks of a limited name are its slots: the claim counts those whose lease has not
-- lapsed on this index (a handful of rows per name: at most its limit and the lapsed ones),
-- never the tasks waiting behind a full limit.

CREATE INDEX IF NOT EXISTS {index_running} ON {table} (task_name, available_at)
    WHERE status = {running};
