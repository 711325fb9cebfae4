"""Delta-state CRDTs: counters, sets, registers, flags and maps that converge without a server.

Theory of operation
-------------------
Each type is a join semilattice: `merge` is commutative, associative and idempotent, so replicas
that have merged the same states hold the same value whatever the order, the repeats or the
grouping of what they received. Every mutation changes the local state and returns a *delta*:
a small state of the same type whose merge into any replica has the mutation's effect (the
delta-state CRDTs of Almeida, Shoker and Baquero, "Delta State Replicated Data Types", 2018).
Deltas are states, so they fold into each other (`merge` of two deltas is one delta carrying
both) and a replica that missed some recovers by merging a full state.

- `PNCounter`: per node, the sum of its increments and the sum of its decrements; the value is
  their difference. A node only ever raises its own two entries; merge takes the maxima.
  The entries of a node that left are folded away (below).
- `ORSet` (the "optimized", add-wins observed-remove set): each present element carries the
  dots (node, n) of the adds that put it there, and a causal context records every dot the
  replica has seen. Merge keeps a dot that both sides hold, or that one side holds and the
  other has not seen: a dot the other side has seen and no longer holds was removed. So a
  remove takes away exactly the adds it observed, and an add concurrent with it survives.
  Removes leave no tombstone: the context is a version vector plus the few dots seen out of
  order, one integer per node that ever wrote.
- `Flag` (enable-wins): an ORSet of one implicit element. Enabling adds a dot; disabling
  removes the dots seen; an enable concurrent with a disable wins.
- `LWWRegister`: a value and the hybrid-logical-clock stamp it was written at; merge keeps the
  larger stamp (node id breaks ties, so the order is total).
- `ORMap`: keys as an add-wins ORSet, each key's value a counter, set or register merged on its
  own. Updating a key adds it again; removing a key hides it (its value's state stays, so
  a key removed and updated concurrently comes back with both sides' updates, and a counter
  re-added after a remove resumes from the value it had).

Pruning a counter's removed nodes. A counter keeps two integers per node that ever wrote it;
a node that left never writes again (under that run), but its entries cannot simply be
dropped: a replica that has not merged them yet would bring them back, and dropping them
changes the value. So they are folded, in three steps that are all deltas (after Akka's
distributed data, `PruningState` and `RemovedNodePruning`, where a removed node's
`GCounter` entry is collapsed into the pruning owner's):
1. `start_pruning(R, owner)`: a marker R -> (owner, {owner}); markers of two owners merge to
   the lower owner, so holders agree on one.
2. `see_pruning(R, holder)`: each holder adds itself to the marker's `seen`, in a delta that
   also carries its own entries of R, so the owner ends with the largest entry of R any
   holder had.
3. `prune(R, until)` by the owner once every holder saw: R's sums are added to the owner's own
   entries (the value does not move) and a fold marker R -> (until, up, down) replaces the
   pending one. Every merge then drops R's entries that are not above the folded sums, so a
   replica that still held R's old entries converges to the same value, and a node that comes
   back under R's id (a kept identity) writes on top of the folded sums (its deltas carry the
   marker) and counts only what it adds. `forget_pruned(now)` drops a marker past its time,
   unless R wrote again: after that, the state holds nothing of R.
Why a fold into the owner rather than a shared "departed" entry: a shared entry written by
several pruners cannot be merged by maximum without knowing which nodes each folded (a sum
of sums), which is per-node state again; the owner's own entry is written by one node only,
so the maximum stays right. The price is agreement before the fold: the owner folds only
after every holder it knows saw the marker (the replica side adds: only nodes that left a
while ago, and only while no member is suspect or dead, so two sides of a partition never
fold one node twice). The one limit, as in Akka: a replica away for longer than a marker's
lifetime that still holds R's old entries would count them again after the marker is gone.

Sets, flags and maps prune the same way (`_Prunable` holds the agreement, steps 1 and 2, for
every type). Their per-node state is the dots R made and R's entry in the causal context;
the fold (`_fold_dots`) gives each of R's live dots a new dot of the owner's (Akka's ORSet
re-adds the element under the pruning owner), drops R from the context, and leaves a marker
R -> (until, top, renamed): which of R's dots became which owner dot, up to which of R's dots
it covered. A state or delta that lacks the marker was made before the fold, and is renamed
before it is merged: R's dots up to top become their owner dots or, if not renamed (removed
before the fold), go; its context's R entries become the renamed dots they had seen. So an
old add of R does not bring back an element removed since, and a remove of one of R's adds
made while the fold was under way removes the owner's dot that replaced it (Akka drops such
a remove). A map's agreement is its own; its keys fold as a set and each counter or set value
as itself. A node back under R's id numbers its dots from top on, and its deltas carry the
marker so no replica renames them.

Encoding is msgpack: `encode` writes [type tag, node table, body], each node id written once and
dots as (index, n) pairs; `decode` checks the shape and raises ProtocolError on anything else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, ClassVar, TypeAlias, cast

import msgpack

from irismesh.data.clock import Stamp
from irismesh.errors import ProtocolError

__all__ = [
    "CausalContext",
    "Crdt",
    "Element",
    "Flag",
    "LWWRegister",
    "ORMap",
    "ORSet",
    "PNCounter",
    "Prunable",
    "decode",
    "encode",
]

Dot: TypeAlias = tuple[bytes, int]
Element: TypeAlias = bytes | str | int  # what a set holds and a map is keyed by
_MAX_NODE = 64  # bytes of a node id on the wire


class CausalContext:
    """The dots a replica has seen: a version vector plus the dots past its gaps."""

    __slots__ = ("cloud", "vv")

    def __init__(self, vv: dict[bytes, int] | None = None, cloud: set[Dot] | None = None) -> None:
        self.vv: dict[bytes, int] = vv if vv is not None else {}
        self.cloud: set[Dot] = cloud if cloud is not None else set()

    def seen(self, dot: Dot) -> bool:
        return dot[1] <= self.vv.get(dot[0], 0) or dot in self.cloud

    def next_dot(self, node: bytes) -> Dot:
        """A new dot of `node` (this replica's own: its dots are never past a gap)."""
        n = self.vv.get(node, 0) + 1
        self.vv[node] = n
        return (node, n)

    def join(self, other: CausalContext) -> None:
        vv = self.vv
        for node, n in other.vv.items():
            if n > vv.get(node, 0):
                vv[node] = n
        if other.cloud:
            self.cloud |= other.cloud
        if self.cloud:
            self.compact()

    def compact(self) -> None:
        """Fold the dots that continue the version vector into it."""
        vv = self.vv
        for node, n in sorted(self.cloud):
            have = vv.get(node, 0)
            if n == have + 1:
                vv[node] = n
                self.cloud.discard((node, n))
            elif n <= have:
                self.cloud.discard((node, n))

    def copy(self) -> CausalContext:
        return CausalContext(dict(self.vv), set(self.cloud))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CausalContext):
            return NotImplemented
        return self.vv == other.vv and self.cloud == other.cloud

    __hash__ = None  # type: ignore[assignment]


def _join_dots(
    ours: set[Dot], our_cc: CausalContext, theirs: set[Dot], their_cc: CausalContext
) -> set[Dot]:
    """The dots of one element after a merge: held by both, or by one and unseen by the other."""
    kept = ours & theirs
    for dot in ours:
        if dot not in kept and not their_cc.seen(dot):
            kept.add(dot)
    for dot in theirs:
        if dot not in kept and not our_cc.seen(dot):
            kept.add(dot)
    return kept


Pruning: TypeAlias = dict[bytes, tuple[bytes, frozenset[bytes]]]


class _Prunable:
    """The agreement half of pruning a removed node, the same for every type that keeps
    per-node state: `pruning` maps a removed node to (the holder that will fold it, the
    holders that saw so). A type supplies what is its own: whether it holds anything of a
    node (`_holds`), whether it folded one already (`_is_pruned`), a delta of what it holds of
    one (`_of`) and the fold itself (`_fold`)."""

    __slots__ = ()
    pruning: Pruning

    def _holds(self, removed: bytes) -> bool:
        raise NotImplementedError

    def _is_pruned(self, removed: bytes) -> bool:
        raise NotImplementedError

    def _of(self, removed: bytes) -> Any:
        raise NotImplementedError

    def _fold(self, removed: bytes, owner: bytes, until: int) -> Any:
        raise NotImplementedError

    def start_pruning(self, removed: bytes, owner: bytes) -> Any:
        """Propose that `owner` folds what `removed` (a node that left) wrote; None if there
        is nothing to fold or a lower owner is at it already. Returns a delta."""
        if self._is_pruned(removed) or not self._holds(removed):
            return None
        current = self.pruning.get(removed)
        if current is not None and current[0] <= owner:
            return None
        self.pruning[removed] = (owner, frozenset({owner}))
        return self._marker(removed)

    def see_pruning(self, removed: bytes, node: bytes) -> Any:
        """Record that `node` (a holder) saw the pruning of `removed`: the delta carries what
        `node` holds of `removed`, so the owner folds everything any holder had."""
        current = self.pruning.get(removed)
        if current is None or node in current[1]:
            return None
        self.pruning[removed] = (current[0], current[1] | {node})
        return self._marker(removed)

    def prune(self, removed: bytes, until: int) -> Any:
        """As the owner: fold what `removed` wrote into the owner's own (the value does not
        change) and keep a marker until `until` (ms) by which merges clean what arrives."""
        current = self.pruning.pop(removed, None)
        if current is None or self._is_pruned(removed):
            return None
        return self._fold(removed, current[0], until)

    def _marker(self, removed: bytes) -> Any:
        delta = self._of(removed)
        delta.pruning[removed] = self.pruning[removed]
        return delta


def _merge_pruning(mine: Pruning, theirs: Pruning) -> None:
    """Two holders' proposals: the lower owner wins; one owner's `seen` sets unite."""
    for removed, (owner, seen) in theirs.items():
        current = mine.get(removed)
        if current is None or owner < current[0]:
            mine[removed] = (owner, seen)
        elif owner == current[0] and not seen <= current[1]:
            mine[removed] = (owner, current[1] | seen)


class PNCounter(_Prunable):
    """A counter that goes up and down, whose removed nodes' entries can be folded away."""

    TAG: ClassVar[int] = 1
    __slots__ = ("down", "pruned", "pruning", "up")

    def __init__(self) -> None:
        self.up: dict[bytes, int] = {}
        self.down: dict[bytes, int] = {}
        # A removed node -> (the holder that will fold its entries, the holders that saw so).
        self.pruning: dict[bytes, tuple[bytes, frozenset[bytes]]] = {}
        # A removed node whose entries were folded into its owner's -> (until when, in ms,
        # the marker is kept; the sums folded, up and down): merges drop its entries up to them.
        self.pruned: dict[bytes, tuple[int, int, int]] = {}

    @property
    def value(self) -> int:
        value = sum(self.up.values()) - sum(self.down.values())
        for removed, (_until, up, down) in self.pruned.items():
            # A node that came back writes on top of what was folded: count only the rest.
            if removed in self.up:
                value -= up
            if removed in self.down:
                value += down
        return value

    def add(self, node: bytes, amount: int) -> PNCounter:
        """Add `amount` (negative: subtract) as `node`; returns the delta."""
        delta = PNCounter()
        folded = self.pruned.get(node)
        if amount >= 0:
            base = self.up.get(node, 0)
            if folded is not None:
                base = max(base, folded[1])
            total = self.up[node] = base + amount
            delta.up[node] = total
        else:
            base = (
                self.down.get(node, 0) if folded is None else max(self.down.get(node, 0), folded[2])
            )
            total = self.down[node] = base - amount
            delta.down[node] = total
        if folded is not None:  # its entries were folded: receivers must know what of them
            delta.pruned[node] = folded
        return delta

    # Pruning (see the module's docstring): start, see, fold; every step returns a delta.

    def _holds(self, removed: bytes) -> bool:
        return removed in self.up or removed in self.down

    def _is_pruned(self, removed: bytes) -> bool:
        return removed in self.pruned

    def _of(self, removed: bytes) -> PNCounter:
        delta = PNCounter()
        if removed in self.up:
            delta.up[removed] = self.up[removed]
        if removed in self.down:
            delta.down[removed] = self.down[removed]
        return delta

    def _fold(self, removed: bytes, owner: bytes, until: int) -> PNCounter:
        self.pruning.pop(removed, None)
        delta = PNCounter()
        sums = []
        for mine, theirs in ((self.up, delta.up), (self.down, delta.down)):
            folded = mine.pop(removed, 0)
            sums.append(folded)
            if folded or owner in mine:
                mine[owner] = theirs[owner] = mine.get(owner, 0) + folded
        self.pruned[removed] = delta.pruned[removed] = (until, sums[0], sums[1])
        return delta

    def forget_pruned(self, now: int) -> int:
        """Drop the fold markers past their time (a local step: not a delta), except those
        of a node that came back and wrote again (its entries need them); how many went."""
        gone = [
            r
            for r, (until, _up, _down) in self.pruned.items()
            if until <= now and r not in self.up and r not in self.down
        ]
        for removed in gone:
            del self.pruned[removed]
        return len(gone)

    def merge(self, other: PNCounter) -> None:
        for mine, theirs in ((self.up, other.up), (self.down, other.down)):
            for node, n in theirs.items():
                if n > mine.get(node, 0):
                    mine[node] = n
        if other.pruned:
            pruned = self.pruned
            for removed, marker in other.pruned.items():
                held = pruned.get(removed)
                if held is None:
                    pruned[removed] = marker
                elif marker != held:
                    pruned[removed] = (
                        max(held[0], marker[0]),
                        max(held[1], marker[1]),
                        max(held[2], marker[2]),
                    )
        if other.pruning:
            _merge_pruning(self.pruning, other.pruning)
        if self.pruned:
            up, down = self.up, self.down
            for removed, (_until, folded_up, folded_down) in self.pruned.items():
                if up.get(removed, 0) <= folded_up:
                    up.pop(removed, None)
                if down.get(removed, 0) <= folded_down:
                    down.pop(removed, None)
                self.pruning.pop(removed, None)

    def copy(self) -> PNCounter:
        c = PNCounter()
        c.up, c.down = dict(self.up), dict(self.down)
        c.pruning, c.pruned = dict(self.pruning), dict(self.pruned)
        return c

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PNCounter):
            return NotImplemented
        return (
            _nonzero(self.up) == _nonzero(other.up)
            and _nonzero(self.down) == _nonzero(other.down)
            and self.pruning == other.pruning
            and self.pruned == other.pruned
        )

    __hash__ = None  # type: ignore[assignment]

    def _canon(self) -> list[Any]:
        canon: list[Any] = [sorted(_nonzero(self.up).items()), sorted(_nonzero(self.down).items())]
        if self.pruning or self.pruned:
            pruning = sorted([r, o, sorted(seen)] for r, (o, seen) in self.pruning.items())
            canon += [pruning, sorted([r, list(m)] for r, m in self.pruned.items())]
        return canon

    def _body(self, nodes: _Nodes) -> list[Any]:
        body: list[Any] = [
            {nodes.index(k): v for k, v in self.up.items()},
            {nodes.index(k): v for k, v in self.down.items()},
        ]
        if self.pruning or self.pruned:  # absent unless used: the earlier form otherwise
            body.append(
                {
                    nodes.index(r): [nodes.index(o), [nodes.index(n) for n in seen]]
                    for r, (o, seen) in self.pruning.items()
                }
            )
            body.append({nodes.index(r): list(marker) for r, marker in self.pruned.items()})
        return body

    @classmethod
    def _from_body(cls, body: Any, nodes: list[bytes]) -> PNCounter:
        if not isinstance(body, list) or len(body) not in (2, 4):
            raise ProtocolError("bad_data", "counter")
        c = cls()
        c.up = {_node(nodes, k): _count(v) for k, v in _items(body[0])}
        c.down = {_node(nodes, k): _count(v) for k, v in _items(body[1])}
        if len(body) == 4:
            for r, marker in _items(body[2]):
                owner, seen = _pair(marker)
                if not isinstance(seen, list):
                    raise ProtocolError("bad_data", "pruning")
                c.pruning[_node(nodes, r)] = (
                    _node(nodes, owner),
                    frozenset(_node(nodes, n) for n in seen),
                )
            for r, marker in _items(body[3]):
                if not isinstance(marker, list) or len(marker) != 3:
                    raise ProtocolError("bad_data", "pruned")
                c.pruned[_node(nodes, r)] = (
                    _count(marker[0]),
                    _count(marker[1]),
                    _count(marker[2]),
                )
        return c


# Pruning a removed node from a dot store (a set's entries, a flag's dots) and its context.
# The fold gives each live dot of the removed node R a new dot of the owner O and drops R from
# the context; the marker R -> (until, top, renamed) says which of R's dots became which
# (renamed: R's counter -> O's dot) and up to which of R's dots (top) the fold covered. A
# state or delta that does not carry the marker was made before the fold: before it is merged
# its dots of R up to top are renamed (or dropped: R's dots not renamed were removed before
# the fold), and its context's dots of R become the renamed dots they stand for. So a remove
# of one of R's adds made before the fold removes the owner's new dot, and an old add of R
# that was removed since does not come back. A state that carries the marker was cleaned
# already: its dots of R above top are new ones (R came back under its id) and are kept.
DotMarker: TypeAlias = tuple[int, int, dict[int, Dot]]  # until (ms), top, renamed


def _rename(dots: set[Dot], markers: dict[bytes, DotMarker]) -> set[Dot]:
    out: set[Dot] = set()
    for dot in dots:
        marker = markers.get(dot[0])
        if marker is None or dot[1] > marker[1]:
            out.add(dot)
        else:
            new = marker[2].get(dot[1])
            if new is not None:
                out.add(new)
    return out


def _rename_cc(cc: CausalContext, markers: dict[bytes, DotMarker]) -> None:
    for removed, (_until, top, renamed) in markers.items():
        v = cc.vv.get(removed, 0)
        if v and v <= top:  # above top it was made after the fold (R came back): clean
            del cc.vv[removed]
            cc.cloud.update(d for k, d in renamed.items() if k <= v)
        loose = [k for node, k in cc.cloud if node == removed and k <= top]
        for k in loose:
            cc.cloud.discard((removed, k))
            new = renamed.get(k)
            if new is not None:
                cc.cloud.add(new)
    cc.compact()


def _touches(
    markers: dict[bytes, DotMarker], cc: CausalContext, stores: Iterable[set[Dot]]
) -> bool:
    """Whether a state or delta holds dots of a removed node up to its marker's top."""
    for removed, (_until, top, _renamed) in markers.items():
        if 0 < cc.vv.get(removed, 0) <= top:
            return True
    for dots in (cc.cloud, *stores):
        for node, k in dots:
            marker = markers.get(node)
            if marker is not None and k <= marker[1]:
                return True
    return False


def _merge_dot_markers(mine: dict[bytes, DotMarker], theirs: dict[bytes, DotMarker]) -> None:
    for removed, marker in theirs.items():
        held = mine.get(removed)
        if held is None:
            mine[removed] = marker
        elif held != marker:  # two folds of one node (holders that disagreed on the owner)
            renamed = dict(marker[2])
            for k, dot in held[2].items():
                other = renamed.get(k)
                if other is None or dot < other:
                    renamed[k] = dot
            mine[removed] = (max(held[0], marker[0]), max(held[1], marker[1]), renamed)


def _forget_markers(pruned: dict[bytes, DotMarker], now: int) -> int:
    """Drop a dot store's fold markers whose time has passed; how many went."""
    gone = [removed for removed, marker in pruned.items() if marker[0] <= now]
    for removed in gone:
        del pruned[removed]
    return len(gone)


def _settle(cc: CausalContext, pruned: dict[bytes, DotMarker]) -> None:
    """A node back under a pruned id numbers its dots from the marker's top on: start its
    version vector there, so every replica's context compacts them alike."""
    changed = False
    for removed, (_until, top, _renamed) in pruned.items():
        if cc.vv.get(removed, 0) < top and any(node == removed for node, _k in cc.cloud):
            cc.vv[removed] = top
            changed = True
    if changed:
        cc.compact()


def _holds_dots(cc: CausalContext, removed: bytes) -> bool:
    return removed in cc.vv or any(node == removed for node, _k in cc.cloud)


def _dots_of(
    stores: dict[Any, set[Dot]], cc: CausalContext, removed: bytes
) -> tuple[dict[Any, set[Dot]], CausalContext]:
    """What a dot store and its context hold of `removed`: a delta's parts."""
    picked = {key: {d for d in dots if d[0] == removed} for key, dots in stores.items()}
    context = CausalContext({removed: cc.vv[removed]} if removed in cc.vv else {})
    context.cloud = {d for d in cc.cloud if d[0] == removed}
    return {key: dots for key, dots in picked.items() if dots}, context


def _fold_dots(
    stores: dict[Any, set[Dot]], cc: CausalContext, removed: bytes, owner: bytes, until: int
) -> tuple[dict[Any, set[Dot]], DotMarker]:
    """As the owner: give each live dot of `removed` a new dot of the owner's, drop `removed`
    from the context; the new dots per key (a delta's entries) and the marker."""
    top = max([cc.vv.get(removed, 0), *(k for node, k in cc.cloud if node == removed)])
    renamed: dict[int, Dot] = {}
    new_dots: dict[Any, set[Dot]] = {}
    for key, dots in stores.items():
        theirs = sorted(d for d in dots if d[0] == removed)
        if not theirs:
            continue
        new: set[Dot] = set()
        for dot in theirs:
            renamed[dot[1]] = mine = cc.next_dot(owner)
            new.add(mine)
        dots.difference_update(theirs)
        dots |= new
        new_dots[key] = new
    cc.vv.pop(removed, None)
    cc.cloud = {d for d in cc.cloud if d[0] != removed}
    return new_dots, (until, top, renamed)


def _pruning_out(pruning: Pruning, nodes: _Nodes) -> dict[int, list[Any]]:
    return {
        nodes.index(r): [nodes.index(o), [nodes.index(n) for n in seen]]
        for r, (o, seen) in pruning.items()
    }


def _pruning_in(body: Any, nodes: list[bytes]) -> Pruning:
    pruning: Pruning = {}
    for r, marker in _items(body):
        owner, seen = _pair(marker)
        if not isinstance(seen, list):
            raise ProtocolError("bad_data", "pruning")
        pruning[_node(nodes, r)] = (_node(nodes, owner), frozenset(_node(nodes, n) for n in seen))
    return pruning


def _dot_markers_out(markers: dict[bytes, DotMarker], nodes: _Nodes) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for r, (until, top, renamed) in markers.items():
        flat: list[int] = []
        for k, (node, n) in renamed.items():
            flat += (k, nodes.index(node), n)
        out[nodes.index(r)] = [until, top, flat]
    return out


def _dot_markers_in(body: Any, nodes: list[bytes]) -> dict[bytes, DotMarker]:
    markers: dict[bytes, DotMarker] = {}
    for r, marker in _items(body):
        if not isinstance(marker, list) or len(marker) != 3 or not isinstance(marker[2], list):
            raise ProtocolError("bad_data", "pruned")
        until, top, flat = marker
        if len(flat) % 3:
            raise ProtocolError("bad_data", "renamed")
        renamed = {
            _count(flat[i]): (_node(nodes, flat[i + 1]), _count(flat[i + 2]))
            for i in range(0, len(flat), 3)
        }
        markers[_node(nodes, r)] = (_count(until), _count(top), renamed)
    return markers


def _canon_pruning(pruning: Pruning) -> list[Any]:
    return sorted([r, o, sorted(seen)] for r, (o, seen) in pruning.items())


def _canon_dot_markers(markers: dict[bytes, DotMarker]) -> list[Any]:
    return sorted(
        [r, u, t, sorted([k, *d] for k, d in m.items())] for r, (u, t, m) in markers.items()
    )


def _present(entries: dict[Element, set[Dot]]) -> dict[Element, set[Dot]]:
    """Entries without the empty ones a remove's delta lists to name what it removed."""
    return {e: d for e, d in entries.items() if d}


def _nonzero(d: dict[bytes, int]) -> dict[bytes, int]:
    return {k: v for k, v in d.items() if v}


class ORSet(_Prunable):
    """An add-wins observed-remove set, whose removed nodes' dots can be folded away."""

    TAG: ClassVar[int] = 2
    __slots__ = ("cc", "entries", "pruned", "pruning")

    def __init__(self) -> None:
        self.entries: dict[Element, set[Dot]] = {}
        self.cc = CausalContext()
        self.pruning: Pruning = {}
        self.pruned: dict[bytes, DotMarker] = {}  # see the fold of a dot store, above

    @property
    def value(self) -> frozenset[Element]:
        return frozenset(self.entries)

    def __contains__(self, element: object) -> bool:
        return element in self.entries

    def add(self, node: bytes, element: Element) -> ORSet:
        """Add `element` as `node`; returns the delta (the new dot, replacing the ones seen)."""
        marker = self.pruned.get(node)
        if marker is not None and self.cc.vv.get(node, 0) < marker[1]:
            self.cc.vv[node] = marker[1]  # back under a pruned id: number on from the fold
        dot = self.cc.next_dot(node)
        delta = ORSet()
        old = self.entries.get(element)
        delta.cc.cloud = {dot, *old} if old else {dot}
        delta.entries[element] = {dot}
        self.entries[element] = {dot}
        if marker is not None:  # receivers must not take its new dots for old ones
            delta.pruned[node] = marker
        return delta

    def remove(self, element: Element) -> ORSet:
        """Remove `element` as this replica has seen it; returns the delta (the dots removed)."""
        delta = ORSet()
        old = self.entries.pop(element, None)
        if old:
            delta.cc.cloud = set(old)
            delta.entries[element] = set()  # names the element, so a merge need not search
        return delta

    def clear(self) -> ORSet:
        delta = ORSet()
        for element, dots in self.entries.items():
            delta.cc.cloud |= dots
            delta.entries[element] = set()
        self.entries.clear()
        return delta

    def merge(self, other: ORSet) -> None:
        if other.pruning:
            _merge_pruning(self.pruning, other.pruning)
        if other.pruned or self.pruned:
            other = self._clean(other)
        entries, theirs, cc, their_cc = self.entries, other.entries, self.cc, other.cc
        if their_cc.vv or self._unresolved(other):
            # Their context may have seen dots of elements they do not list: walk them all.
            for element in [e for e in entries if e not in theirs]:
                kept = {d for d in entries[element] if not their_cc.seen(d)}
                if kept:
                    entries[element] = kept
                else:
                    del entries[element]
        for element, dots in theirs.items():
            mine = entries.get(element)
            kept = _join_dots(mine or set(), cc, dots, their_cc)
            if kept:
                entries[element] = kept
            elif mine is not None:
                del entries[element]
        cc.join(their_cc)
        if self.pruned:
            _settle(cc, self.pruned)
            for removed in self.pruned:
                self.pruning.pop(removed, None)

    def _clean(self, other: ORSet) -> ORSet:
        """Take in `other`'s fold markers (renaming this replica's dots by the new ones) and
        return `other` with its dots renamed by the markers it lacks."""
        new = {r: m for r, m in other.pruned.items() if r not in self.pruned}
        _merge_dot_markers(self.pruned, other.pruned)
        if new:
            for element in list(self.entries):
                dots = _rename(self.entries[element], new)
                if dots:
                    self.entries[element] = dots
                else:
                    del self.entries[element]
            _rename_cc(self.cc, new)
        old = {r: m for r, m in self.pruned.items() if r not in other.pruned}
        if old and _touches(old, other.cc, other.entries.values()):
            renamed = ORSet()
            renamed.entries = {e: _rename(d, old) for e, d in other.entries.items()}
            renamed.cc = other.cc.copy()
            _rename_cc(renamed.cc, old)
            return renamed
        return other

    def _unresolved(self, delta: ORSet) -> bool:
        """Whether `delta` (a context of loose dots) names a dot of an element it does not
        list; a delta made here lists each element it touches, so mostly not."""
        left = set(delta.cc.cloud)
        for element, dots in delta.entries.items():
            left -= dots
            mine = self.entries.get(element)
            if mine:
                left -= mine
            if not left:
                return False
        return bool(left)

    # Pruning (the fold of a dot store, above); `_Prunable` has the agreement.

    def _holds(self, removed: bytes) -> bool:
        return _holds_dots(self.cc, removed)

    def _is_pruned(self, removed: bytes) -> bool:
        return removed in self.pruned

    def _of(self, removed: bytes) -> ORSet:
        delta = ORSet()
        delta.entries, delta.cc = _dots_of(self.entries, self.cc, removed)
        return delta

    def _fold(self, removed: bytes, owner: bytes, until: int) -> ORSet:
        self.pruning.pop(removed, None)
        delta = ORSet()
        delta.entries, marker = _fold_dots(self.entries, self.cc, removed, owner, until)
        for dots in delta.entries.values():
            delta.cc.cloud |= dots
        self.pruned[removed] = delta.pruned[removed] = marker
        return delta

    def forget_pruned(self, now: int) -> int:
        """Drop the fold markers past their time (a local step); how many went."""
        return _forget_markers(self.pruned, now)

    def copy(self) -> ORSet:
        s = ORSet()
        s.entries = {e: set(d) for e, d in self.entries.items()}
        s.cc = self.cc.copy()
        s.pruning, s.pruned = dict(self.pruning), dict(self.pruned)
        return s

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ORSet):
            return NotImplemented
        return (
            _present(self.entries) == _present(other.entries)
            and self.cc == other.cc
            and self.pruning == other.pruning
            and self.pruned == other.pruned
        )

    __hash__ = None  # type: ignore[assignment]

    def _canon(self) -> list[Any]:
        present = _present(self.entries)
        entries = sorted([_order(e), e, sorted(d)] for e, d in present.items())
        canon: list[Any] = [entries, _canon_cc(self.cc)]
        if self.pruning or self.pruned:
            canon += [_canon_pruning(self.pruning), _canon_dot_markers(self.pruned)]
        return canon

    def _body(self, nodes: _Nodes) -> list[Any]:
        body: list[Any] = [
            [[e, _dots_out(d, nodes)] for e, d in self.entries.items()],
            _cc_out(self.cc, nodes),
        ]
        if self.pruning or self.pruned:  # absent unless used: the earlier form otherwise
            body += [_pruning_out(self.pruning, nodes), _dot_markers_out(self.pruned, nodes)]
        return body

    @classmethod
    def _from_body(cls, body: Any, nodes: list[bytes]) -> ORSet:
        if not isinstance(body, list) or len(body) not in (2, 4):
            raise ProtocolError("bad_data", "set")
        entries, cc = body[0], body[1]
        s = cls()
        if not isinstance(entries, list):
            raise ProtocolError("bad_data", "set entries")
        for item in entries:
            element, dots = _pair(item)
            s.entries[_element(element)] = _dots_in(dots, nodes)
        s.cc = _cc_in(cc, nodes)
        if len(body) == 4:
            s.pruning = _pruning_in(body[2], nodes)
            s.pruned = _dot_markers_in(body[3], nodes)
        return s


class Flag(_Prunable):
    """An enable-wins flag, whose removed nodes' dots can be folded away."""

    TAG: ClassVar[int] = 4
    __slots__ = ("cc", "dots", "pruned", "pruning")

    def __init__(self) -> None:
        self.dots: set[Dot] = set()
        self.cc = CausalContext()
        self.pruning: Pruning = {}
        self.pruned: dict[bytes, DotMarker] = {}

    @property
    def value(self) -> bool:
        return bool(self.dots)

    def enable(self, node: bytes) -> Flag:
        marker = self.pruned.get(node)
        if marker is not None and self.cc.vv.get(node, 0) < marker[1]:
            self.cc.vv[node] = marker[1]
        dot = self.cc.next_dot(node)
        delta = Flag()
        delta.cc.cloud = {dot, *self.dots}
        delta.dots = {dot}
        self.dots = {dot}
        if marker is not None:
            delta.pruned[node] = marker
        return delta

    def disable(self) -> Flag:
        delta = Flag()
        delta.cc.cloud = set(self.dots)
        self.dots = set()
        return delta

    def merge(self, other: Flag) -> None:
        if other.pruning:
            _merge_pruning(self.pruning, other.pruning)
        if other.pruned or self.pruned:
            other = self._clean(other)
        self.dots = _join_dots(self.dots, self.cc, other.dots, other.cc)
        self.cc.join(other.cc)
        if self.pruned:
            _settle(self.cc, self.pruned)
            for removed in self.pruned:
                self.pruning.pop(removed, None)

    def _clean(self, other: Flag) -> Flag:
        """As `ORSet._clean`, for the flag's one dot store."""
        new = {r: m for r, m in other.pruned.items() if r not in self.pruned}
        _merge_dot_markers(self.pruned, other.pruned)
        if new:
            self.dots = _rename(self.dots, new)
            _rename_cc(self.cc, new)
        old = {r: m for r, m in self.pruned.items() if r not in other.pruned}
        if old and _touches(old, other.cc, [other.dots]):
            renamed = Flag()
            renamed.dots, renamed.cc = _rename(other.dots, old), other.cc.copy()
            _rename_cc(renamed.cc, old)
            return renamed
        return other

    def _holds(self, removed: bytes) -> bool:
        return _holds_dots(self.cc, removed)

    def _is_pruned(self, removed: bytes) -> bool:
        return removed in self.pruned

    def _of(self, removed: bytes) -> Flag:
        delta = Flag()
        stores, delta.cc = _dots_of({0: self.dots}, self.cc, removed)
        delta.dots = stores.get(0, set())
        return delta

    def _fold(self, removed: bytes, owner: bytes, until: int) -> Flag:
        self.pruning.pop(removed, None)
        delta = Flag()
        stores = {0: self.dots}
        new, marker = _fold_dots(stores, self.cc, removed, owner, until)
        self.dots = stores[0]
        delta.dots = new.get(0, set())
        delta.cc.cloud = set(delta.dots)
        self.pruned[removed] = delta.pruned[removed] = marker
        return delta

    def forget_pruned(self, now: int) -> int:
        """Drop the fold markers past their time (a local step); how many went."""
        return _forget_markers(self.pruned, now)

    def copy(self) -> Flag:
        f = Flag()
        f.dots, f.cc = set(self.dots), self.cc.copy()
        f.pruning, f.pruned = dict(self.pruning), dict(self.pruned)
        return f

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Flag):
            return NotImplemented
        return (
            self.dots == other.dots
            and self.cc == other.cc
            and self.pruning == other.pruning
            and self.pruned == other.pruned
        )

    __hash__ = None  # type: ignore[assignment]

    def _canon(self) -> list[Any]:
        canon: list[Any] = [sorted(self.dots), _canon_cc(self.cc)]
        if self.pruning or self.pruned:
            canon += [_canon_pruning(self.pruning), _canon_dot_markers(self.pruned)]
        return canon

    def _body(self, nodes: _Nodes) -> list[Any]:
        body: list[Any] = [_dots_out(self.dots, nodes), _cc_out(self.cc, nodes)]
        if self.pruning or self.pruned:
            body += [_pruning_out(self.pruning, nodes), _dot_markers_out(self.pruned, nodes)]
        return body

    @classmethod
    def _from_body(cls, body: Any, nodes: list[bytes]) -> Flag:
        if not isinstance(body, list) or len(body) not in (2, 4):
            raise ProtocolError("bad_data", "flag")
        f = cls()
        f.dots, f.cc = _dots_in(body[0], nodes), _cc_in(body[1], nodes)
        if len(body) == 4:
            f.pruning = _pruning_in(body[2], nodes)
            f.pruned = _dot_markers_in(body[3], nodes)
        return f


class LWWRegister:
    """A last-writer-wins register ordered by hybrid logical clock stamps."""

    TAG: ClassVar[int] = 3
    __slots__ = ("stamp", "value")

    def __init__(self, stamp: Stamp | None = None, value: Any = None) -> None:
        self.stamp = stamp
        self.value = value

    def assign(self, stamp: Stamp, value: Any) -> LWWRegister:
        """Write `value` at `stamp` (or just after the value it replaces, if that is later:
        a write made after reading another orders after it whatever the clocks say)."""
        current = self.stamp
        if current is not None and stamp <= current:
            stamp = Stamp(current.wall, current.logical + 1, stamp.node)
        self.stamp, self.value = stamp, value
        return LWWRegister(stamp, value)

    def merge(self, other: LWWRegister) -> None:
        if other.stamp is not None and (self.stamp is None or other.stamp > self.stamp):
            self.stamp, self.value = other.stamp, other.value

    def copy(self) -> LWWRegister:
        return LWWRegister(self.stamp, self.value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LWWRegister):
            return NotImplemented
        return self.stamp == other.stamp and (self.stamp is None or self.value == other.value)

    __hash__ = None  # type: ignore[assignment]

    def _canon(self) -> list[Any]:
        return [] if self.stamp is None else [list(self.stamp), self.value]

    def _body(self, nodes: _Nodes) -> list[Any]:
        if self.stamp is None:
            return []
        wall, logical, node = self.stamp
        return [wall, logical, nodes.index(node), self.value]

    @classmethod
    def _from_body(cls, body: Any, nodes: list[bytes]) -> LWWRegister:
        if not isinstance(body, list) or len(body) not in (0, 4):
            raise ProtocolError("bad_data", "register")
        if not body:
            return cls()
        wall, logical, node, value = body
        return cls(Stamp(_count(wall), _count(logical), _node(nodes, node)), value)


MapValue: TypeAlias = PNCounter | ORSet | LWWRegister


class ORMap(_Prunable):
    """An add-wins map from keys to counters, sets or registers."""

    TAG: ClassVar[int] = 5
    __slots__ = ("keys", "pruning", "values")

    def __init__(self) -> None:
        self.keys = ORSet()
        self.values: dict[Element, MapValue] = {}
        # The agreement on folding a removed node is the map's; the folds and their markers
        # are its keys' and each value's own, so each merges on its own as before.
        self.pruning: Pruning = {}

    @property
    def value(self) -> dict[Element, Any]:
        values = self.values
        return {k: values[k].value for k in self.keys.entries if k in values}

    def entry(self, key: Element, kind: type[MapValue]) -> MapValue:
        """The state of `key`'s value, made empty of `kind` if the map has none yet."""
        value = self.values.get(key)
        if value is None:
            value = self.values[key] = kind()
        elif type(value) is not kind:
            raise TypeError(
                f"map key {key!r} holds a {type(value).__name__}, not a {kind.__name__}"
            )
        return value

    def updated(self, node: bytes, key: Element, change: MapValue) -> ORMap:
        """The delta of an update of `key`'s value (`change`, already applied to it)."""
        delta = ORMap()
        delta.keys = self.keys.add(node, key)
        delta.values[key] = change
        return delta

    def remove(self, key: Element) -> ORMap:
        delta = ORMap()
        delta.keys = self.keys.remove(key)
        return delta

    def merge(self, other: ORMap) -> None:
        if other.pruning:
            _merge_pruning(self.pruning, other.pruning)
        self.keys.merge(other.keys)
        values = self.values
        for key, theirs in other.values.items():
            mine = values.get(key)
            if mine is None or (type(mine) is not type(theirs) and theirs.TAG < mine.TAG):
                # new here, or written as two kinds at once (the lower tag wins): merged into
                # an empty one, which leaves its context compact
                mine = values[key] = type(theirs)()
            if type(mine) is type(theirs):
                mine.merge(theirs)  # type: ignore[arg-type]
        if self.pruning and self.keys.pruned:
            for removed in self.keys.pruned:
                self.pruning.pop(removed, None)

    # Pruning: the keys fold as a set, each counter or set value as itself.

    def _holds(self, removed: bytes) -> bool:
        return self.keys._holds(removed) or any(
            not isinstance(v, LWWRegister) and v._holds(removed) for v in self.values.values()
        )

    def _is_pruned(self, removed: bytes) -> bool:
        return removed in self.keys.pruned

    def _of(self, removed: bytes) -> ORMap:
        delta = ORMap()
        delta.keys = self.keys._of(removed)
        for key, value in self.values.items():
            if not isinstance(value, LWWRegister) and value._holds(removed):
                delta.values[key] = value._of(removed)
        return delta

    def _fold(self, removed: bytes, owner: bytes, until: int) -> ORMap:
        self.pruning.pop(removed, None)
        delta = ORMap()
        delta.keys = self.keys._fold(removed, owner, until)
        for key, value in self.values.items():
            if not isinstance(value, LWWRegister) and value._holds(removed):
                delta.values[key] = value._fold(removed, owner, until)
        return delta

    def forget_pruned(self, now: int) -> int:
        """Drop the fold markers past their time (the keys' and the values'); how many of
        the keys' went (one per node the map had folded)."""
        for value in self.values.values():
            if not isinstance(value, LWWRegister):
                value.forget_pruned(now)
        return self.keys.forget_pruned(now)

    @property
    def pruned(self) -> dict[bytes, DotMarker]:
        """The nodes folded away (the keys' markers)."""
        return self.keys.pruned

    def copy(self) -> ORMap:
        m = ORMap()
        m.keys = self.keys.copy()
        m.values = {k: v.copy() for k, v in self.values.items()}
        m.pruning = dict(self.pruning)
        return m

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ORMap):
            return NotImplemented
        return (
            self.keys == other.keys
            and self.values == other.values
            and self.pruning == other.pruning
        )

    __hash__ = None  # type: ignore[assignment]

    def _canon(self) -> list[Any]:
        values = sorted([_order(k), k, v.TAG, v._canon()] for k, v in self.values.items())
        canon: list[Any] = [self.keys._canon(), values]
        if self.pruning:
            canon.append(_canon_pruning(self.pruning))
        return canon

    def _body(self, nodes: _Nodes) -> list[Any]:
        body: list[Any] = [
            self.keys._body(nodes),
            [[k, v.TAG, v._body(nodes)] for k, v in self.values.items()],
        ]
        if self.pruning:  # absent unless used: the earlier form otherwise
            body.append(_pruning_out(self.pruning, nodes))
        return body

    @classmethod
    def _from_body(cls, body: Any, nodes: list[bytes]) -> ORMap:
        if not isinstance(body, list) or len(body) not in (2, 3):
            raise ProtocolError("bad_data", "map")
        keys, values = body[0], body[1]
        m = cls()
        if len(body) == 3:
            m.pruning = _pruning_in(body[2], nodes)
        m.keys = ORSet._from_body(keys, nodes)
        if not isinstance(values, list):
            raise ProtocolError("bad_data", "map values")
        for item in values:
            if not isinstance(item, list) or len(item) != 3:
                raise ProtocolError("bad_data", "map value")
            key, tag, inner = item
            kind = _TYPES.get(tag)
            if kind is None or kind is ORMap or kind is Flag:
                raise ProtocolError("bad_data", "map value type")
            m.values[_element(key)] = cast(MapValue, kind._from_body(inner, nodes))
        return m


Crdt: TypeAlias = PNCounter | ORSet | LWWRegister | Flag | ORMap
Prunable: TypeAlias = PNCounter | ORSet | Flag | ORMap  # the types that keep per-node state
_TYPES: dict[int, type[Crdt]] = {t.TAG: t for t in (PNCounter, ORSet, LWWRegister, Flag, ORMap)}


# ----------------------------------------------------------------- encoding


class _Nodes:
    """The node table of one encoding: each node id once, referred to by index."""

    __slots__ = ("ids", "order")

    def __init__(self) -> None:
        self.ids: dict[bytes, int] = {}
        self.order: list[bytes] = []

    def index(self, node: bytes) -> int:
        i = self.ids.get(node)
        if i is None:
            i = self.ids[node] = len(self.order)
            self.order.append(node)
        return i


def encode(state: Crdt) -> bytes:
    """The compact msgpack form of a state or delta."""
    nodes = _Nodes()
    body = state._body(nodes)
    packed: bytes = msgpack.packb([state.TAG, nodes.order, body], use_bin_type=True)
    return packed


def decode(data: bytes) -> Crdt:
    """A state or delta from `encode`; ProtocolError("bad_data") if `data` is not one."""
    try:
        tag, nodes, body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError("bad_data", type(exc).__name__) from None
    kind = _TYPES.get(tag) if type(tag) is int else None
    if kind is None or not isinstance(nodes, list):
        raise ProtocolError("bad_data", "type")
    for node in nodes:
        if type(node) is not bytes or not 0 < len(node) <= _MAX_NODE:
            raise ProtocolError("bad_data", "node id")
    try:
        return kind._from_body(body, nodes)
    except (ValueError, TypeError) as exc:  # unpacking a wrong shape
        raise ProtocolError("bad_data", str(exc)[:60]) from None


def fingerprint(state: Crdt) -> bytes:
    """A digest that equal states share, whatever order they were built in."""
    canon = msgpack.packb(state._canon(), use_bin_type=True)
    return hashlib.blake2b(canon, digest_size=16).digest()


def _order(e: Element) -> tuple[str, Element]:
    return (type(e).__name__, e)


def _canon_cc(cc: CausalContext) -> list[Any]:
    return [sorted(cc.vv.items()), sorted(cc.cloud)]


def _pair(body: Any) -> tuple[Any, Any]:
    if not isinstance(body, list) or len(body) != 2:
        raise ProtocolError("bad_data", "shape")
    return body[0], body[1]


def _items(d: Any) -> Iterable[tuple[Any, Any]]:
    if not isinstance(d, dict):
        raise ProtocolError("bad_data", "map")
    return d.items()


def _count(n: Any) -> int:
    if type(n) is not int or n < 0:
        raise ProtocolError("bad_data", "count")
    return n


def _node(nodes: list[bytes], i: Any) -> bytes:
    if type(i) is not int or not 0 <= i < len(nodes):
        raise ProtocolError("bad_data", "node index")
    return nodes[i]


def _element(e: Any) -> Element:
    if type(e) not in (bytes, str, int):
        raise ProtocolError("bad_data", "element")
    return cast(Element, e)


def _dots_out(dots: Iterable[Dot], nodes: _Nodes) -> list[int]:
    flat: list[int] = []
    for node, n in dots:
        flat += (nodes.index(node), n)
    return flat


def _dots_in(flat: Any, nodes: list[bytes]) -> set[Dot]:
    if not isinstance(flat, list) or len(flat) % 2:
        raise ProtocolError("bad_data", "dots")
    return {(_node(nodes, flat[i]), _count(flat[i + 1])) for i in range(0, len(flat), 2)}


def _cc_out(cc: CausalContext, nodes: _Nodes) -> list[Any]:
    return [{nodes.index(k): v for k, v in cc.vv.items()}, _dots_out(cc.cloud, nodes)]


def _cc_in(body: Any, nodes: list[bytes]) -> CausalContext:
    vv, cloud = _pair(body)
    return CausalContext(
        {_node(nodes, k): _count(v) for k, v in _items(vv)}, _dots_in(cloud, nodes)
    )
