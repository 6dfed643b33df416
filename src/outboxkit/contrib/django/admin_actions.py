"""The admin's replay / discard / cancel plumbing, once: run the store function, log, tell."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest


def act_and_log(
    model_admin: admin.ModelAdmin[Any],
    request: HttpRequest,
    *,
    selected: int,
    eligible: Mapping[int, Any],
    act: Callable[[list[int]], list[int] | int],
    noun: str,
    past: str,
    states: str,
    done_noun: str | None = None,
    note: Callable[[Any], str] = lambda _obj: "",
) -> None:
    """Run ``act`` over the ``eligible`` rows' ids (of ``selected`` rows), log it, tell the user.

    ``act`` is the store's statement (fenced to the rows in the right state, as the CLI and
    the dashboard run it); it returns the ids it changed, or only their count, in which
    case every eligible row is logged. Each change is one LogEntry, "<past> through
    outboxkit" plus ``note(row)``; the success message counts ``done_noun`` (default ``noun``),
    the rows left alone are counted in a warning naming ``states``.
    """
    result = act(list(eligible)) if eligible else []
    if isinstance(result, int):
        done, changed = result, list(eligible.values())
    else:
        done, changed = len(result), [eligible[i] for i in result]
    for obj in changed:
        model_admin.log_change(request, obj, f"{past} through outboxkit{note(obj)}")
    model_admin.message_user(request, f"{done} {done_noun or noun} {past}.", messages.SUCCESS)
    skipped = selected - done
    if skipped:
        model_admin.message_user(
            request,
            f"{skipped} selected {noun} left alone: only {states} can be {past}.",
            messages.WARNING,
        )
