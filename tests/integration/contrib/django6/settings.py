"""Django settings of the Django 6 tests (run in build/django6-venv by test_django6_tasks.py):
Django's own ``django.tasks`` with outboxkit's backend, no backport installed."""

from tests.integration.contrib.django_settings import _database  # OUTBOXKIT_TEST_DJANGO_DSN's

SECRET_KEY = "outboxkit-tests-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "outboxkit.contrib.django"]
DATABASES = {"default": _database()}
TASKS = {
    "default": {
        "BACKEND": "outboxkit.contrib.django.tasks_backend.OutboxkitBackend",
        "QUEUES": ["default", "reports"],
    }
}
