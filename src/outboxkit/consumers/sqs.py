"""Amazon SQS runner: ``ReceiveMessage``, then ``DeleteMessage`` only after the database commit.

A message that is not deleted becomes visible again when its visibility
timeout runs out; after a failure the runner shortens that to a backoff delay.
Dead-lettering is SQS's own: give the queue a redrive policy
(``maxReceiveCount``) and SQS moves a message that keeps failing to its DLQ.
boto3 is synchronous, so its calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
from typing import Any

from outboxkit.errors import EnvelopeError, missing_extra

try:
    import boto3
    import botocore.config
except ModuleNotFoundError as exc:  # one line naming the extra, not a traceback
    raise missing_extra(exc, "outboxkit.consumers.sqs") from exc
import orjson

from outboxkit._redact import redact
from outboxkit.consumers.base import (
    ConsumerRunner,
    Handler,
    ReceivedEvent,
    from_cloudevents,
)
from outboxkit.inbox import Inbox

log = logging.getLogger("outboxkit.consumer.sqs")


def decode(queue: str, message: dict[str, Any]) -> ReceivedEvent:
    """The event in an SQS message sent by the SQS publisher (``ce_*`` message attributes)."""
    attributes: dict[str, str] = {}
    user: dict[str, str] = {}
    content_type = None
    base64_body = False
    for name, value in (message.get("MessageAttributes") or {}).items():
        text = str(value.get("StringValue", ""))
        if name.startswith("ce_"):
            attributes[name[3:]] = text
        elif name == "content-type":
            content_type = text
        elif name == "content-transfer-encoding":
            base64_body = text == "base64"
        elif name == "headers":
            try:
                decoded = orjson.loads(text)
            except orjson.JSONDecodeError:
                raise EnvelopeError(f"message of queue {queue!r} has unreadable headers") from None
            if isinstance(decoded, dict):
                user = {str(k): str(v) for k, v in decoded.items()}
    if "ce_schemaversion" in user:  # no attribute slot was left for it (SQS allows 10)
        attributes.setdefault("schemaversion", user.pop("ce_schemaversion"))
    body = str(message.get("Body", ""))
    if base64_body:
        try:
            payload = base64.b64decode(body, validate=True)
        except binascii.Error:
            raise EnvelopeError(f"message of queue {queue!r} has a broken base64 body") from None
    else:
        payload = body.encode("utf-8")
    received = int((message.get("Attributes") or {}).get("ApproximateReceiveCount", "1"))
    return from_cloudevents(
        topic=queue,
        payload=payload,
        attributes=attributes,
        headers=user,
        content_type=content_type,
        delivery_count=received,
    )


class SqsConsumer(ConsumerRunner):
    """Consumes one SQS queue (standard or FIFO) with long polling.

    ``max_deliveries`` is only reported here (SQS counts receives itself); set
    the queue's redrive policy for a dead-letter queue.
    """

    broker = "sqs"

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        consumer: str,
        queue: str,
        region: str | None = None,
        endpoint_url: str | None = None,
        inbox: Inbox | None = None,
        max_deliveries: int = 5,
        retry_delay: float = 5.0,
        wait_time: int = 10,
        batch: int = 10,
    ) -> None:
        super().__init__(
            dsn,
            handler,
            consumer=consumer,
            inbox=inbox,
            max_deliveries=max_deliveries,
            retry_delay=retry_delay,
        )
        self.queue = queue
        self.region = region
        self.endpoint_url = endpoint_url
        self.wait_time = max(0, min(int(wait_time), 20))
        self.batch = max(1, min(batch, 10))
        self._client: Any = None

    async def run(self) -> None:
        """Receive, apply and delete until :meth:`stop` (at most ``wait_time`` s to notice)."""
        config = botocore.config.Config(
            connect_timeout=5, read_timeout=self.wait_time + 10, retries={"mode": "standard"}
        )
        self._client = boto3.session.Session().client(
            "sqs", region_name=self.region, endpoint_url=self.endpoint_url, config=config
        )
        try:
            url = (await asyncio.to_thread(self._client.get_queue_url, QueueName=self.queue))[
                "QueueUrl"
            ]
            while not self.stopping:
                try:
                    reply = await asyncio.to_thread(
                        self._client.receive_message,
                        QueueUrl=url,
                        MaxNumberOfMessages=self.batch,
                        WaitTimeSeconds=self.wait_time,
                        MessageAttributeNames=["All"],
                        AttributeNames=["ApproximateReceiveCount"],
                    )
                except Exception as exc:
                    log.warning(
                        "sqs consumer %r: receive failed: %s", self.consumer, _describe(exc)
                    )
                    await self._sleep_or_stop(1.0)
                    continue
                for message in reply.get("Messages", []):
                    await self._handle(url, message)
        finally:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await asyncio.to_thread(client.close)
            await self._close_db()

    async def _handle(self, url: str, message: dict[str, Any]) -> None:
        receipt = message["ReceiptHandle"]
        try:
            event = decode(self.queue, message)
        except EnvelopeError as exc:
            # Left visible-later: the queue's redrive policy moves it to the DLQ.
            log.error("sqs consumer %r: %s", self.consumer, redact(str(exc)))
            return
        if await self._apply(event):
            # If this delete fails the message comes back and is skipped as a duplicate.
            try:
                await asyncio.to_thread(
                    self._client.delete_message, QueueUrl=url, ReceiptHandle=receipt
                )
            except Exception as exc:
                log.warning("sqs consumer %r: delete failed: %s", self.consumer, _describe(exc))
            return
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                self._client.change_message_visibility,
                QueueUrl=url,
                ReceiptHandle=receipt,
                VisibilityTimeout=round(self._backoff(event.delivery_count)),
            )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
