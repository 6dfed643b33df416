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
import logging
import re
from collections.abc import Sequence
from typing import Any

import botocore.exceptions

from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers import _aws as aws
from outboxkit.publishers._util import too_large
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard
from outboxkit.wire import eventbridge as wire

log = logging.getLogger("outboxkit.eventbridge")

BATCH_ENTRIES = 10
#: EventBridge's limit for one entry and for a whole PutEvents request.
MAX_ENTRY_BYTES = 262_144
_BUS = re.compile(r"^[/.A-Za-z0-9_-]{1,256}$")
_BUS_ARN = re.compile(r"^arn:[a-z-]+:events:[a-z0-9-]+:\d{12}:event-bus/[/.A-Za-z0-9_-]{1,256}$")
_NO_BUS = {"ResourceNotFoundException"}
#: Entry errors EventBridge will give again for the same entry.
_PERMANENT = {
    "MalformedDetail",
    "InvalidArgument",
    "ValidationException",
    "InvalidEventPatternException",
}


class EventBridgePublisher:
    """Puts events on one EventBridge bus, or one bus per topic (``eventbridge://{topic}``)."""

    name = "eventbridge"

    def __init__(
        self,
        bus: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        timeout: float = aws.DEFAULT_TIMEOUT,
        concurrency: int = aws.DEFAULT_CONCURRENCY,
        max_message_bytes: int | None = None,
    ) -> None:
        if not _valid_bus(bus.replace(aws.PLACEHOLDER, "x")):
            raise ConfigurationError(
                f"invalid EventBridge bus {bus!r}: a name of 1-256 letters, digits, / . _ -"
                " (default for the account's default bus), a bus ARN, or {topic}"
            )
        aws.check_options("eventbridge", timeout, concurrency, max_message_bytes)
        self._bus = bus
        self._region = region
        self._endpoint_url = endpoint_url
        self._timeout = timeout
        self._concurrency = concurrency
        self._limit = min(max_message_bytes or MAX_ENTRY_BYTES, MAX_ENTRY_BYTES)
        self._lowered = max_message_bytes is not None
        self._slots = asyncio.Semaphore(concurrency)
        self._client: Any = None
        self._throttle = aws.Throttle()
        #: For /readyz: unreachable once requests have failed to connect for a few seconds.
        self.reachability = Reachability()
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> EventBridgePublisher:
        """``eventbridge://BUS[?region=us-east-1&endpoint_url=http://127.0.0.1:4566]``.

        ``BUS`` is a bus name (``default`` for the account's default bus), a bus ARN, or
        contains ``{topic}``. Also ``timeout=``, ``concurrency=N`` and
        ``max_message_bytes=N`` (at most 256 KiB). Credentials come from the usual boto3
        chain (environment, profile, role).
        """
        bus, options = aws.parse_url(url, "eventbridge", "eventbridge://orders?region=eu-west-1")
        return cls(bus, **options)

    def __repr__(self) -> str:
        return f"EventBridgePublisher(bus={self._bus!r}, region={self._region!r})"

    async def start(self) -> None:
        """Check the bus exists; if EventBridge is unreachable the first batch retries."""
        try:
            client = self._ensure_client()
            if aws.PLACEHOLDER not in self._bus:
                await aws.call(client, "describe_event_bus", Name=self._bus)
        except botocore.exceptions.ClientError as exc:
            log.error(
                "EventBridge bus %r not usable at start: %s", self._bus, aws.client_error(exc)
            )
        except ConfigurationError:
            raise
        except Exception as exc:
            log.warning("EventBridge not reachable at start (%s); will retry", describe(exc))

    def _ensure_client(self) -> Any:
        if self._client is None:
            self._client = aws.make_client(
                "events", self._region, self._endpoint_url, self._timeout, self._concurrency
            )
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        self._ensure_client()
        results: list[PublishResult | None] = [None] * len(messages)
        entries: dict[int, dict[str, Any]] = {}
        sizes: dict[int, int] = {}
        for i, message in enumerate(messages):
            if (refused := self.guard.refuse(message)) is not None:
                results[i] = refused
                continue
            bus = self._bus.replace(aws.PLACEHOLDER, message.topic)
            if not _valid_bus(bus):
                results[i] = PublishResult.permanent(
                    f"eventbridge: {bus[:300]!r} is not a valid bus name (from topic"
                    f" {message.topic[:80]!r})",
                    "invalid_bus",
                )
                continue
            entry, size = wire.encode(message)
            if size > self._limit:
                results[i] = self._too_large(size)
                continue
            entry["EventBusName"] = bus
            entries[i], sizes[i] = entry, size
        by_bus: dict[str, list[int]] = {}
        for i, entry in entries.items():  # a missing bus fails only its own requests
            by_bus.setdefault(entry["EventBusName"], []).append(i)
        requests = [
            c
            for indexes in by_bus.values()
            for c in aws.chunks(indexes, sizes, BATCH_ENTRIES, MAX_ENTRY_BYTES)
        ]
        await asyncio.gather(*(self._send(c, entries, results) for c in requests))
        return [
            r if r is not None else PublishResult.retry("eventbridge: no outcome") for r in results
        ]

    def _too_large(self, size: int) -> PublishResult:
        if self._lowered:
            named = f"max_message_bytes={self._limit} in the relay's broker URL"
            fix = "raise it (up to 262 144), or send less"
        else:
            named = "EventBridge's entry size limit"
            fix = "send less, or a reference to the payload (e.g. an S3 key)"
        return too_large(
            "eventbridge",
            size,
            "as an entry (source, detail type, detail, time)",
            named,
            self._limit,
            fix,
        )

    async def _send(
        self,
        chunk: list[int],
        entries: dict[int, dict[str, Any]],
        results: list[PublishResult | None],
    ) -> None:
        async with self._slots:
            try:
                reply = await aws.call(
                    self._client, "put_events", Entries=[entries[i] for i in chunk]
                )
            except botocore.exceptions.ClientError as exc:
                self.reachability.succeeded()  # EventBridge answered, with an error
                for i in chunk:
                    results[i] = self._request_error(entries[i]["EventBusName"], exc)
                return
            except Exception as exc:
                result = aws.request_failed(
                    self.reachability, exc, f"eventbridge: request failed: {describe(exc)}"
                )
                for i in chunk:
                    results[i] = result
                return
        self.reachability.succeeded()
        throttled = False
        for i, answer in zip(chunk, reply.get("Entries", []), strict=False):
            code = answer.get("ErrorCode")
            if not code:
                if answer.get("EventId"):
                    results[i] = PublishResult.success()
                continue
            text = f"eventbridge: {code}: {answer.get('ErrorMessage', '')}".strip()
            if code in aws.THROTTLED:
                throttled = True
                results[i] = self._throttle.throttled("eventbridge", text)
            elif code in _PERMANENT:
                results[i] = PublishResult.permanent(text, str(code))
            else:
                results[i] = PublishResult.retry(text, str(code))
        if not throttled:
            self._throttle.passed()

    def _request_error(self, bus: str, exc: botocore.exceptions.ClientError) -> PublishResult:
        code = aws.error_code(exc)
        text = aws.client_error(exc)
        if code in _NO_BUS:
            return PublishResult.permanent(
                f"eventbridge: bus {bus!r} does not exist ({text}); create it, then"
                " `outboxkit replay --all-failed`",
                "no_bus",
            )
        if code in aws.THROTTLED:
            return self._throttle.throttled("eventbridge", text)
        return PublishResult.retry(f"eventbridge: {text}", code or "client_error")


def _valid_bus(bus: str) -> bool:
    if bus.startswith("arn:"):
        return _BUS_ARN.match(bus) is not None
    return _BUS.match(bus) is not None
