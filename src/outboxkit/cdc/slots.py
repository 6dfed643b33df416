"""The replication slot and publication of an outbox: set up, reported on, dropped.

`setup` checks everything it can before it changes anything (wal_level, the role's
privileges, free slots, the table) and says what to change; `status` reports the slot's lag
in bytes and in seconds and whether the server invalidated it; `drop` removes both.
All of it runs on an ordinary (psycopg 3) connection: no extra is needed.
"""

from __future__ import annotations

import datetime as dt
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outboxkit.backends.postgres import cdc_sql
from outboxkit.backends.postgres._connection import connect
from outboxkit.backends.postgres.postgres import DEFAULT_TABLE, parse_table, quote_table
from outboxkit.cdc import pgoutput
from outboxkit.cdc.errors import (
    CdcSetupError,
    SlotInvalidated,
    invalidated_message,
    refuse_without_wal,
)
from outboxkit.errors import PgoutputError

#: How long `status` may spend measuring the lag in seconds before it gives up on that figure.
LAG_PROBE_TIMEOUT_MS = 10_000

WAL_LEVEL_FIX = (
    "set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and "
    "restart PostgreSQL (on a managed service: RDS/Aurora rds.logical_replication = 1 in the "
    "parameter group, Cloud SQL cloudsql.logical_decoding = on, Azure wal_level = logical "
    "in the server parameters)"
)


def default_name(table: str) -> str:
    """The slot and publication name of an outbox: `outboxkit_<table>` (a valid slot name)."""
    name = "outboxkit_" + table.replace(".", "_").lower()
    return name if len(name) <= 63 else f"outboxkit_{zlib.crc32(table.encode()):08x}"


def _connect(dsn: str) -> psycopg.Connection[dict[str, Any]]:
    refuse_without_wal(dsn)  # (a mysql:// URL: one line, not libpq's parse error)
    conn = connect(dsn, application_name="outboxkit-cdc")
    conn.row_factory = dict_row
    return conn


# --------------------------------------------------------------------------- setup


@dataclass(frozen=True, slots=True)
class SetupResult:
    table: str
    slot: str
    publication: str
    created_publication: bool
    created_slot: bool
    slot_lsn: str | None  # where the new slot starts (None: it existed)


def check(dsn: str, table: str = DEFAULT_TABLE, *, slot: str | None = None) -> list[str]:
    """Every reason `setup` would fail, each with what to do; empty when it can run. Read-only."""
    parse_table(table)
    slot = slot or default_name(table)
    with _connect(dsn) as conn:
        return _problems(conn, table, slot)


def _problems(conn: psycopg.Connection[dict[str, Any]], table: str, slot: str) -> list[str]:
    settings = conn.execute(cdc_sql.CDC_SERVER_SETTINGS).fetchone()
    role = conn.execute(cdc_sql.CDC_ROLE_PRIVILEGES, {"table": table}).fetchone()
    assert settings is not None
    assert role is not None
    problems = []
    if settings["wal_level"] != "logical":
        problems.append(
            f"wal_level is {settings['wal_level']!r}, and logical decoding needs 'logical': "
            f"{WAL_LEVEL_FIX}"
        )
    exists = conn.execute(cdc_sql.CDC_SLOT, {"slot": slot}).fetchone() is not None
    if not exists and settings["slots_in_use"] >= settings["max_replication_slots"]:
        problems.append(
            f"all {settings['max_replication_slots']} replication slots are taken "
            f"(max_replication_slots = {settings['max_replication_slots']}): drop one no "
            "longer used (SELECT slot_name, active FROM pg_replication_slots; then "
            "SELECT pg_drop_replication_slot('<name>')) or raise max_replication_slots in "
            "postgresql.conf and restart PostgreSQL"
        )
    if settings["max_wal_senders"] < 1:
        problems.append(
            "max_wal_senders is 0, so no replication connection can stream the slot: set "
            "max_wal_senders = 10 in postgresql.conf and restart PostgreSQL"
        )
    who = settings["role"]
    if not (role["superuser"] or role["replication"]):
        problems.append(
            f"role {who!r} may not create or stream a replication slot: as a superuser run "
            f"ALTER ROLE {who} WITH REPLICATION (RDS/Aurora: GRANT rds_replication TO {who}; "
            f"Cloud SQL: ALTER ROLE {who} WITH REPLICATION as cloudsqlsuperuser)"
        )
    if not role["table_exists"]:
        problems.append(
            f"outbox table {table!r} not found in database {settings['database']!r}: run "
            f"`outboxkit migrate --table {table}` first"
        )
    elif not (role["superuser"] or role["owns_table"]):
        problems.append(
            f"role {who!r} does not own table {table!r}, and a publication FOR TABLE needs "
            f"its owner: run `outboxkit cdc setup` as the role that ran `outboxkit migrate`, "
            f"or ALTER TABLE {table} OWNER TO {who}"
        )
    if not (role["superuser"] or role["create_on_database"]):
        problems.append(
            f"role {who!r} may not create a publication in database "
            f"{settings['database']!r}: GRANT CREATE ON DATABASE {settings['database']} TO {who}"
        )
    return problems


def setup(
    dsn: str,
    table: str = DEFAULT_TABLE,
    *,
    slot: str | None = None,
    publication: str | None = None,
) -> SetupResult:
    """Create the publication (inserts of `table`) and the pgoutput slot; idempotent.

    Raises `CdcSetupError` listing every problem found, before changing anything.
    """
    schema, name = parse_table(table)
    quoted = quote_table(schema, name)
    slot = slot or default_name(table)
    publication = publication or default_name(table)
    with _connect(dsn) as conn:
        problems = _problems(conn, table, slot)
        if problems:
            raise CdcSetupError(
                f"cannot set up logical replication for outbox {table!r}: "
                + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
            )
        existing = conn.execute(
            cdc_sql.CDC_PUBLICATION, {"table": table, "publication": publication}
        ).fetchone()
        created_publication = existing is None
        if existing is None:
            conn.execute(
                cdc_sql.render(
                    cdc_sql.CDC_CREATE_PUBLICATION, table=quoted, publication=publication
                )
            )
        elif not existing["has_table"]:
            conn.execute(
                cdc_sql.render(
                    cdc_sql.CDC_PUBLICATION_ADD_TABLE, table=quoted, publication=publication
                )
            )
        if not (existing is None or existing["inserts"]):
            raise CdcSetupError(
                f"publication {publication!r} exists but does not publish inserts: "
                f"ALTER PUBLICATION {publication} SET (publish = 'insert')"
            )
        row = conn.execute(cdc_sql.CDC_SLOT, {"slot": slot}).fetchone()
        lsn = None
        if row is None:
            created = conn.execute(cdc_sql.CDC_CREATE_SLOT, {"slot": slot}).fetchone()
            assert created is not None
            lsn = created["lsn"]
        else:
            _check_existing_slot(row, slot, table)
    return SetupResult(table, slot, publication, created_publication, row is None, lsn)


def _check_existing_slot(row: dict[str, Any], slot: str, table: str) -> None:
    info = row["slot"]
    if info.get("plugin") != "pgoutput" or info.get("slot_type") != "logical":
        raise CdcSetupError(
            f"replication slot {slot!r} exists but is not a logical pgoutput slot "
            f"(type {info.get('slot_type')}, plugin {info.get('plugin')}): drop it "
            f"(SELECT pg_drop_replication_slot('{slot}')) or name another with --slot"
        )
    if _invalidated(info):
        raise SlotInvalidated(invalidated_message(slot, table, _since(info)))


# --------------------------------------------------------------------------- status


@dataclass(slots=True)
class SlotStatus:
    """What `outboxkit cdc status` reports; `as_dict()` is its JSON."""

    table: str
    slot: str
    publication: str
    exists: bool = False
    publication_exists: bool = False
    publication_has_table: bool = False
    active: bool = False
    active_pid: int | None = None
    database: str | None = None
    confirmed_flush_lsn: str | None = None
    restart_lsn: str | None = None
    current_lsn: str | None = None
    lag_bytes: int | None = None
    lag_seconds: float | None = None
    oldest_unconfirmed_commit: str | None = None
    retained_bytes: int | None = None
    wal_status: str | None = None
    safe_wal_size: int | None = None
    max_slot_wal_keep_size: str | None = None
    invalidation_reason: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def invalidated(self) -> bool:
        return self.wal_status == "lost" or self.invalidation_reason is not None

    @property
    def problem(self) -> str | None:
        """The one thing wrong that needs a person, with what to do; None when healthy."""
        if not self.exists:
            return (
                f"replication slot {self.slot!r} does not exist: run `outboxkit cdc setup "
                f"--table {self.table}`"
            )
        if self.invalidated:
            return invalidated_message(self.slot, self.table, self.oldest_unconfirmed_commit)
        if not self.publication_exists or not self.publication_has_table:
            return (
                f"publication {self.publication!r} does not carry table {self.table!r}: run "
                f"`outboxkit cdc setup --table {self.table}`"
            )
        return None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["invalidated"] = self.invalidated
        data["problem"] = self.problem
        return data


def status(
    dsn: str,
    table: str = DEFAULT_TABLE,
    *,
    slot: str | None = None,
    publication: str | None = None,
    measure_seconds: bool = True,
) -> SlotStatus:
    """The slot's state and lag. Lag in seconds is the age of the oldest transaction the slot
    has not confirmed (0 when none is waiting), read from a temporary copy of the slot."""
    parse_table(table)
    report = SlotStatus(table, slot or default_name(table), publication or default_name(table))
    with _connect(dsn) as conn:
        pub = conn.execute(
            cdc_sql.CDC_PUBLICATION, {"table": table, "publication": report.publication}
        ).fetchone()
        report.publication_exists = pub is not None
        report.publication_has_table = bool(pub and pub["has_table"])
        row = conn.execute(cdc_sql.CDC_SLOT, {"slot": report.slot}).fetchone()
        if row is None:
            return report
        info = row["slot"]
        report.exists = True
        report.active = bool(info.get("active"))
        report.active_pid = info.get("active_pid")
        report.database = info.get("database")
        report.confirmed_flush_lsn = info.get("confirmed_flush_lsn")
        report.restart_lsn = info.get("restart_lsn")
        report.current_lsn = row["current_lsn"]
        report.lag_bytes = row["lag_bytes"]
        report.retained_bytes = row["retained_bytes"]
        report.wal_status = info.get("wal_status")
        report.safe_wal_size = info.get("safe_wal_size")
        report.max_slot_wal_keep_size = row["max_slot_wal_keep_size"]
        report.invalidation_reason = info.get("invalidation_reason")
        if report.max_slot_wal_keep_size == "-1":
            report.notes.append(
                "max_slot_wal_keep_size = -1 (unlimited): with no relay confirming, the slot "
                "keeps WAL until the disk of pg_wal is full and PostgreSQL stops; set a limit "
                "(docs/operations.md, 'Sizing max_slot_wal_keep_size')"
            )
        if report.invalidated:
            report.oldest_unconfirmed_commit = _since(info)
            return report
        if measure_seconds:
            _measure_lag_seconds(dsn, report, row["now"])
    return report


def _measure_lag_seconds(dsn: str, report: SlotStatus, now: dt.datetime) -> None:
    copy = f"outboxkit_probe_{uuid.uuid4().hex[:12]}"
    try:
        with _connect(dsn) as conn:
            conn.execute(cdc_sql.CDC_PROBE_TIMEOUT, {"ms": str(LAG_PROBE_TIMEOUT_MS)})
            conn.execute(cdc_sql.CDC_COPY_SLOT, {"slot": report.slot, "copy": copy})
            first = conn.execute(
                cdc_sql.CDC_PEEK_FIRST, {"copy": copy, "publication": report.publication}
            ).fetchone()
    except psycopg.Error as exc:
        report.notes.append(f"lag in seconds not measured: {str(exc).strip().splitlines()[0]}")
        return
    if first is None:
        report.lag_seconds = 0.0
        return
    try:
        message = pgoutput.Decoder().decode(bytes(first["data"]))
    except PgoutputError as exc:
        report.notes.append(f"lag in seconds not measured: {exc}")
        return
    if isinstance(message, pgoutput.Begin):
        report.oldest_unconfirmed_commit = message.commit_time.isoformat()
        report.lag_seconds = max(0.0, (now - message.commit_time).total_seconds())
    else:  # a non-transactional message first: no commit time to measure from
        report.notes.append("lag in seconds not measured: the oldest change has no commit time")


def _invalidated(info: dict[str, Any]) -> bool:
    return info.get("wal_status") == "lost" or info.get("invalidation_reason") is not None


def _since(info: dict[str, Any]) -> str | None:
    """When the invalidated slot stopped being read, as far as the server tells."""
    if info.get("inactive_since"):
        position = info.get("confirmed_flush_lsn")
        return f"the relay stopped at {info['inactive_since']} (slot position {position})"
    if info.get("confirmed_flush_lsn"):
        return f"WAL position {info['confirmed_flush_lsn']}"
    return None


def check_streamable(dsn: str, table: str = DEFAULT_TABLE, *, slot: str | None = None) -> None:
    """Raise `SlotInvalidated` (with the recovery steps) if the slot can never stream again."""
    report = status(dsn, table, slot=slot, measure_seconds=False)
    if report.exists and report.invalidated:
        raise SlotInvalidated(report.problem or "")


# --------------------------------------------------------------------------- drop


@dataclass(frozen=True, slots=True)
class DropResult:
    slot: str
    publication: str
    dropped_slot: bool
    dropped_publication: bool


def drop(
    dsn: str,
    table: str = DEFAULT_TABLE,
    *,
    slot: str | None = None,
    publication: str | None = None,
    force: bool = False,
) -> DropResult:
    """Drop the slot (the WAL it held is freed) and the publication; idempotent.

    A slot a relay streams is refused unless `force`, which ends that relay's connection.
    """
    schema, name = parse_table(table)
    slot = slot or default_name(table)
    publication = publication or default_name(table)
    with _connect(dsn) as conn:
        row = conn.execute(cdc_sql.CDC_SLOT, {"slot": slot}).fetchone()
        dropped_slot = False
        if row is not None:
            info = row["slot"]
            if info.get("active") and not force:
                raise CdcSetupError(
                    f"replication slot {slot!r} is streamed by process {info.get('active_pid')}"
                    " (a running relay): stop the relays first, or pass --force to end its "
                    "connection"
                )
            _drop_slot(conn, slot)
            dropped_slot = True
        pub = conn.execute(
            cdc_sql.CDC_PUBLICATION, {"table": table, "publication": publication}
        ).fetchone()
        if pub is not None:
            conn.execute(
                cdc_sql.render(
                    cdc_sql.CDC_DROP_PUBLICATION,
                    table=quote_table(schema, name),
                    publication=publication,
                )
            )
    return DropResult(slot, publication, dropped_slot, pub is not None)


def _drop_slot(conn: psycopg.Connection[dict[str, Any]], slot: str) -> None:
    import time

    deadline = time.monotonic() + 10
    while True:
        conn.execute(cdc_sql.CDC_TERMINATE_SLOT_USER, {"slot": slot})
        try:
            conn.execute(cdc_sql.CDC_DROP_SLOT, {"slot": slot})
            return
        except psycopg.errors.ObjectInUse:  # the ended WAL sender has not let go yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        except psycopg.errors.UndefinedObject:  # dropped meanwhile
            return
