"""The admin's tasks through Django's test client: list, filters, detail, and replay, discard
and cancel through backends/postgres/tasks_pg.py, each logged; nothing editable."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

URL = "/admin/outboxkit/task/"


def _add(dsn: str, name: str, status: int, error: str | None = None, **extra: Any) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO outboxkit_tasks (task_name, payload, status, attempts, last_error,"
            " error_type, traceback_excerpt) VALUES (%s, %s::jsonb, %s, %s, %s, %s, %s)"
            " RETURNING id",
            (name, extra.get("payload", "{}"), status, 3 if error else 0, error,
             extra.get("error_type"), extra.get("traceback")),
        ).fetchone()  # fmt: skip
    assert row is not None
    return int(row[0])


def _states(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute("SELECT id, status FROM outboxkit_tasks").fetchall())


@pytest.fixture
def admin_client(django_dsn: str) -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    client = Client()
    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "pw"))
    return client


@pytest.fixture
def seeded(django_dsn: str) -> dict[str, int]:
    return {
        "failed": _add(
            django_dsn, "report.generate", 3, "ValueError: token=s3cr3tvalue123 was refused",
            error_type="ValueError", traceback="Traceback ...\nValueError",
            payload='{"html": "<script>alert(1)</script>"}',
        ),
        "failed_mail": _add(django_dsn, "mail.send", 3, "timeout", error_type="TimeoutError"),
        "pending": _add(django_dsn, "report.generate", 0),
    }  # fmt: skip


def test_the_list_filters_failed_tasks_by_name_and_error_type(
    admin_client: Any, seeded: dict[str, int]
) -> None:
    page = admin_client.get(URL, {"status__exact": 3})
    assert page.status_code == 200
    html = page.content.decode()
    assert f"/task/{seeded['failed']}/change/" in html
    assert f"/task/{seeded['pending']}/change/" not in html
    assert "s3cr3tvalue123" not in html  # the error is shown masked
    mail = admin_client.get(URL, {"task_name": "mail.send"}).content.decode()
    assert f"/task/{seeded['failed_mail']}/change/" in mail
    assert f"/task/{seeded['failed']}/change/" not in mail
    by_type = admin_client.get(URL, {"error_type": "ValueError"}).content.decode()
    assert f"/task/{seeded['failed']}/change/" in by_type
    assert f"/task/{seeded['failed_mail']}/change/" not in by_type


def test_the_detail_is_read_only_and_escaped(admin_client: Any, seeded: dict[str, int]) -> None:
    for key in ("failed", "pending"):
        page = admin_client.get(f"{URL}{seeded[key]}/change/")
        assert page.status_code == 200
        assert 'name="_save"' not in page.content.decode()  # nothing to save, pending included
    html = admin_client.get(f"{URL}{seeded['failed']}/change/").content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>alert" not in html
    assert "Traceback ..." in html and "s3cr3tvalue123" not in html


def test_replay_discard_and_cancel_act_on_the_right_states_and_are_logged(
    django_dsn: str, admin_client: Any, seeded: dict[str, int]
) -> None:
    from django.contrib.admin.models import LogEntry

    failed, mail, pending = seeded["failed"], seeded["failed_mail"], seeded["pending"]
    answer = admin_client.post(URL, {"action": "replay", "_selected_action": [failed, pending]})
    assert answer.status_code == 302
    assert _states(django_dsn) == {failed: 0, mail: 3, pending: 0}  # the pending one untouched
    admin_client.post(URL, {"action": "cancel", "_selected_action": [pending, mail]})
    assert _states(django_dsn) == {failed: 0, mail: 3, pending: 4}
    admin_client.post(URL, {"action": "discard", "_selected_action": [mail, pending, failed]})
    assert _states(django_dsn) == {failed: 0}  # failed and cancelled ones deleted
    logged = sorted((int(e.object_id), e.change_message) for e in LogEntry.objects.all())
    assert [(i, m.split()[0]) for i, m in logged] == sorted(
        [(failed, "replayed"), (pending, "cancelled"), (mail, "discarded"),
         (pending, "discarded")]
    )  # fmt: skip


def test_a_staff_user_without_the_permission_cannot_replay(
    django_dsn: str, seeded: dict[str, int]
) -> None:
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_task"))
    client = Client()
    client.force_login(viewer)
    assert client.get(URL).status_code == 200
    client.post(URL, {"action": "replay", "_selected_action": [seeded["failed"]]})
    assert _states(django_dsn)[seeded["failed"]] == 3
