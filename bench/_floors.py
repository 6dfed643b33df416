"""The two floors of a relay's work, as child processes of bench/_measure.py.

    python bench/_floors.py producer DSN BOOTSTRAP N TOTAL READY   # bare idempotent producer
    python bench/_floors.py sql DSN BOOTSTRAP N TOTAL READY        # bare lease-claim-delete
    python bench/_floors.py producer_window ...   # the producer in the relay's batch window
    python bench/_floors.py producer_paced ...    # ... and at a relay's pace per message

Each writes its CPU at the end of its set-up to the file READY (see ``ready``).

``producer`` loads TOTAL messages (the relay's key, payload and headers) whatever N is, so
that its set-up is the same in the n and the n0 run and cancels in their difference; then
it sends N of them with the relay's producer settings and exits after the last ack.
``producer_window`` sends them as the relay's Kafka publisher hands them over: batches of
1 000, at most 4 unconfirmed (``KafkaPublisher.batch_shape``), where ``producer`` queues
all N at once. The difference between the two is what the relay's window costs librdkafka
and the broker (smaller produce requests), not the relay's own code.
``producer_paced`` is ``producer_window`` spending ``OUTBOXKIT_BENCH_PACE_US`` µs (default
12) of CPU before each message, as a relay spends building it: a batch then takes longer
to hand over than librdkafka lingers, and goes out in more, smaller requests.
``sql`` runs the database work any lease-based relay must do, written by hand (issue 14):
claim a batch with a lease and a token, return what a publish needs, delete it fenced,
commits not waiting for the WAL flush, one connection, binary results, until the table
is empty.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import uuid
from typing import Any

import psycopg

BARE_CLAIM = """
UPDATE outbox
SET attempts = attempts + 1, available_at = now() + make_interval(secs => 30), claim_token = %s
WHERE id = ANY(ARRAY(
    SELECT id FROM outbox WHERE status = 0 AND available_at <= now()
    ORDER BY available_at, id LIMIT %s FOR UPDATE SKIP LOCKED))
RETURNING id, event_id, topic, key, event_type, payload
"""
BARE_DELETE = "DELETE FROM outbox WHERE id = ANY(%s) AND claim_token = %s"
BATCH = 1000


def producer(
    dsn: str, bootstrap: str, n: int, total: int, window: bool = False, pace_us: float = 0.0
) -> None:
    from confluent_kafka import Producer

    from outboxkit import OutboundMessage
    from outboxkit.publishers.kafka import _DEFAULTS, KafkaPublisher
    from outboxkit.wire.kafka import encode_headers

    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT event_id, key, event_type, aggregate_type, aggregate_id, payload, headers,"
            " now() FROM bench_seed LIMIT %s",
            (total,),
        ).fetchall()
    prepared = []
    for r in rows:
        m = OutboundMessage(
            event_id=r[0],
            topic="bench.orders",
            key=r[1],
            event_type=r[2],
            aggregate_type=r[3],
            aggregate_id=r[4],
            payload=bytes(r[5]),
            headers=r[6],
            created_at=r[7],
        )
        prepared.append((m.key.encode() if m.key else None, m.payload, encode_headers(m)))
    p = Producer({**_DEFAULTS, "bootstrap.servers": bootstrap})
    p.list_topics(None, 2.0)  # connected and with metadata, as the relay's publisher starts
    ready(sys.argv[6])
    acked = 0

    def on_delivery(err: Any, _msg: Any) -> None:
        nonlocal acked
        if err is None:
            acked += 1

    size, in_flight = KafkaPublisher.batch_shape if window else (n, 1)
    pace = pace_us / 1e6
    clock = time.perf_counter
    for i, (key, value, headers) in enumerate(prepared[:n]):
        if i % size == 0:
            # The relay claims the next batch only while fewer than `in_flight` wait.
            while acked < i - size * (in_flight - 1):
                p.poll(0.0005)
        if pace:
            until = clock() + pace
            while clock() < until:  # CPU, as a relay's per-message work (not a sleep)
                pass
        while True:
            try:
                p.produce("bench.orders", value, key, on_delivery=on_delivery, headers=headers)
                break
            except BufferError:
                p.poll(0.001)
        p.poll(0)
    p.flush(60)
    if acked != n:
        raise SystemExit(f"producer floor: {acked} of {n} acked")


def ready(path: str) -> None:
    """Write this process's CPU so far (every thread): its set-up, which the parent takes
    off its whole-life CPU (the producer's set-up, loading TOTAL messages, varies by
    ±0.2 s between lives on a loaded machine: too much to leave to the n - n0 difference)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(path, "w") as f:
        f.write(repr(usage.ru_utime + usage.ru_stime))


def sql(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        ready(sys.argv[6])
        while True:
            token = uuid.uuid4()
            rows = conn.execute(BARE_CLAIM, (token, BATCH), binary=True).fetchall()
            if not rows:
                break
            conn.execute(BARE_DELETE, ([r[0] for r in rows], token))


if __name__ == "__main__":
    kind, dsn, bootstrap, n, total = sys.argv[1:6]
    if kind.startswith("producer"):
        paced = kind == "producer_paced"
        pace = float(os.environ.get("OUTBOXKIT_BENCH_PACE_US", "12")) if paced else 0.0
        producer(dsn, bootstrap, int(n), int(total), window=kind != "producer", pace_us=pace)
    else:
        sql(dsn)
