"""The replicated data types: merges form a semilattice, and replicas that exchange deltas in any
order, with repeats, converge to one value (the semantics of each type checked too)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh.data.clock import HybridClock, Stamp
from irismesh.data.types import (
    Crdt,
    Flag,
    LWWRegister,
    ORMap,
    ORSet,
    PNCounter,
    decode,
    encode,
    fingerprint,
)
from irismesh.errors import ProtocolError

NODES = [bytes([i]) * 16 for i in range(5)]
ELEMENTS = [b"a", b"b", b"c", "d", 7]

# One operation: (replica index, what, argument).
ops = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 4)), min_size=0, max_size=40
)


class Replica:
    """One simulated replica of one type: its state, clock, and the deltas it produced."""

    def __init__(self, kind: type[Crdt], index: int) -> None:
        self.node = NODES[index]
        self.state: Any = kind()
        self.clock = HybridClock(self.node)
        self.now = 1_000 + index  # milliseconds; skewed per replica

    def apply(self, what: int, arg: int) -> Crdt:
        s, node = self.state, self.node
        self.now += arg % 2  # a clock that sometimes stands still
        if isinstance(s, PNCounter):
            return s.add(node, [1, -1, 5, -3][what])
        if isinstance(s, ORSet):
            element = ELEMENTS[arg]
            if what == 3 and arg == 0:
                return s.clear()
            return s.add(node, element) if what < 2 else s.remove(element)
        if isinstance(s, Flag):
            return s.enable(node) if what < 2 else s.disable()
        if isinstance(s, LWWRegister):
            return s.assign(self.clock.now(self.now), [what, arg, self.node.hex()[:2]])
        assert isinstance(s, ORMap)
        key = ELEMENTS[arg % 3]
        if what == 3:
            return s.remove(key)
        if key == b"a":
            counter = s.entry(key, PNCounter)
            assert isinstance(counter, PNCounter)
            return s.updated(node, key, counter.add(node, what + 1))
        if key == b"b":
            members = s.entry(key, ORSet)
            assert isinstance(members, ORSet)
            change = members.add(node, arg) if what < 2 else members.remove(arg)
            return s.updated(node, key, change)
        register = s.entry(key, LWWRegister)
        assert isinstance(register, LWWRegister)
        return s.updated(node, key, register.assign(self.clock.now(self.now), what))

    def receive(self, delta: Crdt) -> None:
        if isinstance(delta, LWWRegister) and delta.stamp is not None:
            self.clock.observe(delta.stamp, self.now)
        self.state.merge(delta)


KINDS: list[type[Crdt]] = [PNCounter, ORSet, Flag, LWWRegister, ORMap]


def run(kind: type[Crdt], operations: list[tuple[int, int, int]]) -> list[Replica]:
    """Five replicas, each operation on one of them; the deltas made, in order of making."""
    replicas = [Replica(kind, i) for i in range(5)]
    run.deltas = []  # type: ignore[attr-defined]
    for index, what, arg in operations:
        delta = replicas[index].apply(what, arg)
        run.deltas.append((index, delta))  # type: ignore[attr-defined]
    return replicas


def merged(a: Crdt, b: Crdt) -> Crdt:
    c = a.copy()
    c.merge(b)  # type: ignore[arg-type]
    return c


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@settings(max_examples=60, deadline=None)
@given(operations=ops, order=st.randoms(use_true_random=False))
def test_merge_is_a_semilattice(
    kind: type[Crdt], operations: list[tuple[int, int, int]], order: random.Random
) -> None:
    replicas = run(kind, operations)
    a, b, c = (r.state for r in order.sample(replicas, 3))
    assert merged(a, b) == merged(b, a)  # commutative
    assert merged(merged(a, b), c) == merged(a, merged(b, c))  # associative
    assert merged(a, a) == a  # idempotent
    assert merged(merged(a, b), b) == merged(a, b)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@settings(max_examples=60, deadline=None)
@given(operations=ops, order=st.randoms(use_true_random=False))
def test_deltas_in_any_order_with_repeats_converge(
    kind: type[Crdt], operations: list[tuple[int, int, int]], order: random.Random
) -> None:
    replicas = run(kind, operations)
    deltas: list[tuple[int, Crdt]] = run.deltas  # type: ignore[attr-defined]
    everything = kind()
    for r in replicas:
        everything.merge(r.state)  # type: ignore[arg-type]
    for r in replicas:
        # Every delta the others made, shuffled, a third of them twice, some folded together,
        # and each through the wire encoding.
        theirs = [d for i, d in deltas if r.node != NODES[i]]
        theirs += order.sample(theirs, len(theirs) // 3)
        order.shuffle(theirs)
        while theirs:
            if len(theirs) > 1 and order.random() < 0.3:
                folded = merged(theirs.pop(), theirs.pop())
                r.receive(decode(encode(folded)))
            else:
                r.receive(decode(encode(theirs.pop())))
    values = [_value(r.state) for r in replicas]
    assert all(v == values[0] for v in values)
    assert values[0] == _value(everything)
    for r in replicas:
        assert r.state == everything
        # Equal states share a fingerprint, whatever order they were built in: the digests
        # of anti-entropy compare these.
        assert fingerprint(r.state) == fingerprint(everything)


def _value(state: Crdt) -> Any:
    return state.value


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@settings(max_examples=40, deadline=None)
@given(operations=ops)
def test_encoding_round_trips(kind: type[Crdt], operations: list[tuple[int, int, int]]) -> None:
    for r in run(kind, operations):
        assert decode(encode(r.state)) == r.state


@given(data=st.binary(max_size=64))
def test_bad_bytes_are_a_protocol_error(data: bytes) -> None:
    reasons = set()
    try:
        decode(data)
    except ProtocolError as exc:
        reasons.add(exc.reason)
    assert reasons <= {"bad_data"}


def pair(kind: type[Crdt]) -> tuple[Any, Any]:
    return kind(), kind()


def exchange(a: Any, b: Any, da: Crdt, db: Crdt) -> None:
    a.merge(db)
    b.merge(da)


def test_counter_sums_every_node() -> None:
    a, b = pair(PNCounter)
    da = merged(a.add(NODES[0], 5), a.add(NODES[0], -2))
    db = b.add(NODES[1], 10)
    exchange(a, b, da, db)
    assert a.value == b.value == 13


def test_set_add_wins_over_a_concurrent_remove() -> None:
    a, b = pair(ORSet)
    b.merge(a.add(NODES[0], b"x"))
    da = a.remove(b"x")  # a removes the add it saw ...
    db = b.add(NODES[1], b"x")  # ... while b adds again
    exchange(a, b, da, db)
    assert a.value == b.value == {b"x"}


def test_set_remove_takes_the_adds_it_saw() -> None:
    a, b = pair(ORSet)
    b.merge(a.add(NODES[0], b"x"))
    b.merge(a.add(NODES[0], b"y"))
    db = b.remove(b"x")
    exchange(a, b, ORSet(), db)
    assert a.value == b.value == {b"y"}


def test_flag_enable_wins() -> None:
    a, b = pair(Flag)
    b.merge(a.enable(NODES[0]))
    exchange(a, b, a.disable(), b.enable(NODES[1]))
    assert a.value is b.value is True
    exchange(a, b, a.disable(), Flag())
    assert a.value is b.value is False


def test_register_orders_a_write_after_the_one_it_read_whatever_the_clocks() -> None:
    fast, slow = HybridClock(NODES[0]), HybridClock(NODES[1])
    a, b = pair(LWWRegister)
    b.merge(a.assign(fast.now(1_010_000), b"v1"))  # a clock 10 s ahead
    slow.observe(a.stamp, 1_000_000)
    exchange(a, b, LWWRegister(), b.assign(slow.now(1_000_001), b"v2"))
    assert a.value == b.value == b"v2"


def test_clock_follows_kulkarni_rules() -> None:
    c = HybridClock(NODES[0])
    assert c.now(100) == Stamp(100, 0, NODES[0])
    assert c.now(100) == Stamp(100, 1, NODES[0])
    c.observe(Stamp(200, 4, NODES[1]), 150)
    assert (c.wall, c.logical) == (200, 5)
    c.observe(Stamp(200, 9, NODES[1]), 150)
    assert (c.wall, c.logical) == (200, 10)
    c.observe(Stamp(100, 0, NODES[1]), 150)
    assert (c.wall, c.logical) == (200, 11)
    assert c.now(300) == Stamp(300, 0, NODES[0])
    c.observe(Stamp(10_000_000, 0, NODES[1]), 300)  # a year-fast clock is not adopted
    assert c.wall == 300
    assert c.refused_ahead == 1


def test_map_holds_each_kind_and_add_wins_over_remove() -> None:
    a, b = pair(ORMap)
    counter = a.entry(b"hits", PNCounter)
    b.merge(a.updated(NODES[0], b"hits", counter.add(NODES[0], 3)))
    members = b.entry(b"who", ORSet)
    a.merge(b.updated(NODES[1], b"who", members.add(NODES[1], b"x")))
    assert a.value == b.value == {b"hits": 3, b"who": frozenset({b"x"})}
    da = a.remove(b"hits")
    counter = b.entry(b"hits", PNCounter)
    db = b.updated(NODES[1], b"hits", counter.add(NODES[1], 1))
    exchange(a, b, da, db)
    assert a.value == b.value == {b"hits": 4, b"who": frozenset({b"x"})}


def test_map_refuses_a_second_kind_for_a_key() -> None:
    m = ORMap()
    m.entry(b"k", PNCounter)
    with pytest.raises(TypeError):
        m.entry(b"k", ORSet)


def test_deltas_stay_small() -> None:
    s = ORSet()
    for i in range(10_000):
        s.add(NODES[0], i)
    delta = s.add(NODES[0], b"one more")
    assert len(encode(delta)) < 64  # a delta does not carry the state
    c = PNCounter()
    for node in NODES:
        c.add(node, 1)
    assert len(encode(c.add(NODES[0], 1))) < 40
