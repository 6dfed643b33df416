"""Task table version 7 (backends/postgres/migrations/tasks/0007_limits.sql): the index of
running tasks that concurrency limits count, unless ``OUTBOXKIT['TASKS_TABLE']`` is None."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0009_traces")]
    operations = [*schema_operations("tasks", 7)]
