"""Task table version 1 (backends/postgres/migrations/tasks/0001_tasks.sql), unless
``OUTBOXKIT['TASKS_TABLE']`` is None, and the admin's model of it."""

from django.db import migrations, models

from outboxkit.contrib.django import conf
from outboxkit.contrib.django.models import TASK_STATUS_CHOICES
from outboxkit.contrib.django.operations import db_table, schema_operations
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE


class Migration(migrations.Migration):
    dependencies = [("outboxkit", "0003_processed_events")]
    operations = [
        *schema_operations("tasks", 1),
        migrations.CreateModel(
            name="Task",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("task_name", models.TextField()),
                ("queue", models.TextField(default="default")),
                ("payload", models.JSONField(null=True)),
                ("priority", models.SmallIntegerField(default=0)),
                ("key", models.TextField(null=True)),
                ("unique_key", models.TextField(null=True)),
                ("status", models.SmallIntegerField(choices=TASK_STATUS_CHOICES, default=0)),
                ("attempts", models.IntegerField(default=0)),
                ("max_attempts", models.IntegerField(null=True)),
                ("available_at", models.DateTimeField()),
                ("claim_token", models.UUIDField(null=True)),
                ("claimed_by", models.TextField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("error_type", models.TextField(null=True)),
                ("traceback_excerpt", models.TextField(null=True)),
                ("created_at", models.DateTimeField()),
                ("started_at", models.DateTimeField(null=True)),
                ("finished_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "task",
                "verbose_name_plural": "tasks",
                "db_table": db_table(conf.get().TASKS_TABLE or DEFAULT_TASKS_TABLE),
                "ordering": ["id"],
                "managed": False,
            },
        ),
    ]
