"""What the core tells its driver: events to act on and link actions to carry out.

Events of the message hot path are mutable: a frozen dataclass's `__init__` costs about 1.5 us
more per message, measured. `RequestArrived` is a plain class (the compiled core builds it
natively; a dataclass's generated `__init__` stays interpreted); `ReplyArrived` a slotted
dataclass, made only where no reply sink takes replies (`Calls.reply_sink`). The rest are
frozen and keyword-only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from irismesh.errors import MeshError

E = TypeVar("E")

# (caller node id, request id, link it came on, scope slot there): what a reply needs.
Token = tuple[bytes, int, bytes, int]


class RequestArrived:
    """A request for one of this node's clusters; answer it with `MeshCore.reply(token, ...)`.

    A plain class, not a dataclass, with a dataclass's `==` and repr: compiled, a dataclass's
    generated `__init__` stays interpreted, and this one is made once per request."""

    __slots__ = ("cluster", "deadline", "kind", "payload", "priority", "token", "trace")

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

    def _fields(self) -> tuple[Token, str, bytes, int, float, int, bytes]:
        return (
            self.token,
            self.cluster,
            self.payload,
            self.kind,
            self.deadline,
            self.priority,
            self.trace,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestArrived):
            return NotImplemented
        return self._fields() == other._fields()

    def __repr__(self) -> str:
        return (
            f"RequestArrived(token={self.token!r}, cluster={self.cluster!r}, "
            f"payload={self.payload!r}, kind={self.kind!r}, deadline={self.deadline!r}, "
            f"priority={self.priority!r}, trace={self.trace!r})"
        )


@dataclass(slots=True)
class RequestCancelled:
    """The caller of request `token` gave up on it (cancelled it, or a hedge's other copy won):
    if it still waits, drop it; if its handler runs, cancel it."""

    token: Token


@dataclass(slots=True)
class ReplyArrived:
    """The reply to this node's request `req_id`; `status` is frames.STATUS_OK or _ERROR."""

    req_id: int
    status: int
    payload: bytes
    peer: bytes = b""  # the member that answered


@dataclass(slots=True)
class MessagesArrived:
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
    gaps: dict[int, int] | None = None
    stamps: dict[int, float] | None = None
    ids: dict[int, bytes] | None = None
    traces: dict[int, bytes] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CreditArrived:
    """A subscriber granted credit: publishes that were blocked may go on."""


@dataclass(slots=True)
class TunnelArrived:
    """A caller opened a tunnel to this member: accept it (`tunnel_accept`) or reset it."""

    handle: int
    cluster: str
    peer: bytes
    trace: bytes = b""  # the caller's trace context (frames.TRACED; b"": none)


@dataclass(slots=True)
class TunnelFrame:
    """Something happened on tunnel `handle`: an op of frames.TunnelOp, as the peer sent it.

    ACCEPT and CREDIT: `arg` more bytes may be sent (the core has counted them). DATA: `data`,
    and `arg` 1 if the message continues. FIN: the peer sends no more. RESET: the tunnel is
    gone (`data` says why: the peer's reason, or the link that died); the core forgot it.
    """

    handle: int
    op: int
    arg: int
    data: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class InterestChanged:
    """A peer subscribed or unsubscribed: who hears a topic may have changed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFailed:
    req_id: int
    error: MeshError


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerUp:
    """Membership: a node joined the mesh (or came back from a false death)."""

    node_id: bytes
    endpoint: str
    name: str = ""  # what the node is called ("": it has no name)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerDown:
    """Membership: a node was declared dead, or left (`reason` "dead" or "left")."""

    node_id: bytes
    endpoint: str
    reason: str
    name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSuspect:
    """Membership: a node is suspected (`suspect` True), or the suspicion was refuted."""

    node_id: bytes
    suspect: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberEjected:
    """This caller took member `node_id` out of `cluster`'s rotation for `seconds`: its
    `ejections`th time lately, for `reason` ("errors", "success_rate" or "latency")."""

    cluster: str
    node_id: bytes
    reason: str
    seconds: float
    ejections: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberReadmitted:
    """Member `node_id`'s ejection from `cluster`'s rotation is over: it is chosen again."""

    cluster: str
    node_id: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LinksChanged:
    """A link to a peer came up or closed: who can be called right now may have changed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenLink:
    """Dial `endpoint`; frames for `link_id` follow in the outbox."""

    link_id: int
    endpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseLink:
    link_id: int


Event = (
    RequestArrived
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
