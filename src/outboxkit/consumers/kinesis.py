"""Amazon Kinesis: reading a record the Kinesis publisher wrote (CloudEvents JSON data).

A consumer runner (shard iterators, a checkpoint per shard written after the inbox
commit) is not here yet: read the stream with the Kinesis Client Library or a Lambda
event source mapping, and dedup with :class:`outboxkit.Inbox` on the decoded event id.
"""

from __future__ import annotations

from typing import Any

from outboxkit.consumers.base import ReceivedEvent, unwrap
from outboxkit.wire import kinesis as wire


def decode(stream: str, record: dict[str, Any]) -> ReceivedEvent:
    """The event in a Kinesis record as boto3's ``get_records`` returns it (``Data`` bytes)."""
    data = record.get("Data", b"")
    return unwrap(stream, lambda: wire.decode(bytes(data)))
