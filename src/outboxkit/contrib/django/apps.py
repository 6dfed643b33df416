"""The Django app: ``INSTALLED_APPS += ["outboxkit.contrib.django"]`` (label ``outboxkit``)."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxkitConfig(AppConfig):
    name = "outboxkit.contrib.django"
    label = "outboxkit"
    verbose_name = "outboxkit"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from outboxkit.contrib.django import conf

        conf.get()  # a wrong setting fails at start-up, not at the first write
