"""Every statement of the MariaDB/MySQL backend, by name; table names through :func:`quote`.

MariaDB has no ``UPDATE … RETURNING`` (10.x), no partial indexes, no arrays and no
NOTIFY: the claim is a ``SELECT … FOR UPDATE SKIP LOCKED`` then an ``UPDATE`` of those
ids in one short transaction; id lists are expanded into ``IN (%s, …)`` here; times are
``UTC_TIMESTAMP(6)`` (the columns are UTC ``DATETIME(6)``).
"""

from __future__ import annotations

import re
import urllib.parse
import zlib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from outboxkit.errors import ConfigurationError

Kind = Literal["outbox", "inbox", "ordered", "tasks", "fleet"]
SCHEMES = ("mysql", "mariadb")
PENDING, PUBLISHED, FAILED = 0, 1, 2
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,63}$")
_FILE = re.compile(r"^(?P<version>\d{4})_[a-z0-9_]+\.sql$")
#: Where the applied schema versions are recorded (one row per kind, table and version).
VERSIONS_TABLE = "outboxkit_schema_versions"

NOW = "UTC_TIMESTAMP(6)"
#: Ordered mode: key partitions by default and at most (a SMALLINT column, as PostgreSQL's).
DEFAULT_PARTITIONS = 64
MAX_PARTITIONS = 32767
#: An ordered write's key lock is one of 65 536 rows (the migration creates them all).
KEY_SLOT_MASK = 0xFFFF


def quote(name: str) -> str:
    """``name`` (``table`` or ``database.table``) as a quoted identifier; refused if unusual."""
    parts = name.split(".")
    if len(parts) > 2 or not all(_NAME.match(p) for p in parts):
        raise ConfigurationError(
            f"table name {name!r} is not a plain MariaDB identifier (letters, digits, _ and $,"
            " at most 64, optionally database-qualified): choose another name"
        )
    return ".".join(f"`{p}`" for p in parts)


def is_mysql_url(dsn: str) -> bool:
    """Whether ``dsn`` names a MariaDB/MySQL server (``mysql://`` or ``mariadb://``)."""
    return dsn.split("://", 1)[0].lower() in SCHEMES if "://" in dsn else False


def connect_args(dsn: str) -> dict[str, Any]:
    """PyMySQL/aiomysql keyword arguments from ``mysql://user:password@host:port/database``."""
    url = urllib.parse.urlsplit(dsn)
    if url.scheme.lower() not in SCHEMES:
        raise ConfigurationError(
            f"not a MariaDB/MySQL URL (mysql:// or mariadb://): {url.scheme}://…"
        )
    database = urllib.parse.unquote(url.path.lstrip("/"))
    if not database:
        raise ConfigurationError(
            "the MariaDB URL names no database: give mysql://USER@HOST:PORT/DATABASE"
        )
    args: dict[str, Any] = {
        "host": url.hostname or "127.0.0.1",
        "port": url.port or 3306,
        "user": urllib.parse.unquote(url.username or "root"),
        "database": database,
        "charset": "utf8mb4",
    }
    if url.password:
        args["password"] = urllib.parse.unquote(url.password)
    return args


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema version of one kind of table, as its file holds it."""

    kind: Kind
    version: int
    name: str
    template: str

    def statements(self, slots: dict[str, str]) -> list[str]:
        """The statements with their placeholders filled (quoted identifiers, constants)."""
        script = self.template.format(**slots)
        return [s.strip() for s in script.split(";\n") if s.strip() and not _comment(s)]


def _comment(text: str) -> bool:
    return all(line.lstrip().startswith("--") or not line.strip() for line in text.splitlines())


def migrations(kind: Kind) -> list[Migration]:
    """The files of ``kind`` in version order, header comments left out."""
    folder = resources.files(__package__).joinpath("migrations", kind)
    found = []
    for entry in folder.iterdir():
        match = _FILE.match(entry.name)
        if match:
            text = entry.read_text(encoding="utf-8")
            body = text.split("\n\n", 1)[1]  # the header ends at the first blank line
            found.append(Migration(kind, int(match["version"]), entry.name, body))
    return sorted(found, key=lambda m: m.version)


def slots(kind: Kind, table: str, partitions: int = DEFAULT_PARTITIONS) -> dict[str, str]:
    """The placeholders of ``kind``'s files for ``table`` (``partitions``: ordered mode's P)."""
    bare = table.split(".")[-1]
    if kind == "inbox":
        return {"table": quote(table), "index_processed_at": quote(f"{bare}_processed_at")}
    if kind == "fleet":
        return {"table": quote(table), "index_owner": quote(f"{bare}_owner")}
    if kind == "tasks":
        from outboxkit.backends.mariadb.tasks_sql import tasks_slots

        return tasks_slots(table)
    if kind == "ordered":
        return {
            "table": quote(table),
            "partitions_table": quote(sibling(table, "partitions")),
            "relays_table": quote(sibling(table, "relays")),
            "key_locks_table": quote(sibling(table, "key_locks")),
            "index_ordered": quote(f"{bare}_ordered"[:64]),
            "index_key_head": quote(f"{bare}_key_head"[:64]),
            "index_pending_id": quote(f"{bare}_pending_id"[:64]),
            "index_key_status": quote(f"{bare}_key_status"[:64]),
            "partitions": str(check_partitions(partitions)),
            "hex_digit": HEX_DIGIT,
        }
    return {
        "table": quote(table),
        "index_pending": quote(f"{bare}_pending"),
        "index_published": quote(f"{bare}_published"),
        "pending": str(PENDING),
    }


#: The 16 rows 0..15 the key-lock tables are filled from (65 536 rows: four of them joined).
HEX_DIGIT = "(" + " UNION ALL ".join(f"SELECT {n} AS n" for n in range(16)) + ")"


def sibling(table: str, suffix: str) -> str:
    """Ordered mode's table ``<table>_<suffix>`` beside ``table`` (same database)."""
    *database, bare = table.split(".")
    return ".".join([*database, f"{bare}_{suffix}"[:64]])


def check_partitions(partitions: int) -> int:
    """P, refused unless an integer from 1 to MAX_PARTITIONS (a SMALLINT)."""
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise ConfigurationError(f"partitions must be an integer, not {partitions!r}")
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ConfigurationError(f"partitions must be from 1 to {MAX_PARTITIONS}, not {partitions}")
    return partitions


def key_slot(key: str) -> int:
    """The row of ``<table>_key_locks`` an ordered write of ``key`` locks (CRC32, 16 bits)."""
    return zlib.crc32(key.encode("utf-8")) & KEY_SLOT_MASK


CREATE_VERSIONS = f"""
CREATE TABLE IF NOT EXISTS {VERSIONS_TABLE} (
    kind       VARCHAR(32) NOT NULL,
    table_name VARCHAR(130) NOT NULL,
    version    INT NOT NULL,
    applied_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (kind, table_name, version)
) ENGINE = InnoDB
"""
APPLIED_VERSIONS = f"SELECT version FROM {VERSIONS_TABLE} WHERE kind = %s AND table_name = %s"
RECORD_VERSION = (
    f"INSERT IGNORE INTO {VERSIONS_TABLE} (kind, table_name, version) VALUES (%s, %s, %s)"
)
FORGET_VERSIONS = f"DELETE FROM {VERSIONS_TABLE} WHERE kind = %s AND table_name = %s"
#: One version's record, when a later file is reversed and the table stays.
FORGET_VERSION = FORGET_VERSIONS + " AND version = %s"
#: Serialises concurrent `outboxkit migrate` runs (a session lock, released at once after).
#: ``Outbox.transaction()``: the longest query this session's server takes (read-only in
#: a session, so read once per connection: write/mariadb_packet.py).
MAX_ALLOWED_PACKET = "SELECT @@max_allowed_packet"
MIGRATE_LOCK = "SELECT GET_LOCK('outboxkit_migrate', 60)"
MIGRATE_UNLOCK = "SELECT RELEASE_LOCK('outboxkit_migrate')"


def ids_in(count: int) -> str:
    """``IN (%s, …)`` with ``count`` placeholders (MariaDB has no array parameter)."""
    return "IN (" + ",".join(["%s"] * count) + ")"


class Statements:
    """The relay's statements on one outbox table (names as in
    outboxkit.backends.postgres.postgres)."""

    def __init__(self, table: str = "outbox") -> None:
        self.table = table
        t = quote(table)
        # The claim, step 1, in a READ COMMITTED transaction: lock one batch of due pending
        # rows, skipping those another claim holds. READ COMMITTED so the claim sees rows
        # committed after a previous claim's snapshot (REPEATABLE READ is the default).
        pending_index = quote(table.split(".")[-1] + "_pending")
        self.claim_lock = (
            f"SELECT id, attempts, claim_token, last_error FROM {t} FORCE INDEX ({pending_index})"
            f" WHERE status = {PENDING} AND available_at <= {NOW}"
            " ORDER BY available_at, id LIMIT %s FOR UPDATE SKIP LOCKED"
        )
        # Every statement on a list of ids reads them by primary key, forced: on a near-empty
        # table (a relay keeping up) the optimizer would scan the whole table instead, and a
        # locking scan waits on rows other relays hold: two settles (or a claim's lease and a
        # settle) then waited on each other, error 1213 (test_mariadb_claim_plan.py).
        by_id = f"{t} FORCE INDEX (PRIMARY)"
        # Step 2 (same transaction): available_at is both the retry time and the lease;
        # a fresh claim_token fences every later settle.
        self.claim_lease = (
            f"UPDATE {by_id} SET attempts = attempts + 1,"
            f" available_at = {NOW} + INTERVAL %s MICROSECOND,"
            " claim_token = %s, claimed_by = %s WHERE id {ids}"
        )
        # The crash-loop guard: a row claimed max_attempts times and never settled (each
        # claimer died on it) is dead-lettered by the claim, not handed to the next victim.
        self.claim_dead = (
            f"UPDATE {by_id} SET status = {FAILED}, claim_token = NULL, claimed_by = %s,"
            " last_error = %s WHERE id {ids}"
        )
        # Step 3 (same transaction): the leased rows (OutboundMessage's field order after id).
        self.claim_read = (
            "SELECT id, event_id, topic, `key`, event_type, aggregate_type, aggregate_id,"
            " payload, headers, created_at, attempts, COALESCE(occurred_at, created_at),"
            f" schema_version FROM {by_id} WHERE id {{ids}} ORDER BY id"
        )
        self.claim_read_dead = (
            f"SELECT id, event_id, LEFT(topic, 200), LEFT(event_type, 200), created_at, attempts"
            f" FROM {by_id} WHERE id {{ids}} ORDER BY id"
        )
        # Settles, fenced by the claim token: a row another claim took since is left alone.
        self.fenced_ids = f"SELECT id FROM {by_id} WHERE id {{ids}} AND claim_token = %s"
        self.settle_published_delete = (
            f"DELETE {t} FROM {by_id} WHERE id {{ids}} AND claim_token = %s"
        )
        self.settle_published_keep = (
            f"UPDATE {by_id} SET status = {PUBLISHED}, published_at = {NOW}, claim_token = NULL,"
            " last_error = NULL WHERE id {ids} AND claim_token = %s"
        )
        # One failure (retry, dead letter or hand-back: its own delay, error and refund).
        self.settle_failure = (
            f"UPDATE {t} SET status = %s, available_at = {NOW} + INTERVAL %s MICROSECOND,"
            " last_error = %s, claim_token = NULL, attempts = GREATEST(attempts - %s, 0)"
            " WHERE id = %s AND claim_token = %s"
        )
        self.release_leases = (
            f"UPDATE {by_id} SET available_at = {NOW}, claim_token = NULL,"
            " attempts = GREATEST(attempts - 1, 0) WHERE id {ids} AND claim_token = %s"
        )
        self.extend_leases = (
            f"UPDATE {by_id} SET available_at = {NOW} + INTERVAL %s MICROSECOND"
            " WHERE id {ids} AND claim_token = %s"
        )
        self.hasten_handed_back = (
            f"UPDATE {by_id} SET available_at = {NOW} WHERE id {{ids}} AND status = {PENDING}"
            f" AND claim_token IS NULL AND available_at > {NOW}"
        )
        self.count_pending_capped = (
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE status = {PENDING} LIMIT %s) AS p"
        )
        self.check_columns = (
            "SELECT id, event_id, topic, `key`, event_type, aggregate_type, aggregate_id,"
            " payload, headers, status, attempts, available_at, claim_token, claimed_by,"
            f" last_error, created_at, published_at, occurred_at, schema_version FROM {t} LIMIT 0"
        )
        # The write: one multi-row INSERT per put (the caller's transaction).
        self.insert_columns = (
            f"INSERT INTO {t} (event_id, topic, `key`, event_type, aggregate_type, aggregate_id,"
            " payload, headers, available_at, occurred_at, schema_version) VALUES "
        )
        self.insert_row = f"(%s, %s, %s, %s, %s, %s, %s, %s, COALESCE(%s, {NOW}), %s, %s)"


def with_ids(statement: str, count: int) -> str:
    """``statement`` with its ``{ids}`` filled for ``count`` ids."""
    return statement.replace("{ids}", ids_in(count))


#: The write's values of one row, in the INSERT's column order (as ``insert_row``).
_ROW_VALUES = (*["%s"] * 8, f"COALESCE(%s, {NOW})", "%s", "%s")


def insert_ordered(table: str, rows: int, slots: int) -> str:
    """Ordered mode's write of ``rows`` events whose keys lock ``slots`` rows (parameters:
    the slots, then each row's values).

    The lock rows are read FOR UPDATE in a derived table the INSERT joins: MariaDB
    materialises it (it aggregates) before the first row is produced, so every key is
    locked before any row takes its AUTO_INCREMENT id, and the locks last until COMMIT or
    ROLLBACK. A second writer of the key waits there and takes its ids after the first
    committed: one key's ids follow its commit order (tests/integration/
    test_mariadb_ordered_write.py shows the naive INSERT breaking it).
    """
    names = [f"c{i}" for i in range(len(_ROW_VALUES))]
    first = "SELECT " + ", ".join(f"{v} AS {n}" for v, n in zip(_ROW_VALUES, names, strict=True))
    rest = [" UNION ALL SELECT " + ", ".join(_ROW_VALUES) + f", {i}" for i in range(1, rows)]
    locks = quote(sibling(table, "key_locks"))
    # (o: the events' order, so their ids follow it as in the plain multi-row INSERT)
    return (
        f"INSERT INTO {quote(table)} (event_id, topic, `key`, event_type, aggregate_type,"
        " aggregate_id, payload, headers, available_at, occurred_at, schema_version)"
        f" SELECT {', '.join('v.' + n for n in names)}"
        f" FROM (SELECT COUNT(*) AS n FROM {locks} FORCE INDEX (PRIMARY)"
        f" WHERE slot {ids_in(slots)} FOR UPDATE) AS l,"
        f" ({first}, 0 AS o{''.join(rest)}) AS v ORDER BY v.o"
    )
