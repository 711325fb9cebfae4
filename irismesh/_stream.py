"""Links over the event loop's own TCP: irismesh's framing, no zmq and no I/O thread.

Over zmq, each message crosses from the event loop's thread to zmq's I/O thread and back on
each side of a link: four thread hand-offs per round trip, each a wake-up. Here the event loop
reads and writes the TCP connections itself (uvloop's transports, in C, where it runs), so a
request is one system call out and one wake-up in on each side (`bench/tcp_floor.py` measures
what that leaves out: about 0.6x raw pyzmq's p50 for a plain echo).

Framing: each frame goes as its length (4 bytes, big-endian) and the frame. A frame longer than
the node's largest frame allows is refused from its length, before anything of it is buffered:
counted (`dropped_stream_oversize`) and the connection closed, as zmq's MAXMSGSIZE does; there
is no finding the next frame after one refused.

- **Links peers dialled**: the node listens on one TCP socket; each connection accepted gets a
  routing id of its own (as a zmq ROUTER names its peers), the name the core keeps its inbound
  link under; until its HELLO proves the mesh key it is a *stranger* (see below). When the
  connection closes the core forgets that link at once (`MeshCore.inbound_closed`; a ROUTER
  never tells). A reply to a connection that is gone is counted (`replies_unroutable`), the
  way ROUTER_MANDATORY's error is.
- **Links this node dialled**: one connection per link. What the core sends before the
  connection is up waits, in order, and goes out once it is. A dial refused or failed, and a
  connection that drops, fail the link at once (`MeshCore.link_failed`): the link never
  reconnects on its own (a new connection needs a new handshake), and membership is asked to
  probe the peer. What TCP does not show, a stopped process or a silent network, membership's
  probes and the handshake's timeout find.

Strangers cost little and not for long. A dialler sends its HELLO alone and waits for the
answer, so a stranger's first frame must be a HELLO that proves the key (the core then knows
its link: `MeshCore.knows_inbound`), or the connection is closed
(`dropped_stranger_unproven`). Until then it may send no frame longer than `HELLO_LIMIT` (a
longer length closes it at once: `dropped_stranger_oversize`), and it has
`CoreConfig.hello_timeout` to do so (`dropped_stranger_timeout`). At most `max_strangers` are
open at once, `max_strangers_per_address` from one address: past either, the oldest is closed
(`dropped_stranger_evicted`), so the room goes to the newest connection, and a peer with the
key, which proves itself at once, gets in however many are held. Accepting is the driver's own
(a reader on the listening socket): out of descriptors, it closes the oldest stranger and tries
again (`accept_out_of_descriptors`, a warning at most every ten seconds), or pauses a moment
when there is none. Each `dropped_stranger_*` is a drop in the telemetry too.

What the loop reads is cut into frames at once and waits in the connection's queue; the driver
takes frames from that queue the way the zmq driver reads its sockets (a caller's replies one
at a time while the requests they wake are still to go out, a member's requests in batches), so
the two sides still work on alternate batches when many requests are in flight. Send buffers
are unbounded, as zmq's are with SNDHWM 0: the core bounds them by its limits on requests in
flight. Busy polling (opt-in) reads a duplicate of the connection's descriptor without
yielding to the loop.

This module is compiled by mypyc with the core and `irismesh._driver` (see setup.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from irismesh._core.engine import MeshCore
from irismesh._core.events import Event, OpenLink
from irismesh._datagrams import DatagramSocket, join_address
from irismesh._driver import BATCH, Driver
from irismesh.errors import ConfigurationError

_monotonic = time.monotonic  # bound once: the clock is read for every frame

_LENGTH = 4  # bytes of the length before each frame
_SLACK = 64  # what a frame may exceed the core's largest frame by (as zmq's MAXMSGSIZE here)
_JOIN_BELOW = 65536  # a shorter frame goes out joined to its length, a longer one beside it
_READ = 262144  # bytes one read of a busy poll takes at most
_BACKLOG = 1024
# The largest frame a stranger (a connection accepted that has not proven the mesh key) may
# send: a HELLO. The largest irismesh sends, with every field at its limit (a 256-character
# endpoint and address, 1 KiB of tags, a 64-character name, its identity and signatures), is
# 2,161 bytes (tests/integration/test_strangers.py builds it): room three times over.
HELLO_LIMIT = 8192
_ACCEPTS = 64  # connections accepted in one turn of the loop, at most
_OUT_OF_DESCRIPTORS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_ACCEPT_PAUSE = 0.5  # out of descriptors with no stranger to close: accept again after this
_LOG_EVERY = 10.0  # seconds between two warnings of running out of descriptors
# The strangers' deadline came this late: the loop stalled, and a HELLO that came meanwhile may
# be waiting to be read (uvloop runs due timers before it reads): it is read first.
_STALLED = 0.25
_log = logging.getLogger(__name__)
# A `Connection` is the loop's protocol object, though no subclass of asyncio.Protocol (a class
# compiled by mypyc cannot extend one): the loop only calls its methods.
_Factory = Callable[[], asyncio.Protocol]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) of "tcp://host:port" ("*" for a host: every interface; "*" or 0 for a
    port: any free one); ValueError when it is no such endpoint."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp:// endpoint: {endpoint!r}")
    host, sep, port = endpoint[6:].rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ValueError(f"no host and port in {endpoint!r}")
    try:
        number = 0 if port == "*" else int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ValueError(f"no such port: {port!r}")
    return ("0.0.0.0" if host == "*" else host), number


def listen(bind: str) -> tuple[socket.socket, str]:
    """A listening, non-blocking TCP socket at `bind` and the endpoint it got (its port filled
    in); ConfigurationError when it cannot be had."""
    try:
        host, port = split_endpoint(bind)
    except ValueError as exc:
        raise ConfigurationError(f"cannot listen on {bind}: {exc}") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"cannot listen on {bind}: {exc}") from None
    return sock, "tcp://" + join_address(host, int(sock.getsockname()[1]))


def framed(frame: bytes) -> bytes:
    """`frame` as it goes on the wire: its length, then itself."""
    return len(frame).to_bytes(_LENGTH, "big") + frame


class Framer:
    """Cuts a byte stream into frames, `frames`, as it arrives; stops reading for good at a
    length beyond `limit` (`oversize`), before buffering anything of that frame."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.frames: deque[bytes] = deque()
        self.partial = bytearray()  # the start of a frame still arriving
        self.oversize = False

    def take(self, data: bytes) -> bool:
        """Cut what was read into frames, queued in `frames`; whether any came whole."""
        if self.oversize:
            return False
        limit = self.limit
        partial = self.partial
        if partial:
            partial += data
            if len(partial) < _LENGTH:
                return False
            size = int.from_bytes(partial[:_LENGTH], "big")
            if size > limit:
                self._refuse()
                return False
            if len(partial) < _LENGTH + size:
                return False
            data = bytes(partial)
            self.partial = bytearray()
        frames = self.frames
        queued = len(frames)
        pos = 0
        end = len(data)
        while end - pos >= _LENGTH:
            size = int.from_bytes(data[pos : pos + _LENGTH], "big")
            if size > limit:
                self._refuse()  # the frames before it still count
                return len(frames) > queued
            stop = pos + _LENGTH + size
            if stop > end:
                break
            frames.append(data[pos + _LENGTH : stop])
            pos = stop
        if pos < end:
            self.partial = bytearray(data[pos:])
        return len(frames) > queued

    def _refuse(self) -> None:
        self.oversize = True
        self.partial = bytearray()


class Connection:
    """One TCP connection of a link: the loop's protocol object for it, the frames read from it
    and not yet taken, and what waits to be written until it is up."""

    def __init__(self, driver: StreamDriver, link_id: int, routing_id: bytes) -> None:
        self.driver = driver
        self.link_id = link_id  # the dialled link's id; 0 for a connection a peer dialled
        self.routing_id = routing_id  # a connection a peer dialled: its name to the core
        # A connection a peer dialled is a stranger until its HELLO proves the mesh key: only
        # a frame a HELLO fits in is read from it meanwhile.
        self.stranger = link_id == 0
        self.source = ""  # a stranger's address (its host), which its share is counted under
        self.framer = Framer(HELLO_LIMIT if link_id == 0 else driver.frame_limit)
        self.frames = self.framer.frames  # read and not yet taken by the driver
        self.transport: Any = None  # set once up (uvloop's transports are no asyncio.Transport)
        self.unsent: list[bytes] = []  # written before the connection was up
        self.closed = False
        self.connecting: asyncio.Task[None] | None = None
        self.raw: socket.socket | None = None  # a duplicate of its descriptor, to busy-poll

    # ----------------------------------------------------------------- the loop's protocol

    def connection_made(self, transport: Any) -> None:
        driver = self.driver
        if self.closed or driver._closed:
            transport.close()
            return
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.link_id == 0:
            driver.accepted(self)
        elif self.unsent:
            transport.write(b"".join(self.unsent))
            self.unsent = []

    def data_received(self, data: bytes) -> None:
        framer = self.framer
        if framer.take(data):
            self.driver.readable(self)
        if framer.oversize:
            self.refuse()

    def eof_received(self) -> bool:
        return False  # the transport closes, and connection_lost says so

    def connection_lost(self, exc: BaseException | None) -> None:
        was_closed = self.closed
        self.closed = True
        self.close_raw()
        self.driver.lost(self, was_closed)

    def pause_writing(self) -> None:
        """Unbounded, as zmq's queues are: the core bounds what is in flight."""

    def resume_writing(self) -> None:
        """See `pause_writing`."""

    # ----------------------------------------------------------------- frames

    def refuse(self) -> None:
        """A frame too long came: count it and drop the connection (once)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            stats = self.driver.core.stats
            if self.stranger:  # longer than any HELLO, before the key was proven
                stats["dropped_stranger_oversize"] += 1
            else:
                stats["dropped_stream_oversize"] += 1
            transport.abort()  # connection_lost follows

    def write(self, frame: bytes) -> None:
        size = len(frame)
        transport = self.transport
        if transport is None:
            self.unsent.append(framed(frame))
        elif size < _JOIN_BELOW:
            transport.write(size.to_bytes(_LENGTH, "big") + frame)
        else:
            transport.writelines((size.to_bytes(_LENGTH, "big"), frame))

    def raw_socket(self) -> socket.socket | None:
        """A duplicate of the connection's descriptor, to read without the loop (busy polling;
        closed with the connection: a duplicate left open would keep the connection open)."""
        if self.raw is None and self.transport is not None and not self.closed:
            sock = self.transport.get_extra_info("socket")
            if sock is None:
                return None
            raw = socket.socket(fileno=os.dup(sock.fileno()))
            raw.setblocking(False)
            self.raw = raw
        return self.raw

    def close_raw(self) -> None:
        raw, self.raw = self.raw, None
        if raw is not None:
            raw.close()

    def close(self) -> None:
        self.closed = True
        self.frames.clear()
        self.unsent = []
        self.close_raw()
        if self.connecting is not None:
            self.connecting.cancel()
        if self.transport is not None:
            self.transport.close()  # what was written still goes out


class StreamDriver(Driver):
    """Links over TCP connections the event loop reads and writes itself."""

    def __init__(
        self,
        core: MeshCore,
        listener: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_events: Callable[[list[Event]], None],
        datagrams: DatagramSocket,
    ) -> None:
        super().__init__(core, loop, on_events, datagrams)
        self.frame_limit = self._max_frame + _SLACK
        self._listener = listener
        self._out: dict[int, Connection] = {}  # link id -> the connection this node dialled
        self._in: dict[bytes, Connection] = {}  # routing id -> a connection a peer dialled
        self._routes = 0  # routing ids given so far
        self._recheck: set[Connection] = set()  # connections to take more frames from
        self._closing: set[Connection] = set()  # closed by this node, still open (`close`)
        self._all_closed: asyncio.Event | None = None
        config = core.config
        self._hello_timeout = config.hello_timeout
        self._max_strangers = config.max_strangers
        self._max_per_address = config.max_strangers_per_address
        # Connections accepted that have not proven the mesh key, oldest first: when each was.
        self._strangers: dict[Connection, float] = {}
        self._strangers_from: dict[str, int] = {}  # address -> its strangers
        self._stranger_timer: asyncio.TimerHandle | None = None
        self._stranger_timer_at = 0.0  # when it is due
        self._accepting = False
        self._starved_since_log = 0  # accepts without a descriptor since the last warning
        self._starved_logged_at = float("-inf")

    # ----------------------------------------------------------------- accepting

    async def serve(self) -> None:
        """Accept connections: a reader on the listening socket (not the loop's server, whose
        accept logs a traceback each time it runs out of descriptors, and then cannot make
        room; here a stranger's descriptor makes room, see `_starved`)."""
        self._resume_accepting()

    def _resume_accepting(self) -> None:
        if not self._accepting and not self._closed:
            self._accepting = True
            self.loop.add_reader(self._listener.fileno(), self._accept_ready)

    def _pause_accepting(self) -> None:
        if self._accepting:
            self._accepting = False
            self.loop.remove_reader(self._listener.fileno())

    def _accept_ready(self) -> None:
        listener = self._listener
        for _ in range(_ACCEPTS):
            try:
                sock, _address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._starved()
                    return
                # The peer gave up before its turn (ECONNABORTED), or worse: the next one.
                self.core.stats["accept_failed"] += 1
                continue
            self._routes += 1
            conn = Connection(self, 0, self._routes.to_bytes(5, "big"))
            conn.connecting = self.loop.create_task(self._adopt(conn, sock))

    async def _adopt(self, conn: Connection, sock: socket.socket) -> None:
        """Make an accepted socket the loop's transport, `conn` its protocol."""
        try:
            sock.setblocking(False)
            await self.loop.connect_accepted_socket(cast(_Factory, lambda: conn), sock)
        except OSError:  # reset before it was adopted
            sock.close()
            self.core.stats["accept_failed"] += 1
        except asyncio.CancelledError:  # the loop is closing
            sock.close()
            raise
        finally:
            conn.connecting = None

    def _starved(self) -> None:
        """Accept found no descriptor free (this process's limit, or the system's).

        The oldest stranger is closed to make room, and accepting goes on once it is gone: a
        peer with the key still gets in while strangers hold descriptors. With no stranger to
        close, accepting pauses a moment; the peers waiting meanwhile stay in the backlog.
        Counted each time, logged at most once per `_LOG_EVERY` seconds."""
        stats = self.core.stats
        stats["accept_out_of_descriptors"] += 1
        self._starved_since_log += 1
        now = _monotonic()
        if now - self._starved_logged_at >= _LOG_EVERY:
            _log.warning(
                "out of file descriptors accepting links (%d times since the last warning): "
                "closing the oldest of %d connections that have not proven the mesh key",
                self._starved_since_log,
                len(self._strangers),
            )
            self._starved_logged_at = now
            self._starved_since_log = 0
        self._pause_accepting()
        if self._strangers:
            stats["dropped_stranger_evicted"] += 1
            self._drop_stranger(next(iter(self._strangers)))
            # Its descriptor is released as the loop closes it, this turn or the next: then
            # accept again (a callback queued now runs after the close the loop queued).
            self.loop.call_soon(self._resume_accepting)
        else:
            self.loop.call_later(_ACCEPT_PAUSE, self._resume_accepting)

    def accepted(self, conn: Connection) -> None:
        self._in[conn.routing_id] = conn
        peer = conn.transport.get_extra_info("peername")
        conn.source = str(peer[0]) if peer else ""
        self._admit_stranger(conn)

    # ----------------------------------------------------------------- strangers

    def _admit_stranger(self, conn: Connection) -> None:
        """Count a new connection among the strangers, closing the oldest past a bound (of
        its address, then of all): a stranger's room goes to the newest, so a peer with the
        key gets in however many idle connections are held, and proves itself at once."""
        stats = self.core.stats
        strangers, counts, source = self._strangers, self._strangers_from, conn.source
        if counts.get(source, 0) >= self._max_per_address:
            oldest = next(c for c in strangers if c.source == source)
            stats["dropped_stranger_evicted"] += 1
            self._drop_stranger(oldest)
        if len(strangers) >= self._max_strangers:
            stats["dropped_stranger_evicted"] += 1
            self._drop_stranger(next(iter(strangers)))
        now = _monotonic()
        strangers[conn] = now
        counts[source] = counts.get(source, 0) + 1
        stats["strangers_connected"] = len(strangers)
        if self._stranger_timer is None:
            self._strangers_due_at(now + self._hello_timeout)

    def _forget_stranger(self, conn: Connection) -> None:
        """`conn` is no stranger to count any more (proven, or closed)."""
        if self._strangers.pop(conn, None) is None:
            return
        counts = self._strangers_from
        left = counts[conn.source] - 1
        if left:
            counts[conn.source] = left
        else:
            del counts[conn.source]
        self.core.stats["strangers_connected"] = len(self._strangers)

    def _drop_stranger(self, conn: Connection) -> None:
        """Close a stranger at once (what it sent is dropped, nothing is said to it)."""
        self._forget_stranger(conn)
        conn.frames.clear()
        transport = conn.transport
        if transport is not None and not transport.is_closing():
            transport.abort()  # connection_lost follows, and forgets it

    def _strangers_due_at(self, when: float) -> None:
        self._stranger_timer_at = when
        self._stranger_timer = self.loop.call_at(when, self._strangers_due)

    def _strangers_due(self) -> None:
        """Close the strangers whose time to prove the key is up; wait for the next one."""
        self._stranger_timer = None
        if self._closed:
            return
        now = _monotonic()
        if now - self._stranger_timer_at > _STALLED:
            self._strangers_due_at(now + 0.05)  # after the loop has read what waits
            return
        timeout = self._hello_timeout
        strangers = self._strangers
        while strangers:
            conn, since = next(iter(strangers.items()))
            if now < since + timeout:
                self._strangers_due_at(since + timeout)
                return
            self.core.stats["dropped_stranger_timeout"] += 1
            self._drop_stranger(conn)

    def _judge(self, conn: Connection) -> None:
        """A stranger's first frames were read: whether they proved the mesh key. A dialler
        sends its HELLO alone and waits for the answer, so one that did not is closed (what
        the core answered, a REFUSE, still goes out first)."""
        self._forget_stranger(conn)
        if self.core.knows_inbound(conn.routing_id):
            conn.stranger = False
            conn.framer.limit = self.frame_limit
            return
        self.core.stats["dropped_stranger_unproven"] += 1
        self._recheck.discard(conn)
        if self._in.get(conn.routing_id) is conn:
            del self._in[conn.routing_id]
        conn.close()

    def lost(self, conn: Connection, closed_here: bool) -> None:
        """A connection closed (`closed_here`: this node closed it, and it is gone now)."""
        if conn.stranger:
            self._forget_stranger(conn)
        if closed_here:
            closing = self._closing
            closing.discard(conn)
            if not closing and self._all_closed is not None:
                self._all_closed.set()
            return
        if conn.link_id == 0:
            if self._in.get(conn.routing_id) is conn:
                del self._in[conn.routing_id]
                if not self._closed:
                    self.core.inbound_closed(conn.routing_id)
                    self.process()
            return
        if self._out.get(conn.link_id) is conn and not self._closed:
            del self._out[conn.link_id]
            self.core.link_failed(conn.link_id, _monotonic(), "disconnected")
            self.process()

    # ----------------------------------------------------------------- input

    def readable(self, conn: Connection) -> None:
        """Frames came whole on `conn` (called as the loop reads it)."""
        if conn.link_id == 0:
            self._drain_in(conn)
        elif self.flush_pending:
            # Replies just read woke the tasks that awaited them, and the requests those make
            # go out in the queued flush: taking more replies before it would merge two batches
            # into one, and then each side waits while the other works on the whole window.
            self._recheck.add(conn)
        else:
            self._drain_out(conn)

    def _drain_in(self, conn: Connection) -> None:
        frames = conn.frames
        receive = self.core.receive_in
        routing_id = conn.routing_id
        now = _monotonic()
        got = 0
        while frames:
            if got == BATCH:  # come back after others had a turn
                self._recheck.add(conn)
                break
            receive(routing_id, frames.popleft(), now)
            got += 1
        if got:
            if self._served_at:
                self._request_came()
            self.process()
            if conn.stranger:
                self._judge(conn)
                if conn.closed:
                    return
            if self.partners:
                self._flush_partners()
            if self.busy_poll:
                self._spin_in(conn)

    def _drain_out(self, conn: Connection) -> None:
        frames = conn.frames
        receive = self.core.receive_out
        link_id = conn.link_id
        pending = self.core.calls.pending
        now = _monotonic()
        got = 0
        while frames and not conn.closed:
            if got == BATCH:
                self._recheck.add(conn)
                break
            got += 1
            waiting = len(pending)
            receive(link_id, frames.popleft(), now)
            if len(pending) < waiting:
                # Replies woke their callers: the requests those make next go out before more
                # replies are taken (see `readable`), in the flush queued below.
                if frames:
                    self._recheck.add(conn)
                break
        if got:
            self._dialled_link_read()

    def drain_all(self) -> None:
        """Take every frame read and not yet taken (before the core's tick)."""
        for conn in list(self._in.values()):
            if conn.frames:
                self._drain_in(conn)
        for conn in list(self._out.values()):
            if conn.frames:
                self._drain_out(conn)

    def _recheck_input(self) -> None:
        if self._closed:
            self.flush_pending = False
            return
        self.process()
        self.flush_pending = False
        conns = self._recheck
        if not conns:
            return
        self._recheck = set()
        for conn in conns:
            if conn.frames and not conn.closed:
                if conn.link_id == 0:
                    self._drain_in(conn)
                else:
                    self._drain_out(conn)

    # ----------------------------------------------------------------- output

    def _send(self) -> None:
        core = self.core
        self._seal_and_send_datagrams()
        if core.out_frames:
            frames = core.out_frames
            core.out_frames = []
            out = self._out
            for link_id, frame in frames:
                conn = out.get(link_id)
                if conn is None:  # the link closed meanwhile; the core has already moved on
                    core.stats["frames_for_closed_links"] += 1
                    continue
                conn.write(frame)
        if core.in_frames:
            frames2 = core.in_frames
            core.in_frames = []
            routes = self._in
            for routing_id, frame in frames2:
                conn2 = routes.get(routing_id)
                if conn2 is None or conn2.closed:  # the caller left; it resends if it returns
                    core.stats["replies_unroutable"] += 1
                    continue
                conn2.write(frame)

    # ----------------------------------------------------------------- links

    def _open(self, event: OpenLink) -> None:
        try:
            host, port = split_endpoint(event.endpoint)
        except ValueError:
            self.core.link_failed(event.link_id, _monotonic(), "bad_endpoint")
            return
        conn = Connection(self, event.link_id, b"")
        self._out[event.link_id] = conn
        conn.connecting = self.loop.create_task(self._connect(conn, host, port))

    async def _connect(self, conn: Connection, host: str, port: int) -> None:
        try:
            await self.loop.create_connection(cast(_Factory, lambda: conn), host, port)
        except Exception as exc:  # refused, unreachable, a name that does not resolve
            if self._out.get(conn.link_id) is conn and not self._closed:
                del self._out[conn.link_id]
                conn.closed = True
                self.core.stats["dials_unconnected"] += 1
                reason = "refused" if isinstance(exc, ConnectionRefusedError) else "unreachable"
                self.core.link_failed(conn.link_id, _monotonic(), reason)
                self.process()
        finally:
            conn.connecting = None

    async def wait_closed(self, timeout: float) -> None:
        """Wait up to `timeout` for the connections `close` closed to be gone (what they
        still had to send sent), and the loop to have turned meanwhile."""
        if not self._closing:
            return
        done = self._all_closed = asyncio.Event()
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except TimeoutError:
            self.core.stats["close_lingered"] += 1

    def _close_link(self, link_id: int) -> None:
        conn = self._out.pop(link_id, None)
        if conn is not None:
            self._recheck.discard(conn)
            conn.close()

    # ----------------------------------------------------------------- busy polling

    def _read_raw(self, conn: Connection, until: float) -> bool:
        """Read `conn` without the loop until frames come whole or `until` (perf_counter);
        whether they came."""
        raw = conn.raw_socket()
        if raw is None:
            return False
        clock = time.perf_counter
        while clock() < until:
            try:
                data = raw.recv(_READ)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return False
            if not data:
                return False  # closed: the loop sees it too
            framer = conn.framer
            if framer.take(data):
                return True
            if framer.oversize:
                conn.refuse()
                return False
        return False

    def spin(self, link_id: int, seconds: float, done: Callable[[], bool]) -> None:
        conn = self._out.get(link_id)
        if conn is None:
            return
        receive, clock = self.core.receive_out, time.perf_counter
        until = clock() + seconds
        while not done() and self._read_raw(conn, until):
            frames = conn.frames
            while frames and not conn.closed:
                receive(link_id, frames.popleft(), _monotonic())
            self.process()
        self.flush_soon()

    def _spin_in(self, conn: Connection) -> None:
        """After serving: poll the connection that brought the request for the next one
        (opt-in)."""
        self._spin_for_requests(
            lambda until: self._read_raw(conn, until), lambda: self._take_in(conn)
        )

    def _take_in(self, conn: Connection) -> None:
        frames, receive = conn.frames, self.core.receive_in
        while frames:
            receive(conn.routing_id, frames.popleft(), _monotonic())

    # ----------------------------------------------------------------- closing

    def close(self, linger_ms: int = 200) -> None:
        """Flush goodbyes and close every connection (what was written still goes out: the
        loop's transports send their buffers before they close)."""
        if self._closed:
            return
        self.process()
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._stranger_timer is not None:
            self._stranger_timer.cancel()
        self._pause_accepting()
        self._listener.close()
        self._strangers.clear()
        self._strangers_from.clear()
        for conn in [*self._out.values(), *self._in.values()]:
            if conn.transport is not None:
                self._closing.add(conn)
            conn.close()
        self._out.clear()
        self._in.clear()
        self._recheck.clear()
        self._datagrams.close()
