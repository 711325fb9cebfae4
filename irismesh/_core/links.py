"""The state of one link, seen from either end.

A link is one transport connection that this node dialled (`OutLink`: its requests go out
and replies come back on it) or that a peer dialled (`InLink`: its requests come in). Links are
opened on demand, to the peers a node actually talks to: members of the clusters it calls,
subscribers of the topics it publishes, nodes it joins the mesh through; a link nothing needs
is closed after a while. Whether a peer is alive is membership's to say, not the links'; but
what a link's transport saw (its connection dropped, and the peer's endpoint then refused a
new one) takes the peer out of this node's own routing at once (`LinkDemand.unreachable`).

Link lifecycle, dialler side:

    HANDSHAKING --WELCOME--> UP --(BYE | transport error | idle | peer dead | silent)--> CLOSED
         |                                                                         ^
         +--------(handshake_timeout | REFUSE | bad proof | self or duplicate)-----+

The listener side has no handshake state of its own: an InLink exists once a valid HELLO has
arrived and is forgotten when its peer says BYE, or membership says the peer died or left.

The engine keeps the link table and walks every link through this lifecycle; each other
concern of the core (calls, publish/subscribe, tunnels, the links' own watch) hears of it
through one small interface, `LinkObserver`, and keeps no link table of its own.

The links and their records are plain classes, not dataclasses (`irismesh._core.plain`): a
field's default is in the class body (compiled, each instance starts with it), a table's is made
by `__init__`, one per link.
"""

from __future__ import annotations

import enum

from irismesh._core.frames import HEADER_SIZE
from irismesh._core.plain import Plain
from irismesh._core.rights import UNCHECKED, PeerGrant
from irismesh._core.sealing import LinkKeys, Sealer
from irismesh.errors import ProtocolError


class LinkState(enum.Enum):
    HANDSHAKING = "handshaking"
    UP = "up"
    CLOSED = "closed"


class OutLink(Plain):
    link_id: int
    endpoint: str
    nonce: bytes
    opened: float
    state: LinkState = LinkState.HANDSHAKING
    peer_id: bytes = b""
    peer_nonce: bytes = b""
    offers: dict[bytes, int]  # tag -> scope slot
    clusters: dict[str, int]  # resolved: name -> slot (0: no)
    last_heard: float = 0.0
    last_ping: float = 0.0
    rtt: float = 0.0
    send_seq: int = 0
    recv_seq: int = 0
    outstanding: int = 0  # requests in flight on this link (read by the balancer)
    latency: float = 0.0  # EWMA of request round trips (read by the balancer)
    latency_at: float = 0.0  # when a reply (or a refusal) last refreshed `latency`
    last_sample: float = 0.0  # when the link was last used (a reply, a publish): idle closing
    # This interval's outcomes of requests on this link (read and cleared by `outliers`):
    replies: int = 0  # replies, good or error (turned away unrun: `refusals`)
    errors: int = 0  # error replies (the member's handler raised)
    errors_in_row: int = 0  # error replies since the last good one
    timeouts: int = 0  # requests whose deadline passed waiting for this member
    refusals: int = 0  # requests the member turned away (Overloaded)
    peer_load: int = 0
    suspect: bool = False  # membership suspects the peer, or the link fell silent while busy
    busy: bool = False  # had requests in flight (or replies to acknowledge) at the last tick
    subscribed: bool = False  # the peer has told us its subscriptions (and granted credit)
    acks: list[int]  # replies received, not yet acknowledged
    keys: LinkKeys | None  # None, by __init__: mypyc drops a class-body None of a Protocol type
    staged: list[tuple[int, int, bytes]]  # (slot, kind, body)
    # Staged entries of a priority other than the default: (priority, slot, kind, body).
    ranked: list[tuple[int, int, int, bytes]]
    priorities: bool = False  # the peer's WELCOME says it reads requests' priorities
    traces: bool = False  # and that it reads trace context (TRACED, PUBLISH_TRACED)
    # The peer's public key and verified grant, from its WELCOME (`rights`).
    public: bytes = b""
    grant: PeerGrant = UNCHECKED
    send_sealers: dict[int, Sealer]
    recv_sealers: dict[int, Sealer]
    # Publish/subscribe, this node publishing to the peer:
    interest: set[str]  # the peer's subscription patterns
    credit: int = 0  # messages the peer lets us send now
    pub_seq: int = 0  # our PUBLISH stream to the peer
    pub_seen: int = 0  # pub_seq when the engine last looked (was it published to since?)
    # Staged PUBLISH entries of one frame's body, their size, and the slot they are sealed in:
    # a PUBLISH_RUN (its head, then one entry each) when the peer reads runs (`pub_runs`, its
    # WELCOME's caps["run"]), else a BATCH (header, body, header, ...).
    pub_runs: bool = False
    pub_parts: list[bytes]
    pub_size: int = 0
    pub_slot: int = 0
    topic_slots: dict[str, int]  # topic scope -> slot (0: none)
    handles: dict[int, object]  # slot -> key handle, as matched

    def __init__(self, link_id: int, endpoint: str, nonce: bytes, opened: float) -> None:
        self.link_id, self.endpoint, self.nonce, self.opened = link_id, endpoint, nonce, opened
        self.offers, self.clusters, self.send_sealers, self.recv_sealers = {}, {}, {}, {}
        self.acks, self.staged, self.ranked, self.pub_parts = [], [], [], []
        self.interest, self.topic_slots, self.handles, self.keys = set(), {}, {}, None


class InLink(Plain):
    routing_id: bytes
    peer_id: bytes
    peer_endpoint: str
    nonce: bytes
    peer_nonce: bytes
    last_heard: float
    scopes: list[str | None]  # slot -> cluster served (slot 0: the link itself)
    send_seq: int = 0
    recv_seq: int = 0
    send_sealers: dict[int, Sealer]
    recv_sealers: dict[int, Sealer]
    staged: list[tuple[int, int, bytes]]  # (slot, kind, body)
    # Staged entries of a priority other than the default: (priority, slot, kind, body).
    ranked: list[tuple[int, int, int, bytes]]
    # Publish/subscribe, the peer publishing to this node:
    pub_seq: int = 0  # last PUBLISH stream seq seen
    credit_out: int = 0  # messages the peer may still send us (what we granted, less arrivals)
    to_grant: int = 0  # released by the application, not yet granted back
    topic_slots: dict[int, str]  # slot -> topic scope ("*": default)
    handles: list[object]  # the key handle of each slot but 0
    # The peer's public key and verified grant, from its HELLO (`rights`), and the slots whose
    # cluster that grant does not let it call: their requests are answered Forbidden.
    public: bytes = b""
    grant: PeerGrant = UNCHECKED
    refused: frozenset[int] = frozenset()
    # With grants required: the topics the peer published here, each with its verdict, taken
    # once per topic from its grant (`PubSubCore.on_publish_batch`). None: grants not required.
    topics_heard: dict[bytes, tuple[str, str, bool]] | None = None

    def __init__(
        self,
        routing_id: bytes,
        peer_id: bytes,
        peer_endpoint: str,
        nonce: bytes,
        peer_nonce: bytes,
        last_heard: float,
        scopes: list[str | None],
    ) -> None:
        self.routing_id, self.peer_id, self.peer_endpoint = routing_id, peer_id, peer_endpoint
        self.nonce, self.peer_nonce, self.last_heard = nonce, peer_nonce, last_heard
        self.scopes, self.send_sealers, self.recv_sealers, self.topic_slots = scopes, {}, {}, {}
        self.staged, self.ranked, self.handles = [], [], []


class TunnelEnd(Plain):
    """This node's end of a tunnel: `out` set if it opened the tunnel, `inlink` if it serves it."""

    handle: int  # this node's name for it (the caller's handle is also the wire id)
    wire_id: int
    cluster: str
    peer_id: bytes
    slot: int
    out: OutLink | None = None
    inlink: InLink | None = None
    send_credit: int = 0  # bytes the other end lets us send now
    recv_allowed: int = 0  # bytes we granted that have not arrived yet
    accepted: bool = False

    def __init__(self, handle: int, wire_id: int, cluster: str, peer_id: bytes, slot: int) -> None:
        self.handle, self.wire_id, self.cluster, self.peer_id = handle, wire_id, cluster, peer_id
        self.slot = slot


class DialRecord(Plain):
    """What the node knows of an endpoint it may dial."""

    endpoint: str
    seed: bool
    failures: int = 0
    next_at: float = 0.0
    link_id: int = 0  # the live OutLink dialled to it, 0 if none
    join: bool = True  # exchange membership tables with it once linked (seeds, discovery)
    # The node whose UP link through this endpoint dropped: the redial's answer is awaited
    # (refused: no process listens there any more). b"" if none.
    dropped: bytes = b""

    def __init__(self, endpoint: str, seed: bool, next_at: float = 0.0) -> None:
        self.endpoint, self.seed, self.next_at = endpoint, seed, next_at


class LinkObserver:
    """What a concern of the core hears of the link table, in the engine's order.

    `link_up`: a dialled link finished its handshake.
    `link_down`: a dialled link that was UP closed for `reason` (it is out of the table).
    `inbound_up`: a peer's HELLO was accepted and answered.
    `inbound_gone`: a link a peer dialled is about to be forgotten (BYE, or its peer is gone).
    Each does nothing unless a concern overrides it.
    """

    __slots__ = ()

    def link_up(self, link: OutLink, now: float) -> None:
        return None

    def link_down(self, link: OutLink, reason: str, now: float) -> None:
        return None

    def inbound_up(self, link: InLink, now: float) -> None:
        return None

    def inbound_gone(self, link: InLink) -> None:
        return None


_VIEW_ABOVE = 2048  # frame bytes; below it, slicing costs less than a view


def open_frame(link: OutLink | InLink, scope: int, seq: int, frame: bytes) -> bytes:
    """Check sequence and seal of a frame on an established link; return its body."""
    if seq <= link.recv_seq:
        raise ProtocolError("replay", f"seq {seq} after {link.recv_seq}")
    sealer = link.recv_sealers.get(scope)
    if sealer is None:
        raise ProtocolError("bad_scope", str(scope))
    if len(frame) > _VIEW_ABOVE:  # a batch: the cipher reads it in place, uncopied
        body = sealer.open(frame[:HEADER_SIZE], seq, memoryview(frame)[HEADER_SIZE:])
    else:
        body = sealer.open(frame[:HEADER_SIZE], seq, frame[HEADER_SIZE:])
    link.recv_seq = seq  # only an authentic frame may advance the window
    return body
