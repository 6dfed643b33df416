"""Errors that say what to do: one line, the cause and the next step, never a traceback.

Against real servers and real import failures: a missing client library is made
missing in the child interpreter (``sys.modules[name] = None``), a missing table is
dropped, a busy port is held by a socket of the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import create_async_engine

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import MigrationAction, migrate, schema_version
from outboxkit.backends.postgres.postgres import SCHEMA_VERSION
from outboxkit.errors import TableNotFoundError
from outboxkit.ops.cli import main
from tests.support.relaying import count, make_events, write_events


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run_cli(
    *args: str, without: tuple[str, ...] = (), timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``outboxkit ARGS`` in a child interpreter where the modules ``without`` cannot import."""
    shim = "".join(f"sys.modules[{m!r}] = None; " for m in without)
    code = f"import sys; {shim}from outboxkit.ops.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "COLUMNS": "60"},  # a narrow terminal must not wrap the line
    )


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# -- missing extras -------------------------------------------------------------


@pytest.mark.parametrize(
    ("broker", "module", "hint"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/", "aio_pika", "pip install 'outboxkit[rabbitmq]'"),
        ("redis://127.0.0.1:6379/0", "redis", "pip install 'outboxkit[redis]'"),
        ("sqs://orders?region=us-east-1", "boto3", "pip install 'outboxkit[sqs]'"),
        # One boto3 for every AWS target: the extra every release declares.
        ("sns://orders?region=us-east-1", "boto3", "pip install 'outboxkit[sqs]'"),
        ("kinesis://orders?region=us-east-1", "boto3", "pip install 'outboxkit[sqs]'"),
        ("eventbridge://orders?region=us-east-1", "boto3", "pip install 'outboxkit[sqs]'"),
        ("https://example.invalid/hooks/{topic}", "httpx", "pip install 'outboxkit[webhook]'"),
    ],
)
def test_relay_without_the_brokers_library_names_the_extra_in_one_line(
    broker: str, module: str, hint: str
) -> None:
    proc = run_cli(
        "relay", "--dsn", "postgresql://app@127.0.0.1:1/shop", "--broker", broker, without=(module,)
    )
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    scheme = broker.split("://")[0]
    assert f"the {scheme}:// broker needs" in line
    assert hint in line  # the [extra] survives: no markup eats it


def test_a_command_without_its_library_names_the_extra_instead_of_a_traceback(
    db_dsn: str,
) -> None:
    # dashboard imports aiohttp when it runs: the group-level net catches what commands miss.
    proc = run_cli("dashboard", "--dsn", db_dsn, "--port", "0", without=("aiohttp",))
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert "`outboxkit dashboard` needs aiohttp" in line and "pip install 'aiohttp'" in line


# -- markup -----------------------------------------------------------------------


def test_demo_without_the_embedded_servers_prints_the_extra_with_its_brackets() -> None:
    proc = run_cli(
        "demo", "--orders", "10", "--duration", "5", without=("outboxkit.testing",), timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert "pip install 'outboxkit[embedded]'" in line


def test_topics_errors_and_table_names_print_as_written_not_as_markup(db_dsn: str) -> None:
    events = [
        Event(topic="orders[eu]", event_type="order.placed", payload={"n": 1}),
        Event(topic="[bold]x[/bold]", event_type="order.placed", payload={"n": 2}),
    ]
    write_events(db_dsn, events)
    status = cli("status", "--dsn", db_dsn)
    assert status.exit_code == 0
    assert "orders[eu]" in status.output and "[bold]x[/bold]" in status.output
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 2, last_error = 'broker said [red]no[/red]'")
    listed = cli("failed", "list", "--dsn", db_dsn)
    assert "[red]no[/red]" in listed.output and "orders[eu]" in listed.output
    shown = cli("failed", "show", str(events[0].event_id), "--dsn", db_dsn)
    assert "[red]no[/red]" in shown.output


# -- migrate ----------------------------------------------------------------------


def _schema(dsn: str, table: str = "outbox") -> dict[str, list[Any]]:
    """Columns, indexes and storage options of ``table``, for comparing two databases."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        columns = conn.execute(
            "SELECT column_name, data_type, is_nullable, column_default"
            " FROM information_schema.columns WHERE table_name = %s ORDER BY column_name",
            (table,),
        ).fetchall()
        indexes = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s ORDER BY indexname",
            (table,),
        ).fetchall()
        options = conn.execute(
            "SELECT reloptions FROM pg_class WHERE relname = %s", (table,)
        ).fetchall()
    return {"columns": columns, "indexes": indexes, "options": options}


def test_migrate_after_the_table_was_dropped_recreates_it_and_says_so(
    db_dsn: str, empty_db_dsn: str
) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outbox")
    out = cli("migrate", "--dsn", db_dsn)
    assert out.exit_code == 0, out.output
    assert "repaired outbox table 'outbox'" in out.output
    assert "recreated the missing table outbox" in out.output
    assert "index outbox_pending_idx" in out.output
    assert cli("status", "--dsn", db_dsn).exit_code == 0
    # what came back equals a table created fresh
    cli("migrate", "--dsn", empty_db_dsn)
    assert _schema(db_dsn) == _schema(empty_db_dsn)
    again = cli("migrate", "--dsn", db_dsn)
    assert "is in place at schema version" in again.output and "nothing to do" in again.output


def test_migrate_recreates_only_the_dropped_index(db_dsn: str) -> None:
    write_events(db_dsn, make_events("orders", 3))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("DROP INDEX outbox_pending_idx")
    result = migrate(db_dsn)
    assert result.action is MigrationAction.REPAIRED
    assert result.recreated == ("index outbox_pending_idx",)
    assert count(db_dsn) == 3  # the rows are untouched
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        found = conn.execute("SELECT to_regclass('outbox_pending_idx') IS NOT NULL").fetchone()
    assert found == (True,)


def test_migrate_rewrites_a_lost_version_record(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outboxkit_schema_versions")
    out = cli("migrate", "--dsn", db_dsn)
    assert "recreated the missing version record" in out.output
    assert schema_version(db_dsn) == SCHEMA_VERSION


def test_migrate_says_created_then_in_place(empty_db_dsn: str) -> None:
    first = cli("migrate", "--dsn", empty_db_dsn, "--table", "app_events")
    assert f"created outbox table 'app_events' at schema version {SCHEMA_VERSION}" in first.output
    second = migrate(empty_db_dsn, table="app_events")
    assert second.action is MigrationAction.UNCHANGED and second.version == SCHEMA_VERSION


def test_migrate_upgrades_from_an_older_recorded_version(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outboxkit_schema_versions SET version = %s", (SCHEMA_VERSION - 1,))
    out = cli("migrate", "--dsn", db_dsn)
    assert f"upgraded outbox table 'outbox' to schema version {SCHEMA_VERSION}" in out.output
    assert f"(from {SCHEMA_VERSION - 1})" in out.output
    assert schema_version(db_dsn) == SCHEMA_VERSION


def test_migrate_refuses_a_table_migrated_by_a_newer_release(db_dsn: str) -> None:
    newer = SCHEMA_VERSION + 1
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outboxkit_schema_versions SET version = %s", (newer,))
    proc = run_cli("migrate", "--dsn", db_dsn)
    assert proc.returncode == 2
    assert "upgrade outboxkit" in one_line(proc.stderr)
    assert schema_version(db_dsn) == newer  # not silently downgraded


def test_concurrent_migrates_of_a_dropped_table_repair_it_once(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outbox")
    results: list[Any] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        barrier.wait()
        try:
            results.append(migrate(db_dsn))
        except BaseException as exc:  # pragma: no cover - the failure we test against
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    actions = sorted(r.action for r in results)
    assert actions == sorted([MigrationAction.REPAIRED] + [MigrationAction.UNCHANGED] * 3)


def test_migrate_inbox_says_created_in_place_or_repaired(empty_db_dsn: str) -> None:
    first = cli("migrate", "--inbox", "--dsn", empty_db_dsn)
    assert "created inbox table 'processed_events'" in first.output
    assert "nothing to do" in cli("migrate", "--inbox", "--dsn", empty_db_dsn).output
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("DROP INDEX processed_events_processed_at_idx")
    repaired = cli("migrate", "--inbox", "--dsn", empty_db_dsn)
    assert "recreated the missing index processed_events_processed_at_idx" in repaired.output


# -- writes on a missing table ----------------------------------------------------------


def _event() -> Event:
    return Event(topic="orders", event_type="order.placed", payload={"n": 1})


def _check_missing(exc_info: pytest.ExceptionInfo[TableNotFoundError]) -> None:
    message = str(exc_info.value)
    assert "outbox table 'nope'" in message and "outboxkit migrate" in message
    assert "roll it back" in message
    assert exc_info.value.__cause__ is not None  # the driver's error is chained


def test_psycopg_writes_to_a_missing_table_raise_the_migrate_hint(db_dsn: str) -> None:
    outbox = Outbox("nope")
    for write in (
        lambda c: outbox.put(c, _event()),
        lambda c: outbox.put_many(c, [_event(), _event()]),
        lambda c: outbox.execute_with(c, "SELECT 1", events=[_event()]),
    ):
        with psycopg.connect(db_dsn) as conn:
            with pytest.raises(TableNotFoundError) as info:
                write(conn)
            assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)
            _check_missing(info)


def test_execute_with_on_the_callers_missing_table_keeps_the_drivers_error(db_dsn: str) -> None:
    with psycopg.connect(db_dsn) as conn, pytest.raises(psycopg.errors.UndefinedTable):
        Outbox().execute_with(conn, "UPDATE no_such_orders SET x = 1", events=[_event()])


async def test_async_writes_to_a_missing_table_raise_the_migrate_hint(db_dsn: str) -> None:
    import asyncpg

    outbox = Outbox("nope")
    async with await psycopg.AsyncConnection.connect(db_dsn) as aconn:
        with pytest.raises(TableNotFoundError) as info:
            await outbox.aput(aconn, _event())
        _check_missing(info)
        await aconn.rollback()
        with pytest.raises(TableNotFoundError) as info:
            await outbox.aput_many(aconn, [_event(), _event()])
        _check_missing(info)
    conn = await asyncpg.connect(db_dsn)
    try:
        for write in (
            lambda: outbox.aput(conn, _event()),
            lambda: outbox.aexecute_with(conn, "SELECT 1", events=[_event()]),
        ):
            with pytest.raises(TableNotFoundError) as info:
                async with conn.transaction():
                    await write()
            assert isinstance(info.value.__cause__, asyncpg.UndefinedTableError)
            _check_missing(info)
    finally:
        await conn.close()


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_sqlalchemy_writes_to_a_missing_table_raise_the_migrate_hint(
    db_dsn: str, driver: str
) -> None:
    engine = sa.create_engine(db_dsn.replace("postgresql://", f"postgresql+{driver}://"))
    try:
        with engine.connect() as conn, conn.begin(), pytest.raises(TableNotFoundError) as info:
            Outbox("nope").put(conn, _event())
        _check_missing(info)
    finally:
        engine.dispose()


async def test_sqlalchemy_async_writes_to_a_missing_table_raise_the_migrate_hint(
    db_dsn: str,
) -> None:
    engine = create_async_engine(db_dsn.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        with pytest.raises(TableNotFoundError) as info:
            async with engine.connect() as conn, conn.begin():
                await conn.execute(sa.text("SELECT 1"))  # the adapter begins on first use
                await Outbox("nope").aput(conn, _event())
        _check_missing(info)
    finally:
        await engine.dispose()


# -- the relay's start-up ---------------------------------------------------------------


@contextlib.contextmanager
def counting_listener() -> Iterator[tuple[int, list[int]]]:
    """A TCP port that counts the connections made to it (a broker that never answers)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    accepted = [0]
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            accepted[0] += 1
            client.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        done.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize("scheme", ["nats", "kafka"])
def test_relay_on_a_missing_table_stops_before_contacting_the_broker(
    db_dsn: str, scheme: str
) -> None:
    with counting_listener() as (port, accepted):
        proc = run_cli(
            "relay", "--dsn", db_dsn, "--table", "nope", "--broker", f"{scheme}://127.0.0.1:{port}"
        )
        time.sleep(0.3)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "outboxkit migrate" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert accepted[0] == 0, "the relay contacted the broker before checking its table"


def test_relay_says_what_it_does_at_start_and_stops_without_warnings(
    db_dsn: str, nats_server: Any
) -> None:
    write_events(db_dsn, make_events("orders", 5))
    stream = f"ERR_{uuid.uuid4().hex[:8].upper()}"
    broker = f"{nats_server.url}?stream={stream}&subjects=orders"
    proc = subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "relay", "--dsn", db_dsn, "--broker", broker],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while count(db_dsn) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        asyncio.run(_delete_stream(nats_server.url, stream))
    assert proc.returncode == 0, output
    assert re.search(r"connected to database \S+ on \S+; table outbox found with 5 pending", output)
    assert "publisher nats started" in output
    assert "first batch published: 5 event(s)" in output
    order = [output.index(s) for s in ("connected to database", "publisher nats", "first batch")]
    assert order == sorted(order)
    assert "WARNING" not in output and "disconnected from NATS" not in output, output


async def _delete_stream(url: str, stream: str) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


# -- dashboard, help and titles -----------------------------------------------------------


def test_dashboard_does_not_announce_a_url_it_could_not_bind(db_dsn: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = run_cli("dashboard", "--dsn", db_dsn, "--port", str(port))
    assert proc.returncode == 2
    assert "http://" not in proc.stdout, proc.stdout
    assert "choose another --port" in one_line(proc.stderr)


def test_dashboard_url_answers_as_soon_as_it_is_announced(db_dsn: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "dashboard", "--dsn", db_dsn, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert found, line
        with urllib.request.urlopen(found.group(0), timeout=5) as answer:  # noqa: S310
            assert answer.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        yield (*prefix, name)
        if hasattr(command, "commands"):
            yield from _commands(command, (*prefix, name))


def test_every_option_has_a_help_text_and_links_are_full_urls() -> None:
    for path in _commands(main):
        command: Any = main
        for name in path:
            command = command.commands[name]
        for param in command.params:
            if param.param_type_name == "option":
                assert param.help, f"outboxkit {' '.join(path)} {param.opts[0]} has no help"
        text = cli(*path, "--help").output
        for link in re.findall(r"\S*docs/\S+", text):
            assert link.startswith("https://"), f"`outboxkit {' '.join(path)} --help`: {link}"


def test_status_title_does_not_repeat_words(db_dsn: str) -> None:
    write_events(db_dsn, make_events("orders", 2))
    out = cli("status", "--dsn", db_dsn).output
    title = out.strip().splitlines()[0].split()
    assert all(a != b for a, b in itertools.pairwise(title)), out
    assert "outbox outbox" not in out


# -- a table that is not an outbox, numbers out of range, ports it may not bind -----------


@pytest.mark.parametrize(
    "command",
    [
        ["status"],
        ["relay", "--broker", "nats://127.0.0.1:1"],
        ["failed", "list"],
        ["replay", "--all-failed"],
        ["purge", "--older-than", "7d"],
        ["dashboard", "--port", "0"],
        ["migrate"],
    ],
)
def test_a_table_that_is_not_an_outbox_is_one_line_naming_it_and_its_missing_column(
    empty_db_dsn: str, command: list[str]
) -> None:
    """Before: psycopg's UndefinedColumn traceback (column "topic" does not exist)."""
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE customers (id bigint PRIMARY KEY, name text)")
    proc = run_cli(*command, "--dsn", empty_db_dsn, "--table", "customers")
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr
    assert line.startswith("error: table 'customers' is not an outboxkit outbox table"), line
    assert re.search(r"it has no column '(status|topic|event_id)'", line), line
    assert "--table" in line and "outboxkit migrate" in line, line


def test_an_inbox_table_that_is_not_an_inbox_names_the_inbox_option(empty_db_dsn: str) -> None:
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE customers (id bigint PRIMARY KEY, name text)")
    proc = run_cli(
        "purge", "--inbox", "--inbox-table", "customers", "--older-than", "1d",
        "--dsn", empty_db_dsn,
    )  # fmt: skip
    line = one_line(proc.stderr)
    assert "table 'customers' is not an outboxkit inbox table" in line, line
    assert "--inbox-table" in line and "migrate --inbox" in line, line


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["purge", "--older-than", "999999999999999999d"], "--older-than"),
        (["purge", "--older-than", "99999999d"], "--older-than"),
        (["relay", "--broker", "nats://127.0.0.1:1", "--lease", "1e309"], "--lease"),
        (["relay", "--broker", "nats://127.0.0.1:1", "--poll-interval", "nan"], "--poll-interval"),
        (["relay", "--broker", "nats://127.0.0.1:1", "--batch-size", "9" * 20], "--batch-size"),
        (["relay", "--broker", "nats://127.0.0.1:1", "--metrics-port", "99999"], "--metrics-port"),
        (["dashboard", "--port", "-1"], "--port"),
        (["replay", "--id", "9" * 20], "--id"),
    ],
)
def test_numbers_and_durations_out_of_range_are_refused_at_their_option(
    db_dsn: str, command: list[str], option: str
) -> None:
    """Before: OverflowError and psycopg out-of-range tracebacks, or a relay that ran anyway."""
    proc = run_cli(*command, "--dsn", db_dsn, timeout=30)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    [error] = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert f"'{option}'" in error and "out of range" in error, error


def _as_nobody() -> list[str]:
    """A command prefix that drops root (binding port 80 is then refused), else skip."""
    if os.geteuid() != 0:
        return []
    import shutil

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: every port can be bound")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.parametrize(
    ("command", "hint"),
    [
        (["dashboard", "--port", "80"], "choose another --port"),
        (
            ["relay", "--broker", "nats://127.0.0.1:1", "--metrics-port", "80", "--dashboard"],
            "choose another --metrics-port",
        ),
    ],
)
def test_a_port_the_process_may_not_bind_is_one_line(
    db_dsn: str, command: list[str], hint: str
) -> None:
    proc = subprocess.run(
        [*_as_nobody(), sys.executable, "-m", "outboxkit", *command, "--dsn", db_dsn],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "60"},
    )
    if proc.returncode == 0:
        pytest.skip("this process may bind port 80")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and hint in errors[0], proc.stderr
    assert "permission denied" in errors[0].lower(), errors[0]
    assert proc.returncode == 2


def test_a_metrics_port_in_use_is_one_line(db_dsn: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = run_cli(
            "relay", "--dsn", db_dsn, "--broker", "nats://127.0.0.1:1", "--metrics-port", str(port)
        )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and "choose another --metrics-port" in errors[0], proc.stderr
    assert f"127.0.0.1:{port}" in errors[0] and proc.returncode == 2
