-- Task table version 6: the enqueue's trace (W3C traceparent of the span active when the
-- task was enqueued, NULL without one): the worker's span for the handler's run links to
-- it, as the relay's batch span links to each event's write-time trace.

ALTER TABLE {table} ADD COLUMN IF NOT EXISTS trace text;
