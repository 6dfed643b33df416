"""Inbox schema version 1 (backends/postgres/migrations/inbox/0001_processed_events.sql), unless
``OUTBOXKIT['INBOX_TABLE']`` is None."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0002_occurred_at")]
    operations = schema_operations("inbox", 1)
