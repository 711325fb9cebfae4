"""The sans-I/O node: frames and datagrams in, events, frames and datagrams out.

Theory of operation
-------------------
Who is in the mesh is `membership`'s to say: SWIM over datagrams, each node probing one other
per period, so the cost per node stays flat however large the mesh grows. Each member's record
says where it listens and, through tags only holders of the right key can read, which clusters
it serves and which topic scopes it reads; the `directory` keeps those answers for the clusters
and scopes this node uses. Records also carry members' versions and the traffic splits of
clusters, which `splits` reads and hands to the calls (`split`).

Links carry the traffic, and only where there is traffic: `MeshCore` dials a member when this
node calls a cluster it serves (`want`), publishes in a scope it reads, or joins the mesh
through it (seeds, discovery), and closes a link nothing has needed for `idle_link_after`,
least recently needed first when it reaches `max_links`. A node sends its requests on the
links it dialled and serves requests on the links dialled to it. Membership's verdicts act on
the links: a member declared dead or gone has its links closed, and its requests in flight are
resent to other members within their deadlines; those left with no live member to go to fail
with NoResponders at once, as a new request would.

What the transport shows is quicker than any probe: a killed process's kernel closes its
connections at once and refuses new ones. So when an UP link's connection drops, its endpoint
is dialled again at once (again at once, a few times, if that connects and drops before its
handshake: a dying process's listener may still take one), and if a dial is refused the member
is taken out of this node's routing (`LinkDemand.unreachable`; counted in `peers_taken_out`):
calls into a cluster with no other member fail with NoResponders at once, parked ones
included. It is this node's view alone: membership still probes the member and gives its own
verdict. A drop alone is no such evidence (a live peer may close or lose a connection), nor is
a refusal alone (an endpoint may be stale) or a dial that times out. The member is put back
(`peers_put_back`) when a handshake with it completes, either way, or membership hears a newer
incarnation of it.

`MeshCore` keeps the link table and walks each link through its lifecycle (`links`): it dials,
runs the handshake (`handshake`, which also proves the mesh key and exchanges membership
records), closes and forgets. Everything else is a concern of its own, told of the link table
through one interface, `LinkObserver` (link up, link down with its reason, inbound link up,
inbound link gone), in this order:

- `liveness`: heartbeats of busy links, and what their silence means;
- `pubsub`: interest, publishing, credit;
- `tunnels`: tunnel ends and their ops;
- `calls`: requests as caller (resends, hedges, deadlines, and through `outliers` the members
  kept out of rotation for a while, which this node's record tells the mesh) and as member
  (the reply cache).

`outbox` holds what the core hands its driver: events, and frames sealed per link (staged and
batched while the driver flushes); `take_datagrams` hands it membership's datagrams.

Every frame or datagram from a peer is checked (header, sequence, seal, envelope shape) before
it changes any state; a bad one is dropped and counted under its reason in `stats`, never
raised. The driver calls `receive_*`, `tick`, `request`, `reply`, ..., then takes `events`,
`out_frames`, `in_frames` and `take_datagrams()`. The public methods of this class (with those
it inherits from `api.CoreApi`, which delegate to the concerns) are the core's whole API.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from random import Random
from typing import Any

from irismesh._core.api import CoreApi
from irismesh._core.calls import Calls
from irismesh._core.config import CoreConfig
from irismesh._core.demand import DROPPED, REDIALS_AFTER_DROP, LinkDemand
from irismesh._core.directory import Directory
from irismesh._core.events import (
    CloseLink,
    LinksChanged,
    OpenLink,
    PeerDown,
    PeerSuspect,
    PeerUp,
)
from irismesh._core.frames import (
    HEADER_SIZE,
    MAX_CLUSTERS,
    BodyCodec,
    Kind,
    batch_spans,
    decode_header,
    decode_traced,
)
from irismesh._core.handshake import Handshake
from irismesh._core.links import (
    DialRecord,
    InLink,
    LinkObserver,
    LinkState,
    OutLink,
    open_frame,
)
from irismesh._core.liveness import LinkWatch
from irismesh._core.membership import Membership
from irismesh._core.outbox import Outbox
from irismesh._core.outliers import SharedEjections, ejected_by
from irismesh._core.pubsub import PubSubCore
from irismesh._core.records import (
    MemberChanged,
    MemberDown,
    MemberRecord,
    MemberState,
    MemberSuspect,
    MemberUp,
    NodeIdentity,
    node_id_of,
    validate_name,
)
from irismesh._core.rights import UNCHECKED, GrantPolicy, PeerGrant, Rights
from irismesh._core.sealing import NodeSecurity
from irismesh._core.split import Split, Splits, check_weights, validate_version
from irismesh._core.tunnels import TunnelTable
from irismesh.errors import ConfigurationError, NoKey, ProtocolError

_PING, _PONG, _REQUEST, _REPLY = int(Kind.PING), int(Kind.PONG), int(Kind.REQUEST), int(Kind.REPLY)
_BROADCAST, _SURVEY, _BATCH = int(Kind.BROADCAST), int(Kind.SURVEY), int(Kind.BATCH)
_JOB = int(Kind.JOB)
_SUBSCRIBE, _UNSUBSCRIBE = int(Kind.SUBSCRIBE), int(Kind.UNSUBSCRIBE)
_CREDIT, _PUBLISH, _TUNNEL = int(Kind.CREDIT), int(Kind.PUBLISH), int(Kind.TUNNEL)
_PUBLISH_STAMPED = int(Kind.PUBLISH_STAMPED)
_PUBLISH_KINDS = (
    _PUBLISH,
    _PUBLISH_STAMPED,
    int(Kind.PUBLISH_RETAINED),
    int(Kind.PUBLISH_RUN),
    int(Kind.PUBLISH_TRACED),
)
_BYE, _CANCEL = int(Kind.BYE), int(Kind.CANCEL)
_TRACED = int(Kind.TRACED)
_CALL_KINDS = frozenset((_REQUEST, _BROADCAST, _SURVEY, _JOB, _TUNNEL, _TRACED))
_REPLY_KINDS = frozenset((_REPLY, _TUNNEL))
_REKEY = "rekey"  # the BYE reason of a link closed because a key it used was removed
_GRANT = "grant"  # the BYE reason of a link closed because the peer's grant stopped holding
_MAX_INBOUND = 4096  # links peers dialled to this node at once
_HOUSEKEEPING = 1.0  # idle links, wanted clusters and redials are looked at this often


def address_of(endpoint: str) -> str:
    """The datagram address a node at `endpoint` takes by default: same host, same port."""
    return endpoint.removeprefix("tcp://")


class MeshCore(CoreApi):
    """One node's protocol state. Not thread-safe; the driver owns it."""

    def __init__(
        self,
        *,
        node_id: bytes,
        endpoint: str,
        clusters: Iterable[str],
        security: NodeSecurity,
        rng: Random,
        randbytes: Callable[[int], bytes],
        config: CoreConfig | None = None,
        address: str | None = None,
        now: float = 0.0,
        name: str = "",
        version: str = "",
        identity: NodeIdentity | None = None,
        grants: GrantPolicy | None = None,
    ) -> None:
        if identity is not None and node_id_of(identity.public) != node_id:
            raise ConfigurationError("the node id is not the one its identity's key derives")
        self.node_id = node_id
        self.name = validate_name(name) if name else ""
        self.version = validate_version(version)
        self.endpoint = endpoint
        self.address = address or address_of(endpoint)
        self.clusters = tuple(dict.fromkeys(clusters))
        if len(self.clusters) > MAX_CLUSTERS:
            raise ConfigurationError(
                f"a node serves at most {MAX_CLUSTERS} clusters, got {len(self.clusters)}"
            )
        self.config = config = config or CoreConfig()
        self.stats: Counter[str] = Counter()
        self._security = security
        # Grants (`rights`): None, or a policy that does not require them, allows anything.
        self._grants = grants
        # Whether revoked keys' nodes are barred from membership: while grants are required.
        self._barring = grants is not None and grants.required
        self._own = own = UNCHECKED if grants is None else grants.own()
        self.serving = self._allowed_to_serve()
        self._rng = rng  # balancing, jitter and gossip: need not be unpredictable
        self._codec = codec = BodyCodec(config.max_payload)
        self._max_frame = config.max_frame
        self._closed = False
        self._now = now  # the latest time the driver gave (or the start)
        # The link table. Concerns get these very dicts to read; only the engine changes them.
        self._out: dict[int, OutLink] = {}
        self._in: dict[bytes, InLink] = {}
        self._in_by_peer: dict[bytes, InLink] = {}
        self._peers: dict[bytes, OutLink] = {}  # node id -> its UP dialled link
        self._dials: dict[str, DialRecord] = {}
        self._dials[endpoint] = DialRecord(endpoint, seed=False, next_at=float("inf"))
        self._next_link = 1
        self._next_housekeeping = now
        self._tick_due = now  # when the last tick asked for the next one
        # Membership, and what its records say this node can reach.
        stats = self.stats
        self.directory = directory = Directory(security)
        directory.version = self.version
        tags = directory.own_tags(node_id, self.serving, ())
        record = MemberRecord(node_id, endpoint, self.address, tags, self.name)
        self.membership = membership = Membership(
            record,
            sealer=security.datagram_sealer(node_id),
            rng=rng,
            config=config.membership,
            stats=stats,
            identity=identity,
        )
        # The concerns.
        self.outbox = outbox = Outbox(
            codec=codec, stats=stats, inbound=self._in, max_payload=config.max_payload
        )
        self._handshake = Handshake(
            node_id=node_id,
            endpoint=endpoint,
            clusters=self.serving,
            security=security,
            randbytes=randbytes,
            codec=codec,
            stats=stats,
            outbox=outbox,
            record=lambda: (
                membership.incarnation,
                self.address,
                membership.me.tags,
                membership.sealed_name(),
                membership.signed_me().signature,
            ),
            open_name=membership.open_name,
            identity=identity,
            grants=grants,
        )
        self.calls = calls = Calls(
            config=config,
            security=security,
            rng=rng,
            stats=stats,
            outbox=outbox,
            inbound=self._in,
            peers=self._peers,
            cluster_slot=self._handshake.cluster_slot,
            want=self.want,
            clock=lambda: self._now,
        )
        self.splits = Splits(
            served=self.clusters,
            security=security,
            directory=directory,
            randbytes=randbytes,
            stats=stats,
            routes=calls.routes,
            carried=directory.notes,
        )
        # Which members this node keeps out of rotation, as its record says (`outliers`).
        self._ejections = SharedEjections(
            security=security, randbytes=randbytes, carried=directory.ejections
        )
        self.pubsub = pubsub = PubSubCore(
            config=config,
            security=security,
            stats=stats,
            outbox=outbox,
            handshake=self._handshake,
            inbound=self._in,
            peers=self._peers,
            readers=lambda scope: self._demand.readers(scope),
            interest_changed=self._interest_changed,
        )
        self.tunnels = tunnels = TunnelTable(
            config=config, rng=rng, stats=stats, outbox=outbox, members_for=calls.members_for
        )
        self._watch = watch = LinkWatch(
            config=config,
            stats=stats,
            outbox=outbox,
            out=self._out,
            migrate=calls.migrate,
            probe_soon=membership.probe_soon,
        )
        self._demand = LinkDemand(
            config=config,
            stats=stats,
            directory=directory,
            peers=self._peers,
            dials=self._dials,
            own_endpoint=endpoint,
            rng=rng,
            open_link=self._open_link,
            link_count=lambda: len(self._out),
            goodbye=self._goodbye,
            tunnels_use=tunnels.uses,
            alone=lambda: len(membership) == 0,
            clock=lambda: self._now,
        )
        self._observers: tuple[LinkObserver, ...] = (watch, pubsub, tunnels, calls)
        calls.rights = own.rights
        pubsub.rights_changed(own.rights)
        # Frame dispatch, bound once: these run once per message.
        self._on_reply = calls.on_reply
        self._on_request = calls.on_request
        self._on_publish_batch = pubsub.on_publish_batch
        self._on_tunnel_out = tunnels.on_out
        self._on_tunnel_in = tunnels.on_in

    # ----------------------------------------------------------------- introspection

    def next_deadline(self, now: float) -> float:
        """When `tick` must next run: a deadline, a probe, a ping, or housekeeping."""
        due = min(self.membership.next_deadline(), self._watch.next_deadline(now))
        pending = self.calls.pending.next_deadline()
        return due if pending is None else min(due, pending)

    def knows_inbound(self, routing_id: bytes) -> bool:
        """Whether a link a peer dialled is known under `routing_id`: its HELLO proved the
        mesh key (until the link is forgotten)."""
        return routing_id in self._in

    # ----------------------------------------------------------------- membership

    def receive_datagram(self, source: str, datagram: bytes, now: float) -> None:
        """A membership datagram arrived from `source` (host:port)."""
        self._now = now
        self.membership.receive(source, datagram, now)
        if self.membership.events:
            self._after_membership(now)
        if self.membership.rechecks:
            self._recheck_barred(now)
        if self.membership.notices:
            self._on_notices(now)

    def _interest_changed(self) -> None:
        """This node's subscriptions now reach other topic scopes: a new record says so."""
        self._retag()

    def _retag(self) -> None:
        """What this node's record carries changed (subscriptions, a split's note): a new
        record says so."""
        tags = self.directory.own_tags(self.node_id, self.serving, self.pubsub.subscribed)
        if tags != self.membership.me.tags:
            self.membership.update(self._now, tags=tags)

    def _after_membership(self, now: float) -> None:
        """Act on what membership decided: peers up, suspect or down; new nodes to link to."""
        membership, events, directory = self.membership, self.outbox.events, self.directory
        splits = self.splits
        gained = retag = False
        while membership.events:
            changes, membership.events = membership.events, []
            for change in changes:
                gained |= directory.on_event(change)
                if splits.watched:
                    retag |= splits.on_event(change)
                if isinstance(change, MemberUp):
                    record = change.record
                    self.stats["peers_up"] += 1
                    events.append(
                        PeerUp(node_id=record.node_id, endpoint=record.endpoint, name=record.name)
                    )
                elif isinstance(change, MemberDown):
                    self._peer_gone(change.record, change.reason, now)
                elif isinstance(change, MemberSuspect):
                    link = self._peers.get(change.node_id)
                    if link is not None:
                        link.suspect = change.suspect
                    events.append(PeerSuspect(node_id=change.node_id, suspect=change.suspect))
                    if not change.suspect:  # refuted: a newer incarnation spoke
                        self._put_back(change.node_id)
                elif isinstance(change, MemberChanged):  # a newer incarnation's record
                    self._put_back(change.record.node_id)
            self.pubsub.readers_changed()
        if retag:
            self._retag()
        if gained:
            self._demand.dial_wanted(now)

    def _peer_gone(self, record: MemberRecord, reason: str, now: float) -> None:
        """Membership declared a peer dead (its links go, and its requests move), or it left.

        A node that leaves says BYE on each of its links after what it still had to send, but
        its leave travels as a datagram and may overtake that: its links close on their BYE.
        """
        node_id = record.node_id
        self.stats["peers_down_" + reason] += 1
        self._demand.unreachable.pop(node_id, None)  # membership's verdict now
        if reason == "dead":
            link = self._peers.get(node_id)
            if link is not None:
                self._close_out(link, now, reason)
            for inlink in [x for x in self._in.values() if x.peer_id == node_id]:
                self._forget_in(inlink)
            self.calls.fail_unserved(now)
        self._demand.forget(record.endpoint)
        self.outbox.events.append(
            PeerDown(node_id=node_id, endpoint=record.endpoint, reason=reason, name=record.name)
        )

    # ----------------------------------------------------------------- dialling

    def _open_link(self, record: DialRecord, now: float) -> None:
        link_id = self._next_link
        self._next_link += 1
        self._out[link_id] = self._handshake.hello(link_id, record.endpoint, now)
        record.link_id = link_id
        self.outbox.events.append(OpenLink(link_id=link_id, endpoint=record.endpoint))
        self.outbox.link_events = True
        self.stats["dials"] += 1

    def _goodbye(self, link: OutLink, now: float, reason: str) -> None:
        self.outbox.send_out(link, _BYE, [reason])
        self._close_out(link, now, reason)

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
            body = open_frame(link, scope, seq, frame)
            link.last_heard = now
            if link.suspect and link.busy:  # a silent busy link spoke again
                link.suspect = False
            if kind == _REPLY:
                self._on_reply(link, body, now)
                return
            if kind == _TUNNEL:
                self._on_tunnel_out(link, scope, body)
                return
            if kind == _BATCH:
                for entry_kind, start, end in batch_spans(body, _REPLY_KINDS):
                    if entry_kind == _REPLY:
                        self._on_reply(link, body, now, start, end)
                    else:
                        self._on_tunnel_out(link, scope, body[start:end])
                return
            env = self._codec.unpack(body, kind)
            if kind == _PONG:
                self._watch.on_pong(link, env, now)
            elif kind == _CREDIT:
                self.pubsub.on_credit(link, env[0])
            elif kind == _SUBSCRIBE:
                self.pubsub.on_interest(link, env[1], add=True, grant=env[0])
            elif kind == _UNSUBSCRIBE:
                self.pubsub.on_interest(link, env[0], add=False)
            elif kind == _BYE:
                # A member whose keys changed asks to be dialled again at once ("rekey"), as
                # does one that found this node's grant no longer holds ("grant").
                reason = env[0] if env[0] in (_REKEY, _GRANT) else "bye"
                self._close_out(link, now, reason)
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
            body = open_frame(link, scope, seq, frame)
            link.last_heard = now
            if kind in (_REQUEST, _BROADCAST, _SURVEY, _JOB):
                self._on_request(link, scope, body, now, kind)
                return
            if kind == _TUNNEL:
                self._on_tunnel_in(link, scope, body)
                return
            if kind in _PUBLISH_KINDS:
                slot_scope = link.topic_slots.get(scope)
                if slot_scope is None:
                    raise ProtocolError("bad_scope", "PUBLISH")
                self.pubsub.on_publish(link, body, slot_scope, kind)
                return
            if kind == _BATCH:
                slot_scope = link.topic_slots.get(scope)
                if slot_scope is not None:
                    self._on_publish_batch(link, body, slot_scope)
                    return
                for entry_kind, start, end in batch_spans(body, _CALL_KINDS):
                    if entry_kind == _TUNNEL:
                        self._on_tunnel_in(link, scope, body[start:end])
                    elif entry_kind == _TRACED:
                        self._on_traced(link, scope, body, now, start, end)
                    else:
                        self._on_request(link, scope, body, now, entry_kind, start, end)
                return
            if kind == _TRACED:
                self._on_traced(link, scope, body, now, 0, len(body))
                return
            env = self._codec.unpack(body, kind)
            if kind == _PING:
                self.calls.forget_replies(link, env[1])  # the caller's acks ride on its pings
                self._watch.on_ping(link, env[0], len(self.calls.replies))
            elif kind == _CANCEL:
                self.calls.on_cancel(link, env[0])
            elif kind == _BYE:
                self._forget_in(link)
            else:
                raise ProtocolError("unexpected", Kind(kind).name)
        except ProtocolError as exc:
            self.stats["dropped_" + exc.reason] += 1

    def _on_traced(
        self, link: InLink, scope: int, body: bytes, now: float, start: int, end: int
    ) -> None:
        """A call with its caller's trace context (TRACED): `body[start:end]`."""
        kind, trace, first = decode_traced(body, start, end)
        if kind == _TUNNEL:
            self._on_tunnel_in(link, scope, body[first:end], trace)
        else:
            self._on_request(link, scope, body, now, kind, first, end, trace)

    # ----------------------------------------------------------------- link lifecycle

    def _on_hello(self, routing_id: bytes, env: list[Any], now: float) -> None:
        if len(self._in) >= _MAX_INBOUND:
            raise ProtocolError("too_many_links")
        if self._closed:
            self._handshake.refuse(routing_id, "closing")
            return
        link, (record, incarnation) = self._handshake.accept(routing_id, env, now)
        # An older link of the same peer is kept: the peer may still use it (it reached us under
        # two names and kept the first) or it is gone, and then membership says so.
        self._in[routing_id] = link
        self._in_by_peer[link.peer_id] = link
        if self._demand.unreachable:
            self._put_back(link.peer_id)
        for observer in self._observers:
            observer.inbound_up(link, now)
        self._unbar(link.peer_id)
        self.membership.learn(record, incarnation, now)
        self._after_membership(now)

    def _on_welcome(self, link: OutLink, env: list[Any], now: float) -> None:
        peer_id = env[0]
        if peer_id == self.node_id:
            self._close_out(link, now, "self")
            return
        if peer_id in self._peers:  # another endpoint of a peer already linked
            self._close_out(link, now, "duplicate")
            return
        record, incarnation = self._handshake.welcome(link, env)
        link.last_heard = link.last_sample = now
        self._peers[peer_id] = link
        if self._demand.unreachable:
            self._put_back(peer_id)
        dial = self._dials.get(link.endpoint)
        if dial is not None:
            dial.failures = 0
            dial.dropped = b""  # answered
        self.calls.linked.clear()
        self.stats["links_up"] += 1
        self.outbox.events.append(LinksChanged())
        for observer in self._observers:
            observer.link_up(link, now)
        self._unbar(peer_id)
        self.membership.learn(record, incarnation, now)
        if dial is not None and dial.join:  # joining the mesh through it: exchange tables
            dial.join = dial.seed
            self.membership.join(record.address, now)
        self._after_membership(now)

    def _recheck_barred(self, now: float) -> None:
        """Barred nodes that spoke: dial each, so that one holding a grant issued after its
        revocation proves it at the handshake (and is unbarred); the others are refused there
        again (`dropped_revoked`)."""
        records, self.membership.rechecks = self.membership.rechecks, []
        for record in records:
            if record.node_id not in self._peers:
                self.stats["revoked_members_rechecked"] += 1
                self._demand.dial_member(record, now)

    def _unbar(self, peer_id: bytes) -> None:
        """A barred node linked: the handshake admitted its grant, so it is one issued after
        its revocation, and membership takes its records again."""
        if self._barring and self.membership.barred(peer_id):
            self.membership.unbar(peer_id)
            self.stats["revoked_members_regranted"] += 1

    def _close_out(self, link: OutLink, now: float, reason: str) -> None:
        was_up = link.state is LinkState.UP
        link.state = LinkState.CLOSED
        del self._out[link.link_id]
        events = self.outbox.events
        events.append(CloseLink(link_id=link.link_id))
        self.outbox.link_events = True
        record = self._dials.get(link.endpoint)
        if record is not None and record.link_id != link.link_id:
            record = None  # not the record this link was dialled through
        dropped = b""
        if record is not None:
            dropped, record.dropped = record.dropped, b""
            self._demand.dial_ended(record, reason, was_up, now)
        if not was_up:
            self.stats["dials_failed"] += 1
            self.stats["dials_failed_" + reason.partition(":")[0]] += 1
            if dropped and record is not None:
                self._redial_failed(record, dropped, reason, now)
            return
        self.stats["links_down_" + reason] += 1
        if self._peers.get(link.peer_id) is link:
            del self._peers[link.peer_id]
        self.calls.linked.clear()
        events.append(LinksChanged())
        redial = False
        if record is not None and reason in DROPPED:
            # Its endpoint is dialled again at once (`dial_ended`), by the resends below or
            # here if the link was still needed: a refusal there says the member is gone.
            record.dropped = link.peer_id
            redial = self._demand.needed(link, now)  # asked before the resends empty it
        for observer in self._observers:
            observer.link_down(link, reason, now)
        if reason not in ("bye", "idle", "dead", "left", _REKEY, _GRANT):
            # The transport broke (a peer killed closes its sockets at once): ask membership.
            self.membership.probe_soon(link.peer_id, now)
        if (
            redial
            and record is not None
            and not record.link_id
            and self._dials.get(record.endpoint) is record
            and not self._closed
        ):
            self._demand.dial(record, now)

    def _redial_failed(self, record: DialRecord, node_id: bytes, reason: str, now: float) -> None:
        """The dial made through `record` since `node_id`'s link dropped failed, for `reason`."""
        if reason == "refused":  # the transport's own refusal (a REFUSE says "refused: ...")
            self._take_out(node_id, now)
        elif (
            reason in DROPPED
            and record.failures <= REDIALS_AFTER_DROP
            and self._dials.get(record.endpoint) is record
            and not record.link_id
            and not self._closed
        ):
            # Connected, then dropped before its handshake: a killed process's listener may
            # still take a connection while its kernel closes its sockets one by one (the
            # connection first). Dial again at once: by then nothing listens.
            record.dropped = node_id
            self._demand.dial(record, now)

    def _take_out(self, node_id: bytes, now: float) -> None:
        """`node_id`'s link dropped and its endpoint refused the redial: out of this node's
        routing (see the module's docstring), unless membership holds it dead already or
        another link to it is up."""
        member = self.membership.get(node_id)
        unreachable = self._demand.unreachable
        if (
            member is None
            or member.state > MemberState.SUSPECT
            or node_id in self._peers
            or node_id in unreachable
        ):
            return
        unreachable[node_id] = member.incarnation
        self.stats["peers_taken_out"] += 1
        self.pubsub.readers_changed()
        self.calls.fail_unserved(now)

    def _put_back(self, node_id: bytes) -> None:
        """A member taken out of routing showed it lives: it routes again."""
        if self._demand.unreachable.pop(node_id, None) is not None:
            self.stats["peers_put_back"] += 1
            self.pubsub.readers_changed()

    def _forget_in(self, link: InLink) -> None:
        for observer in self._observers:
            observer.inbound_gone(link)
        self._in.pop(link.routing_id, None)
        if self._in_by_peer.get(link.peer_id) is link:
            del self._in_by_peer[link.peer_id]

    def inbound_closed(self, routing_id: bytes) -> None:
        """The driver saw the connection of a link a peer dialled close (a transport that can
        tell): the link is forgotten at once, as on its BYE (its tunnels break), not when
        membership declares the peer dead; a peer that dials again gets a new link."""
        link = self._in.get(routing_id)
        if link is not None:
            self.stats["links_in_closed"] += 1
            self._forget_in(link)

    def link_failed(self, link_id: int, now: float, reason: str = "transport") -> None:
        """The driver saw the transport fail (disconnect, unroutable, refused)."""
        link = self._out.get(link_id)
        if link is not None and link.state is not LinkState.CLOSED:
            self._close_out(link, now, reason)

    # ----------------------------------------------------------------- keys

    def keys_changed(self, now: float) -> None:
        """The security now decides with another keyring (a rotation step): tell the mesh.

        The record's tags are made again (clusters served, topic scopes read, keys held) and
        announced; what other records say is read again with the new keys. A link goes on
        under the keys its handshake chose while this node still accepts them: a caller
        merely chooses its cluster slots again (its new primary, where the peer offered it).
        A link using a key no longer accepted is closed with BYE "rekey", and dialled again
        at once with a fresh handshake; its requests in flight are resent meanwhile (`calls`),
        and the member's reply cache answers a resend of one that already ran.
        """
        self._now = now
        self.membership.rekeyed()
        tags = self.directory.own_tags(self.node_id, self.serving, self.pubsub.subscribed)
        if tags != self.membership.me.tags:
            self.membership.update(now, tags=tags)
        holds = self._security.holds
        stale: list[OutLink] = []
        for link in self._out.values():
            if link.state is not LinkState.UP:
                continue
            if all(holds(handle) for handle in link.handles.values()):
                link.clusters.clear()
            else:
                stale.append(link)
        stale_in = [inlink for inlink in self._in.values() if not all(map(holds, inlink.handles))]
        self.stats["links_rekeyed"] += len(stale) + len(stale_in)
        self._handshake_again(now, _REKEY, stale, stale_in)
        self.calls.linked.clear()
        self.pubsub.readers_changed()
        if self.directory.recheck():
            self._demand.dial_wanted(now)
        if self.splits.reread():
            self._retag()
        self._ejections.reseal()
        self.calls.outliers.unshared = True

    # ----------------------------------------------------------------- what it serves

    def serve(self, clusters: Iterable[str], now: float) -> None:
        """Serve `clusters` from now on instead (a gateway's node serving what its peers
        export). A change in what it offers is announced in a new record, and every caller
        linked to it is asked to handshake again (BYE "rekey", as when its grant changes):
        a caller sees a link's offers at its handshake only, so it learns of a cluster added
        on a new one, and of one dropped at once. Their requests in flight are resent
        meanwhile. ConfigurationError beyond MAX_CLUSTERS."""
        served = tuple(dict.fromkeys(clusters))
        if len(served) > MAX_CLUSTERS:
            raise ConfigurationError(
                f"a node serves at most {MAX_CLUSTERS} clusters, got {len(served)}"
            )
        if served == self.clusters:
            return
        self._now = now
        self.clusters = served
        self.splits.serve(served)
        serving = self._allowed_to_serve()
        if serving == self.serving:
            return
        self.serving = self._handshake.clusters = serving
        self.stats["served_clusters_changed"] += 1
        self._retag()
        self._handshake_again(now, _REKEY, (), list(self._in.values()))

    def _handshake_again(
        self, now: float, reason: str, out: Iterable[OutLink], inbound: Iterable[InLink]
    ) -> None:
        """Ask these links to handshake again, and so to learn what changed: what is staged
        goes out first (a peer drops what follows a BYE); a link up says BYE `reason` and is
        dialled again at once; one still handshaking is closed and dialled again (its HELLO
        said what held before); an inbound link says BYE `reason` and is forgotten, its peer
        dials again. Requests in flight on them are resent meanwhile (`calls`)."""
        self.outbox.seal_staged()
        for link in out:
            if link.state is LinkState.UP:
                self._goodbye(link, now, reason)
            elif link.state is LinkState.HANDSHAKING:
                self._close_out(link, now, reason)
        for inlink in inbound:
            self.outbox.send_in(inlink, _BYE, [reason])
            self._forget_in(inlink)

    # ----------------------------------------------------------------- grants

    def _allowed_to_serve(self) -> tuple[str, ...]:
        """The clusters this node serves that its own grant allows; the others are refused
        (counted in `serve_refused`): it neither offers them nor says it serves them."""
        rights = self._own.rights
        allowed = tuple(cluster for cluster in self.clusters if rights.may_serve(cluster))
        if len(allowed) < len(self.clusters):
            self.stats["serve_refused"] += len(self.clusters) - len(allowed)
        return allowed

    def recheck_grants(self, now: float) -> None:
        """Grants may have changed (time passed, this node's grant file was reread, a
        revocation arrived): act on what no longer holds. Cheap when nothing changed.

        This node's own rights are taken again: what it serves (a change re-announces its
        record and asks its callers to handshake again, "rekey"), calls and publishes.
        A link whose peer's grant no longer holds (expired, revoked) is closed: a caller's
        requests move to other members, and the peer must handshake again, with a grant
        that holds, to get rights back.
        """
        grants = self._grants
        if grants is None or not grants.required:
            if self._barring:  # grants no longer required: revocations bar no one
                self._barring = False
                self.membership.unbar_all()
            return
        self._now = now
        own = grants.own()
        if own != self._own:
            # Peers hold this node's old grant on its links: handshake again on every one,
            # at once ("rekey"); requests in flight are resent meanwhile.
            self._own = own
            self.serving = self._handshake.clusters = self._allowed_to_serve()
            self.calls.rights = own.rights
            self.calls.linked.clear()
            self.calls.fail_forbidden()
            self.pubsub.rights_changed(own.rights)
            self.stats["grants_changed"] += 1
            self._retag()
            self._handshake_again(now, _REKEY, list(self._out.values()), list(self._in.values()))
        holds = grants.holds
        for link in list(self._out.values()):
            if link.state is LinkState.UP and not holds(link.public, link.grant):
                self.stats["links_closed_grant"] += 1
                self._goodbye(link, now, _GRANT)
        for inlink in list(self._in.values()):
            if not holds(inlink.public, inlink.grant):
                self.stats["links_closed_grant"] += 1
                self.outbox.send_in(inlink, _BYE, [_GRANT])
                self._forget_in(inlink)
        if not self._barring:  # grants required from now on: bar the keys revoked so far
            self._barring = True
            if grants.revoked_keys():
                for public in grants.revoked_keys():
                    self.membership.bar(node_id_of(public), now)
                self._after_membership(now)

    def _on_notices(self, now: float) -> None:
        """Revocations heard through gossip: each new and trusted one spreads on and applies
        at once; the others die out here."""
        notices, self.membership.notices = self.membership.notices, []
        grants = self._grants
        if grants is None:
            return
        revoked: list[tuple[bytes, bytes]] = []
        for notice in notices:
            public = grants.learn_key(notice)
            if public is not None:
                revoked.append((public, notice))
                self.membership.spread_notice(notice)
                self.stats["revocations_heard"] += 1
        if revoked:
            self._apply_revocations(revoked, now)

    def _apply_revocations(self, revoked: list[tuple[bytes, bytes]], now: float) -> None:
        """Keys just revoked, each with its notice: their links close, and in a mesh that
        requires grants their nodes leave membership as deaths they cannot refute
        (`Membership.bar`), so that no table, directory or probe keeps them; each is sent the
        notice, so that it refuses its own calls at once."""
        self.recheck_grants(now)
        if self._barring:
            for public, notice in revoked:
                self.membership.bar(node_id_of(public), now, notice)
            self._after_membership(now)

    def announce_revocation(self, notice: bytes, now: float) -> bool:
        """Apply an authority's revocation here and gossip it to the mesh: True if it is new
        and trusted (else nothing happens)."""
        grants = self._grants
        public = None if grants is None else grants.learn_key(notice)
        if public is None:
            return False
        self.membership.spread_notice(notice)
        self._apply_revocations([(public, notice)], now)
        return True

    def link_members(self, now: float) -> int:
        """Dial every live member not linked yet (to learn each one's grant: `mesh grants`);
        how many live members there are."""
        live = 0
        for member in self.membership.members():
            if member.state <= MemberState.SUSPECT:
                live += 1
                if member.record.node_id not in self._peers:
                    self._demand.dial_member(member.record, now)
        return live

    def linked_peers(self) -> list[bytes]:
        """The ids of the peers this node dialled and linked to."""
        return list(self._peers)

    def caller_rights(self, routing_id: bytes) -> Rights | None:
        """The rights of the caller on inbound link `routing_id` (a request token's third
        field), as its grant was verified at the handshake; None if that link is gone."""
        link = self._in.get(routing_id)
        return None if link is None else link.grant.rights

    def linked_grants(self) -> list[tuple[bytes, bytes, PeerGrant]]:
        """(peer id, public key, verified grant) of each peer linked, either way."""
        found = {
            link.peer_id: (link.peer_id, link.public, link.grant) for link in self._in.values()
        }
        for link in self._peers.values():
            found[link.peer_id] = (link.peer_id, link.public, link.grant)
        return list(found.values())

    # ----------------------------------------------------------------- traffic splits

    def set_split(self, cluster: str, weights: Mapping[str, int] | None, stamp: int) -> Split:
        """Set the split of `cluster` for the whole mesh (None: clear it), stamped `stamp`
        (newer than any set before: `split`); returns the split in effect here. This node's
        record carries it, and the cluster's members carry it on (`irismesh._core.split`)."""
        if not self._security.has_key(cluster):
            raise NoKey(cluster)
        checked = () if weights is None else check_weights(weights)
        split = self.splits.set(cluster, checked, stamp)
        self._retag()
        return split

    def split(self, cluster: str) -> Split | None:
        """The newest split of `cluster` this node knows (cleared: no weights), or None."""
        return self.splits.view(cluster)

    def split_carriers(self, cluster: str, stamp: int) -> tuple[int, int]:
        """(live members of `cluster` carrying its split stamped `stamp` or later, live
        members of `cluster`)."""
        return self.splits.carriers(cluster, stamp)

    def split_versions(self, cluster: str) -> tuple[dict[str, int], int]:
        """Live members of `cluster` by version its split names, and those of other versions."""
        return self.splits.versions(cluster)

    # ----------------------------------------------------------------- ejections, mesh-wide

    def ejected_by(self, clusters: Iterable[str]) -> dict[bytes, dict[str, list[bytes]]]:
        """Which live nodes (this one too) keep which members out of `clusters`' rotation, as
        their records say (`outliers`): member id prefix -> cluster -> the nodes' ids."""
        live = [m.record for m in self.membership.members() if m.state <= MemberState.SUSPECT]
        live.append(self.membership.me)
        return ejected_by(self._security, live, clusters)

    # ----------------------------------------------------------------- time

    def tick(self, now: float) -> None:
        """Membership's protocol period, busy links' heartbeats, housekeeping, deadlines."""
        self._now = now
        self.membership.tick(now)
        if self.membership.events:
            self._after_membership(now)
        watch = self._watch
        watch.tick_started(now, now - self._tick_due)
        handshake_timeout = self.config.handshake_timeout
        for link in list(self._out.values()):
            if link.state is LinkState.UP:
                reason = watch.watch(link, now)
                if reason is not None:
                    self._close_out(link, now, reason)
            elif now - link.opened > handshake_timeout:
                self._close_out(link, now, "handshake_timeout")
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + _HOUSEKEEPING
            if self._demand.unreachable:
                self._recheck_unreachable()
            self._demand.housekeep(now)
        self.calls.tick(now)
        outliers = self.calls.outliers
        if (
            outliers.unshared
            and self._ejections.due(now)
            and self._ejections.update(outliers.shared(), now)
        ):
            self._retag()
        self._tick_due = self.next_deadline(now)

    def _recheck_unreachable(self) -> None:
        """Members taken out of routing: put back those of which membership heard a newer
        incarnation (a restart that kept its id refutes in time), forget those it lost."""
        for node_id, incarnation in list(self._demand.unreachable.items()):
            member = self.membership.get(node_id)
            if member is None or member.state > MemberState.SUSPECT:
                del self._demand.unreachable[node_id]
            elif member.incarnation > incarnation:
                self._put_back(node_id)

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
        self.membership.leave(self._now)  # every member hears it at once
        for link in list(self._out.values()):
            if link.state is LinkState.UP:
                outbox.send_out(link, _BYE, ["closing"])
        self.tunnels.close()
        for inlink in list(self._in.values()):
            outbox.send_in(inlink, _BYE, ["closing"])
        self.calls.close()
