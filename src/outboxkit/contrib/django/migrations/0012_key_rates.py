"""Task table version 9 (backends/postgres/migrations/tasks/0009_key_rates.sql): the token
buckets of task names rate-limited per key, unless ``OUTBOXKIT['TASKS_TABLE']`` is None."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0011_rates")]
    operations = [*schema_operations("tasks", 9)]
