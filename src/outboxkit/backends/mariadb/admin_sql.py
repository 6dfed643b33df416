"""The operator statements on MariaDB/MySQL (status, dead letters, replay, purge, gauges).

The same names and columns as PostgreSQL's (outboxkit.backends.postgres.postgres), in MariaDB's SQL:
no ``FILTER`` (``SUM(condition)``), no arrays (ids expanded by ``sql.with_ids``), times as
UTC ``DATETIME(6)`` compared with ``UTC_TIMESTAMP(6)``, ages from ``TIMESTAMPDIFF``.
"""

from __future__ import annotations

from outboxkit.backends.mariadb.sql import FAILED, NOW, PENDING, PUBLISHED, quote

# A pending row that was never tried and waits for its deliver_at is not "waiting" yet:
# its age counts from its due time (PostgreSQL's _NOT_DUE and _WAITING_SINCE).
_NOT_DUE = f"(attempts = 0 AND claim_token IS NULL AND last_error IS NULL AND available_at > {NOW})"
_WAITING_SINCE = (
    "CASE WHEN attempts = 0 AND claim_token IS NULL AND last_error IS NULL"
    " THEN GREATEST(created_at, available_at) ELSE created_at END"
)
_IN_FLIGHT = f"(claim_token IS NOT NULL AND available_at > {NOW})"
_EVENT_COLUMNS = (
    "id, event_id, topic, `key`, event_type, aggregate_type, aggregate_id, payload, headers,"
    " schema_version, occurred_at, status, attempts, available_at, claim_token, claimed_by,"
    " last_error, created_at, published_at"
)
_REPLAY = (
    "UPDATE {t} SET status = {pending}, attempts = 0, available_at = {now}, claim_token = NULL"
    " WHERE status = {failed}"
)


def _oldest_age(where: str = "") -> str:
    """SQL: seconds since the oldest due row (of those ``where`` admits) started waiting."""
    return (
        f"TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN {where}NOT {_NOT_DUE} THEN {_WAITING_SINCE}"
        f" END), {NOW}) / 1e6"
    )


class AdminStatements:
    """The operator statements on one outbox table (``{ids}`` filled by ``sql.with_ids``)."""

    def __init__(self, table: str = "outbox") -> None:
        t = quote(table)
        self.status_by_topic = (
            f"SELECT topic, SUM(status = {PENDING} AND NOT {_IN_FLIGHT}),"
            f" SUM(status = {PENDING} AND {_IN_FLIGHT}), SUM(status = {FAILED}),"
            f" SUM(status = {PUBLISHED}), {_oldest_age(f'status = {PENDING} AND ')}"
            f" FROM {t} GROUP BY topic ORDER BY topic"
        )
        self.list_failed = (
            "SELECT id, event_id, topic, event_type, `key`, attempts, last_error, created_at"
            f" FROM {t} WHERE status = {FAILED} AND (%s IS NULL OR topic = %s)"
            " ORDER BY id LIMIT %s"
        )
        self.show_event = f"SELECT {_EVENT_COLUMNS} FROM {t} WHERE id = %s"
        self.show_event_by_event_id = f"SELECT {_EVENT_COLUMNS} FROM {t} WHERE event_id = %s"
        # The testing kit's `outbox_events`: every row, in write order.
        self.list_events = f"SELECT {_EVENT_COLUMNS} FROM {t} ORDER BY id"
        self.row_id_by_event_id = f"SELECT id FROM {t} WHERE event_id = %s"
        replay = _REPLAY.format(t=t, pending=PENDING, failed=FAILED, now=NOW)
        # Replay: dead letters back in line with a fresh attempt budget.
        self.replay_by_id = f"{replay} AND id {{ids}}"
        self.replay_by_topic = f"{replay} AND topic = %s"
        self.replay_all_failed = replay
        # Discard: a dead letter deleted for good (never a row in another state).
        self.discard_failed_by_id = f"DELETE FROM {t} WHERE status = {FAILED} AND id {{ids}}"
        # Retention keep: published rows older than %s microseconds, oldest first, one small
        # batch per statement (MariaDB's single-table DELETE takes ORDER BY and LIMIT).
        self.purge_published_batch = (
            f"DELETE FROM {t} WHERE status = {PUBLISHED}"
            f" AND published_at < {NOW} - INTERVAL %s MICROSECOND ORDER BY published_at LIMIT %s"
        )
        self.count_purgeable = (
            f"SELECT COUNT(*) FROM {t} WHERE status = {PUBLISHED}"
            f" AND published_at < {NOW} - INTERVAL %s MICROSECOND"
        )
        # The gauges and the dashboard: pending and failed rows only, at most %s of each, read
        # through the (status, …) indexes, so their cost stays flat however large the table.
        self.metrics_pending_by_topic = (
            f"SELECT topic, SUM(NOT {_IN_FLIGHT}), SUM({_IN_FLIGHT}), {_oldest_age()}"
            " FROM (SELECT topic, claim_token, available_at, created_at, attempts, last_error"
            f" FROM {t} WHERE status = {PENDING} ORDER BY available_at, id LIMIT %s) AS p"
            " GROUP BY topic"
        )
        self.metrics_failed_by_topic = (
            f"SELECT topic, COUNT(*) FROM (SELECT topic FROM {t} WHERE status = {FAILED}"
            " ORDER BY id LIMIT %s) AS f GROUP BY topic"
        )
        # Ordered mode: keys stopped behind a dead-lettered head, with the pending rows behind
        # it (PostgreSQL's DISTINCT ON is a GROUP BY of the first failed id here).
        self.is_ordered = (
            "SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()"
            " AND TABLE_NAME = %s AND COLUMN_NAME = 'partition'"
        )
        self.blocked_keys = (
            "SELECT h.`key`, h.id, h.event_id, h.topic, h.event_type, h.attempts, h.last_error,"
            f" h.created_at, (SELECT COUNT(*) FROM {t} AS w WHERE w.`key` = h.`key`"
            f" AND w.id > h.id AND w.status = {PENDING}) AS waiting"
            f" FROM {t} AS h JOIN (SELECT MIN(id) AS id FROM {t} WHERE status = {FAILED}"
            " AND `key` IS NOT NULL GROUP BY `key`) AS f ON f.id = h.id"
            f" WHERE EXISTS (SELECT 1 FROM {t} AS w WHERE w.`key` = h.`key` AND w.id > h.id"
            f" AND w.status = {PENDING}) ORDER BY h.id LIMIT %s"
        )
        # The last id handed out (MAX(id) would go back down as published rows are deleted):
        # the table's next AUTO_INCREMENT minus one. Parameters: the database (or NULL for
        # the connection's) and the bare table name.
        self.last_event_id = (
            "SELECT COALESCE(MAX(AUTO_INCREMENT) - 1, 0) FROM information_schema.TABLES"
            " WHERE TABLE_SCHEMA = COALESCE(%s, DATABASE()) AND TABLE_NAME = %s"
        )


#: MySQL 8 caches information_schema's AUTO_INCREMENT for a day by default (MariaDB reads it
#: live and has no such variable): an admin session of MySQL's reads it live too.
MYSQL_LIVE_TABLE_STATS = "SET SESSION information_schema_stats_expiry = 0"


class InboxAdminStatements:
    """Retention of an inbox table: records older than %s microseconds, optionally of one
    consumer, oldest first in small batches."""

    def __init__(self, table: str = "processed_events") -> None:
        t = quote(table)
        where = (
            f"processed_at < {NOW} - INTERVAL %s MICROSECOND AND (%s IS NULL OR consumer_name = %s)"
        )
        self.purge_batch = f"DELETE FROM {t} WHERE {where} ORDER BY processed_at LIMIT %s"
        self.count_purgeable = f"SELECT COUNT(*) FROM {t} WHERE {where}"
