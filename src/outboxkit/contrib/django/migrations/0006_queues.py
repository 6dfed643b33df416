"""Task table version 3 (backends/postgres/migrations/tasks/0003_queues.sql): the table of
paused queues, unless ``OUTBOXKIT['TASKS_TABLE']`` is None."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0005_lapses")]
    operations = schema_operations("tasks", 3)
