"""Task table version 11 (backends/postgres/migrations/tasks/0011_fair.sql): the fair task
names the workers keep for the enqueue, unless ``OUTBOXKIT['TASKS_TABLE']`` is None."""

from django.db import migrations

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0013_parked")]
    operations = [*schema_operations("tasks", 11)]
