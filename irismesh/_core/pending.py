"""The caller's table of requests in flight, with their deadlines.

A request stays here from `add` until its reply, its failure, or its deadline. Its `link` is
the link it was last sent on; when that link dies the engine resends it elsewhere with the
same id (so the member's reply cache can spot a duplicate), or parks it (`link is None`)
until a member appears or the deadline passes. Deadlines sit in a heap with lazy deletion:
finished requests leave their heap entry behind, popped when it surfaces or compacted away
once stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from irismesh._core.links import OutLink


class PendingRequest:
    """One request in flight. A plain class, not a dataclass: compiled, a dataclass's
    generated `__init__` stays interpreted (a fifth of the caller's core per request)."""

    __slots__ = (
        "attempts",
        "cluster",
        "deadline",
        "hedge_at",
        "hedged",
        "kind",
        "link",
        "payload",
        "pinned",
        "priority",
        "refused",
        "req_id",
        "sent_at",
        "timeout",
        "trace",
    )

    def __init__(
        self,
        req_id: int,
        cluster: str,
        payload: bytes,
        deadline: float,
        timeout: float,
        sent_at: float,
        link: OutLink | None,
        attempts: int = 1,
        kind: int = 5,  # Kind.REQUEST, BROADCAST, SURVEY or JOB
        pinned: bool = False,  # meant for one member (broadcast, survey): never resent elsewhere
        hedged: OutLink | None = None,  # a second copy in flight there (hedged requests)
        hedge_at: float = float("inf"),
        refused: list[bytes] | None = None,  # members that turned it away unrun
        priority: int = 0,  # higher is more important (`priority`)
        trace: bytes | None = None,  # the caller's trace context, sent with every copy
    ) -> None:
        self.req_id = req_id
        self.cluster = cluster
        self.payload = payload
        self.deadline = deadline
        self.timeout = timeout
        self.sent_at = sent_at
        self.link = link
        self.attempts = attempts
        self.kind = kind
        self.pinned = pinned
        self.hedged = hedged
        self.hedge_at = hedge_at
        self.refused: list[bytes] = [] if refused is None else refused
        self.priority = priority
        self.trace = trace

    def __repr__(self) -> str:
        return f"PendingRequest(req_id={self.req_id}, cluster={self.cluster!r})"


class PendingRequests:
    __slots__ = ("_heap", "_hedges", "by_id")

    def __init__(self) -> None:
        self.by_id: dict[int, PendingRequest] = {}
        self._heap: list[tuple[float, int]] = []
        self._hedges: list[tuple[float, int]] = []  # when to send a hedged request's copy

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[PendingRequest]:
        return iter(list(self.by_id.values()))

    def add(self, request: PendingRequest) -> None:
        self.by_id[request.req_id] = request
        heap = self._heap
        heapq.heappush(heap, (request.deadline, request.req_id))
        if len(heap) > 1024 and len(heap) > 4 * len(self.by_id):
            self._heap = [(r.deadline, r.req_id) for r in self.by_id.values()]
            heapq.heapify(self._heap)

    def pop(self, req_id: int) -> PendingRequest | None:
        return self.by_id.pop(req_id, None)

    def get(self, req_id: int) -> PendingRequest | None:
        return self.by_id.get(req_id)

    def add_hedge(self, request: PendingRequest) -> None:
        heapq.heappush(self._hedges, (request.hedge_at, request.req_id))

    def pop_hedges(self, now: float) -> list[PendingRequest]:
        due = []
        hedges = self._hedges
        while hedges and hedges[0][0] <= now:
            _at, req_id = heapq.heappop(hedges)
            request = self.by_id.get(req_id)
            if request is not None and request.hedged is None:
                due.append(request)
        return due

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and heap[0][1] not in self.by_id:
            heapq.heappop(heap)
        hedges = self._hedges
        while hedges and hedges[0][1] not in self.by_id:
            heapq.heappop(hedges)
        times = [h[0][0] for h in (heap, hedges) if h]
        return min(times) if times else None

    def pop_expired(self, now: float) -> list[PendingRequest]:
        expired = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _deadline, req_id = heapq.heappop(heap)
            request = self.by_id.pop(req_id, None)
            if request is not None:
                expired.append(request)
        return expired
