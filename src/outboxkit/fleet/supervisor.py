"""The fleet: one service (a Relay, or a task Worker) per database of the DSN file, each
supervised on its own.

A database is tried (one connection, at once hung up) before its relay starts; one that
cannot be reached or refuses the login is reported in one log line naming its line and
name, and tried again with backoff, never holding back the others. The file is read again
on :meth:`Fleet.reload` (SIGHUP) and every ``reload_interval`` seconds: a database added
starts, one removed stops (its relay's graceful stop: in-flight batches finish or are
handed back), one whose DSN changed is restarted; the others are left alone.

Several processes given the same file divide its databases (fleet/leases.py): with
``lease`` set, a database whose backend keeps a fleet lease is served here only while this
process owns its lease; the others are only checked, once a round (a third of a lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.backends import backend_for
from outboxkit.errors import OutboxkitError
from outboxkit.fleet.dsn_file import BadLine, Database, DsnFile, read_dsn_file
from outboxkit.fleet.leases import DatabaseLease, Sighting, member_id, rank, target
from outboxkit.queue.episode import FailureEpisode
from outboxkit.queue.idle import claim_idle

log = logging.getLogger("outboxkit.fleet")

#: The name of the database whose service is running (set in each member's task, so every
#: line its relay logs can say which database it is about: :class:`DatabaseTag`).
current_database: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "outboxkit_database", default=None
)
#: The application_name of the connection that tries a database before its relay starts.
PROBE_APPLICATION_NAME = "outboxkit-fleet:probe"
#: How long a fleet process's lease on a database lasts without a check (seconds).
DEFAULT_LEASE = 15.0
#: Lease checks under way at once (each a short connection of its own).
_CHECKS_AT_ONCE = 16
#: Free databases taken at most per round: a process that joins (or takes over a dead
#: one's share) starts their services a few at a time, its lease checks kept on time.
_TAKEN_PER_ROUND = 16
#: A service that ran this long before it failed starts its retries from the shortest delay.
_HEALTHY_RUN = 30.0
#: Seconds a database's claim connection stays open while its claims find nothing
#: (``OUTBOXKIT_CLAIM_IDLE``; 0: for good): then a PostgreSQL database waits on its LISTEN
#: session alone (docs/fleet.md, "Connections").
CLAIM_IDLE = float(os.environ.get("OUTBOXKIT_CLAIM_IDLE", "30"))

State = Literal["starting", "running", "down", "stopped"]


@dataclass(frozen=True, slots=True)
class Words:
    """How the log names the service and its work: a relay relays, a worker serves."""

    service: str = "relay"
    done: str = "relayed"


#: The words of ``outboxkit relay --dsn-file`` (the default) and ``outboxkit worker --dsn-file``.
RELAY_WORDS = Words()
WORKER_WORDS = Words("worker", "served")


class Service(Protocol):
    """What the fleet runs for one database: a Relay (or a Relay with its metrics)."""

    def stop(self) -> None: ...

    async def run(self) -> None:
        """Serve until :meth:`stop`; raise for a fault (the fleet retries it with backoff)."""
        ...


Factory = Callable[[Database], Service]


class DatabaseTag(logging.Filter):
    """Adds ``database`` (the file's name) to every record logged inside a member's task."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = current_database.get()
        if name is not None and not hasattr(record, "database"):
            record.database = name
        return True


class Member:
    """One database of the fleet: tries it, runs its service, retries either with backoff."""

    def __init__(
        self,
        database: Database,
        service: Service,
        *,
        retry_base: float,
        retry_cap: float,
        words: Words = RELAY_WORDS,
    ) -> None:
        self.database = database
        self.service = service
        self.words = words
        self.state: State = "starting"
        #: Why the database is down (one line, redacted), or None.
        self.problem: str | None = None
        self._stopping = asyncio.Event()
        self._backoff = Backoff(base=retry_base, cap=retry_cap)

    def __repr__(self) -> str:
        return f"Member({self.database.name!r}, state={self.state!r})"

    def stop(self) -> None:
        """Stop the service gracefully (a relay finishes or hands back its batches)."""
        self._stopping.set()
        self.service.stop()

    async def run(self) -> None:
        where = self.database
        backend = backend_for(where.dsn)
        unreachable = False  # the last try to connect failed
        while not self._stopping.is_set():
            try:
                if not await self._until_stopped(
                    backend.reach(where.dsn, application_name=PROBE_APPLICATION_NAME)
                ):
                    break
            except Exception as exc:  # whatever the driver raises: the database is down
                unreachable = True
                self._down(first_line(exc, with_type=True))
                await self._pause()
                continue
            if unreachable:
                unreachable = False
                self.problem = None
                log.info(
                    "database %s (line %d) is reachable again: starting its %s",
                    where.name,
                    where.line,
                    self.words.service,
                )
            self.state = "running"
            started = time.monotonic()
            failure: str | None = None
            try:
                await self.service.run()
            except OutboxkitError as exc:
                failure = first_line(exc)
            except Exception as exc:  # a bug of one database's service must not end the others
                failure = first_line(exc, with_type=True)
                if failure != self.problem:
                    log.error(
                        "database %s (line %d): its %s failed: %s",
                        where.name,
                        where.line,
                        self.words.service,
                        failure,
                        exc_info=True,
                    )
            if time.monotonic() - started >= _HEALTHY_RUN:
                self._backoff.reset()  # a failure after a good run is news: said again
                self.problem = None
            if failure is not None:
                self._down(failure)
            if not self._stopping.is_set():
                await self._pause()
        self.state = "stopped"

    def _down(self, reason: str) -> None:
        """Mark the database down; one log line per new cause, none per retry."""
        self.state = "down"
        if reason != self.problem:
            log.warning(
                "database %s (line %d) is not %s: %s; retrying with backoff",
                self.database.name,
                self.database.line,
                self.words.done,
                reason,
            )
        self.problem = reason

    async def _until_stopped(self, work: Coroutine[Any, Any, None]) -> bool:
        """Await ``work`` unless :meth:`stop` comes first (then cancel it: a connect to a
        host that does not answer must not hold back a SIGTERM); whether it finished."""
        done = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not done.done():
                done.cancel()
                with contextlib.suppress(BaseException):
                    await done
        if done.cancelled():
            return False
        await done  # (its error, if any)
        return not self._stopping.is_set()

    async def _pause(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=self._backoff.next_delay())


class Fleet:
    """Runs ``factory(database)`` for every database of the DSN file at ``path``.

    ``words``: how the log names the service (a relay by default; :data:`WORKER_WORDS`).
    ``on_removed(member)``: called once a member's service has stopped for good (a database
    removed or changed, or the fleet stopping), e.g. to drop its metrics.
    ``lease``: the fleet lease (seconds) by which processes given the same file divide its
    databases; None serves every database here. ``service``: what is leased (one relay's
    outbox table, one worker's task table: ``relay:outbox``), ``member``: this process's
    name in the lease tables. ``claim_idle``: seconds after which a database whose claims
    find nothing closes its claim connection (0 or None: never; :data:`CLAIM_IDLE`).
    """

    def __init__(
        self,
        path: str | Path,
        factory: Factory,
        *,
        reload_interval: float = 30.0,
        retry_base: float = 1.0,
        retry_cap: float = 30.0,
        on_removed: Callable[[Member], None] | None = None,
        words: Words = RELAY_WORDS,
        lease: float | None = DEFAULT_LEASE,
        service: str = "relay:outbox",
        member: str | None = None,
        claim_idle: float | None = CLAIM_IDLE,
    ) -> None:
        self.path = Path(path)
        self.claim_idle = claim_idle or None
        self.words = words
        self.factory = factory
        self.reload_interval = reload_interval
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.on_removed = on_removed
        #: The databases served now, by name.
        self.members: dict[str, Member] = {}
        self._tasks: dict[Member, asyncio.Task[None]] = {}
        self._reload = asyncio.Event()
        self._stopping = False
        self._reported: set[tuple[int, str]] = set()
        self._read_error: str | None = None
        self.lease = lease
        self.service = service
        #: This process in the lease tables (host:pid:nonce).
        self.member_id = member or member_id()
        #: The databases of the file, by name; those served here are :attr:`members`.
        self.listed: dict[str, Database] = {}
        #: The databases whose lease this process holds.
        self.owned: set[str] = set()
        #: The processes seen through the leases at the last round (this one included).
        self.seen: frozenset[str] = frozenset({self.member_id})
        #: Databases whose lease could not be checked, and why (one line, redacted).
        self.unreachable: dict[str, str] = {}
        self._handing_back: set[str] = set()
        self._leases: dict[str, tuple[str, DatabaseLease]] = {}
        self._round = asyncio.Event()
        self._leaving: set[asyncio.Task[None]] = set()
        self._checking = asyncio.Semaphore(_CHECKS_AT_ONCE)
        self._generation = 0  # (the file read again: a round under way decides nothing)
        self._answered: set[str] = set()  # databases whose last lease check answered
        self._refused: dict[str, str] = {}  # name -> the DSN its factory refused
        self._round_failures = FailureEpisode("the fleet's lease round", logger=log)

    def reload(self) -> None:
        """Read the file again now (SIGHUP)."""
        self._reload.set()

    def stop(self) -> None:
        """Stop every database's service gracefully, then return from :meth:`run`."""
        self._stopping = True
        self._reload.set()

    async def run(self) -> None:
        """Serve the file's databases until :meth:`stop`. ConfigurationError if the file
        cannot be read at start; later a file that cannot be read keeps what runs."""
        self.apply(read_dsn_file(self.path))
        sharing = asyncio.create_task(self._share()) if self.lease is not None else None
        try:
            while not self._stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._reload.wait(), timeout=self.reload_interval)
                self._reload.clear()
                if self._stopping:
                    break
                try:
                    listed = read_dsn_file(self.path)
                except OutboxkitError as exc:
                    if str(exc) != self._read_error:
                        log.warning("%s; the databases %s now go on", exc, self.words.done)
                    self._read_error = str(exc)
                    continue
                self._read_error = None
                self.apply(listed)
        finally:
            if sharing is not None:
                sharing.cancel()
                await asyncio.gather(sharing, return_exceptions=True)
            for member in list(self.members.values()):
                self._retire(member)
            if self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            # (the others take this process's databases at their next round, not a lease later)
            leaving = [
                self._leave(lease)
                for name, (_dsn, lease) in self._leases.items()
                if name in self._answered
            ]
            await asyncio.gather(*leaving, *self._leaving, return_exceptions=True)

    def apply(self, listed: DsnFile) -> None:
        """Start, stop and restart members so that they serve the databases ``listed``."""
        self._report(listed.bad_lines)
        wanted = {database.name: database for database in listed.databases}
        # A line being edited (a name whose DSN does not parse yet) does not stop its database.
        kept = {bad.name for bad in listed.bad_lines if bad.name is not None}
        for name, member in list(self.members.items()):
            database = wanted.get(name)
            if database is None:
                if name not in kept:
                    log.info("database %s left the file: stopping its %s", name, self.words.service)
                    self._retire(member)
            elif database.dsn != member.database.dsn:
                log.info(
                    "database %s (line %d) changed: restarting its %s",
                    name,
                    database.line,
                    self.words.service,
                )
                self._retire(member)
            else:
                member.database = database  # (its line may have moved)
        self.listed = wanted | {n: self.listed[n] for n in kept if n in self.listed}
        self._generation += 1
        self._drop_stale_leases()
        for name, database in wanted.items():
            if name not in self.members and not self._shared(database):
                self._start(database)
        self._round.set()
        if not listed.databases and not self.members:
            log.warning("the DSN file %s lists no database", self.path)

    def _drop_stale_leases(self) -> None:
        """Hand back at once the lease of each database that left the file or changed DSN."""
        for name, (dsn, lease) in list(self._leases.items()):
            database = self.listed.get(name)
            if database is None or database.dsn != dsn:
                del self._leases[name]
                self.owned.discard(name)
                self._handing_back.discard(name)
                self.unreachable.pop(name, None)
                task = asyncio.ensure_future(self._leave(lease))
                self._leaving.add(task)
                task.add_done_callback(self._leaving.discard)

    def _shared(self, database: Database) -> bool:
        """Whether ``database`` is divided among the fleet's processes by its lease."""
        return self.lease is not None and backend_for(database.dsn).can("fleet_leases")

    async def _leave(self, lease: DatabaseLease) -> None:
        with contextlib.suppress(Exception):  # (a database down: the lease runs out instead)
            await asyncio.wait_for(lease.leave(), timeout=3.0)

    async def _share(self) -> None:
        """A lease round every third of a lease, and at once after the file was read."""
        assert self.lease is not None
        while True:
            try:
                await self._share_round()
            except Exception as exc:  # a bug here must not end the fleet: the next round retries
                # One line with the traceback, then a reminder now and then: not one a round.
                self._round_failures.failed(
                    "the fleet's lease round failed: %s; retrying every %.1fs",
                    first_line(exc, with_type=True),
                    self.lease / 3,
                    exc_info=exc,
                )
            else:
                self._round_failures.succeeded()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._round.wait(), timeout=self.lease / 3)
            self._round.clear()

    async def _check(self, database: Database, want: bool) -> Sighting | None:
        """One lease check; None when the database cannot be reached (said once a cause)."""
        assert self.lease is not None
        held = self._leases.get(database.name)
        if held is None or held[0] != database.dsn:
            lease = backend_for(database.dsn).fleet_lease(
                database.dsn, self.service, self.member_id, self.lease
            )
            held = self._leases[database.name] = (database.dsn, lease)
        try:
            async with self._checking:  # (a few connects at a time, not one per database)
                seen = await asyncio.wait_for(held[1].check(want), timeout=self.lease / 3)
        except Exception as exc:  # whatever the driver raises: the database is down
            self._answered.discard(database.name)
            reason = first_line(exc, with_type=True) if str(exc) else "no answer in time"
            if self.unreachable.get(database.name) != reason:
                log.warning(
                    "database %s (line %d) is not %s: %s; retrying",
                    database.name,
                    database.line,
                    self.words.done,
                    reason,
                )
            self.unreachable[database.name] = reason
            return None
        self._answered.add(database.name)
        if self.unreachable.pop(database.name, None) is not None:
            log.info("database %s (line %d) is reachable again", database.name, database.line)
        return seen

    async def _share_round(self) -> None:
        """Check every shared database's lease; hand back what is above this process's
        share, take free ones up to it, and run the service of each database owned."""
        me = self.member_id
        # (a check of the last round may have taken a database the file dropped meanwhile)
        self._drop_stale_leases()
        if self._leaving:  # (a lease handed back must not undo this round's take)
            await asyncio.gather(*self._leaving, return_exceptions=True)
        shared = {
            n: d
            for n, d in self.listed.items()
            if self._shared(d) and self._refused.get(n) != d.dsn
        }
        self.owned &= set(shared)  # (a database that left the file was handed back)
        stopping = {member.database.name for member in self._tasks}
        # keep what is owned; one being handed back, until its service has stopped
        wants = {
            n: n in self.owned and (n not in self._handing_back or n in stopping) for n in shared
        }
        names = list(shared)
        checks = [self._check(shared[n], wants[n]) for n in names]
        generation = self._generation
        sightings = dict(zip(names, await asyncio.gather(*checks), strict=True))
        if generation != self._generation:
            return  # (the next round, already asked for, decides on the file as it is now)
        released: set[str] = set()
        for name, seen in sightings.items():
            if seen is None:
                continue
            if seen.owner == me:
                self.owned.add(name)
                continue
            if name in self.owned and name not in self._handing_back:
                log.warning(
                    "database %s: this process lost its lease (a check came too late); owner"
                    " now: %s",
                    name,
                    seen.owner or "none",
                )
            if name in self.owned:
                released.add(name)
            self.owned.discard(name)
            self._handing_back.discard(name)
            if (member := self.members.get(name)) is not None:
                self._retire(member)
        self.seen = frozenset({me}).union(*(s.members for s in sightings.values() if s))
        # (a database that did not answer still counts: a slow check hands nothing over)
        aim = target(len(sightings), self.seen)
        kept = sorted(self.owned - self._handing_back, key=lambda n: rank(me, n))
        if len(kept) > aim:
            for name in kept[aim:]:
                log.info(
                    "database %s: handing it over (%d processes share %d databases)",
                    name,
                    len(self.seen),
                    len(sightings),
                )
                self._handing_back.add(name)
                if (member := self.members.get(name)) is not None:
                    self._retire(member)
        elif len(kept) < aim:
            free = sorted(
                (
                    n
                    for n, s in sightings.items()
                    if s is not None and s.owner is None and n not in released
                ),
                key=lambda n: rank(me, n),
            )[: min(aim - len(kept), _TAKEN_PER_ROUND)]
            taken = await asyncio.gather(*(self._check(shared[n], True) for n in free))
            self.owned.update(n for n, s in zip(free, taken, strict=True) if s and s.owner == me)
            if generation != self._generation:
                return
        stopping = {member.database.name for member in self._tasks}
        for name in sorted(self.owned - self._handing_back):
            if name not in self.members and name not in stopping and name in shared:
                self._start(shared[name])

    def _report(self, bad_lines: tuple[BadLine, ...]) -> None:
        """Log each bad line once (not at every reload while it stays as it is)."""
        seen = {(bad.line, bad.reason) for bad in bad_lines}
        for bad in bad_lines:
            if (bad.line, bad.reason) not in self._reported:
                log.warning("DSN file %s, %s; the line is skipped", self.path, bad)
        self._reported = seen

    def _start(self, database: Database) -> None:
        try:
            service = self.factory(database)
        except OutboxkitError as exc:
            self._refused[database.name] = database.dsn  # (not taken again, nor said again)
            log.warning(
                "database %s (line %d) is not %s: %s",
                database.name,
                database.line,
                self.words.done,
                exc,
            )
            return
        member = Member(
            database,
            service,
            retry_base=self.retry_base,
            retry_cap=self.retry_cap,
            words=self.words,
        )
        self.members[database.name] = member
        context = contextvars.copy_context()
        context.run(current_database.set, database.name)
        context.run(claim_idle.set, self.claim_idle)
        task = asyncio.create_task(
            member.run(), name=f"outboxkit-fleet:{database.name}", context=context
        )
        self._tasks[member] = task
        task.add_done_callback(lambda _task: self._finished(member))
        log.info(
            "database %s (line %d): starting its %s",
            database.name,
            database.line,
            self.words.service,
        )

    def _retire(self, member: Member) -> None:
        if self.members.get(member.database.name) is member:
            del self.members[member.database.name]
        member.stop()

    def _finished(self, member: Member) -> None:
        task = self._tasks.pop(member, None)
        if task is not None and not task.cancelled() and (exc := task.exception()) is not None:
            log.error("database %s: its supervisor failed: %r", member.database.name, exc)
        if self.members.get(member.database.name) is member:
            del self.members[member.database.name]
        if self.lease is not None:
            self._round.set()  # (hand its lease over, or start its successor, now)
        if self.on_removed is not None:
            self.on_removed(member)
