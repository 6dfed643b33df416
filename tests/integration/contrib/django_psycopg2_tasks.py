"""Run by test_django_tasks_psycopg2.py: Django's Tasks framework on outboxkit's backend in a
project on Django's psycopg2 backend. ``enqueue``: a rolled-back, a committed, an
autocommit and an ``aenqueue`` enqueue; ``results ID...``: ``get_result`` of each. Prints
one JSON object with what it saw."""

import tests.integration.contrib.django_psycopg2_manage  # noqa: F401, I001  (psycopg2 first)

import asyncio
import json
import sys

import django
from django.db import connection, transaction

django.setup()
from tests.integration.contrib import django_framework_tasks as jobs  # noqa: E402


def enqueue() -> dict[str, object]:
    seen: dict[str, object] = {}
    try:
        with transaction.atomic():
            seen["rolled_back"] = jobs.create_group.enqueue("rolled back").id
            raise RuntimeError("the view failed")
    except RuntimeError:
        pass
    with transaction.atomic():
        seen["committed"] = jobs.create_group.enqueue("committed").id
        seen["driver"] = type(connection.connection).__module__
    seen["autocommit"] = jobs.add.enqueue(2, 3).id
    seen["async"] = asyncio.run(jobs.add.aenqueue(20, 22)).id
    return seen


def results(ids: list[str]) -> dict[str, object]:
    seen: dict[str, object] = {"driver": type(connection.connection).__module__}
    for result_id in ids:
        try:
            r = jobs.add.get_backend().get_result(result_id)
        except Exception as exc:
            seen[result_id] = type(exc).__name__
        else:
            seen[result_id] = [str(r.status), r.return_value if r.is_finished else None]
    return seen


if sys.argv[1] == "enqueue":
    print(json.dumps(enqueue()))
else:
    connection.ensure_connection()
    print(json.dumps(results(sys.argv[2:])))
