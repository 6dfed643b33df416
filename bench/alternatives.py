"""outboxkit against what a user would pick instead, same machine, same run, same events.

* pgqueuer as the outbox: the events are jobs, a handler produces each to Kafka
  and returns only after the broker's ack (so the job is done only when delivered);
  run at a few batch sizes and with one or five queue managers, the best is kept.
* faststream-outbox (its ``OutboxBroker`` subscriber, tuned: 32 workers, fetches of
  500, deletes flushed 100 at a time), two ways: as its README relays to Kafka
  (FastStream's own Kafka publisher stacked on the subscriber), and a handler producing each
  row through confluent-kafka and returning after the ack; the better of the two per round
  is its best.
* a hand-written polling relay (``naive_relay.py``), at a few batch sizes.
* outboxkit's relay on the same events, for the ratio: in-process (``Relay`` in a bare
  script) and as users run it, ``outboxkit relay`` (the CLI process, its defaults).

Every contender runs in a process of its own and is timed from the broker's side (a
consumer in this process: first message on its topic to the last, bench/_measure.py's
window; their own clocks are kept as ``own_clock_rate``), and the contenders run interleaved,
round by round in a rotating order, so a machine whose load changes hits all of them alike;
the ratios are per round, then the median.

pgqueuer and faststream-outbox are installed only into the benchmark environment (``pip install
'.[bench]'``), never as a dependency of outboxkit.

    python bench/alternatives.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import naive_relay
import psycopg
from _common import TOPIC, ensure_topic, fmt_rate, kafka_broker, prepare, save, server_facts
from _measure import OwnCpu, Watch, run_child
from confluent_kafka import KafkaError, Producer

from outboxkit.publishers.kafka import _DEFAULTS as KAFKA_DEFAULTS

PGQ_TOPIC = "bench.pgqueuer"
NAIVE_TOPIC = "bench.naive"


def _asyncpg_args(dsn: str) -> dict[str, Any]:
    """asyncpg takes URLs only; the runner hands out libpq key=value strings too."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    names = {
        "host": "host",
        "port": "port",
        "user": "user",
        "password": "password",
        "dbname": "database",
    }
    return {names[k]: v for k, v in params.items() if k in names and v is not None}


class AsyncProducer:
    """confluent-kafka with a poll thread; ``send`` resolves on the delivery report."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = Producer({**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.producer.poll(0.05)

    async def send(
        self, topic: str, value: bytes, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[KafkaError | None] = loop.create_future()

        def done(err: KafkaError | None, _msg: Any) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(err))

        while True:
            try:
                self.producer.produce(
                    topic, value=value, key=key, headers=headers, on_delivery=done
                )
                break
            except BufferError:
                await asyncio.sleep(0.005)
        err = await fut
        if err is not None:
            raise RuntimeError(f"kafka: {err}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.producer.flush(10)


async def _pgq_load(dsn: str, n: int) -> None:
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(**_asyncpg_args(dsn))
    try:
        queries = Queries(AsyncpgDriver(conn))
        with contextlib.suppress(Exception):  # a previous run's objects
            await queries.uninstall()
        await queries.install()
        rows = await conn.fetch(
            "SELECT event_id::text, key, payload FROM bench_seed ORDER BY event_id LIMIT $1", n
        )
        for start in range(0, len(rows), 5000):
            chunk = rows[start : start + 5000]
            await queries.enqueue(
                ["publish"] * len(chunk),
                [bytes(r["payload"]) for r in chunk],
                [0] * len(chunk),
                headers=[{"event_id": r["event_id"], "key": r["key"]} for r in chunk],
            )
        await conn.execute("VACUUM ANALYZE pgqueuer")
        # As before every contender's run (_common.reload): no dirty pages from the load
        # are flushed during the timed drain, and every contender starts after a checkpoint.
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def _pgq_drain(
    dsn: str, bootstrap: str, n: int, batch_size: int, managers: int = 1
) -> dict[str, Any]:
    """pgqueuer's drain: ``managers`` QueueManagers in this process, each on its own asyncpg
    connection (one as ``pgq run`` starts; several as its own drain benchmark,
    ``tools/benchmark.py --dequeue 5``, runs), sharing one producer."""
    from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    producer = AsyncProducer(bootstrap)
    conns = [await asyncpg.connect(**_asyncpg_args(dsn)) for _ in range(managers)]
    done = 0

    async def publish(job: Job) -> None:
        nonlocal done
        headers = job.headers or {}
        key = headers.get("key")
        await producer.send(
            PGQ_TOPIC,
            job.payload or b"",
            str(key).encode() if key else None,
            [("idempotency-key", str(headers.get("event_id", "")).encode())],
        )
        done += 1

    qms = [QueueManager(Queries(AsyncpgDriver(conn))) for conn in conns]
    for qm in qms:
        qm.entrypoint("publish")(publish)
    t0 = time.perf_counter()
    try:
        await asyncio.gather(
            *(
                qm.run(
                    batch_size=batch_size,
                    mode=QueueExecutionMode.drain,
                    dequeue_timeout=__import__("datetime").timedelta(seconds=0.5),
                )
                for qm in qms
            )
        )
        elapsed = time.perf_counter() - t0
    finally:
        producer.close()
        for conn in conns:
            await conn.close()
    return {
        "events": done,
        "seconds": elapsed,
        "rate": done / elapsed,
        "batch_size": batch_size,
        "managers": managers,
    }


def pgqueuer_run(
    dsn: str, bootstrap: str, n: int, batch_size: int, managers: int = 1
) -> dict[str, Any]:
    asyncio.run(_pgq_load(dsn, n))
    result = asyncio.run(_pgq_drain(dsn, bootstrap, n, batch_size, managers))
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
    result["left_in_queue"] = left[0] if left else None
    return result


# -- faststream-outbox: its subscriber relays each row with a handler that produces it ------

FS_TOPIC = "bench.faststream"
FS_TABLE = "fs_outbox"
FS_QUEUE = "publish"
FS_WORKERS = 32  # tuned (issue 14): 32 worker loops, fetches of 500 rows
FS_FETCH = 500
FS_FLUSH = 100  # and its deletes batched 100 at a time (default 1: a commit per row)
#: Its subscriber's options, tuned as above, in both ways to Kafka.
FS_SUBSCRIBER: dict[str, Any] = {
    "max_workers": FS_WORKERS,
    "fetch_batch_size": FS_FETCH,
    "terminal_flush_batch_size": FS_FLUSH,
    "min_fetch_interval": 0.01,
    "max_fetch_interval": 0.1,
}


def _sqlalchemy_url(dsn: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    from sqlalchemy.engine import URL

    return URL.create(
        "postgresql+asyncpg",
        username=str(params.get("user", "postgres")),
        password=str(params["password"]) if params.get("password") else None,
        host=str(params.get("host", "127.0.0.1")),
        port=int(params.get("port", 5432)),
        database=str(params.get("dbname", "postgres")),
    ).render_as_string(hide_password=False)


def _fs_load(dsn: str, n: int) -> None:
    """faststream-outbox's own table (``make_outbox_table``), filled from the same seed rows."""
    import sqlalchemy as sa
    from faststream_outbox import make_outbox_table

    metadata = sa.MetaData()
    make_outbox_table(metadata, table_name=FS_TABLE)
    engine = sa.create_engine(_sqlalchemy_url(dsn).replace("+asyncpg", "+psycopg"))
    try:
        metadata.drop_all(engine)
        metadata.create_all(engine)
    finally:
        engine.dispose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # As its publish() writes them: the payload as bytes, headers as a JSON object.
        conn.execute(
            f"INSERT INTO {FS_TABLE} (queue, payload, headers)"
            " SELECT %s, payload, jsonb_build_object('key', key, 'event_id', event_id::text)"
            " FROM bench_seed LIMIT %s",
            (FS_QUEUE, n),
        )
        conn.execute(f"VACUUM ANALYZE {FS_TABLE}")
        conn.execute("CHECKPOINT")


def _fs_broker(dsn: str) -> tuple[Any, Any, Any]:
    """faststream-outbox's table, its async engine and its ``OutboxBroker``."""
    import sqlalchemy as sa
    from faststream_outbox import OutboxBroker, make_outbox_table
    from sqlalchemy.ext.asyncio import create_async_engine

    table = make_outbox_table(sa.MetaData(), table_name=FS_TABLE)
    # Room for its 32 workers' settles and the fetch loop.
    engine = create_async_engine(_sqlalchemy_url(dsn), pool_size=FS_WORKERS + 4, max_overflow=8)
    # No per-message log lines (its default logs every message at INFO).
    return table, engine, OutboxBroker(engine, outbox_table=table, logger=None)


async def _fs_drain(dsn: str, bootstrap: str, n: int) -> dict[str, Any]:
    from faststream_outbox.annotations import OutboxMessage

    _table, engine, broker = _fs_broker(dsn)
    producer = AsyncProducer(bootstrap)
    done = 0

    @broker.subscriber(FS_QUEUE, **FS_SUBSCRIBER)
    async def publish(msg: OutboxMessage) -> None:
        nonlocal done
        headers = msg.headers or {}
        key = headers.get("key")
        await producer.send(
            FS_TOPIC,
            msg.body,
            str(key).encode() if key else None,
            [("idempotency-key", str(headers.get("event_id", "")).encode())],
        )
        done += 1

    t0 = time.perf_counter()
    await broker.start()
    try:
        while done < n:  # noqa: ASYNC110 (polling is the probe)
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - t0
    finally:
        await broker.stop()
        producer.close()
        await engine.dispose()
    return {
        "events": done,
        "seconds": elapsed,
        "rate": done / elapsed,
        "max_workers": FS_WORKERS,
        "fetch_batch_size": FS_FETCH,
        "terminal_flush_batch_size": FS_FLUSH,
    }


async def _fs_drain_publisher(dsn: str, bootstrap: str, n: int, client: str) -> dict[str, Any]:
    """As faststream-outbox's README relays to Kafka: FastStream's own Kafka publisher stacked
    on the ``OutboxBroker`` subscriber (``@publisher`` over ``@subscriber``); the handler returns
    the message, FastStream publishes it and awaits the broker's ack, then the row is deleted.

    ``client``: ``"aiokafka"`` (``faststream.kafka``, the README's) or ``"confluent"``
    (``faststream.confluent``: confluent-kafka, the client outboxkit's relay uses).
    Key and idempotency header forwarded, as the relay forwards them.
    """
    import sqlalchemy as sa
    from faststream_outbox.annotations import OutboxMessage

    table, engine, broker = _fs_broker(dsn)
    if client == "aiokafka":
        from faststream.kafka import KafkaBroker, KafkaResponse
    else:
        from faststream.confluent import KafkaBroker, KafkaResponse  # type: ignore[assignment]
    kafka = KafkaBroker(bootstrap, logger=None)
    to_kafka = kafka.publisher(FS_TOPIC)

    @to_kafka
    @broker.subscriber(FS_QUEUE, **FS_SUBSCRIBER)
    async def relay(msg: OutboxMessage) -> KafkaResponse:
        headers = msg.headers or {}
        key = headers.get("key")
        return KafkaResponse(
            msg.body,
            key=str(key).encode() if key else None,
            headers={"idempotency-key": str(headers.get("event_id", ""))},
        )

    # Done when its table is empty: a row is deleted only after its publish was acked (the
    # deletes flushed 100 at a time, the last ones when the fetch finds nothing). A broker
    # middleware would not see these publishes: they run under the outbox broker's.
    left = sa.select(sa.func.count()).select_from(table)
    await kafka.connect()
    t0 = time.perf_counter()
    await broker.start()
    try:
        while True:
            await asyncio.sleep(0.02)
            async with engine.connect() as conn:
                if not (await conn.execute(left)).scalar():
                    break
        elapsed = time.perf_counter() - t0
    finally:
        await broker.stop()
        await kafka.stop()
        await engine.dispose()
    return {
        "events": n,
        "seconds": elapsed,
        "rate": n / elapsed,
        "max_workers": FS_WORKERS,
        "fetch_batch_size": FS_FETCH,
        "terminal_flush_batch_size": FS_FLUSH,
        "publisher": f"FastStream's KafkaBroker.publisher ({client}), as its README relays",
    }


def faststream_run(dsn: str, bootstrap: str, n: int) -> dict[str, Any]:
    """The hand-made producer awaited per message (the round-3 contender, kept to compare)."""
    _fs_load(dsn, n)
    result = asyncio.run(_fs_drain(dsn, bootstrap, n))
    return _fs_left(dsn, result)


def faststream_publisher_run(dsn: str, bootstrap: str, n: int, client: str) -> dict[str, Any]:
    """faststream-outbox as its users run it: FastStream's own Kafka publisher."""
    _fs_load(dsn, n)
    result = asyncio.run(_fs_drain_publisher(dsn, bootstrap, n, client))
    return _fs_left(dsn, result)


def _fs_left(dsn: str, result: dict[str, Any]) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(f"SELECT count(*) FROM {FS_TABLE}").fetchone()
    result["left_in_table"] = left[0] if left else None
    return result


def in_child(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in a fresh process: the watching consumer in this one must not share
    its interpreter lock with the contender (outboxkit's relays run as child processes too).
    """
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result: dict[str, Any] = pool.apply(fn, args)
    return result


def watched(
    bootstrap: str, topic: str, n: int, fn: Callable[..., Any], *args: Any
) -> dict[str, Any]:
    """``fn(*args)`` in a child process, a consumer here timing its messages on ``topic`` from
    the broker's side (first to last, as bench/_measure.py times outboxkit's relays)."""
    watch = Watch(bootstrap, n, topic=topic)
    watch.start()
    result = in_child(fn, *args)
    if not watch.wait(60):
        raise RuntimeError(f"{topic}: {watch.count} of {n} messages seen")
    result["own_clock_rate"] = result["rate"]
    result["rate"] = (n - 1) / (watch.last - watch.first)
    return result


def pgq_name(batch: int, managers: int) -> str:
    return f"pgqueuer_{batch}" if managers == 1 else f"pgqueuer_{batch}x{managers}"


def contenders(
    dsn: str,
    bootstrap: str,
    n: int,
    pgq: list[tuple[int, int]],
    naive_batches: list[int],
    faststream: list[str],
) -> dict[str, Callable[[], dict[str, Any]]]:
    own = OwnCpu(bootstrap, dsn)
    out: dict[str, Callable[[], dict[str, Any]]] = {
        "outboxkit_cli": lambda: run_child("cli", dsn, bootstrap, n, n, own),
        "outboxkit_inproc": lambda: run_child("inproc", dsn, bootstrap, n, n, own),
    }
    for way in faststream:
        if way == "producer":
            run: Callable[..., dict[str, Any]] = functools.partial(
                faststream_run, dsn, bootstrap, n
            )
        else:
            client = way.removeprefix("publisher-")
            run = functools.partial(faststream_publisher_run, dsn, bootstrap, n, client)
        out[f"faststream_{way}"] = functools.partial(watched, bootstrap, FS_TOPIC, n, run)
    for b, m in pgq:
        out[pgq_name(b, m)] = functools.partial(
            watched, bootstrap, PGQ_TOPIC, n, pgqueuer_run, dsn, bootstrap, n, b, m
        )
    for b in naive_batches:
        out[f"naive_{b}"] = functools.partial(
            watched, bootstrap, NAIVE_TOPIC, n, naive_relay.bench, dsn, bootstrap, NAIVE_TOPIC, n, b
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, default=30_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--quick", action="store_true", help="20 000 events, one round")
    ap.add_argument(
        "--pgq",
        default="300,1000,1000x5",
        help="pgqueuer configurations, BATCH or BATCHxMANAGERS (10 is its default batch; one"
        " manager is how `pgq run` starts, five how its own drain benchmark runs; 1000 was its"
        " best batch in every earlier run)",
    )
    ap.add_argument(
        "--faststream",
        default="publisher-aiokafka,producer",
        help="faststream-outbox's ways to Kafka: 'publisher-aiokafka' (FastStream's own Kafka"
        " publisher stacked on the subscriber, as its README relays), 'publisher-confluent'"
        " (the same through faststream.confluent), 'producer' (a handler awaiting a"
        " confluent-kafka producer, the round-3 contender)",
    )
    args = ap.parse_args()
    n = 20_000 if args.quick else args.events
    rounds = 1 if args.quick else args.rounds
    pgq = [(int(b), int(m or 1)) for b, _x, m in (c.partition("x") for c in args.pgq.split(","))]
    faststream = [w for w in args.faststream.split(",") if w]
    naive_batches = [1000]

    payload_bytes = prepare(args.dsn, n)
    results: dict[str, Any] = {
        "events": n,
        "payload_bytes": payload_bytes,
        "machine": server_facts(args.dsn),
        "method": "every contender timed from the broker's side (first message to last);"
        " contenders interleaved round by round in a rotating order",
    }
    runs: dict[str, list[dict[str, Any]]] = {}
    with kafka_broker(args.kafka) as bootstrap:
        for topic in (TOPIC, PGQ_TOPIC, NAIVE_TOPIC, FS_TOPIC):
            ensure_topic(bootstrap, topic)
        todo = contenders(args.dsn, bootstrap, n, pgq, naive_batches, faststream)
        names = list(todo)
        for i in range(rounds):
            k = i % len(names)
            order = names[k:] + names[:k]
            for name in order if i % 2 == 0 else order[::-1]:
                r = todo[name]()
                runs.setdefault(name, []).append(r)
                print(f"round {i + 1} {name:20s} {fmt_rate(r['rate']):>12}", flush=True)
    results["runs"] = runs
    rate = {name: [r["rate"] for r in rs] for name, rs in runs.items()}
    # Each peer at its best in each round: the best of its configurations that round.
    pgq_best = [max(rate[pgq_name(b, m)][i] for b, m in pgq) for i in range(rounds)]
    fs_best = [max(rate[f"faststream_{w}"][i] for w in faststream) for i in range(rounds)]
    results["summary"] = {name: statistics.median(v) for name, v in rate.items()}
    ratios: dict[str, Any] = {}
    for ours in ("outboxkit_cli", "outboxkit_inproc"):
        for other, theirs in (("pgqueuer_best", pgq_best), ("faststream_best", fs_best)):
            per_round = [a / b for a, b in zip(rate[ours], theirs, strict=True)]
            ratios[f"{ours}_vs_{other}"] = {
                "per_round": [round(x, 2) for x in per_round],
                "median": round(statistics.median(per_round), 2),
            }
    results["ratios"] = ratios
    # The shape bench/plots.py reads (medians over the rounds).
    summary = results["summary"]
    results["pgqueuer"] = [
        {"batch_size": b, "managers": m, "rate": summary[pgq_name(b, m)]} for b, m in pgq
    ]
    results["naive"] = [{"batch_size": b, "rate": summary[f"naive_{b}"]} for b in naive_batches]
    print(f"\nalternatives, {n} events to Kafka, {rounds} interleaved rounds (median events/s)")
    for name, v in results["summary"].items():
        print(f"  {name:<24} {fmt_rate(v):>12}")
    for key, v in ratios.items():
        print(f"  {key}: per round {v['per_round']}, median {v['median']}")
    print("  targets with the CLI relay: >= 5x pgqueuer, >= 10x faststream-outbox")
    save("alternatives", results)


if __name__ == "__main__":
    main()
