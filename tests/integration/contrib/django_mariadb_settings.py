"""Django settings of a project whose default database is MariaDB (Django's ``mysql``
backend, mysqlclient), for the subprocesses of test_django_mariadb_tasks.py: the database
from OUTBOXKIT_TEST_DJANGO_MYSQL_URL, no MariaDB-only outboxkit setting."""

import os
import urllib.parse

_url = urllib.parse.urlsplit(os.environ.get("OUTBOXKIT_TEST_DJANGO_MYSQL_URL", "mysql://x/unset"))

SECRET_KEY = "outboxkit-tests-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["outboxkit.contrib.django"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "root",
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": str(_url.port or 3306),
    }
}
TASKS = {
    "default": {
        "BACKEND": "outboxkit.contrib.django.tasks_backend.OutboxkitBackend",
        "QUEUES": ["default", "reports"],
    }
}
