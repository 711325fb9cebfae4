"""What the core tells its driver: events to act on and link actions to carry out.

Events are plain classes (`irismesh._core.plain`), not dataclasses: compiled, their `__init__`
is native (a dataclass's generated one stays interpreted, and costs the import its source
compiled); they keep a dataclass's `==`, hash and repr. Events of the message hot path are
mutable (`RequestArrived`, made once per request; `ReplyArrived`, made only where no reply sink
takes replies, `Calls.reply_sink`; `MessagesArrived`; the tunnels'): a frozen one's `__init__`
cost about 1.5 us more per message, measured. The rest are frozen and keyword-only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol, TypeVar

from irismesh._core.plain import Frozen, Value
from irismesh.errors import MeshError

E = TypeVar("E")

# (caller node id, request id, link it came on, scope slot there): what a reply needs.
Token = tuple[bytes, int, bytes, int]


class RequestArrived(Value):
    """A request for one of this node's clusters; answer it with `MeshCore.reply(token, ...)`."""

    __slots__ = ("cluster", "deadline", "kind", "payload", "priority", "token", "trace")

    token: Token
    cluster: str
    payload: bytes
    kind: int
    deadline: float
    priority: int
    trace: bytes

    def __init__(
        self,
        token: Token,
        cluster: str,
        payload: bytes,
        kind: int = 5,  # Kind.REQUEST, BROADCAST or SURVEY: which handler answers
        # When the caller gives up, on this node's clock: the budget the request carried, from
        # the moment it arrived.
        deadline: float = float("inf"),
        priority: int = 0,  # higher is more important (`priority`)
        # The caller's trace context (frames.TRACED; b"": none), as it came.
        trace: bytes = b"",
    ) -> None:
        self.token = token
        self.cluster = cluster
        self.payload = payload
        self.kind = kind
        self.deadline = deadline
        self.priority = priority
        self.trace = trace


class TracedRequestArrived(RequestArrived):
    """A RequestArrived that came with its caller's trace context (`trace`, never empty).
    A type of its own, dispatched by type as every event is: the handlers of the requests
    that came without one never test for it."""

    __slots__ = ()


class RequestCancelled(Value):
    """The caller of request `token` gave up on it (cancelled it, or a hedge's other copy won):
    if it still waits, drop it; if its handler runs, cancel it."""

    token: Token

    def __init__(self, token: Token) -> None:
        self.token = token


class ReplyArrived(Value):
    """The reply to this node's request `req_id`; `status` is frames.STATUS_OK or _ERROR."""

    req_id: int
    status: int
    payload: bytes
    peer: bytes  # the member that answered

    def __init__(self, req_id: int, status: int, payload: bytes, peer: bytes = b"") -> None:
        self.req_id, self.status, self.payload, self.peer = req_id, status, payload, peer


class MessagesArrived(Value):
    """Published messages from one peer, for this node's interest: (topic, payload) each.

    `release(routing_id, n)` them once handled. `gaps` maps an index in `messages` to how many
    messages of this publisher's stream were lost in transit just before that one (None: none);
    `stamps` an index to the publisher's wall clock when it published that message (the
    messages it sampled for publish-to-deliver latency; None: none); `ids` an index to the
    id of a message the mesh's memory also holds (None: none); `traces` an index to the
    publisher's trace context of that message (frames.PUBLISH_TRACED; None: none).
    """

    routing_id: bytes
    publisher: bytes
    messages: list[tuple[str, bytes]]
    gaps: dict[int, int] | None
    stamps: dict[int, float] | None
    ids: dict[int, bytes] | None
    traces: dict[int, bytes] | None

    def __init__(
        self,
        routing_id: bytes,
        publisher: bytes,
        messages: list[tuple[str, bytes]],
        gaps: dict[int, int] | None = None,
        stamps: dict[int, float] | None = None,
        ids: dict[int, bytes] | None = None,
        traces: dict[int, bytes] | None = None,
    ) -> None:
        self.routing_id, self.publisher, self.messages = routing_id, publisher, messages
        self.gaps, self.stamps, self.ids, self.traces = gaps, stamps, ids, traces


class CreditArrived(Frozen):
    """A subscriber granted credit: publishes that were blocked may go on."""


class TunnelArrived(Value):
    """A caller opened a tunnel to this member: accept it (`tunnel_accept`) or reset it."""

    handle: int
    cluster: str
    peer: bytes
    trace: bytes  # the caller's trace context (frames.TRACED; b"": none)

    def __init__(self, handle: int, cluster: str, peer: bytes, trace: bytes = b"") -> None:
        self.handle, self.cluster, self.peer, self.trace = handle, cluster, peer, trace


class TunnelFrame(Value):
    """Something happened on tunnel `handle`: an op of frames.TunnelOp, as the peer sent it.

    ACCEPT and CREDIT: `arg` more bytes may be sent (the core has counted them). DATA: `data`,
    and `arg` 1 if the message continues. FIN: the peer sends no more. RESET: the tunnel is
    gone (`data` says why: the peer's reason, or the link that died); the core forgot it.
    """

    handle: int
    op: int
    arg: int
    data: bytes

    def __init__(self, handle: int, op: int, arg: int, data: bytes) -> None:
        self.handle, self.op, self.arg, self.data = handle, op, arg, data


class InterestChanged(Frozen):
    """A peer subscribed or unsubscribed: who hears a topic may have changed."""


class RequestFailed(Frozen):
    req_id: Final[int]
    error: Final[MeshError]

    def __init__(self, *, req_id: int, error: MeshError) -> None:
        self.req_id, self.error = req_id, error


class PeerUp(Frozen):
    """Membership: a node joined the mesh (or came back from a false death)."""

    node_id: Final[bytes]
    endpoint: Final[str]
    name: Final[str]  # what the node is called ("": it has no name)

    def __init__(self, *, node_id: bytes, endpoint: str, name: str = "") -> None:
        self.node_id, self.endpoint, self.name = node_id, endpoint, name


class PeerDown(Frozen):
    """Membership: a node was declared dead, or left (`reason` "dead" or "left")."""

    node_id: Final[bytes]
    endpoint: Final[str]
    reason: Final[str]
    name: Final[str]

    def __init__(self, *, node_id: bytes, endpoint: str, reason: str, name: str = "") -> None:
        self.node_id, self.endpoint, self.reason, self.name = node_id, endpoint, reason, name


class PeerSuspect(Frozen):
    """Membership: a node is suspected (`suspect` True), or the suspicion was refuted."""

    node_id: Final[bytes]
    suspect: Final[bool]

    def __init__(self, *, node_id: bytes, suspect: bool) -> None:
        self.node_id, self.suspect = node_id, suspect


class MemberEjected(Frozen):
    """This caller took member `node_id` out of `cluster`'s rotation for `seconds`: its
    `ejections`th time lately, for `reason` ("errors", "success_rate" or "latency")."""

    cluster: Final[str]
    node_id: Final[bytes]
    reason: Final[str]
    seconds: Final[float]
    ejections: Final[int]

    def __init__(
        self, *, cluster: str, node_id: bytes, reason: str, seconds: float, ejections: int
    ) -> None:
        self.cluster, self.node_id, self.reason = cluster, node_id, reason
        self.seconds, self.ejections = seconds, ejections


class MemberReadmitted(Frozen):
    """Member `node_id`'s ejection from `cluster`'s rotation is over: it is chosen again."""

    cluster: Final[str]
    node_id: Final[bytes]

    def __init__(self, *, cluster: str, node_id: bytes) -> None:
        self.cluster, self.node_id = cluster, node_id


class LinksChanged(Frozen):
    """A link to a peer came up or closed: who can be called right now may have changed."""


class OpenLink(Frozen):
    """Dial `endpoint`; frames for `link_id` follow in the outbox."""

    link_id: Final[int]
    endpoint: Final[str]

    def __init__(self, *, link_id: int, endpoint: str) -> None:
        self.link_id, self.endpoint = link_id, endpoint


class CloseLink(Frozen):
    link_id: Final[int]

    def __init__(self, *, link_id: int) -> None:
        self.link_id = link_id


Event = (
    RequestArrived
    | TracedRequestArrived
    | RequestCancelled
    | ReplyArrived
    | RequestFailed
    | PeerUp
    | PeerDown
    | OpenLink
    | CloseLink
    | MessagesArrived
    | CreditArrived
    | InterestChanged
    | TunnelArrived
    | TunnelFrame
    | PeerSuspect
    | LinksChanged
    | MemberEjected
    | MemberReadmitted
)


class Listen(Protocol):
    """Registers `handler` for every event of `event_type` (how a node's concerns sign up for
    the events they handle: each type has its handlers, called in the order registered)."""

    def __call__(self, event_type: type[E], handler: Callable[[E], None], /) -> None: ...
