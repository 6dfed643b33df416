"""Task table version 10 (backends/postgres/migrations/tasks/0010_parked.sql): the index of
the tasks parked behind a full concurrency limit, unless ``OUTBOXKIT['TASKS_TABLE']`` is
None."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0012_key_rates")]
    operations = [*schema_operations("tasks", 10)]
