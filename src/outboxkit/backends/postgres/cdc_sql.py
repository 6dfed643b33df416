"""The SQL of the WAL side: the checks, the publication and the slot of an outbox (cdc/slots.py).

Values are parameters; the table goes through `quote_table`, the publication through
`quote_ident` (slot names are values: PostgreSQL takes them as `name` arguments).
"""

from __future__ import annotations

from psycopg import sql

from outboxkit.backends.postgres.postgres import SqlTemplate, Statements

# --- checks that `outboxkit cdc setup` runs before it changes anything -------------------

# The server settings logical decoding depends on, and how many slots are taken.
CDC_SERVER_SETTINGS = """
SELECT current_setting('wal_level') AS wal_level,
       current_setting('max_replication_slots')::int AS max_replication_slots,
       current_setting('max_wal_senders')::int AS max_wal_senders,
       current_setting('max_slot_wal_keep_size') AS max_slot_wal_keep_size,
       (SELECT count(*) FROM pg_replication_slots)::int AS slots_in_use,
       current_database() AS database,
       current_user AS role
"""
# What the role may do: a slot needs REPLICATION (or superuser), a publication FOR TABLE needs
# the table's ownership and CREATE on the database.
CDC_ROLE_PRIVILEGES = """
SELECT r.rolsuper AS superuser,
       r.rolreplication AS replication,
       has_database_privilege(current_database(), 'CREATE') AS create_on_database,
       (SELECT pg_has_role(current_user, c.relowner, 'USAGE')
        FROM pg_class c WHERE c.oid = to_regclass(%(table)s)) AS owns_table,
       to_regclass(%(table)s) IS NOT NULL AS table_exists
FROM pg_roles r WHERE r.rolname = current_user
"""

# --- the publication -----------------------------------------------------------------------

# Whether the publication exists, whether it carries the table and what it publishes.
CDC_PUBLICATION = """
SELECT p.pubinsert AS inserts,
       EXISTS (SELECT 1 FROM pg_publication_rel r
               WHERE r.prpubid = p.oid AND r.prrelid = to_regclass(%(table)s)) AS has_table
FROM pg_publication p WHERE p.pubname = %(publication)s
"""
# Inserts only: the relay ignores updates and deletes (its own bulk removal of published rows
# would otherwise stream back to it as one Delete per row).
CDC_CREATE_PUBLICATION = (
    "CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert')"
)
CDC_PUBLICATION_ADD_TABLE = "ALTER PUBLICATION {publication} ADD TABLE {table}"
CDC_DROP_PUBLICATION = "DROP PUBLICATION IF EXISTS {publication}"

# --- the slot ------------------------------------------------------------------------------

CDC_CREATE_SLOT = (
    "SELECT lsn::text AS lsn FROM pg_create_logical_replication_slot(%(slot)s, 'pgoutput')"
)
# The slot as the server sees it; to_jsonb keeps the columns of newer servers
# (invalidation_reason, inactive_since: PostgreSQL 17) without failing on older ones.
CDC_SLOT = """
SELECT to_jsonb(s) AS slot,
       CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_insert_lsn()::text END
           AS current_lsn,
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE pg_wal_lsn_diff(pg_current_wal_insert_lsn(), s.confirmed_flush_lsn)::bigint END
           AS lag_bytes,
       CASE WHEN pg_is_in_recovery() THEN NULL
            ELSE pg_wal_lsn_diff(pg_current_wal_insert_lsn(), s.restart_lsn)::bigint END
           AS retained_bytes,
       current_setting('max_slot_wal_keep_size') AS max_slot_wal_keep_size,
       now() AS now
FROM pg_replication_slots s WHERE s.slot_name = %(slot)s
"""
# The age of the oldest unconfirmed transaction: a temporary copy of the slot (freed with the
# session) is peeked for its first change, a Begin that carries the commit time. The copy
# leaves the slot itself untouched, even while a relay streams it.
CDC_PROBE_TIMEOUT = "SELECT set_config('statement_timeout', %(ms)s, false)"
CDC_COPY_SLOT = "SELECT 1 FROM pg_copy_logical_replication_slot(%(slot)s, %(copy)s, true)"
CDC_PEEK_FIRST = """
SELECT data FROM pg_logical_slot_peek_binary_changes(
    %(copy)s, NULL, 1, 'proto_version', '1', 'publication_names', %(publication)s,
    'messages', 'true')
LIMIT 1
"""
CDC_DROP_SLOT = "SELECT pg_drop_replication_slot(%(slot)s)"
# A slot streamed by a relay cannot be dropped: its WAL sender is ended first.
CDC_TERMINATE_SLOT_USER = """
SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
WHERE slot_name = %(slot)s AND active_pid IS NOT NULL
"""


def render(template: str, *, table: str, publication: str) -> str:
    """`template` with its quoted table (already quoted by `quote_table`) and publication."""
    return template.format(table=table, publication=sql.Identifier(publication).as_string(None))


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
# How many of the given 32-bit xids a new snapshot does not see as ended yet (each widened to
# xid8 with the epoch of the snapshot's xmax: they are recent). PostgreSQL 13+.
CDC_NOT_VISIBLE = """
SELECT count(*)
FROM (SELECT pg_current_snapshot() AS s) AS snap,
     LATERAL (SELECT pg_snapshot_xmax(snap.s)::text::bigint AS xmax) AS m,
     LATERAL (SELECT ((m.xmax >> 32) << 32) + x AS xid FROM unnest(%s::bigint[]) AS x) AS f
WHERE NOT pg_visible_in_snapshot(
    (f.xid - CASE WHEN f.xid > m.xmax + 2147483648 THEN 4294967296 ELSE 0 END)::text::xid8,
    snap.s)
"""
# Whether a publication carries the table: replay then inserts the events anew, which the
# stream delivers as inserts (an UPDATE back to pending is invisible to it).
CDC_IS_PUBLISHED = "SELECT EXISTS (SELECT 1 FROM pg_publication_rel WHERE prrelid = %s::regclass)"


def _cdc_reinsert(failed_rows: str) -> str:
    """Replay on a published table: the failed rows matching ``failed_rows`` (a condition on
    its columns, with the statement's one parameter if any) deleted and inserted anew."""
    return f"""
WITH gone AS (DELETE FROM {{table}} WHERE status = {{failed}} AND {failed_rows}
              RETURNING id, event_id, topic, key, event_type, aggregate_type, aggregate_id,
                        payload, headers, created_at, occurred_at, schema_version)
INSERT INTO {{table}} (event_id, topic, key, event_type, aggregate_type, aggregate_id, payload,
                     headers, created_at, occurred_at, schema_version)
SELECT event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers,
       created_at, occurred_at, schema_version
FROM gone ORDER BY id
"""


CDC_REPLAY_BY_ID = _cdc_reinsert("id = ANY(%s)")
CDC_REPLAY_BY_TOPIC = _cdc_reinsert("topic = %s")
CDC_REPLAY_ALL_FAILED = _cdc_reinsert("true")


class CdcRelayStatements(Statements):
    """An outbox's statements with those of the CDC relay added."""

    cdc_dead_letter = SqlTemplate(CDC_DEAD_LETTER)
    cdc_delete_published = SqlTemplate(CDC_DELETE_PUBLISHED)
    cdc_is_partitioned = SqlTemplate(CDC_IS_PARTITIONED)
    cdc_is_published = SqlTemplate(CDC_IS_PUBLISHED)
    cdc_not_visible = SqlTemplate(CDC_NOT_VISIBLE)
    cdc_replay_by_id = SqlTemplate(CDC_REPLAY_BY_ID)
    cdc_replay_by_topic = SqlTemplate(CDC_REPLAY_BY_TOPIC)
    cdc_replay_all_failed = SqlTemplate(CDC_REPLAY_ALL_FAILED)

    @classmethod
    def templates(cls) -> dict[str, SqlTemplate]:
        own = {k: v for k, v in vars(cls).items() if isinstance(v, SqlTemplate)}
        return {**Statements.templates(), **own}
