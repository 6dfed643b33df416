"""Task table version 8 (backends/postgres/migrations/tasks/0008_rates.sql): the token buckets
of rate-limited task names, unless ``OUTBOXKIT['TASKS_TABLE']`` is None."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0010_limits")]
    operations = [*schema_operations("tasks", 8)]
