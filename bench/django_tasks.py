"""Django's Tasks framework, two database backends side by side on one PostgreSQL: the same
Django project (tests/support/django_tasks_pair) with django-tasks-db's ``DatabaseBackend``
and with outboxkit's ``OutboxkitBackend``, one ``manage.py`` worker process each.

Per contender and round: TASKS no-op ``@task`` calls enqueued by ``task.enqueue()`` in one
``transaction.atomic()`` block (timed: the enqueue rate), then its worker started
(``manage.py db_worker --no-startup-delay`` / ``manage.py outboxkit_worker``) and timed
until every task is finished (a count polled every 250 ms: timed to a quarter second, light
on the server), then stopped. Two figures: the wall time from the worker's start (Django's
start-up included) and the run rate from the tasks' own first start to last finish as the
backend recorded them. The contenders run in a fresh
order each round; the tables are emptied before each.

    python bench/django_tasks.py --dsn postgresql://postgres@127.0.0.1/postgres [--tasks 10000]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from _common import save, server_facts

ROOT = Path(__file__).resolve().parents[1]
# This file is named django_tasks.py: off the path, so `import django_tasks` (the backport,
# which django-tasks-db imports on Django 5.2) finds the package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
SETTINGS = "tests.support.django_tasks_pair.settings"
# name: (the worker's manage.py arguments, the finished count, the run's start and end, env)
_DB = (
    "SELECT count(*) FROM django_tasks_database_dbtaskresult WHERE status = 'SUCCESSFUL'",
    "SELECT min(started_at), max(finished_at) FROM django_tasks_database_dbtaskresult",
)
_OURS = (
    "SELECT count(*) FROM outboxkit_tasks WHERE status = 2",
    "SELECT min(started_at), max(finished_at) FROM outboxkit_tasks",
)
_DB_WORKER = ["db_worker", "--backend", "db", "--no-startup-delay", "--interval", "0.1"]
_OUR_WORKER = ["outboxkit_worker", "--retention", "keep", "--poll-interval", "0.1"]
CONTENDERS: dict[str, tuple[list[str], str, str, dict[str, str]]] = {
    # Django's default CONN_MAX_AGE = 0: db_worker's close_old_connections() (twice a task,
    # "to emulate Django's request behaviour") then opens a new connection for every task.
    "django-tasks-db db_worker": (_DB_WORKER, *_DB, {}),
    "django-tasks-db db_worker, CONN_MAX_AGE=None": (
        _DB_WORKER, *_DB, {"PAIR_CONN_MAX_AGE": "none"}
    ),
    "outboxkit outboxkit_worker": (_OUR_WORKER, *_OURS, {}),
    "outboxkit outboxkit_worker --concurrency 1": (
        [*_OUR_WORKER, "--concurrency", "1"], *_OURS, {}
    ),
    # No-op tasks settle one round trip each at --batch-size 1 (the profile: ~30 % of the
    # worker in the settle, 4 % in the task); settled 100 together (a batch <= --concurrency):
    "outboxkit outboxkit_worker --concurrency 100 --batch-size 100": (
        [*_OUR_WORKER, "--concurrency", "100", "--batch-size", "100"], *_OURS, {}
    ),
}  # fmt: skip


def _env(dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return env | {
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "OUTBOXKIT_TEST_DJANGO_DSN": dsn,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }


def _enqueue(name: str, n: int) -> float:
    """Seconds to enqueue ``n`` no-op tasks in one atomic() block."""
    from django.db import connection, transaction
    from tests.support.django_tasks_pair import jobs

    task = jobs.noop_db if name.startswith("django-tasks-db") else jobs.noop
    with connection.cursor() as cur:
        cur.execute("TRUNCATE outboxkit_tasks, django_tasks_database_dbtaskresult")
    started = time.perf_counter()
    with transaction.atomic():
        for _ in range(n):
            task.enqueue()
    return time.perf_counter() - started


def _run(dsn: str, name: str, n: int) -> dict[str, Any]:
    argv, finished, span, extra = CONTENDERS[name]
    enqueue = _enqueue(name, n)
    # The workers log each task: a file, never a pipe left unread.
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        worker = subprocess.Popen(
            [sys.executable, "-m", "django", *argv], env=_env(dsn) | extra, cwd=ROOT,
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while True:
                    row = conn.execute(finished).fetchone()
                    if row is not None and row[0] >= n:
                        break
                    if worker.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(f"{name} exited: {log.read().decode()[-2000:]}")
                    time.sleep(0.25)
                wall = time.perf_counter() - started
                first, last = conn.execute(span).fetchone() or (None, None)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    run = (last - first).total_seconds()
    return {
        "enqueue_s": round(enqueue, 3),
        "enqueue_per_s": round(n / enqueue),
        "wall_s": round(wall, 3),
        "wall_per_s": round(n / wall),
        "run_s": round(run, 3),
        "run_per_s": round(n / run),
        "load_1min": round(os.getloadavg()[0], 1),  # the machine is shared: say how busy
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", required=True, help="an admin DSN; a scratch database is made")
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 000 tasks, one round")
    args = parser.parse_args()
    n, rounds = (1000, 1) if args.quick else (args.tasks, args.rounds)
    name = f"bench_django_tasks_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=name)
    os.environ |= {"DJANGO_SETTINGS_MODULE": SETTINGS, "OUTBOXKIT_TEST_DJANGO_DSN": dsn}
    sys.path.insert(0, str(ROOT))
    try:
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "-v0"], env=_env(dsn), cwd=ROOT,
            check=True,
        )  # fmt: skip
        import django
        from django.db import connections

        django.setup()
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for r in range(rounds):
            order = random.sample(list(CONTENDERS), len(CONTENDERS))
            for contender in order:
                runs[contender].append(_run(dsn, contender, n))
                print(f"round {r + 1} {contender}: {runs[contender][-1]}", flush=True)
        connections.close_all()
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    medians = {c: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for c, rs in runs.items()}
    print(f"\n{n} no-op tasks, {rounds} round(s), medians:")
    print(f"{'worker':45} {'enqueue/s':>10} {'wall s':>8} {'wall/s':>8} {'run/s':>8}")
    for c, m in medians.items():
        print(f"{c:45} {m['enqueue_per_s']:>10.0f} {m['wall_s']:>8.2f} {m['wall_per_s']:>8.0f}"
              f" {m['run_per_s']:>8.0f}")  # fmt: skip
    import django as dj
    import django_tasks_db

    save(
        "django_tasks",
        {
            "tasks": n,
            "rounds": rounds,
            "django": dj.get_version(),
            "django_tasks_db": django_tasks_db.__version__,
            "command": " ".join(["python", "bench/django_tasks.py", *sys.argv[1:]]),
            "machine": server_facts(args.dsn),
            "medians": medians,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
