"""``manage.py`` of a project on Django's psycopg2 backend (run as ``python -m`` by
test_django_tasks_psycopg2.py; imported first by django_psycopg2_tasks.py).

Django picks psycopg 3 when it can import it, and outboxkit needs psycopg 3: psycopg is
hidden while Django loads its backend (as in a project without psycopg 3), then let back.
"""

import sys

sys.modules["psycopg"] = None  # type: ignore[assignment]
import django.db.backends.postgresql.base  # noqa: E402, F401  (loaded with psycopg2)

del sys.modules["psycopg"]

if __name__ == "__main__":
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
