"""Tunnels for the asyncio node: ordered, flow-controlled message streams to one member.

`async with node.tunnel("db") as t:` opens a tunnel to one live member of "db" (chosen like a
request's), whose `@node.on_tunnel` handler gets the other end. Both ends `send` and `recv`
whole messages of any size up to `max_message`; a message travels as chunks of at most CHUNK
bytes, in order (one tunnel stays on one link), and is reassembled before `recv` returns it.

Flow control is by bytes: each end grants the other a window (`window`, 1 MiB by default) and
grants it again as its reader consumes messages, so a fast sender waits in `send` instead of
filling memory. A message larger than half the window is granted back while it is reassembled
(it could not complete otherwise), so what one end buffers is at most its window plus one
message being reassembled. Grants go back a quarter window at a time.

Ending, like a socket: `send_eof()` is a half close (the other end's `recv` raises EndOfStream
after the last message; it may still send), `close()` ends both directions (a reset if the
other end had not finished), and when the other end's node dies or leaves, a waiting `send` or
`recv` raises TunnelReset with the reason at once (the link's failure detection: milliseconds
for a killed process, about a second for a silent one). `recv` still returns the messages that
had fully arrived before the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any

from irismesh._core.engine import MeshCore
from irismesh._core.events import Listen, TunnelArrived, TunnelFrame
from irismesh._core.frames import TunnelOp
from irismesh._turns import Turns, weight_of
from irismesh.errors import (
    Closed,
    ConfigurationError,
    EndOfStream,
    MeshError,
    NoResponders,
    RequestTimeout,
    TunnelError,
    TunnelReset,
)
from irismesh.patterns.reqrep import continue_trace, incoming_trace

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from irismesh.telemetry.tracing import Tracing

CHUNK = 64 << 10
DEFAULT_WINDOW = 1 << 20
DEFAULT_MAX_MESSAGE = 64 << 20
# A member that resets an unaccepted tunnel with a reason starting so (a gateway whose far
# mesh has no member of the cluster) makes the opener's `node.tunnel` raise NoResponders.
NO_MEMBER = "no live member"

_ACCEPT, _DATA, _CREDIT = int(TunnelOp.ACCEPT), int(TunnelOp.DATA), int(TunnelOp.CREDIT)
_FIN, _RESET = int(TunnelOp.FIN), int(TunnelOp.RESET)

log = logging.getLogger("irismesh.tunnel")

TunnelHandler = Callable[["Tunnel"], Awaitable[Any]]


class Tunnel:
    """One end of a tunnel: `send`/`recv` messages, `send_eof`, `close`; `async for` reads."""

    def __init__(
        self, hub: Tunnels, handle: int, cluster: str, peer: str, window: int, max_message: int
    ) -> None:
        self.cluster = cluster
        self.peer = peer  # the other end's hex node id
        self.bytes_sent = 0
        self.bytes_received = 0
        self.opened_at = time.monotonic()
        self._hub = hub
        self._handle = handle
        self._window = window
        self._max_message = max_message
        self._messages: deque[tuple[bytes, int]] = deque()  # (message, bytes not yet granted)
        self._partial: list[bytes] = []
        self._partial_size = 0
        self._partial_granted = 0
        self._to_grant = 0
        self._eof = False
        self._fin_sent = False
        self._reset: str | None = None
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._ended: asyncio.Future[None] | None = None  # for wait_reset

    def __repr__(self) -> str:
        state = (self._reset and "reset") or ("eof" if self._eof else "open")
        return f"<Tunnel {self.cluster!r} peer={self.peer[:12]} {state}>"

    @property
    def ended_cleanly(self) -> bool:
        """The other end finished sending, and nothing reset the tunnel (so far)."""
        return self._eof and self._reset is None

    # ----------------------------------------------------------------- sending

    async def send(self, data: bytes) -> None:
        """Send one message; waits while the other end's window is full."""
        data = _as_bytes(data)
        self._check_sendable()
        size = len(data)
        if size > self._max_message:
            raise ConfigurationError(
                f"message of {size} bytes exceeds the tunnel's max_message of {self._max_message}"
            )
        view = memoryview(data)
        offset = 0
        while True:
            core = self._hub.core()
            credit = core.tunnel_credit(self._handle) if self._reset is None else 0
            want = min(CHUNK, size - offset)
            if want and credit <= 0:
                await self._wait_writable()
                continue
            take = min(want, credit)
            piece = data if take == size else bytes(view[offset : offset + take])
            offset += take
            more = 1 if offset < size else 0
            core.tunnel_send(self._handle, _DATA, more, piece)
            self.bytes_sent += take
            if not more:
                break
        self._hub.flush_soon()
        # Within the window a send never waits: a window holds many thousands of small
        # messages, and a sender that never waits for credit would keep its loop (heartbeats,
        # input) from running meanwhile.
        turns = self._hub.turns
        if turns.spend(weight_of(size)):
            await turns.pause()

    async def send_eof(self) -> None:
        """Half close: no more messages from this end; the other end may still send."""
        self._check_sendable()
        self._fin_sent = True
        self._hub.core().tunnel_send(self._handle, _FIN)
        self._hub.flush_soon()

    def _check_sendable(self) -> None:
        if self._reset is not None:
            raise TunnelReset(self._reset)
        if self._fin_sent:
            raise TunnelError("this end has closed its side of the tunnel (send_eof or close)")

    async def _wait_writable(self) -> None:
        self._hub.flush()  # what is staged must go, or no grant can come back
        waiter = self._writable = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._writable = None
        if self._reset is not None:
            raise TunnelReset(self._reset)

    # ----------------------------------------------------------------- receiving

    async def recv(self) -> bytes:
        """The next whole message; EndOfStream after the other end's last, TunnelReset if gone."""
        while not self._messages:
            if self._eof:  # it finished sending: a reset after that ends nothing it sent
                raise EndOfStream(f"the other end of the tunnel to {self.cluster!r} is done")
            if self._reset is not None:
                raise TunnelReset(self._reset)
            if self._partial_size > self._window // 2:
                self._grant_partial()  # the reader waits on a large message: let it come
            waiter = self._readable = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._readable = None
        message, ungranted = self._messages.popleft()
        if ungranted:
            self._grant(ungranted)
        # A reader of a full window finds many messages waiting: it yields now and then too.
        turns = self._hub.turns
        if turns.spend(weight_of(len(message))):
            await turns.pause()
        return message

    def __aiter__(self) -> Tunnel:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.recv()
        except EndOfStream:
            raise StopAsyncIteration from None

    def _grant(self, count: int) -> None:
        self._to_grant += count
        if self._reset is None and self._to_grant >= max(1, self._window // 4):
            grant, self._to_grant = self._to_grant, 0
            with contextlib.suppress(TunnelError, Closed):
                self._hub.core().tunnel_send(self._handle, _CREDIT, grant)
                self._hub.flush_soon()

    # ----------------------------------------------------------------- ending

    async def close(self) -> None:
        """End both directions: FIN if the other end had finished sending, else a reset.

        Messages not yet read are dropped; `recv` and `send` raise TunnelReset from now on.
        """

        def goodbye(core: MeshCore) -> None:
            if self._eof:  # the other end is done sending: a graceful close, like TCP's FIN
                if not self._fin_sent:
                    core.tunnel_send(self._handle, _FIN)
                core.tunnel_forget(self._handle)
            else:  # it may still send, and nobody would read it: reset, like TCP's RST
                core.tunnel_send(self._handle, _RESET, 0, b"the other end closed the tunnel")

        self._end_here(goodbye, "closed by this end")

    async def wait_reset(self) -> str:
        """Wait until the tunnel ends by a reset (either end's, or the other end's node
        going) or `close`, even while nobody sends or reads; the reason."""
        if self._reset is None:
            if self._ended is None:
                self._ended = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._ended)
        return self._reset or ""

    def accept(self) -> None:
        """Accept a tunnel that a handler registered with `on_tunnel(..., accept=False)`
        got unaccepted: the opener's `node.tunnel` returns, and it may send. TunnelReset if
        the opener gave up meanwhile."""
        if self._reset is not None:
            raise TunnelReset(self._reset)
        if self._accepted.done():
            return
        self._hub.core().tunnel_accept(self._handle, self._window)
        self._accepted.set_result(None)
        self._hub.flush_soon()

    def reset(self, reason: str) -> None:
        """End both directions at once, now: the other end's `send` and `recv` raise
        TunnelReset with `reason` (a relay passing on why its own far end went away)."""
        self._end_here(
            lambda core: core.tunnel_send(self._handle, _RESET, 0, reason.encode()[:1000]), reason
        )

    def _end_here(self, tell: Callable[[MeshCore], object], reason: str) -> None:
        """End the tunnel from this end: drop what is unread, `tell` the other end through the
        core (unless the tunnel has already ended), and end it with `reason`."""
        self._hub.forget(self._handle)
        self._messages.clear()
        self._partial = []
        if self._reset is not None:
            return
        core = self._hub.core_or_none()
        if core is not None:
            with contextlib.suppress(TunnelError, Closed):
                tell(core)
            self._hub.flush_soon()
        self._end(reason)

    async def __aenter__(self) -> Tunnel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- from the core

    def _on_frame(self, op: int, arg: int, data: bytes) -> None:
        if op == _DATA:
            self._on_data(arg, data)
        elif op == _ACCEPT:
            if not self._accepted.done():
                self._accepted.set_result(None)
            self._wake_writer()
        elif op == _CREDIT:
            self._wake_writer()
        elif op == _FIN:
            self._eof = True
            self._wake_reader()
        elif op == _RESET:
            self._hub.forget(self._handle)
            self._end(data.decode("utf-8", "replace") or "reset by the other end")

    def _on_data(self, more: int, data: bytes) -> None:
        size = len(data)
        self.bytes_received += size
        self._partial.append(data)
        self._partial_size += size
        if self._partial_size > self._max_message:
            reason = f"a message exceeded max_message ({self._max_message} bytes)"
            with contextlib.suppress(TunnelError, Closed):
                self._hub.core().tunnel_send(self._handle, _RESET, 0, reason.encode())
                self._hub.flush_soon()
            self._hub.forget(self._handle)
            self._end(reason)
            return
        if self._partial_size > self._window // 2 and not self._messages:
            # A message this large cannot fit the window: while the reader waits for it, grant
            # it back as it is assembled. (With whole messages unread, the reader is not
            # waiting: it grants when it comes back for this one, see recv.)
            self._grant_partial()
        if not more:
            parts = self._partial
            message = parts[0] if len(parts) == 1 else b"".join(parts)
            self._messages.append((message, self._partial_size - self._partial_granted))
            self._partial = []
            self._partial_size = self._partial_granted = 0
            self._wake_reader()

    def _grant_partial(self) -> None:
        if self._partial_size > self._partial_granted:
            self._grant(self._partial_size - self._partial_granted)
            self._partial_granted = self._partial_size

    def _end(self, reason: str) -> None:
        if self._reset is None:
            self._reset = reason
        if not self._accepted.done():
            self._accepted.set_exception(TunnelReset(reason))
            self._accepted.exception()  # retrieved: an opener that gave up is no error
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
        self._wake_reader()
        self._wake_writer()

    def _wake_reader(self) -> None:
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    def _wake_writer(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)


def _as_bytes(data: object) -> bytes:
    if type(data) is bytes:
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"a tunnel message must be bytes, not {type(data).__name__}")


class TunnelOpening:
    """`node.tunnel(...)`: await it for a Tunnel, or use it as `async with` (closing at the end)."""

    def __init__(self, opener: Callable[[], Awaitable[Tunnel]]) -> None:
        self._opener = opener
        self._tunnel: Tunnel | None = None

    def __await__(self) -> Generator[Any, None, Tunnel]:
        return self._opener().__await__()

    async def __aenter__(self) -> Tunnel:
        self._tunnel = await self._opener()
        return self._tunnel

    async def __aexit__(self, *exc_info: object) -> None:
        if self._tunnel is not None:
            await self._tunnel.close()


class Tunnels:
    """A node's tunnels: opening, serving through the handler, and events from the core."""

    def __init__(
        self,
        flush_soon: Callable[[], None],
        flush: Callable[[], None],
        turns: Turns | None = None,
    ) -> None:
        self.flush_soon = flush_soon
        self.flush = flush
        self.turns = turns if turns is not None else Turns()
        self._core: MeshCore | None = None
        self._open: dict[int, Tunnel] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.handler: TunnelHandler | None = None
        self.accept_first = True  # False: the handler accepts (Tunnel.accept) or resets
        self.record: Callable[[Tunnel], None] | None = None  # telemetry, as a tunnel ends
        self.window = DEFAULT_WINDOW
        self.max_message = DEFAULT_MAX_MESSAGE
        # Tracing on (`telemetry.tracing`): a CLIENT span from open to accept, and a SERVER
        # span around the handler of a tunnel opened with trace context.
        self.tracing: Tracing | None = None

    def attach(self, core: MeshCore) -> None:
        self._core = core

    def core(self) -> MeshCore:
        if self._core is None:
            raise Closed("node is not running")
        return self._core

    def core_or_none(self) -> MeshCore | None:
        return self._core

    def forget(self, handle: int) -> None:
        tunnel = self._open.pop(handle, None)
        if tunnel is not None and self.record is not None:
            self.record(tunnel)

    @property
    def open_count(self) -> int:
        return len(self._open)

    async def open(self, cluster: str, timeout: float, window: int, max_message: int) -> Tunnel:
        tracing = self.tracing
        passed = incoming_trace()  # within a handler (or a gateway's relay): its caller's
        if tracing is None:
            return await self._open_tunnel(cluster, timeout, window, max_message, passed)
        span, trace = tracing.call(cluster, "tunnel", passed)
        try:
            tunnel = await self._open_tunnel(cluster, timeout, window, max_message, trace)
        except BaseException as exc:
            tracing.end(span, exc)
            raise
        tracing.end(span)
        return tunnel

    async def _open_tunnel(
        self, cluster: str, timeout: float, window: int, max_message: int, trace: bytes
    ) -> Tunnel:
        core = self.core()
        handle = core.open_tunnel(cluster, window, trace)
        peer = core.tunnel_peer(handle).hex()  # the member it went to
        tunnel = Tunnel(self, handle, cluster, peer, window, max_message)
        self._open[handle] = tunnel
        self.flush()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(tunnel._accepted)
        except TimeoutError:
            await tunnel.close()
            raise RequestTimeout(cluster, timeout) from None
        except TunnelReset as exc:
            await tunnel.close()
            if exc.reason.startswith(NO_MEMBER):
                raise NoResponders(cluster) from None
            raise
        except BaseException:
            await tunnel.close()
            raise
        return tunnel

    def listen(self, on: Listen) -> None:
        """Sign up for the core's tunnel events."""
        on(TunnelArrived, self.on_event)
        on(TunnelFrame, self.on_event)

    def on_event(self, event: TunnelArrived | TunnelFrame) -> None:
        if type(event) is TunnelFrame:
            tunnel = self._open.get(event.handle)
            if tunnel is not None:
                tunnel._on_frame(event.op, event.arg, event.data)
            return
        assert isinstance(event, TunnelArrived)
        core = self.core()
        handler = self.handler
        if handler is None:
            core.tunnel_send(event.handle, _RESET, 0, b"the member serves no tunnels")
            return
        tunnel = Tunnel(
            self, event.handle, event.cluster, event.peer.hex(), self.window, self.max_message
        )
        if self.accept_first:
            tunnel.accept()
        self._open[event.handle] = tunnel
        loop = asyncio.get_running_loop()
        if event.trace and self.tracing is not None:
            # The handler's task starts in its SERVER span's context (a copy of the current).
            span, entered = self.tracing.serve(event.cluster, "tunnel", event.trace)
            try:
                task = loop.create_task(self._serve(handler, tunnel, event.trace, span))
            finally:
                self.tracing.leave(entered)
        else:
            task = loop.create_task(self._serve(handler, tunnel, event.trace))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self, handler: TunnelHandler, tunnel: Tunnel, trace: bytes = b"", span: Span | None = None
    ) -> None:
        if trace:  # this task's context: the caller's trace, for what the handler calls
            continue_trace(trace)
        error: BaseException | None = None
        try:
            await handler(tunnel)
        except (TunnelReset, EndOfStream):
            pass  # the other end went away or finished early: the handler's business
        except MeshError as exc:
            log.info("tunnel handler for %r stopped: %s", tunnel.cluster, exc)
        except Exception as exc:
            log.warning(
                "tunnel handler for %r raised %s: %s", tunnel.cluster, type(exc).__name__, exc
            )
            log.debug("the tunnel handler's traceback", exc_info=True)
            error = exc
            reason = f"handler raised {type(exc).__name__}: {exc}"[:500]
            core = self._core
            if core is not None and tunnel._reset is None:
                with contextlib.suppress(TunnelError, Closed):
                    core.tunnel_send(tunnel._handle, _RESET, 0, reason.encode())
                    self.flush_soon()
                self.forget(tunnel._handle)
                tunnel._end(reason)
        finally:
            if span is not None and self.tracing is not None:
                self.tracing.end(span, error)
            await tunnel.close()

    async def close(self) -> None:
        for tunnel in list(self._open.values()):
            tunnel._end("node closed")
        self._open.clear()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._core = None
