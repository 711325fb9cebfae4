"""Choosing a member: least outstanding work, weighted by latency, over two random choices.

Each candidate's cost is `latency_ewma * (outstanding + 1)` (the Peak-EWMA idea of Finagle and
Linkerd): a member ten times slower than its peers looks ten times as loaded for the same queue,
so it gets a small share instead of a third. Comparing two random members rather than all of
them (Mitzenmacher's power of two choices) keeps herds from piling onto whichever member looked
best a moment ago, and costs O(1). Costs within a factor of TIE count as equal, and a member
not yet measured (latency 0) ties with anyone, so new members are sampled at once.

Decay. An estimate moves only when a reply arrives, and a member that looks slow gets few
requests, so without more a member whose estimate rose (a slow spell, a burst of error replies,
which count too) could stay starved long after it recovered, its peers idle. So an estimate
counts for less the longer no reply has refreshed it (`latency_at`), and for nothing after
DECAY seconds: when `choose` compares two members, the higher estimate of an idle member (no
request in flight) drifts linearly toward the other's, reaching it at DECAY, so a member
starved since its last reply is probed again within DECAY at any ratio of estimates (an
exponential decay, Finagle's, takes DECAY times the logarithm of the ratio). `observe` then
weighs the probe's sample by the same age (Finagle's decay toward new samples): after DECAY
the sample replaces the stale estimate, so a member that recovered gets its share back at
once, while one still slow is starved again until its next probe, one request per DECAY.
The other member of the pair is the target, rather than a median of the cluster, because
only the ratio of the two costs decides, and it keeps the pick O(1) and free of allocation.

One sample is weak evidence. A member's first reply may be slow for reasons that are not its
own (a pause of the caller's process, a cold cache, a busy machine as nodes start together), so
an estimate made of that one sample starts FIRST_SAMPLE_AGE old: it decays within DECAY -
FIRST_SAMPLE_AGE (2 s), and the second sample, weighed by that age, mostly replaces it. A member
really slow pays one more probe; one slow only at its first reply is back in rotation within
2 s instead of 10.

Under steady load nothing changes: a member with requests in flight does not decay (it is
busy, not forgotten, and a probe in flight keeps the next requests off a member still slow),
and replies refresh estimates every few milliseconds, against a DECAY of seconds. DECAY is
10 s, Finagle's and Linkerd's default. It bounds how long a member that recovered waits for a
light caller's requests (at most DECAY after its last reply: the scale on which an ejected
member is readmitted, 5 to 30 s), and what probing a member still slow costs (one request per
DECAY per caller). Much shorter, and the probes of a slow member become a share of the load.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random
from typing import Protocol, TypeVar

EWMA_WEIGHT = 0.2  # weight of a new sample
TIE = 1.5  # costs closer than this factor are equal
DECAY = 10.0  # seconds: an estimate no reply has refreshed for this long counts for nothing
FIRST_SAMPLE_AGE = 0.8 * DECAY  # how stale an estimate made of one sample starts


class Candidate(Protocol):
    outstanding: int
    latency: float
    latency_at: float  # when a reply (or a refusal) last refreshed `latency`


C = TypeVar("C", bound=Candidate)


def cost(member: Candidate) -> float:
    return member.latency * (member.outstanding + 1)


def choose(members: Sequence[C], rng: Random, avoid: object = None, now: float = 0.0) -> C:
    """Pick one of `members` (non-empty); `avoid` loses ties so retries go elsewhere. `now`
    ages the estimates (see Decay above)."""
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
    latency_a, latency_b = a.latency, b.latency
    if latency_a == 0.0 or latency_b == 0.0:  # not measured yet: measure it
        return a
    # The higher estimate, if stale, drifts toward the lower (its member idle: see Decay).
    if latency_a > latency_b:
        if not a.outstanding:
            age = now - a.latency_at
            if age >= DECAY:
                latency_a = latency_b
            elif age > 0.0:
                latency_a -= (latency_a - latency_b) * (age / DECAY)
    elif latency_b > latency_a and not b.outstanding:
        age = now - b.latency_at
        if age >= DECAY:
            latency_b = latency_a
        elif age > 0.0:
            latency_b -= (latency_b - latency_a) * (age / DECAY)
    cost_a = latency_a * (a.outstanding + 1)
    cost_b = latency_b * (b.outstanding + 1)
    # Costs within TIE of each other are noise (loopback latencies differ by microseconds): the
    # random first choice wins, so alike members share the load instead of one being starved
    # because its first sample happened to be slow.
    if cost_a <= cost_b * TIE and cost_b <= cost_a * TIE:
        return a
    return a if cost_a < cost_b else b


def observe(member: Candidate, sample: float, age: float = 0.0) -> None:
    """Fold a round-trip sample into the member's latency estimate, refreshed `age` seconds
    ago (the caller keeps `latency_at`: it holds the member's own class, whose attributes cost
    less to reach than a Protocol's, and this runs for every reply).

    A sample counts for at most twice the estimate: one outlier (a GC pause, a scheduler
    hiccup) then moves the estimate by at most EWMA_WEIGHT, inside the tie band, while a member
    that is really slower still converges (tenfold in about thirteen samples). A stale estimate
    counts for less: the sample's weight grows with the estimate's age, to all of it at DECAY.
    """
    latency = member.latency
    if latency == 0.0:  # the first sample is the estimate (the caller ages it: see above)
        member.latency = sample
        return
    if sample > 2 * latency:
        sample = 2 * latency
    weight = EWMA_WEIGHT
    if age > EWMA_WEIGHT * DECAY:
        weight = age / DECAY if age < DECAY else 1.0
    member.latency = latency + weight * (sample - latency)


PENALTY = 1.5  # a member that turned a request away looks this much slower (per refusal)
PENALTY_FLOOR = 0.001  # the estimate penalised, for a member refusing before it was measured
PENALTY_CAP = 0.25  # seconds: the most a penalty makes a member look; its queue still counts


def penalise(member: Candidate, now: float = 0.0) -> None:
    """The member turned a request away (overloaded) at `now`: it looks slower, so it gets less
    of the load until its replies bring the estimate back down (each reply moves it
    EWMA_WEIGHT). The cap keeps a member that refused in a burst from being starved afterwards:
    once its peers hold a queue of their own, it costs less than they do again. The refusal is
    news of the member, so it refreshes the estimate; what was stale of it goes first."""
    latency = member.latency
    age = now - member.latency_at
    if age >= DECAY:
        latency = 0.0
    elif age > 0.0:
        latency -= latency * (age / DECAY)
    member.latency_at = now
    penalised = max(latency, PENALTY_FLOOR) * PENALTY
    member.latency = min(penalised, max(PENALTY_CAP, latency))
