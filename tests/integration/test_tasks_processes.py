"""Worker processes killed and stopped: `outboxkit worker` under SIGKILL and SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from tests.support.tasks_app import RUNS_DDL, tasks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(RUNS_DDL)
    yield db_dsn


def spawn_worker(dsn: str, *args: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OUTBOXKIT_DSN": dsn,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    command = [sys.executable, "-m", "outboxkit", "worker", "--app",
               "tests.support.tasks_app:tasks", "--poll-interval", "0.1", *args]  # fmt: skip
    return subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE)


def stop_workers(*workers: subprocess.Popen[bytes] | None) -> None:
    """Thaw (a SIGSTOPped one) and stop each worker still running; kill one that hangs."""
    for worker in workers:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGCONT)
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(15)
            except subprocess.TimeoutExpired:
                worker.kill()


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def runs(dsn: str) -> list[tuple[int, int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT task_id, attempt FROM task_runs ORDER BY attempt").fetchall()


def state(dsn: str) -> list[tuple[str, int, int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT task_name, status, attempts FROM outboxkit_tasks ORDER BY id"
        ).fetchall()


def test_a_task_whose_worker_is_sigkilled_runs_again_after_its_lease(tasks_dsn: str) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "hang_first")
    first = spawn_worker(tasks_dsn, "--lease", "1")
    try:
        wait_for(lambda: len(runs(tasks_dsn)) == 1)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = time.monotonic()
        second = spawn_worker(tasks_dsn, "--lease", "1")
        try:
            wait_for(lambda: state(tasks_dsn) == [])
            assert time.monotonic() - killed_at >= 0.5  # not before the lease ran out
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(15) == 0
    finally:
        if first.poll() is None:
            first.kill()
    assert [attempt for _id, attempt in runs(tasks_dsn)] == [1, 2]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_sigterm_lets_running_handlers_finish_within_the_grace_then_hands_the_rest_back(
    tasks_dsn: str, loop: str
) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "sleep", {"seconds": 0.5}, priority=2)  # finishes in the grace
        tasks.enqueue(conn, "sleep", {"seconds": 60}, priority=1)  # does not
        for _ in range(3):
            tasks.enqueue(conn, "sleep", {"seconds": 0})  # never started
    worker = spawn_worker(
        tasks_dsn, "--concurrency", "2", "--shutdown-timeout", "1.5", "--loop", loop
    )
    try:
        wait_for(lambda: len(runs(tasks_dsn)) == 2)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    # the short one finished (deleted); the long one was handed back, its attempt refunded
    assert state(tasks_dsn) == [("sleep", 0, 0)] * 4


def test_the_worker_serves_task_metrics(tasks_dsn: str) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "sleep", {"seconds": 0})
        tasks.enqueue(conn, "sleep", {"seconds": 0}, delay=3600)
    worker = spawn_worker(tasks_dsn, "--metrics-port", str(port))
    try:
        wait_for(lambda: len(runs(tasks_dsn)) == 1)

        def scrape() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return str(r.read().decode())
            except OSError:
                return ""

        wait_for(
            lambda: 'outboxkit_tasks_finished_total{outcome="done",task="sleep"} 1.0' in scrape()
        )
        body = scrape()
        assert 'outboxkit_tasks_scheduled{task="sleep"} 1.0' in body
        assert 'outboxkit_task_run_seconds_count{task="sleep"} 1.0' in body
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0


def test_metrics_max_names_bounds_the_task_names_with_series_of_their_own(
    tasks_dsn: str,
) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for name in ("quick", "sleep"):
            tasks.enqueue(conn, name, {"seconds": 0} if name == "sleep" else None, delay=3600)
        tasks.enqueue(conn, "sleep", {"seconds": 0}, delay=3600)
    worker = spawn_worker(tasks_dsn, "--metrics-port", str(port), "--metrics-max-names", "1")
    try:

        def scrape() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return str(r.read().decode())
            except OSError:
                return ""

        wait_for(lambda: "outboxkit_tasks_scheduled{" in scrape())
        body = scrape()
        assert 'outboxkit_tasks_scheduled{task="sleep"} 2.0' in body  # the busiest
        assert 'outboxkit_tasks_scheduled{task="(other)"} 1.0' in body
        assert 'task="quick"' not in body
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0


def test_a_frozen_workers_late_completion_is_a_no_op_and_its_writes_are_rolled_back(
    tasks_dsn: str,
) -> None:
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (task_id bigint, attempt int)")
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "effect_once")
    # Finished tasks are kept (marked done): the zombie's completion finds the row still
    # there, so only the claim token can fence it off.
    keep = ("--lease", "1", "--retention", "keep")
    frozen = spawn_worker(tasks_dsn, *keep)
    try:
        wait_for(lambda: len(runs(tasks_dsn)) == 1)
        frozen.send_signal(signal.SIGSTOP)  # hung inside its ctx.transaction(): no heartbeat
        other = spawn_worker(tasks_dsn, *keep)
        try:
            # attempt 2 ran and completed
            wait_for(lambda: state(tasks_dsn) == [("effect_once", 2, 2)])
        finally:
            other.send_signal(signal.SIGTERM)
            assert other.wait(15) == 0
        frozen.send_signal(signal.SIGCONT)  # wakes, writes, tries to complete: fenced
        time.sleep(3)
        frozen.send_signal(signal.SIGTERM)
        assert frozen.wait(15) == 0
    finally:
        if frozen.poll() is None:
            frozen.kill()
    with psycopg.connect(tasks_dsn) as conn:
        effects = conn.execute("SELECT attempt FROM effects").fetchall()
    assert effects == [(2,)]  # the zombie attempt's write never landed
    assert [attempt for _id, attempt in runs(tasks_dsn)] == [1, 2]
    assert frozen.stderr is not None
    assert b"lease_lost" in frozen.stderr.read()  # its late settle was fenced off too


def failed_rows(dsn: str) -> dict[str, tuple[str, int, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT task_name, error_type, attempts, traceback_excerpt FROM outboxkit_tasks"
            " WHERE status = 3"
        ).fetchall()
    return {name: (error_type, attempts, tb or "") for name, error_type, attempts, tb in rows}


def test_a_handler_raising_systemexit_or_keyboardinterrupt_fails_its_task_not_the_worker(
    tasks_dsn: str,
) -> None:
    """SystemExit, KeyboardInterrupt and a BaseException subclass from a handler (sync and
    async) are failed attempts with their tracebacks; the worker keeps serving healthy tasks.
    Before: the process exited, its shutdown refunded the poison's attempt, and a supervisor
    restarted it into the same poison for ever (94-99 exits in 90 s)."""
    poisons = ("poison.exit", "poison.interrupt", "poison.base")
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for name in poisons:
            tasks.enqueue(conn, name, max_attempts=1)
        for _ in range(10):
            tasks.enqueue(conn, "sleep", {"seconds": 0})
    worker = spawn_worker(tasks_dsn, "--concurrency", "4")
    try:
        wait_for(lambda: len(failed_rows(tasks_dsn)) == 3 and len(runs(tasks_dsn)) == 10)
        wait_for(lambda: len(state(tasks_dsn)) == 3)  # the healthy ones done and deleted
        assert worker.poll() is None, "the worker exited"
        with psycopg.connect(tasks_dsn) as conn, conn.transaction():
            tasks.enqueue(conn, "sleep", {"seconds": 0})  # and it still serves
        wait_for(lambda: len(runs(tasks_dsn)) == 11)
        worker.send_signal(signal.SIGTERM)
        _out, err = worker.communicate(timeout=15)
        assert worker.returncode == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    # Sync handlers ran and returned: idle pool threads are no "handler still running"
    # (the shutdown said so after any sync handler had run).
    assert "exiting with a sync handler still running" not in err.decode()
    failed = failed_rows(tasks_dsn)
    assert {name: (t, a) for name, (t, a, _tb) in failed.items()} == {
        "poison.exit": ("SystemExit", 1),
        "poison.interrupt": ("KeyboardInterrupt", 1),
        "poison.base": ("PoisonError", 1),
    }
    assert all("Traceback" in tb for _t, _a, tb in failed.values())


def test_a_row_written_around_the_api_that_does_not_decode_fails_alone(
    tasks_dsn: str,
) -> None:
    """A payload nested 3 000 levels deep, inserted by SQL, fails its own task with the
    reason; the healthy tasks claimed beside it run, the worker stays up, and `tasks show`
    opens the row. Before: orjson's depth error raised out of the claim and the worker
    exited (after 3 exits, healthy tasks claimed with it were dead-lettered unrun)."""
    deep = "[" * 3000 + "]" * 3000
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(5):
            tasks.enqueue(conn, "sleep", {"seconds": 0})
        row = conn.execute(
            "INSERT INTO outboxkit_tasks (task_name, queue, payload) VALUES"
            " ('sleep', 'default', %s::jsonb) RETURNING id",
            (deep,),
        ).fetchone()
        for _ in range(5):
            tasks.enqueue(conn, "sleep", {"seconds": 0})
    assert row is not None
    bad = int(row[0])
    worker = spawn_worker(tasks_dsn, "--concurrency", "10")
    try:
        wait_for(lambda: len(runs(tasks_dsn)) == 10 and len(failed_rows(tasks_dsn)) == 1)
        assert worker.poll() is None, "the worker exited"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    assert state(tasks_dsn) == [("sleep", 3, 1)]
    assert failed_rows(tasks_dsn)["sleep"][0] == "UndecodablePayload"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    shown = subprocess.run(
        [sys.executable, "-m", "outboxkit", "tasks", "show", str(bad), "--dsn", tasks_dsn],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "does not decode" in shown.stdout and "UndecodablePayload" in shown.stdout


def _get(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sync_handlers_that_never_return_do_not_wedge_the_worker(tasks_dsn: str) -> None:
    """6 sync handlers that block for ever (timeout=1) on a worker of --concurrency 4: their
    threads are abandoned and replaced, and 20 healthy tasks run. Before: the 4 threads
    stayed taken, healthy tasks sat `running` (their leases renewed) and nothing was said."""
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(6):
            tasks.enqueue(conn, "block_forever", max_attempts=1)
        for _ in range(20):
            tasks.enqueue(conn, "quick")
    worker = spawn_worker(tasks_dsn, "--concurrency", "4")
    try:
        wait_for(lambda: len(runs(tasks_dsn)) == 20, timeout=45)
        wait_for(lambda: len(failed_rows(tasks_dsn)) == 1, timeout=20)  # the 6 timed out
        worker.send_signal(signal.SIGTERM)
        _out, err = worker.communicate(timeout=15)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert state(tasks_dsn) == [("block_forever", 3, 1)] * 6
    assert err.decode().count("its thread is abandoned and replaced") == 6


def test_past_its_cap_of_abandoned_threads_the_worker_is_degraded_and_hands_tasks_on(
    tasks_dsn: str,
) -> None:
    """--concurrency 2 replaces at most 8 abandoned threads; past that /readyz is 503 with
    the reason, sync tasks go back to the queue (attempt refunded) and another worker runs
    them; the degraded line is said once, not per task."""
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(8):
            tasks.enqueue(conn, "block_forever", max_attempts=1, priority=1)
    port = _free_port()
    stuck = spawn_worker(tasks_dsn, "--concurrency", "2", "--metrics-port", str(port))
    other = None
    try:
        wait_for(
            lambda: len(failed_rows(tasks_dsn)) == 1 and len(state(tasks_dsn)) == 8, timeout=45
        )
        wait_for(lambda: _get(port, "/readyz")[0] == 503, timeout=10)
        _status, text = _get(port, "/readyz")
        assert "8 sync handler thread(s) still running past their timeout" in text
        assert _get(port, "/healthz")[0] == 200
        # Healthy tasks enqueued once it is degraded (enqueued before, one could run in the
        # slot the 7th abandoned thread freed, before the 8th was abandoned: a race, not a
        # fault).
        with psycopg.connect(tasks_dsn) as conn, conn.transaction():
            for _ in range(10):
                tasks.enqueue(conn, "quick")
        time.sleep(1.0)  # the degraded worker hands the healthy tasks back, runs none
        assert runs(tasks_dsn) == []
        other = spawn_worker(tasks_dsn, "--concurrency", "2")
        wait_for(lambda: len(runs(tasks_dsn)) == 10, timeout=60)  # (loaded CI: 30 s ran out)
        assert {attempt for _id, attempt in runs(tasks_dsn)} == {1}  # attempts refunded
        stuck.send_signal(signal.SIGTERM)
        _out, err = stuck.communicate(timeout=15)
    finally:
        for proc in (stuck, other):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert err.decode().count("worker degraded") == 1
    assert "exiting with a sync handler still running" in err.decode()


def test_a_handler_error_quoting_the_database_password_is_masked_everywhere(
    tasks_dsn: str,
) -> None:
    """The worker registers its DSN's secrets as the relay does: a handler's error that
    quotes the password is masked in the worker's log, the stored error and traceback, and
    `tasks failed` / `tasks list` (the password was shown in all of them)."""
    password = "pw-" + uuid.uuid4().hex[:12]
    info = psycopg.conninfo.conninfo_to_dict(tasks_dsn)
    info["password"] = password  # trust authentication ignores it; the worker still has it
    dsn = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v})
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "leak", max_attempts=1)
    worker = spawn_worker(dsn)
    try:
        wait_for(lambda: len(failed_rows(tasks_dsn)) == 1)
        worker.send_signal(signal.SIGTERM)
        _out, err = worker.communicate(timeout=15)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "login failed, password was" in err.decode()
    assert password not in err.decode()
    with psycopg.connect(tasks_dsn) as conn:
        stored = conn.execute(
            "SELECT last_error || traceback_excerpt FROM outboxkit_tasks"
        ).fetchone()
    assert stored is not None and "login failed" in stored[0] and password not in stored[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for command in (["failed"], ["list"], ["failed", "--json"], ["show", "1", "--json"]):
        shown = subprocess.run(
            [sys.executable, "-m", "outboxkit", "tasks", *command, "--dsn", dsn],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert "login failed" in shown.stdout and password not in shown.stdout, command


def test_readyz_and_metrics_through_a_database_cut_and_black_hole(tasks_dsn: str) -> None:
    """The worker's /readyz says when the database is away (it had only /healthz, 200
    throughout), and /metrics answers within its bound without the table's gauges (it
    answered 500 through a restart and hung 5 s and more in a black hole)."""
    from outboxkit.testing import TcpProxy

    info = psycopg.conninfo.conninfo_to_dict(tasks_dsn)
    proxy = TcpProxy(str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432))
    proxy.start()
    info.update(host="127.0.0.1", port=str(proxy.port))
    through = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v})
    port = _free_port()
    worker = spawn_worker(through, "--metrics-port", str(port), "--lease", "3")
    try:
        wait_for(lambda: _get(port, "/readyz")[0] == 200 if _port_open(port) else False)
        assert "outboxkit_tasks_queued" in _get(port, "/metrics")[1]
        for fault in (proxy.cut, proxy.pause):
            fault()
            wait_for(lambda: _get(port, "/readyz")[0] == 503, timeout=20)
            assert "the database" in _get(port, "/readyz")[1]
            started = time.monotonic()
            status, body = _get(port, "/metrics")
            assert status == 200 and "outboxkit_tasks_finished_total" in body
            assert time.monotonic() - started < 4.5
            assert _get(port, "/healthz")[0] == 200
            proxy.resume()
            wait_for(lambda: _get(port, "/readyz")[0] == 200, timeout=30)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(20) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
        proxy.close()


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_frozen_workers_result_and_progress_never_land_over_the_live_attempts(
    tasks_dsn: str,
) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        task_id = tasks.enqueue(conn, "zombie.result")
    assert task_id is not None
    first = spawn_worker(tasks_dsn, "--lease", "1")
    second = None
    try:
        wait_for(lambda: len(runs(tasks_dsn)) == 1)
        first.send_signal(signal.SIGSTOP)  # frozen mid-handler, past its lease
        second = spawn_worker(tasks_dsn, "--lease", "1")
        wait_for(lambda: len(runs(tasks_dsn)) == 2)
        first.send_signal(signal.SIGCONT)  # the zombie wakes while attempt 2 runs
        result = tasks.wait(tasks_dsn, task_id, timeout=30)
        time.sleep(1.5)  # the zombie's late progress and settle, had they landed
        result = tasks.result(tasks_dsn, task_id)  # type: ignore[assignment]
    finally:
        stop_workers(first, second)
    assert result is not None and result.status == "done"
    assert result.value == {"attempt": 2}
    assert result.progress == {"attempt": 2, "final": 1}
    assert [attempt for _id, attempt in runs(tasks_dsn)] == [1, 2]


def _states(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT status, attempts, count(*) FROM outboxkit_tasks GROUP BY 1, 2"
        ).fetchall()
    return {f"{status}/{attempts}": int(n) for status, attempts, n in rows}


def test_prefetched_tasks_go_back_at_once_on_sigterm_and_after_the_lease_on_sigkill(
    tasks_dsn: str,
) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(40):
            tasks.enqueue(conn, "sleep", {"seconds": 0.4})

    def running() -> int:
        with psycopg.connect(tasks_dsn) as conn:
            row = conn.execute("SELECT count(*) FROM outboxkit_tasks WHERE status = 1").fetchone()
        return int(row[0]) if row else 0

    # 2 slots; once tasks have run, a claim takes more than the free slots (the local queue).
    worker = spawn_worker(tasks_dsn, "--concurrency", "2", "--lease", "4")
    try:
        wait_for(lambda: running() > 2)  # claimed beyond the 2 slots: prefetched
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(15) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    states = _states(tasks_dsn)
    assert not any(k.startswith("1/") for k in states), states  # nothing left running
    assert set(states) == {"0/0"}, states  # handed back, the attempt refunded
    started = {task_id for task_id, _attempt in runs(tasks_dsn)}
    assert states["0/0"] == 40 - len(started)  # what started finished; the rest wait

    killed = spawn_worker(tasks_dsn, "--concurrency", "2", "--lease", "2")
    try:
        wait_for(lambda: running() > 2)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
    finally:
        if killed.poll() is None:
            killed.kill()
    held = running()
    assert held > 2  # the prefetched are leased to a dead worker...
    after = spawn_worker(tasks_dsn, "--concurrency", "8", "--lease", "2")
    try:
        wait_for(lambda: _states(tasks_dsn) == {}, timeout=60)  # ...claimable after the lease
    finally:
        after.send_signal(signal.SIGTERM)
        assert after.wait(15) == 0
    assert {task_id for task_id, _attempt in runs(tasks_dsn)} >= started
    assert len({task_id for task_id, _attempt in runs(tasks_dsn)}) == 40
