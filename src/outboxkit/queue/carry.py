"""A claim that carries the settle of the claim before it: one statement a cycle, not two.

At the steady rates production runs, a claim finds a few items, and each cycle cost the
database two statements and two commits (the claim, then the settle of what it published),
each about as dear for 5 items as for 500. While the loop waits to look again (the gather
window, the linger's looks), the settle of a claim published whole is parked here, and the
claim that ends the wait settles it in its own statement (``ClaimsSettling``). Never held
longer than the wait: only a wait that ends in a claim takes one, and a settle offered at
any other time runs on its own as before. The commit → broker latency is not touched: the
items were published before their settle was offered.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from outboxkit.queue.store import Attempted, Claim, ClaimsSettling, Settled

T = TypeVar("T", bound=Attempted)

#: What a parked settle learns: its result, or None to run on its own (the claim failed,
#: or the loop stopped before claiming).
Carried = asyncio.Future[Settled | None]


class SettleCarry(Generic[T]):
    """At most one parked settle, taken by the next claim (the loop opens it for a wait)."""

    def __init__(self, store: ClaimsSettling[T], room: Callable[[], bool]) -> None:
        self.store = store
        #: Whether the next claim can start with the parked settle still holding its
        #: in-flight slot (a free slot besides the offering claim's): without one, the
        #: claim would wait for the very settle it is to carry.
        self.room = room
        self._open = False
        self._parked: tuple[Claim[T], Carried] | None = None

    def open(self) -> None:
        """The loop waits, then claims: a settle offered meanwhile rides on that claim."""
        self._open = True

    def offer(self, claim: Claim[T]) -> Carried | None:
        """Park ``claim``'s settle (every item done) for the next claim; None: settle it now."""
        if not self._open or self._parked is not None or not self.room():
            return None
        future: Carried = asyncio.get_running_loop().create_future()
        self._parked = (claim, future)
        return future

    def flush(self) -> None:
        """No claim follows: the parked settle (if any) runs on its own."""
        self._open = False
        parked, self._parked = self._parked, None
        if parked is not None and not parked[1].done():
            parked[1].set_result(None)

    async def claim(
        self,
        plain: Callable[[], Awaitable[Claim[T] | None]],
        *,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
    ) -> Claim[T] | None:
        """The next claim: ``plain()``, or the store's claim carrying the parked settle."""
        self._open = False
        parked, self._parked = self._parked, None
        if parked is None:
            return await plain()
        carried, future = parked
        try:
            claim, settled = await self.store.claim_settling(
                carried, limit=limit, lease=lease, token=token, owner=owner,
                max_attempts=max_attempts,
            )  # fmt: skip
        except BaseException:
            if not future.done():
                future.set_result(None)  # the statement settled nothing: it settles alone
            raise
        if not future.done():
            future.set_result(settled)
        return claim
