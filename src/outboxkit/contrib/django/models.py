"""The outbox table as an unmanaged model, for the admin (the migrations own the table)."""

from __future__ import annotations

from django.db import models

from outboxkit.contrib.django import conf
from outboxkit.contrib.django.operations import db_table
from outboxkit.store.postgres import Status

STATUS_CHOICES = [(int(s), s.name.lower()) for s in Status]


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
