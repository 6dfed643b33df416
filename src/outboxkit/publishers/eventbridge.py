"""Amazon EventBridge publisher: ``PutEvents`` of up to ten entries and 256 KiB.

EventBridge accepts an entry once it is durably stored; each entry of the answer holds
an ``EventId`` or its own ``ErrorCode``, so only the refused entries are retried, each
with its code: throttling is handed back (attempt refunded), a malformed or invalid
entry is dead-lettered, anything else retried. The mapping is ``wire.eventbridge``'s:
``Source`` = CloudEvents source, ``DetailType`` = event type, ``Detail`` = the event in
CloudEvents JSON, with its id (EventBridge has no deduplication: consumers dedup on
``detail.id``). EventBridge keeps no order; entries go out concurrently.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

from outboxkit.publishers import _aws as aws
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.wire import eventbridge as wire

BATCH_ENTRIES = 10
#: EventBridge's limit for one entry and for a whole PutEvents request.
MAX_ENTRY_BYTES = 262_144
_BUS = re.compile(r"^[/.A-Za-z0-9_-]{1,256}$")
_BUS_ARN = re.compile(r"^arn:[a-z-]+:events:[a-z0-9-]+:\d{12}:event-bus/[/.A-Za-z0-9_-]{1,256}$")


class EventBridgePublisher(aws.AwsPublisher):
    """Puts events on one EventBridge bus, or one bus per topic (``eventbridge://{topic}``)."""

    name = "eventbridge"
    service = "events"
    kind = "bus"
    example = "eventbridge://orders?region=eu-west-1"
    max_bytes = MAX_ENTRY_BYTES
    limit_name = "EventBridge's entry size limit"
    counted = "as an entry (source, detail type, detail, time)"
    #: Entry errors EventBridge will give again for the same entry.
    never_valid = frozenset(
        {
            "MalformedDetail",
            "InvalidArgument",
            "ValidationException",
            "InvalidEventPatternException",
        }
    )

    @classmethod
    def from_url(cls, url: str) -> EventBridgePublisher:
        """``eventbridge://BUS[?region=us-east-1&endpoint_url=http://127.0.0.1:4566]``.

        ``BUS`` is a bus name (``default`` for the account's default bus), a bus ARN, or
        contains ``{topic}``. Also ``timeout=``, ``concurrency=N`` and
        ``max_message_bytes=N`` (at most 256 KiB). Credentials come from the usual boto3
        chain (environment, profile, role).
        """
        publisher: EventBridgePublisher = cls._from_url(url)
        return publisher

    @staticmethod
    def _valid(name: str) -> bool:
        if name.startswith("arn:"):
            return _BUS_ARN.match(name) is not None
        return _BUS.match(name) is not None

    @staticmethod
    def _rule() -> str:
        return "a name of 1-256 letters, digits, / . _ - (default: the account's default bus)"

    async def start(self) -> None:
        """Check the bus exists; if EventBridge is unreachable the first batch retries."""
        await self._check_at_start("describe_event_bus", Name=self._destination)

    async def _publish_to(
        self,
        bus: str,
        indexes: list[int],
        messages: Sequence[OutboundMessage],
        results: aws.Results,
    ) -> None:
        entries: dict[int, dict[str, Any]] = {}
        sizes: dict[int, int] = {}
        for i in indexes:
            entry, size = wire.encode(messages[i])
            if size > self._limit:
                results[i] = self._too_large(size)
            else:
                entry["EventBusName"] = bus
                entries[i], sizes[i] = entry, size
        requests = aws.chunks(list(entries), sizes, BATCH_ENTRIES, MAX_ENTRY_BYTES)
        await asyncio.gather(*(self._send(bus, c, entries, results) for c in requests))

    async def _send(
        self,
        bus: str,
        chunk: list[int],
        entries: dict[int, dict[str, Any]],
        results: aws.Results,
    ) -> None:
        batch = [entries[i] for i in chunk]
        reply = await self._request(bus, chunk, results, "put_events", Entries=batch)
        if reply is None:
            return
        throttled = False
        for i, answer in zip(chunk, reply.get("Entries", []), strict=False):
            code = answer.get("ErrorCode")
            if not code:
                if answer.get("EventId"):
                    results[i] = PublishResult.success()
                continue
            text = f"eventbridge: {code}: {answer.get('ErrorMessage', '')}".strip()
            throttled = throttled or code in aws.THROTTLED
            results[i] = self._verdict(str(code), text, sender_fault=False)
        if not throttled:
            self._throttle.passed()
