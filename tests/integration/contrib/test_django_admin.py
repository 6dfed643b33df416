"""The admin's outbox events through Django's test client: list, filters, detail, actions."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outboxkit import Event, Outbox
from tests.support.relaying import count, rows


def _write(dsn: str, *events: Event) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        Outbox().put_many(conn, events)


def _fail(dsn: str, key: str, error: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET status = 2, attempts = 5, last_error = %s WHERE key = %s",
            (error, key),
        )


@pytest.fixture
def admin_client(django_dsn: str) -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    user = User.objects.create_superuser("ops", "ops@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def _events(dsn: str) -> None:
    _write(
        dsn,
        Event(
            topic="orders",
            event_type="order.placed",
            key="bad",
            payload=b'{"card": "<script>alert(1)</script>"}',
            headers={
                "authorization": "Bearer abcdefghijklmnop",
                "x-upstream-authorization": "Bearer s3cr3t",  # too short for the Bearer net
                "x-api-token": "Token abcdefghijkl",  # no prefix the free-text net knows
                "cookie": "session=zq8wv",
                "x-app-idempotency-key": "order-77",  # a key, not a secret: shown
            },
        ),
        Event(topic="orders", event_type="order.placed", key="late", payload={"n": 2}),
        Event(topic="mail", event_type="mail.sent", key="pending", payload={"n": 3}),
    )
    _fail(dsn, "bad", "broker refused: message too large")
    _fail(dsn, "late", "timeout after 5 s")


def _listed(page: Any) -> str:
    """The result rows of a changelist page."""
    html = page.content.decode()
    return html.split("<tbody>")[1].split("</tbody>")[0] if "<tbody>" in html else ""


def _link(row_id: int) -> str:
    return f"/outboxevent/{row_id}/change/"


def _id(dsn: str, key: str) -> int:
    return int(next(r["id"] for r in rows(dsn) if r["key"] == key))


def test_the_list_filters_by_status_topic_type_and_error(
    django_dsn: str, admin_client: Any
) -> None:
    _events(django_dsn)
    url = "/admin/outboxkit/outboxevent/"
    bad, late, pending = (_id(django_dsn, k) for k in ("bad", "late", "pending"))

    def shown(**query: Any) -> set[int]:
        listed = _listed(admin_client.get(url, query))
        return {i for i in (bad, late, pending) if _link(i) in listed}

    assert shown() == {bad, late, pending}
    assert shown(status__exact=2) == {bad, late}
    assert shown(error="timeout after 5 s") == {late}
    assert shown(topic="mail") == {pending}
    assert shown(event_type="order.placed") == {bad, late}


def test_the_detail_shows_payload_and_headers_escaped_and_secrets_masked(
    django_dsn: str, admin_client: Any
) -> None:
    _events(django_dsn)
    page = admin_client.get(f"/admin/outboxkit/outboxevent/{_id(django_dsn, 'bad')}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "abcdefghijklmnop" not in html and "authorization" in html
    for secret in ("s3cr3t", "abcdefghijkl", "zq8wv"):  # masked by the header's name
        assert secret not in html, secret
    assert "order-77" in html and "x-api-token" in html
    assert 'name="_save"' not in html  # read-only: nothing to save


def test_replay_and_discard_act_on_failed_events_only_and_are_logged(
    django_dsn: str, admin_client: Any
) -> None:
    from django.contrib.admin.models import LogEntry

    _events(django_dsn)
    url = "/admin/outboxkit/outboxevent/"
    bad, late, pending = (_id(django_dsn, k) for k in ("bad", "late", "pending"))
    answer = admin_client.post(url, {"action": "replay", "_selected_action": [bad, pending]})
    assert answer.status_code == 302
    by_key = {r["key"]: r for r in rows(django_dsn)}
    assert (by_key["bad"]["status"], by_key["bad"]["attempts"]) == (0, 0)
    assert by_key["late"]["status"] == 2
    admin_client.post(url, {"action": "discard", "_selected_action": [late, pending]})
    assert sorted(r["key"] for r in rows(django_dsn)) == ["bad", "pending"]
    logged = {(e.object_id, e.change_message) for e in LogEntry.objects.all()}
    assert {o for o, _m in logged} == {str(bad), str(late)}
    assert any("replayed" in m for _o, m in logged) and any("discarded" in m for _o, m in logged)
    assert count(django_dsn) == 2


def test_a_staff_user_without_the_permission_gets_no_actions(django_dsn: str) -> None:
    from django.contrib.auth.models import Permission, User
    from django.test import Client

    _events(django_dsn)
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_outboxevent"))
    client = Client()
    client.force_login(viewer)
    url = "/admin/outboxkit/outboxevent/"
    assert client.get(url).status_code == 200
    bad = _id(django_dsn, "bad")
    client.post(url, {"action": "replay", "_selected_action": [bad]})
    assert next(r for r in rows(django_dsn) if r["key"] == "bad")["status"] == 2


def test_a_secret_in_an_error_stays_out_of_the_filter_links_and_search_is_safe(
    django_dsn: str, admin_client: Any
) -> None:
    _events(django_dsn)
    _fail(django_dsn, "late", "401 from https://user:hunter22secret@hooks.example.com/x")
    url = "/admin/outboxkit/outboxevent/"
    page = admin_client.get(url).content.decode()
    assert "hunter22secret" not in page
    late = _id(django_dsn, "late")
    assert _link(late) in _listed(admin_client.get(url, {"error": "401 from https://user:***"}))
    for q in ("not-a-uuid", str(late), "late"):
        assert admin_client.get(url, {"q": q}).status_code == 200
