"""Busy polling only where it pays: whether to spin for the next message or sleep in the loop.

`Node(busy_poll=seconds)` lets a caller poll for the reply to a lone request, and a member for
the next request, instead of sleeping in the event loop until the socket wakes it: that saves
the loop's wake-up, at the cost of a core while it spins. It pays only when what it waits for
comes soon, and only when the spinning thread does not take the core that the message needs
to arrive (the peer itself on the same machine, and zmq's I/O thread where links run on zmq).
Measured on a 2-core machine, a caller spinning alone shortened its round trips, while a
caller and a member both spinning made them about six times longer.

So each side decides from what it measured (`Spin`): it waits in runs of one way or the other
and keeps the typical wait each way. A caller spins while the replies it waits for come within
`busy_poll`; a member spins unless sleeping is clearly quicker or requests come further apart
than `busy_poll`, and spends one run in `EXPLORE` the other way to keep both figures current.
So a member whose requests come seconds apart never spins, and where a caller and a member
spin against each other on too few cores the member finds that sleeping is quicker and stops.
With fewer cores than the threads that must run at once while it spins (the spinning one and
the peer, or zmq's I/O thread), neither ever spins. What spinning cost is counted (see `Spin`),
in `Node.stats`: `busy_poll_replies_*` for a caller, `busy_poll_requests_*` for a member.
"""

from __future__ import annotations

import os
from collections import Counter

RUN = 32  # waits decided one way in a row, timed together (the first few not counted)
SETTLE = 8  # the first waits of a run, not counted: the scheduler settles into the new way
EXPLORE = 8  # one run in this many goes the way the figures do not prefer
# Sleeping is preferred only when it is clearly the quicker (by this share): busy polling was
# asked for, and on a busy machine two runs of the same way differ by more than spinning saves.
MARGIN = 0.2
_MIN_SPIN = 50e-6  # the shortest spin worth starting, seconds


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Spin:
    """Whether to spin for the next wait (`budget`), learning from each wait (`observe`).

    Waits are decided in runs of `RUN` the same way: a spinning thread and the threads it
    competes with settle onto cores only after a few rounds, so single waits the other way
    would measure the wrong thing (a lone spin on a busy 2-core machine mostly starves its
    own zmq I/O thread). `spinning` and `sleeping` are the median waits of the runs each way,
    each run's averaged with those before (half and half). It spins unless what it waits for
    comes too late to catch (beyond the limit) or, with `compare`, sleeping was clearly
    quicker (`MARGIN`); it spends one run in `EXPLORE` the other way (with `compare`; without,
    only to see whether waits too long to catch have become short).

    A member compares (its spinning can take the core its callers need); a caller does not:
    a caller alone spinning on a busy 2-core machine was quicker than sleeping in every
    sitting, and each run spent sleeping to compare unsettled the cores for the runs after
    it. Where both spin against each other, the member's comparison stops the member.

    `limit` is the longest spin (`Node(busy_poll=...)`); `busy_threads` the threads that must
    run at the same time as the spinning one for what it waits for to arrive, counting itself.
    The counters, in `stats` under `prefix`: `_spins` (waits it spun for), `_caught` (spins
    that got what they waited for), `_spun_us` (microseconds spent spinning, the cost: a whole
    core for that long), `_slept` (waits it did not spin for)."""

    __slots__ = (
        "_caught",
        "_left",
        "_runs",
        "_slept",
        "_spins",
        "_spun_us",
        "_waits",
        "compare",
        "enabled",
        "limit",
        "mode",
        "sleeping",
        "spinning",
        "stats",
    )

    def __init__(
        self,
        limit: float,
        stats: Counter[str],
        prefix: str,
        *,
        compare: bool = True,
        busy_threads: int = 2,
        available: int | None = None,
    ) -> None:
        self.limit = limit
        self.enabled = limit > 0 and (cores() if available is None else available) >= busy_threads
        self.compare = compare
        self.spinning = 0.0  # the typical wait (seconds) of the runs spent spinning (0: none)
        self.sleeping = 0.0  # ... and of the runs spent sleeping
        self.mode = True  # this run spins
        self._left = RUN  # waits left in this run
        self._waits: list[float] = []  # the waits of this run timed so far
        self._runs = 0
        self.stats = stats
        self._spins = prefix + "_spins"
        self._caught = prefix + "_caught"
        self._spun_us = prefix + "_spun_us"
        self._slept = prefix + "_slept"

    def budget(self) -> float:
        """Seconds to spin for the next wait; 0.0: sleep in the loop."""
        if not self.enabled:
            return 0.0
        if self._left <= 0:
            self._next_run()
        self._left -= 1
        if not self.mode:
            self.stats[self._slept] += 1
            return 0.0
        self.stats[self._spins] += 1
        spinning = self.spinning
        if spinning == 0.0 or not self.compare:
            return self.limit
        return min(self.limit, max(2 * spinning, _MIN_SPIN))

    def _next_run(self) -> None:
        waits = self._waits
        if waits:  # the median: a busy machine's stalls would swing a mean
            waits.sort()
            middle = waits[len(waits) // 2]
            # ... and averaged with the runs before, which a busy machine swings too
            if self.mode:
                self.spinning = middle if not self.spinning else (self.spinning + middle) / 2
            else:
                self.sleeping = middle if not self.sleeping else (self.sleeping + middle) / 2
        self._waits, self._left = [], RUN
        self._runs += 1
        limit, spinning, sleeping = self.limit, self.spinning, self.sleeping
        explore = self._runs % EXPLORE == 0
        if spinning == 0.0:
            self.mode = True  # not tried yet
        elif not self.compare:
            # Now and then a spin where waits too long to catch may have become short.
            self.mode = spinning <= limit or (explore and sleeping <= 2 * limit)
        elif sleeping == 0.0:
            self.mode = False
        else:
            spin = spinning <= limit and sleeping >= spinning * (1 - MARGIN)
            if explore:
                # Now and then a run the other way, so that a change (a slower member, a
                # busier machine) is seen; spinning only where what it waits for could come
                # in time.
                spin = not spin and sleeping <= 2 * limit
            self.mode = spin

    def spun(self, seconds: float, caught: bool) -> None:
        """A spin of `seconds` ended, with what it waited for or without."""
        self.stats[self._spun_us] += int(seconds * 1e6)
        if caught:
            self.stats[self._caught] += 1

    def observe(self, spun: bool, wait: float) -> None:
        """A wait took `wait` seconds, spinning (for at least part of it) or not."""
        if spun is self.mode and self._left < RUN - SETTLE:
            self._waits.append(wait)
