"""Choosing a member: least outstanding work, weighted by latency, over two random choices.

Each candidate's cost is `latency_ewma * (outstanding + 1)` (the Peak-EWMA idea of Finagle and
Linkerd): a member ten times slower than its peers looks ten times as loaded for the same queue,
so it gets a small share instead of a third. Comparing two random members rather than all of
them (Mitzenmacher's power of two choices) keeps herds from piling onto whichever member looked
best a moment ago, and costs O(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import Protocol, TypeVar

EWMA_WEIGHT = 0.2  # weight of a new sample


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
    return a if cost(a) <= cost(b) else b


def observe(member: Candidate, sample: float) -> None:
    member.latency += EWMA_WEIGHT * (sample - member.latency)
