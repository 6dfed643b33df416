"""moto's AWS API server (SQS, SNS, Kinesis, EventBridge, STS) in the test process, on a free
port, to stop and start at will."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from outboxkit.testing import free_port
from tests.support.servers import require_or_skip


class MotoSqs:
    """moto's SQS API in this process on a free port; `stop()`/`start()` keep its queues."""

    def __init__(self) -> None:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as exc:  # pragma: no cover - the dev extra installs it
            require_or_skip(f"moto[server] is not installed: {exc}")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.running = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, queue: str, **options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"region": "us-east-1", **options}.items())
        return f"sqs://{queue}?{query}&endpoint_url={self.endpoint}"

    def start(self) -> None:
        self._server.start()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._server.stop()
            self.running = False

    def client(self, service: str = "sqs") -> Any:
        import boto3

        return boto3.client(service, region_name="us-east-1", endpoint_url=self.endpoint)

    def create_queue(self, name: str, **attributes: str) -> str:
        if name.endswith(".fifo"):
            attributes = {"FifoQueue": "true", **attributes}
        url: str = self.client().create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        return url

    def depth(self, queue_url: str) -> int:
        attrs = self.client().get_queue_attributes(
            QueueUrl=queue_url, AttributeNames=["ApproximateNumberOfMessages"]
        )
        return int(attrs["Attributes"]["ApproximateNumberOfMessages"])

    def drain(self, queue_url: str, *, idle_polls: int = 2) -> list[dict[str, Any]]:
        """Every message of the queue (received, then deleted), in receive order."""
        client = self.client()
        messages: list[dict[str, Any]] = []
        idle = 0
        while idle < idle_polls:
            reply = client.receive_message(
                QueueUrl=queue_url,
                MaxNumberOfMessages=10,
                MessageAttributeNames=["All"],
                AttributeNames=["All"],
                VisibilityTimeout=60,
            )
            batch = reply.get("Messages", [])
            if not batch:
                idle += 1
                continue
            idle = 0
            messages += batch
            client.delete_message_batch(
                QueueUrl=queue_url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(batch)
                ],
            )
        return messages

    def create_stream(self, name: str, shards: int = 2) -> None:
        self.client("kinesis").create_stream(StreamName=name, ShardCount=shards)

    def read_stream(self, name: str) -> list[dict[str, Any]]:
        """Every record of every shard of the stream, shard after shard, each in its order."""
        kinesis = self.client("kinesis")
        records: list[dict[str, Any]] = []
        for shard in kinesis.list_shards(StreamName=name)["Shards"]:
            iterator = kinesis.get_shard_iterator(
                StreamName=name, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
            )["ShardIterator"]
            while iterator:
                reply = kinesis.get_records(ShardIterator=iterator, Limit=10_000)
                records += reply["Records"]
                if not reply["Records"]:
                    break
                iterator = reply.get("NextShardIterator")
        return records


@contextmanager
def running_moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoSqs]:
    """A started server; dummy credentials through boto3's normal chain (relay processes
    inherit them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = MotoSqs()
    server.start()
    try:
        yield server
    finally:
        server.stop()
