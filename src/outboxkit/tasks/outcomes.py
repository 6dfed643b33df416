"""What a handler may ask for instead of returning (``Retry``, ``Fail``, ``Snooze``), and the
outcome the handler sink reports per task to the queue core's ``decide()``."""

from __future__ import annotations

from dataclasses import dataclass


class _Request(Exception):
    """What a handler raises to ask the worker for something: control flow, not an error."""


class Retry(_Request):
    """Run the task again after ``delay`` seconds; the attempt counts (the last one fails it)."""

    def __init__(self, delay: float, reason: str = "retry requested by the handler") -> None:
        super().__init__(reason)
        self.delay = delay
        self.reason = reason


class Fail(_Request):
    """Fail the task now, whatever attempts remain (a payload that can never succeed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Snooze(_Request):
    """Not now: run the task again after ``delay`` seconds, without spending an attempt."""

    def __init__(self, delay: float) -> None:
        super().__init__(f"snoozed for {delay}s")
        self.delay = delay


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """One handler run as the core's ``Outcome``: ok, or a failure retried on the schedule
    (``retryable``) or dead-lettered at once (``Fail``, an unknown task name)."""

    ok: bool
    error: str | None = None
    retryable: bool = True
    retry_after: float | None = None
    counts_attempt: bool = True


SUCCESS = TaskOutcome(True)
