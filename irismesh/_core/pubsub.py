"""Publish/subscribe in the core: interest, publishing, credit, topic scopes.

Theory of operation
-------------------
Interest flows against the messages, in two steps. Coarsely, through membership: a node's
record carries a tag for each topic scope it subscribes in (the first segment of its patterns;
"every scope" for a pattern that starts with a wildcard), readable only under the key the scope
is sealed with, so a publisher learns who may want its scope, and no one else learns anything.
A publisher links to each of them (`readers`, dialled on demand). Exactly, over the link: a
node tells every peer that dialled it (its inbound links) which patterns it subscribes to
(SUBSCRIBE / UNSUBSCRIBE), the first of them with a window of credit (`inbound_up`); the peer
keeps each pattern against its dialled link to the node (`on_interest`, into a `TopicTrie`) and
forgets them when that link goes down. So a publisher sends on its dialled links, to the peers
whose interest matches the topic. Publishing to a scope waits (as for credit, below) until
every reader membership knows of is linked and has said what it wants: none is skipped for
being new. The cost: one link per (publisher, reader of its scopes) pair, and per node a tag
per scope it reads in its record (past 64 scopes, one "every scope" tag per key).

Flow control is per link, in messages: each PUBLISH uses one credit; the subscriber grants
them back as the application releases messages, a quarter window at a time (`release`, CREDIT).
A publish that finds an interested peer without credit sends nothing and returns -1
(`publish_blocked`); a CreditArrived event says when to try again. A message that arrives over
its credit, out of order or on the wrong key is dropped and counted, never delivered.

With grants required, a subscriber also checks that its publisher may publish: each inbound
link keeps the topics heard on it with their verdicts (`InLink.topics_heard`), decided from the
publisher's verified grant the first time the link carries the topic; a message on a topic the
grant does not allow is dropped and counted (`dropped_publish_forbidden`). A subscriber thus
evaluates a grant once per (link, topic), and the per-message path is the same dictionary
lookup as without grants (where the node-wide table of topics heard serves every link).

Topic scopes. A message is sealed once, under the key of its topic's first segment (else the
default key "*"), in the link slot whose offer matched that key (`Handshake.topic_slot`). The
receiver accepts a topic only in the slot of the key it expects for it: its own key for a
scope it has one for, so a holder of the default key cannot inject there.

Hot paths: `publish` routes a topic from a per-topic cache of (link, slot) pairs and writes
straight into each link's frame body (`OutLink.pub_parts`, sealed by the outbox): a
PUBLISH_RUN, whose entries carry no stream seq of their own, so one encoded entry is shared by
every subscriber (each link's run head holds its first seq); or, for a peer that reads no runs,
a BATCH with an entry header per link. `on_publish_batch` walks either with the entry checks
inlined, making one MessagesArrived event per frame. Each link still seals its own frames:
see SECURITY.md on why a seal shared by the subscribers would not pay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from irismesh._core.config import CoreConfig
from irismesh._core.events import CreditArrived, InterestChanged, MessagesArrived
from irismesh._core.frames import (
    BATCH_ENTRY,
    MAX_BATCH,
    MAX_PATTERNS_PER_FRAME,
    MAX_STAMP,
    MAX_TRACE,
    MESSAGE_ID_SIZE,
    PUBLISH_ENTRY,
    PUBLISH_FIELDS,
    PUBLISH_STAMP,
    RUN_ENTRY,
    RUN_HEAD,
    TRACE_FIELDS,
    Kind,
)
from irismesh._core.handshake import Handshake
from irismesh._core.links import InLink, LinkObserver, OutLink
from irismesh._core.outbox import Outbox
from irismesh._core.records import MemberRecord
from irismesh._core.rights import ALL_RIGHTS, Rights
from irismesh._core.sealing import LinkSecurity
from irismesh._core.topics import TopicTrie, parse_pattern_from_peer, parse_topic_from_peer
from irismesh.errors import (
    Closed,
    ConfigurationError,
    Forbidden,
    NoKey,
    PayloadTooLarge,
    ProtocolError,
)

_SUBSCRIBE, _UNSUBSCRIBE = int(Kind.SUBSCRIBE), int(Kind.UNSUBSCRIBE)
_CREDIT, _PUBLISH = int(Kind.CREDIT), int(Kind.PUBLISH)
_PUBLISH_STAMPED = int(Kind.PUBLISH_STAMPED)
_PUBLISH_RETAINED = int(Kind.PUBLISH_RETAINED)
_MAX_CREDIT = 1 << 30
_MAX_TOPIC_SCOPES = 4096  # topics whose checks a node remembers at once
# The scope a link's topic verdict holds when the publisher's grant does not allow the topic:
# no topic has it, so such a message fails the scope check, where it is counted apart.
_FORBIDDEN = ""
_MAX_PARTS = 2 * MAX_BATCH  # a staged publish is two parts: its entry's header and its body
_pack_publish = PUBLISH_FIELDS.pack
_PUBLISH_SIZE = PUBLISH_FIELDS.size
_pack_entry = BATCH_ENTRY.pack
_ENTRY_SIZE = BATCH_ENTRY.size
_pack_publish_entry = PUBLISH_ENTRY.pack
_unpack_publish_entry = PUBLISH_ENTRY.unpack_from
_PUBLISH_ENTRY_SIZE = PUBLISH_ENTRY.size
_pack_stamp = PUBLISH_STAMP.pack
_unpack_stamp = PUBLISH_STAMP.unpack_from
_STAMP_SIZE = PUBLISH_STAMP.size
_pack_run_head = RUN_HEAD.pack
_unpack_run_head = RUN_HEAD.unpack_from
_RUN_HEAD_SIZE = RUN_HEAD.size
_pack_run_entry = RUN_ENTRY.pack
_RUN_ENTRY_SIZE = RUN_ENTRY.size
_PUBLISH_RUN = int(Kind.PUBLISH_RUN)
_PUBLISH_TRACED = int(Kind.PUBLISH_TRACED)
_pack_trace = TRACE_FIELDS.pack
_TRACE_SIZE = TRACE_FIELDS.size


class PubSubCore(LinkObserver):
    """This node's subscriptions, its peers' interest, and the messages between them."""

    def __init__(
        self,
        *,
        config: CoreConfig,
        security: LinkSecurity,
        stats: Counter[str],
        outbox: Outbox,
        handshake: Handshake,
        inbound: dict[bytes, InLink],
        peers: dict[bytes, OutLink],
        readers: Callable[[str], dict[bytes, MemberRecord]],
        interest_changed: Callable[[], None],
    ) -> None:
        self.config = config
        self.closed = False
        self.blocked = False  # a publish found a peer without credit: tell when it has
        self._security = security
        self._stats = stats
        self._outbox = outbox
        self._topic_slot = handshake.topic_slot
        self._inbound = inbound  # the engine's table of links peers dialled
        self._peers = peers  # and of its UP dialled links, by node id
        self._readers = readers  # who reads a scope (membership), each linked or dialled
        self._interest_changed = interest_changed  # our own scopes changed: a new record
        self._ready: set[str] = set()  # scopes whose every reader is linked and subscribed
        self._max_payload = config.max_payload
        # The peers' interest (pattern -> their dialled links) and this node's own.
        self._interest: TopicTrie[OutLink] = TopicTrie()
        self._subscribed: Counter[str] = Counter()
        # Topics checked: as heard -> (topic, scope, whether its key is our own), and as
        # published -> (UTF-8, scope).
        self._topics_heard: dict[bytes, tuple[str, str, bool]] = {}
        self._topics_out: dict[str, tuple[bytes, str]] = {}
        # Per topic published: the links that want it, each with the slot it takes the topic's
        # scope in, and how many others want it but cannot read it (`_route`); forgotten
        # whenever interest or links change.
        self._routes: dict[str, tuple[list[tuple[OutLink, int]], int]] = {}
        # This node's own rights (`rights`): checked once per topic published (the verdict
        # kept in `_topics_out`) and per subscription made. The engine sets them.
        self.rights: Rights = ALL_RIGHTS

    def rights_changed(self, rights: Rights) -> None:
        """This node's grant changed: topics are checked again as they are next published."""
        self.rights = rights
        self._topics_out.clear()

    # ----------------------------------------------------------------- own subscriptions

    @property
    def subscribed(self) -> list[str]:
        """The patterns this node subscribes to."""
        return list(self._subscribed)

    def subscribe(self, pattern: str) -> None:
        """One more local subscription to a (validated) pattern; peers hear of a new one.
        Forbidden if this node's grant does not let it subscribe to the pattern."""
        if pattern not in self._subscribed and not self.rights.may_subscribe(pattern):
            self._stats["subscriptions_forbidden"] += 1
            raise Forbidden(pattern, "subscribe", "this node's grant does not allow it")
        self._subscribed[pattern] += 1
        if self._subscribed[pattern] == 1:
            for inlink in self._inbound.values():
                self._outbox.send_in(inlink, _SUBSCRIBE, [0, [pattern.encode()]])
            self._interest_changed()

    def unsubscribe(self, pattern: str) -> None:
        """One local subscription fewer; peers hear when a pattern has none left."""
        count = self._subscribed.get(pattern, 0)
        if count > 1:
            self._subscribed[pattern] = count - 1
        elif count == 1:
            del self._subscribed[pattern]
            for inlink in self._inbound.values():
                self._outbox.send_in(inlink, _UNSUBSCRIBE, [[pattern.encode()]])
            self._interest_changed()

    def inbound_up(self, link: InLink, now: float) -> None:
        """A new link from a peer: grant it a window and tell it every pattern we want."""
        link.credit_out = self.config.pubsub_window
        patterns = [p.encode() for p in self._subscribed]
        chunks = [
            patterns[i : i + MAX_PATTERNS_PER_FRAME]
            for i in range(0, len(patterns), MAX_PATTERNS_PER_FRAME)
        ] or [[]]
        self._outbox.send_in(link, _SUBSCRIBE, [link.credit_out, chunks[0]])
        for chunk in chunks[1:]:
            self._outbox.send_in(link, _SUBSCRIBE, [0, chunk])

    def release(self, routing_id: bytes, count: int = 1) -> bool:
        """The application is done with `count` messages from a peer: grant them back.

        Grants go out a quarter window at a time; returns True when one was queued.
        """
        link = self._inbound.get(routing_id)
        if link is None:
            return False
        link.to_grant += count
        if link.to_grant < self.config.pubsub_window // 4:
            return False
        grant, link.to_grant = link.to_grant, 0
        link.credit_out += grant
        self._outbox.send_in(link, _CREDIT, [grant])
        return True

    # ----------------------------------------------------------------- the peers' interest

    def subscribers(self, topic: str) -> list[bytes]:
        """Node ids of the peers interested in a (validated) topic (linking to the readers of
        its scope that are not linked yet, so that they are counted once they are)."""
        self._readers(topic.partition(".")[0])
        return [link.peer_id for link in self._interest.match(topic)]

    def blocked_subscribers(self, topic: str) -> list[bytes]:
        """Node ids of the peers interested in a topic that grant no credit now."""
        return [link.peer_id for link in self._interest.match(topic) if link.credit <= 0]

    def on_interest(self, link: OutLink, patterns: list[bytes], add: bool, grant: int = 0) -> None:
        """SUBSCRIBE (`add`, with a `grant` of credit) or UNSUBSCRIBE from the peer at the
        other end of `link`."""
        link.credit = min(link.credit + grant, _MAX_CREDIT)
        self._routes.clear()
        if add and not link.subscribed:
            link.subscribed = True
            self._ready.clear()
        for raw in patterns:
            try:
                pattern = parse_pattern_from_peer(raw)
            except ProtocolError as exc:
                self._stats["dropped_" + exc.reason] += 1
                continue
            if add:
                if pattern in link.interest:
                    continue
                if not link.grant.rights.may_subscribe(pattern):
                    # The subscriber's grant does not allow it: nothing is ever sent to it.
                    self._stats["refused_forbidden"] += 1
                    continue
                if len(link.interest) >= self.config.max_interest:
                    self._stats["dropped_interest_overflow"] += 1
                    continue
                link.interest.add(pattern)
                self._interest.add(pattern, link)
            elif pattern in link.interest:
                link.interest.discard(pattern)
                self._interest.remove(pattern, link)
        self._outbox.events.append(InterestChanged())
        self._unblock_publishers()

    def on_credit(self, link: OutLink, grant: int) -> None:
        """CREDIT from a subscriber: `grant` more messages may go to it."""
        link.credit = min(link.credit + grant, _MAX_CREDIT)
        self._unblock_publishers()

    def readers_changed(self) -> None:
        """Membership changed: who reads which scope may have; a waiting publish tries again."""
        self._ready.clear()
        self._unblock_publishers()

    def link_down(self, link: OutLink, reason: str, now: float) -> None:
        """A peer's link is gone, and with it the interest it carried."""
        self._ready.clear()
        self._routes.clear()
        if link.interest:
            for pattern in link.interest:
                self._interest.remove(pattern, link)
            link.interest.clear()
            self._outbox.events.append(InterestChanged())
            self._unblock_publishers()

    def _unblock_publishers(self) -> None:
        if self.blocked:
            self.blocked = False
            self._outbox.events.append(CreditArrived())

    # ----------------------------------------------------------------- publishing

    def publish(
        self,
        topic: str,
        payload: bytes,
        stamp: float = 0.0,
        msg_id: bytes = b"",
        trace: bytes = b"",
    ) -> int:
        """Send a message on a (validated) topic to every peer interested in it.

        Returns how many peers it went to, or -1 without sending anything when one of them has
        granted no credit (`blocked` is set; a CreditArrived event says when to retry).
        The payload is sealed once, under the topic scope's key (the topic's first segment,
        else the default key); raises NoKey without one. A `stamp` (the publisher's wall
        clock, seconds since the epoch) travels with the message (PUBLISH_STAMPED), so that
        subscribers can measure publish-to-deliver latency; a `msg_id` (a message the mesh's
        memory holds, MESSAGE_ID_SIZE bytes) travels instead (PUBLISH_RETAINED). A `trace`
        context goes with it (PUBLISH_TRACED) when every peer it goes to reads one.
        """
        if self.closed:
            raise Closed("node is closed")
        if len(payload) > self._max_payload:
            raise PayloadTooLarge(len(payload), self._max_payload)
        known = self._topics_out.get(topic)
        if known is None:
            known = self._topic_out(topic)
        encoded, scope = known
        if scope not in self._ready and not self._settled(scope):
            self.blocked = True
            self._stats["publish_awaiting_readers"] += 1
            return -1
        route = self._routes.get(topic)
        if route is None:
            route = self._route(topic, scope)
        links, unreadable = route
        for link, _slot in links:
            if link.credit <= 0:
                self.blocked = True
                self._stats["publish_blocked"] += 1
                return -1
        if unreadable:  # interested, but they hold no key we publish this scope under
            self._stats["publish_unreadable"] += unreadable
        if not links:
            return 0
        if msg_id:
            if len(msg_id) != MESSAGE_ID_SIZE:
                raise ConfigurationError(f"a message id is {MESSAGE_ID_SIZE} bytes")
            kind = _PUBLISH_RETAINED
            tail = msg_id + encoded + payload
        elif stamp:
            kind = _PUBLISH_STAMPED
            tail = _pack_stamp(stamp) + encoded + payload
        else:
            kind = _PUBLISH
            tail = encoded + payload
        if trace:
            if self._traces_read(links):
                tail = _pack_trace(kind, len(trace)) + trace + tail
                kind = _PUBLISH_TRACED
            else:
                self._stats["publish_trace_unread"] += 1
        size = len(encoded)
        outbox = self._outbox
        if not outbox.batching:
            for link, slot in links:
                link.credit -= 1
                seq = link.pub_seq = link.pub_seq + 1
                outbox.stage_out(link, slot, kind, _pack_publish(seq, size) + tail)
            return len(links)
        # The publish hot path: straight into each link's frame body for this slot, with no
        # entry list to walk and encode at flush time. A link that reads runs gets the very
        # same entry bytes as every other such link (encoded once here); one that reads only
        # BATCHes gets an entry header of its own (its stream seq is in it).
        limit = outbox.batch_limit
        published = outbox.published
        entry = b""
        length = _PUBLISH_SIZE + len(tail)
        for link, slot in links:
            link.credit -= 1
            seq = link.pub_seq = link.pub_seq + 1
            parts = link.pub_parts
            if link.pub_runs:
                if not entry:
                    entry = _pack_run_entry(kind, len(tail), size) + tail
                if parts:
                    if (
                        slot != link.pub_slot
                        or link.pub_size + len(entry) > limit
                        or len(parts) > MAX_BATCH
                    ):
                        outbox.seal_published(link)  # the link stays listed in published
                        link.pub_slot = slot
                        parts.append(_pack_run_head(seq))
                        link.pub_size = _RUN_HEAD_SIZE
                else:
                    published.append(link)
                    link.pub_slot = slot
                    parts.append(_pack_run_head(seq))
                    link.pub_size = _RUN_HEAD_SIZE
                parts.append(entry)
                link.pub_size += len(entry)
                continue
            if parts:
                if (
                    slot != link.pub_slot
                    or link.pub_size + length > limit
                    or len(parts) >= _MAX_PARTS
                ):
                    outbox.seal_published(link)  # the link stays listed in published
                    link.pub_slot = slot
            else:
                published.append(link)
                link.pub_slot = slot
            parts.append(_pack_publish_entry(kind, length, seq, size))
            parts.append(tail)
            link.pub_size += _ENTRY_SIZE + length
        return len(links)

    @staticmethod
    def _traces_read(links: list[tuple[OutLink, int]]) -> bool:
        """Whether every one of `links` reads trace context: a publish's entry is encoded once
        for all of them, so it carries the context to all or to none."""
        return all(link.traces for link, _slot in links)

    def _route(self, topic: str, scope: str) -> tuple[list[tuple[OutLink, int]], int]:
        """The links interested in `topic` with the slot each takes its scope in, and how many
        more are interested but hold no key this node publishes the scope under; remembered
        per topic until interest or links change (publishers repeat their topics)."""
        links: list[tuple[OutLink, int]] = []
        unreadable = 0
        for link in self._interest.match_cached(topic):
            slot = link.topic_slots.get(scope)
            if slot is None:
                slot = self._topic_slot(link, scope)
            if slot:
                links.append((link, slot))
            else:
                unreadable += 1
        if len(self._routes) >= _MAX_TOPIC_SCOPES:
            self._routes.clear()
        route = self._routes[topic] = (links, unreadable)
        return route

    def _settled(self, scope: str) -> bool:
        """Whether every node that reads `scope` is linked and has told its patterns."""
        peers = self._peers
        for node_id in self._readers(scope):
            link = peers.get(node_id)
            if link is None or not link.subscribed:
                return False
        self._ready.add(scope)
        return True

    def _topic_out(self, topic: str) -> tuple[bytes, str]:
        if not self.rights.may_publish(topic):  # once per topic: the verdict is kept
            self._stats["publishes_forbidden"] += 1
            raise Forbidden(topic, "publish", "this node's grant does not allow it")
        scope = topic.partition(".")[0]
        if not self._security.has_key(scope):
            raise NoKey(scope)
        if len(self._topics_out) >= _MAX_TOPIC_SCOPES:
            self._topics_out.clear()
        known = self._topics_out[topic] = (topic.encode(), scope)
        return known

    # ----------------------------------------------------------------- receiving

    def on_publish(self, link: InLink, body: bytes, slot_scope: str, kind: int = _PUBLISH) -> None:
        """One PUBLISH (PUBLISH_STAMPED, PUBLISH_RETAINED) frame: a batch of one; or a
        PUBLISH_RUN."""
        if kind == _PUBLISH_RUN:
            self.on_publish_batch(link, body, slot_scope, True)
            return
        self.on_publish_batch(link, _pack_entry(kind, len(body)) + body, slot_scope)

    def on_publish_batch(
        self, link: InLink, body: bytes, slot_scope: str, run: bool = False
    ) -> None:
        """The PUBLISH entries of a BATCH (or, `run`, of a PUBLISH_RUN): one MessagesArrived
        event for all of them.

        The subscriber's hot path, so decode_batch's walk and each entry's checks are inlined.
        A bad message is counted and dropped (the credit it used is the sender's again); a
        broken envelope ends the walk, and the messages before it are still delivered.
        """
        messages: list[tuple[str, bytes]] = []
        gaps: dict[int, int] | None = None
        stamps: dict[int, float] | None = None
        ids: dict[int, bytes] | None = None
        traces: dict[int, bytes] | None = None
        offset, size, count = 0, len(body), 0
        unpack, stats = _unpack_publish_entry, self._stats
        checked = link.topics_heard  # per link with grants required, else node-wide
        heard = self._topics_heard if checked is None else checked
        kind: int
        length: int
        stream_seq: int
        topic_size: int
        first_seq = 0
        try:
            if run:
                if size < _RUN_HEAD_SIZE:
                    raise ProtocolError("bad_envelope", "PUBLISH_RUN")
                first_seq = _unpack_run_head(body, 0)[0]
                offset = _RUN_HEAD_SIZE
            while offset < size:
                if count >= MAX_BATCH:
                    raise ProtocolError("bad_envelope", "BATCH")
                if run:
                    if size - offset < _RUN_ENTRY_SIZE:
                        raise ProtocolError("bad_envelope", "PUBLISH_RUN")
                    # RUN_ENTRY (!BIB) read byte by byte: compiled, no call and no tuple.
                    kind = body[offset]
                    length = (
                        body[offset + 1] << 24
                        | body[offset + 2] << 16
                        | body[offset + 3] << 8
                        | body[offset + 4]
                    )
                    topic_size = body[offset + 5]
                    stream_seq = first_seq + count
                    start = offset + _RUN_ENTRY_SIZE
                    offset = start + length
                else:
                    if size - offset < _PUBLISH_ENTRY_SIZE:
                        raise ProtocolError("bad_envelope", "BATCH")
                    kind, length, stream_seq, topic_size = unpack(body, offset)
                    start = offset + _PUBLISH_ENTRY_SIZE
                    offset += _ENTRY_SIZE + length
                stamp = 0.0
                msg_id = b""
                trace = b""
                if kind != _PUBLISH:  # a plain publish (the common case) checks nothing more
                    if kind == _PUBLISH_TRACED and start + _TRACE_SIZE <= offset <= size:
                        # TRACE_FIELDS (!BH) read byte by byte, as RUN_ENTRY is.
                        kind = body[start]
                        trace_end = start + _TRACE_SIZE + (body[start + 1] << 8 | body[start + 2])
                        if trace_end > offset or trace_end - start - _TRACE_SIZE > MAX_TRACE:
                            raise ProtocolError("bad_envelope", "PUBLISH trace")
                        trace = body[start + _TRACE_SIZE : trace_end]
                        start = trace_end
                    if kind == _PUBLISH_STAMPED and start + _STAMP_SIZE <= offset <= size:
                        stamp = _unpack_stamp(body, start)[0]
                        start += _STAMP_SIZE
                        if not 0.0 < stamp < MAX_STAMP:  # NaN, infinity, or no time at all
                            raise ProtocolError("bad_envelope", "PUBLISH stamp")
                    elif kind == _PUBLISH_RETAINED and start + MESSAGE_ID_SIZE <= offset <= size:
                        msg_id = body[start : start + MESSAGE_ID_SIZE]
                        start += MESSAGE_ID_SIZE
                    elif kind != _PUBLISH:
                        raise ProtocolError("bad_envelope", "PUBLISH entry")
                topic_end = start + topic_size
                if offset > size or topic_size == 0 or topic_end > offset:
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
                        if checked is None:
                            known = self._topic_heard(encoded)
                        else:
                            known = self._topic_checked(link, checked, encoded)
                    except ProtocolError as exc:
                        stats["dropped_" + exc.reason] += 1
                        self.release(link.routing_id)
                        continue
                topic, scope, owned = known
                # The slot's key must be the one this node expects for the topic: its own key
                # for a scope it has one for (a holder of the default key cannot inject there).
                if scope != slot_scope and (slot_scope != "*" or owned):
                    stats[
                        "dropped_publish_forbidden" if scope == _FORBIDDEN else "dropped_bad_scope"
                    ] += 1
                    self.release(link.routing_id)
                    continue
                if stamp:
                    if stamps is None:
                        stamps = {}
                    stamps[len(messages)] = stamp
                elif msg_id:
                    if ids is None:
                        ids = {}
                    ids[len(messages)] = msg_id
                if trace:
                    if traces is None:
                        traces = {}
                    traces[len(messages)] = trace
                messages.append((topic, body[topic_end:offset]))
        finally:
            if messages:
                self._outbox.events.append(
                    MessagesArrived(
                        link.routing_id, link.peer_id, messages, gaps, stamps, ids, traces
                    )
                )

    def _topic_checked(
        self, link: InLink, checked: dict[bytes, tuple[str, str, bool]], encoded: bytes
    ) -> tuple[str, str, bool]:
        """A topic heard first on `link` (grants required): its verdict, kept on the link. A
        topic the publisher's grant does not allow holds the scope `_FORBIDDEN`."""
        known = self._topics_heard.get(encoded)
        if known is None:
            known = self._topic_heard(encoded)
        if not link.grant.rights.may_publish(known[0]):
            known = (known[0], _FORBIDDEN, True)
        self._stats["publisher_topics_checked"] += 1
        if len(checked) >= _MAX_TOPIC_SCOPES:
            checked.clear()
        checked[encoded] = known
        return known

    def _topic_heard(self, encoded: bytes) -> tuple[str, str, bool]:
        topic = parse_topic_from_peer(encoded)
        scope = topic.partition(".")[0]
        if len(self._topics_heard) >= _MAX_TOPIC_SCOPES:
            self._topics_heard.clear()
        known = self._topics_heard[encoded] = (topic, scope, self._security.owns(scope))
        return known
