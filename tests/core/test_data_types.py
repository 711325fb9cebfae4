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


# ----------------------------------------------------------------- pruning removed nodes


def _deliver(
    replicas: dict[int, PNCounter], queue: list[tuple[int, PNCounter]], rng: random.Random
) -> None:
    """Deliver every queued delta to every replica but its maker, shuffled, some twice."""
    sends = [(to, d) for frm, d in queue for to in replicas if to != frm]
    sends += rng.sample(sends, len(sends) // 3)
    rng.shuffle(sends)
    for to, delta in sends:
        replicas[to].merge(delta)


@settings(max_examples=80, deadline=None)
@given(
    writes=st.lists(st.tuples(st.integers(0, 4), st.integers(-5, 9)), max_size=40),
    later=st.lists(st.tuples(st.integers(0, 2), st.integers(-5, 9)), max_size=20),
    rng=st.randoms(use_true_random=False),
)
def test_pruning_a_removed_node_keeps_the_value_exact(
    writes: list[tuple[int, int]], later: list[tuple[int, int]], rng: random.Random
) -> None:
    """Nodes 3 and 4 write, then leave; node 0 folds their entries while 0-2 keep writing,
    deltas arriving in any order, some twice: every replica ends with the exact total and no
    entry of the nodes that left."""
    replicas = {i: PNCounter() for i in range(5)}
    queue: list[tuple[int, PNCounter]] = []
    total = 0
    for i, amount in writes:
        queue.append((i, replicas[i].add(NODES[i], amount)))
        total += amount
    _deliver(replicas, queue, rng)  # the leavers' writes reached the others before they left
    for leaver in (3, 4):
        del replicas[leaver]
    queue = []
    owner = NODES[0]
    steps: list[tuple[str, int, int]] = [("write", i, amount) for i, amount in later]
    steps += [("start", 0, r) for r in (3, 4)] + [("see", i, r) for i in (1, 2) for r in (3, 4)]
    rng.shuffle(steps)
    for kind, i, arg in steps:
        replica = replicas[i]
        delta: PNCounter | None
        if kind == "write":
            delta = replica.add(NODES[i], arg)
            total += arg
        elif kind == "start":
            delta = replica.start_pruning(NODES[arg], owner)
        else:
            delta = replica.see_pruning(NODES[arg], NODES[i])
        if delta is not None:
            queue.append((i, delta))
        if rng.random() < 0.3:  # some deltas arrive now, the rest later
            _deliver(replicas, queue, rng)
            queue = []
    _deliver(replicas, queue, rng)
    queue = []
    for r in (3, 4):  # each holder saw the marker: its entries of r are with the owner
        for i in (1, 2):
            delta = replicas[i].see_pruning(NODES[r], NODES[i])
            if delta is not None:
                queue.append((i, delta))
    _deliver(replicas, queue, rng)
    queue = []
    for r in (3, 4):
        marker = replicas[0].pruning.get(NODES[r])
        if marker is not None:
            assert marker[1] == {NODES[0], NODES[1], NODES[2]}
            delta = replicas[0].prune(NODES[r], until=10_000)
            assert delta is not None
            queue.append((0, delta))
    _deliver(replicas, queue, rng)
    values = [replicas[i].value for i in (0, 1, 2)]
    assert values == [total] * 3
    assert replicas[0] == replicas[1] == replicas[2]
    for replica in replicas.values():
        assert not {NODES[3], NODES[4]} & (replica.up.keys() | replica.down.keys())
        assert replica.forget_pruned(10_000) in (0, 1, 2)
        assert replica.value == total


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_merge_is_a_semilattice_with_pruning_markers(data: st.DataObject) -> None:
    def state() -> PNCounter:
        c = PNCounter()
        for node in data.draw(st.lists(st.sampled_from(NODES), max_size=4)):
            c.add(node, data.draw(st.integers(-3, 5)))
        for removed in data.draw(st.lists(st.sampled_from(NODES[3:]), max_size=2)):
            owner = data.draw(st.sampled_from(NODES[:3]))
            if data.draw(st.booleans()):
                c.start_pruning(removed, owner)
                c.see_pruning(removed, data.draw(st.sampled_from(NODES[:3])))
            else:
                folded = (data.draw(st.integers(1, 3)), data.draw(st.integers(0, 5)), 0)
                c.pruned[removed] = folded
                c.merge(PNCounter())  # the cleanup a merge makes
        return c

    a, b, c = state(), state(), state()

    def merged(*parts: PNCounter) -> PNCounter:
        out = PNCounter()
        for part in parts:
            out.merge(part)
        return out

    assert merged(a, b) == merged(b, a)
    assert merged(merged(a, b), c) == merged(a, merged(b, c))
    assert merged(a, a) == merged(a)
    for s in (a, b, c, merged(a, b, c)):
        assert decode(encode(s)) == s
        assert fingerprint(decode(encode(s))) == fingerprint(s)


def test_state_stays_bounded_as_writers_come_and_go() -> None:
    """A hundred writers that each write and leave: once pruned and the markers' time is
    past, the state holds the two writers still there, whatever the total."""
    a, b = PNCounter(), PNCounter()
    total = 0
    for n in range(100):
        writer = bytes([0xF0]) + n.to_bytes(15, "big")
        b.merge(a.add(writer, n + 1))
        b.merge(a.add(NODES[0], 1))
        a.merge(b.add(NODES[1], -1))
        total += n + 1
        marker = a.start_pruning(writer, NODES[0])
        assert marker is not None
        b.merge(marker)
        seen = b.see_pruning(writer, NODES[1])
        assert seen is not None
        a.merge(seen)
        folded = a.prune(writer, until=n)
        assert folded is not None
        b.merge(folded)
        a.forget_pruned(n)
        b.forget_pruned(n)
        assert a.value == b.value == total
    assert a == b
    assert len(a.up) + len(a.down) + len(a.pruning) + len(a.pruned) <= 3
    assert len(encode(a)) < 64


def test_a_pruned_node_that_comes_back_counts_on_top_of_what_was_folded() -> None:
    """A node that left comes back under the same id (a kept identity) after its entries were
    folded, even on a replica that already forgot the fold: its new adds count once."""
    a, b, r = PNCounter(), PNCounter(), PNCounter()
    for delta in (r.add(NODES[3], 10), r.add(NODES[3], -4), a.add(NODES[0], 1)):
        a.merge(delta)
        b.merge(delta)
    b.merge(a.start_pruning(NODES[3], NODES[0]) or PNCounter())
    a.merge(b.see_pruning(NODES[3], NODES[1]) or PNCounter())
    folded = a.prune(NODES[3], until=5)
    assert folded is not None
    b.merge(folded)
    assert a.value == b.value == 7
    assert b.forget_pruned(5) == 1  # b forgets the fold; a keeps it a while longer
    back = a.copy()  # the node's new run asks a holder for the state, then writes
    for delta in (back.add(NODES[3], 3), back.add(NODES[3], -1)):
        a.merge(delta)
        b.merge(delta)  # the delta carries the fold: b does not count the folded part twice
    assert back.value == a.value == b.value == 9
    assert a.forget_pruned(10) == 0  # kept: the node that came back has entries again
    assert decode(encode(b)) == b
