"""Task table version 6 (backends/postgres/migrations/tasks/0006_traces.sql): the enqueue's
trace, unless ``OUTBOXKIT['TASKS_TABLE']`` is None, and the admin model's new column."""

from django.db import migrations, models

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0008_dependencies")]
    operations = [
        *schema_operations("tasks", 6),
        migrations.AddField(model_name="task", name="trace", field=models.TextField(null=True)),
    ]
