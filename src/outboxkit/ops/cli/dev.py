"""``outboxkit dev``: a PostgreSQL (and, if asked, NATS and a Kafka-protocol broker) to develop
against, from the wheels the ``embedded`` extra brings, until Ctrl-C.

The servers are the testing kit's (outboxkit.testing), the ones ``make demo`` runs, but kept:
PostgreSQL's cluster and NATS's streams live in a data directory that the next ``outboxkit
dev`` starts again. They listen on 127.0.0.1 only, on free ports unless given, so the
machine's own PostgreSQL or NATS on the default ports is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import click

from outboxkit.ops.cli.output import fail, ok


def default_data_dir() -> Path:
    """Where the servers keep their data unless told: the user's data directory, or, for
    root (PostgreSQL then runs as a system user that cannot enter /root), /var/tmp."""
    if os.geteuid() == 0:
        return Path("/var/tmp/outboxkit-dev")  # noqa: S108 - root-owned, made 0o711 below
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "outboxkit" / "dev"


def _taken(port: int | None, flag: str) -> None:
    from outboxkit.testing import port_accepts

    if port is not None and port_accepts(port):
        fail(
            f"port {port} ({flag}) is taken on 127.0.0.1: something already listens there;"
            f" give another {flag}, or leave it out (a free port is picked)",
            2,
        )


@click.command()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the servers keep their data, kept across runs [default: ~/.local/share/"
    "outboxkit/dev; /var/tmp/outboxkit-dev for root].",
)
@click.option("--pg-port", type=click.IntRange(1, 65535), default=None,
              help="PostgreSQL's port [default: a free one].")  # fmt: skip
@click.option("--nats", is_flag=True, help="Also start NATS with JetStream (nats-server).")
@click.option("--nats-port", type=click.IntRange(1, 65535), default=None,
              help="NATS's port [default: a free one].")  # fmt: skip
@click.option(
    "--kafka",
    is_flag=True,
    help="Also start a Kafka-protocol broker (Tansu; its topics live in memory only).",
)
@click.option("--kafka-port", type=click.IntRange(1, 65535), default=None,
              help="The Kafka broker's port [default: a free one].")  # fmt: skip
@click.option("--json", "as_json", is_flag=True,
              help="One JSON line with the URLs and pids, for programs.")  # fmt: skip
def dev(
    data_dir: Path | None,
    pg_port: int | None,
    nats: bool,
    nats_port: int | None,
    kafka: bool,
    kafka_port: int | None,
    as_json: bool,
) -> None:
    """Run a PostgreSQL to develop against (and NATS or Kafka, if asked) until Ctrl-C.

    Prints the URLs and the `export` lines that make every other command use them
    (OUTBOXKIT_DSN, OUTBOXKIT_BROKER). The data stays in --data-dir: stop with Ctrl-C
    (or SIGTERM) and start again, and your tables and rows are where you left them.

    \b
    Example:
      outboxkit dev --nats            # in one terminal
      export OUTBOXKIT_DSN=...        # the lines it prints, in another
      outboxkit migrate && outboxkit relay --broker "$OUTBOXKIT_BROKER"
    """
    _taken(pg_port, "--pg-port")
    _taken(nats_port, "--nats-port")
    _taken(kafka_port, "--kafka-port")
    from outboxkit.testing import EmbeddedKafka, EmbeddedNats, EmbeddedPostgres

    root = (data_dir or default_data_dir()).absolute()
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        root.chmod(0o711)  # PostgreSQL's system user must enter it to reach its cluster
    lock = _claim(root)
    servers: list[Any] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        postgres = EmbeddedPostgres(root / "postgres", port=pg_port)
        servers.append(postgres)
        postgres.start()
        found: dict[str, Any] = {
            "dsn": postgres.dsn,
            "data_dir": str(root),
            "pids": {"postgres": postgres.pid},
        }
        if nats:
            server = EmbeddedNats(root / "nats", port=nats_port)
            servers.append(server)
            server.start()
            found["nats"] = server.url
            found["pids"]["nats"] = server.pid
        if kafka:
            broker = EmbeddedKafka(port=kafka_port)
            servers.append(broker)
            broker.start()
            found["kafka"] = broker.url
            found["pids"]["kafka"] = broker.pid
        _announce(found, as_json)
        while not stop.wait(0.5):
            for server in servers:
                if not server.is_running():
                    fail(f"{server._name} stopped by itself; its log: {server._log_path()}", 1)
    finally:
        for server in reversed(servers):
            server.stop()
        lock.unlink(missing_ok=True)
    if not as_json:
        ok(f"stopped; the data stays in {root}")


#: The pid of the ``outboxkit dev`` using a data directory, in that directory.
LOCK_FILE = "outboxkit-dev.pid"


def _claim(root: Path) -> Path:
    """Refuse a data directory another live ``outboxkit dev`` uses, else mark it ours: two
    would share PostgreSQL's cluster, and stopping its postmaster leaves the other blind."""
    lock = root / LOCK_FILE
    try:
        other = int(lock.read_text().strip())
    except (FileNotFoundError, ValueError):
        other = None
    if other is not None and other != os.getpid() and _alive(other):
        fail(
            f"another `outboxkit dev` (pid {other}) uses {root}: stop it (Ctrl-C in its"
            f" terminal, or `kill {other}`), or give this one another --data-dir",
            2,
        )
    lock.write_text(f"{os.getpid()}\n")
    return lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _announce(found: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(found), nl=True)
        return
    broker = found.get("nats") or found.get("kafka")
    ok(f"PostgreSQL on {found['dsn']} (data in {found['data_dir']})")
    for name in ("nats", "kafka"):
        if name in found:
            ok(f"{'NATS' if name == 'nats' else 'Kafka'} on {found[name]}")
    click.echo("\n# paste into another terminal:")
    click.echo(f"export OUTBOXKIT_DSN={found['dsn']}")
    if broker:
        click.echo(f"export OUTBOXKIT_BROKER={broker}")
    click.echo("\nCtrl-C stops the servers; the data stays for the next `outboxkit dev`.")
