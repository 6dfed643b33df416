"""Task table version 2 (backends/postgres/migrations/tasks/0002_lapses.sql), unless
``OUTBOXKIT['TASKS_TABLE']`` is None, and the admin model's new columns."""

from django.db import migrations, models

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0004_tasks")]
    operations = [
        *schema_operations("tasks", 2),
        migrations.AddField(
            model_name="task", name="lapses", field=models.SmallIntegerField(default=0)
        ),
        migrations.AddField(model_name="task", name="spared", field=models.IntegerField(default=0)),
    ]
