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
import random
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import psycopg

from outboxkit.testing import EmbeddedNats, TcpProxy, spawn_relay
from tests.support.chaos_common import (
    REPO,
    ChaosReportBase,
    create_stream,
    fault_while_writing,
    kill_relays,
    next_fault,
    read_rolled_back,
    read_stream,
    respawn_exited,
    restart_relay,
    start_writers,
    stop_relays,
    wait_drained,
)
from tests.support.chaos_writer import LEDGER

STREAM = "CHAOS"
TOKEN = "chaos-s3cr3t-token-7f3a9c"  # a test secret: it must appear in no log
FAULTS = ("relay_kill", "relay_kill", "broker_kill", "db_terminate", "link_cut", "link_stall")


class _TokenNats(EmbeddedNats):
    """The embedded NATS, requiring a token: the relays' URL carries a secret."""

    def _command(self) -> list[str]:
        return [*super()._command(), "--auth", TOKEN]

    @property
    def token_url(self) -> str:
        return f"nats://{TOKEN}@127.0.0.1:{self.port}"


@dataclass
class ChaosReport(ChaosReportBase):
    CHECKED: ClassVar[tuple[str, ...]] = (
        "lost",
        "phantom",
        "unknown",
        "duplicates",
        "poison_published",
        "poison_not_dead_lettered",
        "dead_letters_without_reason",
        "healthy_dead_lettered",
        "secret_leaks",
    )

    seconds: float
    seed: int
    writers: int
    relays: int
    faults: dict[str, int] = field(default_factory=dict)
    committed: int = 0
    rolled_back: int = 0
    poison: int = 0
    #: The poison committed, by kind (poison topic, oversized, at the limit, Status header).
    poison_kinds: dict[str, int] = field(default_factory=dict)
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
        asyncio.run(create_stream(self.nats.token_url, STREAM, ["chaos.>"]))
        self.proxy = TcpProxy("127.0.0.1", self.nats.port).start()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(LEDGER)
        for i in range(len(self.relays)):
            self._spawn_relay(i)

    def _start_writers(self) -> list[subprocess.Popen[bytes]]:
        return start_writers(
            "tests.support.chaos_writer",
            self.writers,
            lambda w: [
                *("--dsn", self.dsn, "--seconds", str(self.seconds), "--seed", str(w + 1)),
                *("--rolled-back", str(self.rolled_back_path.with_suffix(f".{w}.txt"))),
            ],
        )

    # -- faults --------------------------------------------------------------------

    def _fault(self) -> None:
        kind = next_fault(self._deck, FAULTS, self.rng, self.report.faults)
        assert self.proxy is not None
        if kind == "relay_kill":
            i = self.rng.randrange(len(self.relays))
            restart_relay(self.relays, i, self.rng, self._spawn_relay)
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
        respawn_exited(self.relays, self._spawn_relay)

    # -- the run -------------------------------------------------------------------

    def run(self) -> ChaosReport:
        try:
            self._start()
            writers = self._start_writers()
            fault_while_writing(
                writers, self.rng, self._fault, (1.0, 4.0), self.report.writer_output
            )
            self._heal()
            self._drain()
            stop_relays(self.relays)
            self._count()
            return self.report
        finally:
            kill_relays(self.relays)
            if self.proxy is not None:
                self.proxy.close()
            self.nats.close()

    def _drain(self, timeout: float = 180.0) -> None:
        self.report.drain_seconds = wait_drained(
            self.dsn, timeout, 0.5, lambda row: f"the outbox did not drain in {timeout:.0f}s: {row}"
        )

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
        rolled_back = read_rolled_back(self.workdir)
        headers = asyncio.run(
            read_stream(self.nats.token_url, STREAM, "chaos.>", batch=1000, seconds=60)
        )
        published = [h.get("Nats-Msg-Id", "") for h in headers]
        distinct = set(published)
        healthy = {e for e, k in ledger.items() if k == "ok"}
        poison = {e for e, k in ledger.items() if k != "ok"}
        r.committed = len(healthy)
        r.rolled_back = len(rolled_back)
        r.poison = len(poison)
        r.poison_kinds = dict(sorted(Counter(ledger[e] for e in poison).items()))
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
