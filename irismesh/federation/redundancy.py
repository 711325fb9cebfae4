"""Redundant gateways: one forwarder per direction, the others standing by with what it has
not yet delivered.

Two gateways of one mesh that export the same topics both receive every message published
there. Were both to send each message over their own links, each would be republished twice
in the importing mesh (by two gateway processes that cannot tell each other's copies apart).
So the gateways of a mesh elect, for each mesh they link to and each set of exported topics,
one *forwarder*: among the live gateways with a link to that mesh (up ones before down ones,
so a lone gateway in an outage still buffers), the one that started first, then the lowest
node id. Started first, rather than lowest id alone, so a gateway that starts late (and so
missed what was published before it) does not take the forwarding from one that has run
all along; it waits as a standby.

A standby keeps each message it would have sent, in arrival order, in a bounded buffer per
destination mesh. The forwarder tells its mesh's other gateways (a broadcast to the cluster
`_gateway`, a few times a second) the origin ids the far side has acknowledged, that is,
republished; the standbys drop those from their buffers. Every gateway also broadcasts, five
times a second, which meshes it has links to. When the forwarder goes, the next in line
sends its buffer first, then goes on forwarding. Gone means: its link down (it says so); it
closed (membership holds it "left"); SIGKILLed, which the mesh's membership sees first (its
broken links make the others probe it at once): held "dead", or "suspect" and silent for
`SUSPECT_SILENCE` (about half a second after the kill in all), else silent for `STALE_AFTER`
(a stalled process that membership still holds alive). What the dead one may not have
delivered is sent again, in the order it was published. Meanwhile the messages wait in
the standby's buffer, not lost. Any message of a fellow's is a sign of life: under a flood of
deliveries a forwarder's state messages may wait behind its acknowledgements, which are sent
merged (`merged`) so that the sync does not fall behind in the first place.

Why an elected forwarder and not an idempotency barrier spanning the importing mesh's
gateways: the forwarder's acknowledgements already say what was delivered, and one sender per
direction keeps each publisher's order with no merging on the far side, where a barrier
across the importing gateways would have to agree on every message before republishing it.

Resends are not doubles as a rule. A takeover sends what it held as *resent* crossings
(`crossing.RESENT`); the gateway of the far mesh that receives them asks its mesh's other
gateways (a survey of `_gateway`) which of them they have republished, once each has
republished what it had queued: the gateway that received from the dead forwarder lives on and
knows exactly what came before the crash. Those are dropped there
(`resends_dropped_republished_elsewhere`), the others republished in order. What it cannot do:
when the far gateway that republished them is gone too (the importing end of the pair died), or
does not answer within a second, the resends it may have republished are republished again and
delivered twice (`resends_unchecked` on the far side counts them when a gateway asked did not
answer, or none was there to ask, but not when membership had already removed the one that died
and others answered). `takeover_resent` on this side counts every message a takeover sent, an
upper bound on the doubles whatever happened. Such doubles stop at the subscribers: a
republished message carries its origin id, and each subscription delivers an id once within
its window (`patterns.dedup.IdWindow`). A standby whose buffer
overflows drops the oldest, counted (`standby_dropped`): only a takeover after that can lose
them. A forwarder that is alive but silent for `STALE_AFTER` (a stalled process), or suspected
by membership and silent for `SUSPECT_SILENCE`, is taken over from, and both forward until it
is heard again (`forwarding_changes` counts the switches). The origin id of a message published
several times identically by one publisher depends on how many of them a gateway has seen, so a
gateway that started late may give such repeats other ids than the forwarder: a takeover by it
may resend them under those ids, which the far side cannot recognise (counted among
`takeover_resent`). Messages that cross this mesh from another one (onward) go on through the
gateway that received them, elected or not; a message published here is sent by the elected
forwarder alone to each mesh that several gateways here link to, and marked as seen there on
its copies to other meshes (see `Gateway._cross`), so that no third mesh relays it onward to a
mesh this election serves.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from irismesh.federation.crossing import Crossing

__all__ = ["Fellow", "Redundancy"]

STATE, DELIVERED = 0, 1
STALE_AFTER = 3.0  # a fellow not heard from this long is taken for gone
SUSPECT_SILENCE = 0.6  # nor this long, while membership suspects it (three state messages)
WORD_AFTER = 0.5  # a fellow's links as it told them this long after this gateway's link came up


@dataclass(slots=True)
class Fellow:
    """Another gateway of this mesh, as its last state message described it."""

    started: float
    topics: tuple[str, ...]
    up: frozenset[str]  # meshes it has a link up to
    known: frozenset[str]  # meshes it has a link to, up or down
    heard_at: float


class Redundancy:
    """The election and the standby buffers of one gateway (no I/O; the gateway drives it)."""

    def __init__(self, own_id: str, started: float, topics: Sequence[str], bound: int) -> None:
        self.own_id = own_id
        self.started = started
        self.topics = tuple(topics)
        self.bound = bound
        self.fellows: dict[str, Fellow] = {}
        self.forwarding: dict[str, bool] = {}  # destination mesh -> this gateway forwards
        self._standby: dict[str, OrderedDict[bytes, Crossing]] = {}
        # Ids reported delivered before this gateway had the message itself (it is slower
        # than the forwarder): dropped when it comes.
        self._early: dict[str, OrderedDict[bytes, None]] = {}
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------- messages between gateways

    def state_message(self, up: Iterable[str], known: Iterable[str]) -> list[Any]:
        return [STATE, self.own_id, self.started, list(self.topics), sorted(up), sorted(known)]

    def delivered_message(self, mesh: str, ids: list[bytes]) -> list[Any]:
        return [DELIVERED, self.own_id, mesh, ids]

    def on_message(self, body: Any, now: float) -> None:
        """A sync message from a fellow (malformed ones are counted and ignored)."""
        if not isinstance(body, list) or len(body) < 2 or type(body[1]) is not str:
            self.stats["sync_malformed"] += 1
            return
        if body[1] == self.own_id:
            return
        self.stats["sync_heard"] += 1
        if body[0] == STATE and len(body) == 6:
            _, sender, started, topics, up, known = body
            ok = (
                isinstance(started, int | float)
                and isinstance(topics, list)
                and isinstance(up, list)
                and isinstance(known, list)
                and all(type(t) is str for t in (*topics, *up, *known))
            )
            if ok:
                self.fellows[sender] = Fellow(
                    float(started), tuple(topics), frozenset(up), frozenset(known), now
                )
                return
        elif body[0] == DELIVERED and len(body) == 4:
            _, sender, mesh, ids = body
            if type(mesh) is str and isinstance(ids, list):
                fellow = self.fellows.get(sender)
                if fellow is not None:  # a forwarder busy telling deliveries is alive
                    fellow.heard_at = now
                self.delivered(mesh, [i for i in ids if type(i) is bytes])
                return
        self.stats["sync_malformed"] += 1

    @staticmethod
    def merged(bodies: Iterable[list[Any]], most: int) -> list[list[Any]]:
        """Messages to fellows waiting to be sent, as few as say the same: the newest state
        stands for every state before it, and the ids delivered to one mesh go together (at
        most `most` a message), the state first. A gateway whose sync fell behind (each
        message a broadcast's round trip) so catches up in a few messages, and its state is
        not held up behind deliveries, which would make its fellows take it for gone."""
        state: list[Any] | None = None
        delivered: dict[tuple[str, str], list[bytes]] = {}
        for body in bodies:
            if body[0] == STATE:
                state = body
            else:
                _, sender, mesh, ids = body
                delivered.setdefault((sender, mesh), []).extend(ids)
        out = [] if state is None else [state]
        for (sender, mesh), ids in delivered.items():
            out += [[DELIVERED, sender, mesh, ids[i : i + most]] for i in range(0, len(ids), most)]
        return out

    def delivered(self, mesh: str, ids: Iterable[bytes]) -> None:
        """The forwarder to `mesh` says the far side has these: no standby resends them."""
        held = self._standby.get(mesh)
        early = self._early.setdefault(mesh, OrderedDict())
        for origin_id in ids:
            if held is not None and held.pop(origin_id, None) is not None:
                continue
            early[origin_id] = None
            if len(early) > self.bound:
                early.popitem(last=False)

    # ------------------------------------------------------------- election

    def elect(
        self,
        mesh: str,
        *,
        own_up: bool,
        since: float,
        now: float,
    ) -> bool | None:
        """Whether this gateway forwards to `mesh`, to which it has had a link since `since`
        (see the docstring); None while a fellow's word on its own links predates that (it
        may have linked to `mesh` at the same time): the caller keeps what it decided."""
        best = (not own_up, self.started, self.own_id)
        for fid, fellow in self.fellows.items():
            if fellow.topics != self.topics or now - fellow.heard_at > STALE_AFTER:
                continue
            if mesh not in fellow.known:
                if fellow.heard_at < since + WORD_AFTER:
                    return None
                continue
            best = min(best, (mesh not in fellow.up, fellow.started, fid))
        return best[2] == self.own_id

    def judge(self, fellow_id: str, state: str | None, now: float) -> bool:
        """What the mesh's membership says of a fellow (`Node.peer_state`): one held "dead"
        or "left", or "suspect" and silent here for `SUSPECT_SILENCE`, is out of the election
        at once, without waiting for its silence to reach `STALE_AFTER`. True if it was put
        out. Should it come back (a wrong verdict, refuted), its next state message makes it
        a fellow again, and the election gives it back what it forwarded."""
        fellow = self.fellows.get(fellow_id)
        if fellow is None:
            return False
        if state in ("dead", "left"):
            self.stats["fellows_declared_dead"] += 1
        elif state == "suspect" and now - fellow.heard_at > SUSPECT_SILENCE:
            self.stats["fellows_suspect_and_silent"] += 1
        else:
            return False
        del self.fellows[fellow_id]
        return True

    def shared(self, now: float) -> frozenset[str]:
        """The meshes some fellow exporting the same topics has a link to (up or down): for
        each, the election picks one forwarder, and the others hold what it has not
        delivered."""
        meshes: set[str] = set()
        for fellow in self.fellows.values():
            if fellow.topics == self.topics and now - fellow.heard_at <= STALE_AFTER:
                meshes |= fellow.known
        return frozenset(meshes)

    def forget_stale(self, now: float) -> None:
        for fid, fellow in list(self.fellows.items()):
            if now - fellow.heard_at > 10 * STALE_AFTER:
                del self.fellows[fid]

    # ------------------------------------------------------------- standby

    def hold(self, mesh: str, crossing: Crossing) -> None:
        """Keep a message this standby would have sent to `mesh`, until it is delivered."""
        early = self._early.get(mesh)
        if early is not None and crossing.origin_id in early:
            del early[crossing.origin_id]
            return  # the forwarder has already delivered it
        held = self._standby.setdefault(mesh, OrderedDict())
        held[crossing.origin_id] = crossing
        if len(held) > self.bound:
            held.popitem(last=False)
            self.stats["standby_dropped"] += 1

    def take_over(self, mesh: str) -> list[Crossing]:
        """This gateway now forwards to `mesh`: what the last forwarder may not have delivered,
        in the order it came."""
        held = self._standby.pop(mesh, None)
        self._early.pop(mesh, None)
        if not held:
            return []
        self.stats["takeovers"] += 1
        self.stats["takeover_resent"] += len(held)
        return list(held.values())

    def held(self) -> int:
        return sum(len(h) for h in self._standby.values())
