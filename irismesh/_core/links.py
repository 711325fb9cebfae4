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

A link's tables are plain classes, not dataclasses (compared by identity, as they were): their
`__init__` is native compiled, and `import irismesh` does not compile dataclass methods for them.
"""

from __future__ import annotations

import enum

from irismesh._core.frames import HEADER_SIZE
from irismesh._core.rights import UNCHECKED, PeerGrant
from irismesh._core.sealing import LinkKeys, Sealer
from irismesh.errors import ProtocolError


class LinkState(enum.Enum):
    HANDSHAKING = "handshaking"
    UP = "up"
    CLOSED = "closed"


class OutLink:
    __slots__ = (
        "acks",
        "busy",
        "clusters",
        "credit",
        "endpoint",
        "errors",
        "errors_in_row",
        "grant",
        "handles",
        "interest",
        "keys",
        "last_heard",
        "last_ping",
        "last_sample",
        "latency",
        "latency_at",
        "link_id",
        "nonce",
        "offers",
        "opened",
        "outstanding",
        "peer_id",
        "peer_load",
        "peer_nonce",
        "priorities",
        "pub_parts",
        "pub_runs",
        "pub_seen",
        "pub_seq",
        "pub_size",
        "pub_slot",
        "public",
        "ranked",
        "recv_sealers",
        "recv_seq",
        "refusals",
        "replies",
        "rtt",
        "send_sealers",
        "send_seq",
        "staged",
        "state",
        "subscribed",
        "suspect",
        "timeouts",
        "topic_slots",
        "traces",
    )

    def __init__(
        self,
        link_id: int,
        endpoint: str,
        nonce: bytes,
        opened: float,
        state: LinkState = LinkState.HANDSHAKING,
        peer_id: bytes = b"",
        peer_nonce: bytes = b"",
        last_heard: float = 0.0,
        last_ping: float = 0.0,
        rtt: float = 0.0,
        send_seq: int = 0,
        recv_seq: int = 0,
        outstanding: int = 0,  # requests in flight on this link (read by the balancer)
        latency: float = 0.0,  # EWMA of request round trips (read by the balancer)
        latency_at: float = 0.0,  # when a reply (or a refusal) last refreshed `latency`
        last_sample: float = 0.0,  # when the link was last used (a reply, a publish): idle closing
        # This interval's outcomes of requests on this link (read and cleared by `outliers`):
        replies: int = 0,  # replies, good or error (turned away unrun: `refusals`)
        errors: int = 0,  # error replies (the member's handler raised)
        errors_in_row: int = 0,  # error replies since the last good one
        timeouts: int = 0,  # requests whose deadline passed waiting for this member
        refusals: int = 0,  # requests the member turned away (Overloaded)
        peer_load: int = 0,
        suspect: bool = False,  # membership suspects the peer, or the link fell silent while busy
        busy: bool = False,  # had requests in flight (or replies to acknowledge) at the last tick
        subscribed: bool = False,  # the peer has told us its subscriptions (and granted credit)
        keys: LinkKeys | None = None,
        priorities: bool = False,  # the peer's WELCOME says it reads requests' priorities
        traces: bool = False,  # and that it reads trace context (TRACED, PUBLISH_TRACED)
        # The peer's public key and verified grant, from its WELCOME (`rights`).
        public: bytes = b"",
        grant: PeerGrant = UNCHECKED,
        credit: int = 0,  # messages the peer lets us send now
        pub_seq: int = 0,  # our PUBLISH stream to the peer
        pub_seen: int = 0,  # pub_seq when the engine last looked (was it published to since?)
        # Staged PUBLISH entries of one frame's body, their size, and the slot they are sealed in:
        # a PUBLISH_RUN (its head, then one entry each) when the peer reads runs (`pub_runs`, its
        # WELCOME's caps["run"]), else a BATCH (header, body, header, ...).
        pub_runs: bool = False,
        pub_size: int = 0,
        pub_slot: int = 0,
    ) -> None:
        self.link_id = link_id
        self.endpoint = endpoint
        self.nonce = nonce
        self.opened = opened
        self.state = state
        self.peer_id = peer_id
        self.peer_nonce = peer_nonce
        self.offers: dict[bytes, int] = {}  # tag -> scope slot
        self.clusters: dict[str, int] = {}  # resolved: name -> slot (0: no)
        self.last_heard = last_heard
        self.last_ping = last_ping
        self.rtt = rtt
        self.send_seq = send_seq
        self.recv_seq = recv_seq
        self.outstanding = outstanding
        self.latency = latency
        self.latency_at = latency_at
        self.last_sample = last_sample
        self.replies = replies
        self.errors = errors
        self.errors_in_row = errors_in_row
        self.timeouts = timeouts
        self.refusals = refusals
        self.peer_load = peer_load
        self.suspect = suspect
        self.busy = busy
        self.subscribed = subscribed
        self.acks: list[int] = []  # replies received, not yet acknowledged
        self.keys = keys
        self.staged: list[tuple[int, int, bytes]] = []  # (slot, kind, body)
        # Staged entries of a priority other than the default: (priority, slot, kind, body).
        self.ranked: list[tuple[int, int, int, bytes]] = []
        self.priorities = priorities
        self.traces = traces
        self.public = public
        self.grant = grant
        self.send_sealers: dict[int, Sealer] = {}
        self.recv_sealers: dict[int, Sealer] = {}
        # Publish/subscribe, this node publishing to the peer:
        self.interest: set[str] = set()  # the peer's subscription patterns
        self.credit = credit
        self.pub_seq = pub_seq
        self.pub_seen = pub_seen
        self.pub_runs = pub_runs
        self.pub_parts: list[bytes] = []
        self.pub_size = pub_size
        self.pub_slot = pub_slot
        self.topic_slots: dict[str, int] = {}  # topic scope -> slot (0: none)
        self.handles: dict[int, object] = {}  # slot -> key handle, as matched

    def __repr__(self) -> str:
        return (
            f"OutLink(link_id={self.link_id!r}, endpoint={self.endpoint!r}, "
            f"nonce={self.nonce!r}, opened={self.opened!r}, state={self.state!r}, "
            f"peer_id={self.peer_id!r}, peer_nonce={self.peer_nonce!r}, "
            f"offers={self.offers!r}, clusters={self.clusters!r}, "
            f"last_heard={self.last_heard!r}, last_ping={self.last_ping!r}, "
            f"rtt={self.rtt!r}, send_seq={self.send_seq!r}, "
            f"recv_seq={self.recv_seq!r}, outstanding={self.outstanding!r}, "
            f"latency={self.latency!r}, latency_at={self.latency_at!r}, "
            f"last_sample={self.last_sample!r}, replies={self.replies!r}, "
            f"errors={self.errors!r}, errors_in_row={self.errors_in_row!r}, "
            f"timeouts={self.timeouts!r}, refusals={self.refusals!r}, "
            f"peer_load={self.peer_load!r}, suspect={self.suspect!r}, "
            f"busy={self.busy!r}, subscribed={self.subscribed!r}, acks={self.acks!r}, "
            f"keys={self.keys!r}, staged={self.staged!r}, ranked={self.ranked!r}, "
            f"priorities={self.priorities!r}, traces={self.traces!r}, "
            f"public={self.public!r}, grant={self.grant!r}, "
            f"send_sealers={self.send_sealers!r}, recv_sealers={self.recv_sealers!r}, "
            f"interest={self.interest!r}, credit={self.credit!r}, "
            f"pub_seq={self.pub_seq!r}, pub_seen={self.pub_seen!r}, "
            f"pub_runs={self.pub_runs!r}, pub_parts={self.pub_parts!r}, "
            f"pub_size={self.pub_size!r}, pub_slot={self.pub_slot!r}, "
            f"topic_slots={self.topic_slots!r}, handles={self.handles!r})"
        )


class InLink:
    __slots__ = (
        "credit_out",
        "grant",
        "handles",
        "last_heard",
        "nonce",
        "peer_endpoint",
        "peer_id",
        "peer_nonce",
        "pub_seq",
        "public",
        "ranked",
        "recv_sealers",
        "recv_seq",
        "refused",
        "routing_id",
        "scopes",
        "send_sealers",
        "send_seq",
        "staged",
        "to_grant",
        "topic_slots",
        "topics_heard",
    )

    def __init__(
        self,
        routing_id: bytes,
        peer_id: bytes,
        peer_endpoint: str,
        nonce: bytes,
        peer_nonce: bytes,
        last_heard: float,
        scopes: list[str | None],  # slot -> cluster served (slot 0: the link itself)
        send_seq: int = 0,
        recv_seq: int = 0,
        # Publish/subscribe, the peer publishing to this node:
        pub_seq: int = 0,  # last PUBLISH stream seq seen
        credit_out: int = 0,  # messages the peer may still send us (what we granted, less arrivals)
        to_grant: int = 0,  # released by the application, not yet granted back
        # The peer's public key and verified grant, from its HELLO (`rights`), and the slots whose
        # cluster that grant does not let it call: their requests are answered Forbidden.
        public: bytes = b"",
        grant: PeerGrant = UNCHECKED,
        refused: frozenset[int] = frozenset(),
        # With grants required: the topics the peer published here, each with its verdict, taken
        # once per topic from its grant (`PubSubCore.on_publish_batch`). None: grants not required.
        topics_heard: dict[bytes, tuple[str, str, bool]] | None = None,
    ) -> None:
        self.routing_id = routing_id
        self.peer_id = peer_id
        self.peer_endpoint = peer_endpoint
        self.nonce = nonce
        self.peer_nonce = peer_nonce
        self.last_heard = last_heard
        self.scopes = scopes
        self.send_seq = send_seq
        self.recv_seq = recv_seq
        self.send_sealers: dict[int, Sealer] = {}
        self.recv_sealers: dict[int, Sealer] = {}
        self.staged: list[tuple[int, int, bytes]] = []  # (slot, kind, body)
        # Staged entries of a priority other than the default: (priority, slot, kind, body).
        self.ranked: list[tuple[int, int, int, bytes]] = []
        self.pub_seq = pub_seq
        self.credit_out = credit_out
        self.to_grant = to_grant
        self.topic_slots: dict[int, str] = {}  # slot -> topic scope ("*": default)
        self.handles: list[object] = []  # the key handle of each slot but 0
        self.public = public
        self.grant = grant
        self.refused = refused
        self.topics_heard = topics_heard

    def __repr__(self) -> str:
        return (
            f"InLink(routing_id={self.routing_id!r}, peer_id={self.peer_id!r}, "
            f"peer_endpoint={self.peer_endpoint!r}, nonce={self.nonce!r}, "
            f"peer_nonce={self.peer_nonce!r}, last_heard={self.last_heard!r}, "
            f"scopes={self.scopes!r}, send_seq={self.send_seq!r}, "
            f"recv_seq={self.recv_seq!r}, send_sealers={self.send_sealers!r}, "
            f"recv_sealers={self.recv_sealers!r}, staged={self.staged!r}, "
            f"ranked={self.ranked!r}, pub_seq={self.pub_seq!r}, "
            f"credit_out={self.credit_out!r}, to_grant={self.to_grant!r}, "
            f"topic_slots={self.topic_slots!r}, handles={self.handles!r}, "
            f"public={self.public!r}, grant={self.grant!r}, refused={self.refused!r}, "
            f"topics_heard={self.topics_heard!r})"
        )


class TunnelEnd:
    """This node's end of a tunnel: `out` set if it opened the tunnel, `inlink` if it serves it."""

    __slots__ = (
        "accepted",
        "cluster",
        "handle",
        "inlink",
        "out",
        "peer_id",
        "recv_allowed",
        "send_credit",
        "slot",
        "wire_id",
    )

    def __init__(
        self,
        handle: int,  # this node's name for it (the caller's handle is also the wire id)
        wire_id: int,
        cluster: str,
        peer_id: bytes,
        slot: int,
        out: OutLink | None = None,
        inlink: InLink | None = None,
        send_credit: int = 0,  # bytes the other end lets us send now
        recv_allowed: int = 0,  # bytes we granted that have not arrived yet
        accepted: bool = False,
    ) -> None:
        self.handle = handle
        self.wire_id = wire_id
        self.cluster = cluster
        self.peer_id = peer_id
        self.slot = slot
        self.out = out
        self.inlink = inlink
        self.send_credit = send_credit
        self.recv_allowed = recv_allowed
        self.accepted = accepted

    def __repr__(self) -> str:
        return (
            f"TunnelEnd(handle={self.handle!r}, wire_id={self.wire_id!r}, "
            f"cluster={self.cluster!r}, peer_id={self.peer_id!r}, slot={self.slot!r}, "
            f"out={self.out!r}, inlink={self.inlink!r}, "
            f"send_credit={self.send_credit!r}, recv_allowed={self.recv_allowed!r}, "
            f"accepted={self.accepted!r})"
        )


class DialRecord:
    """What the node knows of an endpoint it may dial."""

    __slots__ = ("dropped", "endpoint", "failures", "join", "link_id", "next_at", "seed")

    def __init__(
        self,
        endpoint: str,
        seed: bool,
        failures: int = 0,
        next_at: float = 0.0,
        link_id: int = 0,  # the live OutLink dialled to it, 0 if none
        join: bool = True,  # exchange membership tables with it once linked (seeds, discovery)
        # The node whose UP link through this endpoint dropped: the redial's answer is awaited
        # (refused: no process listens there any more). b"" if none.
        dropped: bytes = b"",
    ) -> None:
        self.endpoint = endpoint
        self.seed = seed
        self.failures = failures
        self.next_at = next_at
        self.link_id = link_id
        self.join = join
        self.dropped = dropped

    def __repr__(self) -> str:
        return (
            f"DialRecord(endpoint={self.endpoint!r}, seed={self.seed!r}, "
            f"failures={self.failures!r}, next_at={self.next_at!r}, "
            f"link_id={self.link_id!r}, join={self.join!r}, dropped={self.dropped!r})"
        )


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
