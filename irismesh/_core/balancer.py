"""Choosing a member: least outstanding work, weighted by latency, over two random choices.

Each candidate's cost is `latency_ewma * (outstanding + 1)` (the Peak-EWMA idea of Finagle and
Linkerd): a member ten times slower than its peers looks ten times as loaded for the same queue,
so it gets a small share instead of a third. Comparing two random members rather than all of
them (Mitzenmacher's power of two choices) keeps herds from piling onto whichever member looked
best a moment ago, and costs O(1). Costs within a factor of TIE count as equal, and a member
not yet measured (latency 0) ties with anyone, so new members are sampled at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import Protocol, TypeVar

EWMA_WEIGHT = 0.2  # weight of a new sample
TIE = 1.5  # costs closer than this factor are equal


class Candidate(Protocol):
    outstanding: int
    latency: float


C = TypeVar("C", bound=Candidate)


def cost(member: Candidate) -> float:
    return member.latency * (member.outstanding + 1)


def choose(members: Sequence[C], rng: Random, avoid: object = None) -> C:
    """Pick one of `members` (non-empty); `avoid` loses ties so retries go elsewhere."""
    n = len(members)
    if n == 1:
        return members[0]
    i = int(rng.random() * n)
    j = int(rng.random() * (n - 1))
    if j >= i:
        j += 1
    a, b = members[i], members[j]
    if a is avoid:
        return b
    if b is avoid:
        return a
    if a.latency == 0.0 or b.latency == 0.0:  # not measured yet: measure it
        return a
    cost_a, cost_b = cost(a), cost(b)
    # Costs within TIE of each other are noise (loopback latencies differ by microseconds): the
    # random first choice wins, so alike members share the load instead of one being starved
    # because its first sample happened to be slow.
    if cost_a <= cost_b * TIE and cost_b <= cost_a * TIE:
        return a
    return a if cost_a < cost_b else b


def observe(member: Candidate, sample: float) -> None:
    """Fold a round-trip sample into the member's latency estimate.

    A sample counts for at most twice the estimate: one outlier (a GC pause, a scheduler
    hiccup) then moves the estimate by at most EWMA_WEIGHT, inside the tie band, while a member
    that is really slower still converges (tenfold in about thirteen samples).
    """
    latency = member.latency
    if latency == 0.0:  # the first sample is the estimate
        member.latency = sample
        return
    if sample > 2 * latency:
        sample = 2 * latency
    member.latency = latency + EWMA_WEIGHT * (sample - latency)


PENALTY = 1.5  # a member that turned a request away looks this much slower (per refusal)
PENALTY_FLOOR = 0.001  # the estimate penalised, for a member refusing before it was measured
PENALTY_CAP = 0.25  # seconds: the most a penalty makes a member look; its queue still counts


def penalise(member: Candidate) -> None:
    """The member turned a request away (overloaded): it looks slower, so it gets less of the
    load until its replies bring the estimate back down (each reply moves it EWMA_WEIGHT). The
    cap keeps a member that refused in a burst from being starved afterwards: once its peers
    hold a queue of their own, it costs less than they do again."""
    latency = max(member.latency, PENALTY_FLOOR) * PENALTY
    member.latency = min(latency, max(PENALTY_CAP, member.latency))
