"""What the core tells its driver: events to act on and link actions to carry out.

Every event is a plain class with a dataclass's `==` and repr, not a dataclass: compiled, a
plain class's `__init__` is native (a dataclass's generated one stays interpreted: about
1.5 us more per message for a frozen one, measured), and `import irismesh` does not pay the
dataclass decorator (about 0.4 ms a class, compiling its methods from source text). Events of
the message hot path are mutable; the rest are frozen (their attributes `Final`: read-only
compiled, checked by mypy) and hashable, and take keyword arguments only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol, TypeVar

from irismesh.errors import MeshError

E = TypeVar("E")

# (caller node id, request id, link it came on, scope slot there): what a reply needs.
Token = tuple[bytes, int, bytes, int]


class RequestArrived:
    """A request for one of this node's clusters; answer it with `MeshCore.reply(token, ...)`.

    Made once per request (`ReplyArrived` once per reply where no reply sink takes replies:
    `Calls.reply_sink`)."""

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


class RequestCancelled:
    """The caller of request `token` gave up on it (cancelled it, or a hedge's other copy won):
    if it still waits, drop it; if its handler runs, cancel it."""

    __slots__ = ("token",)

    def __init__(
        self,
        token: Token,
    ) -> None:
        self.token = token

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestCancelled):
            return NotImplemented
        return self.token == other.token

    def __repr__(self) -> str:
        return f"RequestCancelled(token={self.token!r})"


class ReplyArrived:
    """The reply to this node's request `req_id`; `status` is frames.STATUS_OK or _ERROR."""

    __slots__ = ("payload", "peer", "req_id", "status")

    def __init__(
        self,
        req_id: int,
        status: int,
        payload: bytes,
        peer: bytes = b"",  # the member that answered
    ) -> None:
        self.req_id = req_id
        self.status = status
        self.payload = payload
        self.peer = peer

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReplyArrived):
            return NotImplemented
        return (self.req_id, self.status, self.payload, self.peer) == (
            other.req_id,
            other.status,
            other.payload,
            other.peer,
        )

    def __repr__(self) -> str:
        return (
            f"ReplyArrived(req_id={self.req_id!r}, status={self.status!r}, "
            f"payload={self.payload!r}, peer={self.peer!r})"
        )


class MessagesArrived:
    """Published messages from one peer, for this node's interest: (topic, payload) each.

    `release(routing_id, n)` them once handled. `gaps` maps an index in `messages` to how many
    messages of this publisher's stream were lost in transit just before that one (None: none);
    `stamps` an index to the publisher's wall clock when it published that message (the
    messages it sampled for publish-to-deliver latency; None: none); `ids` an index to the
    id of a message the mesh's memory also holds (None: none); `traces` an index to the
    publisher's trace context of that message (frames.PUBLISH_TRACED; None: none).
    """

    __slots__ = ("gaps", "ids", "messages", "publisher", "routing_id", "stamps", "traces")

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
        self.routing_id = routing_id
        self.publisher = publisher
        self.messages = messages
        self.gaps = gaps
        self.stamps = stamps
        self.ids = ids
        self.traces = traces

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MessagesArrived):
            return NotImplemented
        return (
            self.routing_id,
            self.publisher,
            self.messages,
            self.gaps,
            self.stamps,
            self.ids,
            self.traces,
        ) == (
            other.routing_id,
            other.publisher,
            other.messages,
            other.gaps,
            other.stamps,
            other.ids,
            other.traces,
        )

    def __repr__(self) -> str:
        return (
            f"MessagesArrived(routing_id={self.routing_id!r}, "
            f"publisher={self.publisher!r}, messages={self.messages!r}, "
            f"gaps={self.gaps!r}, stamps={self.stamps!r}, ids={self.ids!r}, "
            f"traces={self.traces!r})"
        )


class CreditArrived:
    """A subscriber granted credit: publishes that were blocked may go on."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CreditArrived):
            return NotImplemented
        return True

    def __hash__(self) -> int:
        return hash(())

    def __repr__(self) -> str:
        return "CreditArrived()"


class TunnelArrived:
    """A caller opened a tunnel to this member: accept it (`tunnel_accept`) or reset it."""

    __slots__ = ("cluster", "handle", "peer", "trace")

    def __init__(
        self,
        handle: int,
        cluster: str,
        peer: bytes,
        trace: bytes = b"",  # the caller's trace context (frames.TRACED; b"": none)
    ) -> None:
        self.handle = handle
        self.cluster = cluster
        self.peer = peer
        self.trace = trace

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TunnelArrived):
            return NotImplemented
        return (self.handle, self.cluster, self.peer, self.trace) == (
            other.handle,
            other.cluster,
            other.peer,
            other.trace,
        )

    def __repr__(self) -> str:
        return (
            f"TunnelArrived(handle={self.handle!r}, cluster={self.cluster!r}, "
            f"peer={self.peer!r}, trace={self.trace!r})"
        )


class TunnelFrame:
    """Something happened on tunnel `handle`: an op of frames.TunnelOp, as the peer sent it.

    ACCEPT and CREDIT: `arg` more bytes may be sent (the core has counted them). DATA: `data`,
    and `arg` 1 if the message continues. FIN: the peer sends no more. RESET: the tunnel is
    gone (`data` says why: the peer's reason, or the link that died); the core forgot it.
    """

    __slots__ = ("arg", "data", "handle", "op")

    def __init__(
        self,
        handle: int,
        op: int,
        arg: int,
        data: bytes,
    ) -> None:
        self.handle = handle
        self.op = op
        self.arg = arg
        self.data = data

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TunnelFrame):
            return NotImplemented
        return (self.handle, self.op, self.arg, self.data) == (
            other.handle,
            other.op,
            other.arg,
            other.data,
        )

    def __repr__(self) -> str:
        return (
            f"TunnelFrame(handle={self.handle!r}, op={self.op!r}, arg={self.arg!r}, "
            f"data={self.data!r})"
        )


class InterestChanged:
    """A peer subscribed or unsubscribed: who hears a topic may have changed."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InterestChanged):
            return NotImplemented
        return True

    def __hash__(self) -> int:
        return hash(())

    def __repr__(self) -> str:
        return "InterestChanged()"


class RequestFailed:
    __slots__ = ("error", "req_id")

    def __init__(
        self,
        *,
        req_id: int,
        error: MeshError,
    ) -> None:
        self.req_id: Final = req_id
        self.error: Final = error

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestFailed):
            return NotImplemented
        return (self.req_id, self.error) == (other.req_id, other.error)

    def __hash__(self) -> int:
        return hash((self.req_id, self.error))

    def __repr__(self) -> str:
        return f"RequestFailed(req_id={self.req_id!r}, error={self.error!r})"


class PeerUp:
    """Membership: a node joined the mesh (or came back from a false death)."""

    __slots__ = ("endpoint", "name", "node_id")

    def __init__(
        self,
        *,
        node_id: bytes,
        endpoint: str,
        name: str = "",  # what the node is called ("": it has no name)
    ) -> None:
        self.node_id: Final = node_id
        self.endpoint: Final = endpoint
        self.name: Final = name

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PeerUp):
            return NotImplemented
        return (self.node_id, self.endpoint, self.name) == (
            other.node_id,
            other.endpoint,
            other.name,
        )

    def __hash__(self) -> int:
        return hash((self.node_id, self.endpoint, self.name))

    def __repr__(self) -> str:
        return f"PeerUp(node_id={self.node_id!r}, endpoint={self.endpoint!r}, name={self.name!r})"


class PeerDown:
    """Membership: a node was declared dead, or left (`reason` "dead" or "left")."""

    __slots__ = ("endpoint", "name", "node_id", "reason")

    def __init__(
        self,
        *,
        node_id: bytes,
        endpoint: str,
        reason: str,
        name: str = "",
    ) -> None:
        self.node_id: Final = node_id
        self.endpoint: Final = endpoint
        self.reason: Final = reason
        self.name: Final = name

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PeerDown):
            return NotImplemented
        return (self.node_id, self.endpoint, self.reason, self.name) == (
            other.node_id,
            other.endpoint,
            other.reason,
            other.name,
        )

    def __hash__(self) -> int:
        return hash((self.node_id, self.endpoint, self.reason, self.name))

    def __repr__(self) -> str:
        return (
            f"PeerDown(node_id={self.node_id!r}, endpoint={self.endpoint!r}, "
            f"reason={self.reason!r}, name={self.name!r})"
        )


class PeerSuspect:
    """Membership: a node is suspected (`suspect` True), or the suspicion was refuted."""

    __slots__ = ("node_id", "suspect")

    def __init__(
        self,
        *,
        node_id: bytes,
        suspect: bool,
    ) -> None:
        self.node_id: Final = node_id
        self.suspect: Final = suspect

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PeerSuspect):
            return NotImplemented
        return (self.node_id, self.suspect) == (other.node_id, other.suspect)

    def __hash__(self) -> int:
        return hash((self.node_id, self.suspect))

    def __repr__(self) -> str:
        return f"PeerSuspect(node_id={self.node_id!r}, suspect={self.suspect!r})"


class MemberEjected:
    """This caller took member `node_id` out of `cluster`'s rotation for `seconds`: its
    `ejections`th time lately, for `reason` ("errors", "success_rate" or "latency")."""

    __slots__ = ("cluster", "ejections", "node_id", "reason", "seconds")

    def __init__(
        self,
        *,
        cluster: str,
        node_id: bytes,
        reason: str,
        seconds: float,
        ejections: int,
    ) -> None:
        self.cluster: Final = cluster
        self.node_id: Final = node_id
        self.reason: Final = reason
        self.seconds: Final = seconds
        self.ejections: Final = ejections

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemberEjected):
            return NotImplemented
        return (self.cluster, self.node_id, self.reason, self.seconds, self.ejections) == (
            other.cluster,
            other.node_id,
            other.reason,
            other.seconds,
            other.ejections,
        )

    def __hash__(self) -> int:
        return hash((self.cluster, self.node_id, self.reason, self.seconds, self.ejections))

    def __repr__(self) -> str:
        return (
            f"MemberEjected(cluster={self.cluster!r}, node_id={self.node_id!r}, "
            f"reason={self.reason!r}, seconds={self.seconds!r}, "
            f"ejections={self.ejections!r})"
        )


class MemberReadmitted:
    """Member `node_id`'s ejection from `cluster`'s rotation is over: it is chosen again."""

    __slots__ = ("cluster", "node_id")

    def __init__(
        self,
        *,
        cluster: str,
        node_id: bytes,
    ) -> None:
        self.cluster: Final = cluster
        self.node_id: Final = node_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemberReadmitted):
            return NotImplemented
        return (self.cluster, self.node_id) == (other.cluster, other.node_id)

    def __hash__(self) -> int:
        return hash((self.cluster, self.node_id))

    def __repr__(self) -> str:
        return f"MemberReadmitted(cluster={self.cluster!r}, node_id={self.node_id!r})"


class LinksChanged:
    """A link to a peer came up or closed: who can be called right now may have changed."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LinksChanged):
            return NotImplemented
        return True

    def __hash__(self) -> int:
        return hash(())

    def __repr__(self) -> str:
        return "LinksChanged()"


class OpenLink:
    """Dial `endpoint`; frames for `link_id` follow in the outbox."""

    __slots__ = ("endpoint", "link_id")

    def __init__(
        self,
        *,
        link_id: int,
        endpoint: str,
    ) -> None:
        self.link_id: Final = link_id
        self.endpoint: Final = endpoint

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpenLink):
            return NotImplemented
        return (self.link_id, self.endpoint) == (other.link_id, other.endpoint)

    def __hash__(self) -> int:
        return hash((self.link_id, self.endpoint))

    def __repr__(self) -> str:
        return f"OpenLink(link_id={self.link_id!r}, endpoint={self.endpoint!r})"


class CloseLink:
    __slots__ = ("link_id",)

    def __init__(
        self,
        *,
        link_id: int,
    ) -> None:
        self.link_id: Final = link_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CloseLink):
            return NotImplemented
        return self.link_id == other.link_id

    def __hash__(self) -> int:
        return hash((self.link_id,))

    def __repr__(self) -> str:
        return f"CloseLink(link_id={self.link_id!r})"


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
