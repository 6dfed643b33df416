"""Django settings of the contrib tests (conftest.py configures Django with them in-process;
the relay test's subprocess loads them as DJANGO_SETTINGS_MODULE).

The databases' names come from OUTBOXKIT_TEST_DJANGO_DSN in a subprocess; in-process the
fixtures point each alias at the test's own database.
"""

import os

from psycopg.conninfo import conninfo_to_dict

_dsn = conninfo_to_dict(os.environ.get("OUTBOXKIT_TEST_DJANGO_DSN", "dbname=unset"))


def _database() -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _dsn.get("dbname", ""),
        "USER": _dsn.get("user", ""),
        "PASSWORD": _dsn.get("password", ""),
        "HOST": _dsn.get("host", ""),
        "PORT": _dsn.get("port", ""),
    }


SECRET_KEY = "outboxkit-tests-only"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["testserver"]
ROOT_URLCONF = "tests.integration.contrib.django_urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "outboxkit.contrib.django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {"default": {**_database(), "ATOMIC_REQUESTS": True}, "other": _database()}
OUTBOXKIT = {
    "TABLE": os.environ.get("OUTBOXKIT_TEST_DJANGO_TABLE", "outbox"),
    "INBOX_TABLE": os.environ.get("OUTBOXKIT_TEST_DJANGO_INBOX_TABLE", "processed_events"),
}
TASKS = {
    "default": {
        "BACKEND": "outboxkit.contrib.django.tasks_backend.OutboxkitBackend",
        "QUEUES": ["default", "reports"],
    }
}
