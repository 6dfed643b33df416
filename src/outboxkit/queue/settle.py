"""How a claim's decisions become settle statements, written once for every SQL backend.

A store settles a batch in one statement per kind: the processed items (deleted or kept),
and the failures (retry, dead letter, hand-back) each with its own delay, error and refund.
:func:`group_decisions` splits the decisions into those lists (parallel, in claim order);
each backend then only binds them to its own statements. Pure: no I/O, unit-tested.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from outboxkit.queue.store import Claim, Decision, Verdict

#: A failure's stored error when its outcome gave none.
UNKNOWN_ERROR = "unknown error"


@dataclass(slots=True)
class SettleGroups:
    """A claim's decisions as a settle writes them: ``done`` ids, then the failures as
    parallel columns (``failed[i]`` is dead-lettered if ``dead[i]``, due after
    ``delays[i]`` seconds, its attempt refunded if ``refund[i]``)."""

    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    dead: list[bool] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    refund: list[bool] = field(default_factory=list)

    def failures(self) -> list[tuple[int, bool, float, str | None, bool]]:
        """The failures as rows (id, dead, delay, error, refund), for per-row statements."""
        return list(zip(self.failed, self.dead, self.delays, self.errors, self.refund, strict=True))


def group_decisions(
    claim: Claim[Any], decisions: Sequence[Decision], *, unknown: str | None = UNKNOWN_ERROR
) -> SettleGroups:
    """Split ``decisions`` (one per ``claim.ids``, in order) into what each statement settles.

    A failure with no error is stored as ``unknown`` (None: the statement keeps the item's
    last error, as task mode's hand-backs do).

    Raises ValueError when the counts differ (a settle must never pair an id with another's
    decision).
    """
    groups = SettleGroups()
    for item_id, decision in zip(claim.ids, decisions, strict=True):
        verdict = decision.verdict
        if verdict is Verdict.DONE:
            groups.done.append(item_id)
            continue
        groups.failed.append(item_id)
        groups.dead.append(verdict is Verdict.DEAD)
        groups.delays.append(decision.delay)
        groups.errors.append(decision.error or unknown)
        groups.refund.append(verdict is Verdict.HAND_BACK)
    return groups
