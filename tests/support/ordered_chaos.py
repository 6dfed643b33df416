"""The ordered chaos run: per-key order from commit to broker, under real faults.

Writer processes (tests/support/ordered_chaos_writer.py) commit keyed events over 200
keys through ``Outbox(ordered=True)``, some transactions rolled back, and record each key's
committed sequence from the database side (``ochaos_ledger``). Three ``outboxkit relay``
processes publish them (``--ordered``, or not: the naive run) to NATS JetStream (an own
server with a file store) or Kafka (the embedded Tansu broker behind a TCP proxy). Faults
at random while the writers run: a relay SIGKILLed and restarted; for NATS the broker
SIGKILLed and restarted on its store; for Kafka (memory storage: a restart would lose
the topic) the relay→broker link cut. Then everything heals, the outbox drains, and the
broker is read from the start.

Checked from the broker's side, per key, after dropping repeats of an event id (first
occurrence kept): the consumed sequence is exactly the committed sequence. Reported:
lost (committed, never consumed), phantom (rolled back, consumed), unknown (consumed,
never committed), keys out of order (same events, another order) and the inversions.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import random
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from outboxkit.testing import EmbeddedKafka, EmbeddedNats, TcpProxy, free_port, spawn_relay
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
from tests.support.chaos_sql import cursor, lost_rows, migrate_ordered, ordered_ledger, scalar
from tests.support.ordered_chaos_writer import TOPIC, setup

STREAM = "OCHAOS"
Broker = Literal["nats", "kafka"]


@dataclass
class OrderedChaosReport(ChaosReportBase):
    CHECKED: ClassVar[tuple[str, ...]] = (
        "lost",
        "phantom",
        "unknown",
        "keys_out_of_order",
        "dead_lettered",
    )

    broker: str
    ordered: bool
    seconds: float
    seed: int
    writers: int
    relays: int
    keys: int
    faults: dict[str, int] = field(default_factory=dict)
    committed: int = 0
    rolled_back: int = 0
    consumed_messages: int = 0
    distinct_consumed: int = 0
    duplicates: int = 0
    lost: int = 0
    phantom: int = 0
    unknown: int = 0
    dead_lettered: int = 0
    keys_out_of_order: int = 0
    inversions: int = 0  # pairs of one key's events consumed in the opposite commit order
    examples: list[str] = field(default_factory=list)
    past_watermark: int = 0  # Kafka: records read beyond the broker's high watermark
    lost_rows: list[dict[str, str]] = field(default_factory=list)  # what the outbox says of them
    timeline: list[str] = field(default_factory=list)  # faults, by UTC time of day
    writing_seconds: float = 0.0
    drain_seconds: float = 0.0
    total_seconds: float = 0.0
    writer_output: list[str] = field(default_factory=list)


class _KafkaBroker:
    """Tansu (memory storage) behind a proxy it advertises: the link can be cut."""

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self.past_watermark = 0  # records read at or past a partition's high watermark
        port = free_port()
        self.proxy = TcpProxy("127.0.0.1", port).start()
        self.server = EmbeddedKafka(port=port, advertised_port=self.proxy.port)

    def start(self) -> None:
        self.server.start()
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.server.bootstrap})
        futures = admin.create_topics([NewTopic(TOPIC, num_partitions=self.partitions)])
        for future in futures.values():
            with contextlib.suppress(Exception):  # already there: auto-created
                future.result(10)

    @property
    def url(self) -> str:
        return f"kafka://{self.server.bootstrap}"

    def close(self) -> None:
        self.proxy.close()
        self.server.close()

    def read(self) -> list[tuple[str, str | None]]:
        """(event id, key) of every message, in offset order within each partition."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer(
            {
                "bootstrap.servers": self.server.bootstrap,
                "group.id": f"ochaos-reader-{time.monotonic_ns()}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )
        try:
            meta = consumer.list_topics(TOPIC, timeout=10).topics[TOPIC]
            parts = sorted(meta.partitions)
            ends = {
                p: consumer.get_watermark_offsets(TopicPartition(TOPIC, p), 10)[1] for p in parts
            }
            consumer.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in parts])
            got: list[tuple[str, str | None]] = []
            seen = {p: 0 for p in parts}
            deadline = time.monotonic() + 120
            idle_since = time.monotonic()
            # Past the high watermarks too, until nothing came for 3 s: a broker whose
            # watermark lags its last record must not look like a loss.
            while time.monotonic() < deadline:
                caught_up = all(seen[p] >= ends[p] for p in parts)
                if caught_up and time.monotonic() - idle_since > 3.0:
                    break
                msg = consumer.poll(0.5)
                if msg is None or msg.error() is not None:
                    continue
                idle_since = time.monotonic()
                partition, offset = msg.partition() or 0, msg.offset() or 0
                if offset >= ends[partition]:
                    self.past_watermark += 1
                seen[partition] = offset + 1
                headers = dict(msg.headers() or [])
                key = msg.key()
                got.append(
                    (headers["ce_id"].decode(), key.decode() if isinstance(key, bytes) else key)
                )
            return got
        finally:
            consumer.close()


class _NatsBroker:
    """An own nats-server with a JetStream file store: SIGKILLed and restarted on it."""

    def __init__(self, workdir: Path) -> None:
        self.server = EmbeddedNats(workdir / "nats")

    def start(self) -> None:
        self.server.start()
        asyncio.run(create_stream(self.server.url, STREAM, ["ochaos.>"]))

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.server.port}?stream={STREAM}&timeout=3"

    def close(self) -> None:
        self.server.close()

    def read(self) -> list[tuple[str, str | None]]:
        """(event id, key) of every message, in stream order."""
        headers = asyncio.run(
            read_stream(self.server.url, STREAM, "ochaos.>", batch=2000, seconds=120)
        )
        return [(h.get("Nats-Msg-Id", ""), h.get("ce-partitionkey")) for h in headers]


class OrderedChaosRun:
    def __init__(
        self,
        dsn: str,
        workdir: Path,
        *,
        broker: Broker,
        ordered: bool = True,
        events: int = 20_000,
        seconds: float = 30.0,
        seed: int = 1,
        writers: int = 4,
        relays: int = 3,
        keys: int = 200,
        partitions: int = 64,
        lease: float = 4.0,
        rollback_rate: float = 0.12,
    ) -> None:
        self.dsn = dsn
        self.workdir = workdir
        self.broker_kind = broker
        self.ordered = ordered
        self.events = events
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.keys = keys
        self.partitions = partitions
        self.lease = lease
        self.rollback_rate = rollback_rate
        self.writers = writers
        self.report = OrderedChaosReport(
            broker=broker,
            ordered=ordered,
            seconds=seconds,
            seed=seed,
            writers=writers,
            relays=relays,
            keys=keys,
        )
        self.broker: _NatsBroker | _KafkaBroker = (
            _NatsBroker(workdir) if broker == "nats" else _KafkaBroker(partitions=8)
        )
        self.relays: list[subprocess.Popen[bytes] | None] = [None] * relays
        self._log_from = [0] * relays  # where the running incarnation's log lines start
        self._deck: list[str] = []

    # -- parts ---------------------------------------------------------------------

    def _spawn_relay(self, i: int) -> None:
        args = [
            # keep: a published row stays, with who published it and when (evidence)
            *("--lease", str(self.lease), "--max-attempts", "25", "--retention", "keep"),
            *("--retry-base", "0.2", "--retry-cap", "1", "--poll-interval", "0.2"),
            *("--shutdown-timeout", "5", "--relay-id", f"ochaos-{i}", "--log-interval", "5"),
        ]
        if self.ordered:
            args += ["--ordered", "--on-dead-letter", "block"]
        log = self.workdir / f"relay-{i}.log"
        self._log_from[i] = log.stat().st_size if log.exists() else 0
        self.relays[i] = spawn_relay(
            self.dsn,
            self.broker.url,
            self.workdir / f"relay-{i}.log",
            *args,
            log_level=None,
            cwd=REPO,
        )

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        migrate_ordered(self.dsn, self.partitions)  # (PostgreSQL or MariaDB)
        setup(self.dsn, self.keys)
        self.broker.start()
        for i in range(len(self.relays)):
            self._spawn_relay(i)

    def _start_writers(self) -> list[subprocess.Popen[bytes]]:
        per_writer = -(-self.events // self.writers)
        return start_writers(
            "tests.support.ordered_chaos_writer",
            self.writers,
            lambda w: [
                *("--dsn", self.dsn, "--events", str(per_writer)),
                *("--seconds", str(self.seconds), "--seed", str(w + 1)),
                *("--keys", str(self.keys)),
                *("--rolled-back", str(self.workdir / f"rolled_back.{w}.txt")),
                *("--rollback-rate", str(self.rollback_rate)),
            ],
        )

    # -- faults --------------------------------------------------------------------

    def _kinds(self) -> list[str]:
        other = "broker_kill" if self.broker_kind == "nats" else "link_cut"
        return ["relay_kill", "relay_kill", "relay_kill", other]

    def _fault(self) -> None:
        kind = next_fault(self._deck, self._kinds(), self.rng, self.report.faults)
        at = dt.datetime.now(dt.UTC).strftime("%H:%M:%S.%f")[:-3]
        self.report.timeline.append(f"{at} {kind}")
        if kind == "relay_kill":
            i = self.rng.randrange(len(self.relays))
            self.report.timeline[-1] += f" ochaos-{i}"
            restart_relay(self.relays, i, self.rng, self._spawn_relay)
        elif kind == "broker_kill":
            assert isinstance(self.broker, _NatsBroker)
            self.broker.server.kill()
            time.sleep(self.rng.uniform(0.5, 2.5))
            self.broker.server.start()
        else:
            assert isinstance(self.broker, _KafkaBroker)
            self.broker.proxy.cut()
            time.sleep(self.rng.uniform(0.5, 2.5))
            self.broker.proxy.resume()

    def _heal(self) -> None:
        if isinstance(self.broker, _KafkaBroker):
            self.broker.proxy.resume()
        elif not self.broker.server.is_running():
            self.broker.server.start()
        respawn_exited(self.relays, self._spawn_relay)

    # -- the run -------------------------------------------------------------------

    def run(self) -> OrderedChaosReport:
        began = time.monotonic()
        try:
            self._start()
            writers = self._start_writers()
            writing = fault_while_writing(
                writers, self.rng, self._fault, (1.0, 3.0), self.report.writer_output
            )
            self.report.writing_seconds = round(writing, 1)
            self._heal()
            self._drain()
            self._stop_relays()
            self._count()
            self.report.total_seconds = round(time.monotonic() - began, 1)
            return self.report
        finally:
            kill_relays(self.relays)
            self.broker.close()

    def _drain(self, timeout: float = 180.0) -> None:
        def failure(row: tuple[int] | None) -> str:
            tails = {
                p.name: p.read_text(errors="replace")[-2000:]
                for p in self.workdir.glob("relay-*.log")
            }
            return (
                f"the outbox did not drain in {timeout:.0f}s: {row[0] if row else '?'}"
                f" pending\n{json.dumps(tails, indent=1)}"
            )

        self.report.drain_seconds = wait_drained(self.dsn, timeout, 0.3, failure)

    def _stop_relays(self) -> None:
        # A relay respawned by _heal must have installed its SIGTERM handler first.
        deadline = time.monotonic() + 60
        for i, start in enumerate(self._log_from):
            log = self.workdir / f"relay-{i}.log"
            while "claiming batches" not in log.read_bytes()[start:].decode(errors="replace"):
                if time.monotonic() > deadline:
                    raise AssertionError(f"relay {i} did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
        stop_relays(self.relays)

    def _count(self) -> None:
        r = self.report
        ledger = ordered_ledger(self.dsn)
        with cursor(self.dsn) as cur:
            r.dead_lettered = scalar(cur, "SELECT count(*) FROM outbox WHERE status = 2")
        committed: dict[str, list[str]] = defaultdict(list)
        key_of: dict[str, str] = {}
        for event_id, key in ledger:
            committed[key].append(event_id)
            key_of[event_id] = key
        rolled_back = read_rolled_back(self.workdir)
        consumed = self.broker.read()
        r.committed = len(key_of)
        r.rolled_back = len(rolled_back)
        r.consumed_messages = len(consumed)
        seen: set[str] = set()
        per_key: dict[str, list[str]] = defaultdict(list)
        for event_id, _key in consumed:
            if event_id in seen:
                continue
            seen.add(event_id)
            if event_id in key_of:
                per_key[key_of[event_id]].append(event_id)
        r.distinct_consumed = len(seen)
        r.past_watermark = getattr(self.broker, "past_watermark", 0)
        r.duplicates = len(consumed) - len(seen)
        lost = set(key_of) - seen
        if lost:  # read the broker once more: a reader that stopped early is not a loss
            again = {event_id for event_id, _key in self.broker.read()}
            lost -= again
        r.lost = len(lost)
        if lost:
            for row in lost_rows(self.dsn, sorted(lost)):
                names = ("event_id", "key", "n", "pos", "row", "status", "attempts")
                names += ("claimed_by", "published_at", "last_error")
                r.lost_rows.append({k: str(v) for k, v in zip(names, row, strict=True)})
        r.phantom = len(seen & rolled_back)
        r.unknown = len(seen - set(key_of) - rolled_back)
        for key, expected in committed.items():
            got = per_key.get(key, [])
            if got == expected:
                continue
            present = [e for e in got if e in set(expected)]
            place = {e: i for i, e in enumerate(expected)}
            ranks = [place[e] for e in present]
            inv = _inversions(ranks)
            if inv:
                r.keys_out_of_order += 1
                r.inversions += inv
                if len(r.examples) < 5:
                    at = next(i for i in range(len(ranks) - 1) if ranks[i] > ranks[i + 1])
                    r.examples.append(
                        f"{key}: committed #{ranks[at + 1]} ({present[at + 1]}) consumed right"
                        f" after #{ranks[at]} ({present[at]})"
                    )


def _inversions(ranks: list[int]) -> int:
    """Pairs i < j with ranks[i] > ranks[j] (merge sort count)."""
    if len(ranks) < 2:
        return 0
    mid = len(ranks) // 2
    left, right = ranks[:mid], ranks[mid:]
    count = _inversions(left) + _inversions(right)
    left.sort()
    right.sort()
    j = 0
    for x in left:
        while j < len(right) and right[j] < x:
            j += 1
        count += j
    return count
