"""The outbox and task tables as unmanaged models, for the admin (the migrations own them)."""

from __future__ import annotations

from django.db import models

from outboxkit.backends.postgres.postgres import Status
from outboxkit.contrib.django import conf
from outboxkit.contrib.django.operations import db_table
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE, TaskStatus

STATUS_CHOICES = [(int(s), s.name.lower()) for s in Status]
TASK_STATUS_CHOICES = [(int(s), s.name.lower()) for s in TaskStatus]


class OutboxEvent(models.Model):
    """One row of the outbox: read it here; replay and discard go through the library."""

    id = models.BigIntegerField(primary_key=True)
    event_id = models.UUIDField()
    topic = models.TextField()
    key = models.TextField(null=True)
    event_type = models.TextField()
    aggregate_type = models.TextField(null=True)
    aggregate_id = models.TextField(null=True)
    payload = models.BinaryField()
    headers = models.JSONField(default=dict)
    status = models.SmallIntegerField(choices=STATUS_CHOICES, default=int(Status.PENDING))
    attempts = models.IntegerField(default=0)
    available_at = models.DateTimeField()
    claim_token = models.UUIDField(null=True)
    claimed_by = models.TextField(null=True)
    last_error = models.TextField(null=True)
    created_at = models.DateTimeField()
    published_at = models.DateTimeField(null=True)
    occurred_at = models.DateTimeField(null=True)
    schema_version = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = db_table(conf.get().TABLE)
        ordering = ["id"]
        verbose_name = "outbox event"
        verbose_name_plural = "outbox events"

    def __str__(self) -> str:
        return f"{self.event_type} #{self.id} ({self.topic})"


class Task(models.Model):
    """One row of task mode's table: read it here; replay, cancel and discard go through the
    library (backends/postgres/tasks_pg.py), as ``outboxkit tasks`` does."""

    id = models.BigIntegerField(primary_key=True)
    task_name = models.TextField()
    queue = models.TextField(default="default")
    payload = models.JSONField(null=True)
    priority = models.SmallIntegerField(default=0)
    key = models.TextField(null=True)
    unique_key = models.TextField(null=True)
    status = models.SmallIntegerField(choices=TASK_STATUS_CHOICES, default=int(TaskStatus.PENDING))
    attempts = models.IntegerField(default=0)
    max_attempts = models.IntegerField(null=True)
    available_at = models.DateTimeField()
    claim_token = models.UUIDField(null=True)
    claimed_by = models.TextField(null=True)
    last_error = models.TextField(null=True)
    error_type = models.TextField(null=True)
    traceback_excerpt = models.TextField(null=True)
    created_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    #: Deaths in a row of its worker while it ran beside others (2+: it runs alone).
    lapses = models.SmallIntegerField(default=0)
    #: Attempts not charged against max_attempts (deaths beside others).
    spared = models.IntegerField(default=0)
    #: The handler's return value, when it keeps results (``keep_result=``).
    result = models.JSONField(null=True)
    #: The last progress the running attempt reported (``ctx.progress()``).
    progress = models.JSONField(null=True)
    #: When a finished task kept for its result may be purged.
    keep_until = models.DateTimeField(null=True)
    #: Tasks wait for this one (``after=``): its settle releases them.
    has_dependents = models.BooleanField(default=False)
    #: What a failed upstream task does to this one: 0 cancel, 1 run anyway (None: none).
    after_failure = models.SmallIntegerField(null=True)
    #: The W3C traceparent of the span active at enqueue (the worker's span links to it).
    trace = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = db_table(conf.get().TASKS_TABLE or DEFAULT_TASKS_TABLE)
        ordering = ["id"]
        verbose_name = "task"
        verbose_name_plural = "tasks"

    def __str__(self) -> str:
        return f"{self.task_name} #{self.id}"
