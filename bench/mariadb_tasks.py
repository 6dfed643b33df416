"""Task mode on MariaDB beside PostgreSQL: no-op tasks drained by one in-process ``Worker``.

N no-op tasks loaded server-side (one ``INSERT … SELECT``), then drained by a Worker
(concurrency 100, one task per claim's slot: the default), first task started to last
finished (bench/tasks_throughput.py's ``drain``), MariaDB (the tests' private ``mariadbd``
with durable commits, bench/mariadb.py's ``DurableMariaDB``) and PostgreSQL (``--dsn``)
taking turns, ``--rounds`` each; medians, written to bench/results/``--name``.json.

    python bench/mariadb_tasks.py --dsn postgresql://postgres@127.0.0.1:5432/bench [--tasks 5000]
"""

from __future__ import annotations

import argparse
import os
import statistics

import pymysql
from _common import save, server_facts
from mariadb import DurableMariaDB  # bench/mariadb.py (the tests' private server, durable)
from tasks_throughput import drain, fill

from outboxkit.backends.mariadb.migrate import migrate as mariadb_migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.tasks import migrate_tasks


def fill_mariadb(url: str, count: int) -> None:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("TRUNCATE outboxkit_tasks")
            cur.execute(
                "INSERT INTO outboxkit_tasks (task_name, payload) SELECT 'noop', 'null'"
                f" FROM seq_1_to_{count}"
            )
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True, help="PostgreSQL, for the side-by-side figure")
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--name", default="mariadb_tasks")
    args = ap.parse_args()
    server = DurableMariaDB(1)
    server.start()
    try:
        admin = pymysql.connect(**server.connect_args(), autocommit=True)
        with admin.cursor() as cur:
            cur.execute("CREATE DATABASE bench_tasks")
        admin.close()
        url = server.url_for("bench_tasks")
        mariadb_migrate(url, kind="tasks", table="outboxkit_tasks")
        migrate_tasks(args.dsn)
        rates: dict[str, list[float]] = {"MariaDB": [], "PostgreSQL": []}
        for _ in range(args.rounds):
            rates["MariaDB"].append(drain(url, args.tasks, args.concurrency, 1, fill_mariadb))
            rates["PostgreSQL"].append(drain(args.dsn, args.tasks, args.concurrency, 1, fill))
        for name, values in rates.items():
            print(
                f"{name}: {statistics.median(values):,.0f} tasks/s (median of {args.rounds};"
                f" {', '.join(f'{v:,.0f}' for v in values)}), {args.tasks} no-op tasks,"
                f" concurrency {args.concurrency}"
            )
        medians = {name: statistics.median(values) for name, values in rates.items()}
        save(
            args.name,
            {
                "tasks": args.tasks,
                "concurrency": args.concurrency,
                "rounds": args.rounds,
                "tasks_per_s": rates,
                "median_tasks_per_s": medians,
                "mariadb_over_postgresql": medians["MariaDB"] / medians["PostgreSQL"],
                "load_average": os.getloadavg(),
                "server": server_facts(args.dsn),
            },
        )
    finally:
        server.close()


if __name__ == "__main__":
    main()
