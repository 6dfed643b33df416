"""Periodic tasks: cron expressions and the slots they fire at (pure: no I/O, no clock).

A schedule fires at *slots*: the times its cron expression matches. The worker's periodic
side task (tasks/periodic.py) inserts each due slot into the schedules table with its task,
``ON CONFLICT DO NOTHING``: one run per slot across any number of workers.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

#: What a worker does with the slots it finds missed (it was down, or no worker ran):
#: run the last one once, every one (up to MAX_CATCH_UP), or none.
CatchUp = Literal["last", "all", "none"]
#: The most missed slots ``catch_up="all"`` runs at once.
MAX_CATCH_UP = 1000

_BOUNDS = {  # field: (low, high)
    "second": (0, 59),
    "minute": (0, 59),
    "hour": (0, 23),
    "day": (1, 31),
    "month": (1, 12),
    "weekday": (0, 6),  # 0 = Sunday (7 is taken as Sunday too)
}


def _field(text: str, name: str) -> frozenset[int]:
    low, high = _BOUNDS[name]
    values: set[int] = set()
    for part in text.split(","):
        base, _, step_text = part.partition("/")
        step = int(step_text) if step_text else 1
        if step < 1:
            raise ValueError(f"cron {name}: step must be >= 1 in {part!r}")
        if base == "*":
            start, end = low, high
        elif "-" in base:
            a, b = base.split("-", 1)
            start, end = int(a), int(b)
        else:
            start = int(base)
            end = high if step_text else start
        if name == "weekday":
            start, end = (0 if start == 7 else start), (6 if end == 7 else end)
        if not low <= start <= end <= high:
            raise ValueError(f"cron {name}: {part!r} is outside {low}-{high}")
        values.update(range(start, end + 1, step))
    return frozenset(values)


@dataclass(frozen=True)
class Cron:
    """A cron expression: ``minute hour day month weekday``, or with a leading ``second``
    field (six fields). ``*``, ``a-b``, ``*/n``, ``a-b/n`` and lists; times are UTC."""

    expression: str
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    day_any: bool
    weekday_any: bool

    @classmethod
    def parse(cls, expression: str) -> Cron:
        fields = expression.split()
        if len(fields) == 5:
            fields = ["0", *fields]
        if len(fields) != 6:
            raise ValueError(
                f"cron expression {expression!r}: give 5 fields (minute hour day month weekday)"
                " or 6 (a leading second)"
            )
        names = ("second", "minute", "hour", "day", "month", "weekday")
        try:
            s, mi, h, d, mo, w = (_field(f, n) for f, n in zip(fields, names, strict=True))
        except ValueError as exc:
            raise ValueError(f"cron expression {expression!r}: {exc}") from None
        return cls(expression, s, mi, h, d, mo, w, fields[3] == "*", fields[5] == "*")

    @property
    def step(self) -> dt.timedelta:
        """The resolution slots are searched at: a second with a seconds field, else a minute."""
        return dt.timedelta(seconds=1) if self.seconds != {0} else dt.timedelta(minutes=1)

    def matches(self, at: dt.datetime) -> bool:
        if not (
            at.second in self.seconds
            and at.minute in self.minutes
            and at.hour in self.hours
            and at.month in self.months
        ):
            return False
        day = at.day in self.days
        weekday = (at.isoweekday() % 7) in self.weekdays
        if self.day_any or self.weekday_any:  # cron's rule: both restricted = either matches
            return day and weekday
        return day or weekday

    def slots(self, after: dt.datetime, until: dt.datetime) -> Iterator[dt.datetime]:
        """The slots in ``(after, until]``, oldest first (UTC, whole seconds)."""
        step = self.step
        at = _floor(after.astimezone(dt.UTC), step) + step
        while at <= until:
            if self.matches(at):
                yield at
            at += step

    def last_slot(self, until: dt.datetime, within: dt.timedelta) -> dt.datetime | None:
        """The latest slot in ``(until - within, until]``, or None."""
        step = self.step
        at = _floor(until.astimezone(dt.UTC), step)
        stop = until - within
        while at > stop:
            if self.matches(at):
                return at
            at -= step
        return None


def _floor(at: dt.datetime, step: dt.timedelta) -> dt.datetime:
    at = at.replace(microsecond=0)
    if step >= dt.timedelta(minutes=1):
        at = at.replace(second=0)
    return at


@dataclass(frozen=True)
class Periodic:
    """One registered schedule: run ``task_name`` with ``payload`` at every slot of ``cron``."""

    schedule: str
    cron: Cron
    task_name: str
    payload: Any
    catch_up: CatchUp
    queue: str
    priority: int
