"""Admission at the member: how many handlers run at once, which requests wait, which are shed.

Theory of operation
-------------------
Every request carries the time its caller has left: its budget, which the member turns into a
deadline of its own clock when the request arrives. A handler started after that deadline, or
too late to finish before it, is wasted work: nobody waits for its reply. Under overload such
work makes every later request late as well, until nothing is answered in time. So a member
admits work only while it can finish it in time, and turns the rest away early and cheaply with
`Overloaded`, which tells the caller to go elsewhere or back off. Three parts:

Concurrency. At most `limit` handlers run at once, and the limit is found by measuring, with
the gradient method of Netflix's concurrency-limits: the latency of each handler run is compared
with the best latency seen lately; while they stay within `TOLERANCE` of each other the limit
grows by about its square root per run, and when runs slow down (the handlers now queue for the
CPU, a database, a lock) the limit shrinks in proportion. A handler that runs inline on the
event loop counts as running while it runs; handlers declared blocking run in a thread pool,
whose size caps the limit.

Queue. Requests beyond the limit wait, at most `max_queue` of them. A request is rejected on
arrival (reason "queue") when the requests ahead of it, at the measured service rate, would
leave it too little budget to be served. A queue that has not emptied for `standing` seconds
(CoDel's test of a standing queue, with CoDel's 100 ms interval) means overload rather than a
burst, and two things change, as in Facebook's "Fail at Scale": a newcomer is also rejected
when it would wait longer than `standing`, however long its budget, so the member turns the
excess away at once instead of building a backlog that outlives the overload; and the queue is
served last in, first out, so what is served is served quickly, while the backlog built before
the queue was known to stand waits its turn or its deadline. A young queue is first in, first
out: a burst waits its turn if its budget allows. Whatever waits, a request whose remaining
budget no longer covers the service time is shed before it starts (reason "deadline"), and is
never started.

Priority. Each waiting request carries a priority (`priority`: higher is more important, 0
the default), and each priority waits in a queue of its own, in the order above. A take serves
the highest class that waits, with one exception that keeps the lower classes from starving:
after `SHARE_EVERY` - 1 starts in a row from the highest class while a lower one waited, the
next start goes to the class whose oldest request came first (under a flood of important
work, a lower one; the highest class's own, when older, as the highest changes while classes
empty). So every request starts within `SHARE_EVERY` starts per request older than it, and
under a flood of important work the lesser still gets one handler run in `SHARE_EVERY`,
while an important request waits behind at most one lesser run per `SHARE_EVERY` - 1 of its
own class (a weighted dequeue; aging alone would not do: a request's deadline, which sheds it,
comes long before any age that would lift it above a busy higher class). A request's expected
wait counts only the requests it will not overtake (its own class and higher, and the lower
share), so a flood of low-priority work does not get a high-priority newcomer turned away; and
when the queue is full, the least important, oldest waiting request makes room for a more
important newcomer (`_victim`). Low priority is thereby shed first.

Everything here is pure: the caller passes the clock, and gets back what to start and what to
reject (with the reason, which names the counter `requests_shed_<reason>`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Generic, TypeVar

from irismesh._core.plain import Plain

T = TypeVar("T")

TOLERANCE = 2.0  # latency up to this multiple of the best lately counts as unloaded
SMOOTHING = 0.2  # weight of one run in the limit's moving average
SERVICE_WEIGHT = 0.1  # weight of one run in the service-time estimate
LONG_WEIGHT = 0.01  # weight of one run in the long-term latency (the "best lately")


SHARE_EVERY = 8  # under contention, one start in this many goes to a lower class


class Waiting(Plain):
    """A request admitted to the queue (its item is the runner's: untyped here so that the
    class compiles as a native one)."""

    item: Any
    deadline: float
    arrived: float
    criticality: int  # its priority
    order: int  # when it came, among the requests offered (clock readings may tie)

    def __init__(
        self, item: Any, deadline: float, arrived: float, criticality: int = 0, order: int = 0
    ) -> None:
        self.item, self.deadline, self.arrived = item, deadline, arrived
        self.criticality, self.order = criticality, order


class Admission(Generic[T]):
    """One member's admission: its concurrency limit and its queues, one per priority."""

    def __init__(
        self,
        *,
        initial_limit: int = 8,
        min_limit: int = 1,
        max_limit: int = 256,
        max_queue: int = 4096,
        standing: float = 0.1,
    ) -> None:
        if not 1 <= min_limit <= initial_limit <= max_limit:
            raise ValueError("want 1 <= min_limit <= initial_limit <= max_limit")
        self.limit = float(initial_limit)
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.max_queue = max_queue
        self.standing = standing
        self.running = 0
        self.waiting = 0  # requests in the queues, all classes
        # Priority -> its waiting requests in arrival order; only classes with some.
        self.queues: dict[int, deque[Waiting]] = {}
        self.levels: list[int] = []  # the keys of `queues`, highest first
        self.service = 0.0  # moving average of a handler run, seconds (0: none measured yet)
        self._long = 0.0  # long-term average latency, the gradient's reference
        self._nonempty_since: float | None = None  # when the queue last stopped being empty
        self._streak = 0  # starts in a row from the highest class while a lower one waited
        self._offered = 0  # requests queued so far: their arrival order

    @property
    def queue(self) -> list[Waiting]:
        """Every waiting request, highest class first (each class in arrival order)."""
        return [w for level in self.levels for w in self.queues[level]]

    @property
    def can_start(self) -> bool:
        return self.running < self.limit

    def standing_queue(self, now: float) -> bool:
        """Whether the queue has not emptied for `standing` seconds: overload, not a burst."""
        since = self._nonempty_since
        return since is not None and now - since >= self.standing

    def ahead(self, priority: int) -> int:
        """How many of the waiting requests a newcomer of `priority` would wait for: those of
        its class and higher, and the lower classes' share of the starts meanwhile."""
        if not self.waiting:
            return 0
        levels = self.levels
        if priority <= levels[-1]:
            return self.waiting
        higher = 0
        for level in levels:
            if level < priority:
                break
            higher += len(self.queues[level])
        return higher + min(self.waiting - higher, higher // (SHARE_EVERY - 1) + 1)

    def offer(
        self,
        item: T,
        deadline: float,
        now: float,
        shed: list[tuple[T, str]],
        criticality: int = 0,
        *,
        may_start: bool = True,
    ) -> str | None:
        """A request arrived: None if it may start now (the caller starts it and calls
        `started`), "queued" if it waits, else the reason it is rejected. A full queue makes
        room by shedding (into `shed`) a waiting request that matters less. Not `may_start`
        (the caller's turn is over), it waits in any case. `criticality` is its priority."""
        service = self.service
        if now + service >= deadline:
            return "deadline"
        if not self.waiting and self.running < self.limit and may_start:
            return None
        ahead = self.ahead(criticality) if self.waiting else 0
        wait = ahead * service / max(1.0, min(self.limit, float(self.running)))
        if now + wait + service >= deadline:
            return "queue"
        if wait >= self.standing and self.standing_queue(now):
            return "queue"
        if self.waiting >= self.max_queue:
            victim = self._victim()
            if victim is None or victim.criticality >= criticality:
                return "queue"
            self._drop(victim)
            shed.append((victim.item, "queue"))
        if not self.waiting:
            self._nonempty_since = now
        queue = self.queues.get(criticality)
        if queue is None:
            queue = self.queues[criticality] = deque()
            self.levels.append(criticality)
            self.levels.sort(reverse=True)
        self._offered += 1
        queue.append(Waiting(item, deadline, now, criticality, self._offered))
        self.waiting += 1
        return "queued"

    def take(self, now: float, shed: list[tuple[T, str]]) -> T | None:
        """The next request to start, if the limit allows one and one is waiting; requests
        that can no longer be served in time are appended to `shed` with their reason."""
        service = self.service
        while self.waiting and self.running < self.limit:
            levels = self.levels
            top = levels[0]
            level = top
            contended = len(levels) > 1  # a lower class waits too
            if contended and self._streak >= SHARE_EVERY - 1:
                level = self._oldest_class()
            queue = self.queues[level]
            entry = queue.pop() if self.standing_queue(now) else queue.popleft()
            self._taken(level, queue)
            if now + service >= entry.deadline:
                shed.append((entry.item, "deadline"))
                continue
            if level != top or not contended:
                self._streak = 0
            else:
                self._streak += 1
            item: T = entry.item
            return item
        return None

    def expire(self, now: float, shed: list[tuple[T, str]]) -> None:
        """Shed what waits past its deadline without being taken (the limit is full)."""
        if not self.waiting:
            return
        service = self.service
        for level in list(self.levels):
            queue = self.queues[level]
            kept = [w for w in queue if now + service < w.deadline]
            if len(kept) != len(queue):
                shed.extend((w.item, "deadline") for w in queue if now + service >= w.deadline)
                self.waiting -= len(queue) - len(kept)
                queue.clear()
                queue.extend(kept)
                if not queue:
                    self._forget(level)
        if not self.waiting:
            self._nonempty_since = None

    def remove(self, item: T) -> bool:
        """A waiting request was cancelled by its caller: it leaves the queue."""
        for level in self.levels:
            for entry in self.queues[level]:
                if entry.item is item:
                    self._drop(entry)
                    return True
        return False

    def clear(self) -> list[Waiting]:
        """Empty the queues; returns what waited."""
        waiting = self.queue
        self.queues.clear()
        self.levels.clear()
        self.waiting = 0
        self._nonempty_since = None
        return waiting

    def started(self) -> None:
        self.running += 1

    def finished(self, latency: float) -> None:
        """A handler run ended after `latency` seconds: measure, and move the limit."""
        self.running -= 1
        if self.service == 0.0:
            self.service = self._long = latency
            return
        self.service += SERVICE_WEIGHT * (latency - self.service)
        self._long += LONG_WEIGHT * (latency - self._long)
        if self._long > 2 * self.service:  # recovered from a slow period: forget it sooner
            self._long = 2 * self.service
        gradient = max(0.5, min(1.0, TOLERANCE * self._long / max(self.service, 1e-9)))
        wanted = self.limit * gradient + math.sqrt(self.limit)
        limit = self.limit + SMOOTHING * (wanted - self.limit)
        self.limit = max(float(self.min_limit), min(float(self.max_limit), limit))

    def _victim(self) -> Waiting | None:
        """The waiting request to shed first when room is needed: the least important, and
        among those the oldest."""
        if not self.waiting:
            return None
        return self.queues[self.levels[-1]][0]

    def _oldest_class(self) -> int:
        """The class whose oldest request came first: every request older than a given one
        is served by such starts before it, so none waits for ever."""
        levels = self.levels
        best, order = levels[0], self.queues[levels[0]][0].order
        for level in levels[1:]:
            first = self.queues[level][0].order
            if first < order:
                best, order = level, first
        return best

    def _drop(self, entry: Waiting) -> None:
        """`entry` leaves the queue unstarted (shed to make room, or cancelled)."""
        queue = self.queues[entry.criticality]
        queue.remove(entry)
        self._taken(entry.criticality, queue)

    def _taken(self, level: int, queue: deque[Waiting]) -> None:
        self.waiting -= 1
        if not queue:
            self._forget(level)
        if not self.waiting:
            self._nonempty_since = None

    def _forget(self, level: int) -> None:
        del self.queues[level]
        self.levels.remove(level)
