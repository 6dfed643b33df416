"""Amazon SNS publisher: ``PublishBatch`` of up to ten, per-entry outcomes.

SNS answers once it has stored the message durably across availability zones, so a
``Successful`` entry is the confirmation. The message is the SQS binding's (the payload
as the body, base64 when SNS cannot carry it as text; CloudEvents attributes as at most
ten String message attributes, ``outboxkit.wire.sqs``), so a queue subscribed with raw
message delivery holds exactly what the SQS publisher would have sent, and the SQS
runner reads it, raw or in SNS's JSON envelope.

FIFO topics (``.fifo``): ``MessageGroupId`` = the event key (per-key order) and
``MessageDeduplicationId`` = the event id (SNS drops a re-publish within five minutes).
A batch goes out in rounds, the n-th event of each key in round n, so a key's later
event never overtakes an earlier one that SNS refused, and a relay keeps one batch in
flight (``batch_shape``), so a later batch cannot overtake it either.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any

from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers import _aws as aws
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.wire import sqs as wire

log = logging.getLogger("outboxkit.sns")

BATCH_ENTRIES = 10
#: SNS's limit for one message (body + attributes) and for a whole PublishBatch request.
MAX_MESSAGE_BYTES = 262_144
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
_TOPIC_ARN = re.compile(r"^arn:[a-z-]+:sns:[a-z0-9-]+:\d{12}:[A-Za-z0-9_.-]{1,256}$")
#: MessageGroupId: 1-128 characters, ASCII letters, digits and punctuation.
_GROUP_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


class SnsPublisher(aws.AwsPublisher):
    """Sends events to one SNS topic, or one topic per event topic (``sns://{topic}``)."""

    name = "sns"
    service = "sns"
    kind = "topic"
    example = "sns://orders?region=eu-west-1"
    max_bytes = MAX_MESSAGE_BYTES
    limit_name = "SNS's message size limit"
    counted = "with its attributes"
    no_destination = frozenset({"NotFound", "NotFoundException"})
    never_valid = frozenset({"InvalidParameter", "InvalidParameterValue", "ParameterValueInvalid"})

    def __init__(self, topic: str, **options: Any) -> None:
        super().__init__(topic, **options)
        self._arn_prefix: str | None = None  # arn:PARTITION:sns:REGION:ACCOUNT:
        if topic.endswith(".fifo"):
            #: One batch in flight: a second one could overtake the first's events of a key.
            self.batch_shape = (500, 1)

    @classmethod
    def from_url(cls, url: str) -> SnsPublisher:
        """``sns://TOPIC[?region=us-east-1&endpoint_url=http://127.0.0.1:4566&timeout=10]``.

        ``TOPIC`` is a topic name, a topic ARN, or contains ``{topic}`` (one SNS topic per
        event topic). Also ``concurrency=N`` and ``max_message_bytes=N`` (at most 256 KiB).
        Credentials come from the usual boto3 chain (environment, profile, role).
        """
        publisher: SnsPublisher = cls._from_url(url)
        return publisher

    @staticmethod
    def _valid(name: str) -> bool:
        if name.startswith("arn:"):
            return _TOPIC_ARN.match(name) is not None
        return _TOPIC_NAME.match(name.removesuffix(".fifo")) is not None

    @staticmethod
    def _rule() -> str:
        return "a name of 1-256 letters, digits, - and _ (plus .fifo)"

    async def start(self) -> None:
        """Learn the account (for topic ARNs); if SNS is unreachable the first batch retries."""
        try:
            self._ensure_client()
            if not self._destination.startswith("arn:"):
                await self._prefix()
        except ConfigurationError:
            raise
        except Exception as exc:
            log.warning("SNS not reachable at start (%s); will retry", describe(exc))

    async def _prefix(self) -> str:
        """``arn:aws:sns:REGION:ACCOUNT:`` of the caller (STS GetCallerIdentity, no permission
        needed), so a topic name becomes its ARN without listing or creating topics."""
        if self._arn_prefix is None:
            client = self._ensure_client()
            region = client.meta.region_name
            sts = aws.make_client("sts", region, self._endpoint_url, self._timeout, 1)
            try:
                identity = await aws.call(sts, "get_caller_identity")
            finally:
                sts.close()
            partition = str(identity["Arn"]).split(":")[1]
            self._arn_prefix = f"arn:{partition}:sns:{region}:{identity['Account']}:"
        return self._arn_prefix

    async def _publish_to(
        self,
        topic: str,
        indexes: list[int],
        messages: Sequence[OutboundMessage],
        results: aws.Results,
    ) -> None:
        try:
            arn = topic if topic.startswith("arn:") else await self._prefix() + topic
        except Exception as exc:
            result = aws.request_failed(
                self.reachability, exc, f"sns: cannot reach AWS: {describe(exc)}"
            )
            for i in indexes:
                results[i] = result
            return
        fifo = topic.endswith(".fifo")
        entries: dict[int, dict[str, Any]] = {}
        sizes: dict[int, int] = {}
        for i in indexes:
            entry, size = _entry(i, messages[i], fifo)
            if size > self._limit:
                results[i] = self._too_large(size)
            else:
                entries[i], sizes[i] = entry, size
        sendable = [i for i in indexes if i in entries]

        def requests(ready: list[int]) -> list[list[int]]:
            return aws.chunks(ready, sizes, BATCH_ENTRIES, MAX_MESSAGE_BYTES)

        if not fifo:
            await asyncio.gather(
                *(self._send(arn, c, entries, results) for c in requests(sendable))
            )
            return

        async def in_order(ready: list[int]) -> None:  # SNS keeps a group's receive order
            for c in requests(ready):
                await self._send(arn, c, entries, results)

        # FIFO: round after round, a key's next event only once the one before it is in.
        await self._in_rounds(sendable, lambda i: entries[i]["MessageGroupId"], results, in_order)

    async def _send(
        self, arn: str, chunk: list[int], entries: dict[int, dict[str, Any]], results: aws.Results
    ) -> None:
        batch = [entries[i] for i in chunk]
        topic = arn.rpartition(":")[2]
        reply = await self._request(
            topic, chunk, results, "publish_batch", TopicArn=arn, PublishBatchRequestEntries=batch
        )
        if reply is None:
            return
        self._throttle.passed()
        for ok in reply.get("Successful", []):
            results[int(ok["Id"])] = PublishResult.success()
        for failed in reply.get("Failed", []):
            code = str(failed.get("Code", "failed"))
            text = f"sns: {code}: {failed.get('Message', '')}".strip()
            fault = bool(failed.get("SenderFault"))
            results[int(failed["Id"])] = self._verdict(code, text, sender_fault=fault)


def _entry(index: int, message: OutboundMessage, fifo: bool) -> tuple[dict[str, Any], int]:
    """One PublishBatch entry and its size as SNS counts it (body + attribute names, types and
    values)."""
    body, attributes = wire.encode(message)
    entry: dict[str, Any] = {
        "Id": str(index),
        "Message": body,
        "MessageAttributes": {
            name: {"DataType": "String", "StringValue": value} for name, value in attributes.items()
        },
    }
    if fifo:
        group = message.key if message.key is not None else message.topic
        entry["MessageGroupId"] = aws.digest_if(group, lambda g: _GROUP_ID.match(g) is not None)
        entry["MessageDeduplicationId"] = str(message.event_id)
    size = len(body.encode("utf-8")) + sum(
        len(name.encode()) + len(b"String") + len(value.encode())
        for name, value in attributes.items()
    )
    return entry, size
