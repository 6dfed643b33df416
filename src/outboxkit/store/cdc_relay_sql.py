"""The CDC relay's statements on the outbox table: dead letters, bulk removal, replay."""

from __future__ import annotations

from outboxkit.store.postgres import SqlTemplate, Statements

# --- the CDC relay: dead letters, bulk removal, replay (cdc/relay.py) -----------------

# A dead letter of the stream. A table row still there (the relay never updates it on the
# hot path) is marked failed; a WAL-only event, or a row already removed, is inserted as a
# failed row, once: a relay that dies before confirming past it writes it again otherwise.
CDC_DEAD_LETTER = """
WITH marked AS (
    UPDATE {table} SET status = {failed}, attempts = %(attempts)s, last_error = %(error)s,
        available_at = now()
    WHERE id = %(id)s AND status = {pending}
    RETURNING id
)
INSERT INTO {table} (event_id, topic, key, event_type, aggregate_type, aggregate_id, payload,
                     headers, status, attempts, last_error, occurred_at, schema_version)
SELECT %(event_id)s, %(topic)s, %(key)s, %(event_type)s, %(aggregate_type)s, %(aggregate_id)s,
       %(payload)s, %(headers)s, {failed}, %(attempts)s, %(error)s,
       coalesce(%(occurred_at)s, now()), %(schema_version)s
WHERE NOT EXISTS (SELECT 1 FROM marked)
  AND NOT EXISTS (SELECT 1 FROM {table} WHERE status = {failed} AND event_id = %(event_id)s)
"""
# Published table rows, removed in bulk (never one UPDATE per event).
CDC_DELETE_PUBLISHED = "DELETE FROM {table} WHERE id = ANY(%s) AND status = {pending}"
# Whether the outbox table is partitioned (its partitions are dropped, never deleted from).
CDC_IS_PARTITIONED = "SELECT relkind = 'p' FROM pg_class WHERE oid = %s::regclass"
# Whether a publication carries the table: replay then inserts the events anew, which the
# stream delivers as inserts (an UPDATE back to pending is invisible to it).
CDC_IS_PUBLISHED = "SELECT EXISTS (SELECT 1 FROM pg_publication_rel WHERE prrelid = %s::regclass)"
_CDC_REINSERT = """
WITH gone AS (DELETE FROM {table} WHERE status = {failed} AND %s
              RETURNING id, event_id, topic, key, event_type, aggregate_type, aggregate_id,
                        payload, headers, created_at, occurred_at, schema_version)
INSERT INTO {table} (event_id, topic, key, event_type, aggregate_type, aggregate_id, payload,
                     headers, created_at, occurred_at, schema_version)
SELECT event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers,
       created_at, occurred_at, schema_version
FROM gone ORDER BY id
"""
CDC_REPLAY_BY_ID = _CDC_REINSERT.replace("%s", "id = ANY(%s)", 1)
CDC_REPLAY_BY_TOPIC = _CDC_REINSERT.replace("%s", "topic = %s", 1)
CDC_REPLAY_ALL_FAILED = _CDC_REINSERT.replace("%s", "true", 1)


class CdcRelayStatements(Statements):
    """An outbox's statements with those of the CDC relay added."""

    cdc_dead_letter = SqlTemplate(CDC_DEAD_LETTER)
    cdc_delete_published = SqlTemplate(CDC_DELETE_PUBLISHED)
    cdc_is_partitioned = SqlTemplate(CDC_IS_PARTITIONED)
    cdc_is_published = SqlTemplate(CDC_IS_PUBLISHED)
    cdc_replay_by_id = SqlTemplate(CDC_REPLAY_BY_ID)
    cdc_replay_by_topic = SqlTemplate(CDC_REPLAY_BY_TOPIC)
    cdc_replay_all_failed = SqlTemplate(CDC_REPLAY_ALL_FAILED)

    @classmethod
    def templates(cls) -> dict[str, SqlTemplate]:
        own = {k: v for k, v in vars(cls).items() if isinstance(v, SqlTemplate)}
        return {**Statements.templates(), **own}
