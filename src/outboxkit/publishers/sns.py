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

import botocore.exceptions

from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers import _aws as aws
from outboxkit.publishers._util import too_large
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard
from outboxkit.wire import sqs as wire

log = logging.getLogger("outboxkit.sns")

BATCH_ENTRIES = 10
#: SNS's limit for one message (body + attributes) and for a whole PublishBatch request.
MAX_MESSAGE_BYTES = 262_144
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
_TOPIC_ARN = re.compile(r"^arn:[a-z-]+:sns:[a-z0-9-]+:\d{12}:[A-Za-z0-9_.-]{1,256}$")
#: MessageGroupId: 1-128 characters, ASCII letters, digits and punctuation.
_GROUP_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_NO_TOPIC = {"NotFound", "NotFoundException"}
_PERMANENT = {"InvalidParameter", "InvalidParameterValue", "ParameterValueInvalid"}


class SnsPublisher:
    """Sends events to one SNS topic, or one topic per event topic (``sns://{topic}``)."""

    name = "sns"

    def __init__(
        self,
        topic: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        timeout: float = aws.DEFAULT_TIMEOUT,
        concurrency: int = aws.DEFAULT_CONCURRENCY,
        max_message_bytes: int | None = None,
    ) -> None:
        if not _valid_topic(topic.replace(aws.PLACEHOLDER, "x")):
            raise ConfigurationError(
                f"invalid SNS topic {topic!r}: a name of 1-256 letters, digits, - and _"
                " (plus .fifo), a topic ARN, or {topic} for one SNS topic per event topic"
            )
        aws.check_options("sns", timeout, concurrency, max_message_bytes)
        self._topic = topic
        self._region = region
        self._endpoint_url = endpoint_url
        self._timeout = timeout
        self._concurrency = concurrency
        self._limit = min(max_message_bytes or MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES)
        self._lowered = max_message_bytes is not None
        self._slots = asyncio.Semaphore(concurrency)
        self._client: Any = None
        self._arn_prefix: str | None = None  # arn:PARTITION:sns:REGION:ACCOUNT:
        self._throttle = aws.Throttle()
        if topic.endswith(".fifo"):
            #: One batch in flight: a second one could overtake the first's events of a key.
            self.batch_shape = (500, 1)
        #: For /readyz: unreachable once requests have failed to connect for a few seconds.
        self.reachability = Reachability()
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> SnsPublisher:
        """``sns://TOPIC[?region=us-east-1&endpoint_url=http://127.0.0.1:4566&timeout=10]``.

        ``TOPIC`` is a topic name, a topic ARN, or contains ``{topic}`` (one SNS topic per
        event topic). Also ``concurrency=N`` and ``max_message_bytes=N`` (at most 256 KiB).
        Credentials come from the usual boto3 chain (environment, profile, role).
        """
        topic, options = aws.parse_url(url, "sns", "sns://orders?region=eu-west-1")
        return cls(topic, **options)

    def __repr__(self) -> str:
        return f"SnsPublisher(topic={self._topic!r}, region={self._region!r})"

    async def start(self) -> None:
        """Learn the account (for topic ARNs); if SNS is unreachable the first batch retries."""
        try:
            self._ensure_client()
            await self._prefix()
        except ConfigurationError:
            raise
        except Exception as exc:
            log.warning("SNS not reachable at start (%s); will retry", describe(exc))

    def _ensure_client(self) -> Any:
        if self._client is None:
            self._client = aws.make_client(
                "sns", self._region, self._endpoint_url, self._timeout, self._concurrency
            )
        return self._client

    async def _prefix(self) -> str:
        """``arn:aws:sns:REGION:ACCOUNT:`` of the caller (STS GetCallerIdentity, no permission
        needed), so a topic name becomes its ARN without listing or creating topics."""
        if self._arn_prefix is None:
            client = self._ensure_client()
            sts = aws.make_client(
                "sts", client.meta.region_name, self._endpoint_url, self._timeout, 1
            )
            try:
                identity = await aws.call(sts, "get_caller_identity")
            finally:
                sts.close()
            partition = str(identity["Arn"]).split(":")[1]
            self._arn_prefix = (
                f"arn:{partition}:sns:{client.meta.region_name}:{identity['Account']}:"
            )
        return self._arn_prefix

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        self._ensure_client()
        results: list[PublishResult | None] = [None] * len(messages)
        by_topic: dict[str, list[int]] = {}
        for i, message in enumerate(messages):
            if (refused := self.guard.refuse(message)) is not None:
                results[i] = refused
                continue
            by_topic.setdefault(self._topic.replace(aws.PLACEHOLDER, message.topic), []).append(i)
        await asyncio.gather(
            *(self._publish_to(name, idx, messages, results) for name, idx in by_topic.items())
        )
        return [r if r is not None else PublishResult.retry("sns: no outcome") for r in results]

    async def _publish_to(
        self,
        topic: str,
        indexes: list[int],
        messages: Sequence[OutboundMessage],
        results: list[PublishResult | None],
    ) -> None:
        if not _valid_topic(topic):
            for i in indexes:
                results[i] = PublishResult.permanent(
                    f"sns: {topic[:300]!r} is not a valid topic name (from topic"
                    f" {messages[i].topic[:80]!r})",
                    "invalid_topic",
                )
            return
        try:
            arn = topic if topic.startswith("arn:") else await self._prefix() + topic
        except Exception as exc:
            text = f"sns: cannot reach AWS: {describe(exc)}"
            result = aws.request_failed(self.reachability, exc, text)
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
        if not fifo:
            await asyncio.gather(
                *(
                    self._send(topic, arn, c, entries, results)
                    for c in aws.chunks(sendable, sizes, BATCH_ENTRIES, MAX_MESSAGE_BYTES)
                )
            )
            return
        # FIFO: round after round, a key's next event only once the one before it is in.
        failed: dict[str, PublishResult | None] = {}  # group -> its refused entry's verdict
        for wave in aws.waves(sendable, lambda i: entries[i]["MessageGroupId"]):
            ready = []
            for i in wave:
                group = entries[i]["MessageGroupId"]
                if group in failed:
                    key = messages[i].key or messages[i].topic
                    results[i] = aws.blocked("sns", key, failed[group])
                else:
                    ready.append(i)
            # In order: SNS keeps a group's receive order.
            for c in aws.chunks(ready, sizes, BATCH_ENTRIES, MAX_MESSAGE_BYTES):
                await self._send(topic, arn, c, entries, results)
            for i in ready:
                if not aws.ok(results[i]):
                    failed[entries[i]["MessageGroupId"]] = results[i]

    def _too_large(self, size: int) -> PublishResult:
        if self._lowered:
            named = f"max_message_bytes={self._limit} in the relay's broker URL"
            fix = "raise it (up to 262 144), or send less"
        else:
            named = "SNS's message size limit"
            fix = "send less, or a reference to the payload (e.g. an S3 key)"
        return too_large("sns", size, "with its attributes", named, self._limit, fix)

    async def _send(
        self,
        topic: str,
        arn: str,
        chunk: list[int],
        entries: dict[int, dict[str, Any]],
        results: list[PublishResult | None],
    ) -> None:
        async with self._slots:
            try:
                reply = await aws.call(
                    self._client,
                    "publish_batch",
                    TopicArn=arn,
                    PublishBatchRequestEntries=[entries[i] for i in chunk],
                )
            except botocore.exceptions.ClientError as exc:
                self.reachability.succeeded()  # SNS answered, with an error
                result = self._topic_error(topic, exc)
                for i in chunk:
                    results[i] = result
                return
            except Exception as exc:
                result = aws.request_failed(
                    self.reachability, exc, f"sns: request failed: {describe(exc)}"
                )
                for i in chunk:
                    results[i] = result
                return
        self.reachability.succeeded()
        self._throttle.passed()
        for ok in reply.get("Successful", []):
            results[int(ok["Id"])] = PublishResult.success()
        for failed in reply.get("Failed", []):
            code = str(failed.get("Code", "failed"))
            text = f"sns: {code}: {failed.get('Message', '')}".strip()
            if code in aws.THROTTLED:
                results[int(failed["Id"])] = self._throttle.throttled("sns", text)
            elif failed.get("SenderFault"):
                results[int(failed["Id"])] = PublishResult.permanent(text, code)
            else:
                results[int(failed["Id"])] = PublishResult.retry(text, code)

    def _topic_error(self, topic: str, exc: botocore.exceptions.ClientError) -> PublishResult:
        code = aws.error_code(exc)
        text = aws.client_error(exc)
        if code in _NO_TOPIC:
            return PublishResult.permanent(
                f"sns: topic {topic!r} does not exist ({text}); create it, then"
                " `outboxkit replay --all-failed`",
                "no_topic",
            )
        if code in aws.THROTTLED:
            return self._throttle.throttled("sns", text)
        if code in _PERMANENT:
            return PublishResult.permanent(f"sns: {text}", code)
        return PublishResult.retry(f"sns: {text}", code or "client_error")


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


def _valid_topic(topic: str) -> bool:
    if topic.startswith("arn:"):
        return _TOPIC_ARN.match(topic) is not None
    return _TOPIC_NAME.match(topic.removesuffix(".fifo")) is not None
