"""An existing NATS stream without the subjects ``?subjects=`` asks for is named at start."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import nats
import pytest

from outboxkit.publishers.nats import NatsPublisher


async def _stream_subjects(url: str, stream: str, subjects: list[str] | None) -> list[str]:
    """Create ``stream`` with ``subjects`` (when given), then read its subjects back."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        if subjects is not None:
            await js.add_stream(name=stream, subjects=subjects)
        info = await js.stream_info(stream)
        return list(info.config.subjects or [])
    finally:
        await nc.close()


async def _delete(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def test_a_stream_lacking_asked_subjects_is_a_warning_at_start_saying_how_to_add(
    nats_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: no word at start; every publish then said "create one (or give ?subjects=)"."""
    stream, tag = f"SUBJ_{uuid.uuid4().hex[:8].upper()}", uuid.uuid4().hex[:8]
    await _stream_subjects(nats_server.url, stream, [f"{tag}.a"])
    publisher = NatsPublisher.from_url(
        f"{nats_server.url}?stream={stream}&subjects={tag}.a,{tag}.b"
    )
    try:
        with caplog.at_level(logging.WARNING, logger="outboxkit.nats"):
            await publisher.start()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        [line] = [w for w in warnings if stream in w]
        assert f"without subjects {tag}.b" in line, line
        assert f"nats stream edit {stream} --subjects {tag}.a,{tag}.b" in line, line
        assert "add_subjects=1" in line, line
        # The operator's stream is left alone.
        assert await _stream_subjects(nats_server.url, stream, None) == [f"{tag}.a"]
    finally:
        await publisher.close()
        await _delete(nats_server.url, stream)


async def test_add_subjects_adds_the_missing_subjects_to_the_existing_stream(
    nats_server: Any,
) -> None:
    stream, tag = f"SUBJ_{uuid.uuid4().hex[:8].upper()}", uuid.uuid4().hex[:8]
    await _stream_subjects(nats_server.url, stream, [f"{tag}.a"])
    publisher = NatsPublisher.from_url(
        f"{nats_server.url}?stream={stream}&subjects={tag}.a,{tag}.b&add_subjects=1"
    )
    try:
        await publisher.start()
        subjects = await _stream_subjects(nats_server.url, stream, None)
        assert subjects == [f"{tag}.a", f"{tag}.b"]
    finally:
        await publisher.close()
        await _delete(nats_server.url, stream)


async def test_a_stream_that_cannot_be_created_for_overlapping_subjects_is_named(
    nats_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the overlap was swallowed and the start logged "created JetStream stream"."""
    holder, asked, tag = (
        f"SUBJ_{uuid.uuid4().hex[:8].upper()}",
        f"SUBJ_{uuid.uuid4().hex[:8].upper()}",
        uuid.uuid4().hex[:8],
    )
    await _stream_subjects(nats_server.url, holder, [f"{tag}.a"])
    publisher = NatsPublisher.from_url(f"{nats_server.url}?stream={asked}&subjects={tag}.a")
    try:
        with caplog.at_level(logging.INFO, logger="outboxkit.nats"):
            await publisher.start()
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if m.startswith("created JetStream stream")], messages
        [line] = [m for m in messages if m.startswith("cannot create JetStream stream")]
        assert f"give the relay ?stream={holder}" in line and "overlap" in line, line
    finally:
        await publisher.close()
        await _delete(nats_server.url, holder)
