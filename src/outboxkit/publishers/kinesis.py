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
import re
from collections.abc import Sequence
from typing import Any

from outboxkit.publishers import _aws as aws
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.wire import kinesis as wire

BATCH_RECORDS = 500
#: Kinesis's limits: one record (data + partition key) and one PutRecords request.
MAX_RECORD_BYTES = 1_048_576
MAX_REQUEST_BYTES = 5 * 1_048_576
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_STREAM_ARN = re.compile(r"^arn:[a-z-]+:kinesis:[a-z0-9-]+:\d{12}:stream/[A-Za-z0-9_.-]{1,128}$")


class KinesisPublisher(aws.AwsPublisher):
    """Sends events to one Kinesis data stream, or one per topic (``kinesis://{topic}``)."""

    name = "kinesis"
    service = "kinesis"
    kind = "stream"
    example = "kinesis://orders?region=eu-west-1"
    max_bytes = MAX_RECORD_BYTES
    limit_name = "Kinesis's record size limit"
    counted = "with its envelope and partition key"
    #: One batch in flight: a second one could overtake the first's events of a key.
    batch_shape = (500, 1)

    @classmethod
    def from_url(cls, url: str) -> KinesisPublisher:
        """``kinesis://STREAM[?region=us-east-1&endpoint_url=http://127.0.0.1:4566&timeout=10]``.

        ``STREAM`` is a stream name, a stream ARN, or contains ``{topic}``. Also
        ``concurrency=N`` and ``max_message_bytes=N`` (at most 1 MiB). Credentials come
        from the usual boto3 chain (environment, profile, role).
        """
        publisher: KinesisPublisher = cls._from_url(url)
        return publisher

    @staticmethod
    def _valid(name: str) -> bool:
        if name.startswith("arn:"):
            return _STREAM_ARN.match(name) is not None
        return _STREAM_NAME.match(name) is not None

    @staticmethod
    def _rule() -> str:
        return "a name of 1-128 letters, digits, _ . -"

    async def start(self) -> None:
        """Check the stream exists; if Kinesis is unreachable the first batch retries."""
        await self._check_at_start("describe_stream_summary", **_stream_arg(self._destination))

    async def _publish_to(
        self,
        stream: str,
        indexes: list[int],
        messages: Sequence[OutboundMessage],
        results: aws.Results,
    ) -> None:
        records: dict[int, dict[str, Any]] = {}
        sizes: dict[int, int] = {}
        for i in indexes:
            data, key = wire.encode(messages[i])
            size = len(data) + len(key.encode())
            if size > self._limit:
                results[i] = self._too_large(size)
            else:
                records[i], sizes[i] = {"Data": data, "PartitionKey": key}, size

        async def at_once(ready: list[int]) -> None:
            requests = aws.chunks(ready, sizes, BATCH_RECORDS, MAX_REQUEST_BYTES)
            await asyncio.gather(*(self._send(stream, c, records, results) for c in requests))

        sendable = [i for i in indexes if i in records]
        await self._in_rounds(sendable, lambda i: records[i]["PartitionKey"], results, at_once)

    async def _send(
        self,
        stream: str,
        chunk: list[int],
        records: dict[int, dict[str, Any]],
        results: aws.Results,
    ) -> None:
        batch = [records[i] for i in chunk]
        reply = await self._request(
            stream, chunk, results, "put_records", Records=batch, **_stream_arg(stream)
        )
        if reply is None:
            return
        throttled = False
        for i, record in zip(chunk, reply.get("Records", []), strict=False):
            code = record.get("ErrorCode")
            if not code:
                if record.get("SequenceNumber"):
                    results[i] = PublishResult.success()
                continue
            text = f"kinesis: {code}: {record.get('ErrorMessage', '')}".strip()
            throttled = throttled or code in aws.THROTTLED
            results[i] = self._verdict(str(code), text, sender_fault=False)
        if not throttled:
            self._throttle.passed()


def _stream_arg(stream: str) -> dict[str, str]:
    return {"StreamARN": stream} if stream.startswith("arn:") else {"StreamName": stream}
