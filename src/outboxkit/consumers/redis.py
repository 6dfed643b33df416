"""Redis Streams runner: a consumer group, ``XACK`` only after the database commit.

A failed entry stays in the group's pending entries list. Once it has been idle
for ``retry_delay`` seconds any consumer of the group claims it again
(``XPENDING … IDLE`` then ``XCLAIM``: unlike ``XAUTOCLAIM`` this also tells us
how often it was delivered), which is also how entries of a consumer that died
are picked up. After ``max_deliveries`` deliveries an entry is copied to the
dead-letter stream and acknowledged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any

from outboxkit.errors import missing_extra

try:
    import redis.asyncio
    import redis.exceptions
except ModuleNotFoundError as exc:  # one line naming the extra, not a traceback
    raise missing_extra(exc, "outboxkit.consumers.redis") from exc

from outboxkit._text import describe
from outboxkit.consumers.base import (
    ConsumerRunner,
    Handler,
    ReceivedEvent,
    unwrap,
)
from outboxkit.errors import ConfigurationError, EnvelopeError
from outboxkit.inbox import Inbox
from outboxkit.wire import redis as wire

log = logging.getLogger("outboxkit.consumer.redis")

DEFAULT_DEAD_LETTER_STREAM = "{stream}:dead"


def decode(stream: str, fields: dict[Any, Any], delivery_count: int = 1) -> ReceivedEvent:
    """The event in a stream entry of the Redis publisher (``data``, ``ce_*``, ``headers``)."""
    return unwrap(stream, lambda: wire.decode(fields), delivery_count)


class RedisStreamsConsumer(ConsumerRunner):
    """Consumes ``streams`` as member ``name`` of the consumer group ``group``.

    The group is created if missing, reading from the start of the stream
    (``start_id="$"`` for new entries only).
    """

    broker = "redis"

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        consumer: str,
        url: str,
        streams: str | list[str],
        group: str | None = None,
        name: str | None = None,
        dead_letter_stream: str | None = DEFAULT_DEAD_LETTER_STREAM,
        start_id: str = "0",
        inbox: Inbox | None = None,
        max_deliveries: int = 5,
        retry_delay: float = 30.0,
        batch: int = 10,
        block: float = 1.0,
    ) -> None:
        super().__init__(
            dsn,
            handler,
            consumer=consumer,
            inbox=inbox,
            max_deliveries=max_deliveries,
            retry_delay=retry_delay,
        )
        self.streams = [streams] if isinstance(streams, str) else list(streams)
        if not self.streams:
            raise ConfigurationError("redis consumer needs at least one stream")
        self.url = url
        self.group = group or consumer
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.dead_letter_stream = dead_letter_stream
        self.start_id = start_id
        self.batch = batch
        self.block_ms = max(1, round(block * 1000))
        self._client: Any = None

    async def run(self) -> None:
        """Read, apply and acknowledge until :meth:`stop` is called."""
        self._client = redis.asyncio.Redis.from_url(self.url, socket_connect_timeout=5)
        try:
            for stream in self.streams:
                try:
                    await self._client.xgroup_create(
                        stream, self.group, self.start_id, mkstream=True
                    )
                except redis.exceptions.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
            while not self.stopping:
                try:
                    await self._reclaim()
                    await self._read_new()
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    log.warning("redis consumer %r: %s; retrying", self.consumer, describe(exc))
                    await self._sleep_or_stop(1.0)
        finally:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            await self._close_db()

    async def _read_new(self) -> None:
        replies = await self._client.xreadgroup(
            self.group,
            self.name,
            dict.fromkeys(self.streams, ">"),
            count=self.batch,
            block=self.block_ms,
        )
        for raw_stream, entries in replies or []:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            for entry_id, fields in entries:
                await self._handle(stream, entry_id, fields, 1)

    async def _reclaim(self) -> None:
        """Take over entries idle for ``retry_delay``: failed here, or held by a dead consumer."""
        idle_ms = max(1, round(self.retry_delay * 1000))
        for stream in self.streams:
            pending = await self._client.xpending_range(
                stream, self.group, "-", "+", self.batch, idle=idle_ms
            )
            if not pending:
                continue
            counts = {p["message_id"]: int(p["times_delivered"]) for p in pending}
            claimed = await self._client.xclaim(
                stream, self.group, self.name, idle_ms, list(counts)
            )
            for entry_id, fields in claimed:
                if fields is None:  # deleted from the stream meanwhile
                    await self._client.xack(stream, self.group, entry_id)
                    continue
                delivered = counts.get(entry_id, 1)
                if delivered >= self.max_deliveries:
                    await self._dead_letter(
                        stream, entry_id, fields, f"failed {delivered} deliveries"
                    )
                else:
                    await self._handle(stream, entry_id, fields, delivered + 1)

    async def _handle(
        self, stream: str, entry_id: Any, fields: dict[Any, Any], delivered: int
    ) -> None:
        try:
            event = decode(stream, fields, delivered)
        except EnvelopeError as exc:
            await self._dead_letter(stream, entry_id, fields, str(exc))
            return
        if await self._apply(event):
            # If this XACK is lost the entry is reclaimed later and skipped as a duplicate.
            await self._client.xack(stream, self.group, entry_id)

    async def _dead_letter(
        self, stream: str, entry_id: Any, fields: dict[Any, Any], reason: str
    ) -> None:
        if self.dead_letter_stream is None:
            log.error(
                "redis consumer %r: entry %s of %s keeps failing (%s); it stays pending"
                " (set dead_letter_stream= to move it aside)",
                self.consumer,
                entry_id,
                stream,
                reason,
            )
            return
        target = self.dead_letter_stream.replace("{stream}", stream)
        copy = dict(fields)
        copy.update(
            {
                "outboxkit_dead_letter_reason": reason,
                "outboxkit_consumer": self.consumer,
                "outboxkit_source": f"{stream}/{_text(entry_id)}",
            }
        )
        # Copy first, then acknowledge: a crash in between leaves a second copy, never none.
        await self._client.xadd(target, copy)
        await self._client.xack(stream, self.group, entry_id)
        self.stats.dead_lettered += 1
        log.warning(
            "redis consumer %r: entry %s of %s dead-lettered to %s (%s)",
            self.consumer,
            _text(entry_id),
            stream,
            target,
            reason,
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
