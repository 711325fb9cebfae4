"""The sans-I/O node: frames in, events and frames out.

Theory of operation
-------------------
A node listens on one endpoint and dials every peer it learns of (seeds, discovery, the peer
lists its peers send, the endpoint in a peer's HELLO), so two nodes that know each other hold
two links, one dialled by each (see `links`). A node sends its requests on the links it
dialled and serves requests on the links dialled to it.

Handshake: the dialler sends HELLO (its id, a fresh nonce, its endpoint, its key-agreement
public key); the listener answers WELCOME (the same of its own, and one *offer tag* per key of
each cluster it serves). A tag is a MAC under the cluster's key over both nonces
(`LinkSecurity.offers`). The dialler learns that a peer serves cluster X only by computing X's
tag itself (`LinkSecurity.match`), which needs X's name and key: a node without the key learns
nothing, and old tags are useless on a new link. The n-th offer becomes scope slot n of the
link; requests and their replies name the slot, never the cluster, and are sealed under keys
derived from the cluster key, so only holders of the key can read, forge or answer them. The
link's own control frames (slot 0) are sealed under the agreed link key.

Liveness: the dialler pings every `heartbeat_interval`, the listener answers; any frame counts
as a sign of life. A dialled link silent for `dead_after` is dead: its in-flight requests are
resent on other members' links within their deadlines, with the same request id. A member
remembers recent request ids with their replies (`ReplyCache`), so a resend of a request that
already ran gets the remembered reply and a resend of one still running waits for it.
If this node's own loop stalls (its tick arrives late), the stall is not held against peers.

Every frame from a peer is checked (header, sequence, seal, envelope shape) before it changes
any state; a bad frame is dropped and counted under its reason in `stats`, never raised.
The driver calls `receive_*`, `tick`, `request`, `reply`, then takes `events` and `outbox`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from random import Random
from typing import Any

from irismesh._core import balancer
from irismesh._core.config import CoreConfig
from irismesh._core.events import (
    CloseLink,
    CreditArrived,
    Event,
    InterestChanged,
    MessagesArrived,
    OpenLink,
    PeerDown,
    PeerSuspect,
    PeerUp,
    ReplyArrived,
    RequestArrived,
    RequestFailed,
    Token,
    TunnelArrived,
    TunnelFrame,
)
from irismesh._core.frames import (
    ACKS,
    BATCH_ENTRY,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_ACKS,
    MAX_BATCH,
    MAX_CLUSTERS,
    MAX_OFFERS,
    MAX_PATTERNS_PER_FRAME,
    MAX_PEERS_PER_FRAME,
    NONCE_SIZE,
    PUBLISH_ENTRY,
    PUBLISH_FIELDS,
    REQUEST_FIELDS,
    STATUS_ERROR,
    STATUS_OK,
    VERSION,
    BodyCodec,
    Kind,
    TunnelOp,
    decode_batch,
    decode_header,
    decode_reply,
    decode_request,
    decode_tunnel,
    encode_batch,
    encode_header,
    encode_reply,
    encode_tunnel,
    pack_error,
)
from irismesh._core.links import DialRecord, InLink, LinkState, OutLink, TunnelEnd
from irismesh._core.pending import PendingRequest, PendingRequests
from irismesh._core.replycache import ReplyCache
from irismesh._core.sealing import LinkSecurity
from irismesh._core.topics import TopicTrie, parse_pattern_from_peer, parse_topic_from_peer
from irismesh.errors import (
    Closed,
    ConfigurationError,
    MemberLost,
    NoKey,
    NoResponders,
    Overloaded,
    PayloadTooLarge,
    ProtocolError,
    RequestTimeout,
    TunnelError,
)

_PING, _PONG, _REQUEST, _REPLY = int(Kind.PING), int(Kind.PONG), int(Kind.REQUEST), int(Kind.REPLY)
_BROADCAST, _SURVEY, _BATCH = int(Kind.BROADCAST), int(Kind.SURVEY), int(Kind.BATCH)
_SUBSCRIBE, _UNSUBSCRIBE = int(Kind.SUBSCRIBE), int(Kind.UNSUBSCRIBE)
_CREDIT, _PUBLISH = int(Kind.CREDIT), int(Kind.PUBLISH)
_TUNNEL = int(Kind.TUNNEL)
_PROBE, _PROBE_ACK = int(Kind.PROBE), int(Kind.PROBE_ACK)
_CALL_KINDS = frozenset((_REQUEST, _BROADCAST, _SURVEY, _TUNNEL))
_REPLY_KINDS = frozenset((_REPLY, _TUNNEL))
_OPEN, _ACCEPT, _DATA = int(TunnelOp.OPEN), int(TunnelOp.ACCEPT), int(TunnelOp.DATA)
_TCREDIT, _FIN, _RESET = int(TunnelOp.CREDIT), int(TunnelOp.FIN), int(TunnelOp.RESET)
_MAX_WINDOW = 1 << 30
_pack_header = HEADER.pack
_pack_publish = PUBLISH_FIELDS.pack
_unpack_publish_entry = PUBLISH_ENTRY.unpack_from
_PUBLISH_ENTRY_SIZE = PUBLISH_ENTRY.size
_pack_entry = BATCH_ENTRY.pack
_pack_publish_entry = PUBLISH_ENTRY.pack
_PUBLISH_SIZE = PUBLISH_FIELDS.size
_MAX_PARTS = 2 * MAX_BATCH  # a staged publish is two parts: its entry's header and its body
_ENTRY_SIZE = BATCH_ENTRY.size
_MAX_CREDIT = 1 << 30
_BATCH_BYTES = 96 << 10
_MAX_TOPIC_SCOPES = 4096  # topic scopes whose ciphers a node keeps at once


def _release(request: PendingRequest) -> None:
    """The request is over: its links carry one request fewer."""
    if request.link is not None:
        request.link.outstanding -= 1
    if request.hedged is not None:
        request.hedged.outstanding -= 1


_pack_request = REQUEST_FIELDS.pack


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
        self.config = config or CoreConfig()
        self.stats: Counter[str] = Counter()
        self.events: list[Event] = []
        # Frames to send: (link_id, frame) on dialled links, (routing_id, frame) on the others.
        self.out_frames: list[tuple[int, bytes]] = []
        self.in_frames: list[tuple[bytes, bytes]] = []
        self._security = security
        self._rng = rng  # balancing, jitter and gossip: need not be unpredictable
        self._randbytes = randbytes  # handshake nonces: must be (os.urandom in a node)
        self._codec = BodyCodec(self.config.max_payload)
        self._max_frame = self.config.max_frame
        self._max_payload = self.config.max_payload
        # Off: every call and reply is sealed into out_frames/in_frames at once. On (the
        # driver): they are staged per link and sealed by seal_staged(), several to a frame.
        self.batching = False
        self._staged_out: list[OutLink] = []
        self._staged_in: list[InLink] = []
        self._published: list[OutLink] = []  # links with publishes in OutLink.pub_parts
        self._batch_limit = min(self._max_payload, _BATCH_BYTES)
        self._max_pending = self.config.max_pending
        self._out: dict[int, OutLink] = {}
        self._in: dict[bytes, InLink] = {}
        self._in_by_peer: dict[bytes, InLink] = {}
        self._peers: dict[bytes, OutLink] = {}  # node id -> its UP dialled link
        self._dials: dict[str, DialRecord] = {}
        self._members: dict[str, list[OutLink]] = {}  # cluster -> UP links serving it (cache)
        self._pending = PendingRequests()
        self._replies = ReplyCache(self.config.reply_cache_entries, self.config.reply_cache_bytes)
        self._next_link = 1
        self._next_req = 1
        self._hedge_tokens = self.config.hedge_burst
        self._hedge_refilled = 0.0
        self._last_tick: float | None = None
        self._next_gossip = 0.0
        self._closed = False
        self._dials[endpoint] = DialRecord(endpoint, seed=False, next_at=float("inf"))
        # Publish/subscribe: the peers' interest (pattern -> their dialled links), this node's
        # own (pattern -> local subscriptions), and the ciphers it publishes with.
        self._interest: TopicTrie[OutLink] = TopicTrie()
        self._subscribed: Counter[str] = Counter()
        # Topics checked: as heard -> (topic, scope, whether its key is our own), and as
        # published -> (UTF-8, scope).
        self._topics_heard: dict[bytes, tuple[str, str, bool]] = {}
        self._topics_out: dict[str, tuple[bytes, str]] = {}
        self.publish_blocked = False  # a publish found a peer without credit: tell when it has
        # Tunnels: handle -> this node's end; a served tunnel is also found by (link, wire id).
        self._tunnels: dict[int, TunnelEnd] = {}
        self._served_tunnels: dict[tuple[bytes, int], TunnelEnd] = {}
        self._next_tunnel = 1

    # ----------------------------------------------------------------- introspection

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def next_deadline(self) -> float | None:
        return self._pending.next_deadline()

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
            members = [link for link in self._peers.values() if self._slot(link, cluster)]
            self._members[cluster] = members
        return members

    @property
    def reply_cache(self) -> ReplyCache:
        return self._replies

    # ----------------------------------------------------------------- discovery input

    def add_candidate(self, endpoint: str, now: float, *, seed: bool = False) -> None:
        """An endpoint worth dialling (from seeds, discovery or a peer)."""
        if self._closed:
            return
        record = self._dials.get(endpoint)
        if record is None:
            if len(self._dials) >= 4096 and not seed:
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
        nonce = self._randbytes(NONCE_SIZE)
        link = OutLink(link_id, record.endpoint, nonce, opened=now, last_heard=now)
        link.keys = keys = self._security.begin()
        self._out[link_id] = link
        record.link_id = link_id
        self.events.append(OpenLink(link_id=link_id, endpoint=record.endpoint))
        body = self._codec.pack([self.node_id, nonce, self.endpoint, {"kx": keys.public}])
        self.out_frames.append((link_id, encode_header(Kind.HELLO, 0, 0) + body))
        self.stats["dials"] += 1

    # ----------------------------------------------------------------- requests (caller)

    def request(
        self, cluster: str, payload: bytes, timeout: float, now: float, hedge: float | None = None
    ) -> int:
        """Send a request to one member of `cluster`; returns its id for the events.

        With `hedge`, a copy goes to a second member if no reply came within `hedge` seconds,
        and the first reply wins (for idempotent requests: both may run).
        """
        if self._closed:
            raise Closed("node is closed")
        if len(payload) > self._max_payload:
            raise PayloadTooLarge(len(payload), self._max_payload)
        if len(self._pending.by_id) >= self._max_pending:
            raise Overloaded(len(self._pending.by_id), self._max_pending)
        members = self._members.get(cluster)
        if members is None:
            members = self.members(cluster)
        if not members:
            if not self._security.has_key(cluster):
                raise NoKey(cluster)
            raise NoResponders(cluster)
        link = balancer.choose(members, self._rng)
        if link.suspect:  # silent lately: another member if there is one that is not
            heard = [m for m in members if not m.suspect]
            if heard:
                link = balancer.choose(heard, self._rng)
        req_id = self._next_req
        self._next_req += 1
        request = PendingRequest(req_id, cluster, payload, now + timeout, timeout, now, link)
        self._pending.add(request)
        if hedge is not None and hedge < timeout and len(members) > 1:
            request.hedge_at = now + hedge
            self._pending.add_hedge(request)
            self._hedge_tokens = min(
                self.config.hedge_burst, self._hedge_tokens + self.config.hedge_ratio
            )
        self._send_request(link, req_id, cluster, payload, timeout)
        return req_id

    def fanout(
        self, kind: int, cluster: str, payload: bytes, timeout: float, now: float
    ) -> list[tuple[int, bytes]]:
        """Send a BROADCAST or SURVEY to every live member: [(req id, member id), ...]."""
        if self._closed:
            raise Closed("node is closed")
        if len(payload) > self._max_payload:
            raise PayloadTooLarge(len(payload), self._max_payload)
        members = self.members(cluster)
        if not members:
            if not self._security.has_key(cluster):
                raise NoKey(cluster)
            raise NoResponders(cluster)
        if len(self._pending.by_id) + len(members) > self._max_pending:
            raise Overloaded(len(self._pending.by_id), self._max_pending)
        sent = []
        for link in members:
            req_id = self._next_req
            self._next_req += 1
            request = PendingRequest(
                req_id, cluster, payload, now + timeout, timeout, now, link, kind=kind, pinned=True
            )
            self._pending.add(request)
            self._send_request(link, req_id, cluster, payload, timeout, kind)
            sent.append((req_id, link.peer_id))
        return sent

    def request_link(self, req_id: int) -> int:
        """The link a pending request was sent on (0: none now)."""
        request = self._pending.get(req_id)
        return request.link.link_id if request is not None and request.link is not None else 0

    def cancel(self, req_id: int) -> None:
        """Forget a request whose caller gave up; a late reply is then dropped and counted."""
        request = self._pending.pop(req_id)
        if request is not None:
            _release(request)

    def _send_request(
        self,
        link: OutLink,
        req_id: int,
        cluster: str,
        payload: bytes,
        timeout: float,
        kind: int = _REQUEST,
    ) -> None:
        # The hot path: encode_header and encode_request inlined (measured).
        link.outstanding += 1
        slot = link.clusters[cluster]
        timeout_ms = int(timeout * 1000) + 1
        if timeout_ms > 0xFFFFFFFF:
            timeout_ms = 0xFFFFFFFF
        acks = link.acks
        if acks:
            acks, link.acks = acks[:MAX_ACKS], acks[MAX_ACKS:]
            n = len(acks)
            body = _pack_request(req_id, timeout_ms, n) + ACKS[n].pack(*acks) + payload
        else:
            body = _pack_request(req_id, timeout_ms, 0) + payload
        if self.batching:  # _stage_out's staging, inlined: the hot path
            if not link.staged:
                self._staged_out.append(link)
            link.staged.append((slot, kind, body))
            return
        self._stage_out(link, slot, kind, body)

    def _resend(self, request: PendingRequest, now: float, failed: OutLink | None) -> None:
        remaining = request.deadline - now
        members = self.members(request.cluster)
        if remaining <= 0 or not members:
            request.link = None  # parked: a new member or the deadline decides
            return
        link = balancer.choose(members, self._rng, avoid=failed)
        request.link = link
        request.attempts += 1
        request.sent_at = now
        self.stats["requests_resent"] += 1
        self._send_request(
            link, request.req_id, request.cluster, request.payload, remaining, request.kind
        )

    def _hedge(self, request: PendingRequest, now: float) -> None:
        members = [m for m in self.members(request.cluster) if m is not request.link]
        if not members:
            return
        cfg = self.config
        self._hedge_tokens = min(
            cfg.hedge_burst, self._hedge_tokens + (now - self._hedge_refilled) * cfg.hedge_rate
        )
        self._hedge_refilled = now
        if self._hedge_tokens < 1.0:  # hedging must not double the load of a slow cluster
            self.stats["hedges_over_budget"] += 1
            return
        self._hedge_tokens -= 1.0
        link = balancer.choose(members, self._rng)
        request.hedged = link
        self.stats["requests_hedged"] += 1
        remaining = request.deadline - now
        self._send_request(link, request.req_id, request.cluster, request.payload, remaining)

    # ----------------------------------------------------------------- publish/subscribe

    def subscribe(self, pattern: str) -> None:
        """One more local subscription to a (validated) pattern; peers hear of a new one."""
        self._subscribed[pattern] += 1
        if self._subscribed[pattern] == 1:
            for inlink in self._in.values():
                self._send_in(inlink, _SUBSCRIBE, [0, [pattern.encode()]])

    def unsubscribe(self, pattern: str) -> None:
        """One local subscription fewer; peers hear when a pattern has none left."""
        count = self._subscribed.get(pattern, 0)
        if count > 1:
            self._subscribed[pattern] = count - 1
        elif count == 1:
            del self._subscribed[pattern]
            for inlink in self._in.values():
                self._send_in(inlink, _UNSUBSCRIBE, [[pattern.encode()]])

    def subscribers(self, topic: str) -> list[bytes]:
        """Node ids of the peers interested in a (validated) topic."""
        return [link.peer_id for link in self._interest.match(topic)]

    def blocked_subscribers(self, topic: str) -> list[bytes]:
        """Node ids of the peers interested in a topic that grant no credit now."""
        return [link.peer_id for link in self._interest.match(topic) if link.credit <= 0]

    def publish(self, topic: str, payload: bytes) -> int:
        """Send a message on a (validated) topic to every peer interested in it.

        Returns how many peers it went to, or -1 without sending anything when one of them has
        granted no credit (`publish_blocked` is set; a CreditArrived event says when to retry).
        The payload is sealed once, under the topic scope's key (the topic's first segment,
        else the default key); raises NoKey without one.
        """
        if self._closed:
            raise Closed("node is closed")
        if len(payload) > self._max_payload:
            raise PayloadTooLarge(len(payload), self._max_payload)
        known = self._topics_out.get(topic)
        if known is None:
            known = self._topic_out(topic)
        targets = self._interest.match_cached(topic)
        if not targets:
            return 0
        encoded, scope = known
        for link in targets:
            slot = link.topic_slots.get(scope)
            if slot is None:
                slot = self._topic_slot(link, scope)
            if slot and link.credit <= 0:
                self.publish_blocked = True
                self.stats["publish_blocked"] += 1
                return -1
        tail = encoded + payload
        size = len(encoded)
        length = _PUBLISH_SIZE + len(tail)
        batching = self.batching
        sent = 0
        for link in targets:
            slot = link.topic_slots[scope]
            if not slot:  # interested, but it holds no key we publish this scope under
                self.stats["publish_unreadable"] += 1
                continue
            link.credit -= 1
            seq = link.pub_seq = link.pub_seq + 1
            if batching:
                # Straight into the link's BATCH body for this slot: no entry list to walk
                # and encode at flush time (the publish hot path).
                parts = link.pub_parts
                if parts:
                    if (
                        slot != link.pub_slot
                        or link.pub_size + length > self._batch_limit
                        or len(parts) >= _MAX_PARTS
                    ):
                        self._seal_published(link)  # the link stays listed in _published
                        link.pub_slot = slot
                else:
                    self._published.append(link)
                    link.pub_slot = slot
                parts.append(_pack_publish_entry(_PUBLISH, length, seq, size))
                parts.append(tail)
                link.pub_size += _ENTRY_SIZE + length
            else:
                self._stage_out(link, slot, _PUBLISH, _pack_publish(seq, size) + tail)
            sent += 1
        return sent

    def _seal_published(self, link: OutLink) -> None:
        """Seal the publishes staged for `link` as one BATCH frame."""
        parts = link.pub_parts
        if not parts:
            return
        body = b"".join(parts)
        count = len(parts) >> 1
        parts.clear()
        link.pub_size = 0
        if link.state is not LinkState.UP:
            return
        if count > 1:
            self.stats["batches_sent"] += 1
        self.out_frames.append((link.link_id, self._frame(link, link.pub_slot, _BATCH, body)))

    def _topic_out(self, topic: str) -> tuple[bytes, str]:
        scope = topic.partition(".")[0]
        if not self._security.has_key(scope):
            raise NoKey(scope)
        if len(self._topics_out) >= _MAX_TOPIC_SCOPES:
            self._topics_out.clear()
        known = self._topics_out[topic] = (topic.encode(), scope)
        return known

    def _topic_slot(self, link: OutLink, scope: str) -> int:
        """The slot of `link` whose key seals topics of `scope` (0: the peer offers none)."""
        found = self._security.match_topic(scope, link.peer_nonce, link.nonce, link.offers)
        slot = 0
        if found is not None and link.keys is not None:
            slot, handle = found
            link.send_sealers[slot] = link.keys.sealer(handle, True)
        if len(link.topic_slots) >= _MAX_TOPIC_SCOPES:
            link.topic_slots.clear()
        link.topic_slots[scope] = slot
        return slot

    def release(self, routing_id: bytes, count: int = 1) -> bool:
        """The application is done with `count` messages from a peer: grant them back.

        Grants go out a quarter window at a time; returns True when one was queued.
        """
        link = self._in.get(routing_id)
        if link is None:
            return False
        link.to_grant += count
        if link.to_grant < self.config.pubsub_window // 4:
            return False
        grant, link.to_grant = link.to_grant, 0
        link.credit_out += grant
        self._send_in(link, _CREDIT, [grant])
        return True

    def _on_publish(self, link: InLink, body: bytes, slot_scope: str) -> None:
        """One PUBLISH frame: a batch of one."""
        self._on_publish_batch(link, _pack_entry(_PUBLISH, len(body)) + body, slot_scope)

    def _on_publish_batch(self, link: InLink, body: bytes, slot_scope: str) -> None:
        """The PUBLISH entries of a BATCH: one MessagesArrived event for all of them.

        The subscriber's hot path, so decode_batch's walk and each entry's checks are inlined.
        A bad message is counted and dropped (the credit it used is the sender's again); a
        broken envelope ends the walk, and the messages before it are still delivered.
        """
        messages: list[tuple[str, bytes]] = []
        gaps: dict[int, int] | None = None
        offset, size, count = 0, len(body), 0
        heard, unpack, stats = self._topics_heard, _unpack_publish_entry, self.stats
        try:
            while offset < size:
                if size - offset < _PUBLISH_ENTRY_SIZE or count >= MAX_BATCH:
                    raise ProtocolError("bad_envelope", "BATCH")
                kind, length, stream_seq, topic_size = unpack(body, offset)
                start = offset + _PUBLISH_ENTRY_SIZE
                topic_end = start + topic_size
                offset += _ENTRY_SIZE + length
                if kind != _PUBLISH or offset > size or topic_size == 0 or topic_end > offset:
                    raise ProtocolError("bad_envelope", "PUBLISH entry")
                count += 1
                if link.credit_out <= 0:
                    stats["dropped_over_credit"] += 1
                    continue
                link.credit_out -= 1
                gap = stream_seq - link.pub_seq - 1
                if gap:
                    if gap < 0:
                        stats["dropped_replay"] += 1
                        self.release(link.routing_id)
                        continue
                    stats["publish_gaps"] += gap
                    if gaps is None:
                        gaps = {}
                    at = len(messages)
                    gaps[at] = gaps.get(at, 0) + gap
                link.pub_seq = stream_seq
                encoded = body[start:topic_end]
                known = heard.get(encoded)
                if known is None:
                    try:
                        known = self._topic_heard(encoded)
                    except ProtocolError as exc:
                        stats["dropped_" + exc.reason] += 1
                        self.release(link.routing_id)
                        continue
                topic, scope, owned = known
                # The slot's key must be the one this node expects for the topic: its own key
                # for a scope it has one for (a holder of the default key cannot inject there).
                if scope != slot_scope and (slot_scope != "*" or owned):
                    stats["dropped_bad_scope"] += 1
                    self.release(link.routing_id)
                    continue
                messages.append((topic, body[topic_end:offset]))
        finally:
            if messages:
                self.events.append(MessagesArrived(link.routing_id, link.peer_id, messages, gaps))

    def _topic_heard(self, encoded: bytes) -> tuple[str, str, bool]:
        topic = parse_topic_from_peer(encoded)
        scope = topic.partition(".")[0]
        if len(self._topics_heard) >= _MAX_TOPIC_SCOPES:
            self._topics_heard.clear()
        known = self._topics_heard[encoded] = (topic, scope, self._security.owns(scope))
        return known

    def _on_interest(self, link: OutLink, patterns: list[bytes], add: bool) -> None:
        for raw in patterns:
            try:
                pattern = parse_pattern_from_peer(raw)
            except ProtocolError as exc:
                self.stats["dropped_" + exc.reason] += 1
                continue
            if add:
                if pattern in link.interest:
                    continue
                if len(link.interest) >= self.config.max_interest:
                    self.stats["dropped_interest_overflow"] += 1
                    continue
                link.interest.add(pattern)
                self._interest.add(pattern, link)
            elif pattern in link.interest:
                link.interest.discard(pattern)
                self._interest.remove(pattern, link)
        self.events.append(InterestChanged())
        self._unblock_publishers()

    def _unblock_publishers(self) -> None:
        if self.publish_blocked:
            self.publish_blocked = False
            self.events.append(CreditArrived())

    def _announce_interest(self, inlink: InLink) -> None:
        """A new link from a peer: grant it a window and tell it every pattern we want."""
        inlink.credit_out = self.config.pubsub_window
        patterns = [p.encode() for p in self._subscribed]
        chunks = [
            patterns[i : i + MAX_PATTERNS_PER_FRAME]
            for i in range(0, len(patterns), MAX_PATTERNS_PER_FRAME)
        ] or [[]]
        self._send_in(inlink, _SUBSCRIBE, [inlink.credit_out, chunks[0]])
        for chunk in chunks[1:]:
            self._send_in(inlink, _SUBSCRIBE, [0, chunk])

    def _stage_out(self, link: OutLink, slot: int, kind: int, body: bytes) -> None:
        if self.batching:
            if not link.staged:
                self._staged_out.append(link)
            link.staged.append((slot, kind, body))
            return
        self.out_frames.append((link.link_id, self._frame(link, slot, kind, body)))

    # ----------------------------------------------------------------- tunnels

    def open_tunnel(self, cluster: str, window: int) -> int:
        """Open a tunnel to one member of `cluster`, granting it `window` bytes; a handle.

        A TunnelFrame ACCEPT (or RESET) follows; until ACCEPT nothing may be sent.
        """
        if self._closed:
            raise Closed("node is closed")
        if not 0 < window <= _MAX_WINDOW:
            raise TunnelError(f"a tunnel window must be 1 byte to 1 GiB, not {window}")
        if len(self._tunnels) >= self.config.max_tunnels:
            raise TunnelError(f"{len(self._tunnels)} tunnels open, the limit is max_tunnels")
        members = self.members(cluster)
        if not members:
            if not self._security.has_key(cluster):
                raise NoKey(cluster)
            raise NoResponders(cluster)
        link = balancer.choose(members, self._rng)
        handle = self._next_tunnel
        self._next_tunnel += 1
        slot = link.clusters[cluster]
        end = TunnelEnd(handle, handle, cluster, link.peer_id, slot, out=link, recv_allowed=window)
        self._tunnels[handle] = end
        self._stage_out(link, slot, _TUNNEL, encode_tunnel(handle, _OPEN, window))
        self.stats["tunnels_opened"] += 1
        return handle

    def tunnel_accept(self, handle: int, window: int) -> None:
        """Accept a tunnel from TunnelArrived, granting the caller `window` bytes."""
        end = self._tunnel(handle)
        if end.accepted or end.inlink is None:
            raise TunnelError("this tunnel is already accepted")
        end.accepted = True
        self.tunnel_send(handle, _ACCEPT, window)

    def tunnel_send(self, handle: int, op: int, arg: int = 0, data: bytes = b"") -> None:
        """Send an op on a tunnel: DATA needs `send_credit` for `data`; RESET forgets it."""
        end = self._tunnel(handle)
        if op == _DATA:
            if len(data) > end.send_credit:
                raise TunnelError(f"{len(data)} bytes but a credit of {end.send_credit}")
            end.send_credit -= len(data)
        elif op in (_TCREDIT, _ACCEPT):
            if not 0 < arg <= _MAX_WINDOW - end.recv_allowed:
                raise TunnelError(f"a grant of {arg} bytes is out of range")
            end.recv_allowed += arg
        body = encode_tunnel(end.wire_id, op, arg, data)
        if end.out is not None:
            self._stage_out(end.out, end.slot, _TUNNEL, body)
        elif end.inlink is not None:
            self._stage_in(end.inlink, end.slot, _TUNNEL, body)
        if op == _RESET:
            self._forget_tunnel(end)

    def tunnel_forget(self, handle: int) -> None:
        """Both ends are done (FIN each way): forget the tunnel without a word."""
        end = self._tunnels.get(handle)
        if end is not None:
            self._forget_tunnel(end)

    def tunnel_peer(self, handle: int) -> bytes:
        """The node id of the tunnel's other end."""
        return self._tunnel(handle).peer_id

    def tunnel_credit(self, handle: int) -> int:
        """Bytes this end may send on the tunnel now."""
        return self._tunnel(handle).send_credit

    @property
    def tunnel_count(self) -> int:
        return len(self._tunnels)

    def _tunnel(self, handle: int) -> TunnelEnd:
        end = self._tunnels.get(handle)
        if end is None:
            raise TunnelError("the tunnel is closed")
        return end

    def _forget_tunnel(self, end: TunnelEnd) -> None:
        self._tunnels.pop(end.handle, None)
        if end.inlink is not None:
            self._served_tunnels.pop((end.inlink.routing_id, end.wire_id), None)

    def _break_tunnels(
        self,
        reason: str,
        *,
        out: OutLink | None = None,
        peer: bytes = b"",
        inlink: InLink | None = None,
    ) -> None:
        """The link under some tunnels died: they are reset, and their owners told."""
        for end in list(self._tunnels.values()):
            if (
                (out is not None and end.out is out)
                or (inlink is not None and end.inlink is inlink)
                or (peer and end.inlink is not None and end.peer_id == peer)
            ):
                self._forget_tunnel(end)
                self.stats["tunnels_broken"] += 1
                self.events.append(TunnelFrame(end.handle, _RESET, 0, reason.encode()))

    def _on_tunnel(self, end: TunnelEnd | None, op: int, arg: int, data: bytes) -> None:
        if end is None:  # reset or closed here already: frames in flight arrive late
            self.stats["tunnel_frames_late"] += 1
            return
        if op == _DATA:
            end.recv_allowed -= len(data)
            if end.recv_allowed < 0:  # the peer ignored our window: the tunnel cannot go on
                self.stats["dropped_tunnel_over_credit"] += 1
                self.tunnel_send(end.handle, _RESET, 0, b"window exceeded")
                self.events.append(TunnelFrame(end.handle, _RESET, 0, b"peer exceeded its window"))
                return
        elif op == _ACCEPT:
            if end.out is None or end.accepted:
                raise ProtocolError("bad_envelope", "TUNNEL ACCEPT")
            end.accepted = True
            end.send_credit = min(end.send_credit + arg, _MAX_WINDOW)
        elif op == _TCREDIT:
            end.send_credit = min(end.send_credit + arg, _MAX_WINDOW)
        elif op == _RESET:
            self._forget_tunnel(end)
        elif op == _OPEN:
            raise ProtocolError("bad_envelope", "TUNNEL OPEN on an open tunnel")
        self.events.append(TunnelFrame(end.handle, op, arg, data))

    def _on_tunnel_out(self, link: OutLink, slot: int, body: bytes) -> None:
        wire_id, op, arg, data = decode_tunnel(body)
        end = self._tunnels.get(wire_id)
        if end is not None and (end.out is not link or end.slot != slot):
            raise ProtocolError("bad_scope", "TUNNEL")
        self._on_tunnel(end, op, arg, data)

    def _on_tunnel_in(self, link: InLink, slot: int, body: bytes) -> None:
        if slot == 0 or slot >= len(link.scopes) or link.scopes[slot] is None:
            raise ProtocolError("bad_scope", str(slot))
        wire_id, op, arg, data = decode_tunnel(body)
        key = (link.routing_id, wire_id)
        end = self._served_tunnels.get(key)
        if op != _OPEN:
            if end is not None and end.slot != slot:
                raise ProtocolError("bad_scope", "TUNNEL")
            self._on_tunnel(end, op, arg, data)
            return
        if end is not None:
            raise ProtocolError("bad_envelope", "TUNNEL OPEN twice")
        handle = self._next_tunnel
        self._next_tunnel += 1
        cluster = link.scopes[slot]
        assert cluster is not None
        end = TunnelEnd(handle, wire_id, cluster, link.peer_id, slot, inlink=link)
        end.send_credit = min(arg, _MAX_WINDOW)
        self._tunnels[handle] = end
        self._served_tunnels[key] = end
        if self._closed or len(self._tunnels) > self.config.max_tunnels:
            self.stats["tunnels_refused"] += 1
            self.tunnel_send(handle, _RESET, 0, b"too many tunnels at the member")
            return
        self.stats["tunnels_served"] += 1
        self.events.append(TunnelArrived(handle, cluster, link.peer_id))

    def _stage_in(self, link: InLink, slot: int, kind: int, body: bytes) -> None:
        if self.batching:
            if not link.staged:
                self._staged_in.append(link)
            link.staged.append((slot, kind, body))
            return
        self.in_frames.append((link.routing_id, self._frame(link, slot, kind, body)))

    # ----------------------------------------------------------------- requests (member)

    def reply(self, token: Token, payload: bytes, *, error: bool = False) -> None:
        """Answer the request `token` (from RequestArrived); errors carry pack_error bytes."""
        status = STATUS_ERROR if error else STATUS_OK
        if not error and len(payload) > self.config.max_payload:
            status = STATUS_ERROR
            payload = pack_error(
                "PayloadTooLarge",
                f"reply of {len(payload)} bytes exceeds the limit of {self.config.max_payload}",
            )
        peer_id, req_id, routing_id, slot = token
        entry = self._replies.finish((peer_id, req_id), status, payload)
        if entry is not None:  # a resend may have come on another link since
            routing_id, slot = entry.routing_id, entry.slot
        link = self._in.get(routing_id)
        if link is None:  # the caller is gone; a resend gets the cached reply
            self.stats["replies_unroutable"] += 1
            return
        self._send_reply(link, slot, req_id, status, payload)

    def reply_error(self, token: Token, exc: BaseException) -> None:
        self.reply(token, pack_error(type(exc).__name__, str(exc)), error=True)

    def _send_reply(
        self, link: InLink, slot: int, req_id: int, status: int, payload: bytes
    ) -> None:
        # In the request's scope, under its keys.
        self._stage_in(link, slot, _REPLY, encode_reply(req_id, status, payload))

    def seal_staged(self) -> None:
        """Seal what `batching` staged: one frame per link and scope (BATCH if several)."""
        if self._published:
            published, self._published = self._published, []
            for link in published:
                self._seal_published(link)
        if self._staged_out:
            links, self._staged_out = self._staged_out, []
            for link in links:
                staged, link.staged = link.staged, []
                if link.state is LinkState.UP:
                    for frame in self._seal_batches(link, staged):
                        self.out_frames.append((link.link_id, frame))
        if self._staged_in:
            inlinks, self._staged_in = self._staged_in, []
            for inlink in inlinks:
                staged, inlink.staged = inlink.staged, []
                if self._in.get(inlink.routing_id) is inlink:
                    for frame in self._seal_batches(inlink, staged):
                        self.in_frames.append((inlink.routing_id, frame))

    def _seal_batches(
        self, link: OutLink | InLink, staged: list[tuple[int, int, bytes]]
    ) -> list[bytes]:
        by_slot: dict[int, list[tuple[int, bytes]]] = {}
        for slot, kind, body in staged:
            by_slot.setdefault(slot, []).append((kind, body))
        frames = []
        # A batch fits the peer's frame limit (like any one body) and stays below the sizes
        # malloc serves by mmap (one batch frame per 64 KiB tunnel chunk or so, not a MiB).
        limit = self._batch_limit
        for slot, entries in by_slot.items():
            start, count = 0, len(entries)
            while start < count:
                end, size = start + 1, len(entries[start][1])
                while end < count and end - start < MAX_BATCH:
                    size += len(entries[end][1]) + 5
                    if size > limit:
                        break
                    end += 1
                if end - start == 1:
                    kind, body = entries[start]
                else:
                    kind, body = _BATCH, encode_batch(entries[start:end])
                    self.stats["batches_sent"] += 1
                start = end
                frames.append(self._frame(link, slot, kind, body))
        return frames

    def _frame(self, link: OutLink | InLink, slot: int, kind: int, body: bytes) -> bytes:
        """The link's next frame: header (its next seq) and `body` sealed in `slot`."""
        link.send_seq += 1
        seq = link.send_seq
        header = _pack_header(MAGIC, VERSION, kind, 0, slot, seq)
        return header + link.send_sealers[slot].seal(header, seq, body)

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
                link.suspect = False
                self.stats["suspicions_refuted"] += 1
                self.events.append(PeerSuspect(node_id=link.peer_id, suspect=False))
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
                link.rtt = max(0.0, now - env[0] / 1e6)
                link.peer_load = env[1]
            elif kind == _PROBE_ACK:
                self._on_probe_ack(env, now)
            elif kind == _CREDIT:
                link.credit = min(link.credit + env[0], _MAX_CREDIT)
                self._unblock_publishers()
            elif kind == _SUBSCRIBE:
                link.credit = min(link.credit + env[0], _MAX_CREDIT)
                self._on_interest(link, env[1], add=True)
            elif kind == _UNSUBSCRIBE:
                self._on_interest(link, env[0], add=False)
            elif kind == Kind.PEERS:
                self._on_peers(env, now)
            elif kind == Kind.BYE:
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
                self._on_publish(link, body, slot_scope)
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
                self._forget_replies(link, env[1])
                # The load a member reports: replies it still holds for its callers.
                self._send_in(link, _PONG, [env[0], len(self._replies)])
            elif kind == _PROBE:
                self._on_probe(link, env, now)
            elif kind == Kind.PEERS:
                self._on_peers(env, now)
            elif kind == Kind.BYE:
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

    def _on_hello(self, routing_id: bytes, env: list[Any], now: float) -> None:
        peer_id, peer_nonce, peer_endpoint = env[0], env[1], env[2]
        if len(self._in) >= 4096:
            raise ProtocolError("too_many_links")
        if self._closed:
            self.in_frames.append(
                (routing_id, encode_header(Kind.REFUSE, 0, 0) + self._codec.pack(["closing"]))
            )
            return
        peer_public = env[3].get("kx")
        if type(peer_public) is not bytes:
            raise ProtocolError("bad_handshake", "no key agreement")
        nonce = self._randbytes(NONCE_SIZE)
        keys = self._security.begin()
        keys.establish(peer_public, nonce, peer_nonce)
        scopes: list[str | None] = [None]
        handles: list[object | None] = [None]
        tags: list[bytes] = []
        for cluster in self.clusters:
            for tag, handle in self._security.offers(cluster, nonce, peer_nonce):
                scopes.append(cluster)
                handles.append(handle)
                tags.append(tag)
        topic_slots: dict[int, str] = {}
        for tag, handle, topic_scope in self._security.topic_offers(nonce, peer_nonce):
            if len(tags) >= MAX_OFFERS:  # a huge keyring: the remaining topic scopes go unread
                self.stats["topic_offers_dropped"] += 1
                break
            topic_slots[len(scopes)] = topic_scope
            scopes.append(None)  # no cluster: requests in this slot are refused
            handles.append(handle)
            tags.append(tag)
        # An older link of the same peer is kept: the peer may still use it (it reached us under
        # two names and kept the first) or it is dead and falls silent; replies follow requests.
        link = InLink(routing_id, peer_id, peer_endpoint, nonce, peer_nonce, now, scopes)
        link.topic_slots = topic_slots
        for slot, handle in enumerate(handles):
            link.send_sealers[slot] = keys.sealer(handle, False)
            link.recv_sealers[slot] = keys.sealer(handle, True)
        self._in[routing_id] = link
        self._in_by_peer[peer_id] = link
        body = self._codec.pack([self.node_id, nonce, self.endpoint, tags, {"kx": keys.public}])
        self.in_frames.append((routing_id, encode_header(Kind.WELCOME, 0, 0) + body))
        self._send_in(link, Kind.PEERS, self._peer_list())
        self._announce_interest(link)
        self.add_candidate(peer_endpoint, now)  # dial back: requests flow on dialled links

    def _on_welcome(self, link: OutLink, env: list[Any], now: float) -> None:
        peer_id, peer_nonce, tags = env[0], env[1], env[3]
        if peer_id == self.node_id:
            self._close_out(link, now, "self")
            return
        if peer_id in self._peers:  # another endpoint of a peer already linked
            self._close_out(link, now, "duplicate")
            return
        peer_public = env[4].get("kx")
        keys = link.keys
        if type(peer_public) is not bytes or keys is None:
            raise ProtocolError("bad_handshake", "no key agreement")
        keys.establish(peer_public, peer_nonce, link.nonce)
        link.peer_id = peer_id
        link.peer_nonce = peer_nonce
        link.offers = {tag: slot for slot, tag in enumerate(tags, start=1)}
        link.send_sealers[0] = keys.sealer(None, True)
        link.recv_sealers[0] = keys.sealer(None, False)
        link.state = LinkState.UP
        link.last_heard = now
        link.last_ping = now
        self._peers[peer_id] = link
        record = self._dials.get(link.endpoint)
        if record is not None:
            record.failures = 0
        self._members.clear()
        self.stats["peers_up"] += 1
        self.events.append(PeerUp(node_id=peer_id, endpoint=link.endpoint))
        self._send_out(link, Kind.PEERS, self._peer_list())
        self._unpark(now)

    def _on_reply(self, link: OutLink, body: bytes, now: float) -> None:
        req_id, status, payload = decode_reply(body)
        link.acks.append(req_id)  # received: the member may forget it
        request = self._pending.get(req_id)
        if request is None or (request.link is not link and request.hedged is not link):
            self.stats["replies_late"] += 1  # timed out, cancelled, or answered elsewhere
            return
        self._pending.pop(req_id)
        _release(request)
        balancer.observe(
            link, now - (request.sent_at if request.link is link else request.hedge_at)
        )
        link.last_sample = now
        self.events.append(ReplyArrived(req_id, status, payload, link.peer_id))

    def _on_request(self, link: InLink, slot: int, body: bytes, now: float, kind: int) -> None:
        if slot == 0 or slot >= len(link.scopes) or link.scopes[slot] is None:
            raise ProtocolError("bad_scope", str(slot))
        req_id, timeout_ms, acks, payload = decode_request(body)
        if acks:
            self._forget_replies(link, acks)
        if len(payload) > self.config.max_payload:
            raise ProtocolError("oversize", f"payload of {len(payload)} bytes")
        key = (link.peer_id, req_id)
        cached = self._replies.get(key)
        if cached is not None:
            self.stats["requests_duplicate"] += 1
            cached.routing_id = link.routing_id  # the resend's link is the one to answer on
            cached.slot = slot
            if cached.status >= 0:
                self._send_reply(link, slot, req_id, cached.status, cached.payload)
            return
        self._replies.start(key, now + timeout_ms / 1000 + 1.0, link.routing_id, slot)
        cluster = link.scopes[slot]
        assert cluster is not None
        self.events.append(
            RequestArrived((link.peer_id, req_id, link.routing_id, slot), cluster, payload, kind)
        )

    def _forget_replies(self, link: InLink, acks: Iterable[int]) -> None:
        # Only replies answered on this very link: its node id is merely claimed, and a PING
        # needs no cluster key, but a reply bound to this link came from a request that did.
        discard = self._replies.discard
        peer_id, routing_id = link.peer_id, link.routing_id
        for req_id in acks:
            discard((peer_id, req_id), routing_id)

    def _on_peers(self, env: list[Any], now: float) -> None:
        for entry in env:
            peer_id, endpoint = entry
            if peer_id != self.node_id and peer_id not in self._peers:
                self.add_candidate(endpoint, now)

    # ----------------------------------------------------------------- time

    def tick(self, now: float) -> None:
        """Heartbeats, failure detection, redials, gossip and request deadlines."""
        cfg = self.config
        if self._last_tick is not None:
            stall = now - self._last_tick - cfg.heartbeat_interval
            if stall > cfg.heartbeat_interval:
                # Our own loop was late: what we did not hear meanwhile is not the peers' fault.
                self.stats["loop_stalls"] += 1
                for link in self._out.values():
                    link.last_heard += stall
                for inlink in self._in.values():
                    inlink.last_heard += stall
        self._last_tick = now
        for link in list(self._out.values()):
            if link.state is LinkState.UP:
                silence = now - link.last_heard
                if silence > cfg.suspect_after and self._suspect(link, silence, now):
                    continue  # declared dead
                if now - link.last_ping >= cfg.heartbeat_interval - 1e-6:  # float ticks
                    link.last_ping = now
                    acks, link.acks = link.acks[:200], link.acks[200:]
                    self._send_out(link, _PING, [int(now * 1e6), acks])
                    if link.outstanding == 0 and now - link.last_sample > 1.0:
                        link.latency *= 0.5  # let an idle member that was slow be probed again
                        link.last_sample = now
            elif now - link.opened > cfg.handshake_timeout:
                self._close_out(link, now, "handshake_timeout")
        for inlink in list(self._in.values()):
            if now - inlink.last_heard > 3 * cfg.dead_after:
                self._forget_in(inlink)
        for record in list(self._dials.values()):
            # Seeds are redialled forever; other endpoints until forget_after_failures.
            if not record.link_id and now >= record.next_at and record.endpoint != self.endpoint:
                self._dial(record, now)
        if now >= self._next_gossip and self._peers:
            self._next_gossip = now + cfg.gossip_interval * (0.5 + self._rng.random())
            target = self._rng.choice(list(self._peers.values()))
            self._send_out(target, Kind.PEERS, self._peer_list())
        for request in self._pending.pop_hedges(now):
            self._hedge(request, now)
        for request in self._pending.pop_expired(now):
            _release(request)
            self.stats["requests_timed_out"] += 1
            error = RequestTimeout(request.cluster, request.timeout, request.attempts)
            self.events.append(RequestFailed(req_id=request.req_id, error=error))
        self._replies.expire(now)

    def _suspect(self, link: OutLink, silence: float, now: float) -> bool:
        """A silent peer: ask others whether they hear it; True if it is now declared dead.

        SWIM's indirect probe, over the links the peers already watch: each asked peer says how
        long ago it last heard the suspect. A word that it was heard lately keeps the suspect
        alive past dead_after (our own link may be lossy, as TCP retransmits), for at most
        max_vouched_silence; then the link is closed and redialled. With no such word, the
        suspect is dead at dead_after.
        """
        cfg = self.config
        if not link.suspect:
            link.suspect = True
            self.stats["peers_suspected"] += 1
            self.events.append(PeerSuspect(node_id=link.peer_id, suspect=True))
            self._probe(link, now)
        elif now - link.probed_at >= cfg.heartbeat_interval - 1e-6:
            self._probe(link, now)
        if silence <= cfg.dead_after:
            return False
        vouched = now - link.vouched_at <= cfg.dead_after - cfg.suspect_after
        if vouched and silence <= cfg.max_vouched_silence:
            if link.outstanding:
                self._migrate(link, now)
            return False
        self._close_out(link, now, "unreachable" if vouched else "silent")
        return True

    def _migrate(self, link: OutLink, now: float) -> None:
        """Requests waiting on a link that others vouch for but we cannot hear (TCP in
        retransmission backoff, say) go to other members: alive is not the same as useful."""
        for request in self._pending:
            if request.link is not link or request.pinned:
                continue
            if request.hedged is not None:  # the hedge's copy carries on alone
                request.link, request.hedged = request.hedged, None
                link.outstanding -= 1
                continue
            others = [m for m in self.members(request.cluster) if m is not link and not m.suspect]
            remaining = request.deadline - now
            if not others or remaining <= 0:
                continue  # it stays: this member may yet answer
            link.outstanding -= 1
            target = balancer.choose(others, self._rng)
            request.link = target
            request.attempts += 1
            request.sent_at = now
            self.stats["requests_migrated"] += 1
            self._send_request(
                target, request.req_id, request.cluster, request.payload, remaining, request.kind
            )

    def _probe(self, link: OutLink, now: float) -> None:
        helpers = [p for p in self._peers.values() if p is not link and not p.suspect]
        link.probed_at = now
        if not helpers:
            return
        link.probe_token += 1
        count = min(self.config.indirect_probes, len(helpers))
        for helper in self._rng.sample(helpers, count):
            self._send_out(helper, _PROBE, [link.peer_id, link.probe_token])
        self.stats["probes_sent"] += count

    def _on_probe(self, link: InLink, env: list[Any], now: float) -> None:
        target, token = env
        heard = -1.0
        out = self._peers.get(target)
        if out is not None and not out.suspect:
            heard = now - out.last_heard
        inlink = self._in_by_peer.get(target)
        if inlink is not None and (heard < 0 or now - inlink.last_heard < heard):
            heard = now - inlink.last_heard
        self._send_in(link, _PROBE_ACK, [target, token, int(heard * 1000) if heard >= 0 else -1])

    def _on_probe_ack(self, env: list[Any], now: float) -> None:
        target, token, heard_ms = env
        link = self._peers.get(target)
        if (
            link is not None
            and link.suspect
            and link.probe_token - 3 < token <= link.probe_token
            # Fresh word only: heard within a heartbeat and a half (a healthy peer hears the
            # suspect every heartbeat), and after we last did ourselves.
            and 0 <= heard_ms <= 1500 * self.config.heartbeat_interval
            and now - heard_ms / 1000 > link.last_heard
        ):
            link.vouched_at = now
            self.stats["probes_vouched"] += 1

    def link_failed(self, link_id: int, now: float, reason: str = "transport") -> None:
        """The driver saw the transport fail (disconnect, unroutable, refused)."""
        link = self._out.get(link_id)
        if link is not None and link.state is not LinkState.CLOSED:
            self._close_out(link, now, reason)

    def close(self) -> None:
        """Say goodbye on every link and fail what is pending; the driver then flushes."""
        if self._closed:
            return
        self._closed = True
        # What is staged (publishes, replies, tunnel data) goes before the goodbyes: a peer
        # drops a link's later frames once it has heard BYE.
        self.seal_staged()
        for link in list(self._out.values()):
            if link.state is LinkState.UP:
                self._send_out(link, Kind.BYE, ["closing"])
        for end in list(self._tunnels.values()):
            self.tunnel_send(end.handle, _RESET, 0, b"the other end closed its node")
            self.events.append(TunnelFrame(end.handle, _RESET, 0, b"node closed"))
        for inlink in list(self._in.values()):
            self._send_in(inlink, Kind.BYE, ["closing"])
        for request in self._pending:
            self._pending.pop(request.req_id)
            self.events.append(RequestFailed(req_id=request.req_id, error=Closed("node closed")))

    # ----------------------------------------------------------------- internals

    def _slot(self, link: OutLink, cluster: str) -> int:
        slot = link.clusters.get(cluster)
        if slot is None:
            if not self._security.has_key(cluster):
                raise NoKey(cluster)
            found = self._security.match(cluster, link.peer_nonce, link.nonce, link.offers)
            slot = 0
            if found is not None and link.keys is not None:
                slot, handle = found
                link.send_sealers[slot] = link.keys.sealer(handle, True)
                link.recv_sealers[slot] = link.keys.sealer(handle, False)  # its replies
            link.clusters[cluster] = slot
        return slot

    def _close_out(self, link: OutLink, now: float, reason: str) -> None:
        was_up = link.state is LinkState.UP
        link.state = LinkState.CLOSED
        del self._out[link.link_id]
        self.events.append(CloseLink(link_id=link.link_id))
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
                if not record.seed and record.failures >= self.config.forget_after_failures:
                    del self._dials[link.endpoint]
            elif not record.seed:
                del self._dials[link.endpoint]
        if link.interest:
            for pattern in link.interest:
                self._interest.remove(pattern, link)
            link.interest.clear()
            self.events.append(InterestChanged())
            self._unblock_publishers()
        if not was_up:
            self.stats["dials_failed"] += 1
            return
        self.stats["peers_down_" + reason] += 1
        if self._tunnels:
            gone = f"member {link.peer_id.hex()[:12]} is gone ({reason})"
            self._break_tunnels(gone, out=link)
            self._break_tunnels(
                f"caller {link.peer_id.hex()[:12]} is gone ({reason})", peer=link.peer_id
            )
        if self._peers.get(link.peer_id) is link:
            del self._peers[link.peer_id]
        self._members.clear()
        self.events.append(PeerDown(node_id=link.peer_id, endpoint=link.endpoint, reason=reason))
        link.outstanding = 0
        for request in self._pending:
            if request.hedged is link:
                request.hedged = None
            if request.link is not link:
                continue
            if request.hedged is not None:  # the hedge's copy carries on alone
                request.link, request.hedged = request.hedged, None
            elif request.pinned:  # meant for this member alone
                self._pending.pop(request.req_id)
                error = MemberLost(request.cluster, link.peer_id.hex())
                self.events.append(RequestFailed(req_id=request.req_id, error=error))
            else:
                self._resend(request, now, link)

    def _unpark(self, now: float) -> None:
        for request in self._pending:
            if request.link is None:
                self._resend(request, now, None)

    def _forget_in(self, link: InLink) -> None:
        if self._tunnels:
            self._break_tunnels(f"caller {link.peer_id.hex()[:12]} left", inlink=link)
        self._in.pop(link.routing_id, None)
        if self._in_by_peer.get(link.peer_id) is link:
            del self._in_by_peer[link.peer_id]

    def _peer_list(self) -> list[list[Any]]:
        peers = [[p.peer_id, p.endpoint] for p in self._peers.values()]
        if len(peers) > MAX_PEERS_PER_FRAME:
            peers = self._rng.sample(peers, MAX_PEERS_PER_FRAME)
        return peers

    def _send_out(self, link: OutLink, kind: int, env: list[Any]) -> None:
        self.out_frames.append((link.link_id, self._frame(link, 0, kind, self._codec.pack(env))))

    def _send_in(self, link: InLink, kind: int, env: list[Any]) -> None:
        self.in_frames.append((link.routing_id, self._frame(link, 0, kind, self._codec.pack(env))))
