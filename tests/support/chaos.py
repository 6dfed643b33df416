"""The chaos run: writers, relays and a broker under random real faults; then count.

Writer processes commit events (some transactions rolled back, poison and oversized
events mixed in) while three ``outboxkit relay`` processes publish them to NATS
JetStream (file storage). Faults, at random: a relay SIGKILLed and restarted, the
broker SIGKILLed and restarted, the relays' database connections terminated, the
relay→broker link cut or stalled through a TCP proxy. At the end everything is
healed, the outbox drains, and the broker's stream is read back from the start.

The invariants, checked from the broker's side (docs/reliability.md):
  * nothing lost: every committed event (the ledger) is in the stream;
  * nothing phantom: no event of a rolled-back transaction is in it, nor any
    event that is not in the ledger;
  * no duplicate: NATS drops a re-published event by its ``Nats-Msg-Id``;
  * every poison event is dead-lettered with its reason, none is published;
  * the broker's token appears in no log line and no stored error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg

from outboxkit.testing import EmbeddedNats, TcpProxy, spawn_relay
from tests.support.chaos_writer import LEDGER

STREAM = "CHAOS"
TOKEN = "chaos-s3cr3t-token-7f3a9c"  # a test secret: it must appear in no log
REPO = Path(__file__).resolve().parents[2]
FAULTS = ("relay_kill", "relay_kill", "broker_kill", "db_terminate", "link_cut", "link_stall")


class _TokenNats(EmbeddedNats):
    """The embedded NATS, requiring a token: the relays' URL carries a secret."""

    def _command(self) -> list[str]:
        return [*super()._command(), "--auth", TOKEN]

    @property
    def token_url(self) -> str:
        return f"nats://{TOKEN}@127.0.0.1:{self.port}"


@dataclass
class ChaosReport:
    seconds: float
    seed: int
    writers: int
    relays: int
    faults: dict[str, int] = field(default_factory=dict)
    committed: int = 0
    rolled_back: int = 0
    poison: int = 0
    published_messages: int = 0
    distinct_published: int = 0
    lost: int = 0
    phantom: int = 0
    unknown: int = 0
    duplicates: int = 0
    poison_published: int = 0
    poison_not_dead_lettered: int = 0
    dead_letters_without_reason: int = 0
    healthy_dead_lettered: int = 0
    secret_leaks: int = 0
    relay_restarts: int = 0
    drain_seconds: float = 0.0
    writer_output: list[str] = field(default_factory=list)

    def violations(self) -> list[str]:
        checks = {
            "lost": self.lost,
            "phantom": self.phantom,
            "unknown": self.unknown,
            "duplicates": self.duplicates,
            "poison_published": self.poison_published,
            "poison_not_dead_lettered": self.poison_not_dead_lettered,
            "dead_letters_without_reason": self.dead_letters_without_reason,
            "healthy_dead_lettered": self.healthy_dead_lettered,
            "secret_leaks": self.secret_leaks,
        }
        return [f"{k}={v}" for k, v in checks.items() if v]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class ChaosRun:
    def __init__(
        self,
        dsn: str,
        workdir: Path,
        *,
        seconds: float,
        seed: int = 1,
        writers: int = 3,
        relays: int = 3,
    ) -> None:
        self.dsn = dsn
        self.workdir = workdir
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.report = ChaosReport(seconds=seconds, seed=seed, writers=writers, relays=relays)
        self.nats = _TokenNats(workdir / "nats")
        self.proxy: TcpProxy | None = None
        self.relays: list[subprocess.Popen[bytes] | None] = [None] * relays
        self.writers = writers
        self.rolled_back_path = workdir / "rolled_back.txt"
        self._deck: list[str] = []

    # -- parts ---------------------------------------------------------------------

    def _relay_url(self) -> str:
        assert self.proxy is not None
        return f"nats://{TOKEN}@127.0.0.1:{self.proxy.port}?stream={STREAM}&timeout=3"

    def _spawn_relay(self, i: int) -> None:
        self.relays[i] = spawn_relay(
            self.dsn,
            self._relay_url(),
            self.workdir / f"relay-{i}.log",
            "--lease",
            "5",
            "--max-attempts",
            "4",
            "--retry-base",
            "0.2",
            "--retry-cap",
            "1",
            "--poll-interval",
            "0.2",
            "--shutdown-timeout",
            "5",
            "--relay-id",
            f"chaos-{i}",
            "--log-interval",
            "5",
            log_level=None,
            cwd=REPO,
        )

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rolled_back_path.write_text("")
        self.nats.start()
        asyncio.run(_create_stream(self.nats.token_url))
        self.proxy = TcpProxy("127.0.0.1", self.nats.port).start()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(LEDGER)
        for i in range(len(self.relays)):
            self._spawn_relay(i)

    def _start_writers(self) -> list[subprocess.Popen[bytes]]:
        procs = []
        for w in range(self.writers):
            cmd = [
                sys.executable,
                "-m",
                "tests.support.chaos_writer",
                "--dsn",
                self.dsn,
                "--seconds",
                str(self.seconds),
                "--seed",
                str(w + 1),
                "--rolled-back",
                str(self.rolled_back_path.with_suffix(f".{w}.txt")),
            ]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
            )
        return procs

    # -- faults --------------------------------------------------------------------

    def _fault(self) -> None:
        if not self._deck:  # every kind of fault once per round, in a random order
            self._deck = [*FAULTS]
            self.rng.shuffle(self._deck)
        kind = self._deck.pop()
        self.report.faults[kind] = self.report.faults.get(kind, 0) + 1
        assert self.proxy is not None
        if kind == "relay_kill":
            i = self.rng.randrange(len(self.relays))
            proc = self.relays[i]
            if proc is not None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            time.sleep(self.rng.uniform(0.2, 1.5))
            self._spawn_relay(i)
            self.report.relay_restarts += 1
        elif kind == "broker_kill":
            self.nats.kill()
            time.sleep(self.rng.uniform(0.5, 3.0))
            self.nats.start()
        elif kind == "db_terminate":
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database()"
                    " AND application_name LIKE 'outboxkit-relay%'"
                )
        elif kind == "link_cut":
            self.proxy.cut()
            time.sleep(self.rng.uniform(0.5, 3.0))
            self.proxy.resume()
        else:
            self.proxy.pause()
            time.sleep(self.rng.uniform(0.5, 2.5))
            self.proxy.resume()

    def _heal(self) -> None:
        assert self.proxy is not None
        self.proxy.resume()
        if not self.nats.is_running():
            self.nats.start()
        for i, proc in enumerate(self.relays):
            if proc is None or proc.poll() is not None:
                self._spawn_relay(i)

    # -- the run -------------------------------------------------------------------

    def run(self) -> ChaosReport:
        try:
            self._start()
            writers = self._start_writers()
            while any(w.poll() is None for w in writers):
                time.sleep(self.rng.uniform(1.0, 4.0))
                if any(w.poll() is None for w in writers):
                    self._fault()
            for w in writers:
                out = w.stdout.read().decode() if w.stdout else ""
                self.report.writer_output.append(out.strip())
                if w.returncode != 0:
                    raise AssertionError(f"a writer failed (exit {w.returncode}):\n{out}")
            self._heal()
            self._drain()
            self._stop_relays()
            self._count()
            return self.report
        finally:
            for proc in self.relays:
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if self.proxy is not None:
                self.proxy.close()
            self.nats.close()

    def _drain(self, timeout: float = 180.0) -> None:
        start = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while True:
                row = conn.execute("SELECT count(*) FROM outbox WHERE status = 0").fetchone()
                if row is not None and row[0] == 0:
                    break
                if time.monotonic() - start > timeout:
                    raise AssertionError(f"the outbox did not drain in {timeout:.0f}s: {row}")
                time.sleep(0.5)
        self.report.drain_seconds = round(time.monotonic() - start, 1)

    def _stop_relays(self) -> None:
        for proc in self.relays:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.relays:
            if proc is not None and proc.wait(timeout=30) != 0:
                raise AssertionError(f"a relay exited {proc.returncode} on SIGTERM")

    def _count(self) -> None:
        r = self.report
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            ledger = {
                str(eid): kind
                for eid, kind in conn.execute("SELECT event_id, kind FROM chaos_ledger")
            }
            dead = {
                str(eid): (topic, err)
                for eid, topic, err in conn.execute(
                    "SELECT event_id, topic, last_error FROM outbox WHERE status = 2"
                )
            }
            stored_errors = [
                e
                for (e,) in conn.execute(
                    "SELECT last_error FROM outbox WHERE last_error IS NOT NULL"
                )
            ]
        rolled_back: set[str] = set()
        for path in self.workdir.glob("rolled_back.*.txt"):
            rolled_back.update(line for line in path.read_text().split() if line)
        published = asyncio.run(_read_stream(self.nats.token_url))
        distinct = set(published)
        healthy = {e for e, k in ledger.items() if k == "ok"}
        poison = {e for e, k in ledger.items() if k != "ok"}
        r.committed = len(healthy)
        r.rolled_back = len(rolled_back)
        r.poison = len(poison)
        r.published_messages = len(published)
        r.distinct_published = len(distinct)
        r.lost = len(healthy - distinct)
        r.phantom = len(distinct & rolled_back)
        r.unknown = len(distinct - set(ledger))
        r.duplicates = len(published) - len(distinct)
        r.poison_published = len(poison & distinct)
        r.poison_not_dead_lettered = len(poison - set(dead))
        r.dead_letters_without_reason = sum(1 for _, err in dead.values() if not err)
        r.healthy_dead_lettered = len(healthy & set(dead))
        texts = [p.read_text(errors="replace") for p in self.workdir.glob("relay-*.log")]
        r.secret_leaks = sum(t.count(TOKEN) for t in texts) + sum(TOKEN in e for e in stored_errors)


async def _create_stream(url: str) -> None:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(
                name=STREAM,
                subjects=["chaos.>"],
                storage=StorageType.FILE,
                duplicate_window=900.0,  # longer than any run: every re-publish is absorbed
            )
        )
    finally:
        await nc.close()


async def _read_stream(url: str) -> list[str]:
    """Every message's ``Nats-Msg-Id`` (the event id), in stream order."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        total = (await js.stream_info(STREAM)).state.messages
        sub = await js.pull_subscribe(
            "chaos.>",
            stream=STREAM,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE),
        )
        ids: list[str] = []
        deadline = time.monotonic() + 60
        while len(ids) < total and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
                for msg in await sub.fetch(min(1000, total - len(ids)), timeout=2):
                    ids.append((msg.headers or {}).get("Nats-Msg-Id", ""))
        await sub.unsubscribe()
        return ids
    finally:
        await nc.close()
