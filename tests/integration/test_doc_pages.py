"""The guide pages beyond the README's journey run as written (issue 39: the snippets in the
site are the ones tests/ runs).

Each page gets the setup its prose assumes and no more: a migrated database, the broker a
snippet names, the order service docs/testing-your-code.md tests. A page whose snippets
build on each other runs top to bottom; every run checks the effect the snippet promises
(the event on the broker, the task's effect, the assertions of a test that pytest runs).
Fragments (a view's lines, an ``INSTALLED_APPS`` line, a relay built from ``dsn``) run
with the names their page says the reader has (``conn``, ``Order``, ``dsn``) or inside the
file they belong to (settings.py, an Alembic env.py); a block that cannot run carries
``<!-- not-runnable: why -->``. docs/tasks.md's handlers run in a ``Worker`` with the
payload models the page assumes; docs/mariadb.md's snippets connect to the private
mariadbd instead of the page's ``db`` host.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest

from outboxkit import Event, Outbox, Relay, from_url, migrate_inbox
from outboxkit.backends.mariadb.migrate import migrate as migrate_mariadb
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.backends.postgres.postgres import Status
from outboxkit.publishers.memory import MemoryBroker
from outboxkit.pytest import MemoryOutbox
from outboxkit.queue.tasks import TaskStatus
from outboxkit.tasks import InvalidTaskError, Tasks, Worker, migrate_tasks
from outboxkit.testing import free_port, port_accepts
from tests.support.doc_blocks import PAGES, ROOT, Block, page_python_blocks
from tests.support.doc_programs import Program, until
from tests.support.local_brokers import rabbitmq_url, redis_url
from tests.support.mariadb_drivers import driver_module
from tests.support.mariadb_ops import mariadb_execute, new_database
from tests.support.relaying import count, rows, running_relay, wait_for

# The blocks each test below runs, by a line of their own: a new block fails
# test_every_block_of_the_pages_is_run until a test runs it (or it is marked not-runnable).
RUN = {
    "docs/brokers.md": [
        "# write_event.py",
        "# read_rabbitmq.py",
        "# receiver.py",
        "# receiver_raw.py",
        "RoutingPublisher(from_url(",
        "inbox = Inbox()",
        "# consume_orders.py",
    ],
    "docs/testing-your-code.md": [
        'pytest_plugins = ["outboxkit.pytest"]',
        "def test_place_order(",
        "def test_wire_message(",
        "async def invoice(conn, event):",
        "def test_announce():",
        "def test_receipt_retries(",
    ],
    "docs/django.md": [
        '"outboxkit.contrib.django"]',
        "outbox.put(Event(",
        "# shop/tasks.py",
        "tasks.enqueue(",
        "inbox.handle(",
        "def upgrade():",
        "context.configure(",
        "TASKS = {",
        "# reports/tasks.py",
        "add.enqueue(2, 3)",
        "django.db.backends.mysql",
    ],
    "docs/celery.md": ["send_task(conn,", "# proj/tasks.py"],
    "docs/operations.md": ["metrics = RelayMetrics(dsn)"],
    "docs/tasks.md": [
        '@tasks.handler("report.generate", retry=',
        "task_id = generate.enqueue(conn,",
        '@tasks.handler("invoice.charge")',
        "result = tasks.result(conn, task_id)",
        "children = [resize.enqueue(",
        "@tasks.periodic(",
    ],
    "docs/mariadb.md": [
        "outbox.put(conn, Event(",
        "except TransactionConflictError:",
        '@tasks.handler("mail.send")',
    ],
}


def _block(page: str, marker: str) -> Block:
    (block,) = [b for b in page_python_blocks(page) if marker in b.code]
    assert block.not_runnable is None, f"{block} is run here: {block.not_runnable}"
    return block


def test_every_block_of_the_pages_is_run() -> None:
    assert sorted(RUN) == sorted(PAGES)
    marked = [str(b) for page in PAGES for b in page_python_blocks(page) if b.not_runnable]
    assert len(marked) <= 1, f"not-runnable is for rare exceptions: {marked}"
    for page, markers in RUN.items():
        runnable = [b for b in page_python_blocks(page) if b.not_runnable is None]
        unrun = [str(b) for b in runnable if not any(m in b.code for m in markers)]
        assert not unrun, f"blocks no test runs (run them, or say why with not-runnable): {unrun}"
        for marker in markers:
            _block(page, marker)


def _env(dsn: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "OUTBOXKIT_DSN": dsn, "PYTHONUNBUFFERED": "1", **extra}


def _run(block: Block, directory: Path, env: dict[str, str]) -> str:
    program = Program(block, directory, env)
    program.wait_ok()
    return program.output()


def _relay(dsn: str, url: str) -> None:
    """An embedded relay on ``url`` until the outbox holds nothing pending."""

    async def drain() -> None:
        async with running_relay(dsn, from_url(url)):
            await wait_for(
                lambda: count(dsn, f"status = {Status.PENDING}") == 0, what=f"a relay on {url}"
            )

    asyncio.run(drain())


def _exec(block: Block, names: dict[str, Any]) -> dict[str, Any]:
    """A fragment run with the names its page says the reader has (``conn``, ``dsn``)."""
    namespace = dict(names)
    exec(compile(block.code, str(block), "exec"), namespace)  # noqa: S102
    return namespace


# -- docs/celery.md ---------------------------------------------------------------------------


@pytest.mark.slow
def test_celery_page(empty_db_dsn: str, tmp_path: Path) -> None:
    """send_task writes Celery's task with the order; proj/tasks.py charges it once per id."""
    output = _run(_block("docs/celery.md", "send_task(conn,"), tmp_path, _env(empty_db_dsn))
    (row,) = rows(empty_db_dsn)
    assert (row["topic"], row["event_type"]) == ("celery", "proj.tasks.charge")
    assert output.strip() == f"order 1 committed with Celery task {row['event_id']}"

    # The worker's module, imported as Celery imports it; its task run with that task id.
    migrate_inbox(empty_db_dsn)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj/__init__.py").write_text("")
    (tmp_path / "proj/tasks.py").write_text(_block("docs/celery.md", "# proj/tasks.py").code)
    run = (
        "from proj.tasks import charge\n"
        f"first = charge.apply(args=(1,), task_id={str(row['event_id'])!r}).get()\n"
        f"again = charge.apply(args=(1,), task_id={str(row['event_id'])!r}).get()\n"
        "print(first, again)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", run],
        cwd=tmp_path,
        env=_env(empty_db_dsn),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "None already done"
    with psycopg.connect(empty_db_dsn) as conn:
        charged = conn.execute("SELECT charged_at IS NOT NULL FROM orders WHERE id = 1").fetchone()
    assert charged == (True,)


# -- docs/operations.md -----------------------------------------------------------------------


@pytest.mark.slow
def test_operations_metrics_snippet(db_dsn: str) -> None:
    """The embedded relay with its metrics endpoint publishes and counts what it published."""
    block = _block("docs/operations.md", "metrics = RelayMetrics(dsn)")
    broker = f"ops-doc-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        Outbox().put(conn, Event(topic="orders", event_type="order.placed", payload={"n": 1}))
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT

    async def scenario() -> str:
        namespace: dict[str, Any] = {"dsn": db_dsn, "publisher": from_url(f"memory://{broker}")}
        program = compile(block.code, str(block), "exec", flags)
        snippet = asyncio.ensure_future(eval(program, namespace))  # noqa: S307
        try:
            await wait_for(
                lambda: len(MemoryBroker.named(broker).messages) == 1, what="the publish"
            )

            def scrape() -> str:
                with urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=5) as r:
                    return str(r.read().decode())

            text = ""
            for _ in range(50):
                text = await asyncio.to_thread(scrape)
                if 'outboxkit_events_published_total{topic="orders"} 1.0' in text:
                    break
                await asyncio.sleep(0.1)
            return text
        finally:
            namespace["relay"].stop()
            await asyncio.wait_for(snippet, timeout=30)
            namespace["gauges"].cancel()

    try:
        metrics = asyncio.run(scenario())
    finally:
        MemoryBroker.forget(broker)
    assert 'outboxkit_events_published_total{topic="orders"} 1.0' in metrics, metrics


# -- docs/testing-your-code.md ---------------------------------------------------------------


@pytest.mark.slow
def test_testing_your_code_page(tmp_path: Path, pg_server: Any) -> None:
    """The page's tests, in a project of their own run by pytest: every one passes."""
    page = "docs/testing-your-code.md"
    support = ROOT / "tests/support/doc_pages"
    shutil.copy(support / "orders.py", tmp_path / "orders.py")
    conftest = _block(page, "pytest_plugins").code
    (tmp_path / "conftest.py").write_text(
        conftest + "\n" + (support / "conftest_tail.py").read_text()
    )
    header = (
        "import asyncio\n\nimport orders\n"
        "from orders import announce, place_order, received_event\n\n"
    )
    tests = [m for m in RUN[page] if "pytest_plugins" not in m]
    names = []
    for i, marker in enumerate(tests):
        code = _block(page, marker).code
        tree = ast.parse(code).body
        names += [
            n.name for n in tree if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        ]
        (tmp_path / f"test_page_{i}.py").write_text(header + code)
    # The reader's own pytest run: none of this suite's options (PYTEST_ADDOPTS) or plugins,
    # only the kit its conftest.py names; a warning of the kit fails the page.
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    argv = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-W", "error"]
    done = subprocess.run(
        [sys.executable, *argv, "--outboxkit-dsn", pg_server.dsn],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(names)} passed" in done.stdout, done.stdout
    assert len(names) == 6, names


# -- docs/brokers.md --------------------------------------------------------------------------


def _newest(dsn: str) -> dict[str, Any]:
    return rows(dsn)[-1]


async def _drop_rabbitmq_objects(url: str) -> None:
    """The exchange and queue read_rabbitmq.py declares, gone (a failed run leaves none)."""
    import aio_pika

    conn = await aio_pika.connect(url)
    async with conn:
        channel = await conn.channel()
        await channel.queue_delete("orders")
        await channel.exchange_delete("shop")


def _drop_redis_stream() -> None:
    import redis

    with redis.Redis.from_url(redis_url()) as client:
        client.delete("outbox:orders")


@pytest.mark.slow
def test_brokers_page_top_to_bottom(
    db_dsn: str, empty_db_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_event.py's event read back from RabbitMQ, both webhook receivers (a wrong secret
    refused and dead-lettered first), the routing rules, the inbox twice, and billing's Redis
    consumer invoicing the relayed event once."""
    page = "docs/brokers.md"
    env = _env(db_dsn)
    monkeypatch.setenv("OUTBOXKIT_DSN", db_dsn)
    write_event = _block(page, "# write_event.py")
    _run(write_event, tmp_path, env)
    event = _newest(db_dsn)
    assert (event["topic"], event["key"], event["status"]) == (
        "orders",
        "customer-42",
        Status.PENDING,
    )

    # RabbitMQ: the queue bound first, then the relay, then Enter.
    amqp = rabbitmq_url()
    asyncio.run(_drop_rabbitmq_objects(amqp))
    reader = Program(_block(page, "# read_rabbitmq.py"), tmp_path, env)
    try:
        until(lambda: "queue bound" in reader.output(), reader, "the queue to be bound")
        _relay(db_dsn, f"{amqp}?exchange=shop")
        reader.type("")
        reader.wait_ok()
    finally:
        reader.close()
        asyncio.run(_drop_rabbitmq_objects(amqp))
    assert f"{event['event_id']} order.placed" in reader.output(), reader.output()
    assert (
        "'tenant': 'acme'" in reader.output()
        and '{"order_id":1001,"total":4200}' in reader.output()
    )

    # The webhook receivers: a relay with another secret is refused (401, dead-lettered),
    # the receiver's own secret is accepted and the event printed.
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    monkeypatch.setenv("ORDERS_HOOK_SECRET", secret)
    monkeypatch.setenv("WRONG_SECRET", "whsec_" + base64.b64encode(os.urandom(32)).decode())
    for marker in ("# receiver.py", "# receiver_raw.py"):
        port = free_port()
        receiver_env = {**env, "ORDERS_HOOK_SECRET": secret, "PORT": str(port)}
        receiver = Program(_block(page, marker), tmp_path, receiver_env)
        try:
            until(partial(port_accepts, port), receiver, f"the receiver on port {port}")
            hook = f"http://127.0.0.1:{port}/outbox/{{topic}}"
            for secret_env in ("WRONG_SECRET", "ORDERS_HOOK_SECRET"):
                _exec(write_event, {})  # the same snippet again, in-process (faster)
                sent = _newest(db_dsn)
                _relay(db_dsn, f"{hook}?secret_env={secret_env}")
                after = rows(db_dsn, f"event_id = '{sent['event_id']}'")
                if secret_env == "WRONG_SECRET":
                    assert [r["status"] for r in after] == [Status.FAILED], after
                    assert "HTTP 401" in after[0]["last_error"]
                    assert str(sent["event_id"]) not in receiver.output()
                else:
                    assert after == [], after  # published (and deleted: the relay's retention)
                    printed = f"order.placed {sent['event_id']}"
                    assert printed in receiver.output(), receiver.output()
        finally:
            receiver.close()  # it serves until killed

    # Routing: the rules of the page, as the embedded relay's publisher applies them.
    routing = _exec(_block(page, "RoutingPublisher(from_url("), {"dsn": db_dsn})
    assert isinstance(routing["relay"], Relay)
    memory = MemoryOutbox()
    with memory.transaction() as tx:
        memory.put(tx, Event(topic="shop", event_type="order.placed", payload={}))
        memory.put(
            tx,
            Event(
                topic="shop", event_type="customer.renamed", payload={}, aggregate_type="customer"
            ),
        )
        memory.put(tx, Event(topic="shop", event_type="stock.low", payload={}))
    routed = [routing["publisher"].destination(m) for m in memory.outbound()]
    assert routed == ["orders", "customers", "shop"]

    # The inbox in the reader's own transaction: the same event twice, one invoice.
    migrate_inbox(db_dsn)  # the page's `outboxkit migrate --inbox`
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE invoices (order_id int, total int)")
        event_id = uuid.uuid4()
        for _ in range(2):
            _exec(_block(page, "inbox = Inbox()"), {"conn": conn, "event_id": event_id})
        assert conn.execute("SELECT order_id, total FROM invoices").fetchall() == [(1001, 4200)]
        assert conn.execute("SELECT consumer_name, event_id FROM processed_events").fetchall() == [
            ("billing", event_id)
        ]

    # Billing's Redis consumer, running, invoices the event write_event.py wrote and the
    # relay appended to outbox:orders, once.
    redis_url()  # the machine's Redis, or a skip
    _drop_redis_stream()
    billing_env = {**env, "BILLING_DSN": empty_db_dsn}
    consumer = Program(_block(page, "# consume_orders.py"), tmp_path, billing_env)
    try:
        until(lambda: "invoices" in _tables(empty_db_dsn), consumer, "billing's tables")
        _exec(write_event, {})
        sent = _newest(db_dsn)
        _relay(db_dsn, "redis://127.0.0.1:6379/0?stream_prefix=outbox:")
        printed = f"invoiced order 1001 (event {sent['event_id']})"
        until(lambda: printed in consumer.output(), consumer, "the invoice")
        consumer.stop()
        consumer.wait_ok()
    finally:
        consumer.close()
        _drop_redis_stream()
    with psycopg.connect(empty_db_dsn) as conn:
        assert conn.execute("SELECT order_id, total FROM invoices").fetchall() == [(1001, 4200)]
        assert conn.execute("SELECT event_id FROM processed_events").fetchall() == [
            (sent["event_id"],)
        ]


def _tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        found = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {row[0] for row in found}


# -- docs/django.md ---------------------------------------------------------------------------

DJANGO_PAGE = "docs/django.md"
DJANGO_BASE = """
# The page's "...": this project's own apps.
INSTALLED_APPS = ["django.contrib.contenttypes", "shop", "reports"] + [
    app for app in INSTALLED_APPS if app is not ...
]
OUTBOXKIT = {**_FIRST_OUTBOXKIT, **OUTBOXKIT}
SECRET_KEY = "doc-pages-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": %(name)r,
                         "USER": %(user)r, "PASSWORD": %(password)r, "HOST": %(host)r,
                         "PORT": %(port)r}}
"""


@pytest.mark.slow
def test_django_page(empty_db_dsn: str, tmp_path: Path) -> None:
    """A project built from the page's settings, app and view snippets: the view's event and
    task row commit with the order, the inbox applies a redelivered event once, and
    ``manage.py outboxkit_worker`` runs the framework task to SUCCESSFUL 5."""
    from psycopg.conninfo import conninfo_to_dict

    support = ROOT / "tests/support/doc_pages"
    params = conninfo_to_dict(empty_db_dsn)
    database = {k: str(params.get(k, "")) for k in ("user", "password", "host", "port")}
    settings = (
        _block(DJANGO_PAGE, '"outboxkit.contrib.django"]').code
        + "_FIRST_OUTBOXKIT = OUTBOXKIT\n"
        + _block(DJANGO_PAGE, "TASKS = {").code
        + DJANGO_BASE % {"name": params["dbname"], **database}
    )
    (tmp_path / "settings.py").write_text(settings)
    for app, tasks_block in (("shop", "# shop/tasks.py"), ("reports", "# reports/tasks.py")):
        (tmp_path / app).mkdir()
        (tmp_path / app / "__init__.py").write_text("")
        (tmp_path / app / "tasks.py").write_text(_block(DJANGO_PAGE, tasks_block).code)
    shutil.copy(support / "django_models.py", tmp_path / "shop/models.py")
    (tmp_path / "reports/models.py").write_text("")
    view_blocks = [
        _block(DJANGO_PAGE, m)
        for m in ("outbox.put(Event(", "tasks.enqueue(", "inbox.handle(", "add.enqueue(2, 3)")
    ]
    (tmp_path / "blocks.json").write_text(json.dumps([[str(b), b.code] for b in view_blocks]))
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
        "PYTHONUNBUFFERED": "1",
    }

    def run(*argv: str) -> str:
        done = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, f"{argv}:\n{done.stdout}{done.stderr}"
        return done.stdout

    run("-m", "django", "migrate", "--run-syncdb", "--verbosity", "0")
    written = json.loads(run(str(support / "django_run.py"), "write", "blocks.json"))
    assert written["status"] == "READY"
    with psycopg.connect(empty_db_dsn) as conn:
        assert conn.execute("SELECT id, total FROM shop_order ORDER BY id").fetchall() == [
            (1, 4200),
            (2, 4200),
        ]
        (event,) = conn.execute("SELECT event_type, key, payload FROM outbox").fetchall()
        assert event[:2] == ("order.placed", "1")
        assert json.loads(bytes(event[2])) == {"order_id": 1, "total": 4200}
        receipt = conn.execute(
            "SELECT payload, available_at - created_at > interval '9 seconds' FROM outboxkit_tasks"
            " WHERE task_name = 'receipt.send'"
        ).fetchall()
        assert receipt == [({"order_id": 2}, True)], receipt
        assert conn.execute("SELECT order_id, total FROM shop_invoice").fetchall() == [(1, 4200)]
        assert conn.execute("SELECT consumer_name FROM processed_events").fetchall() == [
            ("billing",)
        ]

    argv = [sys.executable, "-m", "django", "outboxkit_worker", "--poll-interval", "0.2"]
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while _task_status(empty_db_dsn, written["id"]) != TaskStatus.DONE:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    assert json.loads(run(str(support / "django_run.py"), "result", written["id"])) == {
        "status": "SUCCESSFUL",
        "value": 5,
    }


# The page's MariaDB server, as this test's private mariadbd.
PAGE_MYSQL = '"HOST": "db", "PORT": "3306",\n                         "USER": "app", "NAME": "shop"'
DJANGO_MARIADB_BASE = """
INSTALLED_APPS = ["reports"] + [app for app in INSTALLED_APPS if app is not ...]
OUTBOXKIT = {**_FIRST_OUTBOXKIT, **OUTBOXKIT}
SECRET_KEY = "doc-pages-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
"""
# The page's view block, then its result read again once the worker ran it.
DJANGO_MARIADB_RUN = """
import json, sys, time
import django
django.setup()
exec(compile(open(sys.argv[1]).read(), sys.argv[2], "exec"))
print(json.dumps({"id": str(result.id), "status": result.status.name}), flush=True)
sys.stdin.readline()  # the worker ran it
result.refresh()
print(json.dumps({"status": result.status.name, "value": result.return_value}))
"""


@pytest.mark.slow
def test_django_page_on_mariadb(mariadb_server: Any, tmp_path: Path) -> None:
    """The page's Tasks framework snippets on its MariaDB ``DATABASES`` entry (the private
    mariadbd): ``manage.py migrate`` makes the task table, the view's ``add.enqueue(2, 3)``
    is committed with its block, ``manage.py outboxkit_worker`` runs it to SUCCESSFUL 5."""
    driver_module("MySQLdb")  # Django's mysql backend (a failure under REQUIRE_SERVICES)
    url = new_database(mariadb_server)
    args = connect_args(url)
    ours = '"HOST": {host!r}, "PORT": "{port}", "USER": {user!r}, "NAME": {database!r}'
    mysql = _block(DJANGO_PAGE, "django.db.backends.mysql").code
    assert mysql.count(PAGE_MYSQL) == 1, mysql
    settings = (
        _block(DJANGO_PAGE, '"outboxkit.contrib.django"]').code
        + "_FIRST_OUTBOXKIT = OUTBOXKIT\n"
        + _block(DJANGO_PAGE, "TASKS = {").code
        + DJANGO_MARIADB_BASE
        + mysql.replace(PAGE_MYSQL, ours.format(**args).replace("'", '"'))
    )
    (tmp_path / "settings.py").write_text(settings)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/__init__.py").write_text("")
    (tmp_path / "reports/tasks.py").write_text(_block(DJANGO_PAGE, "# reports/tasks.py").code)
    view = _block(DJANGO_PAGE, "add.enqueue(2, 3)")
    (tmp_path / "view.py").write_text(view.code)
    (tmp_path / "run.py").write_text(DJANGO_MARIADB_RUN)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "settings", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}  # fmt: skip
    migrate = [sys.executable, "-m", "django", "migrate", "--verbosity", "0"]
    done = subprocess.run(
        migrate, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    viewer = subprocess.Popen(
        [sys.executable, "run.py", "view.py", str(view)],
        cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    worker = None
    try:
        assert viewer.stdout is not None and viewer.stdin is not None
        written = json.loads(viewer.stdout.readline())
        assert written["status"] == "READY"
        log = tmp_path / "worker.log"
        argv = [sys.executable, "-m", "django", "outboxkit_worker", "--poll-interval", "0.2"]
        with log.open("wb") as out:
            worker = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out,
                                      stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 60
        status = f"SELECT status FROM outboxkit_tasks WHERE id = {int(written['id'])}"
        while mariadb_execute(url, status) != [(TaskStatus.DONE,)]:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        viewer.stdin.write("\n")
        viewer.stdin.flush()
        assert json.loads(viewer.stdout.readline()) == {"status": "SUCCESSFUL", "value": 5}
    finally:
        viewer.kill()
        viewer.wait(timeout=30)
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)


def _task_status(dsn: str, task_id: str) -> int | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT status FROM outboxkit_tasks WHERE id::text = %s", (task_id,))
        found = row.fetchone()
    return None if found is None else int(found[0])


ALEMBIC_ENV = """
from alembic import context
from sqlalchemy import MetaData, create_engine

target_metadata = MetaData()
engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
{configure}
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""


@pytest.mark.slow
def test_django_page_alembic(empty_db_dsn: str, tmp_path: Path) -> None:
    """The page's revision upgrades to the outbox and inbox tables, its env.py hook keeps
    `alembic check` from seeing them as drift, and the downgrade drops them."""
    from alembic import command
    from alembic.config import Config

    configure = _block(DJANGO_PAGE, "context.configure(").code
    (tmp_path / "env.py").write_text(
        ALEMBIC_ENV.format(configure=textwrap.indent(configure, "    "))
    )
    (tmp_path / "script.py.mako").write_text("")
    (tmp_path / "versions").mkdir()
    (tmp_path / "versions/0001_outbox.py").write_text(_block(DJANGO_PAGE, "def upgrade():").code)
    config = Config()
    config.set_main_option("script_location", str(tmp_path))
    url = empty_db_dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))

    def tables() -> tuple[Any, ...]:
        with psycopg.connect(empty_db_dsn) as conn:
            found = conn.execute("SELECT to_regclass('outbox'), to_regclass('processed_events')")
            return tuple(str(t) if t else None for t in found.fetchone() or ())

    command.upgrade(config, "head")
    assert tables() == ("outbox", "processed_events")
    command.check(config)  # no drift: the hook leaves outboxkit's tables out of autogenerate
    command.downgrade(config, "base")
    assert tables() == (None, None)


# -- docs/tasks.md ----------------------------------------------------------------------------

TASKS_PAGE = "docs/tasks.md"
# The names the page's snippets take from the reader's module: its payload models, and the
# child task the fan-in's snippet enqueues (keeping its value for the callback).
TASKS_PRELUDE = """
from pydantic import BaseModel

from outboxkit import Event
from outboxkit.tasks import TaskContext, Tasks


class Report(BaseModel):
    report_id: int = 0


class Summary(BaseModel):
    pages: int


class Mail(BaseModel):
    to: str


class Charge(BaseModel):
    order_id: int
    amount: int


class Image(BaseModel):
    path: str


tasks = Tasks()


@tasks.handler("image.resize", keep_result=True)
def resize(image: Image) -> int:
    return len(image.path)
"""


def _reader(**names: Any) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(TASKS_PRELUDE, namespace)  # noqa: S102
    return {**namespace, **names}


@contextlib.contextmanager
def _worker_thread(tasks: Tasks, dsn: str) -> Iterator[None]:
    """A ``Worker`` of ``tasks`` on its own event loop and thread (a snippet may block its
    own thread in ``tasks.wait``), finished tasks kept to be read back."""
    worker = Worker(tasks, dsn, poll_interval=0.1, retention="keep")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(worker.run(),))
    thread.start()
    try:
        yield
    finally:
        loop.call_soon_threadsafe(worker.stop)
        thread.join(timeout=30)
        loop.close()
    assert not thread.is_alive()


def _task_rows(dsn: str, name: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT status, attempts, last_error FROM outboxkit_tasks WHERE task_name = %s"
            " ORDER BY id",
            (name,),
        )
        return found.fetchall()


def _until_done(dsn: str, name: str, n: int = 1) -> list[tuple[Any, ...]]:
    """The tasks named ``name`` once at least ``n`` exist and all are done (none failed)."""
    deadline = time.monotonic() + 30
    while True:
        found = _task_rows(dsn, name)
        if len(found) >= n and all(r[0] == TaskStatus.DONE for r in found):
            return found
        failed = [r for r in found if r[0] == TaskStatus.FAILED]
        assert not failed and time.monotonic() < deadline, found
        time.sleep(0.05)


@pytest.mark.slow
def test_tasks_page(db_dsn: str) -> None:
    """Each snippet's handler registered, its task enqueued in a PostgreSQL transaction and
    run by a Worker: the generator done once, the typed enqueue's wrong payload refused
    while its transaction goes on, the charge and its event committed with the completion,
    the results read and waited for, the fan-in's callback after its children, and the
    periodic task's missed slot run once."""
    migrate_tasks(db_dsn)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    with psycopg.connect(db_dsn) as conn:
        # Handlers and payloads: the handler's options taken, its task run.
        first = _exec(_block(TASKS_PAGE, '@tasks.handler("report.generate", retry='), _reader())
        options = first["tasks"].types["report.generate"]
        assert (options.max_attempts, options.timeout) == (5, 120)
        first["generate"].enqueue(conn, first["Report"](report_id=1))
        conn.commit()
        with _worker_thread(first["tasks"], db_dsn):
            _until_done(db_dsn, "report.generate")

        # The typed enqueue: the right payload enqueued, the wrong one refused at run time
        # too, the transaction going on; then the results, read and waited for.
        typed_block = _block(TASKS_PAGE, "task_id = generate.enqueue(conn,")
        typed = _reader(conn=conn)
        with pytest.raises(InvalidTaskError) as refused:
            exec(compile(typed_block.code, str(typed_block), "exec"), typed)  # noqa: S102
        tb, lines = refused.tb, []
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(typed_block):
                lines.append(tb.tb_lineno)
            tb = tb.tb_next
        (raised,) = [typed_block.code.splitlines()[n - 1] for n in lines]
        assert raised.startswith('generate.enqueue(conn, Mail(to="x"))'), raised
        conn.commit()
        results = _block(TASKS_PAGE, "result = tasks.result(conn, task_id)")
        namespace = {**typed, "task_id": typed["task_id"], "dsn": db_dsn}
        with _worker_thread(typed["tasks"], db_dsn):
            program = compile(results.code, str(results), "exec", flags)
            asyncio.run(eval(program, namespace))  # noqa: S307
        conn.rollback()
        assert (namespace["result"].status, namespace["result"].attempts) == ("done", 1)
        assert namespace["result"].finished_at is not None

        # Effects that happen once: the charge and its event commit with the completion.
        conn.execute("CREATE TABLE charges (order_id int, amount int)")
        conn.commit()
        charging = _exec(_block(TASKS_PAGE, '@tasks.handler("invoice.charge")'), _reader())
        charging["tasks"].enqueue(conn, "invoice.charge", {"order_id": 7, "amount": 4200})
        conn.commit()
        with _worker_thread(charging["tasks"], db_dsn):
            _until_done(db_dsn, "invoice.charge")
        assert conn.execute("SELECT order_id, amount FROM charges").fetchall() == [(7, 4200)]
        conn.rollback()
    (event,) = rows(db_dsn)
    assert (event["topic"], event["event_type"]) == ("billing", "charged")

    # Dependencies: two children and the callback in one transaction; the callback runs
    # after both, reading their results.
    fan_in = _reader(paths=["a.png", "b.png"])
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        _exec(_block(TASKS_PAGE, "children = [resize.enqueue("), {**fan_in, "conn": conn})
    with _worker_thread(fan_in["tasks"], db_dsn):
        _until_done(db_dsn, "album.publish")
    assert [r[0] for r in _task_rows(db_dsn, "image.resize")] == [TaskStatus.DONE] * 2
    with psycopg.connect(db_dsn) as conn:
        order = conn.execute(
            "SELECT min(started_at) FILTER (WHERE task_name = 'album.publish')"
            " >= max(finished_at) FILTER (WHERE task_name = 'image.resize') FROM outboxkit_tasks"
        ).fetchone()
    assert order == (True,)

    # Periodic tasks: a schedule whose last slot was 20 minutes ago runs the latest missed
    # slot once (catch_up="last").
    periodic = _exec(_block(TASKS_PAGE, "@tasks.periodic("), _reader())
    (schedule,) = periodic["tasks"].schedules
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outboxkit_schedules (schedule, slot) VALUES"
            " (%s, date_bin('5 minutes', now(), 'epoch') - interval '20 minutes')",
            (schedule,),
        )
    before = len(_task_rows(db_dsn, "report.generate"))
    with _worker_thread(periodic["tasks"], db_dsn):
        ran = len(_until_done(db_dsn, "report.generate", before + 1)) - before
    with psycopg.connect(db_dsn) as conn:
        slots = conn.execute(
            "SELECT count(*) FROM outboxkit_schedules WHERE schedule = %s", (schedule,)
        ).fetchone()
    # One run per slot: the latest missed one (and the next, had a boundary just passed).
    assert ran in (1, 2) and slots == (1 + ran,), (ran, slots)


# -- docs/mariadb.md --------------------------------------------------------------------------

MARIADB_PAGE = "docs/mariadb.md"
# The page's connection to the reader's server, as this test's private mariadbd.
PAGE_CONNECT = 'pymysql.connect(host="db", user="app", database="shop")'


def _on_server(block: Block, url: str) -> Block:
    """``block`` connecting to ``url``'s database instead of the page's ``db`` host."""
    args = connect_args(url)
    ours = "pymysql.connect(host={host!r}, port={port!r}, user={user!r}, database={database!r})"
    assert block.code.count(PAGE_CONNECT) == 1, block
    code = block.code.replace(PAGE_CONNECT, ours.format(**args))
    return Block(block.line, block.lang, code, block.not_runnable, block.page)


def _release_after_a_failed_wait(url: str, blocker: Any) -> None:
    """``blocker``'s locks released once a transaction that waited on them gave up (the
    retry loop's first attempt): its next attempt then goes through. One connection polls
    (a second's wait, innodb_lock_wait_timeout, is seen about seven times)."""
    query = "SELECT trx_id FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
    seen: set[Any] = set()
    deadline = time.monotonic() + 20
    with pymysql.connect(**connect_args(url), autocommit=True) as poll, poll.cursor() as cur:
        while time.monotonic() < deadline:
            cur.execute(query)
            waiting = {row[0] for row in cur.fetchall()}
            if seen - waiting:  # one that waited stopped waiting: it timed out
                break
            seen |= waiting
            # InnoDB refreshes innodb_trx only when it went unread for 100 ms: a faster
            # poll reads the same rows forever.
            time.sleep(0.15)
    blocker.rollback()


@pytest.mark.slow
def test_mariadb_page(mariadb_server: Any) -> None:
    """On the private mariadbd: the order and its event commit together, the retry loop
    runs its transaction again after a lock wait timeout and commits the next order with its
    event once, and the task enqueued with PyMySQL
    is run by a Worker, its handler's row committed with the completion."""
    url = new_database(mariadb_server)
    migrate_mariadb(url, kind="tasks", table="outboxkit_tasks")
    mariadb_execute(url, "CREATE TABLE orders (id INT PRIMARY KEY, total INT)")
    mariadb_execute(url, "CREATE TABLE sent (to_addr VARCHAR(255))")

    write = _exec(_on_server(_block(MARIADB_PAGE, "outbox.put(conn, Event("), url), {})
    # The retry loop meets a real conflict first: another transaction's next-key lock on
    # the outbox's end holds its INSERT past a 1 s lock wait (1205), then goes.
    with write["conn"].cursor() as cur:
        cur.execute("SET SESSION innodb_lock_wait_timeout = 1")
    blocker = pymysql.connect(**connect_args(url))
    with blocker.cursor() as cur:
        cur.execute("SELECT id FROM outbox WHERE id > 0 FOR UPDATE")
    release = threading.Thread(target=_release_after_a_failed_wait, args=(url, blocker))
    release.start()
    try:
        retry = _block(MARIADB_PAGE, "except TransactionConflictError:")
        retried = _exec(retry, {**write, "order_id": 43, "total": 4200})
    finally:
        release.join(timeout=30)
        blocker.close()
        write["conn"].close()
    # At least one attempt met the conflict and the loop ran the transaction again (one, as
    # a rule; two if the machine was too slow to see the first wait end).
    assert retried["attempt"] >= 1
    assert mariadb_execute(url, "SELECT id, total FROM orders ORDER BY id") == [
        (42, None),
        (43, 4200),
    ]
    assert mariadb_execute(url, "SELECT event_type, payload FROM outbox ORDER BY id") == [
        ("order.placed", b'{"id":42}'),
        ("order.placed", b'{"id":43}'),
    ]

    enqueue = _exec(_on_server(_block(MARIADB_PAGE, '@tasks.handler("mail.send")'), url), {})
    enqueue["conn"].close()
    ((task_id,),) = mariadb_execute(url, "SELECT id FROM outboxkit_tasks")

    async def work() -> None:
        worker = Worker(enqueue["tasks"], url, poll_interval=0.1, retention="keep")
        running = asyncio.create_task(worker.run())
        try:
            await wait_for(
                lambda: (
                    mariadb_execute(url, "SELECT status FROM outboxkit_tasks")
                    == [(TaskStatus.DONE,)]
                ),
                what="the mail task done",
            )
        finally:
            worker.stop()
            await running

    asyncio.run(work())
    assert mariadb_execute(url, "SELECT to_addr FROM sent") == [("a@example.com",)]
    assert mariadb_execute(url, "SELECT id, attempts FROM outboxkit_tasks") == [(task_id, 1)]
