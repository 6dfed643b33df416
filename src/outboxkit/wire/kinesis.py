"""Amazon Kinesis Data Streams: a record is ``Data`` (bytes) and a ``PartitionKey``, no headers.

``Data`` is the whole event in CloudEvents JSON (``wire.cloudevents_json``); the partition
key is the event key, or the event id for an event without one (spread over the shards).
A key Kinesis cannot take (over 256 characters) is sent as ``sha256:<hex>`` of it: every
event of the key still lands on one shard, in order; ``partitionkey`` in the data keeps
the key itself.
"""

from __future__ import annotations

import hashlib

from outboxkit.wire import cloudevents_json
from outboxkit.wire.cloudevents import Envelope, Outbound

MAX_PARTITION_KEY_CHARS = 256


def partition_key(message: Outbound) -> str:
    key = message.key if message.key is not None else str(message.event_id)
    if 1 <= len(key) <= MAX_PARTITION_KEY_CHARS:
        return key
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def encode(message: Outbound) -> tuple[bytes, str]:
    """The record's data and partition key."""
    return cloudevents_json.encode(message), partition_key(message)


def decode(data: bytes) -> Envelope:
    """The envelope of a record :func:`encode` wrote (the key from ``partitionkey``, not the
    partition key, which is the event id for an event without a key).

    Raises ``ValueError`` for anything else.
    """
    return cloudevents_json.decode(data)
