"""Busy polling spins only where it pays (irismesh._spin.Spin), and counts what it cost."""

from __future__ import annotations

from collections import Counter

from irismesh._spin import EXPLORE, RUN, Spin

LIMIT = 0.0005


def decide(spin: Spin, waits: tuple[float, float], runs: int) -> list[bool]:
    """`runs` runs of waits, one flag per run: spun. A wait takes waits[0] seconds when spun
    for and waits[1] when slept for."""
    spun = []
    for _ in range(runs * RUN):
        budget = spin.budget()
        assert 0.0 <= budget <= LIMIT
        spin.observe(bool(budget), waits[0] if budget else waits[1])
        spun.append(bool(budget))
    by_run = [spun[i : i + RUN] for i in range(0, len(spun), RUN)]
    assert all(len(set(run)) == 1 for run in by_run)  # a run goes one way throughout
    return [run[0] for run in by_run]


def test_spins_when_spinning_is_quicker_and_sleeps_now_and_then_to_keep_watching() -> None:
    stats: Counter[str] = Counter()
    spin = Spin(LIMIT, stats, "p", available=4)
    runs = decide(spin, (100e-6, 250e-6), 4 * EXPLORE)
    assert runs[:2] == [True, False]  # tries each way once
    assert runs[2:].count(False) == 3  # then one run in EXPLORE sleeps
    assert stats["p_spins"] == runs.count(True) * RUN
    assert stats["p_slept"] == runs.count(False) * RUN


def test_budget_follows_the_typical_wait_within_the_limit() -> None:
    assert Spin(LIMIT, Counter(), "p", available=4).budget() == LIMIT  # nothing measured yet
    spin = Spin(LIMIT, Counter(), "p", available=4)
    decide(spin, (100e-6, 300e-6), 3)
    assert spin.mode
    assert abs(spin.budget() - 200e-6) < 1e-9  # twice the typical wait when spinning
    spin = Spin(LIMIT, Counter(), "p", available=4)
    decide(spin, (1e-6, 300e-6), 3)
    assert spin.budget() == 50e-6  # never a spin too short to catch anything


def test_sleeps_when_spinning_makes_waits_longer() -> None:
    """Two processes spinning against each other on too few cores: sleeping is quicker."""
    spin = Spin(LIMIT, Counter(), "p", available=2)
    runs = decide(spin, (400e-6, 150e-6), 4 * EXPLORE)
    assert runs[:2] == [True, False]
    assert runs[2:].count(True) == 3  # tries spinning again one run in EXPLORE


def test_settling_waits_of_a_run_are_not_counted() -> None:
    spin = Spin(LIMIT, Counter(), "p", available=4)
    for i in range(RUN):
        spin.observe(bool(spin.budget()), 0.1 if i < 8 else 100e-6)
    spin.budget()
    assert abs(spin.spinning - 100e-6) < 1e-9


def test_never_spins_for_what_comes_too_late_to_catch() -> None:
    """A member whose requests come seconds apart does not burn a core after each."""
    spin = Spin(LIMIT, Counter(), "p", available=8)
    runs = decide(spin, (2.0, 2.0), 4 * EXPLORE)
    assert runs[:2] == [True, False]
    assert not any(runs[2:])


def test_never_spins_with_fewer_cores_than_busy_threads() -> None:
    stats: Counter[str] = Counter()
    spin = Spin(LIMIT, stats, "p", available=1)
    assert not spin.enabled
    assert not any(decide(spin, (10e-6, 500e-6), 3))
    assert stats == Counter()  # nothing counted: busy polling is simply off
    assert not Spin(0.0, stats, "p", available=8).enabled


def test_counts_what_spinning_cost() -> None:
    stats: Counter[str] = Counter()
    spin = Spin(LIMIT, stats, "p", available=4)
    spin.spun(120e-6, caught=True)
    spin.spun(500e-6, caught=False)
    assert stats["p_spun_us"] == 620
    assert stats["p_caught"] == 1


def test_keeps_spinning_unless_sleeping_is_clearly_quicker() -> None:
    """Busy polling was asked for: a busy machine's noise does not talk it out of spinning."""
    spin = Spin(LIMIT, Counter(), "p", available=4)
    runs = decide(spin, (110e-6, 100e-6), 4 * EXPLORE)
    assert runs[:2] == [True, False]
    assert runs[2:].count(False) == 3  # only the runs that keep the figures current


def test_a_caller_spins_while_replies_come_within_the_limit() -> None:
    """A caller does not compare with sleeping: it spins unless replies come too late."""
    spin = Spin(LIMIT, Counter(), "p", compare=False, available=4)
    assert all(decide(spin, (300e-6, 100e-6), 4 * EXPLORE))  # slower spinning: spins anyway
    assert spin.budget() == LIMIT  # the whole limit, every time


def test_a_caller_stops_spinning_for_slow_replies_and_tries_again_now_and_then() -> None:
    spin = Spin(LIMIT, Counter(), "p", compare=False, available=4)
    runs = decide(spin, (2e-3, 2e-3), 2 * EXPLORE)
    assert runs[0]
    assert not any(runs[1:])  # replies beyond the limit: not even an exploring spin
    runs = decide(spin, (100e-6, 200e-6), 6 * EXPLORE)  # the member got quick again
    assert all(runs[-EXPLORE:])  # (the averages forget the slow runs a half at a time)
