"""Messages crossing meshes: their origin ids, the meshes they have seen, and the barrier
that lets each through once.

A published message leaves its mesh through a gateway as a *crossing*: the topic and payload,
the name of the mesh where it was published (its origin), an origin id, and the names of the
meshes it has been in. A gateway never sends a crossing to a mesh it has seen, and never
republishes one in its own mesh if its own mesh is among them: in a ring of meshes that is
enough to stop every loop. Where a message can reach a mesh by two paths (a complete graph:
A to C directly, and A to B to C), the copies meet at the gateway that receives them, and its
`Barrier` lets through the first and drops the others by origin id, within a bounded window
of recent ids (`duplicates_dropped`). Where redundant gateways of the origin mesh link to a
mesh (one forwards there, the others stand by), the copies would come through two gateway
processes instead, each with its barrier: so the gateway sending a copy marks as seen the
meshes it and another gateway of its mesh link to (`Crossing.wire(also=...)`), and nobody
relays it there.

The origin id is made from the message itself (publisher, topic, payload, and how many
identical messages that publisher sent before it), so every gateway that sees a message in its
origin mesh gives it the same id without talking to the others. Each path keeps its order,
and the barrier keeps the first copy of each message, so each publisher's messages still
arrive in the order it published them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from irismesh._core.frames import MAX_TRACE
from irismesh.errors import ProtocolError

CROSSING = "pub"
RESENT = "pubr"  # a crossing a takeover sends again (see `redundancy`): maybe there already
MAX_SEEN = 32  # meshes a crossing may have been in


@dataclass(frozen=True, slots=True)
class Crossing:
    origin: str  # the mesh where it was published
    origin_id: bytes
    seen: tuple[str, ...]  # the meshes it has been in, the origin first
    topic: str
    payload: bytes
    # The W3C trace context it was published with (b"": none), republished with it.
    trace: bytes = b""

    def wire(self, kind: str = CROSSING, also: Sequence[str] = ()) -> list[Any]:
        """The link item; `also`: meshes the sender sends it to itself, marked as seen so the
        receiver does not relay it there (as many as `MAX_SEEN` leaves room for). Its trace
        context, when it has one, follows as a seventh element."""
        seen = [*self.seen, *also][:MAX_SEEN] if also else list(self.seen)
        item = [kind, self.origin, self.origin_id, seen, self.topic, self.payload]
        if self.trace:
            item.append(self.trace)
        return item

    @classmethod
    def from_wire(cls, item: Sequence[Any]) -> Crossing:
        if len(item) == 7:
            trace = item[6]
            if type(trace) is not bytes or len(trace) > MAX_TRACE:
                raise ProtocolError("malformed", "crossing")
        elif len(item) == 6:
            trace = b""
        else:
            raise ProtocolError("malformed", "crossing")
        _, origin, origin_id, seen, topic, payload = item[:6]
        ok = (
            type(origin) is str
            and type(origin_id) is bytes
            and len(origin_id) == 16
            and isinstance(seen, list)
            and 0 < len(seen) <= MAX_SEEN
            and all(type(m) is str for m in seen)
            and type(topic) is str
            and type(payload) is bytes
        )
        if not ok:
            raise ProtocolError("malformed", "crossing")
        return cls(origin, origin_id, tuple(seen), topic, payload, trace)

    def through(self, mesh: str) -> Crossing:
        """The same message, having now been in `mesh` too."""
        seen = (*self.seen, mesh)
        return Crossing(self.origin, self.origin_id, seen, self.topic, self.payload, self.trace)


class OriginIds:
    """Gives each message published in this mesh its origin id (see the module docstring).

    Counts identical messages per publisher in a bounded table, so two identical messages get
    different ids, and two gateways seeing one publisher's stream give both the same ids."""

    __slots__ = ("_limit", "_repeats")

    def __init__(self, limit: int = 65536) -> None:
        self._repeats: OrderedDict[bytes, int] = OrderedDict()
        self._limit = limit

    def origin_id(self, publisher: str, topic: str, payload: bytes) -> bytes:
        said = b"%s\x00%s\x00%s" % (publisher.encode(), topic.encode(), payload)
        base = hashlib.blake2b(said, digest_size=16).digest()  # one call: per message
        repeats = self._repeats.get(base, 0)
        self._repeats[base] = repeats + 1
        self._repeats.move_to_end(base)
        if len(self._repeats) > self._limit:
            self._repeats.popitem(last=False)
        if repeats == 0:
            return base
        return hashlib.blake2b(base + repeats.to_bytes(8, "big"), digest_size=16).digest()


class Barrier:
    """The idempotency barrier: each origin id once within the last `window` ids."""

    __slots__ = ("_seen", "_window", "duplicates")

    def __init__(self, window: int = 262144) -> None:
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._window = window
        self.duplicates = 0

    def holds(self, origin: str, origin_id: bytes) -> bool:
        """Whether this message has come (within the window), without counting it."""
        return (origin, origin_id) in self._seen

    def first(self, crossing: Crossing) -> bool:
        """True the first time this message comes; False (counted) for its copies."""
        key = (crossing.origin, crossing.origin_id)
        if key in self._seen:
            self.duplicates += 1
            return False
        self._seen[key] = None
        if len(self._seen) > self._window:
            self._seen.popitem(last=False)
        return True
