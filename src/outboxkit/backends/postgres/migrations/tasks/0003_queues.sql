-- Task table version 3: a paused queue is a row every claim reads (`outboxkit tasks pause`).
-- One row per queue ever paused or resumed; a queue with no row runs. The claim looks its
-- queue up by the primary key once per statement; enqueue never reads it (a paused
-- queue's tasks wait in the table).

CREATE TABLE IF NOT EXISTS {queues} (
    queue      text PRIMARY KEY,
    paused     boolean NOT NULL DEFAULT false,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text
);
