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
    Dot,
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


# ----------------------------------------------------------------- pruning sets, flags and maps

DOT_KINDS: list[type[Crdt]] = [ORSet, Flag, ORMap]
LEAVERS = (3, 4)
STAYERS = (0, 1, 2)


def _dots_of_leavers(state: Any) -> set[bytes]:
    """The leavers' node ids anywhere in a set's, flag's or map's dots and contexts."""
    found: set[bytes] = set()
    stores: list[Any] = (
        [state.keys, *state.values.values()] if isinstance(state, ORMap) else [state]
    )
    for s in stores:
        if isinstance(s, PNCounter):
            found |= s.up.keys() | s.down.keys()
            continue
        if isinstance(s, LWWRegister):
            continue
        dots = s.dots if isinstance(s, Flag) else {d for ds in s.entries.values() for d in ds}
        found |= {n for n, _k in dots | s.cc.cloud} | s.cc.vv.keys()
    return found & {NODES[i] for i in LEAVERS}


class Pruned:
    """Replicas that prune the leavers beside shadows that never prune: the same operations
    and the same deliveries reach both, so the shadows say what the values must be."""

    def __init__(self, kind: type[Crdt], rng: random.Random) -> None:
        self.real = [Replica(kind, i) for i in range(5)]
        self.shadow = [Replica(kind, i) for i in range(5)]
        self.rng = rng
        self.queue: list[tuple[int, Crdt, Crdt | None]] = []  # maker, delta, its shadow twin
        self.old: list[tuple[Crdt, Crdt]] = []  # every write made before the leavers left
        self.snapshots: list[Crdt] = []

    def write(self, i: int, what: int, arg: int, *, early: bool = False) -> None:
        delta = self.real[i].apply(what, arg)
        twin = self.shadow[i].apply(what, arg)
        self.queue.append((i, delta, twin))
        if early:
            self.old.append((delta.copy(), twin.copy()))

    def step(self, i: int, delta: Crdt | None) -> None:
        """A pruning step's delta (no twin: the shadows know nothing of pruning)."""
        if delta is not None:
            self.queue.append((i, delta, None))

    def deliver(self, to: tuple[int, ...], everything: bool = True) -> None:
        sends = [(t, d, w) for frm, d, w in self.queue for t in to if t != frm]
        sends += self.rng.sample(sends, len(sends) // 3)  # some twice
        self.rng.shuffle(sends)
        if not everything:
            sends = sends[: len(sends) // 2]
        else:
            self.queue = []
        for t, delta, twin in sends:
            self.real[t].receive(decode(encode(delta)))
            if twin is not None:
                self.shadow[t].receive(twin)
        if self.rng.random() < 0.5:
            self.snapshots.append(self.real[self.rng.choice(to)].state.copy())


@pytest.mark.parametrize("kind", DOT_KINDS, ids=lambda k: k.__name__)
@settings(max_examples=60, deadline=None)
@given(
    early=ops,
    later=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 4)), max_size=20),
    rng=st.randoms(use_true_random=False),
)
def test_pruning_removed_nodes_keeps_values_and_old_deltas_do_not_resurrect(
    kind: type[Crdt],
    early: list[tuple[int, int, int]],
    later: list[tuple[int, int, int]],
    rng: random.Random,
) -> None:
    """Nodes 3 and 4 write, then leave; node 0 folds their dots while 0-2 keep writing. The
    values read just before and after each fold are equal; at the end every replica holds
    what a replica that never pruned holds (so an element the leavers added and someone
    removed stays removed), even after every old, unpruned delta of the leavers is delivered
    again; no dot or context entry of the leavers is left."""
    p = Pruned(kind, rng)
    for i, what, arg in early:
        p.write(i, what, arg, early=True)
        if rng.random() < 0.2:
            p.deliver((0, 1, 2, 3, 4), everything=False)
    p.deliver(STAYERS)  # the leavers' writes reached the others before they left
    for r in LEAVERS:  # their whole states, as a replica away all along would push them
        p.old.append((p.real[r].state.copy(), p.shadow[r].state.copy()))
    owner = NODES[0]
    steps: list[tuple[str, int, int, int]] = [("write", i, w, a) for i, w, a in later]
    steps += [("start", 0, r, 0) for r in LEAVERS]
    steps += [("see", i, r, 0) for i in (1, 2) for r in LEAVERS]
    rng.shuffle(steps)
    for step, i, a, b in steps:
        state: Any = p.real[i].state
        if step == "write":
            p.write(i, a, b)
        elif step == "start":
            p.step(i, state.start_pruning(NODES[a], owner))
        else:
            p.step(i, state.see_pruning(NODES[a], NODES[i]))
        if rng.random() < 0.3:
            p.deliver(STAYERS, everything=rng.random() < 0.5)
    p.deliver(STAYERS)
    for r in LEAVERS:
        for i in (1, 2):
            p.step(i, p.real[i].state.see_pruning(NODES[r], NODES[i]))  # type: ignore[union-attr]
    p.deliver(STAYERS)
    for r in LEAVERS:
        state = p.real[0].state
        marker = state.pruning.get(NODES[r])
        if marker is None:
            continue  # the leaver wrote nothing this type keeps
        assert marker[1] == {NODES[i] for i in STAYERS}
        before = [p.real[i].state.value for i in STAYERS]
        p.step(0, state.prune(NODES[r], until=10_000))
        p.deliver(STAYERS)
        assert [p.real[i].state.value for i in STAYERS] == before
    # Life goes on: writes, then every old delta of anyone (the leavers' included) again.
    for i, what, arg in later[:8]:
        p.write(i, what, arg)
    for delta, twin in p.old:
        p.queue.append((3, delta, twin))
    p.deliver(STAYERS)
    states = [p.real[i].state for i in STAYERS]
    assert states[0] == states[1] == states[2]
    assert [s.value for s in states] == [p.shadow[i].state.value for i in STAYERS]
    assert not _dots_of_leavers(states[0])
    # Merges stay a semilattice with pruning in the mix (states caught before, during and
    # after the folds).
    for _ in range(3):
        if len(p.snapshots) >= 3:
            a, b, c = rng.sample(p.snapshots, 3)
            assert merged(a, b) == merged(b, a)
            assert merged(merged(a, b), c) == merged(a, merged(b, c))
            assert merged(a, a) == a
            assert decode(encode(a)) == a
            assert fingerprint(merged(a, b)) == fingerprint(merged(b, a))


@pytest.mark.parametrize("kind", DOT_KINDS, ids=lambda k: k.__name__)
def test_set_flag_and_map_state_stays_bounded_as_writers_come_and_go(kind: type[Crdt]) -> None:
    """Two hundred writers that each join, write, and leave (their last adds still live):
    once each is folded and its marker's time is past, the state holds the two writers still
    there and what is live, whatever came and went: under 40 bytes per live element plus
    200 bytes (a set of 20 live elements: < 1 kB; without pruning it grows by ~20 bytes per
    writer that ever wrote)."""
    a, b = kind(), kind()
    for n in range(200):
        writer = bytes([0xF0]) + n.to_bytes(15, "big")
        w = Replica(kind, 0)
        w.node = writer
        w.state = a.copy()
        delta: Any = w.apply(n % 2, n % 5)  # an add (or enable or update) by the writer
        a.merge(delta)
        b.merge(delta)
        b.merge(delta)  # a repeat
        assert isinstance(a, (ORSet, Flag, ORMap))
        assert isinstance(b, (ORSet, Flag, ORMap))
        marker = a.start_pruning(writer, NODES[0])
        assert marker is not None
        b.merge(marker)
        seen = b.see_pruning(writer, NODES[1])
        assert seen is not None
        a.merge(seen)
        value = a.value
        folded = a.prune(writer, until=n)
        assert folded is not None
        b.merge(folded)
        a.forget_pruned(n)
        b.forget_pruned(n)
        assert a.value == b.value == value
    assert a == b
    assert not _dots_of_leavers(a)
    writers = {n for n, _k in _all_dots(a)} | _all_vv(a)
    assert writers <= {NODES[0]}, writers
    assert len(encode(a)) < 200 + 40 * max(len(a.value) if not isinstance(a, Flag) else 1, 1)


def _all_dots(state: Any) -> set[Dot]:
    stores: list[Any] = (
        [state.keys, *state.values.values()] if isinstance(state, ORMap) else [state]
    )
    out: set[Dot] = set()
    for s in stores:
        if isinstance(s, Flag):
            out |= s.dots | s.cc.cloud
        elif isinstance(s, ORSet):
            out |= {d for ds in s.entries.values() for d in ds} | s.cc.cloud
    return out


def _all_vv(state: Any) -> set[bytes]:
    stores: list[Any] = (
        [state.keys, *state.values.values()] if isinstance(state, ORMap) else [state]
    )
    out: set[bytes] = set()
    for s in stores:
        if isinstance(s, (Flag, ORSet)):
            out |= s.cc.vv.keys()
        elif isinstance(s, PNCounter):
            out |= s.up.keys() | s.down.keys()
    return out


def test_a_remove_made_while_the_fold_was_under_way_still_removes() -> None:
    """A holder removes an element the leaver added after saying it saw the pruning but
    before the fold reached it, and its delta is lost: its whole state, pushed later, still
    removes the element the owner renamed (its context's version vector of the leaver stands
    for the renamed dots), and the holder's own state agrees once the fold reaches it."""
    a, b, r = ORSet(), ORSet(), ORSet()
    for delta in (r.add(NODES[3], b"x"), r.add(NODES[3], b"y")):
        a.merge(delta)
        b.merge(delta)
    b.merge(a.start_pruning(NODES[3], NODES[0]))
    a.merge(b.see_pruning(NODES[3], NODES[1]))
    b.remove(b"x")  # its delta never arrives
    folded = a.prune(NODES[3], until=5)
    assert folded is not None
    assert a.value == {b"x", b"y"}
    pushed = b.copy()  # b's state as it was before the fold reached it
    b.merge(decode(encode(folded)))
    assert b.value == {b"y"}
    a.merge(decode(encode(pushed)))
    assert a.value == {b"y"}
    assert a == b
    assert not _dots_of_leavers(a)
    assert not _dots_of_leavers(b)
