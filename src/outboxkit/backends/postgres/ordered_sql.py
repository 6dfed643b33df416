"""Ordered mode's SQL: the partition schema, the per-key claim, partition leases, fenced settles.

Opt-in (``outboxkit migrate --ordered``): an outbox without it has no partition column,
no extra index and no lease tables, and its relay runs the statements of ``postgres.py``.
Every key hashes into one of P partitions (a stored generated column); live relays divide
the partitions through ``<table>_relays`` heartbeats and ``<table>_partitions`` leases,
and a relay claims a key's rows only in a partition it holds, only in commit (id) order.
"""

from __future__ import annotations

from typing import Any

from psycopg import sql

from outboxkit.backends.postgres._connection import (
    ADMIN_APPLICATION_NAME,
    Source,
    admin_connection,
    connect,
)
from outboxkit.backends.postgres.migrations import migration_files
from outboxkit.backends.postgres.postgres import (
    CLAIM_LEASE,
    CLAIM_RETURNING,
    DEAD_ON_CLAIM,
    DEFAULT_TABLE,
    FAILURES_UPDATE,
    PUBLISHED_SET,
    SqlTemplate,
    Statements,
    parse_table,
    quote_table,
    schema_slots,
    table_identifier,
)
from outboxkit.errors import SchemaError

DEFAULT_PARTITIONS = 64
MAX_PARTITIONS = 32767  # a smallint

# The ordered-mode schema: the files of backends/postgres/migrations/ordered/ (the partition column,
# its indexes, the lease tables), filled in by ordered_slots.
ORDERED_SCHEMA = "\n".join(f.template for f in migration_files("ordered"))
# Whether the outbox has ordered mode's column (`migrate --ordered`, blocked_keys).
PARTITION_COLUMN_EXISTS = """
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s)
               AND attname = 'partition' AND attnum > 0 AND NOT attisdropped)
"""
LIVE_RELAYS = "SELECT relay_id FROM {relays_table} WHERE expires_at > now() ORDER BY relay_id"
# The column's expression, to read P back: "(mod(... , (64)::bigint))::smallint".
PARTITION_EXPRESSION = """
SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef AS d
JOIN pg_attribute AS a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
WHERE d.adrelid = to_regclass(%s) AND a.attname = 'partition' AND NOT a.attisdropped
"""
# Changing P: the column's expression cannot be altered in place before PostgreSQL 17;
# dropping it drops its indexes too, and ORDERED_SCHEMA then rebuilds everything.
REPARTITION = """
ALTER TABLE {table} DROP COLUMN IF EXISTS partition;
DROP TABLE IF EXISTS {partitions_table};
"""

# A keyed row is claimable only when every earlier row of its key that is not published
# is claimable too: none is leased (in flight: available_at > now()), waiting for a retry
# or its deliver_at (available_at > now()), or dead-lettered while the policy is block.
# Claimable rows are taken in id order, so a batch holds a prefix of each key's rows: the
# relay publishes them in waves. Rows are claimed only in partitions this relay holds
# (owner, not draining) with at least %(margin)s seconds of lease left: its publish
# ends before the lease can pass to another relay.
#
# The scan is bounded: only the first %(scan)s available keyed rows (in id order) of
# those partitions are looked at (an earlier available row of a key is always among
# them), so a claim while every key's head is in flight costs a few thousand index
# probes, not the whole backlog. Per key, one walk of the (key, id) index from its
# oldest row up to its last scanned row finds the first blocking row (usually the first
# row read: the head in flight), so the cost is the scanned rows, not scanned x rows in
# flight. Rows are locked after they were chosen; one that could not be locked (SKIP
# LOCKED) or changed meanwhile drops out with every later row of its key, so what is
# returned is still a prefix per key.
#
# Keyless rows keep the unordered claim (a share of the batch). A row claimed
# max_attempts times without a settle (the relay died or hung publishing it every time)
# or too large to load is dead-lettered by the claim, and under block the later rows of
# its key in this claim are left alone.
ORDERED_CLAIM = (
    """
WITH mine AS MATERIALIZED (
    SELECT coalesce(array_agg(partition), '{{}}') AS parts FROM {partitions_table}
    WHERE owner = %(relay_id)s AND expires_at > now() + make_interval(secs => %(margin)s)
      AND NOT (partition = ANY(%(draining)s::smallint[]))
), scanned AS MATERIALIZED (
    SELECT o.id, o.key FROM {table} AS o
    WHERE o.status = {pending} AND o.partition IS NOT NULL
      AND o.partition = ANY((SELECT parts FROM mine)::smallint[]) AND o.available_at <= now()
    ORDER BY o.id
    LIMIT %(scan)s
), blockers AS MATERIALIZED (
    SELECT k.key, (
        SELECT e.id FROM {table} AS e
        WHERE e.key = k.key AND e.key IS NOT NULL AND e.id < k.last
          AND e.status IN ({pending}, {failed})
          AND (e.status = {pending} AND e.available_at > now()
               OR e.status = {failed} AND %(block)s)
        ORDER BY e.id
        LIMIT 1
    ) AS first_block
    FROM (SELECT key, max(id) AS last FROM scanned GROUP BY key) AS k
), chosen AS MATERIALIZED (
    SELECT s.id, s.key FROM scanned AS s JOIN blockers AS b ON b.key = s.key
    WHERE b.first_block IS NULL OR s.id < b.first_block
    ORDER BY s.id
    LIMIT %(limit)s
), locked AS MATERIALIZED (
    SELECT o.id, o.key, o.attempts, {oversized} AS oversized FROM {table} AS o
    WHERE o.id = ANY(ARRAY(SELECT id FROM chosen))
      AND o.status = {pending} AND o.available_at <= now()
    ORDER BY o.id
    FOR UPDATE OF o SKIP LOCKED
), gaps AS (
    SELECT c.key, min(c.id) AS first_missing FROM chosen AS c
    WHERE NOT EXISTS (SELECT 1 FROM locked AS l WHERE l.id = c.id)
    GROUP BY c.key
), keyed AS MATERIALIZED (
    SELECT l.* FROM locked AS l LEFT JOIN gaps AS g ON g.key = l.key
    WHERE g.key IS NULL OR l.id < g.first_missing
), keyless AS MATERIALIZED (
    SELECT id, key, attempts, {oversized} AS oversized FROM {table}
    WHERE status = {pending} AND key IS NULL AND available_at <= now()
    ORDER BY available_at, id
    LIMIT greatest(%(limit)s - (SELECT count(*) FROM keyed), %(limit)s / 4)
    FOR UPDATE SKIP LOCKED
), batch AS (
    SELECT * FROM keyed UNION ALL SELECT * FROM keyless
), dead AS ("""
    + DEAD_ON_CLAIM
    + """), dead_keys AS (
    SELECT key, min(id) AS first_dead FROM batch
    WHERE key IS NOT NULL AND (oversized IS NOT NULL OR attempts >= %(max_attempts)s)
    GROUP BY key
), claimed AS ("""
    + CLAIM_LEASE
    + """WHERE o.id = ANY(ARRAY(
    SELECT b.id FROM batch AS b LEFT JOIN dead_keys AS x ON x.key = b.key
    WHERE b.oversized IS NULL AND b.attempts < %(max_attempts)s
      AND (x.key IS NULL OR NOT %(block)s OR b.id < x.first_dead)))
  AND {commit_named}"""
    + CLAIM_RETURNING
    + ") SELECT *, NULL::text FROM claimed UNION ALL SELECT * FROM dead"
)
# A keyed row's settle also needs this relay's lease on the row's partition, unexpired:
# once the lease is gone another relay may publish the key, and the late settle of the
# old owner must change nothing (claimed_by is the relay whose claim the token names).
_LEASE_HELD = """(o.partition IS NULL OR EXISTS (
    SELECT 1 FROM {partitions_table} AS l
    WHERE l.partition = o.partition AND l.owner = o.claimed_by AND l.expires_at > now()))"""
_FENCED = f"o.claim_token = %s AND {_LEASE_HELD}"

FENCED_SETTLE_PUBLISHED_DELETE = (
    f"DELETE FROM {{table}} AS o WHERE o.id = ANY(%s) AND {_FENCED} AND {{commit_positional}}"
    " RETURNING o.id"
)
FENCED_SETTLE_PUBLISHED_KEEP = f"""
UPDATE {{table}} AS o
{PUBLISHED_SET}
WHERE o.id = ANY(%s) AND {_FENCED} AND {{commit_positional}}
RETURNING o.id
"""
FENCED_SETTLE_FAILURES = (
    FAILURES_UPDATE
    + f"""WHERE o.id = u.id AND {_FENCED} AND {{commit_positional}}
RETURNING o.id
"""
)
FENCED_RELEASE_LEASES = f"""
UPDATE {{table}} AS o
SET available_at = now(), claim_token = NULL, attempts = greatest(attempts - 1, 0)
WHERE o.id = ANY(%s) AND {_FENCED} AND {{commit_positional}}
"""
FENCED_EXTEND_LEASES = f"""
UPDATE {{table}} AS o
SET available_at = now() + make_interval(secs => %s)
WHERE o.id = ANY(%s) AND {_FENCED} AND {{commit_positional}}
"""

# Membership: one row per live relay, renewed every lease/3. The statement returns every
# live relay including this one (its own upsert is not visible to the statement's
# snapshot), and forgets relays dead for ten leases.
RELAY_HEARTBEAT = """
WITH beat AS (
    INSERT INTO {relays_table} (relay_id, expires_at)
    VALUES (%(relay_id)s, now() + make_interval(secs => %(lease)s))
    ON CONFLICT (relay_id) DO UPDATE SET expires_at = EXCLUDED.expires_at
    RETURNING relay_id
), gone AS (
    DELETE FROM {relays_table} WHERE expires_at < now() - make_interval(secs => 10 * %(lease)s)
)
SELECT relay_id FROM {relays_table} WHERE expires_at > now() AND relay_id <> %(relay_id)s
UNION SELECT relay_id FROM beat
ORDER BY 1
"""
# Take (free or expired) or renew the partitions this relay should hold; the epoch counts
# hand-overs. Returns the partitions held from now on.
ACQUIRE_PARTITIONS = """
UPDATE {partitions_table}
SET epoch = epoch + CASE WHEN owner IS DISTINCT FROM %(relay_id)s OR expires_at IS NULL
                              OR expires_at <= now() THEN 1 ELSE 0 END,
    owner = %(relay_id)s,
    expires_at = now() + make_interval(secs => %(lease)s)
WHERE partition = ANY(%(wanted)s::smallint[])
  AND (owner = %(relay_id)s OR owner IS NULL OR expires_at IS NULL OR expires_at <= now())
RETURNING partition
"""
RELEASE_PARTITIONS = """
UPDATE {partitions_table} SET owner = NULL, expires_at = NULL
WHERE partition = ANY(%(parts)s::smallint[]) AND owner = %(relay_id)s
"""
LEAVE = "DELETE FROM {relays_table} WHERE relay_id = %(relay_id)s"
# One process per relay id and table: the heartbeat's session holds this lock, so a second
# process started with the same --relay-id (it would share the first one's partitions and
# publish its keys beside it) is refused. Its own namespace: the writers' key locks use
# the table's oid, never this hash of the relays table's name.
RELAY_ID_LOCK = (
    "SELECT pg_try_advisory_lock(hashtext('outboxkit relay id ' || {relays_literal}),"
    " hashtext(%(relay_id)s))"
)
PARTITION_COUNT = "SELECT count(*) FROM {partitions_table}"
# Who holds what (status, tests, the dashboard).
PARTITION_OWNERS = """
SELECT partition, owner, epoch, expires_at > now() AS held FROM {partitions_table}
ORDER BY partition
"""
# Keys stopped behind a dead-lettered head (policy block): the head's error and how many
# events wait behind it. Reads the failed rows through the dead-letter index.
BLOCKED_KEYS = """
SELECT h.key, h.id, h.event_id, h.topic, h.event_type, h.attempts, h.last_error,
       h.created_at,
       (SELECT count(*) FROM {table} AS w
        WHERE w.key = h.key AND w.id > h.id AND w.status = {pending}) AS waiting
FROM (SELECT DISTINCT ON (key) key, id, event_id, topic, event_type, attempts, last_error,
             created_at
      FROM {table} WHERE status = {failed} AND key IS NOT NULL
      ORDER BY key, id) AS h
WHERE EXISTS (SELECT 1 FROM {table} AS w
              WHERE w.key = h.key AND w.id > h.id AND w.status = {pending})
ORDER BY h.id
LIMIT %(limit)s
"""


class OrderedStatements(Statements):
    """An outbox's statements in ordered mode: the base set, with fenced settles added.

    ``claim_batch`` is still the unordered claim (a relay without ``ordered=True``);
    the ordered relay runs ``ordered_claim`` and uses the ``fenced_*`` settles.
    """

    ordered_claim = SqlTemplate(ORDERED_CLAIM)
    fenced_settle_published_delete = SqlTemplate(FENCED_SETTLE_PUBLISHED_DELETE)
    fenced_settle_published_keep = SqlTemplate(FENCED_SETTLE_PUBLISHED_KEEP)
    fenced_settle_failures = SqlTemplate(FENCED_SETTLE_FAILURES)
    fenced_release_leases = SqlTemplate(FENCED_RELEASE_LEASES)
    fenced_extend_leases = SqlTemplate(FENCED_EXTEND_LEASES)
    relay_heartbeat = SqlTemplate(RELAY_HEARTBEAT)
    acquire_partitions = SqlTemplate(ACQUIRE_PARTITIONS)
    release_partitions = SqlTemplate(RELEASE_PARTITIONS)
    leave = SqlTemplate(LEAVE)
    relay_id_lock = SqlTemplate(RELAY_ID_LOCK)
    partition_count = SqlTemplate(PARTITION_COUNT)
    partition_owners = SqlTemplate(PARTITION_OWNERS)
    blocked_keys = SqlTemplate(BLOCKED_KEYS)
    live_relays = SqlTemplate(LIVE_RELAYS)

    #: The settles the ordered relay swaps in: (base name, fenced name), same parameters.
    FENCED = (
        ("settle_published_delete", "fenced_settle_published_delete"),
        ("settle_published_keep", "fenced_settle_published_keep"),
        ("settle_failures", "fenced_settle_failures"),
        ("release_leases", "fenced_release_leases"),
        ("extend_leases", "fenced_extend_leases"),
    )

    @classmethod
    def templates(cls) -> dict[str, SqlTemplate]:
        own = {k: v for k, v in vars(cls).items() if isinstance(v, SqlTemplate)}
        return {**Statements.templates(), **own}

    def _render(self, slots: dict[str, str]) -> None:
        schema, name = parse_table(self.table)
        self.partitions_table = quote_table(schema, f"{name}_partitions"[:63])
        self.relays_table = quote_table(schema, f"{name}_relays"[:63])
        self._slots = {
            **slots,
            "partitions_table": self.partitions_table,
            "relays_table": self.relays_table,
            "relays_literal": f"'{self.relays_table}'",  # a validated name: no quote inside
        }
        super()._render(self._slots)

    def ordered_ddl(self, partitions: int = DEFAULT_PARTITIONS) -> str:
        """The ordered-mode schema with ``partitions`` partitions (``--print-sql``)."""
        slots = ordered_slots(self.table, partitions)
        return "\n".join(f.render(slots) for f in migration_files("ordered")).strip() + "\n"

    def repartition_ddl(self) -> str:
        return REPARTITION.format(**self._slots).strip() + "\n"

    def format(self, template: str) -> str:
        return template.format(**self._slots).strip()


def ordered_slots(table: str, partitions: int = DEFAULT_PARTITIONS) -> dict[str, sql.Composable]:
    """The placeholders of the ordered-mode migration files for ``table`` and P."""
    schema, name = parse_table(table)
    return {
        **schema_slots(table),
        "partitions_table": table_identifier(schema, f"{name}_partitions"[:63]),
        "relays_table": table_identifier(schema, f"{name}_relays"[:63]),
        "index_key_head": sql.Identifier(f"{name}_key_head_idx"[:63]),
        "index_ordered": sql.Identifier(f"{name}_ordered_idx"[:63]),
        "index_keyless": sql.Identifier(f"{name}_keyless_idx"[:63]),
        "partitions": sql.Literal(check_partitions(int(partitions))),
    }


def check_partitions(partitions: int) -> int:
    if not isinstance(partitions, int) or not 1 <= partitions <= MAX_PARTITIONS:
        raise SchemaError(f"partitions must be an integer from 1 to {MAX_PARTITIONS}")
    return partitions


def blocked_keys(
    conninfo: Source, *, table: str = DEFAULT_TABLE, limit: int = 100
) -> list[dict[str, Any]]:
    """Keys stopped behind a dead-lettered head event (ordered mode, policy ``block``).

    Each: the key, the head row (id, event_id, topic, event_type, attempts, last_error,
    created_at) and ``waiting``, the pending events behind it. Empty on a table that is
    not ordered. Unblock a key with ``outboxkit replay --id`` (or discard) of its head.
    """
    stmts = OrderedStatements(table)
    with admin_connection(
        conninfo, lambda: SchemaError(f"outbox table {table!r} not found: run `outboxkit migrate`")
    ) as conn:
        exists = conn.execute(PARTITION_COLUMN_EXISTS, (stmts.qualified,)).fetchone()
        if not exists or not exists[0]:
            return []
        cur = conn.execute(stmts.blocked_keys, {"limit": limit})
        names = [d.name for d in cur.description or ()]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def partition_owners(conninfo: str, *, table: str = DEFAULT_TABLE) -> list[tuple[Any, ...]]:
    """(partition, owner, epoch, held) for every partition of an ordered outbox."""
    stmts = OrderedStatements(table)
    with connect(conninfo, application_name=ADMIN_APPLICATION_NAME) as conn:
        return list(conn.execute(stmts.partition_owners).fetchall())
