"""The inbox's statements on MariaDB/MySQL (the table: ``migrations/inbox/``).

The record is an ``INSERT IGNORE``: a duplicate of ``(consumer_name, event_id)`` writes
nothing and reports no affected row, which the driver adapters read as "not fresh"
(``drivers.dbapi_adapter``); it is not ``INSERT … RETURNING`` because MySQL 8 has none, and
not ``ON DUPLICATE KEY UPDATE`` because under ``CLIENT.FOUND_ROWS`` (SQLAlchemy's and
Django's default) a duplicate would count as one row. A second transaction inserting the
same pair waits on the first's row lock, then counts 0 (it committed) or 1 (it rolled back).
``IGNORE`` would also turn an over-long value into a truncation, so the inbox checks the
consumer name's length first (:data:`MAX_CONSUMER_CHARS`).
"""

from __future__ import annotations

from outboxkit.backends.mariadb.sql import quote

#: ``consumer_name VARCHAR(255)``: a longer name is refused before the statement.
MAX_CONSUMER_CHARS = 255


def check_consumer(consumer: str) -> None:
    """ValueError for a consumer name longer than the column (``INSERT IGNORE`` would cut it)."""
    if len(consumer) > MAX_CONSUMER_CHARS:
        raise ValueError(
            f"the consumer name is {len(consumer)} characters; the MariaDB inbox keeps"
            f" at most {MAX_CONSUMER_CHARS} (consumer_name VARCHAR(255))"
        )


class InboxStatements:
    """The statements of one MariaDB inbox table (``%s`` parameters: consumer, event id)."""

    def __init__(self, table: str) -> None:
        t = quote(table)
        self.table = table
        self.mark = f"INSERT IGNORE INTO {t} (consumer_name, event_id) VALUES (%s, %s)"
        self.is_processed = (
            f"SELECT EXISTS (SELECT 1 FROM {t} WHERE consumer_name = %s AND event_id = %s)"
        )
