"""What a user does with the installed wheel, step by step (run by .ci/wheel_check.py).

Runs with the interpreter of a virtual environment the wheel was installed into, from a
directory outside the repository, so only the installed package can be imported. Each step
prints one line; the first failure prints why and exits 1. Arguments: the README's first
snippet (a file) and the number of the Django app's migrations the wheel ships.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

import outboxkit
from outboxkit.testing import EmbeddedNats, EmbeddedPostgres, create_database, free_port

HERE = Path.cwd()
BIN = Path(sys.executable).parent
OUTBOXKIT = str(BIN / "outboxkit")
STREAM = "WHEELCHECK"


class StepFailed(Exception):
    pass


def step(name: str, check: Callable[[], str]) -> None:
    started = time.monotonic()
    try:
        detail = check()
    except Exception as exc:
        print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(1) from None
    print(f"ok   {name}: {detail} ({time.monotonic() - started:.1f}s)", flush=True)


def run(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if done.returncode != 0:
        raise StepFailed(f"{' '.join(args[:3])} ... exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def scalar(dsn: str, query: str) -> object:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return row[0]


def wait_for(what: str, ready: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise StepFailed(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


@contextmanager
def service(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """A long-running command, stopped with SIGTERM at the end; it must exit 0."""
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    if code != 0:
        raise StepFailed(f"{args[1]} exited {code} on SIGTERM; its log:\n{log.read_text()}")


def installed() -> str:
    location = Path(outboxkit.__file__).resolve()
    site = Path(sys.prefix).resolve()
    if site not in location.parents or "site-packages" not in location.parts:
        raise StepFailed(f"outboxkit imported from {location}, not from the venv {site}")
    dist = importlib.metadata.distribution("outboxkit")
    direct = dist.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        raise StepFailed("outboxkit is an editable install, not the wheel")
    if dist.version != outboxkit.__version__:
        raise StepFailed(f"metadata {dist.version} != __version__ {outboxkit.__version__}")
    line = run([OUTBOXKIT, "--version"]).strip()
    if line != f"outboxkit, version {dist.version}":
        raise StepFailed(f"`outboxkit --version` printed {line!r}")
    return f"{line} from {location.parent}"


def readme_snippet(pg: EmbeddedPostgres, snippet: Path) -> str:
    dsn = create_database(pg.dsn, "readme")
    out = run([sys.executable, str(snippet)], env={**os.environ, "OUTBOXKIT_DSN": dsn})
    events = scalar(dsn, "SELECT count(*) FROM outbox WHERE topic = 'orders'")
    if events != 1:
        raise StepFailed(f"the snippet left {events} events in the outbox, expected 1")
    return f"{out.strip().splitlines()[-1]!r}; 1 event in the outbox"


KINDS = {
    # kind: (outboxkit migrate arguments, the table it must leave, its relkind)
    "outbox": ([], "outbox", "r"),
    "partitioned": (["--partition-by", "day", "--table", "outbox_by_day"], "outbox_by_day", "p"),
    "ordered": (
        ["--ordered", "--partitions", "4", "--table", "outbox_ordered"],
        "outbox_ordered",
        "r",
    ),
    "inbox": (["--inbox"], "processed_events", "r"),
    "tasks": (["--tasks"], "outboxkit_tasks", "r"),
}


def migrate_every_kind(dsn: str) -> str:
    for kind, (args, table, relkind) in KINDS.items():
        run([OUTBOXKIT, "migrate", "--dsn", dsn, *args])
        found = scalar(dsn, f"SELECT relkind FROM pg_class WHERE relname = '{table}'")
        if found != relkind:
            raise StepFailed(f"`migrate` for {kind}: table {table} has relkind {found!r}")
    ordered = scalar(
        dsn,
        "SELECT count(*) FROM information_schema.columns"
        " WHERE table_name = 'outbox_ordered' AND column_name = 'partition'",
    )
    if ordered != 1:
        raise StepFailed("`migrate --ordered` left no partition column")
    return ", ".join(f"{kind} ({KINDS[kind][1]})" for kind in KINDS)


def django_migrations(pg: EmbeddedPostgres, expected: int) -> str:
    dsn = create_database(pg.dsn, "django")
    (HERE / "wheelcheck_settings.py").write_text(
        "SECRET_KEY = 'wheel-check'\n"
        "USE_TZ = True\n"
        "INSTALLED_APPS = ['outboxkit.contrib.django']\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql',"
        f" 'NAME': 'django', 'USER': 'postgres', 'HOST': '127.0.0.1', 'PORT': {pg.port}}}}}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE), "DJANGO_SETTINGS_MODULE": "wheelcheck_settings"}
    run([sys.executable, "-m", "django", "migrate", "--no-input", "-v", "0"], env=env)
    applied = scalar(dsn, "SELECT count(*) FROM django_migrations WHERE app = 'outboxkit'")
    if applied != expected or expected == 0:
        raise StepFailed(f"{applied} outboxkit migrations applied, the wheel ships {expected}")
    tables = scalar(
        dsn,
        "SELECT string_agg(relname, ', ' ORDER BY relname) FROM pg_class"
        " WHERE relname IN ('outbox', 'processed_events', 'outboxkit_tasks') AND relkind = 'r'",
    )
    return f"{applied} migrations of the app 'outboxkit' applied: {tables}"


async def _stream_messages(url: str) -> list[bytes]:
    import nats

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        sub = await js.pull_subscribe("orders", stream=STREAM)
        msgs = await sub.fetch(info.state.messages or 1, timeout=5)
        return [m.data for m in msgs]
    finally:
        await nc.close()


def relay_to_nats(pg: EmbeddedPostgres, broker: EmbeddedNats) -> str:
    dsn = pg.dsn_for("readme")
    url = f"{broker.url}?stream={STREAM}&subjects=orders"
    args = [OUTBOXKIT, "relay", "--dsn", dsn, "--broker", url, "--poll-interval", "0.2"]
    with service(args, HERE / "relay.log"):
        wait_for("the relay to publish", lambda: scalar(dsn, "SELECT count(*) FROM outbox") == 0)
    messages = asyncio.run(_stream_messages(broker.url))
    if len(messages) != 1 or b"order_id" not in messages[0]:
        raise StepFailed(f"stream {STREAM} holds {messages!r}, expected the one order event")
    return f"the README's event published to NATS JetStream (stream {STREAM}: 1 message)"


TASKS_APP = """\
from outboxkit.tasks import TaskContext, Tasks

tasks = Tasks()


@tasks.handler("wheel.check")
def record(payload: dict[str, int], ctx: TaskContext) -> None:
    with ctx.transaction() as conn:
        conn.execute("INSERT INTO wheel_done (n, task_id) VALUES (%s, %s)", (payload["n"], ctx.id))
"""


def worker_runs_a_task(dsn: str) -> str:
    (HERE / "wheelcheck_tasks.py").write_text(TASKS_APP)
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    enqueue = (
        "import os, psycopg, wheelcheck_tasks as t\n"
        "with psycopg.connect(os.environ['DSN']) as conn:\n"
        "    conn.execute('CREATE TABLE wheel_done (n int, task_id bigint)')\n"
        "    t.tasks.enqueue(conn, 'wheel.check', {'n': 7})\n"
    )
    run([sys.executable, "-c", enqueue], env={**env, "DSN": dsn})
    args = [OUTBOXKIT, "worker", "--dsn", dsn, "--app", "wheelcheck_tasks:tasks"]
    with service([*args, "--poll-interval", "0.1"], HERE / "worker.log", env):
        wait_for("the task's row", lambda: scalar(dsn, "SELECT count(*) FROM wheel_done") == 1)
        wait_for(
            "the task to leave the table",
            lambda: scalar(dsn, "SELECT count(*) FROM outboxkit_tasks") == 0,
        )
    return "`outboxkit worker` ran wheel.check: its row committed, the task deleted"


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (loopback)
        return response.status, response.headers.get("Content-Type", ""), response.read()


def dashboard_pages(dsn: str) -> str:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [OUTBOXKIT, "dashboard", "--dsn", dsn, "--port", str(port)]
    static = Path(outboxkit.__file__).parent / "ops" / "dashboard" / "static"
    fetched: list[str] = []
    with service(args, HERE / "dashboard.log"):

        def up() -> bool:
            try:
                return _get(base + "/")[0] == 200
            except OSError:
                return False

        wait_for("the dashboard to answer", up)
        for page in ("/", "/tasks"):
            status, kind, body = _get(base + page)
            if status != 200 or "text/html" not in kind:
                raise StepFailed(f"GET {page}: {status} {kind}")
            assets = re.findall(r'(?:src|href)="([^"#:]+\.(?:js|css))"', body.decode())
            if not assets:
                raise StepFailed(f"GET {page}: the page links no script or stylesheet")
            for asset in assets:
                url = asset if asset.startswith("/") else "/" + asset
                status, kind, data = _get(base + url)
                shipped = (static / Path(asset).name).read_bytes()
                if status != 200 or data != shipped:
                    raise StepFailed(f"GET {url}: {status}, {len(data)} B, ships {len(shipped)}")
                fetched.append(url)
        for api in ("/api/overview", "/api/tasks/overview"):
            status, kind, body = _get(base + api)
            if status != 200 or not isinstance(json.loads(body), dict):
                raise StepFailed(f"GET {api}: {status} {body[:200]!r}")
    return f"/ and /tasks served with {', '.join(sorted(set(fetched)))}; their APIs answer"


TYPED_USE = """\
import outboxkit
from outboxkit import Event, Outbox

outbox: Outbox = Outbox(table="outbox")
event: Event = Event(topic="orders", event_type="order.placed", payload={"total": 1})
version: str = outboxkit.__version__
"""
TYPED_MISUSE = """\
from outboxkit import Event

event = Event(topic=42, event_type="order.placed", payload={})
"""


def mypy_reads_the_types(cache: str) -> str:
    (HERE / "typed_use.py").write_text(TYPED_USE)
    (HERE / "typed_misuse.py").write_text(TYPED_MISUSE)
    mypy = [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", cache]
    run([*mypy, "typed_use.py"], timeout=300)
    done = subprocess.run(
        [*mypy, "typed_misuse.py"], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 1 or "[arg-type]" not in done.stdout or "import-untyped" in done.stdout:
        raise StepFailed(f"mypy did not read outboxkit's types (py.typed):\n{done.stdout}")
    return "`import outboxkit` passes mypy --strict; Event(topic=42) is an [arg-type] error"


def main() -> None:
    snippet, django_count, mypy_cache = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    step("installed", installed)
    with EmbeddedPostgres(fsync=False) as pg, EmbeddedNats() as broker:  # temporary data dirs
        kinds = create_database(pg.dsn, "kinds")
        step("README's first snippet", lambda: readme_snippet(pg, snippet))
        step("outboxkit migrate, every kind", lambda: migrate_every_kind(kinds))
        step("Django migrations", lambda: django_migrations(pg, django_count))
        step("outboxkit relay", lambda: relay_to_nats(pg, broker))
        step("outboxkit worker", lambda: worker_runs_a_task(kinds))
        step("outboxkit dashboard", lambda: dashboard_pages(kinds))
    step("mypy and py.typed", lambda: mypy_reads_the_types(mypy_cache))


if __name__ == "__main__":
    main()
