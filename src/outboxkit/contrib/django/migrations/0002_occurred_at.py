"""Outbox schema version 2 (backends/postgres/migrations/outbox/0002_occurred_at.sql)."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0001_outbox")]
    operations = schema_operations("outbox", 2)
