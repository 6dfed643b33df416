"""Amazon Kinesis Data Streams publisher: ``PutRecords`` of up to 500 records / 5 MiB.

Kinesis answers once the records are stored across availability zones, so a record with
a sequence number is the confirmation. Records come back one by one: a record refused
with ``ProvisionedThroughputExceededException`` was throttled (its shard is over its
write limit) and is handed back with a growing delay, the attempt refunded; any other
refusal (``InternalFailure``) is retried.

Per-key order: records of one partition key go to one shard in the order Kinesis
accepts them, but one ``PutRecords`` may refuse a key's record and accept its next. So a
batch goes out in rounds (the n-th event of each key in round n), a key whose record was
refused sends nothing more in that batch, and a relay keeps one batch in flight.
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
from outboxkit.wire import kinesis as wire

log = logging.getLogger("outboxkit.kinesis")

BATCH_RECORDS = 500
#: Kinesis's limits: one record (data + partition key) and one PutRecords request.
MAX_RECORD_BYTES = 1_048_576
MAX_REQUEST_BYTES = 5 * 1_048_576
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_STREAM_ARN = re.compile(r"^arn:[a-z-]+:kinesis:[a-z0-9-]+:\d{12}:stream/[A-Za-z0-9_.-]{1,128}$")
_NO_STREAM = {"ResourceNotFoundException"}


class KinesisPublisher:
    """Sends events to one Kinesis data stream, or one per topic (``kinesis://{topic}``)."""

    name = "kinesis"
    #: One batch in flight: a second one could overtake the first's events of a key.
    batch_shape = (500, 1)

    def __init__(
        self,
        stream: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        timeout: float = aws.DEFAULT_TIMEOUT,
        concurrency: int = aws.DEFAULT_CONCURRENCY,
        max_message_bytes: int | None = None,
    ) -> None:
        if not _valid_stream(stream.replace(aws.PLACEHOLDER, "x")):
            raise ConfigurationError(
                f"invalid Kinesis stream {stream!r}: a name of 1-128 letters, digits, _ . -,"
                " a stream ARN, or {topic} for one stream per event topic"
            )
        aws.check_options("kinesis", timeout, concurrency, max_message_bytes)
        self._stream = stream
        self._region = region
        self._endpoint_url = endpoint_url
        self._timeout = timeout
        self._concurrency = concurrency
        self._limit = min(max_message_bytes or MAX_RECORD_BYTES, MAX_RECORD_BYTES)
        self._lowered = max_message_bytes is not None
        self._slots = asyncio.Semaphore(concurrency)
        self._client: Any = None
        self._throttle = aws.Throttle()
        #: For /readyz: unreachable once requests have failed to connect for a few seconds.
        self.reachability = Reachability()
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> KinesisPublisher:
        """``kinesis://STREAM[?region=us-east-1&endpoint_url=http://127.0.0.1:4566&timeout=10]``.

        ``STREAM`` is a stream name, a stream ARN, or contains ``{topic}``. Also
        ``concurrency=N`` and ``max_message_bytes=N`` (at most 1 MiB). Credentials come
        from the usual boto3 chain (environment, profile, role).
        """
        stream, options = aws.parse_url(url, "kinesis", "kinesis://orders?region=eu-west-1")
        return cls(stream, **options)

    def __repr__(self) -> str:
        return f"KinesisPublisher(stream={self._stream!r}, region={self._region!r})"

    async def start(self) -> None:
        """Check the stream exists; if Kinesis is unreachable the first batch retries."""
        try:
            client = self._ensure_client()
            if aws.PLACEHOLDER not in self._stream:
                await aws.call(client, "describe_stream_summary", **_stream_arg(self._stream))
        except botocore.exceptions.ClientError as exc:
            log.error(
                "Kinesis stream %r not usable at start: %s", self._stream, aws.client_error(exc)
            )
        except ConfigurationError:
            raise
        except Exception as exc:
            log.warning("Kinesis not reachable at start (%s); will retry", describe(exc))

    def _ensure_client(self) -> Any:
        if self._client is None:
            self._client = aws.make_client(
                "kinesis", self._region, self._endpoint_url, self._timeout, self._concurrency
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
        by_stream: dict[str, list[int]] = {}
        for i, message in enumerate(messages):
            if (refused := self.guard.refuse(message)) is not None:
                results[i] = refused
                continue
            by_stream.setdefault(self._stream.replace(aws.PLACEHOLDER, message.topic), []).append(i)
        await asyncio.gather(
            *(self._publish_to(name, idx, messages, results) for name, idx in by_stream.items())
        )
        return [r if r is not None else PublishResult.retry("kinesis: no outcome") for r in results]

    async def _publish_to(
        self,
        stream: str,
        indexes: list[int],
        messages: Sequence[OutboundMessage],
        results: list[PublishResult | None],
    ) -> None:
        if not _valid_stream(stream):
            for i in indexes:
                results[i] = PublishResult.permanent(
                    f"kinesis: {stream[:300]!r} is not a valid stream name (from topic"
                    f" {messages[i].topic[:80]!r})",
                    "invalid_stream",
                )
            return
        records: dict[int, dict[str, Any]] = {}
        sizes: dict[int, int] = {}
        for i in indexes:
            data, key = wire.encode(messages[i])
            size = len(data) + len(key.encode())
            if size > self._limit:
                results[i] = self._too_large(size)
            else:
                records[i], sizes[i] = {"Data": data, "PartitionKey": key}, size
        failed: dict[str, PublishResult | None] = {}  # key -> its refused record's verdict
        sendable = [i for i in indexes if i in records]
        for wave in aws.waves(sendable, lambda i: records[i]["PartitionKey"]):
            ready = []
            for i in wave:
                key = records[i]["PartitionKey"]
                if key in failed:
                    results[i] = aws.blocked("kinesis", key, failed[key])
                else:
                    ready.append(i)
            await asyncio.gather(
                *(
                    self._send(stream, c, records, results)
                    for c in aws.chunks(ready, sizes, BATCH_RECORDS, MAX_REQUEST_BYTES)
                )
            )
            for i in ready:
                if not aws.ok(results[i]):
                    failed[records[i]["PartitionKey"]] = results[i]

    def _too_large(self, size: int) -> PublishResult:
        if self._lowered:
            named = f"max_message_bytes={self._limit} in the relay's broker URL"
            fix = "raise it (up to 1 048 576), or send less"
        else:
            named = "Kinesis's record size limit"
            fix = "send less, or a reference to the payload (e.g. an S3 key)"
        return too_large(
            "kinesis", size, "with its envelope and partition key", named, self._limit, fix
        )

    async def _send(
        self,
        stream: str,
        chunk: list[int],
        records: dict[int, dict[str, Any]],
        results: list[PublishResult | None],
    ) -> None:
        async with self._slots:
            try:
                reply = await aws.call(
                    self._client,
                    "put_records",
                    Records=[records[i] for i in chunk],
                    **_stream_arg(stream),
                )
            except botocore.exceptions.ClientError as exc:
                self.reachability.succeeded()  # Kinesis answered, with an error
                result = self._stream_error(stream, exc)
                for i in chunk:
                    results[i] = result
                return
            except Exception as exc:
                result = aws.request_failed(
                    self.reachability, exc, f"kinesis: request failed: {describe(exc)}"
                )
                for i in chunk:
                    results[i] = result
                return
        self.reachability.succeeded()
        throttled = False
        for i, record in zip(chunk, reply.get("Records", []), strict=False):
            code = record.get("ErrorCode")
            if not code:
                results[i] = PublishResult.success() if record.get("SequenceNumber") else None
                continue
            text = f"kinesis: {code}: {record.get('ErrorMessage', '')}".strip()
            if code in aws.THROTTLED:
                throttled = True
                results[i] = self._throttle.throttled("kinesis", text)
            else:
                results[i] = PublishResult.retry(text, str(code))
        if not throttled:
            self._throttle.passed()

    def _stream_error(self, stream: str, exc: botocore.exceptions.ClientError) -> PublishResult:
        code = aws.error_code(exc)
        text = aws.client_error(exc)
        if code in _NO_STREAM:
            return PublishResult.permanent(
                f"kinesis: stream {stream!r} does not exist ({text}); create it, then"
                " `outboxkit replay --all-failed`",
                "no_stream",
            )
        if code in aws.THROTTLED:
            return self._throttle.throttled("kinesis", text)
        return PublishResult.retry(f"kinesis: {text}", code or "client_error")


def _stream_arg(stream: str) -> dict[str, str]:
    return {"StreamARN": stream} if stream.startswith("arn:") else {"StreamName": stream}


def _valid_stream(stream: str) -> bool:
    if stream.startswith("arn:"):
        return _STREAM_ARN.match(stream) is not None
    return _STREAM_NAME.match(stream) is not None
