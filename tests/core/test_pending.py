"""The caller's pending-request table against a plain model: deadlines and expiry stay right
through any mix of adds, pops and heap compactions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh._core.pending import PendingRequest, PendingRequests


def req(req_id: int, deadline: float) -> PendingRequest:
    return PendingRequest(req_id, "db", b"p", deadline, 1.0, deadline - 1.0, None)


def test_add_get_pop() -> None:
    table = PendingRequests()
    first, second = req(1, 5.0), req(2, 3.0)
    table.add(first)
    table.add(second)
    assert len(table) == 2
    assert table.get(1) is first
    assert table.next_deadline() == 3.0
    assert table.pop(2) is second
    assert table.pop(2) is None
    assert table.get(2) is None
    assert table.next_deadline() == 5.0  # the popped entry's stale heap slot is skipped
    assert [r.req_id for r in table] == [1]


def test_empty() -> None:
    table = PendingRequests()
    assert table.next_deadline() is None
    assert table.pop_expired(1e9) == []
    assert table.pop(1) is None


def test_pop_expired_in_deadline_order_and_inclusive() -> None:
    table = PendingRequests()
    for req_id, deadline in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 9.0)]:
        table.add(req(req_id, deadline))
    table.pop(3)
    assert table.pop_expired(0.999) == []
    expired = table.pop_expired(2.0)
    assert [r.req_id for r in expired] == [2, 4]
    assert [r.req_id for r in table.pop_expired(100.0)] == [1, 5]
    assert len(table) == 0
    assert table.next_deadline() is None


def test_iteration_is_a_snapshot_that_allows_popping() -> None:
    table = PendingRequests()
    for i in range(10):
        table.add(req(i, float(i)))
    for request in table:
        table.pop(request.req_id)
    assert len(table) == 0


def test_compaction_keeps_heap_small_and_deadlines_right() -> None:
    table = PendingRequests()
    live: dict[int, float] = {}
    next_id = 0
    for round_ in range(50):
        for _ in range(200):
            next_id += 1
            deadline = 1000.0 - (next_id % 977) * 0.5 + round_
            table.add(req(next_id, deadline))
            live[next_id] = deadline
        for req_id in sorted(live)[: len(live) - 20]:  # most finish
            assert table.pop(req_id) is not None
            del live[req_id]
        assert len(table) == len(live)
        assert table.next_deadline() == min(live.values())
        # Stale entries are compacted away rather than piling up (10,000 added in all).
        assert len(table._heap) <= max(1025, 4 * len(live)) + 200
    expired = table.pop_expired(1e9)
    assert sorted(r.req_id for r in expired) == sorted(live)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.floats(0, 100, allow_nan=False)),
        st.tuples(st.just("pop"), st.integers(0, 400)),
        st.tuples(st.just("expire"), st.floats(0, 100, allow_nan=False)),
    ),
    max_size=400,
)


@settings(max_examples=100)
@given(ops)
def test_matches_a_model(operations: list[tuple[str, float]]) -> None:
    table = PendingRequests()
    model: dict[int, float] = {}
    next_id = 0
    for op, value in operations:
        if op == "add":
            next_id += 1
            table.add(req(next_id, value))
            model[next_id] = value
        elif op == "pop":
            popped = table.pop(int(value))
            assert (popped is not None) == (int(value) in model)
            model.pop(int(value), None)
        else:
            expired = table.pop_expired(value)
            due = {i for i, d in model.items() if d <= value}
            assert {r.req_id for r in expired} == due
            assert [r.deadline for r in expired] == sorted(r.deadline for r in expired)
            for i in due:
                del model[i]
        assert len(table) == len(model)
        assert table.next_deadline() == (min(model.values()) if model else None)
