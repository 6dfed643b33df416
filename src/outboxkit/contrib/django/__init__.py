"""outboxkit for Django: ``INSTALLED_APPS += ["outboxkit.contrib.django"]``.

``outbox.put(event)`` / ``put_many(events)`` inside ``transaction.atomic()`` (``using=`` for
another database), ``inbox.handle(consumer, event_id)`` for consumers, migrations that apply
the library's versioned SQL files, ``manage.py outboxkit_relay`` / ``outboxkit_status`` and
an admin for dead-lettered events; task mode: ``tasks.enqueue(name, payload)`` inside
``atomic()``, ``manage.py outboxkit_worker``, an admin for tasks. Settings:
``OUTBOXKIT = {...}`` (``conf.Config``). docs/django.md.
"""

from __future__ import annotations

from outboxkit.contrib.django.task_mode import DjangoTasks
from outboxkit.contrib.django.writer import DjangoInbox, DjangoOutbox

#: The outbox of ``settings.OUTBOXKIT``, on Django's connections.
outbox = DjangoOutbox()
#: The inbox of ``settings.OUTBOXKIT['INBOX_TABLE']``, on Django's connections.
inbox = DjangoInbox()
#: Task mode on ``settings.OUTBOXKIT['TASKS_TABLE']``: ``tasks.enqueue`` inside ``atomic()``.
tasks = DjangoTasks()

__all__ = ["DjangoInbox", "DjangoOutbox", "DjangoTasks", "inbox", "outbox", "tasks"]
