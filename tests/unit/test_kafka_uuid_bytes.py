"""The Kafka encoder's fast UUID text is exactly ``str(uuid)``."""

from __future__ import annotations

import random
import uuid

from outboxkit.wire.kafka import uuid_bytes


def test_uuid_bytes_is_the_canonical_text() -> None:
    samples = [uuid.UUID(int=0), uuid.UUID(int=(1 << 128) - 1), uuid.UUID(int=1 << 124)]
    samples += [uuid.uuid4() for _ in range(200)]
    samples += [uuid.UUID(int=random.getrandbits(k)) for k in range(1, 129)]
    for value in samples:
        assert uuid_bytes(value) == str(value).encode()
