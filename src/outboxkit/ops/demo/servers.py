"""The demo's servers and clients: embedded or the user's, a scratch database, a proxy, NATS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import psycopg

from outboxkit._redact import redact
from outboxkit.errors import OutboxkitError
from outboxkit.testing import (
    EmbeddedNats,
    EmbeddedPostgres,
    TcpProxy,
    create_database,
    drop_database,
)

log = logging.getLogger("outboxkit.demo")


class _Server(Protocol):
    def start(self) -> None: ...
    def close(self) -> None: ...


def start_servers(
    pg: _Server | None, nats_server: _Server | None, say: Callable[[str], None]
) -> None:
    """Start both at once: PostgreSQL's initdb dominates the demo's start-up time."""
    named = [(n, s) for n, s in (("PostgreSQL", pg), ("NATS JetStream", nats_server)) if s]
    if not named:
        return
    servers = [s for _n, s in named]
    names = " and ".join(n for n, _s in named)
    say(f"starting embedded {names} …")
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        for (name, _server), future in zip(named, futures, strict=True):
            try:
                future.result()
            except OutboxkitError as exc:
                raise OutboxkitError(cannot_embed(name, exc)) from None


def attr(obj: Any, name: str) -> Any:
    """A property or a no-argument method (``server.dsn`` or ``server.dsn()``)."""
    value = getattr(obj, name)
    return value() if callable(value) else value


def quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # cleanup must go on; say what could not be cleaned
        log.warning("demo cleanup: %s", redact(f"{type(exc).__name__}: {exc}"))


def embedded_servers(
    work: Path, *, want_pg: bool, want_nats: bool, logical: bool = False
) -> tuple[EmbeddedPostgres | None, EmbeddedNats | None]:
    try:  # PostgreSQL makes its own data directory: under root it must be one it can reach
        pg = EmbeddedPostgres(logical=logical) if want_pg else None
    except OutboxkitError as exc:
        raise OutboxkitError(cannot_embed("PostgreSQL", exc)) from None
    try:
        nats_server = EmbeddedNats(work / "nats") if want_nats else None
    except OutboxkitError as exc:
        raise OutboxkitError(cannot_embed("NATS JetStream", exc)) from None
    return pg, nats_server


def cannot_embed(name: str, exc: Exception) -> str:
    """One line: why the embedded server is missing, and the flag that does without it."""
    flag = "--dsn postgresql://…" if name == "PostgreSQL" else "--broker nats://…"
    return f"embedded {name} unavailable: {exc}; or pass {flag} to use a server you already run"


async def create_scratch_database(server_dsn: str) -> tuple[str, str]:
    """A fresh database per run, so the demo never touches anything of the user's: (name, DSN)."""
    name = f"outboxkit_demo_{secrets.token_hex(4)}"
    try:
        dsn = await asyncio.to_thread(create_database, server_dsn, name)
    except psycopg.OperationalError:
        raise
    except psycopg.Error as exc:
        raise OutboxkitError(
            f"cannot create the scratch database {name!r}: {exc};"
            " the demo needs a role allowed to CREATE DATABASE"
        ) from None
    return name, dsn


async def drop_scratch_database(server_dsn: str, name: str) -> None:
    try:
        await asyncio.to_thread(drop_database, server_dsn, name)
    except psycopg.Error as exc:
        log.warning("could not drop the demo database %s: %s", name, redact(str(exc)))


def proxy_target(broker_url: str) -> tuple[str, int]:
    """The host and port of a nats:// URL; a ValueError that says what is expected otherwise."""
    parts = urlsplit(broker_url)
    if parts.scheme != "nats" or not parts.hostname:
        raise ValueError(
            "--broker must be a nats:// URL of a NATS server with JetStream enabled,"
            f" e.g. nats://127.0.0.1:4222 (got {redact(broker_url)!r})"
        )
    return parts.hostname, parts.port or 4222


def proxy_for(broker_url: str) -> tuple[TcpProxy, str]:
    """A started proxy to the broker and the URL clients use to reach it through the proxy."""
    proxy = TcpProxy(*proxy_target(broker_url)).start()
    parts = urlsplit(broker_url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{proxy.port}" if userinfo else f"127.0.0.1:{proxy.port}"
    return proxy, urlunsplit(("nats", netloc, "", "", ""))


async def nats_connect(url: str, name: str, **options: Any) -> Any:
    import nats

    async def quiet(*_args: Any) -> None:
        """Reconnects are the scenario, not news: keep the client's callbacks silent."""

    return await nats.connect(
        url,
        name=name,
        connect_timeout=2,
        reconnect_time_wait=0.25,
        max_reconnect_attempts=-1,
        error_cb=quiet,
        disconnected_cb=quiet,
        reconnected_cb=quiet,
        closed_cb=quiet,
        **options,
    )


async def close_nats(nc: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 5.0)


async def delete_stream(js: Any, stream: str) -> None:
    with contextlib.suppress(Exception):
        await js.delete_stream(stream)


def signal_process(proc: subprocess.Popen[bytes], signum: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)


async def wait_exit(proc: subprocess.Popen[bytes], grace: float) -> int | None:
    """The exit code, or None if the process still runs after ``grace`` seconds."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        return await asyncio.to_thread(proc.wait, grace)
    return proc.poll()
