"""Request/reply on the asyncio side: running handlers and resolving callers' futures.

Members: `HandlerRunner`. Callers: `Caller` (see its docstring).

Handlers are started eagerly: an `async def` handler's coroutine is stepped once inline, and
most handlers finish in that step (they compute a reply without awaiting anything that
blocks), so the common case creates no Task at all. Only a handler that really suspends is
handed to a Task, which resumes it exactly where it stopped. Python 3.12's eager task factory
does the same thing; this is its 3.11 equivalent for one coroutine.

A handler that raises is answered with a RemoteError carrying its type and message, and the
member keeps serving. A handler that returns something other than bytes is a bug in the
handler, reported to the caller the same way.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from irismesh._core.engine import MeshCore
from irismesh._core.events import Listen, ReplyArrived, RequestArrived, RequestFailed, Token
from irismesh._core.frames import STATUS_OK, Kind, unpack_error
from irismesh._driver import Driver
from irismesh.errors import Closed, ConfigurationError, MeshError, RemoteError, RequestTimeout
from irismesh.telemetry.node_telemetry import BROADCAST_KIND, REQUEST_KIND, SURVEY_KIND, outcome
from irismesh.telemetry.schema import Outcome

if TYPE_CHECKING:
    from irismesh.telemetry.node_telemetry import NodeTelemetry
    from irismesh.telemetry.recorder import Series

RequestHandler = Callable[[bytes], Awaitable[bytes | bytearray | memoryview] | bytes]
Reply = Callable[[Token, bytes], None]
ReplyError = Callable[[Token, BaseException], None]
_OK, _REMOTE_ERROR = str(Outcome.OK), str(Outcome.REMOTE_ERROR)


class HandlerRunner:
    """Runs one node's request handler for each RequestArrived."""

    def __init__(
        self,
        reply: Reply,
        reply_error: ReplyError,
        after_async: Callable[[], None],
        serving: Mapping[str, Series] | None = None,
        *,
        ack_only: bool = False,
    ) -> None:
        self._reply = reply
        self._reply_error = reply_error
        self._after_async = after_async  # flush what a handler finishing in a Task queued
        # Telemetry: cluster -> the series that times its handler runs (a Recorder's `serving`)
        self._serving = serving
        self._ack_only = ack_only  # broadcasts: the reply only says the handler ran
        self.handler: RequestHandler | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.running = 0  # handlers suspended in a Task

    def run(self, event: RequestArrived) -> None:
        # Telemetry times one run in `sample_every` (see Series): `started` is 0 for the others.
        serving = self._serving
        if serving is None:
            started = 0
        else:
            series = serving[event.cluster]
            n = series.countdown - 1
            if n:
                series.countdown = n
                series.untimed += 1  # counted as it starts: nothing to do when it ends well
                started = 0
            else:
                started = series.start()
        handler = self.handler
        if handler is None:
            self._fail(event, started, LookupError("this member has no request handler"))
            return
        try:
            result = handler(event.payload)
            if inspect.iscoroutine(result):
                try:
                    yielded = result.send(None)
                except StopIteration as stop:
                    self._finish(event, started, stop.value)
                    return
                loop = asyncio.get_running_loop()
                self._track(loop.create_task(self._resume(event, started, result, yielded)))
                return
            if inspect.isawaitable(result):
                self._track(asyncio.ensure_future(self._await(event, started, result)))
                return
        except Exception as exc:
            self._fail(event, started, exc)
            return
        self._finish(event, started, result)

    def _track(self, task: asyncio.Future[None]) -> None:
        self.running += 1
        self.tasks.add(task)  # type: ignore[arg-type]
        task.add_done_callback(self.tasks.discard)

    async def _resume(
        self,
        event: RequestArrived,
        started: int,
        coro: Coroutine[Any, Any, Any],
        yielded: Any,
    ) -> None:
        try:
            while True:
                try:
                    # Wait on what the handler waits on; its outcome (even an exception or a
                    # cancellation) reaches the handler when it is resumed below.
                    if yielded is None:
                        await asyncio.sleep(0)
                    else:
                        # Take the future over as Task.__step would: the handler's own await
                        # marked it as blocking, and a second await of it must clear that.
                        yielded._asyncio_future_blocking = False
                        await yielded
                except BaseException:
                    pass
                try:
                    yielded = coro.send(None)
                except StopIteration as stop:
                    self._finish(event, started, stop.value)
                    return
                except asyncio.CancelledError:
                    error = ConnectionAbortedError("member is shutting down")
                    self._fail(event, started, error)
                    return
                except Exception as exc:
                    self._fail(event, started, exc)
                    return
        finally:
            self.running -= 1
            self._after_async()

    async def _await(self, event: RequestArrived, started: int, awaitable: Awaitable[Any]) -> None:
        try:
            value = await awaitable
        except Exception as exc:
            self._fail(event, started, exc)
        else:
            self._finish(event, started, value)
        finally:
            self.running -= 1
            self._after_async()

    def _finish(self, event: RequestArrived, started: int, value: object) -> None:
        if self._ack_only:
            value = b""
        elif type(value) is not bytes:
            if not isinstance(value, bytearray | memoryview):
                kind = type(value).__name__
                self._fail(event, started, TypeError(f"request handler returned {kind}, not bytes"))
                return
            value = bytes(value)
        self._reply(event.token, value)
        serving = self._serving
        if started and serving is not None:  # a timed run (an untimed one was counted in run)
            serving[event.cluster].finish(event.token[0], started, len(value), _OK)

    def _fail(self, event: RequestArrived, started: int, exc: BaseException) -> None:
        self._reply_error(event.token, exc)
        if self._serving is not None:
            self._serving[event.cluster].finish(event.token[0], started, 0, _REMOTE_ERROR)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


class Caller:
    """One node's calls in flight: a future per request, resolved by the core's events.

    `request` and `fanout` check their arguments, hand the call to the core and wait on the
    futures; the core's ReplyArrived and RequestFailed resolve them (`on_reply`, `on_failed`)
    and, with telemetry, time them through the cluster's `Series` (inlined: the caller's hot
    path). `events_at` is when the events being handled arrived: the node sets it once per
    batch, so a batch of replies costs one clock read.
    """

    def __init__(
        self, *, default_timeout: float, busy_poll: float, telemetry: NodeTelemetry | None
    ) -> None:
        self.default_timeout = default_timeout
        self.busy_poll = busy_poll
        self.events_at = 0.0
        self.closed = False  # the node is closing: no new calls
        self._telemetry = telemetry
        self._recorder = telemetry.recorder if telemetry is not None else None
        self._core: MeshCore | None = None
        self._driver: Driver | None = None
        # req id -> (future, cluster, sent at, the telemetry series that times it, if any)
        self._waiting: dict[int, tuple[asyncio.Future[bytes], str, float, Series | None]] = {}

    def attach(self, core: MeshCore, driver: Driver) -> None:
        self._core = core
        self._driver = driver

    def listen(self, on: Listen) -> None:
        on(ReplyArrived, self.on_reply)
        on(RequestFailed, self.on_failed)

    def running(self) -> tuple[MeshCore, Driver]:
        """The core and driver, or Closed saying why there are none."""
        if self.closed:
            raise Closed("node is closed")
        if self._core is None or self._driver is None:
            raise Closed("node is not started: use `async with Node(...)` or `await node.start()`")
        return self._core, self._driver

    def close(self) -> None:
        """The node has closed: whatever still waits fails with Closed."""
        for fut, _cluster, _started, _series in self._waiting.values():
            if not fut.done():
                fut.set_exception(Closed("node closed"))
        self._waiting.clear()

    async def request(
        self, cluster: str, payload: bytes, timeout: float | None, hedge: float | bool | None
    ) -> bytes:
        """`Node.request`: one member's reply."""
        core = self._core
        driver = self._driver
        if core is None or driver is None or self.closed:
            core, driver = self.running()  # raises the right Closed
        if timeout is None:
            timeout = self.default_timeout
        elif not timeout > 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        loop = driver.loop
        now = loop.time()
        if hedge is not None and hedge is not False:
            hedge = self._hedge_delay(cluster) if hedge is True else float(hedge)
            if not hedge > 0:
                raise ConfigurationError(f"hedge must be a positive delay, got {hedge!r}")
        else:
            hedge = None
        try:
            req_id = core.calls.request(cluster, payload, timeout, now, hedge)
        except MeshError as exc:
            if self._telemetry is not None:
                self._telemetry.refused(cluster, len(payload), exc, REQUEST_KIND)
            raise
        fut: asyncio.Future[bytes] = loop.create_future()
        recorder = self._recorder
        series = recorder.requests[cluster] if recorder is not None else None
        self._waiting[req_id] = (fut, cluster, now, series)
        if len(self._waiting) > 1:
            # Others are in flight: send at the end of this loop iteration, together with the
            # requests other tasks are about to make (one seal and one send for all of them).
            driver.flush_soon()
        else:
            driver.flush()  # alone: no reason to wait
            if self.busy_poll:  # opt-in: wait for the reply without a trip through the loop
                driver.spin(core.request_link(req_id), self.busy_poll, fut.done)
                if fut.done():
                    return fut.result()
        wake = now + (hedge if hedge is not None else timeout)
        if wake < driver.timer_at:
            driver.arm(wake)
        try:
            return await fut
        except asyncio.CancelledError:
            if self._waiting.pop(req_id, None) is not None:
                core.cancel(req_id)
            raise

    def _hedge_delay(self, cluster: str) -> float:
        """The cluster's measured p95 round trip (a power-of-two bound), or 10 ms unknown."""
        telemetry = self._telemetry
        delay = telemetry.hedge_delay(cluster) if telemetry is not None else None
        return delay or 0.010

    async def fanout(
        self, kind: Kind, cluster: str, payload: bytes, timeout: float | None
    ) -> tuple[dict[str, bytes], dict[str, MeshError], list[str]]:
        """`Node.broadcast` and `Node.survey`: (answers, errors, missing) by member hex id."""
        core, driver = self.running()
        timeout = self.default_timeout if timeout is None else timeout
        if not timeout > 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        loop = driver.loop
        now = loop.time()
        label = BROADCAST_KIND if kind is Kind.BROADCAST else SURVEY_KIND
        try:
            sent = core.fanout(int(kind), cluster, payload, timeout, now)
        except MeshError as exc:
            if self._telemetry is not None:
                self._telemetry.refused(cluster, len(payload), exc, label)
            raise
        futures: dict[str, asyncio.Future[bytes]] = {}
        series = self._recorder.series(label, cluster) if self._recorder is not None else None
        for req_id, member_id in sent:
            fut: asyncio.Future[bytes] = loop.create_future()
            self._waiting[req_id] = (fut, cluster, now, series)
            futures[member_id.hex()] = fut
        driver.flush()
        driver.arm(now + timeout)
        try:
            await asyncio.wait(futures.values())
        except asyncio.CancelledError:
            for req_id, _member in sent:
                if self._waiting.pop(req_id, None) is not None:
                    core.cancel(req_id)
            raise
        answers: dict[str, bytes] = {}
        errors: dict[str, MeshError] = {}
        missing: list[str] = []
        for member, fut in futures.items():
            error = fut.exception()
            if error is None:
                answers[member] = fut.result()
            elif isinstance(error, RequestTimeout):
                missing.append(member)
            elif isinstance(error, MeshError):
                errors[member] = error
            else:  # pragma: no cover - futures only ever get MeshErrors
                raise error
        return answers, errors, missing

    def on_reply(self, event: ReplyArrived) -> None:
        entry = self._waiting.pop(event.req_id, None)
        if entry is None:
            return
        fut, cluster, started, series = entry
        if event.status == STATUS_OK:
            if not fut.done():
                fut.set_result(event.payload)
            if series is not None:  # Series.observe inlined: the caller's hot path
                us = int((self.events_at - started) * 1e6)
                series.histogram[us.bit_length()] += 1
                n = series.countdown - 1
                if n:
                    series.countdown = n
                else:
                    series.sample(event.peer, us, len(event.payload), _OK)
        else:
            kind, message = unpack_error(event.payload)
            if not fut.done():
                fut.set_exception(RemoteError(cluster, kind, message))
            if series is not None:
                us = int((self.events_at - started) * 1e6)
                series.observe(event.peer, us, len(event.payload), _REMOTE_ERROR)

    def on_failed(self, event: RequestFailed) -> None:
        entry = self._waiting.pop(event.req_id, None)
        if entry is not None:
            fut, _cluster, started, series = entry
            if not fut.done():
                fut.set_exception(event.error)
            if series is not None:
                us = int((self.events_at - started) * 1e6)
                series.observe(None, us, 0, outcome(event.error))


def as_bytes(payload: Any) -> bytes:
    """A bytes-like payload as bytes (TypeError for anything else)."""
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
