"""Outbox schema version 1 (backends/postgres/migrations/outbox/0001_outbox.sql), and the admin's
model."""

from django.db import migrations, models

from outboxkit.contrib.django import conf
from outboxkit.contrib.django.models import STATUS_CHOICES
from outboxkit.contrib.django.operations import db_table, schema_operations


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        *schema_operations("outbox", 1),
        migrations.CreateModel(
            name="OutboxEvent",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("event_id", models.UUIDField()),
                ("topic", models.TextField()),
                ("key", models.TextField(null=True)),
                ("event_type", models.TextField()),
                ("aggregate_type", models.TextField(null=True)),
                ("aggregate_id", models.TextField(null=True)),
                ("payload", models.BinaryField()),
                ("headers", models.JSONField(default=dict)),
                ("status", models.SmallIntegerField(choices=STATUS_CHOICES, default=0)),
                ("attempts", models.IntegerField(default=0)),
                ("available_at", models.DateTimeField()),
                ("claim_token", models.UUIDField(null=True)),
                ("claimed_by", models.TextField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("created_at", models.DateTimeField()),
                ("published_at", models.DateTimeField(null=True)),
                ("occurred_at", models.DateTimeField(null=True)),
                ("schema_version", models.TextField(null=True)),
            ],
            options={
                "verbose_name": "outbox event",
                "verbose_name_plural": "outbox events",
                "db_table": db_table(conf.get().TABLE),
                "ordering": ["id"],
                "managed": False,
            },
        ),
    ]
