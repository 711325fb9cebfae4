"""Lifeguard's suspicion timeout and local health: how long to wait, and how much to trust
our own judgement.

A suspected node is declared dead when its suspicion times out. The timeout starts at `maximum`
and shrinks towards `minimum` as *independent* confirmations arrive (other nodes that suspect it
too), logarithmically, reaching `minimum` after `expected` of them: a node many others cannot
reach is declared dead quickly, one that only we cannot reach gets time to refute. Both bounds
grow with log N, since dissemination (and so refutation) takes about log N rounds.

The local health multiplier (`Awareness`) is Lifeguard's answer to the slow detector: a node
whose own probes fail, whose expected nacks do not come, or that has to refute suspicions about
itself is probably the slow one (an overloaded loop, a lossy link). It scales its probe
intervals and timeouts up by (score + 1), so that it stops accusing healthy peers; successful
probes bring the score back down.
"""

from __future__ import annotations

import math


def suspicion_bounds(
    multiplier: float, max_multiplier: float, members: int, interval: float
) -> tuple[float, float]:
    """(minimum, maximum) timeout: multiplier x log10(max(members, 10)) x interval, and
    max_multiplier times that."""
    minimum = multiplier * math.log10(max(members, 10)) * interval
    return minimum, max_multiplier * minimum


class Suspicion:
    """One suspected node: who suspects it and when it will be declared dead."""

    __slots__ = (
        "_confirmers",
        "deadline",
        "expected",
        "incarnation",
        "maximum",
        "minimum",
        "start",
    )

    def __init__(
        self,
        *,
        incarnation: int,
        start: float,
        minimum: float,
        maximum: float,
        expected: int,
        first: bytes,
    ) -> None:
        self.incarnation = incarnation
        self.start = start
        self.minimum = minimum
        self.maximum = maximum
        self.expected = expected
        self._confirmers = {first}
        self.deadline = start + (minimum if expected < 1 else maximum)

    @property
    def confirmations(self) -> int:
        """Independent suspicions beyond the first."""
        return len(self._confirmers) - 1

    def confirm(self, by: bytes) -> bool:
        """Another node suspects it too; True if that was news (the timeout may shrink)."""
        if by in self._confirmers or self.confirmations >= self.expected:
            return False
        self._confirmers.add(by)
        fraction = math.log(self.confirmations + 1) / math.log(self.expected + 1)
        timeout = max(self.minimum, self.maximum - (self.maximum - self.minimum) * fraction)
        self.deadline = self.start + timeout
        return True


class Awareness:
    """The local health multiplier: 0 is healthy, `limit` - 1 the worst."""

    __slots__ = ("limit", "score")

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(max(self.score + delta, 0), self.limit - 1)

    def scale(self, seconds: float) -> float:
        return seconds * (self.score + 1)
