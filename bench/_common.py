"""Shared pieces of the relay benchmarks: the event set, fast reloads, brokers, results.

The 200 000 (or N) events are written once through the library's own write
path into ``outbox``, copied aside into ``bench_seed``, and re-inserted from
there before each run (seconds instead of a minute), so every contender drains
the same rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate

RESULTS = Path(__file__).parent / "results"
TOPIC = "bench.orders"
KEYS = 1000
_COLUMNS = "event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers"


def payload_for(i: int) -> dict[str, Any]:
    """A ~300-byte JSON order event."""
    return {
        "order_id": i,
        "customer": f"customer-{i % KEYS:04d}",
        "currency": "EUR",
        "total_cents": 1000 + i % 9000,
        "lines": [
            {"sku": f"SKU-{(i * 7 + n) % 5000:05d}", "qty": 1 + n, "price_cents": 499 + n}
            for n in range(3)
        ],
        "shipping": {"method": "standard", "country": "DE", "zip": f"{10000 + i % 89999}"},
        "note": "gift wrap please",
    }


def make_event(i: int, *, topic: str = TOPIC, headers: dict[str, str] | None = None) -> Event:
    return Event(
        topic=topic,
        event_type="order.placed",
        payload=payload_for(i),
        key=f"customer-{i % KEYS:04d}",
        aggregate_type="order",
        aggregate_id=str(i),
        headers=headers or {},
    )


def prepare(dsn: str, n: int, *, table: str = "outbox") -> float:
    """Migrate, write ``n`` events through ``Outbox.put_many`` once, keep a copy as the seed.

    Returns the average payload size in bytes.
    """
    migrate(dsn, table=table)
    outbox = Outbox(table=table, notify=False)
    with psycopg.connect(dsn) as conn:
        conn.execute("DROP TABLE IF EXISTS bench_seed")
        conn.commit()
        for start in range(0, n, 5000):
            with conn.transaction():
                outbox.put_many(conn, [make_event(i) for i in range(start, min(n, start + 5000))])
        conn.execute(f"CREATE TABLE bench_seed AS SELECT {_COLUMNS} FROM {table} ORDER BY id")
        size = conn.execute("SELECT avg(length(payload))::float8 FROM bench_seed").fetchone()
        conn.execute(f"TRUNCATE {table}")
        conn.commit()
    return float(size[0]) if size else 0.0


def reload(dsn: str, *, table: str = "outbox", topic: str = TOPIC, limit: int | None = None) -> int:
    """Empty ``table`` and fill it from the seed (optionally on another topic); vacuum it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table}")
        lim = f"LIMIT {int(limit)}" if limit is not None else ""
        cols = _COLUMNS.replace("topic", "%s AS topic")
        cur = conn.execute(
            f"INSERT INTO {table} ({_COLUMNS}) SELECT {cols} FROM bench_seed {lim}", (topic,)
        )
        conn.execute(f"VACUUM ANALYZE {table}")
        conn.execute("CHECKPOINT")
        return cur.rowcount


def remaining(dsn: str, table: str = "outbox") -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table} WHERE status = 0").fetchone()
        return int(row[0]) if row else 0


def server_facts(dsn: str) -> dict[str, Any]:
    """Machine and PostgreSQL settings for the results table."""
    facts: dict[str, Any] = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        facts["ram_gb"] = round(int(mem) / 1024 / 1024, 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in (
            "server_version",
            "fsync",
            "synchronous_commit",
            "shared_buffers",
            "wal_level",
        ):
            row = conn.execute(f"SHOW {name}").fetchone()
            facts[f"pg_{name}"] = row[0] if row else None
    return facts


def save(name: str, data: dict[str, Any]) -> Path:
    """Write results JSON; a --quick smoke run goes to NAME.quick.json and keeps the figures."""
    RESULTS.mkdir(exist_ok=True)
    quick = "--quick" in sys.argv
    path = RESULTS / f"{name}{'.quick' if quick else ''}.json"
    data = {"benchmark": name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **data}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"-> {path}")
    return path


@contextlib.contextmanager
def kafka_broker(url: str | None) -> Iterator[str]:
    """A Kafka bootstrap address: the given one, or an embedded Tansu broker."""
    if url:
        yield url.removeprefix("kafka://")
        return
    from outboxkit.testing import EmbeddedKafka

    broker = EmbeddedKafka()
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.close()


def ensure_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Create ``topic`` (Tansu does not auto-create) and wait until producing to it works."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions)])
    for fut in futures.values():
        with contextlib.suppress(Exception):  # already exists
            fut.result(10)
    producer = Producer({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 20
    errors: list[Any] = []
    while time.monotonic() < deadline:
        errors.clear()
        producer.produce(topic, b"warmup", on_delivery=lambda err, _m: errors.append(err))
        producer.flush(5)
        if errors and errors[0] is None:
            return
        time.sleep(0.2)
    raise RuntimeError(f"cannot produce to {topic} on {bootstrap}: {errors}")


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}/s"


def broker_pid(bootstrap: str) -> int | None:
    """The pid of the process listening on the bootstrap port (the embedded Tansu), if local."""
    import psutil

    port = int(bootstrap.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


class CpuMeter:
    """CPU seconds spent between ``start()`` and ``stop()``: the whole machine, this
    process (all its threads, librdkafka's included) and the broker process.

    ``db_and_rest`` = machine - this process - broker: PostgreSQL's backends, mostly,
    on a machine where nothing else runs.
    """

    def __init__(self, broker: int | None = None) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._broker = psutil.Process(broker) if broker else None

    def _busy(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        machine = t.user + t.system + t.nice + t.irq + t.softirq
        mine = sum(self._me.cpu_times()[:2])
        broker = sum(self._broker.cpu_times()[:2]) if self._broker else 0.0
        return machine, mine, broker

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._c0 = self._busy()

    def stop(self, events: int) -> dict[str, float]:
        wall = time.perf_counter() - self._t0
        machine, mine, broker = (b - a for a, b in zip(self._c0, self._busy(), strict=True))
        per = 1e6 / max(events, 1)
        return {
            "wall_s": wall,
            "cores_busy": machine / wall,
            "us_per_event_total": machine * per,
            "us_per_event_client": mine * per,
            "us_per_event_broker": broker * per,
            "us_per_event_db_and_rest": (machine - mine - broker) * per,
        }
