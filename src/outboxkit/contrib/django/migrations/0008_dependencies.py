"""Task table version 5 (backends/postgres/migrations/tasks/0005_dependencies.sql):
dependencies, unless ``OUTBOXKIT['TASKS_TABLE']`` is None, and the admin model's new columns."""

from django.db import migrations, models

from outboxkit.contrib.django.operations import schema_operations


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0007_results")]
    operations = [
        *schema_operations("tasks", 5),
        migrations.AddField(
            model_name="task", name="has_dependents", field=models.BooleanField(default=False)
        ),
        migrations.AddField(
            model_name="task", name="after_failure", field=models.SmallIntegerField(null=True)
        ),
    ]
