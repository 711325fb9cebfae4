"""Choosing a member: always one of them, `avoid` respected, slow members starved of work."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from irismesh._core import balancer


@dataclass(eq=False)
class Member:
    latency: float
    outstanding: int = 0


members_st = st.lists(
    st.builds(
        Member,
        latency=st.floats(0.0, 10.0, allow_nan=False),
        outstanding=st.integers(0, 1000),
    ),
    min_size=1,
    max_size=8,
)


@given(members_st, st.integers(0, 2**32), st.data())
def test_choose_returns_a_member_and_avoids_when_it_can(
    members: list[Member], seed: int, data: st.DataObject
) -> None:
    avoid = data.draw(st.sampled_from([None, *members]))
    choice = balancer.choose(members, random.Random(seed), avoid=avoid)
    assert any(choice is m for m in members)
    if len(members) > 1:
        assert choice is not avoid


def test_single_member_is_chosen_even_when_avoided() -> None:
    only = Member(latency=5.0, outstanding=99)
    rng = random.Random(1)
    assert balancer.choose([only], rng) is only
    assert balancer.choose([only], rng, avoid=only) is only


def test_avoid_is_never_chosen_among_equals() -> None:
    rng = random.Random(2)
    for n in range(2, 6):
        members = [Member(latency=0.001) for _ in range(n)]
        for _ in range(200):
            assert balancer.choose(members, rng, avoid=members[0]) is not members[0]


def test_cost_of_the_lower_of_two_wins() -> None:
    fast, slow = Member(latency=0.001), Member(latency=0.010)
    rng = random.Random(3)
    assert all(balancer.choose([fast, slow], rng) is fast for _ in range(100))
    fast.outstanding = 20  # 0.001 * 21 > 0.010 * 1 * TIE: the slow one is now the cheaper
    assert all(balancer.choose([fast, slow], rng) is slow for _ in range(100))


def test_costs_within_the_tie_band_share_the_load() -> None:
    """Loopback noise must not starve a member: near-equal costs are picked at random."""
    a, b = Member(latency=0.0010), Member(latency=0.0013)  # 1.3x apart: a tie
    rng = random.Random(5)
    picks = [balancer.choose([a, b], rng) is a for _ in range(2000)]
    assert 0.4 < sum(picks) / len(picks) < 0.6


def simulate(latencies: list[float], picks: int, concurrency: int, seed: int) -> list[int]:
    """Closed loop: `concurrency` requests always in flight, each new one placed by `choose`,
    each finishing after its member's latency; returns how many each member got."""
    rng = random.Random(seed)
    members = [Member(latency=latency) for latency in latencies]
    counts = [0] * len(members)
    in_flight: list[tuple[float, int, int]] = []  # (finishes at, order, member index)
    now = 0.0
    for order in range(picks):
        if len(in_flight) >= concurrency:
            now, _order, done = heapq.heappop(in_flight)
            members[done].outstanding -= 1
        chosen = balancer.choose(members, rng)
        index = next(i for i, m in enumerate(members) if m is chosen)
        chosen.outstanding += 1
        counts[index] += 1
        heapq.heappush(in_flight, (now + chosen.latency, order, index))
    return counts


def test_a_member_ten_times_slower_gets_a_small_share() -> None:
    counts = simulate([0.001, 0.001, 0.010], picks=10_000, concurrency=30, seed=4)
    share = counts[2] / sum(counts)
    assert share < 0.10  # round-robin would give it a third
    assert counts[2] > 0  # but it is still used when the fast ones queue up


def test_equal_members_share_evenly() -> None:
    counts = simulate([0.002, 0.002, 0.002], picks=9_000, concurrency=30, seed=5)
    assert all(abs(c / 9_000 - 1 / 3) < 0.05 for c in counts)


def test_observe_moves_latency_towards_the_sample() -> None:
    member = Member(latency=1.0)
    balancer.observe(member, 0.0)
    assert member.latency == 1.0 - balancer.EWMA_WEIGHT
    for _ in range(100):
        balancer.observe(member, 0.5)
    assert abs(member.latency - 0.5) < 1e-6
