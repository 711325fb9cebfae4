"""Admission at the member (pure): limit, queue, early rejection, adaptive LIFO, shedding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh._core.admission import Admission


def measured(admission: Admission[str], latency: float, runs: int = 20) -> None:
    """Teach `admission` a service time (runs that start and finish)."""
    for _ in range(runs):
        admission.started()
        admission.finished(latency)


def test_requests_start_at_once_while_under_the_limit() -> None:
    admission: Admission[str] = Admission(initial_limit=2)
    shed: list[tuple[str, str]] = []
    assert admission.offer("a", deadline=1.0, now=0.0, shed=shed) is None
    admission.started()
    assert admission.offer("b", deadline=1.0, now=0.0, shed=shed) is None
    admission.started()
    assert admission.offer("c", deadline=1.0, now=0.0, shed=shed) == "queued"
    assert admission.take(0.0, shed) is None  # the limit is full
    admission.finished(0.01)
    assert admission.take(0.01, shed) == "c"
    assert shed == []


def test_a_request_the_queue_would_make_late_is_rejected_on_arrival() -> None:
    admission: Admission[str] = Admission(initial_limit=1, max_limit=1)
    measured(admission, 0.010)
    admission.started()  # one runs
    shed: list[tuple[str, str]] = []
    # Each waiting request costs 10 ms: 40 of them leave a 0.3 s budget enough, 40 more do not.
    verdicts = [admission.offer(i, 0.3, 0.0, shed) for i in map(str, range(60))]
    assert verdicts[:29] == ["queued"] * 29
    assert set(verdicts[30:]) == {"queue"}
    # Its budget spent on arrival: rejected, whatever the queue.
    assert admission.offer("late", deadline=0.005, now=0.0, shed=shed) == "deadline"


def test_a_waiting_request_whose_budget_no_longer_covers_the_service_is_shed() -> None:
    admission: Admission[str] = Admission(initial_limit=1, max_limit=1, standing=10.0)
    measured(admission, 0.010)
    admission.started()
    shed: list[tuple[str, str]] = []
    assert admission.offer("short", 0.05, 0.0, shed) == "queued"
    assert admission.offer("long", 1.0, 0.0, shed) == "queued"
    admission.finished(0.010)
    # At 45 ms "short" has 5 ms left, less than a run: it is shed, never started.
    assert admission.take(0.045, shed) == "long"
    assert shed == [("short", "deadline")]


def test_a_burst_waits_its_turn_and_a_standing_queue_caps_the_wait_and_turns_lifo() -> None:
    admission: Admission[str] = Admission(initial_limit=1, max_limit=1, standing=0.1)
    measured(admission, 0.010)
    admission.started()
    shed: list[tuple[str, str]] = []
    # A burst of 30 (0.3 s of work) with 10 s budgets: all may wait, the queue is young.
    assert {admission.offer(f"b{i}", 10.0, 0.0, shed) for i in range(30)} == {"queued"}
    assert not admission.standing_queue(0.05)
    assert admission.standing_queue(0.1)  # not empty for the whole interval: overload
    # Now a newcomer that would wait longer than the interval is turned away at once.
    assert admission.offer("late", 10.0, 0.15, shed) == "queue"
    # Served newest first now: what is served is served quickly; the older wait their turn.
    admission.finished(0.010)
    assert admission.take(0.15, shed) == "b29"
    assert shed == []
    # Once the queue drains the interval starts again.
    admission.clear()
    admission.take(0.2, shed)
    admission.started()
    assert admission.offer("fresh", 10.0, 0.3, shed) == "queued"
    assert not admission.standing_queue(0.3)


def test_expire_sheds_what_waits_past_its_deadline_while_the_limit_is_full() -> None:
    admission: Admission[str] = Admission(initial_limit=1, max_limit=1)
    admission.started()
    shed: list[tuple[str, str]] = []
    admission.offer("a", 0.1, 0.0, shed)
    admission.offer("b", 1.0, 0.0, shed)
    admission.expire(0.2, shed)
    assert shed == [("a", "deadline")]
    assert [w.item for w in admission.queue] == ["b"]


def test_a_full_queue_rejects_newcomers() -> None:
    admission: Admission[str] = Admission(initial_limit=1, max_limit=1, max_queue=2)
    admission.started()
    shed: list[tuple[str, str]] = []
    assert admission.offer("a", 5.0, 0.0, shed) == "queued"
    assert admission.offer("b", 5.0, 0.0, shed) == "queued"
    assert admission.offer("c", 5.0, 0.01, shed) == "queue"
    assert shed == []


def test_a_more_critical_request_displaces_a_less_critical_one_when_full() -> None:
    admission: Admission[str] = Admission(initial_limit=1, max_limit=1, max_queue=1)
    admission.started()
    shed: list[tuple[str, str]] = []
    assert admission.offer("bulk", 5.0, 0.0, shed, criticality=0) == "queued"
    assert admission.offer("vital", 5.0, 0.0, shed, criticality=1) == "queued"
    assert shed == [("bulk", "queue")]


def test_cancelled_waiting_requests_leave_the_queue() -> None:
    admission: Admission[str] = Admission(initial_limit=1)
    admission.started()
    shed: list[tuple[str, str]] = []
    admission.offer("a", 5.0, 0.0, shed)
    assert admission.remove("a")
    assert not admission.remove("a")
    assert not admission.queue


def test_the_limit_grows_while_latency_holds_and_shrinks_when_it_climbs() -> None:
    admission: Admission[str] = Admission(initial_limit=4, max_limit=200)
    measured(admission, 0.010, runs=300)
    grown = admission.limit
    assert grown > 50  # steady latency: room for more
    measured(admission, 0.100, runs=30)  # ten times slower: handlers contend
    assert admission.limit < grown / 4
    assert admission.limit >= admission.min_limit
    # Slow for long, slow is the new normal (the long-term average catches up): it regrows.
    shrunk = admission.limit
    measured(admission, 0.100, runs=300)
    assert admission.limit > shrunk


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["offer", "take", "finish", "expire"]),
            st.floats(0.0, 0.05),
            st.floats(0.0, 0.5),
        ),
        max_size=200,
    )
)
def test_nothing_is_lost_nothing_starts_late_and_the_limit_holds(
    steps: list[tuple[str, float, float]],
) -> None:
    """Every offered request is started, shed, rejected or still waiting, exactly once; none
    starts after its deadline; never more running than the limit allows."""
    admission: Admission[int] = Admission(initial_limit=2, max_limit=4, max_queue=8)
    now, n = 0.0, 0
    outcomes: dict[int, str] = {}
    deadlines: dict[int, float] = {}
    shed: list[tuple[int, str]] = []
    running: list[int] = []
    for op, dt, budget in steps:
        now += dt
        if op == "offer":
            n += 1
            deadlines[n] = now + budget
            verdict = admission.offer(n, now + budget, now, shed, n % 3 - 1)  # 3 classes
            if verdict is None:
                admission.started()
                running.append(n)
                outcomes[n] = "started"
            elif verdict != "queued":
                outcomes[n] = "rejected"
        elif op == "take":
            item = admission.take(now, shed)
            if item is not None:
                assert now < deadlines[item]
                admission.started()
                running.append(item)
                assert item not in outcomes
                outcomes[item] = "started"
        elif op == "finish" and running:
            running.pop(0)
            admission.finished(dt)
        else:
            admission.expire(now, shed)
        assert admission.running == len(running)
        assert admission.running <= max(admission.limit, 1) + 1  # a start may pass it once
        for item, _reason in shed:
            assert item not in outcomes
            outcomes[item] = "shed"
        shed.clear()
    waiting = {w.item for w in admission.queue}
    assert not waiting & set(outcomes)
    assert set(outcomes) | waiting == set(range(1, n + 1))


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="min_limit"):
        Admission(initial_limit=0)
