"""The sans-I/O node: frames in, events and frames out.

Theory of operation
-------------------
A node listens on one endpoint and dials every peer it learns of (seeds, discovery, the peer
lists its peers send, the endpoint in a peer's HELLO), so two nodes that know each other hold
two links, one dialled by each (see `links`). A node sends its requests on the links it
dialled and serves requests on the links dialled to it.

`MeshCore` keeps the link table and walks each link through its lifecycle (`links`): it dials,
runs the handshake (`handshake`), closes, redials with backoff and forgets. Everything else is
a concern of its own, told of the link table through one interface, `LinkObserver` (link up,
link down with its reason, inbound link up, inbound link gone), in this order:

- `liveness`: heartbeats, suspicion, indirect probes, loop stalls, peer-list gossip;
- `pubsub`: interest, publishing, credit;
- `tunnels`: tunnel ends and their ops;
- `calls`: requests as caller (resends, hedges, deadlines) and as member (the reply cache).

`outbox` holds what the core hands its driver: events, and frames sealed per link (staged and
batched while the driver flushes).

Every frame from a peer is checked (header, sequence, seal, envelope shape) before it changes
any state; a bad frame is dropped and counted under its reason in `stats`, never raised.
The driver calls `receive_*`, `tick`, `request`, `reply`, ..., then takes `events`,
`out_frames` and `in_frames`. The public methods of this class are the core's whole API; the
hot ones (`request`, `reply`, `publish`) may also be called on the concern directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from random import Random
from typing import Any

from irismesh._core.calls import Calls
from irismesh._core.config import CoreConfig
from irismesh._core.events import CloseLink, Event, OpenLink, PeerDown, PeerUp, Token
from irismesh._core.frames import (
    HEADER_SIZE,
    MAX_CLUSTERS,
    BodyCodec,
    Kind,
    decode_batch,
    decode_header,
)
from irismesh._core.handshake import Handshake
from irismesh._core.links import DialRecord, InLink, LinkObserver, LinkState, OutLink
from irismesh._core.liveness import Liveness
from irismesh._core.outbox import Outbox
from irismesh._core.pubsub import PubSubCore
from irismesh._core.replycache import ReplyCache
from irismesh._core.sealing import LinkSecurity
from irismesh._core.tunnels import TunnelTable
from irismesh.errors import ConfigurationError, ProtocolError

_PING, _PONG, _REQUEST, _REPLY = int(Kind.PING), int(Kind.PONG), int(Kind.REQUEST), int(Kind.REPLY)
_BROADCAST, _SURVEY, _BATCH = int(Kind.BROADCAST), int(Kind.SURVEY), int(Kind.BATCH)
_SUBSCRIBE, _UNSUBSCRIBE = int(Kind.SUBSCRIBE), int(Kind.UNSUBSCRIBE)
_CREDIT, _PUBLISH, _TUNNEL = int(Kind.CREDIT), int(Kind.PUBLISH), int(Kind.TUNNEL)
_PROBE, _PROBE_ACK = int(Kind.PROBE), int(Kind.PROBE_ACK)
_PEERS, _BYE = int(Kind.PEERS), int(Kind.BYE)
_CALL_KINDS = frozenset((_REQUEST, _BROADCAST, _SURVEY, _TUNNEL))
_REPLY_KINDS = frozenset((_REPLY, _TUNNEL))
_MAX_INBOUND = 4096  # links peers dialled to this node at once
_MAX_DIAL_RECORDS = 4096  # endpoints remembered (seeds always are)


class MeshCore:
    """One node's protocol state. Not thread-safe; the driver owns it."""

    def __init__(
        self,
        *,
        node_id: bytes,
        endpoint: str,
        clusters: Iterable[str],
        security: LinkSecurity,
        rng: Random,
        randbytes: Callable[[int], bytes],
        config: CoreConfig | None = None,
    ) -> None:
        self.node_id = node_id
        self.endpoint = endpoint
        self.clusters = tuple(dict.fromkeys(clusters))
        if len(self.clusters) > MAX_CLUSTERS:
            raise ConfigurationError(
                f"a node serves at most {MAX_CLUSTERS} clusters, got {len(self.clusters)}"
            )
        self.config = config = config or CoreConfig()
        self.stats: Counter[str] = Counter()
        self._rng = rng  # balancing, jitter and gossip: need not be unpredictable
        self._codec = codec = BodyCodec(config.max_payload)
        self._max_frame = config.max_frame
        self._closed = False
        # The link table. Concerns get these very dicts to read; only the engine changes them.
        self._out: dict[int, OutLink] = {}
        self._in: dict[bytes, InLink] = {}
        self._in_by_peer: dict[bytes, InLink] = {}
        self._peers: dict[bytes, OutLink] = {}  # node id -> its UP dialled link
        self._members: dict[str, list[OutLink]] = {}  # cluster -> UP links serving it (cache)
        self._dials: dict[str, DialRecord] = {}
        self._dials[endpoint] = DialRecord(endpoint, seed=False, next_at=float("inf"))
        self._next_link = 1
        # The concerns.
        stats = self.stats
        self.outbox = outbox = Outbox(
            codec=codec, stats=stats, inbound=self._in, max_payload=config.max_payload
        )
        self._handshake = Handshake(
            node_id=node_id,
            endpoint=endpoint,
            clusters=self.clusters,
            security=security,
            randbytes=randbytes,
            codec=codec,
            stats=stats,
            outbox=outbox,
        )
        self.calls = calls = Calls(
            config=config,
            security=security,
            rng=rng,
            stats=stats,
            outbox=outbox,
            inbound=self._in,
            members=self._members,
            find_members=self.members,
        )
        self.pubsub = pubsub = PubSubCore(
            config=config,
            security=security,
            stats=stats,
            outbox=outbox,
            handshake=self._handshake,
            inbound=self._in,
        )
        self.tunnels = tunnels = TunnelTable(
            config=config, rng=rng, stats=stats, outbox=outbox, members_for=calls.members_for
        )
        self._liveness = liveness = Liveness(
            node_id=node_id,
            config=config,
            rng=rng,
            stats=stats,
            outbox=outbox,
            out=self._out,
            inbound=self._in,
            peers=self._peers,
            in_by_peer=self._in_by_peer,
            add_candidate=self.add_candidate,
            migrate=calls.migrate,
        )
        self._observers: tuple[LinkObserver, ...] = (liveness, pubsub, tunnels, calls)
        # Frame dispatch, bound once: these run once per message.
        self._on_reply = calls.on_reply
        self._on_request = calls.on_request
        self._on_publish_batch = pubsub.on_publish_batch
        self._on_tunnel_out = tunnels.on_out
        self._on_tunnel_in = tunnels.on_in

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

    # ----------------------------------------------------------------- introspection

    @property
    def pending_count(self) -> int:
        return len(self.calls.pending)

    def next_deadline(self) -> float | None:
        return self.calls.pending.next_deadline()

    def peers(self) -> list[OutLink]:
        return list(self._peers.values())

    def links(self) -> list[OutLink]:
        return list(self._out.values())

    def inbound(self) -> list[InLink]:
        return list(self._in.values())

    def members(self, cluster: str) -> list[OutLink]:
        """UP links to members of `cluster`; raises NoKey without a key for it."""
        members = self._members.get(cluster)
        if members is None:
            slot = self._handshake.cluster_slot
            members = [link for link in self._peers.values() if slot(link, cluster)]
            self._members[cluster] = members
        return members

    @property
    def reply_cache(self) -> ReplyCache:
        return self.calls.replies

    @property
    def publish_blocked(self) -> bool:
        return self.pubsub.blocked

    # ----------------------------------------------------------------- the concerns' API
    # Each is the concern's method of (nearly) the same name: see its docstring there.

    def request(
        self, cluster: str, payload: bytes, timeout: float, now: float, hedge: float | None = None
    ) -> int:
        return self.calls.request(cluster, payload, timeout, now, hedge)

    def fanout(
        self, kind: int, cluster: str, payload: bytes, timeout: float, now: float
    ) -> list[tuple[int, bytes]]:
        return self.calls.fanout(kind, cluster, payload, timeout, now)

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

    def publish(self, topic: str, payload: bytes) -> int:
        return self.pubsub.publish(topic, payload)

    def release(self, routing_id: bytes, count: int = 1) -> bool:
        return self.pubsub.release(routing_id, count)

    def open_tunnel(self, cluster: str, window: int) -> int:
        return self.tunnels.open(cluster, window)

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

    # ----------------------------------------------------------------- dialling

    def add_candidate(self, endpoint: str, now: float, *, seed: bool = False) -> None:
        """An endpoint worth dialling (from seeds, discovery or a peer)."""
        if self._closed:
            return
        record = self._dials.get(endpoint)
        if record is None:
            if len(self._dials) >= _MAX_DIAL_RECORDS and not seed:
                self.stats["candidates_dropped"] += 1
                return
            record = self._dials[endpoint] = DialRecord(endpoint, seed=False)
        if endpoint == self.endpoint:
            return  # never dial ourselves, even when listed as a seed
        if seed:
            record.seed = True
        if record.link_id or now < record.next_at:
            return
        self._dial(record, now)

    def _dial(self, record: DialRecord, now: float) -> None:
        if len(self._out) >= self.config.max_links:
            # Each dialled link costs sockets and file descriptors: a peer list cannot make us
            # open more than max_links at once. The record waits for its turn.
            self.stats["dials_deferred"] += 1
            record.next_at = now + self.config.redial_max * (0.5 + self._rng.random())
            if not record.seed:  # a deferral counts as a failed try: floods drain away
                record.failures += 1
                if record.failures >= self.config.forget_after_failures:
                    del self._dials[record.endpoint]
            return
        link_id = self._next_link
        self._next_link += 1
        self._out[link_id] = self._handshake.hello(link_id, record.endpoint, now)
        record.link_id = link_id
        self.outbox.events.append(OpenLink(link_id=link_id, endpoint=record.endpoint))
        self.stats["dials"] += 1

    # ----------------------------------------------------------------- frames in

    def receive_out(self, link_id: int, frame: bytes, now: float) -> None:
        """A frame arrived on a link this node dialled."""
        link = self._out.get(link_id)
        if link is None or link.state is LinkState.CLOSED:
            self.stats["dropped_closed_link"] += 1
            return
        try:
            kind, scope, seq = decode_header(frame, self._max_frame)
            if link.state is LinkState.HANDSHAKING:
                if kind == Kind.WELCOME:
                    try:
                        self._on_welcome(link, self._codec.unpack(frame[HEADER_SIZE:], kind), now)
                    except ProtocolError as exc:  # a peer that cannot handshake is no peer
                        self._close_out(link, now, exc.reason)
                        raise
                elif kind == Kind.REFUSE:
                    env = self._codec.unpack(frame[HEADER_SIZE:], kind)
                    self._close_out(link, now, f"refused: {env[0][:100]}")
                else:
                    raise ProtocolError("unexpected", Kind(kind).name)
                return
            body = self._open(link, scope, seq, frame)
            link.last_heard = now
            if link.suspect:  # heard again: the suspicion is refuted
                self._liveness.heard(link)
            if kind == _REPLY:
                self._on_reply(link, body, now)
                return
            if kind == _TUNNEL:
                self._on_tunnel_out(link, scope, body)
                return
            if kind == _BATCH:
                for entry_kind, entry in decode_batch(body, _REPLY_KINDS):
                    if entry_kind == _REPLY:
                        self._on_reply(link, entry, now)
                    else:
                        self._on_tunnel_out(link, scope, entry)
                return
            env = self._codec.unpack(body, kind)
            if kind == _PONG:
                self._liveness.on_pong(link, env, now)
            elif kind == _PROBE_ACK:
                self._liveness.on_probe_ack(env, now)
            elif kind == _CREDIT:
                self.pubsub.on_credit(link, env[0])
            elif kind == _SUBSCRIBE:
                self.pubsub.on_interest(link, env[1], add=True, grant=env[0])
            elif kind == _UNSUBSCRIBE:
                self.pubsub.on_interest(link, env[0], add=False)
            elif kind == _PEERS:
                self._liveness.on_peers(env, now)
            elif kind == _BYE:
                self._close_out(link, now, "left")
            else:
                raise ProtocolError("unexpected", Kind(kind).name)
        except ProtocolError as exc:
            self.stats["dropped_" + exc.reason] += 1

    def receive_in(self, routing_id: bytes, frame: bytes, now: float) -> None:
        """A frame arrived on a link a peer dialled (from our listening socket)."""
        try:
            kind, scope, seq = decode_header(frame, self._max_frame)
            link = self._in.get(routing_id)
            if link is None:
                if kind != Kind.HELLO:
                    raise ProtocolError("unknown_link", Kind(kind).name)
                self._on_hello(routing_id, self._codec.unpack(frame[HEADER_SIZE:], kind), now)
                return
            body = self._open(link, scope, seq, frame)
            link.last_heard = now
            if kind in (_REQUEST, _BROADCAST, _SURVEY):
                self._on_request(link, scope, body, now, kind)
                return
            if kind == _TUNNEL:
                self._on_tunnel_in(link, scope, body)
                return
            if kind == _PUBLISH:
                slot_scope = link.topic_slots.get(scope)
                if slot_scope is None:
                    raise ProtocolError("bad_scope", "PUBLISH")
                self.pubsub.on_publish(link, body, slot_scope)
                return
            if kind == _BATCH:
                slot_scope = link.topic_slots.get(scope)
                if slot_scope is not None:
                    self._on_publish_batch(link, body, slot_scope)
                    return
                for entry_kind, entry in decode_batch(body, _CALL_KINDS):
                    if entry_kind == _TUNNEL:
                        self._on_tunnel_in(link, scope, entry)
                    else:
                        self._on_request(link, scope, entry, now, entry_kind)
                return
            env = self._codec.unpack(body, kind)
            if kind == _PING:
                self.calls.forget_replies(link, env[1])  # the caller's acks ride on its pings
                self._liveness.on_ping(link, env[0], len(self.calls.replies))
            elif kind == _PROBE:
                self._liveness.on_probe(link, env, now)
            elif kind == _PEERS:
                self._liveness.on_peers(env, now)
            elif kind == _BYE:
                self._forget_in(link)
            else:
                raise ProtocolError("unexpected", Kind(kind).name)
        except ProtocolError as exc:
            self.stats["dropped_" + exc.reason] += 1

    def _open(self, link: OutLink | InLink, scope: int, seq: int, frame: bytes) -> bytes:
        """Check sequence and seal of a frame on an established link; return its body."""
        if seq <= link.recv_seq:
            raise ProtocolError("replay", f"seq {seq} after {link.recv_seq}")
        sealer = link.recv_sealers.get(scope)
        if sealer is None:
            raise ProtocolError("bad_scope", str(scope))
        body = sealer.open(frame[:HEADER_SIZE], seq, frame[HEADER_SIZE:])
        link.recv_seq = seq  # only an authentic frame may advance the window
        return body

    # ----------------------------------------------------------------- link lifecycle

    def _on_hello(self, routing_id: bytes, env: list[Any], now: float) -> None:
        if len(self._in) >= _MAX_INBOUND:
            raise ProtocolError("too_many_links")
        if self._closed:
            self._handshake.refuse(routing_id, "closing")
            return
        link = self._handshake.accept(routing_id, env, now)
        # An older link of the same peer is kept: the peer may still use it (it reached us under
        # two names and kept the first) or it is dead and falls silent; replies follow requests.
        self._in[routing_id] = link
        self._in_by_peer[link.peer_id] = link
        for observer in self._observers:
            observer.inbound_up(link, now)
        self.add_candidate(link.peer_endpoint, now)  # dial back: requests flow on dialled links

    def _on_welcome(self, link: OutLink, env: list[Any], now: float) -> None:
        peer_id = env[0]
        if peer_id == self.node_id:
            self._close_out(link, now, "self")
            return
        if peer_id in self._peers:  # another endpoint of a peer already linked
            self._close_out(link, now, "duplicate")
            return
        self._handshake.welcome(link, env)
        link.last_heard = now
        self._peers[peer_id] = link
        record = self._dials.get(link.endpoint)
        if record is not None:
            record.failures = 0
        self._members.clear()
        self.stats["peers_up"] += 1
        self.outbox.events.append(PeerUp(node_id=peer_id, endpoint=link.endpoint))
        for observer in self._observers:
            observer.link_up(link, now)

    def _close_out(self, link: OutLink, now: float, reason: str) -> None:
        was_up = link.state is LinkState.UP
        link.state = LinkState.CLOSED
        del self._out[link.link_id]
        events = self.outbox.events
        events.append(CloseLink(link_id=link.link_id))
        record = self._dials.get(link.endpoint)
        if record is not None and record.link_id == link.link_id:
            record.link_id = 0
            if reason in ("self", "duplicate"):
                record.next_at = float("inf")  # never useful to dial again
            elif not was_up or reason != "left":
                record.failures += not was_up
                cfg = self.config
                backoff = min(cfg.redial_max, cfg.redial_min * 2 ** min(record.failures, 10))
                record.next_at = now + backoff * (0.5 + self._rng.random())
                if not record.seed and record.failures >= cfg.forget_after_failures:
                    del self._dials[link.endpoint]
            elif not record.seed:
                del self._dials[link.endpoint]
        if not was_up:
            self.stats["dials_failed"] += 1
            return
        self.stats["peers_down_" + reason] += 1
        if self._peers.get(link.peer_id) is link:
            del self._peers[link.peer_id]
        self._members.clear()
        events.append(PeerDown(node_id=link.peer_id, endpoint=link.endpoint, reason=reason))
        for observer in self._observers:
            observer.link_down(link, reason, now)

    def _forget_in(self, link: InLink) -> None:
        for observer in self._observers:
            observer.inbound_gone(link)
        self._in.pop(link.routing_id, None)
        if self._in_by_peer.get(link.peer_id) is link:
            del self._in_by_peer[link.peer_id]

    def link_failed(self, link_id: int, now: float, reason: str = "transport") -> None:
        """The driver saw the transport fail (disconnect, unroutable, refused)."""
        link = self._out.get(link_id)
        if link is not None and link.state is not LinkState.CLOSED:
            self._close_out(link, now, reason)

    # ----------------------------------------------------------------- time

    def tick(self, now: float) -> None:
        """Heartbeats, failure detection, redials, gossip and request deadlines."""
        liveness = self._liveness
        liveness.tick_started(now)
        handshake_timeout = self.config.handshake_timeout
        for link in list(self._out.values()):
            if link.state is LinkState.UP:
                dead = liveness.watch(link, now)
                if dead is not None:
                    self._close_out(link, now, dead)
            elif now - link.opened > handshake_timeout:
                self._close_out(link, now, "handshake_timeout")
        for inlink in list(self._in.values()):
            if liveness.inbound_dead(inlink, now):
                self._forget_in(inlink)
        for record in list(self._dials.values()):
            # Seeds are redialled forever; other endpoints until forget_after_failures.
            if not record.link_id and now >= record.next_at and record.endpoint != self.endpoint:
                self._dial(record, now)
        liveness.gossip(now)
        self.calls.tick(now)

    def close(self) -> None:
        """Say goodbye on every link and fail what is pending; the driver then flushes."""
        if self._closed:
            return
        self._closed = True
        self.pubsub.closed = True
        # What is staged (publishes, replies, tunnel data) goes before the goodbyes: a peer
        # drops a link's later frames once it has heard BYE.
        outbox = self.outbox
        outbox.seal_staged()
        for link in list(self._out.values()):
            if link.state is LinkState.UP:
                outbox.send_out(link, _BYE, ["closing"])
        self.tunnels.close()
        for inlink in list(self._in.values()):
            outbox.send_in(inlink, _BYE, ["closing"])
        self.calls.close()
