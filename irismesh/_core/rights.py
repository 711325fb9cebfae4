"""What a node may do in a mesh that requires grants: rights, and how they match names.

A *grant* (an authority's signed token, `irismesh.security.grants`) gives one node's public key
its rights: the clusters it may serve and call, the topic patterns it may publish and
subscribe under (each with allow and deny lists: deny wins), whether it may hold the memory,
and what a gateway may export and import. This module holds the rights once a grant has been
verified, and the checks the core makes with them; the verification (signatures, trust,
expiry, revocation) is the security layer's (`GrantPolicy`).

A cluster right is a cluster name or ``*`` (every cluster). A topic right is a topic pattern
(``*`` one segment, ``#`` any number): a topic may be published if an allow pattern matches it
and no deny pattern does; a subscription pattern may be taken if an allow pattern covers every
topic it can match and no deny pattern can match a topic it matches. So a subscription is
decided once, when it is made, and never message by message: ``feeds.#`` under a deny of
``feeds.secret.#`` is refused whole, never filtered.

A gateway's rights (`gateway_export`, `gateway_import`) name clusters and topic patterns. They
also give the node what exercising them takes: exporting cluster X is calling X in its own mesh
for far callers, exporting a pattern subscribing to it there; importing X is serving X, importing
topics publishing them. So a gateway's grant needs nothing else, and its peers see those rights
in it.

The core asks at the handshake and when a route or subscription is formed, never per message:
a member marks which slots of an inbound link the caller may call, a caller opens a slot only
to a peer that may serve its cluster, a publisher keeps a subscriber's interest only if it may
subscribe to it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Protocol

from irismesh._core.plain import Frozen

# The cluster of the mesh's memory (`irismesh.memory`): serving it takes the `memory` right;
# calling it (retaining, rereading, enqueueing) takes any right at all, and what is retained
# or reread is a topic the publish and subscribe rights decide.
MEMORY_CLUSTER: Final = "_memory"
# The cluster a mesh's gateways serve and call each other in (`irismesh.federation`): a
# gateway right (export or import) covers both.
GATEWAY_CLUSTER: Final = "_gateway"
# Where the memory keeps revocations for nodes that start later: any node may publish and
# reread there (each revocation is an authority's signed token, checked by every reader).
REVOCATIONS: Final = "_grants.revoked"
_REVOCATION_TOPICS: Final = REVOCATIONS + ".#"
# The replicated data's topics (`irismesh.data`): a node holding the memory keeps the data too,
# so the `memory` right covers them; other nodes need topic rights for the keys they use.
_DATA_TOPICS: Final = "_data.#"


def _segments(pattern: str) -> list[str]:
    return pattern.split(".")


def pattern_covers(allow: str, pattern: str) -> bool:
    """Whether every topic `pattern` matches is matched by `allow` (both topic patterns)."""
    a, p = _segments(allow), _segments(pattern)
    seen: dict[tuple[int, int], bool] = {}

    def covers(i: int, j: int) -> bool:
        key = (i, j)
        found = seen.get(key)
        if found is not None:
            return found
        if j == len(p):
            result = all(s == "#" for s in a[i:])
        elif i == len(a):
            result = False
        elif a[i] == "#":
            result = covers(i + 1, j) or covers(i, j + 1)
        elif p[j] == "#":
            result = False
        elif p[j] == "*":
            result = a[i] == "*" and covers(i + 1, j + 1)
        else:
            result = a[i] in ("*", p[j]) and covers(i + 1, j + 1)
        seen[key] = result
        return result

    return covers(0, 0)


def patterns_meet(first: str, second: str) -> bool:
    """Whether some topic (of at least one segment) matches both patterns."""
    a, b = _segments(first), _segments(second)
    seen: dict[tuple[int, int], bool] = {}

    def meet(i: int, j: int) -> bool:
        key = (i, j)
        found = seen.get(key)
        if found is not None:
            return found
        if i == len(a) and j == len(b):
            result = True
        elif i < len(a) and a[i] == "#":
            result = meet(i + 1, j) or (j < len(b) and meet(i, j + 1))
        elif j < len(b) and b[j] == "#":
            result = meet(i, j + 1) or (i < len(a) and meet(i + 1, j))
        elif i == len(a) or j == len(b):
            result = False
        else:
            result = (a[i] == "*" or b[j] == "*" or a[i] == b[j]) and meet(i + 1, j + 1)
        seen[key] = result
        return result

    # A topic has one segment at least: "#" against "#" meets in "x", not in "".
    return meet(0, 0)


def topic_allowed(topic: str, allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    """Whether `topic` (a concrete topic) passes `allow` and `deny` (deny wins)."""
    if any(pattern_covers(pattern, topic) for pattern in deny):
        return False
    return any(pattern_covers(pattern, topic) for pattern in allow)


def subscription_allowed(pattern: str, allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    """Whether every topic `pattern` matches is allowed and none is denied."""
    if any(patterns_meet(denied, pattern) for denied in deny):
        return False
    return any(pattern_covers(allowed, pattern) for allowed in allow)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rights:
    """What one grant allows. Empty rights allow nothing."""

    serve: tuple[str, ...] = ()
    call: tuple[str, ...] = ()
    publish: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    memory: bool = False
    gateway_export: tuple[str, ...] = ()
    gateway_import: tuple[str, ...] = ()

    def may_serve(self, cluster: str) -> bool:
        if cluster == MEMORY_CLUSTER:
            return self.memory
        if cluster in self.serve or "*" in self.serve or self.may_import_cluster(cluster):
            return True
        return cluster == GATEWAY_CLUSTER and self.gateway

    def may_call(self, cluster: str) -> bool:
        if cluster == MEMORY_CLUSTER:
            return bool(self.call or self.publish or self.subscribe or self.memory)
        if cluster in self.call or "*" in self.call or self.may_export_cluster(cluster):
            return True
        return cluster == GATEWAY_CLUSTER and self.gateway

    @property
    def gateway(self) -> bool:
        """Whether these rights let a node be a gateway (export or import anything)."""
        return bool(self.gateway_export or self.gateway_import)

    def may_export_cluster(self, cluster: str) -> bool:
        """Whether a gateway may let far callers call `cluster` of its mesh."""
        return cluster in self.gateway_export or "*" in self.gateway_export

    def may_export_topics(self, pattern: str) -> bool:
        """Whether a gateway may carry out of its mesh every topic `pattern` matches."""
        return bool(self.gateway_export) and subscription_allowed(pattern, self.gateway_export, ())

    def may_import_cluster(self, cluster: str) -> bool:
        """Whether a gateway may serve in its mesh `cluster` of a far mesh."""
        return cluster in self.gateway_import or "*" in self.gateway_import

    def may_import_topic(self, topic: str) -> bool:
        """Whether a gateway may republish in its mesh `topic` from a far mesh."""
        return bool(self.gateway_import) and topic_allowed(topic, self.gateway_import, ())

    def may_publish(self, topic: str) -> bool:
        if topic.startswith("_"):
            if pattern_covers(_REVOCATION_TOPICS, topic):
                return True
            if self.memory and pattern_covers(_DATA_TOPICS, topic):
                return True
        if topic_allowed(topic, self.publish, self.publish_deny):
            return True
        # A gateway republishes what it imports (its deny list still wins).
        return bool(self.gateway_import) and topic_allowed(
            topic, self.gateway_import, self.publish_deny
        )

    def may_subscribe(self, pattern: str) -> bool:
        if pattern.startswith("_"):
            if pattern_covers(_REVOCATION_TOPICS, pattern):
                return True
            if self.memory and pattern_covers(_DATA_TOPICS, pattern):
                return True
        if subscription_allowed(pattern, self.subscribe, self.subscribe_deny):
            return True
        # A gateway subscribes to what it exports (its deny list still wins).
        return bool(self.gateway_export) and subscription_allowed(
            pattern, self.gateway_export, self.subscribe_deny
        )

    def summary(self) -> dict[str, object]:
        """The rights as a map for people and JSON (empty lists left out)."""
        shown: dict[str, object] = {}
        for name in (
            "serve",
            "call",
            "publish",
            "publish_deny",
            "subscribe",
            "subscribe_deny",
            "gateway_export",
            "gateway_import",
        ):
            value = getattr(self, name)
            if value:
                shown[name] = list(value)
        if self.memory:
            shown["memory"] = True
        return shown


NO_RIGHTS = Rights()
# What a node holds in a mesh that does not require grants: anything.
ALL_RIGHTS = Rights(serve=("*",), call=("*",), publish=("#",), subscribe=("#",), memory=True)


class PeerGrant(Frozen):
    """A peer's verified grant as a link holds it: its rights and when they end (wall-clock
    seconds since the epoch; inf for a mesh that does not require grants)."""

    rights: Final[Rights]
    expires: Final[float]
    issued: Final[float]
    authority: Final[bytes]

    def __init__(
        self, *, rights: Rights, expires: float, issued: float = 0.0, authority: bytes = b""
    ) -> None:
        self.rights, self.expires, self.issued, self.authority = rights, expires, issued, authority


UNGRANTED = PeerGrant(rights=NO_RIGHTS, expires=float("inf"))
UNCHECKED = PeerGrant(rights=ALL_RIGHTS, expires=float("inf"))


class GrantPolicy(Protocol):
    """The security layer's verdicts on grants (`irismesh.security.grants.NodeGrants`)."""

    @property
    def required(self) -> bool:
        """Whether this node requires grants of its peers (and enforces its own)."""
        ...

    def token(self) -> bytes:
        """This node's own grant to present at handshakes (b"": none)."""
        ...

    def own(self) -> PeerGrant:
        """This node's own verified grant (UNCHECKED when grants are not required)."""
        ...

    def admit(self, public: bytes, token: bytes) -> PeerGrant:
        """A peer's grant, verified: UNGRANTED if it has none that holds (or UNCHECKED when
        grants are not required); ProtocolError('revoked') if the peer's key is revoked."""
        ...

    def holds(self, public: bytes, grant: PeerGrant) -> bool:
        """Whether a grant admitted earlier still holds (not expired, not revoked)."""
        ...

    def learn(self, notice: bytes) -> bool:
        """A notice heard (a revocation's token): True if it is new and trusted, and now
        applies (then it is worth spreading)."""
        ...

    def learn_key(self, notice: bytes) -> bytes | None:
        """As `learn`, but the public key the notice revokes (None: not new, or untrusted)."""
        ...

    def revoked_keys(self) -> Collection[bytes]:
        """The public keys this node holds a revocation of."""
        ...


__all__ = [
    "ALL_RIGHTS",
    "GATEWAY_CLUSTER",
    "MEMORY_CLUSTER",
    "NO_RIGHTS",
    "REVOCATIONS",
    "UNCHECKED",
    "UNGRANTED",
    "GrantPolicy",
    "PeerGrant",
    "Rights",
    "pattern_covers",
    "patterns_meet",
    "subscription_allowed",
    "topic_allowed",
]
