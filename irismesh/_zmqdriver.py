"""`ZmqDriver`: a node's links over zmq (`Node(transport="zmq")`), on the shared `Driver`.

Imported only by a node that runs on zmq: every other node leaves pyzmq unloaded.

Hot path, and why it looks like this: `zmq.asyncio` creates a Future per received message,
which costs more than all the rest of a request. Here each socket is a plain non-blocking
pyzmq socket whose file descriptor is registered with `loop.add_reader`; when it fires, the
driver drains up to `BATCH` messages with NOBLOCK, hands each to the core, then dispatches the
core's events and sends its frames once for the whole batch.

With many requests in flight, each side should work on one batch while the other works on
the next. So a member answers a long run of requests in slices of equal length (`slice_length`),
flushing after each, and a caller reads a dialled link's replies one frame at a time while the
requests they trigger are still to go out (`_dealer_readable`): read together, two batches of
replies would go back as one, and each side would wait while the other worked on the whole
window.

A zmq FD is edge-triggered and also signals after *sends* change the socket's state, so a
wake-up can be consumed by a send: after sending on a socket, and after a batch cut short, the
driver checks `EVENTS` and drains again soon if input is waiting. That is the "no lost
wake-up" rule. One timer (`call_at`) fires when the core next has something to do (a probe,
a deadline, a ping, housekeeping: `MeshCore.next_deadline`); before the core's tick, all sockets
are drained so that what arrived during a stall of this loop counts as heard, not as silence.

Sockets: one ROUTER bound at the node's endpoint (links peers dialled), one DEALER per link
this node dialled, and one UDP socket for membership (`_datagrams`). Each DEALER has a zmq
monitor: when its TCP connection drops (a peer killed by SIGKILL closes its sockets at once)
the link fails within milliseconds, and membership is asked to probe the peer; a link cannot
survive zmq's silent reconnect anyway (the peer would see a new connection with no handshake).
A connect that fails is no error to a DEALER, which retries it quietly: the monitor's
EVENT_CONNECT_RETRIED is the only sign, and the link fails on it as "refused", as the TCP
links' do on ECONNREFUSED (the core then knows a dropped member gone, see `MeshCore`). zmq does
not say why the connect failed: one that fails this soon was refused, or the network answered
that the host is unreachable; a connect that gets no answer retries only after the kernel gives
up, long after the handshake's timeout. What TCP does not show (a stopped process, a silent
network) membership's probes find.
Replies go out with ROUTER_MANDATORY so an unroutable reply is an error we count, not a silent
drop. Send queues are unbounded in zmq; the core bounds them by its limits on requests in
flight.

This module is compiled by mypyc together with the core (see setup.py and irismesh._core),
so its attributes are typed slots and its calls into the core are native; it runs as Python
wherever the core does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.backend

from irismesh._core.engine import MeshCore
from irismesh._core.events import Event, OpenLink
from irismesh._datagrams import DatagramSocket
from irismesh._driver import BATCH, Driver
from irismesh.errors import ConfigurationError

_monotonic = time.monotonic  # bound once: the clock is read for every frame

# Plain ints: zmq's constants are IntFlag enums, and `NOBLOCK | SNDMORE` on enums costs an enum
# construction per frame on the hot path.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_CONNECT_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)
LINK_LINGER_MS = 100  # a closed link's last frames (its BYE) get this long to leave
# pyzmq's own `send` (its extension's), called with the socket: the `zmq.Socket.send` every
# socket has wraps it in Python for options frames of bytes never use, at a third of a send.
_send_frame: Callable[..., Any] = zmq.backend.Socket.send


def _readable(sock: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, sock.get(_EVENTS)) & _POLLIN)


def _configure(sock: zmq.Socket[bytes], max_frame: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame + 64)  # refuse oversize before allocating it
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)


def listen(
    ctx: zmq.Context[zmq.Socket[bytes]], bind: str, max_frame: int, *, term: bool = True
) -> tuple[zmq.Socket[bytes], str]:
    """The node's listening ROUTER socket, bound at `bind`, and the endpoint it got; when it
    cannot bind, ConfigurationError (and `ctx` is terminated, if `term`: not one shared with
    other nodes)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.setsockopt(zmq.MAXMSGSIZE, max_frame + 64)
    # A connection that has not finished zmq's greeting in 2 s is closed (zmq's default: 30 s),
    # as a TCP link's stranger is (`CoreConfig.hello_timeout`).
    router.setsockopt(zmq.HANDSHAKE_IVL, 2000)
    try:
        router.bind(bind)
    except zmq.ZMQError as exc:
        router.close(0)
        if term:
            ctx.term()
        raise ConfigurationError(f"cannot listen on {bind}: {exc}") from None
    return router, router.get_string(zmq.LAST_ENDPOINT)


class ZmqDriver(Driver):
    """Links over zmq: a ROUTER for the links peers dialled, a DEALER per link dialled."""

    def __init__(
        self,
        core: MeshCore,
        context: zmq.Context[zmq.Socket[bytes]],
        router: zmq.Socket[bytes],
        loop: asyncio.AbstractEventLoop,
        on_events: Callable[[list[Event]], None],
        datagrams: DatagramSocket,
    ) -> None:
        super().__init__(core, loop, on_events, datagrams)
        self._ctx = context
        self._router = router
        self._dealers: dict[int, zmq.Socket[bytes]] = {}
        self._monitors: dict[int, zmq.Socket[bytes]] = {}
        self._recheck: set[int] = set()  # link ids (0: the router) to re-check for input
        self._polled_route = b""  # busy polling: the routing id of the request caught
        loop.add_reader(router.FD, self._drain_router)

    # ----------------------------------------------------------------- input

    def _drain_router(self, woken: bool = True) -> None:
        """Read the listening socket: the loop's reader callback (`woken`), or a look for
        input queued after a flush, or the timer's (not `woken`: read in one batch)."""
        router = self._router
        receive = self.core.receive_in
        now = _monotonic()
        recv = router.recv
        more = router.get
        got = 0
        for _ in range(BATCH):
            try:
                routing_id = recv(_NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            # A ROUTER message is [routing id, frame] (zmq guarantees the frame). More parts
            # would let a peer smuggle a routing id into the next message: drop them.
            frame = recv(_NOBLOCK)
            if more(_RCVMORE):
                while more(_RCVMORE):
                    recv(_NOBLOCK)
                self.core.stats["dropped_multipart"] += 1
                continue
            got += 1
            receive(routing_id, frame, now)
            if woken:
                # The first frame of a wake-up is answered before asking for more: at one
                # request in flight nothing else waits, and the reply goes out one `EVENTS`
                # query sooner. Whether more came is asked once, after the reply went out
                # (`_send`'s look, which a send needs anyway); what waits is read then, in
                # one batch (a busy node reads there, not in this callback).
                self._recheck.add(0)
                break
            if not cast(int, more(_EVENTS)) & _POLLIN:
                break  # read out: asking costs a third of the failing read it saves
        else:
            self._recheck.add(0)  # batch cut short: come back after others had a turn
        if got:
            if self._served_at:
                self._request_came()
            self.process()
            if self.partners:
                self._flush_partners()
            if self.busy_poll:
                self._spin_router()

    def _spin_router(self) -> None:
        """After serving: poll the listening socket for the next request (opt-in)."""
        self._recheck.add(0)  # what came after the spin: the pass it queues looks at once
        self._spin_for_requests(self._poll_router, self._take_polled)

    def _poll_router(self, until: float) -> bool:
        router, clock = self._router, time.perf_counter
        while clock() < until:
            try:
                self._polled_route = router.recv(_NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return False
            return True
        return False

    def _take_polled(self) -> None:
        router = self._router
        frame = router.recv(_NOBLOCK)
        if router.get(_RCVMORE):
            while router.get(_RCVMORE):
                router.recv(_NOBLOCK)
            self.core.stats["dropped_multipart"] += 1
            return
        self.core.receive_in(self._polled_route, frame, _monotonic())

    def spin(self, link_id: int, seconds: float, done: Callable[[], bool]) -> None:
        """Poll one dialled link for up to `seconds` until `done()`, not yielding (opt-in)."""
        sock = self._dealers.get(link_id)
        if sock is None:
            return
        recv, receive, clock = sock.recv, self.core.receive_out, time.perf_counter
        until = clock() + seconds
        while clock() < until:
            try:
                frame = recv(_NOBLOCK)
            except zmq.Again:
                continue
            receive(link_id, frame, _monotonic())
            self.process()
            if done():
                break
        self._recheck.add(link_id)  # what arrived after: the loop's next turn reads it
        self.flush_soon()

    def _dealer_readable(self, link_id: int) -> None:
        """A dialled link's socket signalled (the loop's reader callback).

        While a flush is queued, it goes first: replies just read woke the tasks that awaited
        them, and the requests those make go out in that flush; reading more replies before it
        would merge two batches into one, and then each side waits while the other works on
        the whole window. So the link is read after the flush (`_recheck_input`), and two
        batches stay in flight, one worked on at each end."""
        if self.flush_pending:
            self._recheck.add(link_id)
            return
        self._drain_dealer(link_id)

    def _drain_dealer(self, link_id: int) -> None:
        sock = self._dealers.get(link_id)
        if sock is None:
            return
        receive = self.core.receive_out
        recv = sock.recv
        events = sock.get
        pending = self.core.calls.pending
        now = _monotonic()
        got = 0
        for _ in range(BATCH):
            try:
                frame = recv(_NOBLOCK)
            except zmq.Again:
                break
            # No RCVMORE check (it costs as much as the recv): on a dialled link every part is
            # judged as a frame of its own, so a peer gains nothing by sending several parts.
            got += 1
            waiting = len(pending)
            receive(link_id, frame, now)
            if len(pending) < waiting:
                # Replies woke their callers: the requests those make next go out before more
                # replies are read (see `_dealer_readable`); whether more came is asked after
                # that flush, once (`_recheck_input`), not here on the way to the callers.
                self._recheck.add(link_id)
                break
            if not cast(int, events(_EVENTS)) & _POLLIN:
                break  # read out: asking costs a third of the failing read it saves
        else:
            self._recheck.add(link_id)
        if got:
            # Replies woke the tasks that awaited them, and those are queued on the loop now:
            # a flush queued behind them sends the requests they make next in the same turn of
            # the loop, together (`Caller` stages a request while this is pending), and
            # handles whatever else the frames brought (a reply reaches its caller without an
            # event: `Calls.reply_sink`). That flush also asks whether more input came.
            self._dialled_link_read()

    def drain_all(self) -> None:
        """Read the zmq sockets that have input waiting (their FDs are edge-triggered: a
        wake-up may have been consumed). The datagram socket needs no look: asyncio runs the
        callbacks of readable sockets before the timers due in the same turn of the loop."""
        if _readable(self._router):
            self._drain_router(False)
        for link_id, sock in list(self._dealers.items()):
            if _readable(sock):
                self._drain_dealer(link_id)

    # ----------------------------------------------------------------- output

    def _send(self) -> None:
        core = self.core
        self._seal_and_send_datagrams()
        recheck = self._recheck
        if core.out_frames:
            frames = core.out_frames
            core.out_frames = []
            dealers = self._dealers
            for link_id, frame in frames:
                sock = dealers.get(link_id)
                if sock is None:  # the link closed meanwhile; the core has already moved on
                    core.stats["frames_for_closed_links"] += 1
                    continue
                try:
                    _send_frame(sock, frame, _NOBLOCK)
                except zmq.Again:
                    core.link_failed(link_id, _monotonic(), "unsendable")
                recheck.add(link_id)
        if core.in_frames:
            frames2 = core.in_frames
            core.in_frames = []
            router = self._router
            for routing_id, frame in frames2:
                try:
                    _send_frame(router, routing_id, _SNDMORE_NOBLOCK)
                    _send_frame(router, frame, _NOBLOCK)
                except zmq.ZMQError:  # EHOSTUNREACH: the caller left; it resends if it returns
                    core.stats["replies_unroutable"] += 1
            recheck.add(0)
        if recheck and not self.flush_pending:
            # A send may have taken the wake-up of input that came meanwhile. Look now: once
            # EVENTS has been read, the next arrival wakes the loop again, so only a socket with
            # input waiting needs another pass (at one request in flight, none does).
            dealers = self._dealers
            for link_id in recheck:
                sock = self._router if link_id == 0 else dealers.get(link_id)
                if sock is not None and cast(int, sock.get(_EVENTS)) & _POLLIN:
                    self.flush_pending = True
                    self.loop.call_soon(self._recheck_input)
                    return
            recheck.clear()

    def _recheck_input(self) -> None:
        if self._closed:
            self.flush_pending = False
            return
        # The flush first, with `flush_pending` still set: `_send` leaves the look for input
        # to the loop below, which asks each socket once, after everything went out.
        self.process()
        self.flush_pending = False
        ids = self._recheck
        self._recheck = set()
        for link_id in ids:
            if link_id == 0:
                if _readable(self._router):
                    self._drain_router(False)
            else:
                sock = self._dealers.get(link_id)
                if sock is not None and _readable(sock):
                    self._drain_dealer(link_id)

    # ----------------------------------------------------------------- links

    def _open(self, event: OpenLink) -> None:
        try:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        except zmq.ZMQError:  # out of sockets or descriptors: this dial fails, nothing else
            self.core.stats["dials_no_socket"] += 1
            self.core.link_failed(event.link_id, _monotonic(), "no_socket")
            return
        _configure(sock, self._max_frame)
        # The monitor before the connect: a refusal on loopback comes at once, and an event
        # from before the monitor is lost (the next try's comes RECONNECT_IVL later).
        monitor: zmq.Socket[bytes] | None = None
        try:
            monitor = sock.get_monitor_socket(_DISCONNECTED | _CONNECT_RETRIED)
        except zmq.ZMQError:  # no socket left for the monitor: heartbeats still watch the link
            self.core.stats["monitors_unavailable"] += 1
        try:
            sock.connect(event.endpoint)
        except zmq.ZMQError:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(0)
            sock.close(0)
            self.core.link_failed(event.link_id, _monotonic(), "bad_endpoint")
            return
        self._dealers[event.link_id] = sock
        self.loop.add_reader(sock.FD, self._dealer_readable, event.link_id)
        if monitor is None:
            return
        self._monitors[event.link_id] = monitor
        self.loop.add_reader(monitor.FD, self._drain_monitor, event.link_id)
        # zmq signals a socket's FD only once a read has found it empty: read once now, or the
        # first event would never wake us.
        self._drain_monitor(event.link_id)

    def _drain_monitor(self, link_id: int) -> None:
        monitor = self._monitors.get(link_id)
        if monitor is None:
            return
        disconnected = retried = False
        while True:
            try:
                parts = monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            if parts and len(parts[0]) >= 2:
                kind = int.from_bytes(parts[0][:2], "little")
                disconnected |= kind == _DISCONNECTED
                retried |= kind == _CONNECT_RETRIED
        if disconnected:
            self.core.link_failed(link_id, _monotonic(), "disconnected")
            self.process()
        elif retried:  # the connect failed (see the module's docstring)
            self.core.stats["dials_unconnected"] += 1
            self.core.link_failed(link_id, _monotonic(), "refused")
            self.process()

    def _close_link(self, link_id: int) -> None:
        monitor = self._monitors.pop(link_id, None)
        sock = self._dealers.pop(link_id, None)
        if monitor is not None:
            self.loop.remove_reader(monitor.FD)
            if sock is not None:
                # Stop the monitor before closing its socket: closing a monitored socket and
                # its monitor without this left the context unable to accept new peers.
                sock.disable_monitor()
            monitor.close(0)
        if sock is not None:
            self.loop.remove_reader(sock.FD)
            sock.close(LINK_LINGER_MS)

    # ----------------------------------------------------------------- time

    def close(self, linger_ms: int = 200) -> None:
        """Flush goodbyes (given `linger_ms` to leave) and close every socket."""
        if self._closed:
            return
        self.process()
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self.loop.remove_reader(self._router.FD)
        for link_id, monitor in self._monitors.items():
            self.loop.remove_reader(monitor.FD)
            dealer = self._dealers.get(link_id)
            if dealer is not None:
                dealer.disable_monitor()
            monitor.close(0)
        self._monitors.clear()
        for sock in self._dealers.values():
            self.loop.remove_reader(sock.FD)
            sock.close(linger_ms)
        self._dealers.clear()
        self._router.close(linger_ms)
        self._datagrams.close()
