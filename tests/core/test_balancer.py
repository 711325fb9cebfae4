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
    latency_at: float = 0.0


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


# ------------------------------------------------------------------ decay with time


def test_a_stale_estimate_drifts_to_the_other_members_and_is_probed_within_decay() -> None:
    """A member starved since its last reply ties with its peer once its estimate is DECAY
    old, whatever the ratio of the two: it is probed again."""
    fast = Member(latency=0.001, latency_at=0.0)
    slow = Member(latency=1.0, latency_at=0.0)  # a thousand times slower, once
    rng = random.Random(6)
    for now in (0.0, 0.5 * balancer.DECAY, 0.99 * balancer.DECAY):
        fast.latency_at = now  # the fast one keeps answering
        assert all(balancer.choose([fast, slow], rng, None, now) is fast for _ in range(200))
    now = balancer.DECAY
    fast.latency_at = now
    picks = sum(balancer.choose([fast, slow], rng, None, now) is slow for _ in range(2000))
    assert 0.4 < picks / 2000 < 0.6  # a tie: the random first choice


def test_the_drift_is_toward_the_other_member_in_proportion_to_age() -> None:
    """Halfway through DECAY a tenfold estimate counts as about 5.5 times: still out of the
    tie band, and cheaper than a peer holding a queue of nine, though not of two."""
    fast = Member(latency=0.001, latency_at=5.0, outstanding=9)
    slow = Member(latency=0.010, latency_at=0.0)
    rng = random.Random(7)
    now = 0.5 * balancer.DECAY  # slow counts 0.0055 against fast's 0.001 * 10
    assert all(balancer.choose([fast, slow], rng, None, now) is slow for _ in range(200))
    fast.outstanding = 2  # 0.003 * TIE < 0.0055
    assert all(balancer.choose([fast, slow], rng, None, now) is fast for _ in range(200))


def test_a_member_with_requests_in_flight_does_not_decay() -> None:
    """Busy is not forgotten: a probe in flight keeps a still-slow member from a burst."""
    fast = Member(latency=0.001, latency_at=100.0)
    slow = Member(latency=1.0, latency_at=0.0, outstanding=1)
    rng = random.Random(8)
    assert all(balancer.choose([fast, slow], rng, None, 100.0) is fast for _ in range(200))


def test_a_fresh_sample_replaces_an_estimate_decay_old() -> None:
    member = Member(latency=1.0)
    balancer.observe(member, 0.001, balancer.DECAY)  # an estimate DECAY old
    assert abs(member.latency - 0.001) < 1e-12
    # Halfway, it counts for half; fresh, for EWMA_WEIGHT as before.
    member = Member(latency=1.0)
    balancer.observe(member, 0.0, 0.5 * balancer.DECAY)
    assert abs(member.latency - 0.5) < 1e-9
    balancer.observe(member, 0.0, 0.01)
    assert abs(member.latency - 0.5 * (1 - balancer.EWMA_WEIGHT)) < 1e-9
    # A stale estimate still moves at most to twice itself: one outlier is one outlier.
    member = Member(latency=0.001)
    balancer.observe(member, 5.0, 2 * balancer.DECAY)
    assert member.latency == 0.002


def test_a_refusal_refreshes_the_estimate_and_drops_its_stale_part() -> None:
    member = Member(latency=0.2, latency_at=0.0)
    balancer.penalise(member, balancer.DECAY)  # stale: penalised from the floor
    assert member.latency == balancer.PENALTY_FLOOR * balancer.PENALTY
    assert member.latency_at == balancer.DECAY
    balancer.penalise(member, balancer.DECAY)  # fresh: penalised again, as before
    assert member.latency == balancer.PENALTY_FLOOR * balancer.PENALTY**2


def simulate_measured(
    service: list[float], picks: int, concurrency: int, seed: int, *, clock: bool
) -> list[int]:
    """`simulate`, with each member's estimate measured from its replies (`observe`), and the
    clock passed to the balancer (`clock`) or not (every estimate then looks fresh: no decay)."""
    rng = random.Random(seed)
    members = [Member(latency=0.0) for _ in service]
    counts = [0] * len(members)
    in_flight: list[tuple[float, int, int, float]] = []  # (finishes at, order, index, sent at)
    now = 0.0
    for order in range(picks):
        if len(in_flight) >= concurrency:
            now, _order, done, sent = heapq.heappop(in_flight)
            member = members[done]
            member.outstanding -= 1
            age = now - member.latency_at if clock else 0.0
            member.latency_at = now if clock else 0.0  # as Calls.on_reply stamps it
            balancer.observe(member, now - sent, age)
        chosen = balancer.choose(members, rng, None, now if clock else 0.0)
        index = next(i for i, m in enumerate(members) if m is chosen)
        chosen.outstanding += 1
        counts[index] += 1
        # Each member serves its requests one at a time: its queue adds to their latency.
        queued = max((f for f, _o, i, _s in in_flight if i == index), default=now)
        heapq.heappush(in_flight, (max(now, queued) + service[index], order, index, now))
    return counts


def test_under_steady_load_the_decay_changes_nothing() -> None:
    """Replies refresh every estimate within milliseconds, against a DECAY of seconds: the
    shares are those of the balancer without a clock."""
    for service in ([0.001, 0.001, 0.010], [0.002, 0.002, 0.002], [0.0005, 0.001, 0.004]):
        with_clock = simulate_measured(service, 20_000, 30, seed=9, clock=True)
        without = simulate_measured(service, 20_000, 30, seed=9, clock=False)
        for a, b in zip(with_clock, without, strict=True):
            assert abs(a - b) / 20_000 < 0.01, (service, with_clock, without)
