"""The demo's result: what each write path committed and delivered, as JSON and as a table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

VICTIM = "relay-a"  # the relay the scenario SIGKILLs: its exit code is not checked


@dataclass
class PathStats:
    """What one write path did, by event id: when it committed, when it arrived."""

    committed_at: dict[str, float] = field(default_factory=dict)
    received_at: dict[str, float] = field(default_factory=dict)
    delivered_orders: set[int] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    redeliveries: int = 0  # copies the consumer's dedup dropped
    publish_errors: int = 0  # naive only: publishes that failed, logged and forgotten


@dataclass
class PathResult:
    committed: int
    delivered: int
    lost: int
    duplicates_absorbed: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "delivered": self.delivered,
            "lost": self.lost,
            "duplicates_absorbed": self.duplicates_absorbed,
            "latency_p50_ms": self.latency_p50_ms,
            "latency_p99_ms": self.latency_p99_ms,
            **self.extra,
        }


def path_result(stats: PathStats, orders: set[int], broker_dups: int) -> PathResult:
    """Compare the orders committed on a path with the events its consumer received."""
    latencies = [
        max(0.0, at - stats.committed_at[e])
        for e, at in stats.received_at.items()
        if e in stats.committed_at
    ]
    return PathResult(
        committed=len(orders),
        delivered=len(stats.received_at),
        lost=len(orders - stats.delivered_orders),
        duplicates_absorbed=stats.redeliveries + broker_dups,
        latency_p50_ms=_ms(_percentile(latencies, 0.50)),
        latency_p99_ms=_ms(_percentile(latencies, 0.99)),
    )


def build_report(
    *,
    naive: PathStats,
    outbox: PathStats,
    committed: dict[str, set[int]],
    dead_letters: int,
    kill: dict[str, Any],
    relay_codes: dict[str, int | None],
    relays: tuple[str, ...],
    notes: list[tuple[float, str]],
    orders: int,
    duration: float,
    runtime_s: float,
    server_start_s: float,
    broker: str,
) -> dict[str, Any]:
    """The JSON object `outboxkit demo --json` prints; `ok` is true iff the outbox lost nothing."""
    naive_result = path_result(naive, committed["naive"], 0)
    naive_result.extra = {"publish_errors": naive.publish_errors}
    republished = int(kill.get("already_published", 0))
    outbox_result = path_result(outbox, committed["outbox"], republished)
    outbox_result.extra = {
        "dead_lettered": dead_letters,
        "duplicates_dropped_by_broker": republished,
        "duplicates_dropped_by_consumer": outbox.redeliveries,
    }
    relays_ok = all(relay_codes.get(n) == 0 for n in relays if n != VICTIM)
    ok = (
        outbox_result.lost == 0
        and outbox_result.committed > 0
        and outbox_result.delivered == outbox_result.committed
        and relays_ok
    )
    return {
        "ok": ok,
        "orders_per_path": orders,
        "duration_s": duration,
        "runtime_s": round(runtime_s, 1),
        "server_start_s": round(server_start_s, 1),
        "broker": broker,
        "naive": naive_result.as_dict(),
        "outbox": outbox_result.as_dict(),
        "faults": [{"at_s": round(at, 2), "event": text} for at, text in notes],
        "relay_kill": kill,
        "relay_exit_codes": relay_codes,
    }


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def print_table(console: Console, report: dict[str, Any]) -> None:
    """The comparison table and what it means, for a person at a terminal."""
    naive, outbox = report["naive"], report["outbox"]
    table = Table(title="naive dual write vs transactional outbox", title_justify="left")
    table.add_column("")
    table.add_column("naive dual write", justify="right")
    table.add_column("outbox", justify="right")
    table.add_row("orders committed", str(naive["committed"]), str(outbox["committed"]))
    table.add_row("events delivered", str(naive["delivered"]), str(outbox["delivered"]))
    table.add_row(
        "lost",
        f"[bold red]{naive['lost']}[/]" if naive["lost"] else "0",
        f"[bold red]{outbox['lost']}[/]" if outbox["lost"] else "[bold green]0[/]",
    )
    table.add_row(
        "duplicates absorbed",
        str(naive["duplicates_absorbed"]),
        str(outbox["duplicates_absorbed"]),
    )
    table.add_row("latency p50 (ms)", _fmt(naive["latency_p50_ms"]), _fmt(outbox["latency_p50_ms"]))
    table.add_row("latency p99 (ms)", _fmt(naive["latency_p99_ms"]), _fmt(outbox["latency_p99_ms"]))
    console.print()
    console.print(table)
    mark = "[bold green]✓[/]" if report["ok"] else "[bold red]✗[/]"
    console.print(
        f"{mark} naive dual write lost {naive['lost']} of {naive['committed']} events;"
        f" outbox lost {outbox['lost']} of {outbox['committed']}",
        highlight=False,
    )
    if outbox["duplicates_absorbed"]:
        console.print(
            f"  duplicates: {outbox['duplicates_dropped_by_broker']} re-published after the"
            " killed relay's lease expired (dropped by the broker's Nats-Msg-Id dedup),"
            f" {outbox['duplicates_dropped_by_consumer']} redelivered (dropped by the consumer)",
            highlight=False,
        )
    console.print(
        "  outbox p99 includes the events that waited out the outage; the naive path has"
        " no such tail because it lost them",
        style="dim",
        highlight=False,
    )
    if outbox["dead_lettered"]:
        console.print(f"[red]  {outbox['dead_lettered']} event(s) dead-lettered[/]")
    for name, code in report["relay_exit_codes"].items():
        if name != VICTIM and code != 0:
            console.print(f"[red]  {name} exited with {code} on SIGTERM (expected 0)[/]")
    console.print(
        f"  runtime {report['runtime_s']:.1f}s (server start-up {report['server_start_s']:.1f}s)",
        style="dim",
        highlight=False,
    )
    if "relay_logs" in report:
        console.print(f"  relay logs: {report['relay_logs']}", markup=False, highlight=False)
