"""The exceptions irismesh raises, all under one base.

    MeshError
    ├── ConfigurationError      the caller's misuse: a bad argument, option or file, raised at once
    │   └── NoKey               no key in the keyring for a cluster or topic this node must use
    ├── Closed                  the node (or tunnel, subscription) is closed
    ├── StorageError            the memory's database cannot be opened, read or written
    ├── MembershipTimeout       a cluster did not reach the awaited number of members in time
    ├── DataTimeout             too few holders of a data key answered a majority or all
                                read or write in time
    ├── PayloadTooLarge         a payload above the configured limit, refused before sending
    ├── Overloaded              too many requests in flight on this node (CoreConfig.max_pending)
    ├── Forbidden               this node's grant (or the caller's, at a member) lacks the right
    ├── RequestError            a request did not produce a reply
    │   ├── NoResponders        the cluster has no live member (known at once, no waiting)
    │   ├── RequestTimeout      no reply within the caller's deadline
    │   ├── MemberLost          the member a broadcast or survey was sent to left before answering
    │   └── RemoteError         the member's handler raised; carries its message
    └── ProtocolError           a peer sent bytes that are not a valid frame (dropped and counted;
                                raised only by the pure codec, never out of a node)

Errors carry data as attributes so callers need not parse messages.
"""

from __future__ import annotations

__all__ = [
    "Closed",
    "ConfigurationError",
    "DataTimeout",
    "Forbidden",
    "MemberLost",
    "MembershipTimeout",
    "MeshError",
    "NoKey",
    "NoResponders",
    "Overloaded",
    "PayloadTooLarge",
    "ProtocolError",
    "RemoteError",
    "RequestError",
    "RequestTimeout",
    "StorageError",
]


class MeshError(Exception):
    """Base of every error irismesh raises."""


class ConfigurationError(MeshError, ValueError):
    """A caller's misuse: bad argument, option, or file."""


class NoKey(ConfigurationError):
    """The keyring holds no key for a scope (cluster or topic) that this node must use."""

    def __init__(self, scope: str) -> None:
        super().__init__(
            f"no key for {scope!r} in the keyring: add one with `mesh keygen --scope {scope}` "
            "or a default key named '*'"
        )
        self.scope = scope


class Closed(MeshError):
    """The node, or the object used, is closed."""


class StorageError(MeshError, OSError):
    """The memory's database at `path` cannot be opened, read or written (`reason`: a full
    disk, a directory that is not writable, a file that is not a database, ...)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"memory store {path}: {reason}")
        self.path = path
        self.reason = reason


class MembershipTimeout(MeshError, TimeoutError):
    """A cluster (or, `cluster` None, the mesh) did not reach the awaited number of live
    members in time."""

    def __init__(self, cluster: str | None, wanted: int, found: int, timeout: float) -> None:
        what = "the mesh" if cluster is None else f"cluster {cluster!r}"
        super().__init__(f"{what} has {found} live member(s) after {timeout:g} s, wanted {wanted}")
        self.cluster = cluster
        self.wanted = wanted
        self.found = found
        self.timeout = timeout


class DataTimeout(MeshError, TimeoutError):
    """Too few holders of a data key answered a "majority" or "all" operation in time (a write
    stays applied here and spreads as the holders come back)."""

    def __init__(self, key: str, consistency: str, reached: int, needed: int, timeout: float):
        super().__init__(
            f"{consistency} on data key {key!r}: {reached} of {needed} holder(s) "
            f"(this node counted) within {timeout:g} s"
        )
        self.key = key
        self.consistency = consistency
        self.reached = reached
        self.needed = needed
        self.timeout = timeout


class PayloadTooLarge(MeshError, ValueError):
    """A payload exceeds the configured size limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"payload of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class Overloaded(MeshError):
    """Too much work now; the request did not run, so retrying later or elsewhere is safe.

    `reason` says whose limit it met:

    - "in_flight": this node already has its maximum of requests in flight (`pending`, `limit`:
      CoreConfig.max_pending);
    - "throttled": this node turned the request away itself, at once, because the cluster's
      members have lately been turning requests away or letting them time out (adaptive
      throttling: the caller backs off instead of hammering a saturated cluster);
    - "member": a member turned it away unrun, because it could not have answered within the
      request's deadline (`detail` says why: "queue", "deadline", "sojourn", ...), and no other
      member could take it in time.
    """

    retriable = True

    def __init__(
        self,
        pending: int = 0,
        limit: int = 0,
        *,
        reason: str = "in_flight",
        cluster: str | None = None,
        detail: str = "",
    ) -> None:
        if reason == "throttled":
            message = (
                f"cluster {cluster!r} is turning requests away: this node throttles itself "
                "and rejected this request without sending it; retry later"
            )
        elif reason == "member":
            message = (
                f"cluster {cluster!r}: the member could not answer within the deadline"
                f"{f' ({detail})' if detail else ''} and no other member could take it"
            )
        else:
            message = (
                f"{pending} requests in flight, the limit is {limit}: wait for replies, or "
                "raise CoreConfig.max_pending"
            )
        super().__init__(message)
        self.pending = pending
        self.limit = limit
        self.reason = reason
        self.cluster = cluster
        self.detail = detail


class Forbidden(MeshError, PermissionError):
    """No right to it: the grant in force lacks `right` ("call", "serve", "publish",
    "subscribe", "memory") for `name` (a cluster, topic or subscription pattern)."""

    def __init__(self, name: str, right: str, detail: str = "") -> None:
        where = f": {detail}" if detail else ""
        super().__init__(f"no right to {right} {name!r}{where}")
        self.name = name
        self.right = right
        self.detail = detail


class RequestError(MeshError):
    """A request did not produce a reply."""

    def __init__(self, message: str, cluster: str) -> None:
        super().__init__(message)
        self.cluster = cluster


class NoResponders(RequestError):
    """The cluster has no live member to take the request."""

    def __init__(self, cluster: str) -> None:
        super().__init__(f"cluster {cluster!r} has no live member", cluster)


class RequestTimeout(RequestError, TimeoutError):
    """No reply arrived within the caller's deadline."""

    def __init__(self, cluster: str, timeout: float, attempts: int = 1) -> None:
        super().__init__(
            f"no reply from cluster {cluster!r} within {timeout:g} s ({attempts} attempt(s))",
            cluster,
        )
        self.timeout = timeout
        self.attempts = attempts


class MemberLost(RequestError):
    """The member a broadcast or survey was meant for left or died before answering."""

    def __init__(self, cluster: str, member: str) -> None:
        super().__init__(f"member {member[:12]} of {cluster!r} left before answering", cluster)
        self.member = member


class RemoteError(RequestError):
    """The member's handler raised; the member keeps serving."""

    def __init__(self, cluster: str, remote_type: str, remote_message: str) -> None:
        super().__init__(
            f"handler in cluster {cluster!r} raised {remote_type}: {remote_message}", cluster
        )
        self.remote_type = remote_type
        self.remote_message = remote_message


def remote_error(cluster: str, remote_type: str, remote_message: str) -> MeshError:
    """The error a member's error reply stands for: Forbidden when the member refused the
    caller's right to call the cluster, else RemoteError."""
    if remote_type == "Forbidden":  # "<right> <name>": the right, and what it was refused for
        right, _, name = remote_message.partition(" ")
        return Forbidden(name or cluster, right or "call", "refused by the member")
    return RemoteError(cluster, remote_type, remote_message)


class SlowConsumer(MeshError, TimeoutError):
    """A publish waited `timeout` seconds for subscribers that granted no room."""

    def __init__(self, topic: str, timeout: float, subscribers: list[str]) -> None:
        who = ", ".join(s[:12] for s in subscribers[:5]) or "a subscription of this node"
        more = f" and {len(subscribers) - 5} more" if len(subscribers) > 5 else ""
        super().__init__(
            f"publish to {topic!r} waited {timeout:g} s for room at slow subscriber(s) "
            f"{who}{more}: they read too slowly (their policy is to block the publisher)"
        )
        self.topic = topic
        self.timeout = timeout
        self.subscribers = subscribers


class InterestTimeout(MeshError, TimeoutError):
    """Fewer peers than awaited subscribed to a topic in time."""

    def __init__(self, topic: str, wanted: int, found: int, timeout: float) -> None:
        super().__init__(
            f"{found} peer(s) subscribed to {topic!r} after {timeout:g} s, wanted {wanted}"
        )
        self.topic = topic
        self.wanted = wanted
        self.found = found


class TunnelError(MeshError):
    """A tunnel cannot carry on."""


class TunnelReset(TunnelError):
    """The tunnel is gone: the other end reset it, refused it, closed it, or died."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"tunnel reset: {reason}")
        self.reason = reason


class EndOfStream(TunnelError):
    """The other end sent everything it will send (it closed its side) and it was all read."""


class ProtocolError(MeshError):
    """Bytes from a peer are not a valid frame; `reason` is a short counter name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
