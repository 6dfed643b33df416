"""Amazon SQS publisher: ``SendMessageBatch`` in chunks of ten, per-entry outcomes.

SQS answers ``SendMessageBatch`` once the messages are stored redundantly, so
a ``Successful`` entry is the durable confirmation. Entries come back one by
one in ``Failed``: ``SenderFault`` means this message will never be accepted
as it is (dead-lettered), anything else is retried. FIFO queues (name ending
in ``.fifo``) get ``MessageDeduplicationId`` = event id, so a batch
re-published within SQS's five-minute window after a relay crash is stored
once, and ``MessageGroupId`` = event key, which keeps per-key order.

boto3 is synchronous; each chunk runs in a worker thread (``asyncio.to_thread``)
and a few run at once.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import boto3
import botocore.config
import botocore.exceptions

from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers._util import too_large
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard
from outboxkit.wire import sqs as wire

log = logging.getLogger("outboxkit.sqs")

_BATCH_ENTRIES = 10
# SQS's classic limit for one message and for a whole SendMessageBatch request.
# A queue may allow more (MaximumMessageSize, up to 1 MiB); it is read at start.
_CLASSIC_LIMIT = 262_144
_DEFAULT_TIMEOUT = 10.0
_DEFAULT_CONCURRENCY = 4
_QUEUE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,80}$")
_NO_QUEUE = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}
_PLACEHOLDER = "{topic}"


class SqsPublisher:
    """Sends events to one SQS queue, or to one queue per topic (``sqs://{topic}``).

    Message attributes (String, at most 10 as SQS allows): ``ce_id``,
    ``ce_type``, ``ce_source``, ``ce_time``, ``ce_specversion``,
    ``content-type``, ``ce_subject`` and ``ce_partitionkey`` when present,
    ``headers`` (JSON of user headers) when there are any, and
    ``content-transfer-encoding: base64`` when the body had to be encoded;
    ``ce_schemaversion`` when the event has one (inside ``headers`` when the
    other nine are all present).
    """

    name = "sqs"

    def __init__(
        self,
        queue: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        timeout: float = _DEFAULT_TIMEOUT,
        concurrency: int = _DEFAULT_CONCURRENCY,
        max_message_bytes: int | None = None,
    ) -> None:
        if not _valid_queue_name(queue.replace(_PLACEHOLDER, "x")):
            raise ConfigurationError(
                f"invalid SQS queue name {queue!r}: 1-80 letters, digits, - and _"
                " (plus .fifo for FIFO queues), or {topic} for one queue per topic"
            )
        if timeout <= 0:
            raise ConfigurationError("sqs timeout must be positive (seconds)")
        if concurrency < 1:
            raise ConfigurationError("sqs concurrency must be at least 1")
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ConfigurationError("sqs max_message_bytes must be at least 1")
        self._queue = queue
        self._region = region
        self._endpoint_url = endpoint_url
        self._timeout = timeout
        self._max_message_bytes = max_message_bytes
        self._slots = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._client: Any = None
        self._queues: dict[str, tuple[str, int]] = {}  # name -> (url, max message size)
        #: For the relay's /readyz: unreachable once connects to the endpoint have failed for
        #: a few seconds with no answer in between.
        self.reachability = Reachability()
        #: Event()'s rules and the broker's system destinations, at publish (reserved.py).
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> SqsPublisher:
        """``sqs://QUEUE[?region=us-east-1&endpoint_url=http://127.0.0.1:4566&timeout=10]``.

        ``QUEUE`` may be ``{topic}`` (or contain it, e.g. ``app-{topic}``): one
        queue per topic. Also ``concurrency=N`` (requests in flight) and
        ``max_message_bytes=N`` (default: the queue's MaximumMessageSize).
        Credentials come from the usual boto3 chain (environment, profile, role).
        """
        parts = urlsplit(url)
        if parts.scheme.lower() != "sqs":
            raise ConfigurationError(f"not an sqs:// URL: {redact(url)}")
        if "@" in parts.netloc:
            raise ConfigurationError(
                "do not put credentials in the sqs:// URL; use the AWS environment"
                " variables, a profile or an instance role"
            )
        queue = unquote(parts.netloc + parts.path).strip("/")
        if not queue:
            raise ConfigurationError(
                "sqs URL needs a queue name: sqs://orders?region=eu-west-1 (or sqs://{topic})"
            )
        options: dict[str, Any] = {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in ("region", "endpoint_url"):
                if not value:
                    raise ConfigurationError(f"sqs URL option {key}= is empty")
                options[key] = value
            elif key in ("timeout", "concurrency", "max_message_bytes"):
                try:
                    options[key] = float(value) if key == "timeout" else int(value)
                except ValueError:
                    raise ConfigurationError(
                        f"sqs URL option {key}={value!r} is not a number"
                    ) from None
            else:
                raise ConfigurationError(
                    f"unknown sqs URL option {key!r}: use region, endpoint_url, timeout,"
                    " concurrency or max_message_bytes"
                )
        if "region" not in options and boto3.session.Session().region_name is None:
            raise ConfigurationError(
                "no AWS region for SQS: add ?region=us-east-1 (for example) to the URL"
                " or set AWS_REGION"
            )
        return cls(queue, **options)

    def __repr__(self) -> str:
        return f"SqsPublisher(queue={self._queue!r}, region={self._region!r})"

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the queue URL (GetQueueUrl); if SQS is unreachable the first batch retries."""
        try:
            self._ensure_client()
            if _PLACEHOLDER not in self._queue:
                await self._resolve(self._queue)
        except botocore.exceptions.ClientError as exc:
            log.error("SQS queue %r not usable at start: %s", self._queue, _client_error(exc))
        except ConfigurationError:
            raise
        except Exception as exc:
            log.warning("SQS not reachable at start (%s); will retry", describe(exc))

    def _ensure_client(self) -> Any:
        if self._client is None:
            config = botocore.config.Config(
                connect_timeout=min(self._timeout, 5.0),
                read_timeout=self._timeout,
                retries={"mode": "standard", "total_max_attempts": 2},
                max_pool_connections=max(10, self._concurrency * 2),
            )
            try:
                self._client = boto3.session.Session().client(
                    "sqs",
                    region_name=self._region,
                    endpoint_url=self._endpoint_url,
                    config=config,
                )
            except botocore.exceptions.NoRegionError:
                raise ConfigurationError(
                    "no AWS region for SQS: add ?region=... to the URL or set AWS_REGION"
                ) from None
        return self._client

    async def _resolve(self, name: str) -> tuple[str, int]:
        """Queue URL and the largest message it accepts, cached per queue name."""
        found = self._queues.get(name)
        if found is None:
            client = self._ensure_client()
            url = (await asyncio.to_thread(client.get_queue_url, QueueName=name))["QueueUrl"]
            limit = self._max_message_bytes
            if limit is None:
                attrs = await asyncio.to_thread(
                    client.get_queue_attributes,
                    QueueUrl=url,
                    AttributeNames=["MaximumMessageSize"],
                )
                limit = int(attrs.get("Attributes", {}).get("MaximumMessageSize", _CLASSIC_LIMIT))
            found = self._queues[name] = (url, limit)
        return found

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)

    # -- publishing ---------------------------------------------------------------

    def _failed(self, exc: BaseException, text: str, error_class: str) -> PublishResult:
        """The verdict on a request that raised: handed back untried when SQS was never
        reached (refused, timed out), so an outage cannot burn attempts."""
        if isinstance(exc, botocore.exceptions.EndpointConnectionError):
            self.reachability.failed(type(exc).__name__)
            return PublishResult.hand_back(text, "unreachable")
        if isinstance(exc, botocore.exceptions.ConnectionClosedError):
            # The connection dropped before SQS answered: no entry was judged.
            return PublishResult.hand_back(text, "connection_lost")
        return PublishResult.retry(text, error_class)

    def _too_large(self, size: int, limit: int) -> PublishResult:
        if self._max_message_bytes is not None:
            named = f"max_message_bytes={limit} in the relay's broker URL"
            fix = "raise it (up to the queue's MaximumMessageSize), or send less"
        else:
            named = "the queue's MaximumMessageSize"
            fix = "raise MaximumMessageSize (up to 1 MiB), or send less"
        return too_large("sqs", size, "with its attributes", named, limit, fix)

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        self._ensure_client()
        results: list[PublishResult | None] = [None] * len(messages)
        by_queue: dict[str, list[int]] = {}
        for i, message in enumerate(messages):
            if (refused := self.guard.refuse(message)) is not None:
                results[i] = refused
                continue
            by_queue.setdefault(self._queue.replace(_PLACEHOLDER, message.topic), []).append(i)
        await asyncio.gather(
            *(self._publish_to(name, idx, messages, results) for name, idx in by_queue.items())
        )
        return [r if r is not None else PublishResult.retry("sqs: no outcome") for r in results]

    async def _publish_to(
        self,
        queue: str,
        indexes: list[int],
        messages: Sequence[OutboundMessage],
        results: list[PublishResult | None],
    ) -> None:
        if not _valid_queue_name(queue):
            for i in indexes:
                results[i] = PublishResult.permanent(
                    f"sqs: {queue!r} is not a valid queue name (from topic {messages[i].topic!r})",
                    "invalid_queue",
                )
            return
        try:
            url, limit = await self._resolve(queue)
        except botocore.exceptions.ClientError as exc:
            result = _queue_error(queue, exc)
            for i in indexes:
                results[i] = result
            return
        except Exception as exc:
            result = self._failed(exc, f"sqs: cannot reach SQS: {describe(exc)}", "connection")
            for i in indexes:
                results[i] = result
            return
        fifo = queue.endswith(".fifo")
        chunks: list[list[tuple[int, dict[str, Any]]]] = []
        chunk: list[tuple[int, dict[str, Any]]] = []
        chunk_bytes = 0
        for i in indexes:
            entry, size = _entry(i, messages[i], fifo)
            if size > limit:
                results[i] = self._too_large(size, limit)
                continue
            if chunk and (len(chunk) == _BATCH_ENTRIES or chunk_bytes + size > _CLASSIC_LIMIT):
                chunks.append(chunk)
                chunk, chunk_bytes = [], 0
            chunk.append((i, entry))
            chunk_bytes += size
        if chunk:
            chunks.append(chunk)
        if fifo:
            # In order: chunks sent at once could land out of order, and a FIFO
            # queue keeps the order in which SQS receives a group's messages.
            for c in chunks:
                await self._send(queue, url, c, results)
        else:
            await asyncio.gather(*(self._send(queue, url, c, results) for c in chunks))

    async def _send(
        self,
        queue: str,
        url: str,
        chunk: list[tuple[int, dict[str, Any]]],
        results: list[PublishResult | None],
    ) -> None:
        async with self._slots:
            try:
                reply = await asyncio.to_thread(
                    self._client.send_message_batch,
                    QueueUrl=url,
                    Entries=[entry for _, entry in chunk],
                )
            except botocore.exceptions.ClientError as exc:
                self.reachability.succeeded()  # SQS answered, with an error
                result = _queue_error(queue, exc)
                if result.error_class == "no_queue":
                    self._queues.pop(queue, None)
                for i, _ in chunk:
                    results[i] = result
                return
            except Exception as exc:
                text = f"sqs: request failed: {describe(exc)}"
                result = self._failed(exc, text, type(exc).__name__)
                for i, _ in chunk:
                    results[i] = result
                return
        self.reachability.succeeded()
        for ok in reply.get("Successful", []):
            results[int(ok["Id"])] = PublishResult.success()
        for failed in reply.get("Failed", []):
            text = f"sqs: {failed.get('Code', 'error')}: {failed.get('Message', '')}".strip()
            code = str(failed.get("Code", "failed"))
            if failed.get("SenderFault"):
                results[int(failed["Id"])] = PublishResult.permanent(text, code)
            else:
                results[int(failed["Id"])] = PublishResult.retry(text, code)


def _entry(index: int, message: OutboundMessage, fifo: bool) -> tuple[dict[str, Any], int]:
    """One SendMessageBatch entry and its size as SQS counts it (body + attributes)."""
    body, attributes = wire.encode(message)
    entry: dict[str, Any] = {
        "Id": str(index),
        "MessageBody": body,
        "MessageAttributes": {
            name: {"DataType": "String", "StringValue": value} for name, value in attributes.items()
        },
    }
    if fifo:
        entry["MessageGroupId"] = message.key if message.key is not None else message.topic
        entry["MessageDeduplicationId"] = str(message.event_id)
    size = len(body.encode("utf-8")) + sum(
        len(name.encode()) + len(b"String") + len(value.encode())
        for name, value in attributes.items()
    )
    return entry, size


def _valid_queue_name(name: str) -> bool:
    return _QUEUE_NAME.match(name.removesuffix(".fifo")) is not None


def _queue_error(queue: str, exc: botocore.exceptions.ClientError) -> PublishResult:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    text = _client_error(exc)
    if code in _NO_QUEUE:
        # Like an unknown Kafka topic with auto-creation off: dead-letter, and `outboxkit
        # replay --topic` once the queue exists (docs/architecture.md, "Settle, fenced").
        return PublishResult.permanent(
            f"sqs: queue {queue!r} does not exist ({text}); create it, then"
            " `outboxkit replay --all-failed`",
            "no_queue",
        )
    if code in ("AccessDenied", "AccessDeniedException", "InvalidClientTokenId"):
        return PublishResult.retry(f"sqs: not allowed to send to {queue!r}: {text}", code)
    return PublishResult.retry(f"sqs: {text}", code or "client_error")


def _client_error(exc: botocore.exceptions.ClientError) -> str:
    error = exc.response.get("Error", {})
    return redact(f"{error.get('Code', 'error')}: {error.get('Message', str(exc))}")
