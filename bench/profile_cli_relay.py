"""Where the CLI relay's CPU per event goes (issue 24 item 2): ``outboxkit relay`` with its
defaults draining N preloaded events to Tansu, as bench/_measure.py runs it, under
``py-spy record --native`` (whole life, idle stacks off), plus each thread's CPU from
/proc between the first and the last message on the topic.

The samples are sorted into buckets by the frames they contain (first match wins, in
the order of ``BUCKETS``); samples of start-up and shutdown (imports, connecting, the
table check, ``gc.freeze``, exit) are counted apart. A bucket's µs per event is its
share of the steady-state samples times the main thread's CPU per event.

    python bench/profile_cli_relay.py --dsn postgresql://postgres@127.0.0.1/bench [--events N]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import TOPIC, ensure_topic, kafka_broker, prepare, reload, save
from _measure import Watch

from outboxkit.testing import spawn_relay

# Samples whose leaf waits (for a lock, the GIL, a condition, epoll) are not CPU: py-spy's
# --native mode does not tell idle threads apart itself.
IDLE = (
    "pthread_cond_timedwait",
    "pthread_cond_wait",
    "epoll_wait",
    "sem_wait",
    "__lll_lock_wait",
    "PyThread_acquire_lock_timed",
)
STARTUP = (
    "_find_and_load",
    "exec_module",
    "_freeze_start_up_heap",
    "register_default_adapters",
    "OSSL",
    "_dl_",
    "PgQueueStore.start",
    "KafkaPublisher.start",
    "Relay.start",
    "import_module",
    "_handle_fromlist",
    "Connection.connect",
    "close (",
)
# (bucket, substrings of a frame; a sample goes to the first bucket one of its frames matches)
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("start-up and shutdown", STARTUP),
    ("garbage collector", ("gc_collect_main",)),
    ("CloudEvents headers (encode_record)", ("encode_record",)),
    ("produce() (librdkafka enqueue, C)", ("_produce", "Producer_produce")),
    ("publish-time guard", ("Guard.refuse",)),
    ("row fetch + decode (psycopg fetchall)", ("AsyncCursor.fetchall",)),
    ("building OutboundMessage (make_item)", ("PgQueueStore.claim.<locals>.<listcomp>",)),
    ("claim statement (send, wait)", ("PgQueueStore.claim",)),
    ("settle statement", ("PgQueueStore.settle", "PgQueueStore._run", "_store_settle")),
    (
        "delivery reports (poll thread)",
        ("_poll_forever", "dr_msg_cb", "_BatchWaiter", "rd_kafka_poll_cb"),
    ),
    ("logging / metrics / tracing", ("logging", "Observer", "SummaryLog", "Tracing", "stats")),
    ("relay/publisher Python (batch plumbing)", ("publish_batch", "ClaimLoop", "Relay")),
    ("event loop / asyncio", ("BaseEventLoop", "task_step", "Handle._run", "asyncio")),
]


def bucket_of(stack: str) -> str:
    frames = stack.split(";")
    if any(w in f for f in frames[-3:] for w in IDLE):
        return "idle (waits)"
    if "relay.<locals>._main" in frames[-1]:  # its own line: the import of ops/http.py
        return "start-up and shutdown"
    for name, needles in BUCKETS:
        if any(n in stack for n in needles):
            return name
    return "other"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--src", help="PYTHONPATH of the relay (default: this one's)")
    ap.add_argument("--out", default="profile_cli_relay")
    args = ap.parse_args()
    pyspy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if pyspy is None:
        raise SystemExit("py-spy is not on PATH: pip install py-spy")
    prepare(args.dsn, args.events)
    raw = Path(tempfile.mkdtemp(prefix="outboxkit-prof-")) / "cli.txt"
    with kafka_broker(None) as bootstrap:
        ensure_topic(bootstrap, TOPIC)
        n = reload(args.dsn, limit=args.events)
        cpu: dict[str, dict[str, float]] = {}
        child: subprocess.Popen[bytes] | None = None

        def at(label: str) -> float:
            assert child is not None
            cpu[label] = thread_cpu(child.pid)
            return 0.0

        marks = iter(("first", "last"))
        watch = Watch(bootstrap, n, None, lambda: at(next(marks)))
        env = {"PYTHONPATH": args.src} if args.src else None
        child = spawn_relay(
            args.dsn, f"kafka://{bootstrap}", raw.with_suffix(".log"), log_level=None, env=env
        )
        spy = subprocess.Popen(
            [
                *(pyspy, "record", "--native", "--rate", str(args.rate), "--format", "raw"),
                *("--pid", str(child.pid), "--output", str(raw)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        watch.start()
        if not watch.wait(600):
            raise RuntimeError(f"{watch.count} of {n} events")
        window = watch.last - watch.first
        child.send_signal(signal.SIGTERM)
        child.wait(60)
        spy.wait(60)
    time.sleep(0.1)
    samples: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples[bucket_of(stack)] += int(count)
    apart = ("start-up and shutdown", "idle (waits)")
    steady = sum(v for k, v in samples.items() if k not in apart)
    threads = {
        name: (cpu["last"].get(name, 0.0) - cpu["first"].get(name, 0.0)) * 1e6 / (n - 1)
        for name in cpu["last"]
    }
    main_us = threads.get("python", 0.0) or max(threads.values())
    print(f"{n} events in {window:.2f} s; CPU µs/event by thread (window): ")
    for name, us in sorted(threads.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<24} {us:6.2f}")
    print(f"py-spy samples: {sum(samples.values())}, steady state {steady}")
    table: list[dict[str, Any]] = []
    for name, count in samples.most_common():
        if name in apart:
            print(f"  ({name}: {count} samples, left out)")
            continue
        share = count / steady
        table.append({"bucket": name, "samples": count, "share": share, "us": share * main_us})
        print(f"  {name:<42} {share:6.1%} {share * main_us:6.2f} µs")
    save(
        args.out,
        {"events": n, "window_s": window, "threads_us_per_event": threads, "buckets": table},
    )
    print(f"raw stacks: {raw}")


if __name__ == "__main__":
    main()
