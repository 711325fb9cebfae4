"""Callers that throttle themselves: adaptive throttling per cluster, from the Google SRE book.

A cluster whose members turn requests away (`Overloaded`) or let them time out is saturated:
sending it more only makes its members spend time rejecting. So each caller keeps, per cluster,
two moving counts over the last `window` seconds: the requests that ended (answered, timed out,
turned away, or rejected here) and those a member accepted (answered, with a reply or a
handler's error). Requests count when they end, not when they start, so a burst of requests
sent before the first reply is not mistaken for a cluster that refuses them. While accepts
keep up with requests nothing happens; once requests exceed `K` times the accepts, the caller
rejects new requests itself, at once, with probability

    max(0, (requests - K * accepts) / (requests + 1))

("Handling Overload", client-side throttling, with K = 2: a caller lets through about twice
what the cluster accepts, so it keeps probing for recovered capacity, and drops the rest before
they cost anything). Requests rejected here count as requests, so the probability follows the
cluster down and back up as its accepts change. A caller with fewer than `MIN_REQUESTS` in its
window is never throttled: a handful of failures says little, and the caller's own errors
(timeouts, no responders) then reach it unchanged.

Each priority of a cluster keeps counts of its own (`key`), as the SRE book keeps them per
criticality: a member that turns away low-priority work while it accepts the high-priority
work does not get its callers to throttle the high-priority requests too.

The counts decay exponentially (time constant `window`), computed lazily, so the cost per
request is a dictionary lookup and a few float operations. Decay alone would keep the ratio,
and with it the throttling, long after the cluster recovered (the requests rejected here keep
counting); so once no request to the cluster has ended unanswered for `QUIET` seconds, the
counts start afresh.
"""

from __future__ import annotations

import math
from random import Random

K = 2.0
WINDOW = 10.0  # seconds: how long a caller remembers requests and accepts
MIN_REQUESTS = 20.0  # a caller with fewer requests in its window is never throttled
QUIET = 1.0  # seconds without an unanswered request after which the counts start afresh
_DECAY_EVERY = 0.05  # seconds between two decays of one cluster's counts


def key(cluster: str, priority: int) -> str:
    """What the throttle counts a request under: its cluster, and its priority unless the
    default (a cluster name has no whitespace, so no cluster is called like a class of one)."""
    return f"{cluster} {priority}" if priority else cluster


class _Counts:
    __slots__ = ("accepts", "at", "refused_at", "requests")

    def __init__(self, now: float) -> None:
        self.requests = 0.0
        self.accepts = 0.0
        self.at = now
        self.refused_at = now  # the last request that ended unanswered


class Throttle:
    """One node's adaptive throttle, a pair of counts per cluster it calls."""

    __slots__ = ("_clusters", "_window", "k")

    def __init__(self, k: float = K, window: float = WINDOW) -> None:
        if k < 1.0 or window <= 0:
            raise ValueError("want k >= 1 and a positive window")
        self.k = k
        self._window = window
        self._clusters: dict[str, _Counts] = {}

    def _counts(self, cluster: str, now: float) -> _Counts:
        counts = self._clusters.get(cluster)
        if counts is None:
            if len(self._clusters) >= 4096:  # clusters called long ago go first
                self._clusters.pop(next(iter(self._clusters)))
            counts = self._clusters[cluster] = _Counts(now)
        elif now - counts.at > _DECAY_EVERY:
            factor = math.exp((counts.at - now) / self._window)
            counts.requests *= factor
            counts.accepts *= factor
            counts.at = now
        return counts

    def admit(self, cluster: str, now: float, rng: Random) -> bool:
        """A request to `cluster` is about to go: False if the caller should reject it itself
        (and then it counts as a request that ended unaccepted)."""
        counts = self._counts(cluster, now)
        requests = counts.requests
        if requests < MIN_REQUESTS:
            return True
        if now - counts.refused_at > QUIET:  # the cluster answers again: start afresh
            counts.requests = counts.accepts = 0.0
            return True
        excess = requests - self.k * counts.accepts
        if excess <= 0.0 or rng.random() >= excess / (requests + 1.0):
            return True
        counts.requests = requests + 1.0
        return False

    def accepted(self, cluster: str, now: float) -> None:
        """A member of `cluster` answered a request."""
        counts = self._counts(cluster, now)
        counts.requests += 1.0
        counts.accepts += 1.0

    def refused(self, cluster: str, now: float) -> None:
        """A request to `cluster` ended unanswered: it timed out, or was turned away."""
        counts = self._counts(cluster, now)
        counts.requests += 1.0
        counts.refused_at = now

    def probability(self, cluster: str) -> float:
        """The probability of rejecting the next request to `cluster` now."""
        counts = self._clusters.get(cluster)
        if counts is None or counts.requests < MIN_REQUESTS:
            return 0.0
        excess = counts.requests - self.k * counts.accepts
        return max(0.0, excess / (counts.requests + 1.0))
