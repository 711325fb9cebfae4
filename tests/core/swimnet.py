"""An in-memory datagram network of `Membership` state machines, on a simulated clock.

`SwimNet` plays the driver for every node at once: it delivers each node's outbox after a
random delay (datagrams may overtake each other, as UDP's do), loses a share of them, and ticks
each node when its `next_deadline` comes, from one heap of timers, so that ten thousand nodes
cost only the work they really do. Nodes can be killed, stalled (their loop stops: datagrams
wait, ticks are skipped) and partitioned. Everything random comes from one seeded generator,
so a failing run replays exactly.

`on_event(node, event)` sees every membership event as it happens (with `net.now`); `log`
keeps them per node when `keep_log` is set (off for large simulations).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from irismesh._core.gossip import DatagramSealer, NullDatagramSealer
from irismesh._core.membership import Membership
from irismesh._core.records import (
    Member,
    MemberEvent,
    MemberRecord,
    MembershipConfig,
    MemberState,
)
from irismesh.security.meshkey import MeshDatagramSealer

SealerFactory = Callable[[bytes], DatagramSealer]


@dataclass(eq=False)
class SwimNode:
    name: str
    membership: Membership
    alive: bool = True
    paused: bool = False
    backlog: list[tuple[str, bytes]] = field(default_factory=list)
    log: list[tuple[float, MemberEvent]] = field(default_factory=list)
    timer: float = float("inf")  # the deadline this node is scheduled at

    @property
    def node_id(self) -> bytes:
        return self.membership.me.node_id

    @property
    def address(self) -> str:
        return self.membership.me.address

    def state_of(self, other: SwimNode) -> MemberState | None:
        member = self.membership.get(other.node_id)
        return None if member is None else member.state

    def live_ids(self) -> set[bytes]:
        return {
            m.record.node_id for m in self.membership.members() if m.state <= MemberState.SUSPECT
        }


class SwimNet:
    def __init__(
        self,
        *,
        seed: int = 0,
        loss: float = 0.0,
        delay: tuple[float, float] = (0.0002, 0.002),
        config: MembershipConfig | None = None,
        sealer: SealerFactory | None = None,
        keep_log: bool = True,
    ) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.loss = loss
        self.delay = delay
        self.config = config or MembershipConfig()
        secret = self.rng.randbytes(32)
        self.sealer: SealerFactory = sealer or (
            lambda node_id: MeshDatagramSealer([secret], node_id)
        )
        self.keep_log = keep_log
        self.nodes: dict[str, SwimNode] = {}
        self.by_address: dict[str, SwimNode] = {}
        self.partitions: list[tuple[frozenset[str], frozenset[str]]] = []
        self.lost: Counter[str] = Counter()
        self.sent = 0
        self.on_event: Callable[[SwimNode, MemberEvent], None] | None = None
        self._queue: list[tuple[float, int, str, str, bytes]] = []  # due, order, from, to, data
        self._timers: list[tuple[float, int, SwimNode]] = []
        self._order = itertools.count()

    # ------------------------------------------------------------------ nodes

    def add(self, name: str, *, join: Iterable[SwimNode] = (), tags: bytes = b"") -> SwimNode:
        node_id = self.rng.randbytes(16)
        record = MemberRecord(node_id, f"tcp://{name}:7000", f"{name}:7000", tags, name)
        membership = Membership(
            record,
            sealer=self.sealer(node_id),
            rng=random.Random(self.rng.random()),
            config=self.config,
        )
        node = SwimNode(name, membership)
        self.nodes[name] = node
        self.by_address[record.address] = node
        for seed in join:
            membership.join(seed.address, self.now)
        self._after(node)
        return node

    def kill(self, node: SwimNode) -> None:
        node.alive = False

    def leave(self, node: SwimNode) -> None:
        node.membership.leave(self.now)
        self._after(node)
        node.alive = False

    def pause(self, node: SwimNode) -> None:
        node.paused = True

    def resume(self, node: SwimNode) -> None:
        """The stalled loop runs again: its late tick first, then what queued meanwhile."""
        node.paused = False
        node.membership.tick(self.now)
        self._after(node)
        backlog, node.backlog = node.backlog, []
        for source, data in backlog:
            node.membership.receive(source, data, self.now)
            self._after(node)

    def partition(self, side_a: Iterable[SwimNode], side_b: Iterable[SwimNode]) -> None:
        a = frozenset(n.name for n in side_a)
        b = frozenset(n.name for n in side_b)
        self.partitions.append((a, b))

    def heal(self) -> None:
        self.partitions.clear()

    def seed_tables(self, nodes: list[SwimNode]) -> None:
        """Start `nodes` as a converged mesh: each knows every other, alive (shared entries)."""
        entries = [Member(n.membership.me, 0, MemberState.ALIVE, self.now) for n in nodes]
        for node in nodes:
            node.membership.adopt(e for e in entries if e.record is not node.membership.me)
            self._after(node)

    # ------------------------------------------------------------------ the clock

    def run(self, until: float) -> None:
        """Deliver datagrams and fire timers due by `until`, in time order."""
        queue, timers = self._queue, self._timers
        spins: dict[str, int] = {}  # ticks that left a node due again at once
        while True:
            next_datagram = queue[0][0] if queue else float("inf")
            next_timer = timers[0][0] if timers else float("inf")
            at = min(next_datagram, next_timer)
            if at > until:
                break
            self.now = max(self.now, at)
            if next_datagram <= next_timer:
                _due, _order, source, target, data = heapq.heappop(queue)
                self._deliver(source, target, data)
            else:
                _due, _order, node = heapq.heappop(timers)
                if node.timer != _due or not node.alive:
                    continue  # rescheduled since, or dead
                node.timer = float("inf")
                if node.paused:
                    continue  # resume() ticks it
                node.membership.tick(self.now)
                self._after(node)
                if node.timer <= self.now:
                    spins[node.name] = spins.get(node.name, 0) + 1
                    if spins[node.name] > 100:
                        raise AssertionError(f"{node.name}'s next deadline does not advance")
        self.now = max(self.now, until)

    def advance(self, seconds: float) -> None:
        self.run(self.now + seconds)

    def run_until(self, done: Callable[[], bool], limit: float, step: float = 0.05) -> float:
        """Advance in `step`s until `done()`; returns the time it took (or raises)."""
        start = self.now
        while not done():
            if self.now - start > limit:
                raise AssertionError(f"not done within {limit} simulated seconds")
            self.advance(step)
        return self.now - start

    # ------------------------------------------------------------------ the wire

    def _after(self, node: SwimNode) -> None:
        """Take a node's events and datagrams, and schedule its next tick."""
        membership = node.membership
        if membership.events:
            events, membership.events = membership.events, []
            for event in events:
                if self.keep_log:
                    node.log.append((self.now, event))
                if self.on_event is not None:
                    self.on_event(node, event)
        if membership.outbox:
            outbox = membership.take_outbox()
            for address, data in outbox:
                self._send(node, address, data)
        due = membership.next_deadline()
        if due < node.timer:
            node.timer = due
            heapq.heappush(self._timers, (due, next(self._order), node))

    def _send(self, node: SwimNode, address: str, data: bytes) -> None:
        self.sent += 1
        if self.loss and self.rng.random() < self.loss:
            self.lost["loss"] += 1
            return
        due = self.now + self.rng.uniform(*self.delay)
        heapq.heappush(self._queue, (due, next(self._order), node.address, address, data))

    def _deliver(self, source: str, target: str, data: bytes) -> None:
        src, dst = self.by_address.get(source), self.by_address.get(target)
        if dst is None or not dst.alive or src is None:
            self.lost["nowhere"] += 1
            return
        for a, b in self.partitions:
            if (src.name in a and dst.name in b) or (src.name in b and dst.name in a):
                self.lost["partition"] += 1
                return
        if dst.paused:
            dst.backlog.append((source, data))
            return
        dst.membership.receive(source, data, self.now)
        self._after(dst)


def null_sealer(node_id: bytes) -> DatagramSealer:
    return NullDatagramSealer()
