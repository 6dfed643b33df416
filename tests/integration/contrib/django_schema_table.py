"""Run by test_django_schema_table.py in a subprocess: settings OUTBOXKIT with schema-qualified
tables (the model's table and the migrations are fixed when Django loads them)."""

import json

import django
from django.core.management import call_command
from django.db import transaction

django.setup()

from outboxkit import Event  # noqa: E402
from outboxkit.contrib.django import inbox, outbox  # noqa: E402
from outboxkit.contrib.django.models import OutboxEvent  # noqa: E402

call_command("migrate", verbosity=0)
with transaction.atomic():
    outbox.put(Event(topic="orders", event_type="order.placed", key="s", payload={}))
    fresh = inbox.mark("billing", "00000000-0000-0000-0000-000000000001")
print(json.dumps({"model_rows": OutboxEvent.objects.count(), "fresh": fresh}))
