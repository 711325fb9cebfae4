"""Fair turns of the event loop: an awaitable that completes at once still yields now and then.

A publish that finds room, a request refused before it is sent (`NoResponders`, `Overloaded`
by the caller's own throttle, `NoKey`), a tunnel message within its window: each completes
without waiting, and awaiting a coroutine that never waits does not give the event loop a turn.
A coroutine looping on one of them keeps the loop to itself: nothing else on it runs, the
node's own timers and sockets included, so its probes go unanswered and its peers declare it
dead. asyncio's own `StreamWriter.drain()` learnt the same lesson.

`Turns` is one node's account of such completions. Each `spend`s a weight (one, or more for
one that moved many bytes); every `CHECK` units it reads the clock, and once `SLICE` has
passed since the loop last had a turn from it, the completion `pause`s: `asyncio.sleep(0)`,
one turn of the loop, in which due timers and ready I/O run. So a busy caller lets its loop
run at least every `SLICE` plus `CHECK` units of work, and what fairness costs is at most one
extra turn of the loop per `SLICE`, whatever the rate of calls: about 0.1-0.3% of a core.
Calls that wait anyway (a request whose reply is to come) cost nothing here, and a caller
that waited (a publish held back for its subscribers' room) starts its slice again
(`turned`): the loop ran while it waited.
"""

from __future__ import annotations

import asyncio
import time

SLICE = 0.002  # seconds a caller may keep the loop between two turns it gives
CHECK = 32  # units of work between two looks at the clock
BYTES_PER_UNIT = 16 << 10  # a completion that moved this many bytes counts one unit more

_monotonic = time.monotonic


class Turns:
    """When a caller whose calls complete at once should give its event loop a turn."""

    __slots__ = ("_since", "credit", "given")

    def __init__(self) -> None:
        # Units left before the next look at the clock: a hot path may decrement it inline
        # and call `due` when it reaches zero, sparing a method call per message.
        self.credit = CHECK
        self._since = _monotonic()
        self.given = 0  # turns given so far (a node's stats: `loop_turns_given`)

    def spend(self, weight: int = 1) -> bool:
        """Count a completion that did not wait; True: `pause` before returning from it."""
        credit = self.credit - weight
        if credit > 0:
            self.credit = credit
            return False
        return self.due()

    def due(self) -> bool:
        """The credit is spent: start it again, and say whether a turn is due."""
        self.credit = CHECK
        return _monotonic() - self._since >= SLICE

    def turned(self) -> None:
        """The caller waited anyway (for room, for a reply): the loop ran meanwhile, so the
        slice starts again. A publisher that its subscribers' credit holds back every few
        milliseconds is given no turn it does not need."""
        self._since = _monotonic()

    async def pause(self) -> None:
        """Give the loop one turn (raises CancelledError if the caller is cancelled in it)."""
        self.given += 1
        try:
            await asyncio.sleep(0)
        finally:
            self._since = _monotonic()

    async def maybe_pause(self, weight: int = 1) -> None:
        """`spend`, and `pause` if it is time: for the paths where a coroutine call costs
        nothing that matters (a failure, a tunnel message)."""
        if self.spend(weight):
            await self.pause()


def weight_of(size: int) -> int:
    """The units a completion that moved `size` bytes spends."""
    return 1 + size // BYTES_PER_UNIT
