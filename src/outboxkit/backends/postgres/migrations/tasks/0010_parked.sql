-- Task table version 10: the tasks waiting behind a full concurrency limit
-- (`@tasks.handler(name, concurrency=N)`) wait out of the claim index. A worker with the
-- name's handler keeps N of a name's unkeyed tasks pending in each queue (the best ones:
-- due first, then by priority and due time) and parks the rest in status {waiting}, with
-- no key and no upstream tasks (after_failure NULL): on this index, in the order they are
-- promoted back. 100 000 tasks behind a full limit then cost the queue's claims nothing.

CREATE INDEX IF NOT EXISTS {index_parked} ON {table} (task_name, queue, priority DESC,
                                                     available_at, id)
    WHERE status = {waiting} AND key IS NULL AND after_failure IS NULL;
