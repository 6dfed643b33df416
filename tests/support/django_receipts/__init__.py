"""A Django app laid out as docs/django.md shows: handlers in tasks.py, a view enqueuing."""
