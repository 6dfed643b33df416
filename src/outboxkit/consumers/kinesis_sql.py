"""The Kinesis runner's checkpoints in PostgreSQL: one row per consumer, stream and shard.

A checkpoint is the sequence number of the last record whose inbox transaction
committed, written after that commit: a runner that dies in between reads the record
again and the inbox skips it. ``finished`` marks a shard closed by resharding and read
to its end, so its children (which continue its keys) may start.
"""

from __future__ import annotations

from outboxkit.backends.postgres.postgres import (
    NamedStatements,
    SqlTemplate,
    parse_table,
    quote_table,
)

DEFAULT_CHECKPOINT_TABLE = "outboxkit_kinesis_checkpoints"

CREATE_CHECKPOINTS = """
CREATE TABLE IF NOT EXISTS {table} (
    consumer_name   text NOT NULL,
    stream          text NOT NULL,
    shard_id        text NOT NULL,
    sequence_number text,
    finished        boolean NOT NULL DEFAULT false,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, stream, shard_id)
)
"""
LOAD_CHECKPOINTS = """
SELECT shard_id, sequence_number, finished FROM {table}
WHERE consumer_name = %s AND stream = %s
"""
SAVE_CHECKPOINT = """
INSERT INTO {table} (consumer_name, stream, shard_id, sequence_number, finished)
VALUES (%s, %s, %s, %s, %s)
ON CONFLICT (consumer_name, stream, shard_id) DO UPDATE
SET sequence_number = coalesce(excluded.sequence_number, {table}.sequence_number),
    finished = excluded.finished,
    updated_at = now()
"""


class CheckpointStatements(NamedStatements):
    """The statements of one checkpoint table, rendered once with its quoted name."""

    create = SqlTemplate(CREATE_CHECKPOINTS)
    load = SqlTemplate(LOAD_CHECKPOINTS)
    save = SqlTemplate(SAVE_CHECKPOINT)

    def __init__(self, table: str = DEFAULT_CHECKPOINT_TABLE) -> None:
        schema, name = parse_table(table)
        self.table = table
        self._render({"table": quote_table(schema, name)})
