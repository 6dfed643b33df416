"""What a fleet's idle databases cost: connections held, CPU, and the first event's latency.

One ``outboxkit relay --dsn-file`` process over ``--databases`` databases of a private
embedded PostgreSQL (fsync off), to a private nats-server (JetStream). Two modes, in turn
``--rounds`` times, each a fresh relay process:

* ``kept``: ``OUTBOXKIT_CLAIM_IDLE=0``, the claim connection held open (before parking);
* ``parked``: ``OUTBOXKIT_CLAIM_IDLE=--idle``, the claim connection closed after that long
  without work, the LISTEN session holding the wake-up gate and answering the polls.

``--worker``: the same for ``outboxkit worker --dsn-file`` (task mode, bench/tasks_app.py's
``idle_tasks``, no broker): ``kept`` holds a claim, a settle (its sweeps run every second) and
a LISTEN connection per database; ``parked`` the LISTEN session only, which answers the polls
and the sweeps. The first task's latency: enqueue (stamped just before its COMMIT) -> its
handler's start.

Round 2 runs them the other way round (noise of the machine hits both alike). Each mode:
start the relay, let every database sit idle for 2 x ``--idle`` + 5 s, then count the
connections by ``application_name`` (``pg_stat_activity``), and over ``--window`` seconds the
relay process's CPU and its PostgreSQL backends' CPU (``/proc/<pid>/stat``: the idle polls).
Then the first-event latency: one event committed in each of ``--samples`` databases idle
since the start (longer than ``--idle``), 0.5 s apart, stamped just before its COMMIT; a core
NATS subscription takes receive time - stamp (commit -> broker). The relay's default poll
(1 s) and settle timeout (``OUTBOXKIT_SETTLE_IDLE``, set to ``--idle`` too).

    python bench/fleet_idle.py [--worker] [--databases 20] [--idle 5] [--window 20] [--samples 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from _common import save, server_facts

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate, migrate_tasks
from outboxkit.testing import EmbeddedNats, EmbeddedPostgres

STAMP = "x-bench-commit-stamp"
ROOT = Path(__file__).resolve().parents[1]
MODES = ("kept", "parked")
COUNT = """
SELECT application_name, count(*) FROM pg_stat_activity
WHERE application_name LIKE 'outboxkit-%' GROUP BY 1 ORDER BY 1
"""
PIDS = "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"


def cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of process ``pid`` (None: gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backends_cpu(dsn: str, who: str) -> dict[int, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [int(r[0]) for r in conn.execute(PIDS, (f"outboxkit-{who}:%",)).fetchall()]
    return {pid: cpu for pid in pids if (cpu := cpu_seconds(pid)) is not None}


def commit_one(dsn: str, subject: str) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        event = Event(
            topic=subject, event_type="order.placed", payload={"order_id": 1},
            headers={STAMP: repr(time.time())},
        )  # fmt: skip
        Outbox().put(conn, event)


def enqueue_one(dsn: str) -> None:
    from tasks_app import idle_tasks

    with psycopg.connect(dsn) as conn, conn.transaction():
        idle_tasks.enqueue(conn, "stamp", {"stamp": time.time()})


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


async def measure(
    mode: str,
    args: argparse.Namespace,
    dsn_file: Path,
    dsns: list[str],
    admin: str,
    nats_url: str | None,
) -> dict[str, Any]:
    claim_idle = "0" if mode == "kept" else str(args.idle)
    who = "worker" if args.worker else "relay"
    starts = dsn_file.parent / f"starts-{mode}"
    starts.unlink(missing_ok=True)  # (a round's own)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench")]),
        "OUTBOXKIT_CLAIM_IDLE": claim_idle,
        "OUTBOXKIT_SETTLE_IDLE": str(args.idle),
        "OKB_STARTS": str(starts),
    }
    command = [sys.executable, "-m", "outboxkit", who, "--dsn-file", str(dsn_file)]
    if nats_url is None:
        command += ["--app", "tasks_app:idle_tasks", "--log-level", "warning"]
    else:
        command += ["--broker", nats_url, "--log-level", "warning"]
    relay = start(command, dsn_file.parent / f"{who}-{mode}.log", env)
    try:
        # (idle twice: a worker's settle connection, used by its sweeps until it parks,
        # closes OUTBOXKIT_SETTLE_IDLE after that)
        await asyncio.sleep(2 * args.idle + 5)
        with psycopg.connect(admin, autocommit=True) as conn:
            held = {name: int(n) for name, n in conn.execute(COUNT).fetchall()}
        relay_before, pg_before = cpu_seconds(relay.pid) or 0.0, backends_cpu(admin, who)
        await asyncio.sleep(args.window)
        relay_after, pg_after = cpu_seconds(relay.pid) or 0.0, backends_cpu(admin, who)
        pg_cpu = sum(pg_after[p] - pg_before[p] for p in pg_after if p in pg_before)
        if nats_url is None:
            latencies = await first_tasks(args, dsns, starts)
        else:
            latencies = await first_events(args, dsns, nats_url)
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(60)
    ms = sorted(x * 1000 for x in latencies)
    return {
        "mode": mode,
        "claim_idle": float(claim_idle),
        "connections": sum(held.values()),
        "by_application_name": held,
        "relay_cpu_ms_per_s": round((relay_after - relay_before) / args.window * 1000, 1),
        "pg_cpu_ms_per_s": round(pg_cpu / args.window * 1000, 1),
        "first_event_ms": [round(x, 1) for x in ms],
        "first_event_median_ms": round(statistics.median(ms), 1) if ms else None,
        "first_event_max_ms": round(ms[-1], 1) if ms else None,
        "lost": args.samples - len(ms),
    }


async def first_tasks(args: argparse.Namespace, dsns: list[str], starts: Path) -> list[float]:
    """One task enqueued in each of the first ``--samples`` databases: enqueue -> start."""
    for i in range(args.samples):
        await asyncio.to_thread(enqueue_one, dsns[i])
        await asyncio.sleep(0.5)
    deadline = time.monotonic() + 30
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = await asyncio.to_thread(_lines, starts)
        if len(lines) >= args.samples:
            break
        await asyncio.sleep(0.1)
    return [float(x) for x in lines]


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def first_events(args: argparse.Namespace, dsns: list[str], nats_url: str) -> list[float]:
    """One event committed in each of the first ``--samples`` databases: commit -> broker."""
    import nats

    latencies: list[float] = []

    async def received(msg: Any) -> None:
        stamp = (msg.headers or {}).get(STAMP)
        if stamp is not None:
            latencies.append(time.time() - float(stamp))

    nc = await nats.connect(nats_url)
    await nc.subscribe("idle.>", cb=received)
    for i in range(args.samples):
        await asyncio.to_thread(commit_one, dsns[i], f"idle.db{i}")
        await asyncio.sleep(0.5)
    deadline = time.monotonic() + 30
    while len(latencies) < args.samples and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    await nc.close()
    return latencies


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats
    from nats.js.api import StreamConfig

    work = Path(tempfile.mkdtemp(prefix="fleet-idle-"))
    server = EmbeddedPostgres(
        fsync=False, settings={"max_connections": str(4 * args.databases + 20)}
    )
    broker = None if args.worker else EmbeddedNats(work / "nats")
    server.start()
    if broker is not None:
        broker.start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE idle_template")
        if args.worker:
            migrate_tasks(server.dsn_for("idle_template"))
        else:
            migrate(server.dsn_for("idle_template"), table="outbox")
        dsns = []
        for i in range(args.databases):
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE idle_{i} TEMPLATE idle_template")
            dsns.append(server.dsn_for(f"idle_{i}"))
        if broker is not None:
            nc = await nats.connect(broker.url)
            await nc.jetstream().add_stream(StreamConfig(name="IDLE", subjects=["idle.>"]))
            await nc.close()
        dsn_file = work / "databases"
        dsn_file.write_text("".join(f"db{i} {dsn}\n" for i, dsn in enumerate(dsns)))
        runs = []
        for i in range(args.rounds):
            for mode in MODES if i % 2 == 0 else reversed(MODES):  # (either first in turn)
                url = broker.url if broker is not None else None
                result = {
                    "round": i + 1,
                    **await measure(mode, args, dsn_file, dsns, server.dsn, url),
                }
                print(result)
                runs.append(result)
        facts = server_facts(server.dsn)
    finally:
        if broker is not None:
            broker.close()
        server.close()
    summary = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("connections", "relay_cpu_ms_per_s", "pg_cpu_ms_per_s",
                        "first_event_median_ms", "first_event_max_ms", "lost")
        }  # fmt: skip
    return {"runs": runs, "summary": summary, "server": facts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", action="store_true", help="a task worker fleet, not a relay")
    ap.add_argument("--databases", type=int, default=20)
    ap.add_argument("--idle", type=float, default=5.0, help="OUTBOXKIT_CLAIM_IDLE when parked")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of idle CPU measured")
    ap.add_argument("--samples", type=int, default=10, help="first events, one per database")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="5 databases, 5 s window, one round")
    args = ap.parse_args()
    if args.quick:
        args.databases, args.window, args.samples, args.rounds = 5, 5.0, 5, 1
    args.samples = min(args.samples, args.databases)
    result = asyncio.run(run(args))
    save(
        "fleet_idle_worker" if args.worker else "fleet_idle",
        {
            "command": " ".join(["python", "bench/fleet_idle.py", *sys.argv[1:]]),
            "databases": args.databases,
            "idle": args.idle,
            "window": args.window,
            **result,
        },
    )
    print(result["summary"])


if __name__ == "__main__":
    main()
