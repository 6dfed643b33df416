"""Every connection the library opens: one factory (sync and async), and the admin commands' one.

One place for the connect timeout and the ``application_name`` each part of outboxkit shows
in ``pg_stat_activity`` (``outboxkit-relay:claim``, ``outboxkit-admin``, ...), so an
operator can tell them apart and a dead server is noticed after the same time everywhere.

It is also where a connection pooler is recognised (README, "Behind PgBouncer"): a
transaction pooler (PgBouncer's ``pool_mode = transaction``) gives each transaction
whichever server connection is free, so session state does not follow the client, and
before PgBouncer 1.21 (``max_prepared_statements``) neither do prepared statements:
psycopg's automatic ones (``prepare_threshold``) then fail with ``prepared statement
"_pg3_0" does not exist``. A DSN may say what sits in front of PostgreSQL
(``?pooler=transaction``, :data:`POOLER_MODES`); otherwise the first connection to a DSN
finds out (:func:`detect_pooling`) and the answer is kept for the process.
"""

from __future__ import annotations

import re
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.generators import execute

from outboxkit._text import first_line

# (re-exported: PoolerMode is configuration, named by Relay/Worker, so it lives in ports.py)
from outboxkit.backends.ports import POOLER_MODES as POOLER_MODES
from outboxkit.backends.ports import PoolerMode as PoolerMode
from outboxkit.backends.ports import pooler_mode as pooler_mode
from outboxkit.backends.postgres._read_ahead import connection_class
from outboxkit.errors import ConfigurationError

#: A DSN, or an open autocommit connection to reuse (the dashboard keeps a few).
Source = str | psycopg.Connection[Any]

#: Seconds a connection attempt may take before it fails (libpq's ``connect_timeout``).
CONNECT_TIMEOUT = 10
#: The admin commands' connections (status, replay, purge, migrate, partitions, inbox purge).
ADMIN_APPLICATION_NAME = "outboxkit-admin"


@dataclass(frozen=True, slots=True)
class Pooling:
    """What the server connection behind a DSN keeps between two transactions.

    ``pooler``: something other than PostgreSQL answered the connection. ``session_state``:
    session advisory locks, LISTEN and ``SET`` stay with this client (false behind a
    transaction pooler). ``prepared``: named prepared statements do.
    """

    mode: PoolerMode
    pooler: bool
    session_state: bool
    prepared: bool


_MODES: dict[PoolerMode, Pooling] = {
    "none": Pooling("none", False, True, True),
    "session": Pooling("session", True, True, True),
    "transaction": Pooling("transaction", True, False, False),
    "transaction-prepared": Pooling("transaction-prepared", True, False, True),
}
#: What the first connection to each DSN found (``auto``), for the rest of the process.
_DETECTED: dict[str, Pooling] = {}
_KEYWORD = re.compile(r"(?:^|\s)pooler\s*=\s*('[^']*'|\S*)")


def split_pooler(dsn: str) -> tuple[str, PoolerMode]:
    """``dsn`` without its ``pooler`` option (libpq knows no such option), and that mode."""
    mode = "auto"
    if dsn.startswith(("postgresql://", "postgres://")):
        parts = urllib.parse.urlsplit(dsn)
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        kept = [(k, v) for k, v in query if k != "pooler"]
        if len(kept) != len(query):
            mode = [v for k, v in query if k == "pooler"][-1]
            dsn = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept)))
    elif match := _KEYWORD.search(dsn):
        mode = match.group(1).strip("'")
        dsn = (dsn[: match.start()] + dsn[match.end() :]).strip()
    return dsn, pooler_mode(mode)


def known_pooling(dsn: str, pooler: PoolerMode | None = None) -> Pooling | None:
    """What ``dsn`` (or ``pooler``, which overrides its option) says or a connection found."""
    bare, mode = split_pooler(dsn)
    mode = pooler_mode(pooler) if pooler else mode
    return _MODES[mode] if mode != "auto" else _DETECTED.get(bare)


def _options(
    application_name: str, autocommit: bool, connect_timeout: int, known: Pooling | None
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "autocommit": autocommit,
        "connect_timeout": connect_timeout,
        "application_name": application_name[:63],  # what PostgreSQL keeps of a name
    }
    if known is not None and not known.prepared:
        options["prepare_threshold"] = None  # psycopg's switch: no named prepared statements
    return options


def connect(
    dsn: str,
    *,
    application_name: str,
    autocommit: bool = True,
    connect_timeout: int = CONNECT_TIMEOUT,
    pooler: PoolerMode | None = None,
) -> psycopg.Connection[Any]:
    """A psycopg connection named ``application_name`` (it overrides one in the DSN).

    Behind a pooler that keeps no prepared statements it prepares none
    (``prepare_threshold=None``); ``pooler`` overrides the DSN's ``?pooler=``.
    """
    bare, mode = split_pooler(dsn)
    mode = pooler_mode(pooler) if pooler else mode
    known = _MODES[mode] if mode != "auto" else _DETECTED.get(bare)
    conn = psycopg.connect(bare, **_options(application_name, autocommit, connect_timeout, known))
    if known is None:
        try:
            with conn.lock:
                known = _DETECTED[bare] = conn.wait(detect_pooling(conn))
        except BaseException:
            conn.close()
            raise
        _apply(conn, known)
    return conn


async def aconnect(
    dsn: str,
    *,
    application_name: str,
    autocommit: bool = True,
    connect_timeout: int = CONNECT_TIMEOUT,
    pooler: PoolerMode | None = None,
    libpq: Mapping[str, Any] | None = None,
) -> psycopg.AsyncConnection[Any]:
    """The async twin of :func:`connect`. ``libpq``: more connection parameters (the
    relay's TCP keepalives), each only if the DSN does not set it."""
    bare, mode = split_pooler(dsn)
    mode = pooler_mode(pooler) if pooler else mode
    known = _MODES[mode] if mode != "auto" else _DETECTED.get(bare)
    options = _options(application_name, autocommit, connect_timeout, known)
    if libpq:
        given = conninfo_to_dict(bare)
        options.update({k: v for k, v in libpq.items() if k not in given})
    conn = await connection_class.connect(bare, **options)
    if known is None:
        try:
            async with conn.lock:
                known = _DETECTED[bare] = await conn.wait(detect_pooling(conn))
        except BaseException:
            await conn.close()
            raise
        _apply(conn, known)
    return conn


def _apply(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], known: Pooling) -> None:
    if not known.prepared:
        conn.prepare_threshold = None


def detect_pooling(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> Any:
    """What sits behind ``conn``, as a generator for ``conn.wait()`` (sync and async alike).

    A pooler answers the connection itself: the backend pid it gives the client (its
    cancel key) is not the pid of the server process that runs the statements. A session
    pooler looks the same from here and is taken for a transaction pooler (the safe side:
    say ``pooler=session``). Whether it keeps prepared statements: a named statement
    prepared through the protocol keeps its name on the server when the pooler passes it
    on (PgBouncer before 1.21: lost with the server connection), and is renamed when the
    pooler manages them (1.21+ ``max_prepared_statements``). Two round trips for
    PostgreSQL itself; four behind a pooler, in one transaction that leaves nothing behind
    (the caller's, when one is open: then the probe's statement is deallocated in it).
    """
    pgconn = conn.pgconn
    begin = pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    (result,) = yield from _run(pgconn, b"SELECT pg_backend_pid()")
    pid = int(result.get_value(0, 0) or 0)
    if pid == pgconn.backend_pid:
        return _MODES["none"]
    name = b"outboxkit_pooler_probe_" + uuid.uuid4().hex[:12].encode()
    text = b"SELECT 1 /* " + name + b" */"  # (hex: nothing to quote)
    if begin:
        yield from _run(pgconn, b"BEGIN")
    try:
        pgconn.send_prepare(name, text)
        _check((yield from execute(pgconn)))
        (found,) = yield from _run(
            pgconn, b"SELECT name FROM pg_prepared_statements WHERE statement = '" + text + b"'"
        )
        if name in [found.get_value(i, 0) for i in range(found.ntuples)]:
            # Passed on as it came, so lost with the server connection: drop it now.
            yield from _run(pgconn, b"DEALLOCATE " + name)
            prepared = False
        else:
            prepared = True
    finally:
        if begin:
            yield from _run(pgconn, b"ROLLBACK")
    return _MODES["transaction-prepared" if prepared else "transaction"]


def _run(pgconn: Any, query: bytes) -> Any:
    pgconn.send_query(query)
    results = yield from execute(pgconn)
    _check(results)
    return results


def _check(results: list[Any]) -> None:
    for result in results:
        if result.status not in (
            psycopg.pq.ExecStatus.COMMAND_OK,
            psycopg.pq.ExecStatus.TUPLES_OK,
        ):
            raise psycopg.errors.error_from_result(result)


@contextmanager
def admin_connection(
    source: Source, table_missing: Callable[[], Exception]
) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection (``source`` itself if it is one, left open).

    A statement that finds no table raises ``table_missing()``, the error that says which
    migration creates it, instead of psycopg's "relation does not exist".
    """
    try:
        if isinstance(source, psycopg.Connection):
            yield source
            return
        with connect(source, application_name=ADMIN_APPLICATION_NAME) as conn:
            yield conn
    except pg_errors.UndefinedTable:
        raise table_missing() from None


# -- configuration faults: what a restart does not fix ----------------------------------

# An unknown database (SQLSTATE 3D000), an unknown role or a refused host (28000), a wrong
# password (28P01). libpq reports them at connect without a SQLSTATE, so its FATAL message
# is read too. Anything else at start (a refused port, a timeout) is an outage and retried.
_CONFIGURATION_FAULTS = {
    "3D000": "check the database name in --dsn (or create it)",
    "28000": "check the user name in --dsn and pg_hba.conf",
    "28P01": "check the password in --dsn",
}
_FATAL_MESSAGES = (
    (re.compile(r'database "[^"]*" does not exist'), "3D000"),
    (re.compile(r'role "[^"]*" does not exist|no pg_hba\.conf entry'), "28000"),
    (re.compile(r"password authentication failed"), "28P01"),
)


#: A word psycopg's parse error quotes: the password itself, unless it is an option's name.
_QUOTED = re.compile(r'"([^"]*)"')


def check_dsn(dsn: str, *, name: str = "the relay's dsn") -> None:
    """Refuse a DSN libpq cannot parse, at once and in one line, naming it ``name``.

    It failed later as a traceback from a side task, with psycopg's reason quoting the
    password ("invalid percent-encoded token: \"S3cret%ZZ\""): a quoted word is masked
    unless it is one of the DSN's option names, which says what is wrong ("sslmodex").
    """
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        option_names = set(re.findall(r"([A-Za-z_]+)\s*=", dsn))

        def mask(m: re.Match[str]) -> str:
            word = m.group(1)
            return m.group(0) if word in option_names or not word.strip("=") else '"***"'

        reason = _QUOTED.sub(mask, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        hint = (
            "in a postgresql:// URL, percent-encode the user name and password"
            " (% as %25, @ as %40, : as %3A, / as %2F)"
            if "percent" in reason
            # No user@ in the example: the line's redaction would mask it as a password.
            else "write a URL such as postgresql://db.example:5432/shop?user=app"
            " or libpq key=value pairs"
        )
        raise ConfigurationError(
            f"{name} is not a valid PostgreSQL connection string: {reason}; {hint}"
        ) from None


def configuration_fault(exc: BaseException) -> str | None:
    """What to fix when ``exc`` is a configuration error no retry cures, or None."""
    state = getattr(exc, "sqlstate", None)
    if state is None:
        text = str(exc)
        state = next((code for pattern, code in _FATAL_MESSAGES if pattern.search(text)), None)
    return _CONFIGURATION_FAULTS.get(state) if state else None


def refusal(exc: BaseException) -> ConfigurationError | None:
    """The one-line error for a database that refuses the relay for good, or None (an
    outage: retried)."""
    fault = configuration_fault(exc)
    if fault is None:
        return None
    return ConfigurationError(f"the database refused the relay: {first_line(exc)} — {fault}")


async def check_database(dsn: str, *, application_name: str) -> None:
    """Connect once: a database that refuses us for good raises :func:`refusal`'s error;
    an unreachable one is left to the caller's own reconnects."""
    try:
        conn = await aconnect(dsn, application_name=application_name)
    except psycopg.OperationalError as exc:
        if (refused := refusal(exc)) is not None:
            raise refused from None
        return
    await conn.close()
