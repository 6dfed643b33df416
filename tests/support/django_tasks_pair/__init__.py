"""One Django project with two backends of Django's Tasks framework on one PostgreSQL:
outboxkit's (``default``) and django-tasks-db's (``db``), for bench/django_tasks.py and
tests/integration/contrib/test_django_tasks_vs_tasks_db.py."""
