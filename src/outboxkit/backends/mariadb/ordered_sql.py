"""Ordered mode's statements on MariaDB/MySQL: the per-key claim's steps, partition leases,
settles fenced by the partition lease. Table names through ``sql.quote``.

MariaDB has no data-modifying CTE and no ``RETURNING`` on UPDATE, so the ordered claim is
a few short statements in one READ COMMITTED transaction (backends/mariadb/queue.py) where
PostgreSQL runs one (backends/postgres/ordered_sql.py); each statement sees its own snapshot, so the
claim checks the keys' earlier rows again after it locked its rows.
"""

from __future__ import annotations

from outboxkit.backends.mariadb.sql import FAILED, NOW, PENDING, ids_in, quote, sibling

#: The ordered claim looks at this many times the batch size of pending keyed rows.
SCAN_FACTOR = 4


class OrderedStatements:
    """The statements of ordered mode on one outbox table; ``{ids}``/``{parts}``/``{keys}``
    are expanded by ``sql.with_ids``-style helpers in the store."""

    def __init__(self, table: str = "outbox") -> None:
        self.table = table
        t = quote(table)
        parts = quote(sibling(table, "partitions"))
        relays = quote(sibling(table, "relays"))
        self.partitions_table = parts
        micros = "INTERVAL %s MICROSECOND"
        # Step 1: the partitions this relay leases with at least `margin` left.
        self.my_partitions = (
            f"SELECT `partition` FROM {parts} WHERE owner = %s AND expires_at > {NOW} + {micros}"
        )
        bare = table.split(".")[-1]
        pending_id = quote(f"{bare}_pending_id"[:64])
        ordered_index = quote(f"{bare}_ordered"[:64])
        due = f"status = {PENDING} AND available_at <= {NOW}"
        # Step 2: the first `scan` due keyed rows of those partitions, in id (commit) order,
        # walking the pending rows by id: it stops after `scan` rows of the relay's
        # partitions (about scan x P / partitions held), where `partition IN (…)` read and
        # sorted every pending row of them. A relay holding few partitions runs scan_one
        # per partition instead (scan_query chooses).
        self.scan = (
            f"SELECT id, `key` FROM {t} FORCE INDEX ({pending_id}) WHERE {due}"
            " AND `partition` {parts} ORDER BY id LIMIT %s"
        )
        # ... per partition: its first `scan` due rows (the ordered index, in id order)
        self.scan_one = (
            f"(SELECT id, `key` FROM {t} FORCE INDEX ({ordered_index}) WHERE {due}"
            " AND `partition` = %s ORDER BY id LIMIT %s)"
        )
        # Step 3, and again after the lock: per key, its first earlier row that blocks it
        # (in flight or waiting for a retry; dead-lettered under `block`), outside `{ids}`.
        # The status list (pending, and failed under `block`) keeps the index walk on the
        # key's unsettled rows: its published history is never read.
        self.blockers = (
            f"SELECT `key`, MIN(id) FROM {t} FORCE INDEX ({quote(f'{bare}_key_status'[:64])})"
            " WHERE `key` {keys} AND status IN (%s, %s) AND id < %s AND id NOT {ids}"
            f" AND (status = {PENDING} AND (available_at > {NOW} OR %s)"
            f" OR status = {FAILED} AND %s) GROUP BY `key`"
        )
        # Step 4: lock the chosen rows still due; one another claim holds is skipped.
        self.lock_chosen = (
            f"SELECT id, `key`, attempts, claim_token, last_error FROM {t} FORCE INDEX (PRIMARY)"
            f" WHERE id {{ids}} AND status = {PENDING} AND available_at <= {NOW}"
            " ORDER BY id FOR UPDATE SKIP LOCKED"
        )
        # Keyless rows (partition NULL) as in the unordered claim, a share of the batch, read
        # through the ordered index: the pending index would walk every due keyed row too.
        self.lock_keyless = (
            f"SELECT id, `key`, attempts, claim_token, last_error FROM {t}"
            f" FORCE INDEX ({ordered_index}) WHERE status = {PENDING} AND `partition` IS NULL"
            f" AND available_at <= {NOW} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
        )
        # A keyed row's settle also needs its claimer's lease on the row's partition,
        # unexpired: once it is gone another relay may publish the key, and the old
        # owner's late settle must change nothing (claimed_by names the token's relay).
        lease_held = (
            f"(o.`partition` IS NULL OR EXISTS (SELECT 1 FROM {parts} AS l"
            f" WHERE l.`partition` = o.`partition` AND l.owner = o.claimed_by"
            f" AND l.expires_at > {NOW}))"
        )
        self.fenced_ids = (
            f"SELECT o.id FROM {t} AS o FORCE INDEX (PRIMARY) WHERE o.id {{ids}}"
            " AND o.claim_token = %s"
            f" AND {lease_held} FOR UPDATE"
        )
        self.release_leases = (
            f"UPDATE {t} AS o FORCE INDEX (PRIMARY) SET o.available_at = {NOW},"
            " o.claim_token = NULL,"
            " o.attempts = GREATEST(o.attempts - 1, 0)"
            f" WHERE o.id {{ids}} AND o.claim_token = %s AND {lease_held}"
        )
        self.extend_leases = (
            f"UPDATE {t} AS o FORCE INDEX (PRIMARY) SET o.available_at = {NOW} + {micros}"
            f" WHERE o.id {{ids}} AND o.claim_token = %s AND {lease_held}"
        )
        # Membership: one row per live relay, renewed every lease/3; relays dead for ten
        # leases are forgotten.
        self.relay_beat = (
            f"INSERT INTO {relays} (relay_id, expires_at) VALUES (%s, {NOW} + {micros})"
            " ON DUPLICATE KEY UPDATE expires_at = VALUES(expires_at)"
        )
        self.forget_relays = f"DELETE FROM {relays} WHERE expires_at < {NOW} - {micros}"
        self.live_relays = (
            f"SELECT relay_id FROM {relays} WHERE expires_at > {NOW} ORDER BY relay_id"
        )
        # Take (free or expired) or renew the wanted partitions; the epoch counts
        # hand-overs (MariaDB assigns left to right: the epoch reads the old owner).
        self.acquire_partitions = (
            f"UPDATE {parts} SET epoch = epoch + IF(owner <=> %s AND expires_at > {NOW}, 0, 1),"
            f" owner = %s, expires_at = {NOW} + {micros}"
            " WHERE `partition` {parts} AND (owner = %s OR owner IS NULL"
            f" OR expires_at IS NULL OR expires_at <= {NOW})"
        )
        self.held_partitions = (
            f"SELECT `partition` FROM {parts} WHERE `partition` {{parts}} AND owner = %s"
            f" AND expires_at > {NOW} ORDER BY `partition`"
        )
        self.release_partitions = (
            f"UPDATE {parts} SET owner = NULL, expires_at = NULL"
            " WHERE `partition` {parts} AND owner = %s"
        )
        self.leave = f"DELETE FROM {relays} WHERE relay_id = %s"
        self.partition_count = f"SELECT COUNT(*) FROM {parts}"
        # Changing P (`migrate --ordered --partitions N --repartition`, every relay stopped):
        # the column's expression, read back; rewritten (the table is copied once, each
        # row's id, and so each key's order, kept); the leases start over, unowned, so a
        # late settle of a relay from before is fenced out as after any hand-over.
        self.partition_expression = (
            "SELECT GENERATION_EXPRESSION FROM information_schema.COLUMNS"
            " WHERE TABLE_SCHEMA = COALESCE(%s, DATABASE()) AND TABLE_NAME = %s"
            " AND COLUMN_NAME = 'partition'"
        )
        self.repartition = (
            f"ALTER TABLE {t} MODIFY COLUMN `partition` SMALLINT"
            " AS (CRC32(`key`) % {partitions}) STORED"
        )
        self.reset_partitions = f"DELETE FROM {parts}"
        self.fill_partitions = (
            f"INSERT INTO {parts} (`partition`) SELECT slot FROM"
            f" {quote(sibling(table, 'key_locks'))} WHERE slot < %s"
        )
        # One process per relay id and table: the heartbeat's session holds this named
        # lock (GET_LOCK is session-scoped, which is what this one wants).
        self.relay_id_lock = "SELECT GET_LOCK(%s, 0)"


def scan_query(
    stmts: OrderedStatements, parts: list[int], scan: int, partitions: int
) -> tuple[str, tuple[int, ...]]:
    """The scan and its parameters for a relay holding ``parts`` of ``partitions``.

    Walking pending rows by id reads about scan x partitions / held rows; one branch per
    held partition reads at most scan x held: the walk is the cheaper once held² >= P.
    """
    held = len(parts)
    if held * held >= partitions:
        return expand(stmts.scan, parts=held), (*parts, scan)
    each = " UNION ALL ".join([stmts.scan_one] * held) + " ORDER BY id LIMIT %s"
    return each, (*[v for p in parts for v in (p, scan)], scan)


def expand(statement: str, **counts: int) -> str:
    """``statement`` with each ``{name}`` filled as ``IN (%s, …)`` for ``counts[name]`` values."""
    for name, count in counts.items():
        statement = statement.replace("{" + name + "}", ids_in(count))
    return statement
