"""encode_record before/after in one process, interleaved rounds (process CPU time).

python bench/micro_encode_record.py BASE_SRC   # e.g. a `git worktree add` of the before state
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.util
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from outboxkit import OutboundMessage
from outboxkit.wire import kafka as after


def load_base(src: str) -> Any:
    path = Path(src) / "outboxkit/wire/kafka.py"
    spec = importlib.util.spec_from_file_location("base_wire_kafka", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample_messages(n: int = 1000) -> list[OutboundMessage]:
    """``n`` messages as the relay benchmarks write them (~230-byte payload, 1 000 keys)."""
    now = dt.datetime.now(dt.UTC)
    return [
        OutboundMessage(
            event_id=uuid.uuid4(),
            topic="bench.orders",
            key=f"customer-{i % 1000:04d}",
            event_type="order.placed",
            aggregate_type="order",
            aggregate_id=str(i),
            payload=b"x" * 230,
            headers={},
            created_at=now + dt.timedelta(microseconds=i * 37),
            schema_version="1",
        )
        for i in range(n)
    ]


def main() -> None:
    before = load_base(sys.argv[1])
    messages = sample_messages()
    odd = [
        dataclasses.replace(m, headers=h, schema_version=None, aggregate_type=None)
        for m, h in zip(
            messages,
            [
                {"traceparent": "00-ab-cd-01", "x": "y"},
                {"content-type": "text/plain", "ce_id": "no", "idempotency-key": "no"},
            ],
            strict=False,
        )
    ]
    assert all(before.encode_record(m) == after.encode_record(m) for m in messages + odd)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(15):
        for name, mod in (("before", before), ("after", after))[:: 1 if r % 2 else -1]:
            t0 = time.process_time()
            for _ in range(20):
                for m in messages:
                    mod.encode_record(m)
            times[name].append((time.process_time() - t0) / 20_000 * 1e6)
    for name, v in times.items():
        print(f"{name}: median {statistics.median(v):.3f} µs per event")


if __name__ == "__main__":
    main()
