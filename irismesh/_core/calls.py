"""Calls: requests, broadcasts and surveys, from the caller's side and from the member's.

Theory of operation
-------------------
Caller. A node sends its requests on the links it dialled. `request` picks one live member of
the cluster (`balancer.choose`, avoiding a suspect one where it can, and while `outliers` keeps
members that failed or lagged far behind out of rotation, among the rest) and keeps the request in
`PendingRequests` until its reply, its failure or its deadline; `fanout` sends a BROADCAST or
SURVEY to every member, one pending request per member, each *pinned* to it. Their preludes are
one (`members_for`): closed, payload too large, too many in flight, no member (NoKey without
a key for the cluster, else NoResponders).

A pending request moves to another member in three cases, all through `_send_to` (the same
request id each time, so the member's reply cache can spot a duplicate): its link went down
(`link_down`: resend to another member, or park it until one appears or the deadline passes,
or fails with NoResponders once the cluster has no live member left, `fail_unserved`;
a pinned one fails with MemberLost), its link is vouched for by other peers but silent here
(`migrate`: alive is not the same as useful), or no reply came within its hedge delay (`_hedge`:
a copy goes to a second member, within a token-bucket budget, and the first reply wins).
Replies are acknowledged on the next request or ping to that member (`OutLink.acks`) so it may
forget them.

Member. A request arrives on a link a peer dialled, in a scope slot that names the cluster
(`on_request`). The member remembers each request id with its reply (`ReplyCache`): a resend of
a request that already ran gets the remembered reply, and a resend of one still running waits
for it; the reply goes out on the link the latest copy came on (`reply`). Acknowledged replies
are forgotten, but only those answered on the very link the acknowledgement came on.

Relays. Gateways of two meshes in one process join two cores in one event loop. A request
for a cluster in `relays` (set on the importing core) is handed at once to the other core's
`relay_request`, which asks its own mesh for it like any request and remembers whose it is
(`relaying`: request id -> the importing core's calls and the request's token); its reply is
answered on the importing core as it is read (`_relay_reply`), the payload's bytes passed
through, so a request crossing makes no event, no Future and no Python call in between. A
failure later (its deadline, no member left) comes out as a RequestFailed event, as for any
request; the node hands it to `relay_failed`. The importing core still remembers the request
in its reply cache, so a resend of it is answered as any other's.

Trace context. A call may carry its caller's trace context (opaque bytes, see `frames.TRACED`):
kept with the pending request, so every resend, migration and hedge carries it too, and sent
only to members that read it; a member hands it on in the RequestArrived event, and a relay
passes it to the other core as it came. A call without it costs one check.

Hot paths: `_send_request`, `on_reply`, `on_request` and `reply` run once per message; their
encoding and staging are inlined, and what they call is bound once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from random import Random

from irismesh._core import balancer
from irismesh._core.config import CoreConfig
from irismesh._core.events import (
    ReplyArrived,
    RequestArrived,
    RequestCancelled,
    RequestFailed,
    Token,
    TracedRequestArrived,
)
from irismesh._core.frames import (
    ACKS,
    MAX_ACKS,
    REQUEST_FIELDS,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_OVERLOADED,
    TRACE_FIELDS,
    Kind,
    decode_reply,
    decode_request,
    encode_reply,
    pack_error,
)
from irismesh._core.links import InLink, LinkObserver, LinkState, OutLink
from irismesh._core.outbox import Outbox
from irismesh._core.outliers import OutlierEjection
from irismesh._core.pending import PendingRequest, PendingRequests
from irismesh._core.priority import label
from irismesh._core.replycache import ReplyCache
from irismesh._core.rights import ALL_RIGHTS, Rights
from irismesh._core.sealing import LinkSecurity
from irismesh._core.split import Route
from irismesh._core.throttle import Throttle
from irismesh._core.throttle import key as throttle_key
from irismesh.errors import (
    Closed,
    Forbidden,
    MemberLost,
    MeshError,
    NoKey,
    NoResponders,
    Overloaded,
    PayloadTooLarge,
    ProtocolError,
    RequestTimeout,
)

_REQUEST, _REPLY, _CANCEL = int(Kind.REQUEST), int(Kind.REPLY), int(Kind.CANCEL)
_TRACED = int(Kind.TRACED)
_pack_request = REQUEST_FIELDS.pack
_pack_trace = TRACE_FIELDS.pack


def _release(request: PendingRequest) -> None:
    """The request is over: its links carry one request fewer."""
    if request.link is not None:
        request.link.outstanding -= 1
    if request.hedged is not None:
        request.hedged.outstanding -= 1


class Calls(LinkObserver):
    """The node's calls in flight (as caller) and the replies it remembers (as member)."""

    def __init__(
        self,
        *,
        config: CoreConfig,
        security: LinkSecurity,
        rng: Random,
        stats: Counter[str],
        outbox: Outbox,
        inbound: dict[bytes, InLink],
        peers: dict[bytes, OutLink],
        cluster_slot: Callable[[OutLink, str], int],
        want: Callable[[str, float], int],
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.closed = False
        self.pending = PendingRequests()
        self.replies = ReplyCache(config.reply_cache_entries, config.reply_cache_bytes)
        self._security = security
        self._rng = rng
        self._stats = stats
        self._outbox = outbox
        self._stage_in = outbox.stage_in
        self._inbound = inbound  # the engine's table of links peers dialled
        self._peers = peers  # the engine's UP dialled links, by node id
        self._cluster_slot = cluster_slot  # whether a link serves a cluster (NoKey without key)
        self._want = want  # links to the cluster's members; how many membership knows
        self._clock = clock
        # Cluster -> UP links serving it: a cache the engine clears whenever a link comes up or
        # goes down.
        self.linked: dict[str, list[OutLink]] = {}
        # This node's own rights (`rights`): a cluster it may not call never gets a list in
        # `linked`, so the check costs nothing per request. The engine sets them.
        self.rights: Rights = ALL_RIGHTS
        self._max_payload = config.max_payload
        self._max_pending = config.max_pending
        self._next_req = 1
        # A request above the default priority arrived since the driver last looked: it
        # hands those to the handlers ahead of the rest of the run of events.
        self.urgent = False
        self._hedge_tokens = config.hedge_burst
        self._hedge_refilled = 0.0
        self.throttle = Throttle()
        # Where replies go, when set (the node's caller sets it): called as each arrives with
        # (req id, status, payload, member id, arrival time) instead of an event per reply.
        # None: a ReplyArrived event each (a driver that takes events only, the tests).
        self.reply_sink: Callable[[int, int, bytes, bytes, float], None] | None = None
        # Relays (see the module's docstring): cluster -> the calls of the core in this process
        # that asks its mesh for requests to it; and, on that core, the requests it relays.
        self.relays: dict[str, Calls] = {}
        self.relaying: dict[int, tuple[Calls, Token]] = {}
        # Cluster -> its traffic split, for the clusters called that have one (`split`).
        self.routes: dict[str, Route] = {}
        # Members this caller keeps out of rotation for a while (see `outliers`).
        self.outliers = OutlierEjection(
            config=config.outliers, stats=stats, outbox=outbox, peers=peers, members=self.members
        )

    # ----------------------------------------------------------------- caller

    def members(self, cluster: str) -> list[OutLink]:
        """UP links to members of `cluster` (linking to those membership knows and this node
        is not linked to yet); raises NoKey without a key for it."""
        members = self.linked.get(cluster)
        if members is None:
            if self._security.has_key(cluster):
                self._want(cluster, self._clock())
            slot = self._cluster_slot
            members = [link for link in self._peers.values() if slot(link, cluster)]
            # A cluster this node may not call keeps no list: its calls take the slow path
            # (`members_for`), which refuses them; the others cost no check per request.
            if self.rights.may_call(cluster):
                self.linked[cluster] = members
        return members

    def members_for(self, cluster: str, size: int, adding: int, now: float) -> list[OutLink]:
        """The linked members a call into `cluster` may go to, or the reason it may not:
        Closed, PayloadTooLarge (`size` bytes), Overloaded (`adding` more requests in flight
        would pass max_pending), Forbidden (this node's grant does not let it call the
        cluster), NoKey, NoResponders; checked in that order. Empty when
        membership knows members but no link to one is up yet (they are being dialled)."""
        if self.closed:
            raise Closed("node is closed")
        if size > self._max_payload:
            raise PayloadTooLarge(size, self._max_payload)
        pending = len(self.pending.by_id)
        if pending + adding > self._max_pending:
            raise Overloaded(pending, self._max_pending)
        if not self.rights.may_call(cluster):
            self._stats["calls_forbidden"] += 1
            raise Forbidden(cluster, "call", "this node's grant does not allow it")
        members = self.linked.get(cluster)
        if members is None:
            members = self.members(cluster)
        if not members:
            if not self._security.has_key(cluster):
                raise NoKey(cluster)
            if not self._want(cluster, now):
                raise NoResponders(cluster)
        return members

    def request(
        self,
        cluster: str,
        payload: bytes,
        timeout: float,
        now: float,
        hedge: float | None = None,
        kind: int = _REQUEST,
        priority: int = 0,
        trace: bytes | None = None,
    ) -> int:
        """Send a request to one member of `cluster`; returns its id for the events.

        With `hedge`, a copy goes to a second member if no reply came within `hedge` seconds,
        and the first reply wins (for idempotent requests: both may run). `kind` is REQUEST,
        or JOB for a queued job the memory hands out (REQUEST's layout and handling).
        `priority` (a checked int, see `priority`) goes with it, and orders it in this node's
        outbox. A `trace` context (frames.TRACED) goes with it to members that read one.
        """
        members = self.linked.get(cluster)
        if (  # the hot path asks members_for only when it cannot go ahead at once
            not members
            or self.closed
            or len(payload) > self._max_payload
            or len(self.pending.by_id) >= self._max_pending
        ):
            members = self.members_for(cluster, len(payload), 1, now)
            if not members:  # its members' links are opening: it waits for one
                return self._park(cluster, payload, timeout, now, kind, priority, trace)
        if not self.throttle.admit(throttle_key(cluster, priority), now, self._rng):
            self._stats["requests_throttled"] += 1
            raise Overloaded(reason="throttled", cluster=cluster)
        candidates = members
        if self.outliers.ejected:  # some member is out of rotation: choose among the rest
            candidates = self.outliers.rotation(cluster, candidates)
        if self.routes:  # a traffic split: a version by weight first, then the usual choice
            route = self.routes.get(cluster)
            if route is not None:
                candidates = route.narrow(candidates, self._rng)
        link = balancer.choose(candidates, self._rng, None, now)
        if link.suspect:  # silent lately: another member if there is one that is not
            heard = [m for m in candidates if not m.suspect]
            if heard:
                link = balancer.choose(heard, self._rng, None, now)
        req_id = self._next_req
        self._next_req += 1
        request = PendingRequest(
            req_id, cluster, payload, now + timeout, timeout, now, link, kind=kind
        )
        if priority:
            request.priority = priority
        if trace is not None:
            request.trace = trace
        self.pending.add(request)
        if hedge is not None and hedge < timeout and len(members) > 1:
            request.hedge_at = now + hedge
            self.pending.add_hedge(request)
            self._hedge_tokens = min(
                self.config.hedge_burst, self._hedge_tokens + self.config.hedge_ratio
            )
        self._send_request(link, req_id, cluster, payload, timeout, kind, priority, trace)
        return req_id

    def fanout(
        self,
        kind: int,
        cluster: str,
        payload: bytes,
        timeout: float,
        now: float,
        trace: bytes | None = None,
    ) -> list[tuple[int, bytes]]:
        """Send a BROADCAST or SURVEY to every live member: [(req id, member id), ...]."""
        members = self.members_for(cluster, len(payload), 0, now)
        if not members:
            raise NoResponders(cluster)
        if len(self.pending.by_id) + len(members) > self._max_pending:
            raise Overloaded(len(self.pending.by_id), self._max_pending)
        sent = []
        for link in members:
            req_id = self._next_req
            self._next_req += 1
            request = PendingRequest(
                req_id,
                cluster,
                payload,
                now + timeout,
                timeout,
                now,
                link,
                kind=kind,
                pinned=True,
                trace=trace,
            )
            self.pending.add(request)
            self._send_request(link, req_id, cluster, payload, timeout, kind, 0, trace)
            sent.append((req_id, link.peer_id))
        return sent

    def request_link(self, req_id: int) -> int:
        """The link a pending request was sent on (0: none now)."""
        request = self.pending.get(req_id)
        return request.link.link_id if request is not None and request.link is not None else 0

    def cancel(self, req_id: int) -> None:
        """Forget a request whose caller gave up; a late reply is then dropped and counted.
        The members it was sent to hear of it, so that they drop it or cancel its handler."""
        request = self.pending.pop(req_id)
        if request is not None:
            _release(request)
            for link in (request.link, request.hedged):
                if link is not None:
                    self._send_cancel(link, req_id)

    def _send_cancel(self, link: OutLink, req_id: int) -> None:
        if link.state is LinkState.UP:
            self._outbox.send_out(link, _CANCEL, [[req_id]])
            self._stats["cancels_sent"] += 1

    def _send_request(
        self,
        link: OutLink,
        req_id: int,
        cluster: str,
        payload: bytes,
        timeout: float,
        kind: int = _REQUEST,
        priority: int = 0,
        trace: bytes | None = None,
    ) -> None:
        # The hot path: encode_header and encode_request inlined (measured).
        link.outstanding += 1
        slot = link.clusters[cluster]
        timeout_ms = int(timeout * 1000) + 1
        if timeout_ms > 0xFFFFFFFF:
            timeout_ms = 0xFFFFFFFF
        acks = link.acks
        # The priority rides in the acks' count byte, for members that read it (`priority`).
        rank = ((priority & 0xF) << 4) if priority and link.priorities else 0
        if acks:
            acks, link.acks = acks[:MAX_ACKS], acks[MAX_ACKS:]
            n = len(acks)
            body = _pack_request(req_id, timeout_ms, rank | n) + ACKS[n].pack(*acks) + payload
        else:
            body = _pack_request(req_id, timeout_ms, rank) + payload
        if trace is not None and link.traces:  # frames.encode_traced, inlined
            body = _pack_trace(kind, len(trace)) + trace + body
            kind = _TRACED
        outbox = self._outbox
        if priority:  # staged in its class: sealed and sent before the lower ones
            outbox.stage_ranked(link, priority, slot, kind, body)
            return
        if outbox.batching:  # Outbox.stage_out's staging, inlined: the hot path
            if not link.staged and not link.ranked:
                outbox.staged_out.append(link)
            link.staged.append((slot, kind, body))
            return
        outbox.stage_out(link, slot, kind, body)

    def _send_to(
        self, request: PendingRequest, link: OutLink, now: float, counter: str, *, hedge: bool
    ) -> None:
        """Send a pending request again, to member `link`: as a hedge (a second copy in
        flight) or as its new attempt. Every resend, migration and hedge goes this way."""
        if hedge:
            request.hedged = link
        else:
            request.link = link
            request.attempts += 1
            request.sent_at = now
        self._stats[counter] += 1
        remaining = request.deadline - now
        self._send_request(
            link,
            request.req_id,
            request.cluster,
            request.payload,
            remaining,
            request.kind,
            request.priority,
            request.trace,
        )

    def _park(
        self,
        cluster: str,
        payload: bytes,
        timeout: float,
        now: float,
        kind: int,
        priority: int,
        trace: bytes | None,
    ) -> int:
        """A request that waits for a member's link to come up (`link_up`) or its deadline."""
        req_id = self._next_req
        self._next_req += 1
        request = PendingRequest(
            req_id, cluster, payload, now + timeout, timeout, now, None, kind=kind
        )
        request.attempts = 0  # not sent yet
        request.priority = priority
        request.trace = trace
        self.pending.add(request)
        self._stats["requests_parked"] += 1
        return req_id

    def _resend(self, request: PendingRequest, now: float, failed: OutLink | None) -> None:
        """Its link is gone: another member, or parked until one comes or the deadline."""
        members = self.members(request.cluster)
        if request.deadline <= now or not members:
            request.link = None  # parked: a new member or the deadline decides
            if request.deadline > now:
                self._want(request.cluster, now)  # other members, not linked yet
            return
        link = balancer.choose(members, self._rng, failed, now)
        counter = "requests_resent" if request.attempts else "requests_unparked"
        self._send_to(request, link, now, counter, hedge=False)

    def migrate(self, link: OutLink, now: float) -> None:
        """Requests waiting on a link that others vouch for but we cannot hear (TCP in
        retransmission backoff, say) go to other members: alive is not the same as useful."""
        for request in self.pending:
            if request.link is not link or request.pinned:
                continue
            if request.hedged is not None:  # the hedge's copy carries on alone
                request.link, request.hedged = request.hedged, None
                link.outstanding -= 1
                continue
            members = self.members(request.cluster)
            others = [m for m in members if m is not link and not m.suspect]
            if not others or request.deadline <= now:
                continue  # it stays: this member may yet answer
            link.outstanding -= 1
            target = balancer.choose(others, self._rng, None, now)
            self._send_to(request, target, now, "requests_migrated", hedge=False)

    def _hedge(self, request: PendingRequest, now: float) -> None:
        """No reply within the hedge delay: a copy to a second member, if the budget allows."""
        members = [m for m in self.members(request.cluster) if m is not request.link]
        if self.outliers.ejected:  # a copy to an ejected member would fail, and win
            members = self.outliers.in_rotation(request.cluster, members)
        if not members:
            return
        cfg = self.config
        self._hedge_tokens = min(
            cfg.hedge_burst, self._hedge_tokens + (now - self._hedge_refilled) * cfg.hedge_rate
        )
        self._hedge_refilled = now
        if self._hedge_tokens < 1.0:  # hedging must not double the load of a slow cluster
            self._stats["hedges_over_budget"] += 1
            return
        self._hedge_tokens -= 1.0
        link = balancer.choose(members, self._rng, None, now)
        self._send_to(request, link, now, "requests_hedged", hedge=True)

    def on_reply(
        self, link: OutLink, body: bytes, now: float, start: int = 0, end: int = -1
    ) -> None:
        """A REPLY: all of `body`, or its entry `body[start:end]` in a BATCH."""
        req_id, status, payload = decode_reply(body, start, end)
        link.acks.append(req_id)  # received: the member may forget it
        pending = self.pending
        request = pending.get(req_id)
        if (
            request is None
            or (request.link is not link and request.hedged is not link)
            or now >= request.deadline  # its caller has given up, though the timer is not in
        ):
            self._stats["replies_late"] += 1  # timed out, cancelled, or answered elsewhere
            return
        if status == STATUS_OVERLOADED:
            self._turned_away(request, link, payload, now)
            return
        pending.pop(req_id)
        _release(request)
        link.replies += 1  # the member's record for outlier ejection
        if status == STATUS_OK:
            link.errors_in_row = 0
        elif not request.pinned:  # its request handler raised: a strike against it
            self.outliers.failed(link, request.cluster, now)
        age = now - link.latency_at  # of the estimate: a stale one counts for less
        link.latency_at = link.last_sample = now
        if link.latency == 0.0:  # the first sample is weak evidence: its estimate starts old
            link.latency_at = now - balancer.FIRST_SAMPLE_AGE
        balancer.observe(
            link, now - (request.sent_at if request.link is link else request.hedge_at), age
        )
        if not request.pinned:
            self.throttle.accepted(throttle_key(request.cluster, request.priority), now)
            other = request.hedged if request.link is link else request.link
            if other is not None:  # the hedge's other copy: its member may drop it
                self._send_cancel(other, req_id)
        if self.relaying and self._relay_reply(req_id, status, payload):
            return
        sink = self.reply_sink
        if sink is not None:
            sink(req_id, status, payload, link.peer_id, now)
        else:
            self._outbox.events.append(ReplyArrived(req_id, status, payload, link.peer_id))

    def _turned_away(self, request: PendingRequest, link: OutLink, why: bytes, now: float) -> None:
        """A member turned the request away unrun (it could not have answered in time): its
        other copy carries on, or another member not asked yet takes it within the deadline;
        else it fails with Overloaded. The member weighs less in the balance for a while."""
        self._stats["requests_turned_away"] += 1
        link.refusals += 1  # no failure, yet its latency estimate is penalised below
        balancer.penalise(link, now)
        link.outstanding -= 1
        if request.hedged is link:
            request.hedged = None
            return
        if request.hedged is not None:
            request.link, request.hedged = request.hedged, None
            return
        request.refused.append(link.peer_id)
        if not request.pinned and request.deadline > now:
            members = self.linked.get(request.cluster) or self.members(request.cluster)
            others = [m for m in members if m.peer_id not in request.refused]
            if others:
                target = balancer.choose(others, self._rng, None, now)
                self._send_to(request, target, now, "requests_retried_elsewhere", hedge=False)
                return
        self.pending.pop(request.req_id)
        self.throttle.refused(throttle_key(request.cluster, request.priority), now)
        reason = why.decode("ascii", "replace")[:40]
        error = Overloaded(reason="member", cluster=request.cluster, detail=reason)
        self._outbox.events.append(RequestFailed(req_id=request.req_id, error=error))

    def link_up(self, link: OutLink, now: float) -> None:
        """A member appeared: parked requests go out again."""
        for request in self.pending:
            if request.link is None:
                self._resend(request, now, None)

    def link_down(self, link: OutLink, reason: str, now: float) -> None:
        """Requests in flight on a lost member: the hedge's copy carries on, a pinned one
        fails with MemberLost, the others are resent (or parked)."""
        link.outstanding = 0
        for request in self.pending:
            if request.hedged is link:
                request.hedged = None
            if request.link is not link:
                continue
            if request.hedged is not None:  # the hedge's copy carries on alone
                request.link, request.hedged = request.hedged, None
            elif request.pinned:  # meant for this member alone
                self.pending.pop(request.req_id)
                error = MemberLost(request.cluster, link.peer_id.hex())
                self._outbox.events.append(RequestFailed(req_id=request.req_id, error=error))
            else:
                self._resend(request, now, link)

    def fail_unserved(self, now: float) -> None:
        """Members went (dead, or out of this node's routing): parked requests of a cluster
        left with no live member fail with NoResponders now, as a new request to it would,
        rather than at their deadline."""
        parked = [request for request in self.pending if request.link is None]
        if not parked:
            return
        served: dict[str, int] = {}
        events = self._outbox.events
        for request in parked:
            cluster = request.cluster
            count = served.get(cluster)
            if count is None:
                count = served[cluster] = self._want(cluster, now)
            if not count:
                self.pending.pop(request.req_id)
                self._stats["requests_unserved"] += 1
                events.append(RequestFailed(req_id=request.req_id, error=NoResponders(cluster)))

    def fail_forbidden(self) -> None:
        """This node's rights changed: requests in flight into a cluster it may no longer call
        fail with Forbidden now, as a new one would, rather than at their deadline; their
        members hear that the caller gave up."""
        may_call = self.rights.may_call
        refused = [request for request in self.pending if not may_call(request.cluster)]
        events = self._outbox.events
        for request in refused:
            self.cancel(request.req_id)
            self._stats["calls_forbidden"] += 1
            error = Forbidden(request.cluster, "call", "this node's grant no longer allows it")
            events.append(RequestFailed(req_id=request.req_id, error=error))

    def tick(self, now: float) -> None:
        """Hedges due, deadlines passed, replies remembered too long."""
        for request in self.pending.pop_hedges(now):
            self._hedge(request, now)
        events = self._outbox.events
        for request in self.pending.pop_expired(now):
            _release(request)
            self._stats["requests_timed_out"] += 1
            if not request.pinned:
                self.throttle.refused(throttle_key(request.cluster, request.priority), now)
                if request.link is not None:  # against its member, unless its peers' alike
                    request.link.timeouts += 1
            error = RequestTimeout(request.cluster, request.timeout, request.attempts)
            events.append(RequestFailed(req_id=request.req_id, error=error))
        self.outliers.tick(now)
        self.replies.expire(now)

    def close(self) -> None:
        """The node closes: every pending request fails with Closed."""
        self.closed = True
        events = self._outbox.events
        for request in self.pending:
            self.pending.pop(request.req_id)
            events.append(RequestFailed(req_id=request.req_id, error=Closed("node closed")))

    # ----------------------------------------------------------------- member

    def on_request(
        self,
        link: InLink,
        slot: int,
        body: bytes,
        now: float,
        kind: int,
        start: int = 0,
        end: int = -1,
        trace: bytes | None = None,
    ) -> None:
        """A REQUEST (or BROADCAST, SURVEY, JOB): all of `body`, or its entry
        `body[start:end]` in a BATCH; with the caller's `trace` context, if it sent one."""
        if slot == 0 or slot >= len(link.scopes) or link.scopes[slot] is None:
            raise ProtocolError("bad_scope", str(slot))
        req_id, timeout_ms, acks, payload, priority = decode_request(body, start, end)
        if link.refused and slot in link.refused:  # the caller's grant lacks `call` for it
            self._refuse(link, slot, req_id, now + timeout_ms / 1000)
            return
        if acks:
            self.forget_replies(link, acks)
        if len(payload) > self._max_payload:
            raise ProtocolError("oversize", f"payload of {len(payload)} bytes")
        key = (link.peer_id, req_id)
        cached = self.replies.get(key)
        if cached is not None:
            self._stats["requests_duplicate"] += 1
            cached.routing_id = link.routing_id  # the resend's link is the one to answer on
            cached.slot = slot
            if cached.status >= 0:
                self._send_reply(link, slot, req_id, cached.status, cached.payload, priority)
            return
        deadline = now + timeout_ms / 1000
        entry = self.replies.start(key, deadline + 1.0, link.routing_id, slot)
        cluster = link.scopes[slot]
        assert cluster is not None
        token = (link.peer_id, req_id, link.routing_id, slot)
        if self.relays and kind == _REQUEST and cluster in self.relays:
            if priority:  # its reply goes in its class
                entry.priority = priority
            self._relay(cluster, payload, timeout_ms, now, token, priority, trace)
            return
        if priority:
            entry.priority = priority
            if priority > 0:
                self.urgent = True  # the driver hands these to the handlers first
            self._stats["requests_arrived_" + label(priority)] += 1
        arrived: RequestArrived
        if trace is not None:  # an event of its own type: plain requests' handlers never look
            arrived = TracedRequestArrived(token, cluster, payload, kind, deadline, priority, trace)
        elif priority:
            arrived = RequestArrived(token, cluster, payload, kind, deadline, priority)
        else:
            arrived = RequestArrived(token, cluster, payload, kind, deadline)
        self._outbox.events.append(arrived)

    def _refuse(self, link: InLink, slot: int, req_id: int, deadline: float) -> None:
        """Answer a request from a caller without the right to call its cluster: Forbidden,
        at once (the caller raises it), and counted."""
        cluster = link.scopes[slot] or ""
        self._stats["refused_forbidden"] += 1
        key = (link.peer_id, req_id)
        if self.replies.get(key) is None:
            self.replies.start(key, deadline + 1.0, link.routing_id, slot)
        self._answer(
            (link.peer_id, req_id, link.routing_id, slot),
            STATUS_ERROR,
            pack_error("Forbidden", f"call {cluster}"),
        )

    def turn_away(self, token: Token, reason: str) -> None:
        """Answer request `token` with STATUS_OVERLOADED: not run, and it will not be (the
        member could not answer it in time); `reason` names why, for the caller's error."""
        self._stats["requests_shed_" + reason] += 1
        self._answer(token, STATUS_OVERLOADED, reason.encode("ascii", "replace"))

    def on_cancel(self, link: InLink, req_ids: list[int]) -> None:
        """The caller gave up on these requests: those still waiting or running here are
        reported (RequestCancelled); the others are done or unknown, and nothing happens."""
        peer_id = link.peer_id
        events = self._outbox.events
        for req_id in req_ids:
            entry = self.replies.get((peer_id, req_id))
            if entry is not None and entry.status < 0:
                self._stats["cancels_received"] += 1
                events.append(RequestCancelled((peer_id, req_id, entry.routing_id, entry.slot)))

    def reply(self, token: Token, payload: bytes, *, error: bool = False) -> None:
        """Answer the request `token` (from RequestArrived); errors carry pack_error bytes."""
        status = STATUS_ERROR if error else STATUS_OK
        if not error and len(payload) > self._max_payload:
            status = STATUS_ERROR
            payload = pack_error(
                "PayloadTooLarge",
                f"reply of {len(payload)} bytes exceeds the limit of {self._max_payload}",
            )
        self._answer(token, status, payload)

    def _answer(self, token: Token, status: int, payload: bytes) -> None:
        peer_id, req_id, routing_id, slot = token
        entry = self.replies.finish((peer_id, req_id), status, payload)
        priority = 0
        if entry is not None:  # a resend may have come on another link since
            routing_id, slot, priority = entry.routing_id, entry.slot, entry.priority
        link = self._inbound.get(routing_id)
        if link is None:  # the caller is gone; a resend gets the cached reply
            self._stats["replies_unroutable"] += 1
            return
        self._send_reply(link, slot, req_id, status, payload, priority)

    def reply_error(self, token: Token, exc: BaseException) -> None:
        self.reply(token, pack_error(type(exc).__name__, str(exc)), error=True)

    def _send_reply(
        self, link: InLink, slot: int, req_id: int, status: int, payload: bytes, priority: int = 0
    ) -> None:
        # In the request's scope, under its keys; in the request's class.
        if priority:
            body = encode_reply(req_id, status, payload)
            self._outbox.stage_ranked(link, priority, slot, _REPLY, body)
            return
        self._stage_in(link, slot, _REPLY, encode_reply(req_id, status, payload))

    def forget_replies(self, link: InLink, acks: Iterable[int]) -> None:
        """The caller has these replies: forget them (acks ride on its requests and pings)."""
        # Only replies answered on this very link: its node id is merely claimed, and a PING
        # needs no cluster key, but a reply bound to this link came from a request that did.
        discard = self.replies.discard
        peer_id, routing_id = link.peer_id, link.routing_id
        for req_id in acks:
            discard((peer_id, req_id), routing_id)

    # ----------------------------------------------------------------- relays

    def _relay(
        self,
        cluster: str,
        payload: bytes,
        timeout_ms: int,
        now: float,
        token: Token,
        priority: int,
        trace: bytes | None,
    ) -> None:
        """A request for a relayed cluster: to the other core now (see `relays`)."""
        self._stats["requests_relayed"] += 1
        if priority:
            self._stats["requests_arrived_" + label(priority)] += 1
        relay = self.relays[cluster]
        relay.relay_request(cluster, payload, timeout_ms / 1000, now, self, token, trace)

    def relay_request(
        self,
        cluster: str,
        payload: bytes,
        timeout: float,
        now: float,
        back: Calls,
        token: Token,
        trace: bytes | None = None,
    ) -> None:
        """Ask this core's mesh for a request the core `back` took (request `token` there),
        with its caller's `trace` context as it came: its reply is answered there as it
        arrives; what cannot be sent is answered at once."""
        self._stats["requests_relay_served"] += 1
        try:
            req_id = self.request(cluster, payload, timeout, now, trace=trace)
        except MeshError as exc:
            back.relay_refused(token, exc)
            return
        self.relaying[req_id] = (back, token)

    def _relay_reply(self, req_id: int, status: int, payload: bytes) -> bool:
        """The reply to a relayed request (False: not one): answered where it came from."""
        entry = self.relaying.pop(req_id, None)
        if entry is None:
            return False
        back, token = entry
        # A member's error is passed on as it came (packed already): the far caller reads it.
        back.reply(token, payload, error=status != STATUS_OK)
        return True

    def relay_failed(self, req_id: int, error: BaseException) -> bool:
        """A relayed request failed here (its RequestFailed event; False: not one): answered
        where it came from."""
        entry = self.relaying.pop(req_id, None)
        if entry is None:
            return False
        entry[0].relay_refused(entry[1], error)
        return True

    def relay_refused(self, token: Token, error: BaseException) -> None:
        """The other core could not serve relayed request `token`: with no member there, too
        many in flight or closing, it is turned away unrun (so that its caller asks another
        gateway); otherwise answered with the error."""
        if isinstance(error, NoResponders | Overloaded | Closed):
            self._stats["requests_relay_turned_away"] += 1
            self.turn_away(token, type(error).__name__.lower())
        else:
            self.reply(token, pack_error(type(error).__name__, str(error)), error=True)

    def drop_relays(self, error: BaseException) -> None:
        """This core closes: every request it relays is answered where it came from."""
        relaying, self.relaying = self.relaying, {}
        for back, token in relaying.values():
            back.relay_refused(token, error)
