"""The Django app: ``INSTALLED_APPS += ["outboxkit.contrib.django"]`` (label ``outboxkit``)."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxkitConfig(AppConfig):
    name = "outboxkit.contrib.django"
    label = "outboxkit"
    verbose_name = "outboxkit"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from outboxkit.contrib.django import conf

        conf.get()  # a wrong setting fails at start-up, not at the first write
        # Every installed app's `tasks` module, where its handlers register: in the web
        # process too, whose views enqueue by name (only the worker command imported
        # them, and a view's enqueue then found no handler: an HTTP 500).
        autodiscover_modules("tasks")
        _register_tasks_backend()


def _register_tasks_backend() -> None:
    """Register ``django.task`` where ``settings.TASKS`` names our backend: the worker runs
    Django's ``@task`` functions although nothing there builds the backend."""
    from django.conf import settings

    backends = getattr(settings, "TASKS", None) or {}
    if any("outboxkit" in str(b.get("BACKEND", "")) for b in backends.values()):
        from outboxkit.contrib.django import tasks_backend

        tasks_backend._register()
