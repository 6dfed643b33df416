"""The relay's binary uuid loader builds the same UUID as ``uuid.UUID(bytes=...)``."""

from __future__ import annotations

import copy
import random
import uuid

from outboxkit.backends.postgres.queue_pg import UuidBinaryLoader


def test_loaded_uuid_is_an_ordinary_uuid() -> None:
    loader = UuidBinaryLoader(0)
    samples = [bytes(16), b"\xff" * 16] + [uuid.uuid4().bytes for _ in range(200)]
    samples += [random.getrandbits(128).to_bytes(16, "big") for _ in range(200)]
    for raw in samples:
        for data in (raw, memoryview(raw), bytearray(raw)):
            got, want = loader.load(data), uuid.UUID(bytes=raw)
            assert type(got) is uuid.UUID
            assert (got, hash(got), str(got), got.bytes) == (want, hash(want), str(want), raw)
            assert got.is_safe == want.is_safe
            assert copy.copy(got) == want and copy.deepcopy(got) == want
