"""Dead letters of the stream: events written to the outbox table as failed rows.

A stream cannot leave an event behind and come back to it, so an event that used up its
attempts (or that the broker will never accept) is stored where ``outboxkit failed``,
``replay`` and the dashboard already look: the outbox table, status failed. The stream
delivers that insert too, and the relay skips it (only pending rows are events).
"""

from __future__ import annotations

import orjson
from psycopg.types.json import Jsonb

from outboxkit.backends.postgres.cdc_sql import CdcRelayStatements
from outboxkit.cdc._db import OwnConnection
from outboxkit.publishers.base import OutboundMessage


class DeadLetters:
    """Writes dead letters over a connection of its own (autocommit: one statement each)."""

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn = dsn
        self._sql = CdcRelayStatements(table)
        self._db = OwnConnection(dsn, "dead-letters")

    async def write(self, message: OutboundMessage, *, row_id: int | None, error: str) -> None:
        """Mark the table row ``row_id`` failed, or insert the event as a failed row."""
        conn = await self._db.get()
        await conn.execute(
            self._sql.cdc_dead_letter,
            {
                "id": row_id,
                "attempts": message.attempt,
                "error": error,
                "event_id": message.event_id,
                "topic": message.topic,
                "key": message.key,
                "event_type": message.event_type,
                "aggregate_type": message.aggregate_type,
                "aggregate_id": message.aggregate_id,
                "payload": message.payload,
                "headers": Jsonb(message.headers),
                "occurred_at": message.occurred_at,
                "schema_version": message.schema_version,
            },
        )

    async def write_raw(
        self,
        prefix: str,
        values: dict[str, bytes | None] | None,
        content: bytes | None,
        error: str,
    ) -> None:
        """An undecodable row or envelope, kept as it came for inspection."""
        import uuid

        def text(column: str) -> str | None:
            raw = (values or {}).get(column)
            return raw.decode(errors="replace") if raw is not None else None

        try:
            event_id = uuid.UUID(text("event_id") or "")
        except ValueError:
            event_id = uuid.uuid4()
        raw = (
            content
            if content is not None
            else orjson.dumps(
                {
                    k: (v.decode(errors="replace") if v is not None else None)
                    for k, v in (values or {}).items()
                }
            )
        )
        row = text("id")
        conn = await self._db.get()
        await conn.execute(
            self._sql.cdc_dead_letter,
            {
                "id": int(row) if row is not None and row.isdigit() else None,
                "attempts": 0,
                "error": error,
                "event_id": event_id,
                "topic": text("topic") or prefix,
                "key": text("key"),
                "event_type": text("event_type") or "outboxkit.undecodable",
                "aggregate_type": None,
                "aggregate_id": None,
                "payload": raw,
                "headers": Jsonb({}),
                "occurred_at": None,
                "schema_version": None,
            },
        )

    async def close(self) -> None:
        await self._db.close()
