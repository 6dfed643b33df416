"""Kafka record headers built per event by the relay, or stored as bytes at write time.

What the relay would save if the writer stored each event's Kafka headers and timestamp
(``encode_record``'s result) in the row: the relay would still have to turn the stored
bytes into the list of (name, bytes) tuples confluent-kafka's ``produce()`` takes. Compared
in one process, interleaved rounds, process CPU time per event, 1 000 events; the stored
size is the bytes each row would carry (the write's cost: bench/write_row_cost.py
``--tables v2_null_headers,ce_bytes``).

    python bench/micro_stored_headers.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import marshal
import pickle
import statistics
import time
from collections.abc import Callable

from _common import save
from micro_encode_record import sample_messages

from outboxkit.wire.kafka import encode_record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--name", default="micro_stored_headers")
    args = ap.parse_args()
    messages = sample_messages()
    as_marshal = [marshal.dumps(encode_record(m)) for m in messages]
    as_pickle = [pickle.dumps(encode_record(m), 5) for m in messages]
    as_text = []
    for m in messages:  # name\0value\0...: PostgreSQL text has no NUL, so none can clash
        headers, ms = encode_record(m)
        as_text.append((b"\0".join(x for n, v in headers for x in (n.encode(), v)), ms))

    def build() -> None:
        for m in messages:
            encode_record(m)

    def load_marshal() -> None:
        loads = marshal.loads
        for b in as_marshal:
            loads(b)

    def load_pickle() -> None:
        loads = pickle.loads
        for b in as_pickle:
            loads(b)

    def split_text() -> None:
        for b, _ms in as_text:
            parts = iter(b.split(b"\0"))
            [(n.decode(), v) for n, v in zip(parts, parts, strict=True)]

    variants: dict[str, Callable[[], None]] = {
        "built per event (encode_record, today)": build,
        "stored, marshal.loads": load_marshal,
        "stored, pickle.loads": load_pickle,
        "stored, NUL-separated text split": split_text,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            start = time.process_time_ns()
            run()
            times[name].append((time.process_time_ns() - start) / 1000 / len(messages))
    result = {k: statistics.median(v) for k, v in times.items()}
    sizes = {
        "marshal": statistics.mean(map(len, as_marshal)),
        "pickle": statistics.mean(map(len, as_pickle)),
        "text": statistics.mean(len(b) for b, _ in as_text),
    }
    for name, us in result.items():
        print(f"{us:6.2f} µs/event  {name}")
    print("stored bytes per row:", {k: round(v) for k, v in sizes.items()})
    save(args.name, {"rounds": args.rounds, "us_per_event": result, "stored_bytes": sizes})


if __name__ == "__main__":
    main()
