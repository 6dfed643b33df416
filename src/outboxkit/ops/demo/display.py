"""The demo's progress: a live view on a terminal, a line per fault or phase in a CI log."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from outboxkit.ops.demo.report import PathStats


class Display:
    """Shows the two paths' counts and the last notes; keeps every note for the report."""

    def __init__(
        self,
        console: Console,
        *,
        orders: int,
        duration: float,
        naive: PathStats,
        outbox: PathStats,
        backlog: Callable[[], int],
    ) -> None:
        self.console = console
        self.orders = orders
        self.duration = duration
        self.naive = naive
        self.outbox = outbox
        self._backlog = backlog
        self.phase = "starting servers"
        self.notes: list[tuple[float, str]] = []
        self.t0 = time.monotonic()  # start of the order phase, set when it begins
        self.live: Live | None = None

    def elapsed(self) -> float:
        """Seconds since the order phase began (negative before)."""
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        """A line outside the live view (before it starts): server start-up."""
        self.console.print(text, markup=False, highlight=False)

    def note(self, text: str, *, phase: str | None = None) -> None:
        """Record a fault or phase change; without a live display, print it as a line."""
        at = self.elapsed()
        if phase is not None:
            self.phase = phase
        self.notes.append((at, text))
        if self.live is None:
            self.console.print(
                f"[{at:5.1f}s] {text}  (orders naive/outbox {len(self.naive.committed_at)}"
                f"/{len(self.outbox.committed_at)}, delivered {len(self.naive.received_at)}"
                f"/{len(self.outbox.received_at)}, outbox backlog {self._backlog()})",
                markup=False,
                highlight=False,
            )

    def render(self) -> RenderableType:
        head = Text.assemble(
            ("outboxkit demo", "bold"),
            f"  {self.orders} orders per path over {self.duration:g}s   ",
            (f"{max(0.0, self.elapsed()):5.1f}s", "cyan"),
            "   phase: ",
            (self.phase, "bold yellow" if "down" in self.phase else "bold"),
        )
        grid = Table(box=None, padding=(0, 2), show_edge=False)
        grid.add_column("")
        grid.add_column("naive dual write", justify="right")
        grid.add_column("outbox", justify="right")
        grid.add_row(
            "orders committed",
            str(len(self.naive.committed_at)),
            str(len(self.outbox.committed_at)),
        )
        grid.add_row(
            "events delivered", str(len(self.naive.received_at)), str(len(self.outbox.received_at))
        )
        grid.add_row("publish errors (logged, dropped)", str(self.naive.publish_errors), "-")
        grid.add_row("outbox backlog", "-", str(self._backlog()))
        lines = [Text(f"[{at:5.1f}s] {text}", style="dim") for at, text in self.notes[-8:]]
        return Group(head, grid, *lines)

    async def _refresh(self) -> None:
        while True:
            if self.live is not None:
                self.live.update(self.render(), refresh=True)
            await asyncio.sleep(0.25)

    @contextlib.asynccontextmanager
    async def showing(self) -> AsyncIterator[None]:
        """A live view on a terminal; a line per phase change in CI logs."""
        if not self.console.is_terminal:
            yield
            return
        self.live = Live(self.render(), console=self.console, auto_refresh=False)
        self.live.start()
        refresher = asyncio.create_task(self._refresh())
        try:
            yield
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            self.live.update(self.render(), refresh=True)
            self.live.stop()
            self.live = None
