"""The core's public API: what the driver hands in and takes out, and each concern's calls.

`MeshCore` is the one object a driver holds; most of what it offers belongs to one concern
(`outbox`, `calls`, `pubsub`, `tunnels`), and is delegated here under the name the driver and
the tests use, so that the engine's own module keeps only the link table, the dispatch of
frames and the timer. The hot calls (`request`, `reply`, `publish`) may also be made on the
concern directly, sparing a call.
"""

from __future__ import annotations

from irismesh._core.calls import Calls
from irismesh._core.demand import LinkDemand
from irismesh._core.events import Event, Token
from irismesh._core.links import InLink, OutLink
from irismesh._core.membership import Membership
from irismesh._core.outbox import Outbox
from irismesh._core.pubsub import PubSubCore
from irismesh._core.records import Member
from irismesh._core.replycache import ReplyCache
from irismesh._core.split import Splits
from irismesh._core.tunnels import TunnelTable


class CoreApi:
    """The delegating half of `MeshCore`; the engine sets the concerns."""

    outbox: Outbox
    calls: Calls
    pubsub: PubSubCore
    tunnels: TunnelTable
    membership: Membership
    splits: Splits
    _demand: LinkDemand
    _out: dict[int, OutLink]
    _in: dict[bytes, InLink]
    _peers: dict[bytes, OutLink]
    _closed: bool
    _now: float

    # ----------------------------------------------------------------- what the driver takes

    @property
    def events(self) -> list[Event]:
        return self.outbox.events

    @events.setter
    def events(self, events: list[Event]) -> None:
        self.outbox.events = events

    @property
    def out_frames(self) -> list[tuple[int, bytes]]:
        return self.outbox.out_frames

    @out_frames.setter
    def out_frames(self, frames: list[tuple[int, bytes]]) -> None:
        self.outbox.out_frames = frames

    @property
    def in_frames(self) -> list[tuple[bytes, bytes]]:
        return self.outbox.in_frames

    @in_frames.setter
    def in_frames(self, frames: list[tuple[bytes, bytes]]) -> None:
        self.outbox.in_frames = frames

    @property
    def batching(self) -> bool:
        """Off: frames are sealed at once. On (the driver): staged until `seal_staged`."""
        return self.outbox.batching

    @batching.setter
    def batching(self, on: bool) -> None:
        self.outbox.batching = on

    def seal_staged(self) -> None:
        self.outbox.seal_staged()

    def peers(self) -> list[OutLink]:
        """The UP links this node dialled, one per peer."""
        return list(self._peers.values())

    def links(self) -> list[OutLink]:
        return list(self._out.values())

    def inbound(self) -> list[InLink]:
        return list(self._in.values())

    def add_candidate(self, endpoint: str, now: float, *, seed: bool = False) -> None:
        """An endpoint to join the mesh through (a seed, or one discovery found)."""
        if not self._closed:
            self._demand.candidate(endpoint, now, seed=seed)

    def want(self, cluster: str, now: float) -> int:
        """This node calls `cluster`: link to its members; how many membership knows, less
        those this node found gone itself (`LinkDemand.unreachable`). Its traffic split
        applies from now on."""
        if cluster not in self.splits.called:
            self.splits.call(cluster)
        return self._demand.want(cluster, now)

    def take_datagrams(self) -> list[tuple[str, bytes]]:
        """Membership's datagrams to send: (address, datagram) each."""
        return self.membership.take_outbox()

    def known(self) -> list[tuple[Member, OutLink | None]]:
        """Every member membership knows (any state), with this node's link to it if any."""
        peers = self._peers
        return [(m, peers.get(m.record.node_id)) for m in self.membership.members()]

    @property
    def pending_count(self) -> int:
        return len(self.calls.pending)

    @property
    def reply_cache(self) -> ReplyCache:
        return self.calls.replies

    @property
    def publish_blocked(self) -> bool:
        return self.pubsub.blocked

    # Each below is the concern's method of (nearly) the same name: see its docstring there.

    def members(self, cluster: str) -> list[OutLink]:
        return self.calls.members(cluster)

    def request(
        self,
        cluster: str,
        payload: bytes,
        timeout: float,
        now: float,
        hedge: float | None = None,
        kind: int = 5,  # Kind.REQUEST
        priority: int = 0,
        trace: bytes = b"",
    ) -> int:
        return self.calls.request(
            cluster, payload, timeout, now, hedge, kind, priority, trace or None
        )

    def fanout(
        self,
        kind: int,
        cluster: str,
        payload: bytes,
        timeout: float,
        now: float,
        trace: bytes = b"",
    ) -> list[tuple[int, bytes]]:
        return self.calls.fanout(kind, cluster, payload, timeout, now, trace or None)

    def request_link(self, req_id: int) -> int:
        return self.calls.request_link(req_id)

    def cancel(self, req_id: int) -> None:
        self.calls.cancel(req_id)

    def reply(self, token: Token, payload: bytes, *, error: bool = False) -> None:
        self.calls.reply(token, payload, error=error)

    def reply_error(self, token: Token, exc: BaseException) -> None:
        self.calls.reply_error(token, exc)

    def subscribe(self, pattern: str) -> None:
        self.pubsub.subscribe(pattern)

    def unsubscribe(self, pattern: str) -> None:
        self.pubsub.unsubscribe(pattern)

    def subscribers(self, topic: str) -> list[bytes]:
        return self.pubsub.subscribers(topic)

    def blocked_subscribers(self, topic: str) -> list[bytes]:
        return self.pubsub.blocked_subscribers(topic)

    def publish(
        self,
        topic: str,
        payload: bytes,
        stamp: float = 0.0,
        msg_id: bytes = b"",
        trace: bytes = b"",
    ) -> int:
        return self.pubsub.publish(topic, payload, stamp, msg_id, trace)

    def release(self, routing_id: bytes, count: int = 1) -> bool:
        return self.pubsub.release(routing_id, count)

    def open_tunnel(self, cluster: str, window: int, trace: bytes = b"") -> int:
        return self.tunnels.open(cluster, window, self._now, trace)

    def tunnel_accept(self, handle: int, window: int) -> None:
        self.tunnels.accept(handle, window)

    def tunnel_send(self, handle: int, op: int, arg: int = 0, data: bytes = b"") -> None:
        self.tunnels.send(handle, op, arg, data)

    def tunnel_forget(self, handle: int) -> None:
        self.tunnels.forget(handle)

    def tunnel_peer(self, handle: int) -> bytes:
        return self.tunnels.peer(handle)

    def tunnel_credit(self, handle: int) -> int:
        return self.tunnels.credit(handle)

    @property
    def tunnel_count(self) -> int:
        return len(self.tunnels.ends)
