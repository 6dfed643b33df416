"""What each of the claim's columns costs the relay's client to decode, in one process.

The claim's RETURNING columns as a SELECT of 1 000 rows written by ``put_many`` (the same
decoding: a binary cursor with the relay's loaders), variants interleaved in a fresh random
order per round, process CPU time per row, medians. Variants drop or recast one column each,
so the differences are what a narrower claim would save on the client.

    python bench/micro_claim_decode.py --dsn postgresql://postgres@127.0.0.1/bench [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import orjson
import psycopg
from _common import save
from psycopg.types.json import set_json_loads

from outboxkit import Event, OutboundMessage, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import SESSION_UTC
from outboxkit.backends.postgres.queue_pg import JsonLoader, UuidBinaryLoader

TABLE = "bench_claim_decode"
# The claim's RETURNING (backends/postgres/postgres.py CLAIM_RETURNING) with the headers as stored.
JSONB = (
    "id, event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers,"
    " created_at, attempts, coalesce(occurred_at, created_at), schema_version, NULL::text"
)
VARIANTS = {
    "headers jsonb (before)": JSONB,
    "headers::json, orjson loader (now)": JSONB.replace(" headers,", " headers::json,"),
    "... + OutboundMessage per row": JSONB.replace(" headers,", " headers::json,"),
    "no headers column (NULL: the bound)": JSONB.replace(" headers,", " NULL::json,"),
    "no created_at": JSONB.replace(" headers,", " headers::json,").replace(" created_at,", ""),
    "no schema_version": JSONB.replace(" headers,", " headers::json,").replace(
        ", schema_version", ""
    ),
    "the SQL floor's columns (id, event_id, topic, key, payload, attempts)": (
        "id, event_id, topic, key, payload, attempts"
    ),
    "id only": "id",
}


def fill(dsn: str, n: int) -> None:
    migrate(dsn, table=TABLE)
    events = [
        Event(
            topic="bench.orders",
            key=f"customer-{i % 1000:04d}",
            payload={"order": i, "lines": [{"sku": "A-1", "qty": 2}] * 3, "note": "x" * 100},
            event_type="order.placed",
            aggregate_type="order",
            aggregate_id=str(i),
            schema_version="1",
        )
        for i in range(n)
    ]
    with psycopg.connect(dsn) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
        Outbox(table=TABLE, notify=False).put_many(conn, events)


async def measure(dsn: str, n: int, rounds: int) -> dict[str, float]:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    set_json_loads(
        orjson.loads, conn
    )  # as the relay's connections (backends/postgres/_pg_session.py)
    conn.adapters.register_loader("uuid", UuidBinaryLoader)
    conn.adapters.register_loader("json", JsonLoader)
    await conn.execute(SESSION_UTC)
    cur = conn.cursor(binary=True)
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    names = list(VARIANTS)
    rng = random.Random(1)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            query = f"SELECT {VARIANTS[name]} FROM {TABLE} ORDER BY id LIMIT {n}"
            start = time.process_time_ns()
            await cur.execute(query)
            rows: list[Any] = await cur.fetchall()
            if name.startswith("..."):
                [OutboundMessage(*r[1:-1]) for r in rows]
            times[name].append((time.process_time_ns() - start) / 1000 / len(rows))
    await conn.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--name", default="micro_claim_decode")
    args = ap.parse_args()
    fill(args.dsn, args.rows)
    result = asyncio.run(measure(args.dsn, args.rows, args.rounds))
    for name, us in result.items():
        print(f"{us:7.2f} µs/row  {name}")
    save(args.name, {"rows": args.rows, "rounds": args.rounds, "us_per_row": result})


if __name__ == "__main__":
    main()
