"""Task mode's table and store on real PostgreSQL: migrate --tasks, the claim, fencing, leases."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit.backends.postgres.migrate import MigrationAction, migrate_tasks, schema_version
from outboxkit.backends.postgres.tasks_pg import PgTaskStore
from outboxkit.backends.postgres.tasks_sql import TaskStatements
from outboxkit.ops.cli.app import main
from outboxkit.queue.store import DONE, Claim, Decision, Verdict
from outboxkit.queue.task_claims import TaskClaims
from outboxkit.queue.tasks import TaskStatus

TABLE = "outboxkit_tasks"


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


def _enqueue(
    dsn: str,
    name: str,
    *,
    queue: str = "default",
    priority: int = 0,
    key: str | None = None,
    delay: float = 0.0,
    max_attempts: int | None = None,
) -> None:
    sql = TaskStatements(TABLE)
    with psycopg.connect(dsn) as conn:
        params = (name, queue, "{}", priority, key, None, max_attempts, None, delay, None,
                  sql.channel)  # fmt: skip
        conn.execute(sql.enqueue, params)


async def _claim(  # type: ignore[no-untyped-def]
    store: PgTaskStore | TaskClaims, limit: int = 10, lease: float = 30.0
):
    """One claim through the core's claim policies (as the worker claims): a suspect passed
    over is claimed alone by the next call."""
    claims = store if isinstance(store, TaskClaims) else TaskClaims(store, queues=["default"])
    return await claims.claim(
        limit=limit, lease=lease, token=uuid.uuid4(), owner="t", max_attempts=5
    )


def test_migrate_tasks_creates_then_finds_nothing_to_do_and_the_cli_does_the_same(
    empty_db_dsn: str,
) -> None:
    first = migrate_tasks(empty_db_dsn, table="jobs")
    assert first.action is MigrationAction.CREATED
    assert migrate_tasks(empty_db_dsn, table="jobs").action is MigrationAction.UNCHANGED
    assert schema_version(empty_db_dsn, table="jobs", kind="tasks") == 11
    result = CliRunner().invoke(main, ["migrate", "--tasks", "--dsn", empty_db_dsn])
    assert result.exit_code == 0, result.output
    assert "created task table 'outboxkit_tasks'" in result.output
    sql = CliRunner().invoke(main, ["migrate", "--tasks", "--print-sql"])
    assert 'CREATE TABLE IF NOT EXISTS "outboxkit_tasks"' in sql.output


def test_the_claim_takes_the_highest_priority_first_in_its_queues_and_nothing_early(
    tasks_dsn: str,
) -> None:
    _enqueue(tasks_dsn, "low")
    _enqueue(tasks_dsn, "high", priority=5)
    _enqueue(tasks_dsn, "later", priority=9, delay=60)
    _enqueue(tasks_dsn, "elsewhere", queue="other", priority=9)

    async def run() -> list[str]:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            claim = await _claim(store)
            assert claim is not None
            return [t.task_name for t in sorted(claim.items, key=lambda t: -t.priority)]
        finally:
            await store.close()

    assert asyncio.run(run()) == ["high", "low"]


def test_a_keyed_task_waits_for_the_earlier_tasks_of_its_key(tasks_dsn: str) -> None:
    for i in range(3):
        _enqueue(tasks_dsn, f"a{i}", key="a")
    _enqueue(tasks_dsn, "b0", key="b")

    async def run() -> list[list[str]]:
        store = PgTaskStore(tasks_dsn, TABLE)
        rounds = []
        try:
            for _ in range(4):
                claim = await _claim(store)
                names = [] if claim is None else [t.task_name for t in claim.items]
                rounds.append(sorted(names))
                if claim is not None:
                    await store.settle(claim, [DONE] * len(claim.ids))
        finally:
            await store.close()
        return rounds

    assert asyncio.run(run()) == [["a0", "b0"], ["a1"], ["a2"], []]


def test_a_late_settle_after_the_lease_ran_out_and_another_claim_took_it_is_a_no_op(
    tasks_dsn: str,
) -> None:
    _enqueue(tasks_dsn, "slow")

    async def run() -> None:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            first = await _claim(store, lease=0.2)
            assert first is not None and first.items[0].attempt == 1
            assert await _claim(store) is None  # leased: nobody else gets it
            await asyncio.sleep(0.3)
            second = await _claim(store)
            # a new attempt, spared: nothing says the first one's death was its own
            assert second is not None and second.items[0].attempt == 2
            assert second.items[0].spared == 1
            late = await store.settle(first, [DONE])
            assert (list(late.ids), late.lost) == ([], 1)
            assert await store.extend_leases(first, 30.0) == 0
            retry = Decision(Verdict.RETRY, 60.0, "boom")
            settled = await store.settle(second, [retry])
            assert list(settled.ids) == second.ids
        finally:
            await store.close()

    asyncio.run(run())
    with psycopg.connect(tasks_dsn) as conn:
        row = conn.execute(f"SELECT status, attempts, last_error FROM {TABLE}").fetchone()
    assert row == (TaskStatus.PENDING, 2, "boom")


def test_a_task_claimed_max_attempts_times_and_never_settled_is_dead_lettered_by_the_claim(
    tasks_dsn: str,
) -> None:
    _enqueue(tasks_dsn, "poison", max_attempts=2)

    async def run() -> str:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            # Each claim by a new worker (the last one died holding it). Two deaths beside
            # other tasks are not charged; from then on it runs alone, and two deaths alone
            # reach its max_attempts of 2.
            runs = []
            while True:
                claims = TaskClaims(store, queues=["default"])
                claim = await _claim(claims, lease=0.05) or await _claim(claims, lease=0.05)
                assert claim is not None
                if not claim.ids:
                    break
                runs.append((claim.items[0].attempt, claims.claimed_alone))
                await asyncio.sleep(0.1)
            assert runs == [(1, 0), (2, 0), (3, 1), (4, 1)]
            return claim.dead[0][1]
        finally:
            await store.close()

    assert asyncio.run(run()) == "crash_loop"
    with psycopg.connect(tasks_dsn) as conn:
        row = conn.execute(f"SELECT status, error_type FROM {TABLE}").fetchone()
    assert row == (TaskStatus.FAILED, "CrashLoop")


def test_purge_removes_finished_tasks_past_the_age_in_batches(tasks_dsn: str) -> None:
    for _ in range(5):
        _enqueue(tasks_dsn, "t")
    with psycopg.connect(tasks_dsn) as conn:
        conn.execute(
            f"UPDATE {TABLE} SET status = %s, finished_at = now() - interval '2 days'"
            " WHERE id <= 3",
            (TaskStatus.DONE,),
        )
    result = CliRunner().invoke(
        main, ["tasks", "purge", "--dsn", tasks_dsn, "--older-than", "1d", "--batch-size", "2"]
    )
    assert result.exit_code == 0 and "purged 3 finished task(s)" in result.output, result.output
    with psycopg.connect(tasks_dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()
    assert row == (2,)


def test_the_claim_walks_the_claim_index_past_a_large_history(tasks_dsn: str) -> None:
    with psycopg.connect(tasks_dsn) as conn:
        conn.execute(
            f"INSERT INTO {TABLE} (task_name, status, finished_at)"
            f" SELECT 'old', {int(TaskStatus.DONE)}, now() FROM generate_series(1, 200000)"
        )
        conn.execute(f"INSERT INTO {TABLE} (task_name) SELECT 'new' FROM generate_series(1, 50)")
        conn.commit()
        conn.autocommit = True
        conn.execute(f"ANALYZE {TABLE}")
        sql = TaskStatements(TABLE)
        params = {"limit": 10, "lease": 30.0, "token": uuid.uuid4(), "owner": "t",
                  "max_attempts": 5, "queue": "default", "names": ["new"],
                  "alone": False, "name": None, "concurrency": None, "rate": None, "burst": 1,
                  "skip": []}  # fmt: skip
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql.claim, params))
    assert "outboxkit_tasks_claim_idx" in plan, plan
    assert "Seq Scan" not in plan, plan


def test_the_task_migration_files_applied_by_another_tool_equal_migrate_tasks(
    empty_db_dsn: str,
) -> None:
    from tests.integration.test_migration_files import _apply, _diff, _schemas

    _schemas(empty_db_dsn, "fresh", "files")
    migrate_tasks(empty_db_dsn, table="fresh.jobs")
    _apply(empty_db_dsn, "files.jobs", "tasks", through=11)
    _diff(empty_db_dsn, "fresh", "files")
    again = migrate_tasks(empty_db_dsn, table="files.jobs")
    assert again.action is MigrationAction.UNCHANGED
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute('DROP INDEX files."jobs_unique_idx"')
    repaired = migrate_tasks(empty_db_dsn, table="files.jobs")
    assert repaired.action is MigrationAction.REPAIRED
    assert repaired.recreated == ("index files.jobs_unique_idx",)


def test_grouped_completions_are_each_fenced_by_their_own_token(tasks_dsn: str) -> None:
    for _ in range(3):
        _enqueue(tasks_dsn, "t")

    async def run() -> list[tuple[list[int], int]]:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            claims = []
            for _ in range(3):
                claim = await _claim(store, limit=1)
                assert claim is not None
                claims.append(claim)
            stale = Claim(uuid.uuid4(), claims[1].ids, claims[1].items)  # a token it never had
            results = await asyncio.gather(
                store.settle(claims[0], [DONE]),
                store.settle(stale, [DONE]),
                store.settle(claims[2], [DONE]),
            )
            return [(list(r.ids), r.lost) for r in results]
        finally:
            await store.close()

    assert asyncio.run(run()) == [([1], 0), ([], 1), ([3], 0)]
    with psycopg.connect(tasks_dsn) as conn:
        assert conn.execute(f"SELECT id FROM {TABLE}").fetchall() == [(2,)]


def test_a_worker_on_a_table_nobody_vacuums_says_so_at_start(
    tasks_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The machine's CI server runs with autovacuum = off: the task table grew from 3 to
    # 21 MB in 8 minutes there (docs/benchmarks.md), and nothing said why.
    with psycopg.connect(tasks_dsn) as conn:
        row = conn.execute("SELECT current_setting('autovacuum')::bool").fetchone()
    server_vacuums = bool(row and row[0])

    def start_warnings() -> list[str]:
        caplog.clear()

        async def run() -> None:
            store = PgTaskStore(tasks_dsn, TABLE)
            try:
                await store.start()
            finally:
                await store.close()

        with caplog.at_level("WARNING", logger="outboxkit.worker"):
            asyncio.run(run())
        return [r.getMessage() for r in caplog.records if "never vacuumed" in r.getMessage()]

    found = start_warnings()
    if server_vacuums:
        assert found == []
    else:
        assert len(found) == 1 and "autovacuum = off" in found[0]
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        # stored as written: 'No' is false too
        conn.execute(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = 'No')")
    [warning] = start_warnings()
    assert "grow without bound" in warning and f'VACUUM "{TABLE}"' in warning
    if server_vacuums:
        assert "autovacuum_enabled = false" in warning


def test_a_store_on_a_table_before_version_9_says_to_migrate(tasks_dsn: str) -> None:
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {TABLE}_key_rates")

    async def start() -> None:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            await store.start()
        finally:
            await store.close()

    with pytest.raises(Exception, match=r"older than this outboxkit.*outboxkit migrate --tasks"):
        asyncio.run(start())


async def test_a_flood_behind_a_full_limit_is_parked_in_batches_counted_as_queued_and_let_go_when_the_limit_goes(  # noqa: E501
    tasks_dsn: str,
) -> None:
    from outboxkit.backends.postgres.tasks_pg import task_gauges

    with psycopg.connect(tasks_dsn) as conn:  # (enqueued as the statement would: pending)
        conn.execute(f"INSERT INTO {TABLE} (task_name) SELECT 'lim' FROM generate_series(1, 3000)")
    limited = PgTaskStore(tasks_dsn, TABLE, names=["lim"])
    claims = TaskClaims(limited, queues=["default"], concurrency={"lim": 2})
    try:
        got = await _claim(claims)
        assert got is not None and len(got.ids) == 2  # the limit is full
        sweeps = [await limited.release_dependents(None, 100) for _ in range(4)]
        assert sweeps == [100, 100, 0, 0]  # 1 002 a statement while a full batch is left
        with psycopg.connect(tasks_dsn) as conn:
            states = dict(conn.execute(f"SELECT status, count(*) FROM {TABLE} GROUP BY 1"))
        assert states == {TaskStatus.RUNNING: 2, TaskStatus.PENDING: 2, TaskStatus.WAITING: 2996}
        gauges = {row[0]: row[1:4] for row in task_gauges(tasks_dsn, TABLE)}
        assert gauges["lim"] == (2998, 0, 2)  # parked tasks are queued, for the metrics
    finally:
        await limited.close()
    unlimited = PgTaskStore(tasks_dsn, TABLE, names=["lim"])  # a deploy without the limit
    try:
        await _claim(TaskClaims(unlimited, queues=["default"]), limit=1)
        while await unlimited.release_dependents(None, 1000):
            pass
        with psycopg.connect(tasks_dsn) as conn:
            left = conn.execute(f"SELECT count(*) FROM {TABLE} WHERE status = %s", (5,))
            assert left.fetchone() == (0,)
    finally:
        await unlimited.close()
