"""An in-memory network of MeshCore instances: h11's ConnectionPair, for a mesh.

`MemNet` plays the driver for every core at once. It carries frames from `core.out_frames`
(link id -> the listener's `receive_in` under that link's routing id) and `core.in_frames`
(routing id -> the dialler's `receive_out`), opens and closes links on `OpenLink`/`CloseLink`,
carries membership datagrams (`take_datagrams` -> `receive_datagram` at their address), and
keeps a virtual clock. Like TCP, a link delivers its frames in order; different links may
be delayed independently (so frames reorder *between* links), frames may be lost, nodes may
be killed (silently: `kill`; or as SIGKILL does, their connections closed and their endpoint
refusing dials: `crash`), paused (a stalled loop) or partitioned from each other. Everything
random comes from one seeded `random.Random`, so a failing run replays exactly.

Members answer requests through a handler: `echo` answers at once with b"re:" + payload,
`hold` keeps the token in `node.held` for the test to answer later.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from irismesh._core.config import CoreConfig
from irismesh._core.engine import MeshCore
from irismesh._core.events import (
    CloseLink,
    Event,
    OpenLink,
    PeerDown,
    PeerUp,
    ReplyArrived,
    RequestArrived,
    RequestFailed,
    Token,
)
from irismesh._core.frames import Kind
from irismesh._core.records import NodeIdentity, node_id_of
from irismesh._core.sealing import LinkSecurity
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring
from irismesh.security.linksecurity import KeyedLinkSecurity

E = TypeVar("E")
Handler = Callable[["MemNode", RequestArrived], bytes | None]
SecurityFactory = Callable[[Keyring], LinkSecurity]


def echo(node: MemNode, event: RequestArrived) -> bytes:
    return b"re:" + event.payload


def hold(node: MemNode, event: RequestArrived) -> None:
    return None


# ---------------------------------------------------------------------- a checking sealer


class MacLinkSecurity(KeyedLinkSecurity):
    """The shipped security (X25519 link keys, AES-256-GCM): any change to a frame fails."""


# ---------------------------------------------------------------------- the network


@dataclass(eq=False)
class Conn:
    """One dialled link: a transport connection from `dialler` to the listener it reached."""

    dialler: MemNode
    link_id: int
    listener: MemNode | None
    routing_id: bytes
    open: bool = True
    last_due: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [to dialler, listener]


@dataclass(frozen=True)
class Delivery:
    sent: float
    at: float
    conn: Conn
    to_listener: bool
    frame: bytes

    @property
    def kind(self) -> int:
        return self.frame[2]


@dataclass(frozen=True)
class NodeSpec:
    """What a node is started with; a restart starts the same spec under a new id."""

    clusters: tuple[str, ...]
    seeds: tuple[str, ...]
    keyring: Keyring
    config: CoreConfig
    security: SecurityFactory
    version: str = ""


@dataclass(eq=False)
class MemNode:
    name: str
    endpoint: str
    core: MeshCore
    handler: Handler
    spec: NodeSpec
    alive: bool = True
    paused: bool = False
    backlog: list[tuple[Conn, bool, bytes, float]] = field(default_factory=list)
    datagram_backlog: list[tuple[str, bytes]] = field(default_factory=list)
    log: list[tuple[float, Event]] = field(default_factory=list)
    arrived: list[RequestArrived] = field(default_factory=list)
    held: list[Token] = field(default_factory=list)
    replies: dict[int, list[ReplyArrived]] = field(default_factory=dict)
    failures: dict[int, list[RequestFailed]] = field(default_factory=dict)
    conns: dict[int, Conn] = field(default_factory=dict)
    security: LinkSecurity | None = None  # what its core decides with (rekeyed by MemNet.rekey)
    refused: list[int] = field(default_factory=list)  # its dials refused, not yet told

    @property
    def node_id(self) -> bytes:
        return self.core.node_id

    def events(self, kind: type[E]) -> list[E]:
        return [event for _at, event in self.log if isinstance(event, kind)]

    def timed(self, kind: type[E]) -> list[tuple[float, E]]:
        return [(at, event) for at, event in self.log if isinstance(event, kind)]

    def peer_ids(self) -> set[bytes]:
        return {link.peer_id for link in self.core.peers()}

    def downs(self) -> list[PeerDown]:
        return self.events(PeerDown)

    def ups(self) -> list[PeerUp]:
        return self.events(PeerUp)

    def conn_to(self, other: MemNode) -> Conn:
        """The open dialled link from this node to `other`'s current incarnation."""
        for conn in self.conns.values():
            if conn.open and conn.listener is other:
                link = next((x for x in self.core.links() if x.link_id == conn.link_id), None)
                if link is not None and link.peer_id == other.node_id:
                    return conn
        raise LookupError(f"{self.name} has no link to {other.name}")


class MemNet:
    def __init__(
        self,
        *,
        seed: int = 0,
        loss: float = 0.0,
        max_delay: float = 0.0,
        config: CoreConfig | None = None,
        keyring: Keyring | None = None,
        security: SecurityFactory = KeyedLinkSecurity,
        identities: bool = True,
    ) -> None:
        self.rng = random.Random(seed)
        self.identities = identities  # False: cores without identities (nothing signed)
        self.now = 0.0
        self.loss = loss
        self.max_delay = max_delay
        self.config = config or CoreConfig()
        self.keyring = keyring or Keyring.generate(["*"], randbytes=self.rng.randbytes)
        self.security = security
        self.nodes: dict[str, MemNode] = {}  # name -> current incarnation
        self.listeners: dict[str, MemNode] = {}  # endpoint -> current incarnation
        self.by_address: dict[str, MemNode] = {}  # datagram address -> current incarnation
        self.datagrams_sent = 0
        self._datagrams: list[tuple[float, int, str, str, bytes]] = []
        self.routes: dict[bytes, Conn] = {}
        self.partitions: set[frozenset[str]] = set()
        self.refusing: set[str] = set()  # endpoints of crashed nodes: dials there are refused
        self.delivered: list[Delivery] = []
        self.lost: Counter[str] = Counter()
        self._queue: list[tuple[float, int, float, Conn, bool, bytes]] = []
        self._order = itertools.count()
        self._routing_ids = itertools.count(1)

    # ------------------------------------------------------------------ nodes

    def add(
        self,
        name: str,
        *,
        clusters: Iterable[str] = (),
        seeds: Iterable[MemNode | str] = (),
        handler: Handler = echo,
        keyring: Keyring | None = None,
        config: CoreConfig | None = None,
        security: SecurityFactory | None = None,
        version: str = "",
        identity: NodeIdentity | None = None,
        node_id: bytes | None = None,
        plain: bool = False,
    ) -> MemNode:
        """`identity` and `node_id`: this node's own (a test's liar), not one made here;
        `plain`: a core without an identity (it signs nothing) in a net of identified ones."""
        spec = NodeSpec(
            clusters=tuple(clusters),
            seeds=tuple(s if isinstance(s, str) else s.endpoint for s in seeds),
            keyring=keyring or self.keyring,
            config=config or self.config,
            security=security or self.security,
            version=version,
        )
        return self._start(name, f"tcp://{name}:7000", handler, spec, identity, node_id, plain)

    def _start(
        self,
        name: str,
        endpoint: str,
        handler: Handler,
        spec: NodeSpec,
        identity: NodeIdentity | None = None,
        node_id: bytes | None = None,
        plain: bool = False,
    ) -> MemNode:
        security = spec.security(spec.keyring)
        # The same 16 bytes of the seeded stream as random ids took, so runs replay as before.
        drawn = self.rng.randbytes(16)
        if identity is None and self.identities and not plain:
            identity = Identity.from_private_bytes(hashlib.sha256(drawn).digest())
        if node_id is None:
            node_id = drawn if identity is None else node_id_of(identity.public)
        core = MeshCore(
            node_id=node_id,
            endpoint=endpoint,
            clusters=spec.clusters,
            security=security,
            rng=random.Random(self.rng.random()),
            randbytes=random.Random(self.rng.random()).randbytes,
            config=spec.config,
            now=self.now,
            name=name,
            version=spec.version,
            identity=identity,
        )
        node = MemNode(name, endpoint, core, handler, spec, security=security)
        self.nodes[name] = node
        self.listeners[endpoint] = node
        self.refusing.discard(endpoint)
        self.by_address[core.address] = node
        for seed in spec.seeds:
            core.add_candidate(seed, self.now, seed=True)
        self.collect(node)
        return node

    def restart(self, node: MemNode, identity: NodeIdentity | None = None) -> MemNode:
        """Kill `node` and start a fresh incarnation (new id, empty state) at its endpoint;
        under `identity` (so with that identity's id), if given."""
        self.kill(node)
        return self._start(node.name, node.endpoint, node.handler, node.spec, identity)

    def rekey(self, node: MemNode, keyring: Keyring) -> None:
        """The node rereads its keyring (a rotation step): its security decides with `keyring`."""
        assert isinstance(node.security, KeyedLinkSecurity)
        node.security.replace(keyring)
        node.core.keys_changed(self.now)
        self.collect(node)
        self.run(self.now)

    def kill(self, node: MemNode) -> None:
        """The process dies: nothing more reaches it or leaves it."""
        node.alive = False

    def crash(self, node: MemNode) -> None:
        """The process is killed as SIGKILL does: its kernel closes its connections at once,
        and their other ends see it; dials to its endpoint are refused until a node listens
        there again (`restart`). Like `kill`, nothing more reaches it or leaves it."""
        node.alive = False
        self.refusing.add(node.endpoint)
        for conn in list(self.routes.values()):
            if not conn.open or node not in (conn.dialler, conn.listener):
                continue
            conn.open = False
            if conn.listener is node and conn.dialler.alive:
                conn.dialler.core.link_failed(conn.link_id, self.now, "disconnected")
                self.collect(conn.dialler)
            elif conn.dialler is node and conn.listener is not None and conn.listener.alive:
                conn.listener.core.inbound_closed(conn.routing_id)
                self.collect(conn.listener)
        self.run(self.now)

    def partition(self, a: MemNode, b: MemNode) -> None:
        self.partitions.add(frozenset((a.name, b.name)))

    def heal(self, a: MemNode | None = None, b: MemNode | None = None) -> None:
        if a is None or b is None:
            self.partitions.clear()
        else:
            self.partitions.discard(frozenset((a.name, b.name)))

    def pause(self, node: MemNode) -> None:
        """The node's loop stalls: frames for it wait, its ticks are skipped."""
        node.paused = True

    def resume(self, *nodes: MemNode) -> None:
        """Stalled loops run again: their (late) ticks first, then what queued meanwhile."""
        for node in nodes:
            node.paused = False
        for node in nodes:
            self.tick(node)
        for node in nodes:
            backlog, node.backlog = node.backlog, []
            for conn, to_listener, frame, sent in backlog:
                self._deliver(conn, to_listener, frame, sent)
            datagrams, node.datagram_backlog = node.datagram_backlog, []
            for source, data in datagrams:
                node.core.receive_datagram(source, data, self.now)
                self.collect(node)
        self.run(self.now)

    def break_link(self, node: MemNode, link_id: int, reason: str = "transport") -> None:
        """The transport of a dialled link fails: frames in flight on it are lost."""
        conn = node.conns.get(link_id)
        if conn is not None:
            conn.open = False
        node.core.link_failed(link_id, self.now, reason)
        self.collect(node)
        self.run(self.now)

    # ------------------------------------------------------------------ driving cores

    def request(
        self,
        node: MemNode,
        cluster: str,
        payload: bytes,
        timeout: float = 2.0,
        hedge: float | None = None,
    ) -> int:
        """Send a request and deliver what is due now (with no delay: the whole exchange)."""
        req_id = node.core.request(cluster, payload, timeout, self.now, hedge=hedge)
        self.collect(node)
        self.run(self.now)
        return req_id

    def reply(self, node: MemNode, token: tuple[bytes, int], payload: bytes) -> None:
        node.core.reply(token, payload)
        self.collect(node)
        self.run(self.now)

    def tick(self, node: MemNode) -> None:
        node.core.tick(self.now)
        self.collect(node)

    def collect(self, node: MemNode) -> None:
        """Act on a core's events and put its frames on the wire, as the driver does."""
        core = node.core
        while (
            core.events
            or core.out_frames
            or core.in_frames
            or core.membership.outbox
            or node.refused
        ):
            events, core.events = core.events, []
            for event in events:
                self._on_event(node, event)
            refused, node.refused = node.refused, []
            for link_id in refused:  # the transport says so once the dial is made
                core.link_failed(link_id, self.now, "refused")
            out, core.out_frames = core.out_frames, []
            for link_id, frame in out:
                conn = node.conns.get(link_id)
                if conn is not None:
                    self._send(conn, True, frame)
            back, core.in_frames = core.in_frames, []
            for routing_id, frame in back:
                route = self.routes.get(routing_id)
                if route is not None and route.listener is node:
                    self._send(route, False, frame)
            for address, data in core.take_datagrams():
                self._send_datagram(node, address, data)

    def _on_event(self, node: MemNode, event: Event) -> None:
        node.log.append((self.now, event))
        if isinstance(event, OpenLink):
            routing_id = b"r%d" % next(self._routing_ids)
            listener = self.listeners.get(event.endpoint)
            conn = Conn(node, event.link_id, listener, routing_id)
            node.conns[event.link_id] = conn
            self.routes[routing_id] = conn
            if event.endpoint in self.refusing:
                conn.open = False
                node.refused.append(event.link_id)
        elif isinstance(event, CloseLink):
            closed = node.conns.pop(event.link_id, None)
            if closed is not None:
                closed.open = False
        elif isinstance(event, RequestArrived):
            node.arrived.append(event)
            answer = node.handler(node, event)
            if answer is None:
                node.held.append(event.token)
            else:
                node.core.reply(event.token, answer)
        elif isinstance(event, ReplyArrived):
            node.replies.setdefault(event.req_id, []).append(event)
        elif isinstance(event, RequestFailed):
            node.failures.setdefault(event.req_id, []).append(event)

    # ------------------------------------------------------------------ the wire

    def _send(self, conn: Conn, to_listener: bool, frame: bytes) -> None:
        if not conn.open:
            self.lost["closed"] += 1
            return
        if self.loss and self.rng.random() < self.loss:
            self.lost["loss"] += 1
            return
        delay = self.rng.uniform(0.0, self.max_delay) if self.max_delay else 0.0
        # One link is one TCP stream: its frames never overtake each other.
        due = max(self.now + delay, conn.last_due[to_listener])
        conn.last_due[to_listener] = due
        heapq.heappush(self._queue, (due, next(self._order), self.now, conn, to_listener, frame))

    def _send_datagram(self, node: MemNode, address: str, data: bytes) -> None:
        self.datagrams_sent += 1
        if self.loss and self.rng.random() < self.loss:
            self.lost["datagram_loss"] += 1
            return
        delay = self.rng.uniform(0.0, self.max_delay) if self.max_delay else 0.0
        heapq.heappush(
            self._datagrams, (self.now + delay, next(self._order), node.core.address, address, data)
        )

    def _reaches(self, src: MemNode | None, dst: MemNode | None, kind: str) -> bool:
        """Whether what `src` sent reaches `dst` now (a paused `dst` holds it back); if not,
        counted lost as `kind`dead (a side gone or down) or `kind`partition."""
        if src is None or dst is None or not src.alive or not dst.alive:
            self.lost[kind + "dead"] += 1
            return False
        if frozenset((src.name, dst.name)) in self.partitions:
            self.lost[kind + "partition"] += 1
            return False
        return True

    def _deliver_datagram(self, source: str, address: str, data: bytes) -> None:
        src, dst = self.by_address.get(source), self.by_address.get(address)
        if not self._reaches(src, dst, "datagram_"):
            return
        assert dst is not None
        if dst.paused:
            dst.datagram_backlog.append((source, data))
            return
        dst.core.receive_datagram(source, data, self.now)
        self.collect(dst)

    def _deliver(self, conn: Conn, to_listener: bool, frame: bytes, sent: float) -> None:
        src, dst = (conn.dialler, conn.listener) if to_listener else (conn.listener, conn.dialler)
        if not self._reaches(src if conn.open else None, dst, ""):  # closed: as if src were gone
            return
        assert dst is not None
        if dst.paused:
            dst.backlog.append((conn, to_listener, frame, sent))
            return
        self.delivered.append(Delivery(sent, self.now, conn, to_listener, frame))
        if to_listener:
            dst.core.receive_in(conn.routing_id, frame, self.now)
        else:
            dst.core.receive_out(conn.link_id, frame, self.now)
        self.collect(dst)

    def in_flight(self) -> int:
        return len(self._queue) + len(self._datagrams)

    def run(self, until: float) -> None:
        """Deliver every frame due by `until`, in order, then set the clock to `until`."""
        queue, datagrams = self._queue, self._datagrams
        while True:
            frame_due = queue[0][0] if queue else float("inf")
            datagram_due = datagrams[0][0] if datagrams else float("inf")
            if min(frame_due, datagram_due) > until:
                break
            if frame_due <= datagram_due:
                due, _order, sent, conn, to_listener, frame = heapq.heappop(queue)
                self.now = max(self.now, due)
                self._deliver(conn, to_listener, frame, sent)
            else:
                due, _order, source, address, data = heapq.heappop(datagrams)
                self.now = max(self.now, due)
                self._deliver_datagram(source, address, data)
        self.now = max(self.now, until)

    def settle(self) -> None:
        """Flush every core and deliver what is due now."""
        for node in list(self.nodes.values()):
            if node.alive:
                self.collect(node)
        self.run(self.now)

    def advance(self, duration: float, step: float = 0.1) -> None:
        """Let `duration` seconds pass, ticking every live, unpaused core every `step`."""
        start = self.now
        for i in range(1, round(duration / step) + 1):
            at = start + i * step
            self.run(at)
            for node in list(self.nodes.values()):
                if node.alive and not node.paused:
                    self.tick(node)
            self.run(at)

    def kinds_delivered(self, kind: Kind) -> list[Delivery]:
        return [d for d in self.delivered if d.kind == kind]


def member_and_client(
    net: MemNet, *, handler: Handler = echo, settle: float = 0.5
) -> tuple[MemNode, MemNode]:
    """A member of "db" and a client seeded with it, handshakes done."""
    nodes = mesh(net, {"member": ["db"]}, handler=handler, settle=settle)
    return nodes["member"], nodes["client"]


def mesh(
    net: MemNet,
    members: dict[str, Iterable[str]],
    *,
    client: str | None = "client",
    handler: Handler = echo,
    settle: float = 0.5,
) -> dict[str, MemNode]:
    """Start `members` (name -> clusters) and a pure client seeded with all of them, then let
    the handshakes finish."""
    nodes = {
        name: net.add(name, clusters=clusters, handler=handler)
        for name, clusters in members.items()
    }
    if client is not None:
        nodes[client] = net.add(client, seeds=list(nodes.values()))
    net.advance(settle)
    return nodes
