"""The pair's settings: DATABASES from OUTBOXKIT_TEST_DJANGO_DSN."""

import os

from tests.integration.contrib.django_settings import _database

SECRET_KEY = "outboxkit-tests-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_tasks_db",
    "outboxkit.contrib.django",
]
# PAIR_CONN_MAX_AGE=none: persistent connections (bench/django_tasks.py's second db_worker).
_AGE = None if os.environ.get("PAIR_CONN_MAX_AGE") == "none" else 0
DATABASES = {"default": {**_database(), "CONN_MAX_AGE": _AGE}}
TASKS = {
    "default": {"BACKEND": "outboxkit.contrib.django.tasks_backend.OutboxkitBackend"},
    "db": {"BACKEND": "django_tasks_db.DatabaseBackend"},
}
LOGGING = {"version": 1, "disable_existing_loggers": False}
