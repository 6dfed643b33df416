"""Write overhead in Django: the reference transaction written with the ORM, with and without
``outboxkit.contrib.django.outbox.put`` (with the COMMIT, the default on psycopg 3, and an
INSERT per put, ``WRITE_WITH_COMMIT: False``), interleaved per transaction in a fresh random
order each round, with an A/A control. Prints medians and ratios; writes JSON.

    python bench/django_write.py --dsn postgresql://postgres@127.0.0.1/postgres [--rounds 3000]

The reference transaction (issue 5), as ORM calls: create an order, create 3 order lines
(one ``bulk_create`` would be one statement: the reference has three), take 3 stock rows
with ``F()`` updates, commit; one connection (a scratch database of its own).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outboxkit import Event
from outboxkit.backends.postgres.migrate import migrate

SCHEMA = """
CREATE TABLE bench_orders (id bigserial PRIMARY KEY, customer text NOT NULL,
                           total_cents int NOT NULL, created_at timestamptz DEFAULT now());
CREATE TABLE bench_order_lines (id bigserial PRIMARY KEY, order_id bigint NOT NULL,
                                sku int NOT NULL, qty int NOT NULL);
CREATE TABLE bench_stock (sku int PRIMARY KEY, qty int NOT NULL);
INSERT INTO bench_stock SELECT g, 1000000000 FROM generate_series(1, 1000) g;
"""
PAYLOAD = {"order": 1, "customer": "customer-1", "lines": [1, 2, 3], "total_cents": 4200}


def _django(dsn: str) -> None:
    import django
    from django.conf import settings

    p = conninfo_to_dict(dsn)
    settings.configure(
        INSTALLED_APPS=["django.contrib.contenttypes", "outboxkit.contrib.django"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                **{
                    k.upper(): str(p.get(v, ""))
                    for k, v in [
                        ("name", "dbname"),
                        ("user", "user"),
                        ("password", "password"),
                        ("host", "host"),
                        ("port", "port"),
                    ]
                },
            }
        },
        USE_TZ=True,
    )
    django.setup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True, help="an admin DSN; a scratch database is made")
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/django_write.json"))
    args = parser.parse_args()
    name = f"bench_django_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
        migrate(dsn)
        result = _run(dsn, args.rounds)
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for variant, v in result["variants"].items():
        print(f"{variant:28} median {v['median_us']:8.0f} us   {v['vs_plain_pct']:+6.1f} %")


def _run(dsn: str, rounds: int) -> dict[str, Any]:
    _django(dsn)
    from django.db import connection, models, transaction
    from django.db.models import F

    from outboxkit.contrib.django import outbox

    class BenchOrder(models.Model):
        customer = models.TextField()
        total_cents = models.IntegerField()

        class Meta:
            app_label, db_table, managed = "outboxkit", "bench_orders", False

    class BenchLine(models.Model):
        order_id = models.BigIntegerField()
        sku = models.IntegerField()
        qty = models.IntegerField()

        class Meta:
            app_label, db_table, managed = "outboxkit", "bench_order_lines", False

    class BenchStock(models.Model):
        sku = models.IntegerField(primary_key=True)
        qty = models.IntegerField()

        class Meta:
            app_label, db_table, managed = "outboxkit", "bench_stock", False

    rng = random.Random(7)

    def business(put: bool) -> None:
        customer, total = f"customer-{rng.randrange(1000)}", rng.randrange(100, 100000)
        skus = rng.sample(range(1, 1001), 3)
        with transaction.atomic():
            order = BenchOrder.objects.create(customer=customer, total_cents=total)
            for sku in skus:
                BenchLine.objects.create(order_id=order.id, sku=sku, qty=1)
            for sku in sorted(skus):
                BenchStock.objects.filter(sku=sku).update(qty=F("qty") - 1)
            if put:
                outbox.put(
                    Event(
                        topic="orders",
                        event_type="order.placed",
                        key=str(order.id),
                        payload=PAYLOAD,
                    )
                )

    def with_setting(value: bool) -> Callable[[], None]:
        def run() -> None:
            # WRITE_WITH_COMMIT, switched without override_settings (which rebuilds the
            # outbox each time): the flag the setting sets.
            outbox._with_commit = value
            business(True)

        return run

    def plain() -> None:
        business(False)

    variants: dict[str, Callable[[], None]] = {
        "plain": plain,
        "plain (A/A control)": plain,
        "put with the COMMIT": with_setting(True),
        "put, INSERT at put": with_setting(False),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(rounds + 100):
        order = list(variants)
        rng.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            variants[k]()
            if i >= 100:  # warm-up
                times[k].append(time.perf_counter() - t0)
        if i % 500 == 0:
            with connection.cursor() as cur:
                cur.execute("DELETE FROM outbox")
    base = statistics.median(times["plain"])
    return {
        "rounds": rounds,
        "server": connection.pg_version,
        "variants": {
            k: {
                "median_us": statistics.median(v) * 1e6,
                "vs_plain_pct": (statistics.median(v) / base - 1) * 100,
            }
            for k, v in times.items()
        },
    }


if __name__ == "__main__":
    main()
