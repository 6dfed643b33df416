"""What a request pays to dispatch a Celery task: after the COMMIT (``on_commit``) or in it.

Each round is one transaction inserting an order, dispatched four ways in a fresh random
order every round on one connection (the figures are medians of the per-round wall time):

* ``no dispatch``: the INSERT and COMMIT alone (the reference);
* ``on_commit -> RabbitMQ`` / ``on_commit -> Redis``: ``app.send_task`` after the COMMIT,
  what ``transaction.on_commit(lambda: task.delay(...))`` does (Celery's producer pool,
  connection kept); the dual write the tests show losing tasks;
* ``outboxkit send_task``: ``outboxkit.contrib.celery.send_task`` inside the transaction
  (an INSERT on the same connection; the relay publishes later).

Needs RabbitMQ on 127.0.0.1:5672 (guest) and Debian's redis-server (a private one is
started on a free port); the queues are deleted after.

    python bench/celery_dispatch.py --dsn postgresql://postgres@127.0.0.1/bench --rounds 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable

import psycopg
from _common import save
from celery import Celery

from outboxkit import Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.contrib.celery import send_task
from outboxkit.testing import free_port, port_accepts

AMQP = "amqp://guest:guest@127.0.0.1:5672//"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    migrate(args.dsn, table="celery_bench_outbox")
    outbox = Outbox("celery_bench_outbox")
    queue = f"okit_bench_{uuid.uuid4().hex[:8]}"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        redis = subprocess.Popen([*argv, "--dir", tmp], stdout=subprocess.DEVNULL)
        try:
            while not port_accepts(port, timeout=0.2):
                time.sleep(0.05)
            figures = _run(args.dsn, args.rounds, outbox, queue, f"redis://127.0.0.1:{port}/0")
        finally:
            redis.kill()
            redis.wait()
    save("celery_dispatch", {"rounds": args.rounds, "median_us": figures})
    reference = figures["no dispatch"]
    for name, value in figures.items():
        print(f"{name:28} {value:8.0f} us  (+{value - reference:6.0f} us over the INSERT alone)")


def _run(dsn: str, rounds: int, outbox: Outbox, queue: str, redis_url: str) -> dict[str, float]:
    rabbit = Celery("bench", broker=AMQP, set_as_current=False)
    redis = Celery("bench", broker=redis_url, set_as_current=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS celery_bench_orders (id bigserial, total int)")
        conn.execute("TRUNCATE celery_bench_orders, celery_bench_outbox")

        def order() -> None:
            conn.execute("INSERT INTO celery_bench_orders (total) VALUES (42)")

        def plain() -> None:
            with conn.transaction():
                order()

        def on_commit(app: Celery) -> Callable[[], None]:
            def run() -> None:
                with conn.transaction():
                    order()
                app.send_task("proj.tasks.charge", (42,), queue=queue)

            return run

        def in_transaction() -> None:
            with conn.transaction():
                order()
                send_task(conn, "proj.tasks.charge", (42,), queue=queue, outbox=outbox)

        variants: dict[str, Callable[[], None]] = {
            "no dispatch": plain,
            "on_commit -> RabbitMQ": on_commit(rabbit),
            "on_commit -> Redis": on_commit(redis),
            "outboxkit send_task": in_transaction,
        }
        for run in variants.values():  # warm up: connections, prepared statements
            for _ in range(50):
                run()
        samples: dict[str, list[float]] = {name: [] for name in variants}
        rng = random.Random(37)
        names = list(variants)
        for _ in range(rounds):
            rng.shuffle(names)
            for name in names:
                start = time.perf_counter()
                variants[name]()
                samples[name].append((time.perf_counter() - start) * 1e6)
        conn.execute("DROP TABLE celery_bench_orders")
        conn.execute("DROP TABLE celery_bench_outbox")
    with rabbit.connection_for_write() as connection:
        connection.default_channel.queue_delete(queue)
        connection.default_channel.exchange_delete(queue)
    return {name: statistics.median(values) for name, values in samples.items()}


if __name__ == "__main__":
    main()
