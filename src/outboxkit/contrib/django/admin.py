"""The admin's view of the outbox: every event read-only, replay and discard for dead letters;
and of task mode's table: every task read-only, replay, discard and cancel.

Replay and discard go through ``outboxkit.backends.postgres.admin`` (the statements ``outboxkit
replay`` and the dashboard run, fenced to failed rows) on a connection of their own, and each is
recorded in Django's LogEntry. Payloads, headers and errors are shown escaped, secrets in headers
and errors masked."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property
from django.utils.html import format_html

from outboxkit._redact import MASK, mask_headers, redact
from outboxkit.backends import backend_for
from outboxkit.backends.ports import TaskAdmin as TaskOps
from outboxkit.backends.postgres.admin import EventRef
from outboxkit.backends.postgres.postgres import Status
from outboxkit.contrib.django import conf
from outboxkit.contrib.django.admin_actions import act_and_log
from outboxkit.contrib.django.db import dsn_for
from outboxkit.contrib.django.models import OutboxEvent, Task
from outboxkit.queue.tasks import TaskStatus

#: What the detail page shows of a payload (the rest is cut, and said to be).
MAX_PAYLOAD_CHARS = 64 * 1024
_ERROR_CHARS = 80


class CappedPaginator(Paginator):
    """Counts at most ``COUNT_CAP`` rows: a COUNT(*) of a busy outbox on every page is a scan."""

    COUNT_CAP = 10_000

    @cached_property
    def count(self) -> int:
        return int(self.object_list.values("pk")[: self.COUNT_CAP].count())


class _FailedValuesFilter(admin.SimpleListFilter):
    """A column's values among the dead letters (the failed rows' partial index; failed
    tasks' on the task table), not the whole table's: a DISTINCT over millions of pending
    or kept rows per page is a scan."""

    field: str
    failed: int = int(Status.FAILED)  # the status of a dead letter in this filter's table

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = (
            model_admin.get_queryset(request)
            .filter(status=self.failed)
            .values_list(self.field, flat=True)
            .distinct()
            .order_by(self.field)[:50]
        )
        return [(v, v) for v in values]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value():
            return queryset.filter(**{self.field: self.value()})
        return queryset


class TopicFilter(_FailedValuesFilter):
    title = "topic (failed events)"
    parameter_name = field = "topic"


class EventTypeFilter(_FailedValuesFilter):
    title = "event type (failed events)"
    parameter_name = field = "event_type"


class ErrorFilter(admin.SimpleListFilter):
    """The dead letters' errors, by the start of the message (the most frequent first)."""

    title = "error"
    parameter_name = "error"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from django.db.models import Count
        from django.db.models.functions import Left

        rows = (
            model_admin.get_queryset(request)
            .filter(status=int(Status.FAILED), last_error__isnull=False)
            .annotate(head=Left("last_error", _ERROR_CHARS))
            .values("head")
            .annotate(n=Count("id"))
            .order_by("-n")[:20]
        )
        # Masked in the value too: it lands in URLs, browser histories and access logs.
        return [(redact(r["head"]), f"{redact(r['head'])} ({r['n']})") for r in rows]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value():
            # up to the first masked secret: the rest of the key is not known here
            prefix = self.value().split(MASK)[0]
            return queryset.filter(status=int(Status.FAILED), last_error__startswith=prefix)
        return queryset


class _ReadOnlyAdmin(admin.ModelAdmin):
    """A table the application writes and a relay or worker settles: never added to, edited
    or deleted from here (its actions go through the store's fenced statements), paged
    without a COUNT(*) over the whole table, errors shown masked."""

    paginator = CappedPaginator
    list_per_page = 50
    show_full_result_count = False  # a COUNT(*) over a big table on every page: no

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="error")
    def error(self, obj: OutboxEvent | Task) -> str:
        return redact(obj.last_error or "")


@admin.register(OutboxEvent)
class OutboxEventAdmin(_ReadOnlyAdmin):
    list_display = ("id", "topic", "event_type", "status", "attempts", "error", "created_at")
    list_filter = ("status", TopicFilter, EventTypeFilter, ErrorFilter)
    search_fields = ("=event_id", "=aggregate_id", "key")
    actions = ["replay", "discard"]
    fields = (
        "id",
        "event_id",
        "topic",
        "key",
        "event_type",
        "aggregate_type",
        "aggregate_id",
        "status",
        "attempts",
        "available_at",
        "claimed_by",
        "error",
        "created_at",
        "occurred_at",
        "published_at",
        "schema_version",
        "headers_shown",
        "payload_shown",
    )
    readonly_fields = fields

    def has_manage_permission(self, request: HttpRequest) -> bool:
        """Replay and discard: for whoever may change outbox events (the model's permission)."""
        return bool(request.user.has_perm("outboxkit.change_outboxevent"))

    @admin.display(description="headers")
    def headers_shown(self, obj: OutboxEvent) -> str:
        headers = obj.headers or {}
        shown = mask_headers(headers) if isinstance(headers, dict) else headers
        text = json.dumps(shown, indent=2, ensure_ascii=False, sort_keys=True)
        return str(format_html("<pre>{}</pre>", redact(text)))

    @admin.display(description="payload")
    def payload_shown(self, obj: OutboxEvent) -> str:
        payload = bytes(obj.payload)
        try:
            text = json.dumps(json.loads(payload), indent=2, ensure_ascii=False)
        except ValueError:
            text = payload.decode("utf-8", "replace")
        note = ""
        if len(text) > MAX_PAYLOAD_CHARS:
            text = text[:MAX_PAYLOAD_CHARS]
            note = f"(the first {MAX_PAYLOAD_CHARS} characters of {len(payload)} bytes)"
        return str(format_html("<pre>{}</pre>{}", text, note))

    @admin.action(description="Replay the selected failed events", permissions=["manage"])
    def replay(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._act(request, queryset, "replay")

    @admin.action(description="Discard the selected failed events", permissions=["manage"])
    def discard(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._act(request, queryset, "discard")

    def _act(self, request: HttpRequest, queryset: QuerySet[Any], action: str) -> None:
        dsn, table = dsn_for(queryset.db), conf.get().TABLE
        ops = backend_for(dsn).admin()  # the database's: PostgreSQL's or MariaDB's
        store_act = ops.replay if action == "replay" else ops.discard
        act_and_log(
            self,
            request,
            selected=queryset.count(),
            eligible={e.id: e for e in queryset.filter(status=int(Status.FAILED))},
            act=lambda ids: store_act(dsn, table, ids=list[EventRef](ids)),
            noun="event(s)",
            done_noun="failed event(s)",
            past="replayed" if action == "replay" else "discarded",
            states="failed events",
            note=lambda event: f" ({event.event_id})",
        )


# -- task mode ------------------------------------------------------------------------------


class TaskNameFilter(_FailedValuesFilter):
    title = "task (failed tasks)"
    parameter_name = field = "task_name"
    failed = int(TaskStatus.FAILED)


class ErrorTypeFilter(_FailedValuesFilter):
    title = "error type (failed tasks)"
    parameter_name = field = "error_type"
    failed = int(TaskStatus.FAILED)


def _replay(ops: TaskOps, dsn: str, table: str, ids: list[int]) -> list[int]:
    return ops.replay_tasks_reporting(dsn, table, ids)[0]


def _discard(ops: TaskOps, dsn: str, table: str, ids: list[int]) -> list[int]:
    return ops.discard_tasks(dsn, table, ids)


def _cancel(ops: TaskOps, dsn: str, table: str, ids: list[int]) -> list[int]:
    return ops.cancel_tasks(dsn, table, ids)


_TASK_ACTIONS: dict[str, tuple[Callable[[TaskOps, str, str, list[int]], list[int]], str, str]] = {
    # action: (the database's task function, past tense, the states it acts on)
    "replay": (_replay, "replayed", "failed or cancelled"),
    "discard": (_discard, "discarded", "failed or cancelled"),
    "cancel": (_cancel, "cancelled", "pending or running"),
}


class TaskAdmin(_ReadOnlyAdmin):
    """Task mode's table: every task read-only; replay, discard and cancel go through
    the database's backend (what ``outboxkit tasks replay / discard / cancel`` run),
    logged."""

    list_display = ("id", "task_name", "queue", "status", "attempts", "error", "created_at")
    list_filter = ("status", TaskNameFilter, ErrorTypeFilter, "queue")
    search_fields = ("=id", "=key", "=unique_key")
    actions = ["replay", "discard", "cancel"]
    fields = (
        "id",
        "task_name",
        "queue",
        "priority",
        "key",
        "unique_key",
        "status",
        "attempts",
        "max_attempts",
        "available_at",
        "claimed_by",
        "error_type",
        "error",
        "traceback_shown",
        "created_at",
        "started_at",
        "finished_at",
        "payload_shown",
    )
    readonly_fields = fields

    def has_manage_permission(self, request: HttpRequest) -> bool:
        """Replay, discard and cancel: for whoever may change tasks (the model's permission)."""
        return bool(request.user.has_perm("outboxkit.change_task"))

    @admin.display(description="traceback")
    def traceback_shown(self, obj: Task) -> str:
        return str(format_html("<pre>{}</pre>", redact(obj.traceback_excerpt or "")))

    @admin.display(description="payload")
    def payload_shown(self, obj: Task) -> str:
        text = json.dumps(obj.payload, indent=2, ensure_ascii=False, sort_keys=True)
        note = ""
        if len(text) > MAX_PAYLOAD_CHARS:
            text = text[:MAX_PAYLOAD_CHARS]
            note = f"(the first {MAX_PAYLOAD_CHARS} characters)"
        return str(format_html("<pre>{}</pre>{}", redact(text), note))

    @admin.action(
        description="Replay the selected failed or cancelled tasks", permissions=["manage"]
    )
    def replay(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._act(request, queryset, "replay")

    @admin.action(
        description="Discard the selected failed or cancelled tasks", permissions=["manage"]
    )
    def discard(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._act(request, queryset, "discard")

    @admin.action(
        description="Cancel the selected pending or running tasks", permissions=["manage"]
    )
    def cancel(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._act(request, queryset, "cancel")

    def _act(self, request: HttpRequest, queryset: QuerySet[Any], action: str) -> None:
        act, past, states = _TASK_ACTIONS[action]
        selected = {t.id: t for t in queryset}
        table = conf.get().TASKS_TABLE
        assert table is not None  # the admin is registered only with a task table
        dsn = dsn_for(queryset.db)
        ops = backend_for(dsn).task_admin()  # the database's: PostgreSQL's or MariaDB's
        # The statement picks the rows in the right state (a worker may settle one meanwhile).
        act_and_log(
            self,
            request,
            selected=len(selected),
            eligible=selected,
            act=lambda ids: act(ops, dsn, table, ids),
            noun="task(s)",
            past=past,
            states=f"{states} tasks",
        )


if conf.get().TASKS_TABLE is not None:
    admin.site.register(Task, TaskAdmin)
