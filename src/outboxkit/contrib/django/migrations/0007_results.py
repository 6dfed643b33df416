"""Task table version 4 (backends/postgres/migrations/tasks/0004_results.sql): results and
progress, unless ``OUTBOXKIT['TASKS_TABLE']`` is None, and the admin model's new columns."""

from django.db import migrations, models

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0006_queues")]
    operations = [
        *schema_operations("tasks", 4),
        migrations.AddField(model_name="task", name="result", field=models.JSONField(null=True)),
        migrations.AddField(model_name="task", name="progress", field=models.JSONField(null=True)),
        migrations.AddField(
            model_name="task", name="keep_until", field=models.DateTimeField(null=True)
        ),
    ]
