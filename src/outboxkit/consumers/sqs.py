"""Amazon SQS runner: ``ReceiveMessage``, then ``DeleteMessage`` only after the database commit.

A message that is not deleted becomes visible again when its visibility
timeout runs out; after a failure the runner shortens that to a backoff delay.
Dead-lettering is SQS's own: give the queue a redrive policy
(``maxReceiveCount``) and SQS moves a message that keeps failing to its DLQ.
boto3 is synchronous, so its calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from outboxkit.errors import EnvelopeError, missing_extra

try:
    import boto3
    import botocore.config
except ModuleNotFoundError as exc:  # one line naming the extra, not a traceback
    raise missing_extra(exc, "outboxkit.consumers.sqs") from exc

from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.consumers.base import (
    ConsumerRunner,
    Handler,
    ReceivedEvent,
    unwrap,
)
from outboxkit.inbox import Inbox
from outboxkit.wire import cloudevents_json
from outboxkit.wire import eventbridge as eventbridge_wire
from outboxkit.wire import sns as sns_wire
from outboxkit.wire import sqs as wire

log = logging.getLogger("outboxkit.consumer.sqs")


def decode(queue: str, message: dict[str, Any]) -> ReceivedEvent:
    """The event in an SQS message from the SQS or SNS publisher, or an EventBridge rule.

    The SQS publisher's message and an SNS one delivered raw carry ``ce_*`` message
    attributes; without raw delivery SNS wraps the message in its JSON notification, and
    an EventBridge rule's SQS target delivers the EventBridge event, whose ``detail`` is
    the CloudEvents JSON object the EventBridge publisher wrote. All three read the same.
    """
    attributes = {
        name: str(value.get("StringValue", ""))
        for name, value in (message.get("MessageAttributes") or {}).items()
    }
    received = int((message.get("Attributes") or {}).get("ApproximateReceiveCount", "1"))
    body = str(message.get("Body", ""))
    if "ce_id" not in attributes and body.startswith("{"):
        notification = sns_wire.unwrap_notification(body)
        if notification is not None:
            body, attributes = notification
        else:
            detail = eventbridge_wire.unwrap_event(body)
            if detail is not None:
                return unwrap(queue, lambda: cloudevents_json.from_document(detail), received)
    return unwrap(queue, lambda: wire.decode(body, attributes), received)


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
                    log.warning("sqs consumer %r: receive failed: %s", self.consumer, describe(exc))
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
                log.warning("sqs consumer %r: delete failed: %s", self.consumer, describe(exc))
            return
        with contextlib.suppress(Exception):
            await asyncio.to_thread(
                self._client.change_message_visibility,
                QueueUrl=url,
                ReceiptHandle=receipt,
                VisibilityTimeout=round(self._backoff(event.delivery_count)),
            )
