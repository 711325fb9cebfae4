"""The sockets of a gateway's inter-mesh links: asyncio over pyzmq, the protocol in `linkproto`.

A gateway listens on one ROUTER (`listen=`) for the peer gateways that dial it, and dials each
of its `peers` with a DEALER of its own. Sockets are plain pyzmq sockets whose descriptors are
registered with `loop.add_reader` and drained without blocking (no Future per message). ZMTP
heartbeats notice a dead TCP connection and `ROUTER_HANDOVER` lets a reconnecting dialler take
its routing id back; the link's own heartbeats (`LinkConfig`) decide when a link is down. A
timer ticks every `heartbeat / 2` seconds: heartbeats, liveness, retransmissions, HELLOs.

Strangers: zmq keeps the listener's connections itself and never shows one to the gateway
before its first message, so the gateway cannot close one that has not proven the link key.
zmq bounds what one costs instead: a connection that has not finished zmq's greeting within
2 s is closed (`HANDSHAKE_IVL`), one that answers no ZMTP heartbeat within 1.5 s too, and a
message longer than any link frame is refused from its size (`MAXMSGSIZE`). What a complete
zmq peer without the link key can still do is in SECURITY.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq

from irismesh.errors import ConfigurationError, ProtocolError
from irismesh.federation.fargrants import FarGrants, Signer
from irismesh.federation.linkproto import (
    MAX_FRAME,
    REHELLO,
    Exports,
    Item,
    LinkConfig,
    LinkEnd,
    open_hello,
)

OnItems = Callable[[LinkEnd, list[Item]], None]  # also (end, []) when acks made room
OnState = Callable[[LinkEnd, bool], None]  # (link end, up)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
# A connection that has not finished zmq's greeting this long after it opened is closed by
# zmq (its default is 30 s): the same time a node gives a stranger to prove the mesh key.
_GREETING_MS = 2000
# Why a far gateway's handshake is refused where far grants are required: logged once per
# gateway and reason (until it links), so a gateway dialling again every retry logs no more.
_GRANT_REASONS = frozenset(
    ("no_grant", "grant_refused", "revoked", "bad_signature", "identity_changed")
)
_MAX_LOGGED = 1024

log = logging.getLogger("irismesh.federation")


def _readable(sock: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)


def _tune(sock: zmq.Socket[bytes]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 500)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1500)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3000)
    sock.setsockopt(zmq.HANDSHAKE_IVL, _GREETING_MS)
    # No link frame is longer: zmq refuses a longer message from its size, before buffering
    # it, and drops that connection.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)


class LinkTransport:
    """A gateway's links: the ends, their sockets, and the timer that keeps them alive."""

    def __init__(
        self,
        *,
        gateway_id: bytes,
        mesh: str,
        secrets: tuple[bytes, ...],
        exports: Exports,
        config: LinkConfig,
        listen: str | None,
        peers: Sequence[str],
        on_items: OnItems,
        on_state: OnState,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        identity: Signer | None = None,
        grant_token: Callable[[], bytes] | None = None,
        far_grants: FarGrants | None = None,
    ) -> None:
        for endpoint in [*([listen] if listen else []), *peers]:
            if not endpoint.startswith("tcp://"):
                raise ConfigurationError(f"a link endpoint is tcp://HOST:PORT, got {endpoint!r}")
        self._gateway_id = gateway_id
        self._mesh = mesh
        self._secrets = secrets
        self._exports = exports
        self.config = config
        self._listen = listen
        self._peers = list(dict.fromkeys(peers))
        self._on_items = on_items
        self._on_state = on_state
        self.stats: Counter[str] = Counter()
        self.ends: list[LinkEnd] = []
        self.endpoint = ""  # where the ROUTER listens, once started
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None  # its own, if it made one
        # Or one shared with the gateway's nodes, not terminated here (set before `start`).
        self.context = context
        self._router: zmq.Socket[bytes] | None = None
        self._dealers: dict[int, zmq.Socket[bytes]] = {}  # id(end) -> its socket
        self._by_peer: dict[bytes, LinkEnd] = {}  # listened ends by peer gateway id
        self._routes: dict[int, bytes] = {}  # id(end) -> routing id (listened ends)
        self._by_route: dict[bytes, LinkEnd] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tick_due = 0.0  # when the next tick is due (a later one: the loop stalled)
        self._flush_pending = False
        self._closed = False
        self._identity = identity
        self._grant_token = grant_token
        self.far_grants = far_grants
        self._logged: dict[object, str] = {}  # who -> the refusal last logged for it
        self._dialled: dict[int, str] = {}  # id(end) -> the endpoint it dials
        self._shown_token: bytes | None = None  # the grant last shown (`_grant_changed`)

    def _new_end(self, dialler: bool) -> LinkEnd:
        end = LinkEnd(
            gateway_id=self._gateway_id,
            mesh=self._mesh,
            secrets=self._secrets,
            exports=self._exports,
            dialler=dialler,
            config=self.config,
            auto_consume=False,  # the gateway acknowledges a crossing once it is republished
            identity=self._identity,
            far_grants=self.far_grants,
        )
        if self._grant_token is not None:
            end.grant_token = self._grant_token
        self.ends.append(end)
        return end

    def _refused(self, who: object, described: str, exc: ProtocolError) -> None:
        """A far gateway's handshake refused for its grant: one line per gateway and reason."""
        if exc.reason not in _GRANT_REASONS or self._logged.get(who) == exc.reason:
            return
        if len(self._logged) >= _MAX_LOGGED:
            self._logged.clear()
        self._logged[who] = exc.reason
        log.warning("gateway link refused: far gateway %s: %s", described, exc)

    def attach(self, end: LinkEnd) -> tuple[OnItems, OnState]:
        """Adopt an end linked another way (in-process: `locallink`): it is one of `ends`,
        flushed and ticked with them; it hands what arrives, and its state changes, to the
        callbacks returned (the gateway's)."""
        self.ends.append(end)
        return self._on_items, self._on_state

    def use_secrets(self, secrets: tuple[bytes, ...]) -> None:
        """New link keys (a rotated link keyring): for new HELLOs, and for every end, whose
        session ends if its key is no longer accepted (dialled again at once)."""
        self._secrets = secrets
        for end in self.ends:
            if end.use_secrets(secrets):
                self._on_state(end, False)
        self.flush_soon()

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        ctx = self.context
        if ctx is None:
            ctx = self._ctx = zmq.Context()
        if self._listen:
            router = self._router = ctx.socket(zmq.ROUTER)
            _tune(router)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            try:
                router.bind(self._listen)
            except zmq.ZMQError as exc:
                router.close(0)
                if self._ctx is not None:
                    self._ctx.term()
                    self._ctx = None
                raise ConfigurationError(f"cannot listen on {self._listen}: {exc}") from None
            self.endpoint = cast(bytes, router.getsockopt(zmq.LAST_ENDPOINT)).decode()
            loop.add_reader(router.FD, self._drain_router)
        for index, peer in enumerate(self._peers):
            end = self._new_end(dialler=True)
            dealer = ctx.socket(zmq.DEALER)
            _tune(dealer)
            dealer.setsockopt(zmq.ROUTING_ID, b"g" + self._gateway_id + bytes([index % 256]))
            dealer.setsockopt(zmq.RECONNECT_IVL, 100)
            dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            # A connect whose SYNs are lost (a link cut) would wait for TCP's own backoff, the
            # next try perhaps seconds after the link returns: give up and try afresh instead.
            dealer.setsockopt(zmq.CONNECT_TIMEOUT, 1000)
            dealer.setsockopt(zmq.IMMEDIATE, 1)
            dealer.connect(peer)
            self._dealers[id(end)] = dealer
            self._dialled[id(end)] = peer
            loop.add_reader(dealer.FD, self._drain_dealer, end, dealer)
        self._tick_due = time.monotonic()
        self._tick()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        loop = self._loop
        for sock in [*self._dealers.values(), *([self._router] if self._router else [])]:
            if loop is not None:
                with contextlib.suppress(Exception):
                    loop.remove_reader(sock.FD)
            sock.close(0)
        for end in self.ends:
            if end.up:
                end.down()
                self._on_state(end, False)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def figures(self) -> dict[str, int]:
        """The links' counters summed, with the gauges `links_up` and `link_buffered`."""
        out: Counter[str] = Counter(self.stats)
        for end in self.ends:
            for name, value in end.stats.items():
                out["link_" + name] += value
        out["links"] = len(self.ends)
        out["links_up"] = sum(1 for e in self.ends if e.up)
        out["link_buffered"] = sum(e.buffered for e in self.ends)
        out["link_dropped_buffer_full"] += 0  # shown even while nothing was dropped
        return dict(out)

    # ------------------------------------------------------------- receiving

    def _drain_router(self) -> None:
        router = self._router
        if router is None or self._closed:
            return
        loop = cast(asyncio.AbstractEventLoop, self._loop)
        now = time.monotonic()
        for _ in range(1024):
            try:
                parts = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            if len(parts) != 2:
                self.stats["link_dropped_malformed"] += 1
                continue
            route, frame = parts
            end = self._by_route.get(route)
            if len(frame) > 4 and frame[4] == 1:  # a HELLO: a new session, perhaps a new peer
                self._hello(route, frame, now)
                continue
            if end is None:
                self.stats["link_dropped_no_session"] += 1
                continue
            self._deliver(end, frame, now)
        else:
            loop.call_soon(self._drain_router)
        if _readable(router):
            loop.call_soon(self._drain_router)
        self.flush_soon()

    def _hello(self, route: bytes, frame: bytes, now: float) -> None:
        try:
            hello = open_hello(frame, self._secrets)
        except ProtocolError as exc:
            self.stats["link_dropped_" + exc.reason] += 1
            self._refused(route, "(dialled in)", exc)  # a bad signature is logged
            return
        end = self._by_peer.get(hello.gateway_id)
        new = end is None
        if end is None:
            end = self._by_peer[hello.gateway_id] = self._new_end(dialler=False)
        was_up = end.up
        try:
            welcome = end.accept(hello, now)
        except ProtocolError as exc:
            end.stats["dropped_" + exc.reason] += 1
            described = f"{hello.gateway_id.hex()[:16]} of mesh {hello.mesh!r} (dialled in)"
            self._refused(hello.gateway_id, described, exc)
            if new:  # a gateway refused keeps no end here
                self._forget(end)
                self._by_peer.pop(hello.gateway_id, None)
            return
        self._logged.pop(hello.gateway_id, None)
        old = self._routes.get(id(end))
        if old is not None and old != route:
            self._by_route.pop(old, None)
        self._routes[id(end)] = route
        self._by_route[route] = end
        self._send(end, [welcome])
        if was_up:  # a new session of a link that was up: the peer saw it go down
            self._on_state(end, False)
        self._on_state(end, True)

    def _drain_dealer(self, end: LinkEnd, dealer: zmq.Socket[bytes]) -> None:
        if self._closed:
            return
        loop = cast(asyncio.AbstractEventLoop, self._loop)
        now = time.monotonic()
        for _ in range(1024):
            try:
                frame = dealer.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._deliver(end, frame, now)
        else:
            loop.call_soon(self._drain_dealer, end, dealer)
        if _readable(dealer):
            loop.call_soon(self._drain_dealer, end, dealer)
        self.flush_soon()

    def _deliver(self, end: LinkEnd, frame: bytes, now: float) -> None:
        was_up, buffered = end.up, end.buffered
        try:
            items = end.receive(frame, now)
        except ProtocolError as exc:  # counted by the end
            if end.dialler:
                self._refused(id(end), f"at {self._dialled.get(id(end), '?')} (dialled)", exc)
            return
        if end.up and not was_up:
            self._logged.pop(id(end), None)
            self._on_state(end, True)
        if items or end.buffered < buffered:  # something arrived, or acks made room
            self._on_items(end, items)

    # ------------------------------------------------------------- sending

    def flush_soon(self) -> None:
        if not self._flush_pending and not self._closed and self._loop is not None:
            self._flush_pending = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_pending = False
        if self._closed or self._loop is None:
            return
        now = time.monotonic()
        for end in self.ends:
            frames = end.outgoing(now)
            if frames:
                self._send(end, frames)

    def _send(self, end: LinkEnd, frames: list[bytes]) -> None:
        dealer = self._dealers.get(id(end))
        try:
            if dealer is not None:
                for frame in frames:
                    dealer.send(frame, zmq.NOBLOCK)
            else:
                route = self._routes.get(id(end))
                router = self._router
                if route is None or router is None:
                    return
                for frame in frames:
                    router.send_multipart([route, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            # Full or unroutable: what was reliable is sent again once acks stop progressing.
            self.stats["link_send_failed"] += 1
            end.stats["frames_unsent"] += 1  # plain items in them are lost (tunnels reset)
        # The descriptor is edge-triggered and a send may have taken the edge of what arrived.
        loop = cast(asyncio.AbstractEventLoop, self._loop)
        if dealer is not None:
            if _readable(dealer):
                loop.call_soon(self._drain_dealer, end, dealer)
        elif self._router is not None and _readable(self._router):
            loop.call_soon(self._drain_router)

    def _tick(self) -> None:
        if self._closed or self._loop is None:
            return
        now = time.monotonic()
        interval = self.config.heartbeat / 2
        late = now - self._tick_due
        if late > self.config.heartbeat:
            # This gateway's own loop stalled (a busy process): the far gateways' silence
            # meanwhile is not theirs (what they sent waits unread), as the core does for links.
            self.stats["link_loop_stalls"] += 1
            for end in self.ends:
                end.last_in += late
        self._grant_changed()
        for end in self.ends:
            closed = end.stats["closed_grant"]
            if end.tick(now):
                if end.stats["closed_grant"] != closed:
                    log.warning(
                        "gateway link closed: far gateway %s of mesh %r: its grant no longer "
                        "holds (expired or revoked)",
                        end.peer_id.hex()[:16],
                        end.peer_mesh,
                    )
                self._on_state(end, False)
        forget = self.config.forget_after
        for end in [e for e in self.ends if not e.dialler and not e.up]:
            if end.silent_for(now) >= forget:
                self._forget(end)
        self.flush()
        self._tick_due = now + interval
        self._timer = self._loop.call_later(interval, self._tick)

    def _grant_changed(self) -> None:
        """Where far grants are checked, a far gateway sees this gateway's grant at each
        handshake: once it changes (a grant file reread, `Node.use_grant`), the links this
        gateway dialled handshake again (as after a link key change: counted `rehandshakes`),
        and the far gateways that dialled in and showed their identity are asked to
        (`REHELLO`, counted `rehandshakes_asked`), so a renewed grant is seen before the old
        one expires."""
        if self.far_grants is None or self._grant_token is None:
            return
        token = self._grant_token()
        if token == self._shown_token:
            return
        first = self._shown_token is None
        self._shown_token = token
        if first:
            return
        for end in self.ends:
            if not end.up:
                continue
            if end.dialler and id(end) in self._dealers:
                self.rehandshake(end)
            elif not end.dialler and end.peer_public and end.send_plain([REHELLO]):
                end.stats["rehandshakes_asked"] += 1

    def rehandshake(self, end: LinkEnd) -> None:
        """Say HELLO again on a link this gateway dialled (its own grant changed, or the far
        gateway asked: `REHELLO`), as after a link key change: counted `rehandshakes`."""
        if end.dialler and end.up and id(end) in self._dealers:
            end.down()
            end.stats["rehandshakes"] += 1
            self._on_state(end, False)
            self.flush_soon()

    def _forget(self, end: LinkEnd) -> None:
        end.forget()
        for name, value in end.stats.items():  # its counters stay in the totals
            self.stats["link_" + name] += value
        self.ends.remove(end)
        self._by_peer.pop(end.peer_id, None)
        route = self._routes.pop(id(end), None)
        if route is not None:
            self._by_route.pop(route, None)

    def peers_up(self) -> list[LinkEnd]:
        return [e for e in self.ends if e.up]


def describe(end: LinkEnd) -> dict[str, Any]:
    """One link as `Gateway.links()` and `mesh top` show it."""
    return {
        "peer_mesh": end.peer_mesh,
        "peer_id": end.peer_id.hex(),
        "up": end.up,
        "dialled": end.dialler,
        "buffered": end.buffered,
        "dropped": end.stats["dropped_buffer_full"],
        "imports": list(end.peer_exports.clusters),
        "topics": list(end.peer_exports.topics),
        # The far gateway's identity as it showed it ("" if it did not), and its grant's
        # rights and expiry where this gateway checks far grants (None where it does not).
        "identity": end.peer_public.hex(),
        "grant": None if end.peer_grant is None else end.peer_grant.rights.summary(),
        "grant_expires": None if end.peer_grant is None else end.peer_grant.expires,
    }
