"""What one event row costs: the outbox table built differently, one option at a time.

Companion of ``write_overhead.py`` (its reference transaction, timing and summary).
Every variant writes the same event into its own table, as a prepared INSERT with
binary parameters in the COMMIT's round trip (what ``Outbox.transaction()`` sends),
so only the table differs; beside them in the same interleaved run: the plain
transaction with its A/A control, the floor (a 40-byte row into a one-index table,
in the COMMIT's message), a naive hand-written INSERT through psycopg, and
``Outbox.transaction()`` / ``Outbox.put`` on today's table. Then the server's cost
per row of each table in bulk (2 000 INSERTs in one message, best of 7, tables
interleaved: robust to a loaded machine) and WAL bytes per transaction.

    python bench/write_row_cost.py --dsn postgresql://postgres@127.0.0.1/bench
    python bench/write_row_cost.py --dsn ... --rounds 3000 --tables v2,uuid_pk   # a subset
"""

from __future__ import annotations

import argparse
import marshal
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
import psycopg
from _common import save
from write_ab import raw_begin, raw_pipeline
from write_overhead import (
    BOOTSTRAP_RESAMPLES,
    SCHEMA,
    WARMUP_ROUNDS,
    SyncTx,
    Timings,
    WritePath,
    _as_url,
    machine_facts,
    order_event,
    psycopg_business,
    server_facts,
    summarise,
    wal_bytes_per_tx,
)

from outboxkit import Event, OutboundMessage, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import WRITE_COLUMNS
from outboxkit.wire.kafka import encode_record
from outboxkit.write.storage import OIDS
from outboxkit.write.table import _params as library_params

# Today's columns minus the identity: the base every hand-built variant starts from.
_BODY = """
    event_id uuid NOT NULL, topic text NOT NULL, key text, event_type text NOT NULL,
    aggregate_type text, aggregate_id text, payload bytea NOT NULL,
    headers {headers} NOT NULL DEFAULT {empty}, status smallint NOT NULL DEFAULT 0,
    attempts integer NOT NULL DEFAULT 0, available_at timestamptz NOT NULL DEFAULT now(),
    claim_token uuid, claimed_by text, last_error text,
    created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz,
    occurred_at timestamptz DEFAULT now(), schema_version text
"""
_JSONB = {"headers": "jsonb", "empty": "'{}'"}
_BYTEA = {"headers": "bytea", "empty": "''"}


def _json_headers(e: Event) -> list[bytes | None]:
    """The row as the library sent it before round 3: '{}' as a jsonb document."""
    row = library_params(e)
    if row[7] is None:
        row[7] = b"\x01{}"
    return row


@dataclass(frozen=True)
class TableVariant:
    """One way to build the outbox table: its DDL and how a row is written into it."""

    label: str
    ddl: str  # {t}: the table; run after migrate() unless it creates the table itself
    columns: tuple[tuple[str, str], ...] = WRITE_COLUMNS
    encode: Callable[[Event], list[bytes | None]] = _json_headers
    table: str = ""  # write into another variant's table (a statement variant)
    headers_null: bool = False  # empty headers sent as NULL, coalesced to '{}' by the INSERT
    named: bool = True  # a named prepared statement; False: unnamed, parsed every time

    def name(self, key: str) -> str:
        return f"rc_{self.table or key}"

    def sql(self, key: str) -> bytes:
        return _insert_sql(self.name(key), self.columns, self.headers_null).encode()


def _bytea_headers(e: Event) -> list[bytes | None]:
    row = library_params(e)
    row[7] = orjson.dumps(e.headers) if e.headers else b""
    return row


def _lean(e: Event) -> list[bytes | None]:
    row = library_params(e)
    return [row[0], row[1], row[2], row[3], row[6], row[10]]


def _ce_bytes(e: Event) -> list[bytes | None]:
    """The library's row plus the Kafka record's headers and timestamp, built at write time
    (the relay would ``marshal.loads`` them instead of building them per event)."""
    message = OutboundMessage(
        e.event_id, e.topic, e.key, e.event_type, e.aggregate_type, e.aggregate_id,
        e.payload, e.headers, e.occurred_at, 1, e.occurred_at, e.schema_version,
    )  # fmt: skip
    return [*library_params(e), marshal.dumps(encode_record(message))]


_LEAN_COLUMNS = (
    *(c for c in WRITE_COLUMNS if c[0] in ("event_id", "topic", "key", "event_type", "payload")),
    ("available_at", "timestamptz"),
)
_BYTEA_COLUMNS = tuple((n, "bytea" if n == "headers" else t) for n, t in WRITE_COLUMNS)

TABLES: dict[str, TableVariant] = {
    "v2": TableVariant("today's table (schema v2): identity PK + pending index", ""),
    "pk_only": TableVariant(
        "v2 without the pending index (one B-tree)", "DROP INDEX {t}_pending_idx"
    ),
    "uuid_pk": TableVariant(
        "uuid7 event_id as PK and claim order, no identity (2 B-trees)",
        "CREATE TABLE {t} (" + _BODY.format(**_JSONB) + ", PRIMARY KEY (event_id));"
        " CREATE INDEX {t}_pending_idx ON {t} (available_at, event_id)"
        " WHERE status = 0",
    ),
    "uuid_pk_only": TableVariant(
        "uuid7 event_id as PK, no identity, no pending index (1 B-tree)",
        "CREATE TABLE {t} (" + _BODY.format(**_JSONB) + ", PRIMARY KEY (event_id))",
    ),
    "no_index": TableVariant(
        "v2 without any index (heap only: the index cost's bound)",
        "ALTER TABLE {t} DROP CONSTRAINT {t}_pkey; DROP INDEX {t}_pending_idx",
    ),
    "seq_cache": TableVariant(
        "v2, identity CACHE 64 (breaks ordered mode's id = commit order)",
        "ALTER TABLE {t} ALTER COLUMN id SET CACHE 64",
    ),
    "bytea_headers": TableVariant(
        "v2 with headers bytea instead of jsonb",
        "CREATE TABLE {t} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        + _BODY.format(**_BYTEA)
        + "); CREATE INDEX {t}_pending_idx ON {t} (available_at, id) WHERE status = 0",
        _BYTEA_COLUMNS,
        _bytea_headers,
    ),
    "lean": TableVariant(
        "9 columns (id, event_id, topic, key, type, payload, status, available_at, attempts)",
        "CREATE TABLE {t} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        " event_id uuid NOT NULL, topic text NOT NULL, key text, event_type text NOT NULL,"
        " payload bytea NOT NULL, status smallint NOT NULL DEFAULT 0,"
        " available_at timestamptz NOT NULL, attempts integer NOT NULL DEFAULT 0);"
        " CREATE INDEX {t}_pending_idx ON {t} (available_at, id) WHERE status = 0",
        _LEAN_COLUMNS,
        _lean,
    ),
    "ce_bytes": TableVariant(
        "v2 + the Kafka headers as bytes written at write time (`ce bytea`)",
        "ALTER TABLE {t} ADD COLUMN ce bytea",
        (*WRITE_COLUMNS, ("ce", "bytea")),
        _ce_bytes,
        headers_null=True,
    ),
    "fillfactor": TableVariant("v2 with fillfactor 70", "ALTER TABLE {t} SET (fillfactor = 70)"),
    "v2_null_headers": TableVariant(
        "v2, empty headers sent as NULL, coalesce(.., '{}') in the INSERT",
        "",
        encode=library_params,
        table="v2",
        headers_null=True,
    ),
    "v2_unnamed": TableVariant(
        "v2, unnamed statement (parsed and planned every time)", "", table="v2", named=False
    ),
}
NAIVE = (
    "INSERT INTO outbox (event_id, topic, key, event_type, payload, headers)"
    " VALUES (%s, %s, %s, %s, %s, %s)"
)
FLOOR = b"INSERT INTO bench_small (v) VALUES ($1)"
FLOOR_VALUE = b"x" * 40
EMIT = b"SELECT pg_logical_emit_message(true, 'outboxkit', $1::bytea)"


def _insert_sql(table: str, columns: tuple[tuple[str, str], ...], headers_null: bool) -> str:
    names = ", ".join(n for n, _ in columns)
    values = []
    for i, (n, _) in enumerate(columns, 1):
        if n == "available_at":
            values.append(f"coalesce(${i}, now())")
        elif n == "headers" and headers_null:
            values.append(f"coalesce(${i}, '{{}}'::jsonb)")
        else:
            values.append(f"${i}")
    return f"INSERT INTO {table} ({names}) VALUES ({', '.join(values)})"


def build_tables(dsn: str, chosen: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("DROP TABLE IF EXISTS bench_small")
        conn.execute("CREATE TABLE bench_small (id bigserial PRIMARY KEY, v text)")
        conn.execute("DROP TABLE IF EXISTS outbox, outboxkit_schema_versions")
        for name in chosen:
            conn.execute(f"DROP TABLE IF EXISTS rc_{name}")
    migrate(dsn)
    for name in chosen:
        variant, table = TABLES[name], f"rc_{name}"
        if variant.table:
            continue
        if not variant.ddl.startswith("CREATE"):
            migrate(dsn, table=table)
        if variant.ddl:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(variant.ddl.replace("{t}", table))


class RowCost(WritePath):
    """The reference transaction on one psycopg connection, one variant per table."""

    name = "psycopg (sync), row cost"

    def __init__(self, dsn: str, rng: random.Random, tables: list[str]) -> None:
        super().__init__(dsn, rng)
        conn = psycopg.connect(dsn, autocommit=True)
        self.conn = conn
        pg = conn.pgconn
        self.backend = _Backend(pg.backend_pid)
        prepared: set[bytes] = set()

        def in_commit(
            name: bytes | None, sql: bytes, types: list[int], row: Callable[[], Any]
        ) -> None:
            # BEGIN as conn.transaction() sends it; the INSERT, prepared once, rides in the
            # COMMIT's pipeline with binary parameters, as Outbox.transaction() sends it.
            conn.wait(raw_begin(pg))
            psycopg_business(conn, self.order)
            values = row()
            sends: list[Callable[[], object]] = []
            formats = [1] * len(values)
            if name is None:
                sends.append(lambda: pg.send_query_params(sql, values, types, formats))
            else:
                if name not in prepared:
                    sends.append(lambda: pg.send_prepare(name, sql, types))
                    prepared.add(name)
                sends.append(lambda: pg.send_query_prepared(name, values, formats))
            sends.append(lambda: pg.send_query_params(b"COMMIT", None))
            _statuses, error = conn.wait(raw_pipeline(pg, sends))
            if error is not None:
                raise error

        def table_row(key: str) -> SyncTx:
            v = TABLES[key]
            types = [OIDS[t] for _, t in v.columns]
            name = f"rc_{key}".encode() if v.named else None
            return lambda: in_commit(name, v.sql(key), types, lambda: v.encode(order_event(0)))

        def wal_content() -> list[bytes]:
            e = order_event(0)
            return [orjson.dumps({"id": str(e.event_id), "topic": e.topic}) + e.payload]

        def plain() -> None:
            with conn.transaction():
                psycopg_business(conn, self.order)

        def naive() -> None:
            # What a user writes by hand: one more statement before the COMMIT.
            with conn.transaction():
                e = order_event(psycopg_business(conn, self.order))
                conn.execute(NAIVE, (e.event_id, e.topic, e.key, e.event_type, e.payload, "{}"))

        def library(ob: Outbox, with_commit: bool) -> SyncTx:
            def run() -> None:
                if with_commit:
                    with ob.transaction(conn) as tx:
                        tx.put(order_event(psycopg_business(conn, self.order)))
                else:
                    with conn.transaction():
                        ob.put(conn, order_event(psycopg_business(conn, self.order)))

            return run

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "floor: 40-byte row, one index, in the COMMIT's message": lambda: in_commit(
                b"rc_floor", FLOOR, [OIDS["text"]], lambda: [FLOOR_VALUE]
            ),
            "naive: hand-written INSERT (psycopg)": naive,
            "outbox.transaction, notify off": library(Outbox(notify=False), True),
            "outbox.put, notify off": library(Outbox(notify=False), False),
            "WAL floor: prepared pg_logical_emit_message in the COMMIT's round trip": (
                lambda: in_commit(b"rc_emit", EMIT, [OIDS["bytea"]], wal_content)
            ),
            "outbox.transaction, storage=wal": library(Outbox(storage="wal"), True),
            **{f"row: {TABLES[k].label}": table_row(k) for k in tables},
        }

    def close(self) -> None:
        self.backend.close()
        self.conn.close()


class _Backend:
    """The CPU time of the connection's server process (``/proc/<pid>/schedstat``, ns):
    what the server spent on a transaction, whatever else the machine was doing."""

    def __init__(self, pid: int) -> None:
        try:
            self._fd: int | None = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY)
        except OSError:  # a server on another machine: no server CPU column
            self._fd = None

    def cpu_ns(self) -> int:
        return 0 if self._fd is None else int(os.pread(self._fd, 64, 0).split()[0])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


def run_block(path: RowCost, rounds: int, timings: Timings, server: dict[str, list[float]]) -> None:
    """``write_overhead.run_sync_block`` plus the server's CPU time per transaction."""
    items = list(path.variants.items())
    cpu_ns = path.backend.cpu_ns
    for _ in range(rounds):
        path.rng.shuffle(items)
        for name, tx in items:
            path.next_order()
            s0 = cpu_ns()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            tx()
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            server[name].append((cpu_ns() - s0) / 1e3)
            timings.wall[name].append((t1 - t0) / 1e6)
            timings.cpu[name].append((c1 - c0) / 1e6)


def bulk_server_us(dsn: str, tables: list[str], rows: int = 2000, repeats: int = 7) -> dict:
    """Server CPU per INSERT into each table: ``rows`` executions of the prepared INSERT,
    binary parameters, in one pipeline (as ``transaction()`` sends one), rolled back; the
    best of ``repeats``, tables interleaved. The floor's 40-byte row the same way."""
    statements = {"floor": (FLOOR, [OIDS["text"]], [[FLOOR_VALUE]] * rows)}
    for key in tables:
        v = TABLES[key]
        types = [OIDS[t] for _, t in v.columns]
        params = [v.encode(order_event(i)) for i in range(rows)]
        statements[key] = (v.sql(key), types, params)
    best: dict[str, float] = {k: float("inf") for k in statements}
    with psycopg.connect(dsn, autocommit=True) as conn:
        pg = conn.pgconn
        backend = _Backend(pg.backend_pid)
        for key, (sql, types, _) in statements.items():
            pg.prepare(f"bulk_{key}".encode(), sql, types)
        unnamed = {k for k in tables if not TABLES[k].named}
        order = list(statements)
        for _ in range(repeats):
            random.shuffle(order)
            for key in order:
                name, (_, types, params) = f"bulk_{key}".encode(), statements[key]
                formats = [1] * len(types)
                sends: list[Callable[[], object]] = [lambda: pg.send_query_params(b"BEGIN", None)]
                if key in unnamed:
                    sql = statements[key][0]
                    sends += [partial(pg.send_query_params, sql, p, types, formats) for p in params]
                else:
                    sends += [partial(pg.send_query_prepared, name, p, formats) for p in params]
                sends.append(lambda: pg.send_query_params(b"ROLLBACK", None))
                start = backend.cpu_ns()
                _statuses, error = conn.wait(raw_pipeline(pg, sends))
                if error is not None:
                    raise error
                best[key] = min(best[key], backend.cpu_ns() - start)
        backend.close()
    return {k: round(ns / rows / 1e3, 2) for k, ns in best.items()}


def in_transaction_server_us(dsn: str, tables: list[str], rounds: int = 3000) -> dict:
    """Server CPU one row adds to a transaction that writes anyway (as the business one
    does: its xid and its commit's WAL flush are paid either way): BEGIN, an UPDATE of a
    stock row, the table's prepared INSERT (none for the baseline), COMMIT, in one
    pipeline; tables interleaved, a fresh random order per round; median minus the
    baseline's. Unlike the bulk figure this includes what a row costs once per
    transaction (its relation's and indexes' locks, the statement's executor start)."""
    statements: dict[str, Any] = {"none": None, "floor": (FLOOR, [OIDS["text"]], None)}
    for key in tables:
        v = TABLES[key]
        if v.named:  # (an unnamed statement's parse is the bulk figure's business)
            statements[key] = (v.sql(key), [OIDS[t] for _, t in v.columns], v.encode)
    samples: dict[str, list[int]] = {k: [] for k in statements}
    rng = random.Random(5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        pg = conn.pgconn
        backend = _Backend(pg.backend_pid)
        pg.prepare(b"tx_stock", b"UPDATE bench_stock SET qty = qty - 1 WHERE sku = $1", [23])
        for key, stmt in statements.items():
            if stmt is not None:
                pg.prepare(f"tx_{key}".encode(), stmt[0], stmt[1])
        order = list(statements)
        for r in range(rounds + 300):
            rng.shuffle(order)
            for key in order:
                sku = str(rng.randrange(1, 1001)).encode()
                stmt = statements[key]
                sends: list[Callable[[], object]] = [
                    lambda: pg.send_query_params(b"BEGIN", None),
                    partial(pg.send_query_prepared, b"tx_stock", [sku]),
                ]
                if stmt is not None:
                    row = [FLOOR_VALUE] if stmt[2] is None else stmt[2](order_event(r))
                    name = f"tx_{key}".encode()
                    sends.append(partial(pg.send_query_prepared, name, row, [1] * len(row)))
                sends.append(lambda: pg.send_query_params(b"COMMIT", None))
                start = backend.cpu_ns()
                _statuses, error = conn.wait(raw_pipeline(pg, sends))
                if error is not None:
                    raise error
                if r >= 300:
                    samples[key].append(backend.cpu_ns() - start)
        backend.close()
    base = statistics.median(samples.pop("none"))
    return {k: round((statistics.median(xs) - base) / 1e3, 1) for k, xs in samples.items()}


def _bulk_only(dsn: str, tables: list[str], name: str) -> None:
    build_tables(dsn, tables)
    bulk = bulk_server_us(dsn, tables)
    for key, us in bulk.items():
        print(f"  {key:<16} {us:6.2f} us")
    print("server CPU one row adds to a writing transaction (median, us):")
    in_tx = in_transaction_server_us(dsn, tables)
    for key, us in in_tx.items():
        print(f"  {key:<16} {us:6.1f} us")
    save(
        name,
        {
            "machine": machine_facts(),
            "server": server_facts(dsn),
            "bulk_server_us_per_insert": bulk,
            "in_transaction_server_us_per_row": in_tx,
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--tables", default=",".join(TABLES), help=f"subset of {','.join(TABLES)}")
    ap.add_argument(
        "--embedded",
        action="store_true",
        help="run on a private embedded PostgreSQL 18 (fsync on, wal_level=logical), not --dsn",
    )
    ap.add_argument(
        "--bulk-only",
        action="store_true",
        help="only the server CPU per INSERT (in bulk and in a writing transaction)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 100 rounds, results to NAME.quick.json"
    )
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--name", default="write_row_cost", help="results file name")
    args = ap.parse_args()
    if args.quick:
        args.rounds = min(args.rounds, 100)
    unknown = set(args.tables.split(",")) - set(TABLES)
    if unknown:
        ap.error(f"unknown --tables {', '.join(sorted(unknown))}; choose from {', '.join(TABLES)}")
    if args.embedded:
        from outboxkit.testing.postgres import EmbeddedPostgres

        with EmbeddedPostgres(logical=True) as server:
            run(server.dsn, args)
    else:
        run(_as_url(args.dsn), args)


def run(dsn: str, args: argparse.Namespace) -> None:
    tables = args.tables.split(",")
    if args.bulk_only:
        _bulk_only(dsn, tables, args.name)
        return
    build_tables(dsn, tables)
    rng = random.Random(args.seed)
    path = RowCost(dsn, random.Random(rng.random()), tables)
    load_start = machine_facts()
    server: dict[str, list[float]] = {v: [] for v in path.variants}
    run_block(path, WARMUP_ROUNDS, Timings(path.variants), {v: [] for v in path.variants})
    timings = Timings(path.variants)
    started = time.time()
    done = 0
    while done < args.rounds:
        block = min(250, args.rounds - done)
        run_block(path, block, timings, server)
        done += block
        print(f"  {done}/{args.rounds} rounds, {time.time() - started:.0f} s", flush=True)
    elapsed = time.time() - started
    results = summarise(path, timings, rng, BOOTSTRAP_RESAMPLES)
    wal = wal_bytes_per_tx(path)
    path.close()
    base_server = statistics.median(server["plain (A)"])
    for r in results:
        r["wal_bytes_per_tx"] = wal.get(r["variant"])
        r["server_cpu_extra_us"] = round(statistics.median(server[r["variant"]]) - base_server, 1)
    bulk = bulk_server_us(dsn, tables)

    print(
        f"\n{'variant':<86} {'median ms':>9} {'overhead':>9} {'95% CI':>16} {'CPU':>7} {'WAL':>6}"
    )
    for r in results:
        lo, hi = r["ci95_pct"]
        w = r["wal_bytes_per_tx"]
        print(
            f"{r['variant']:<86} {r['median_ms']:>9.3f} {r['overhead_pct']:>+8.1f}%"
            f" [{lo:>+6.1f}, {hi:>+6.1f}] {r['client_cpu_extra_us']:>+5.0f}us"
            f" {r['server_cpu_extra_us']:>+5.0f}us"
            f" {'' if w is None else f'{w:6.0f}'}"
        )
    print("\nserver CPU per INSERT, 2000 in one message, best of 7 (us):")
    for key, us in bulk.items():
        label = "floor: 40-byte row, one index" if key == "floor" else TABLES[key].label
        print(f"  {label:<86} {us:6.2f}")
    machine = machine_facts()
    save(
        args.name,
        {
            "rounds": args.rounds,
            "elapsed_s": round(elapsed, 1),
            "machine": machine,
            "loadavg_start": load_start["loadavg_start"],
            "server": server_facts(dsn),
            "results": results,
            "bulk_server_us_per_insert": bulk,
        },
    )


if __name__ == "__main__":
    main()
