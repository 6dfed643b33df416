"""Time partitions of an outbox: which to create ahead, which have expired, what they are named.

A partitioned outbox (``outboxkit migrate --partition-by day|hour``) keeps published rows
(``retention="keep"``) and gets rid of them a whole partition at a time. This module decides;
backends/postgres/partitions.py reads the partitions and runs the DDL (one run at a time per table):

- create the partitions of the current period and of ``ahead`` periods after it, and of any
  period whose rows ended up in the default partition (the store moves them in);
- drop a partition whose whole range is older than the retention window (``keep``), unless it
  still holds a pending or a failed row. A partition kept for a dead letter is reported;
  replay or discard the event and the next run drops it.

Periods and partition names are in UTC: ``<table>_pYYYYMMDD`` (day), ``<table>_pYYYYMMDDHH``
(hour); ``<table>_default`` catches a row no partition covers.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast

from outboxkit.errors import ConfigurationError

#: "minute" compresses days into minutes for tests and benchmarks (the CLI offers day|hour).
PartitionBy = Literal["day", "hour", "minute"]
PERIODS: dict[str, dt.timedelta] = {
    "day": dt.timedelta(days=1),
    "hour": dt.timedelta(hours=1),
    "minute": dt.timedelta(minutes=1),
}
_NAME_FORMATS = {"day": "_p%Y%m%d", "hour": "_p%Y%m%d%H", "minute": "_p%Y%m%d%H%M"}
#: How long published rows stay (a partition is dropped once its whole range is older).
DEFAULT_KEEP = dt.timedelta(days=7)
#: Periods created ahead of the current one: a stopped maintenance has this long to come back.
DEFAULT_AHEAD = 3
#: How long a create or a drop waits for its lock before it is deferred to the next run.
DEFAULT_LOCK_TIMEOUT = dt.timedelta(seconds=2)
_MARK = "outboxkit partitions "

log = logging.getLogger("outboxkit.relay.time_partitions")


def check_partition_by(value: str) -> PartitionBy:
    if value not in PERIODS:
        raise ConfigurationError(f"partition_by must be 'day' or 'hour', not {value!r}")
    return cast(PartitionBy, value)


@dataclass(frozen=True, slots=True)
class PartitionSettings:
    """How a partitioned outbox is maintained; stored in the outbox table's comment."""

    by: PartitionBy
    keep: dt.timedelta = DEFAULT_KEEP
    ahead: int = DEFAULT_AHEAD

    def __post_init__(self) -> None:
        check_partition_by(self.by)
        if self.keep < dt.timedelta(0):
            raise ConfigurationError("the retention window (keep) cannot be negative")
        if self.ahead < 1:
            raise ConfigurationError("partitions ahead must be at least 1")

    @property
    def period(self) -> dt.timedelta:
        return PERIODS[self.by]

    def comment(self) -> str:
        doc = {"by": self.by, "keep_s": self.keep.total_seconds(), "ahead": self.ahead}
        return _MARK + json.dumps(doc)

    @classmethod
    def from_comment(cls, text: str | None) -> PartitionSettings | None:
        if not text or not text.startswith(_MARK):
            return None
        try:
            doc = json.loads(text[len(_MARK) :])
            return cls(
                check_partition_by(doc["by"]),
                dt.timedelta(seconds=float(doc.get("keep_s", DEFAULT_KEEP.total_seconds()))),
                int(doc.get("ahead", DEFAULT_AHEAD)),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(slots=True)
class KeptPartition:
    """An expired partition that was not dropped, and why."""

    name: str
    pending: int
    failed: int

    @property
    def reason(self) -> str:
        parts = []
        if self.failed:
            parts.append(f"{self.failed} dead letter(s): replay or discard them")
        if self.pending:
            parts.append(f"{self.pending} pending event(s): the relay has not published them")
        return "; ".join(parts)


@dataclass(slots=True)
class MaintenanceReport:
    """What one maintenance run did."""

    table: str
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    kept: list[KeptPartition] = field(default_factory=list)
    moved_rows: int = 0
    stray_rows: int = 0  # rows still in the default partition after the run
    deferred: list[str] = field(default_factory=list)  # lock not obtained: retried next run
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept"] = [dict(asdict(k), reason=k.reason) for k in self.kept]
        return d

    def log(self) -> None:
        """Tell an operator what the run changed and what needs them."""
        if self.skipped:
            log.debug("partition maintenance of %s skipped: %s", self.table, self.skipped)
            return
        if self.created or self.dropped:
            log.info(
                "partitions of %s: created %s; dropped %s",
                self.table,
                ", ".join(self.created) or "none",
                ", ".join(self.dropped) or "none",
            )
        if self.moved_rows:
            log.warning(
                "moved %d row(s) of %s from its default partition into their own partitions",
                self.moved_rows,
                self.table,
            )
        for kept in self.kept:
            log.warning("expired partition %s kept: %s", kept.name, kept.reason)
        if self.stray_rows:
            log.warning(
                "%d row(s) of %s are in its default partition: no partition covers their"
                " created_at",
                self.stray_rows,
                self.table,
            )
        if self.deferred:
            log.info("partition changes deferred (lock busy): %s", ", ".join(self.deferred))


# -- periods and names -------------------------------------------------------------------


def period_start(at: dt.datetime, by: PartitionBy) -> dt.datetime:
    """The start (UTC) of the period ``at`` falls in."""
    at = at.astimezone(dt.UTC)
    if by == "day":
        return at.replace(hour=0, minute=0, second=0, microsecond=0)
    if by == "hour":
        return at.replace(minute=0, second=0, microsecond=0)
    return at.replace(second=0, microsecond=0)


def partition_name(table_name: str, start: dt.datetime, by: PartitionBy) -> str:
    suffix = start.astimezone(dt.UTC).strftime(_NAME_FORMATS[by])
    return table_name[: 63 - len(suffix)] + suffix


def default_partition_name(table_name: str) -> str:
    return table_name[: 63 - len("_default")] + "_default"


# -- decisions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Period:
    """A partition to create: its range, its name, and whether rows of the default partition
    fall in it (the store moves them in as it creates it)."""

    start: dt.datetime
    end: dt.datetime
    name: str
    holds_strays: bool


def periods_to_create(
    table_name: str,
    settings: PartitionSettings,
    now: dt.datetime,
    existing: Iterable[tuple[dt.datetime, dt.datetime]],
    stray_times: Iterable[dt.datetime] = (),
) -> list[Period]:
    """The current period, ``ahead`` after it and those of stray rows, minus what exists.

    A period overlapped by an existing partition (one someone made by hand, say) is left out.
    """
    by, period = settings.by, settings.period
    first = period_start(now, by)
    wanted = {first + i * period for i in range(settings.ahead + 1)}
    strays = {period_start(at, by) for at in stray_times}
    ranges = list(existing)
    return [
        Period(start, start + period, partition_name(table_name, start, by), start in strays)
        for start in sorted(wanted | strays)
        if not any(lo < start + period and start < hi for lo, hi in ranges)
    ]


def drop_horizon(
    now: dt.datetime, keep: dt.timedelta, confirmed_through: dt.datetime | None = None
) -> dt.datetime:
    """A partition whose range ends at or before this may be dropped.

    ``confirmed_through`` is for a relay that never updates a row (the WAL relay's table
    source): everything committed up to it reached the broker, nothing after it.
    """
    horizon = now - keep
    return horizon if confirmed_through is None else min(horizon, confirmed_through)


def has_expired(bounds: tuple[dt.datetime, dt.datetime] | None, horizon: dt.datetime) -> bool:
    """Whether a partition's whole range is older than the horizon (never the default one)."""
    return bounds is not None and bounds[1] <= horizon


def blocks_drop(pending: bool, failed: bool, *, confirmed_through: dt.datetime | None) -> bool:
    """Whether an expired partition's unsettled rows keep it.

    A dead letter always does; a pending row does, except for a relay that never updates
    rows (``confirmed_through``): its published rows stay pending, and the horizon already
    stops at what the broker confirmed.
    """
    return failed or (pending and confirmed_through is None)
