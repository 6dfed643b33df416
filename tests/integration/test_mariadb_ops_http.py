"""`outboxkit relay --dsn mysql://… --metrics-port --dashboard`: the same Prometheus series,
readiness and dashboard pages as on PostgreSQL, read from a MariaDB outbox over HTTP."""

from __future__ import annotations

import datetime as dt
import json
import re
import signal
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from outboxkit import Event
from outboxkit.ops.dashboard import Dashboard
from outboxkit.testing import free_port, spawn_relay
from tests.integration.test_dashboard import served
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import commit_events, mariadb_execute, new_database
from tests.support.relaying import wait_for
from tests.support.servers import ensure_stream

TOKEN = "t0ken-" + uuid.uuid4().hex
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _get(url: str, **kw: Any) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url, **kw) as resp:
        return resp.status, await resp.text()


async def _post(url: str, token: str) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=5)
    headers = {"X-Outboxkit-Token": token, "Origin": url.split("/api/")[0].rsplit("/", 1)[0]}
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(url, headers=headers) as resp,
    ):
        return resp.status, await resp.text()


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _events(topic: str, n: int) -> list[Event]:
    return [Event(topic=topic, event_type="order.placed", payload={"i": i}) for i in range(n)]


def _pending(url: str) -> int:
    return int(mariadb_execute(url, "SELECT COUNT(*) FROM outbox WHERE status = 0")[0][0])


async def test_relay_on_mariadb_serves_metrics_readiness_and_the_dashboard(
    mariadb_server: MariaDB, nats_server: Any, proxy_factory: Any, tmp_path: Path
) -> None:
    url = new_database(mariadb_server)
    root = f"m{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    good, poison = f"{root}.orders", f"nostream{uuid.uuid4().hex[:8]}.orders"
    commit_events(url, _events(good, 25) + _events(poison, 2))
    proxy = proxy_factory("127.0.0.1", mariadb_server.port)
    via = urllib.parse.urlsplit(url)._replace(netloc=f"root@127.0.0.1:{proxy.port}").geturl()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    relay = spawn_relay(
        via,
        nats_server.url + "?timeout=1",
        tmp_path / "relay.log",
        *("--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
        *("--gauge-interval", "0.3", "--max-attempts", "1", "--poll-interval", "0.2"),
        *("--dashboard", "--admin-token", TOKEN),
    )
    try:

        async def scrape() -> Samples:
            status, text = await _get(f"{base}/metrics")
            assert status == 200
            return _samples(text)

        async def settled() -> bool:
            try:
                s = await scrape()
            except aiohttp.ClientError:
                return False
            return (
                _value(s, "outboxkit_events_published_total", topic=good) == 25
                and _value(s, "outboxkit_failed", topic=poison) == 2
                and ("outboxkit_backlog", (("topic", good),)) in s  # a reading after the drain:
                and _value(s, "outboxkit_backlog", topic=good) == 0  # a drained topic reports 0
            )

        await wait_for(settled, timeout=30, interval=0.2, what="25 published and 2 failed")
        s = await scrape()
        assert _value(s, "outboxkit_events_claimed_total") == 27
        dead = [v for (name, _), v in s.items() if name == "outboxkit_events_dead_lettered_total"]
        assert sum(dead) == 2
        assert _value(s, "outboxkit_gauges_read_timestamp_seconds") > time.time() - 60
        rules = yaml.safe_load(
            (Path(__file__).parents[2] / "deploy/prometheus/outboxkit-alerts.yml").read_text()
        )
        exprs = " ".join(r["expr"] for g in rules["groups"] for r in g["rules"])
        missing = set(re.findall(r"\boutboxkit_[a-z0-9_]+", exprs)) - {name for name, _ in s}
        missing = {m for m in missing if not m.startswith("outboxkit_cdc_")}  # WAL relay only
        assert not missing, f"alert rules use metrics the MariaDB relay did not export: {missing}"

        # A backlog the relay cannot drain shows in the gauges: scheduled rows an hour ahead.
        commit_events(
            url,
            [
                Event(topic=good, event_type="t", payload={}, delay=dt.timedelta(hours=1))
                for _ in range(3)
            ],
        )

        async def backlog_is(n: int) -> bool:
            return _value(await scrape(), "outboxkit_backlog", topic=good) == n

        await wait_for(lambda: backlog_is(3), timeout=15, what="backlog 3 from the MariaDB table")

        # The dashboard, served by the same relay, reads the same table.
        dash = f"{base}/dashboard/api"

        async def dashboard_shows_failed() -> bool:  # (its sampler reads every 2 s)
            status, overview = await _get(f"{dash}/overview")
            return status == 200 and json.loads(overview)["status"]["failed"] == 2

        await wait_for(dashboard_shows_failed, timeout=15, what="the relay's dashboard")
        status, failed = await _get(f"{dash}/failed")
        rows = json.loads(failed)
        assert status == 200 and len(rows) == 2 and {r["topic"] for r in rows} == {poison}
        row_id = rows[0]["id"]
        status, shown = await _get(f"{dash}/events/{row_id}")
        assert status == 200 and json.loads(shown)["topic"] == poison
        assert (await _post(f"{dash}/events/{row_id}/discard", "wrong-" + TOKEN))[0] == 403
        status, body = await _post(f"{dash}/events/{row_id}/discard", TOKEN)
        assert status == 200, body
        left = mariadb_execute(url, "SELECT COUNT(*) FROM outbox WHERE status = 2")[0][0]
        assert left == 1, "the dashboard's discard deleted exactly that dead letter"

        # /readyz follows the database: 503 with the reason while MariaDB is cut off.
        async def ready_is(code: int) -> bool:
            return (await _get(f"{base}/readyz"))[0] == code

        await wait_for(lambda: ready_is(200), timeout=15, what="/readyz 200")
        proxy.cut()
        await wait_for(lambda: ready_is(503), timeout=15, what="/readyz 503 while MariaDB is cut")
        assert (await _get(f"{base}/healthz"))[0] == 200, "alive even when not ready"
        proxy.resume()
        commit_events(url, _events(good, 2))
        await wait_for(lambda: ready_is(200), timeout=20, what="/readyz 200 after MariaDB is back")
        await wait_for(lambda: _pending(url) == 3, timeout=20, what="events after the outage")
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, (tmp_path / "relay.log").read_text()[-3000:]


async def test_dashboard_on_mariadb_samples_the_table_and_replays_a_dead_letter(
    mariadb_server: MariaDB,
) -> None:
    url = new_database(mariadb_server)
    topic = f"d{uuid.uuid4().hex[:8]}.orders"
    commit_events(url, _events(topic, 4))
    mariadb_execute(url, "UPDATE outbox SET status = 2, last_error = 'no' WHERE id IN (1, 2)")
    board = Dashboard(url, admin_token=TOKEN, sample_interval=60)  # one sample: no race below
    async with served(board) as base:
        await wait_for(lambda: board.latest is not None, timeout=10, what="a sample")
        status, overview = await _get(f"{base}/api/overview")
        data = json.loads(overview)
        assert status == 200 and data["status"]["pending"] == 2 and data["status"]["failed"] == 2
        assert [t["topic"] for t in data["status"]["topics"]] == [topic]
        status, body = await _post(f"{base}/api/events/1/replay", TOKEN)
        assert status == 200, body
        rows = mariadb_execute(url, "SELECT id, status, attempts FROM outbox ORDER BY id")
        assert rows[:2] == [(1, 0, 0), (2, 2, 0)], "only the replayed row went back to pending"
        assert board.connections.opened <= 2, "the dashboard keeps its MariaDB connections"
        # The server drops the kept connections (a restart, wait_timeout): the next page
        # still answers, on a new connection, instead of an error once per dead connection.
        database = url.rsplit("/", 1)[1]
        for (conn_id,) in mariadb_execute(
            url,
            "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = %s AND ID <> CONNECTION_ID()",
            (database,),
        ):
            mariadb_execute(url, f"KILL {int(conn_id)}")
        opened = board.connections.opened
        status, failed = await _get(f"{base}/api/failed")
        assert status == 200 and [r["id"] for r in json.loads(failed)] == [2], failed
        assert board.connections.opened > opened
