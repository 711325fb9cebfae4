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
import contextvars
import inspect
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextvars import ContextVar
from contextvars import Token as ContextToken
from functools import partial
from typing import TYPE_CHECKING, Any, overload

from irismesh._core.admission import Admission
from irismesh._core.engine import MeshCore
from irismesh._core.events import (
    Listen,
    ReplyArrived,
    RequestArrived,
    RequestCancelled,
    RequestFailed,
    Token,
)
from irismesh._core.frames import STATUS_OK, Kind, unpack_error
from irismesh._core.priority import check_priority, label
from irismesh._driver import Driver
from irismesh._spin import Spin
from irismesh._turns import Turns
from irismesh.errors import (
    Closed,
    ConfigurationError,
    MeshError,
    RequestTimeout,
    remote_error,
)
from irismesh.telemetry.node_telemetry import BROADCAST_KIND, REQUEST_KIND, SURVEY_KIND, outcome
from irismesh.telemetry.schema import Outcome

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from opentelemetry.trace import Span

    from irismesh.telemetry.node_telemetry import NodeTelemetry
    from irismesh.telemetry.recorder import Series
    from irismesh.telemetry.tracing import Tracing

RequestHandler = Callable[[bytes], Awaitable[bytes | bytearray | memoryview] | bytes]
# A forwarder's handler (`Node.forward_requests`): given each request as it arrives, it answers
# each once, later, with `HandlerRunner.answer`; its `cancelled` hook hears of callers that gave
# up (True: the request was still being forwarded, and the forwarder has answered it now).
Forward = Callable[[RequestArrived], None]
ForwardCancelled = Callable[[RequestCancelled], bool]
Reply = Callable[[Token, bytes], None]
ReplyError = Callable[[Token, BaseException], None]
_OK, _REMOTE_ERROR = str(Outcome.OK), str(Outcome.REMOTE_ERROR)
_Timer = asyncio.TimerHandle | None
_KIND_REQUEST = int(Kind.REQUEST)
# What a call is, as its spans name it (`telemetry.tracing`).
METHODS = {
    _KIND_REQUEST: "request",
    int(Kind.JOB): "job",
    int(Kind.BROADCAST): "broadcast",
    int(Kind.SURVEY): "survey",
}
SLICE = 0.005  # seconds of plain-function handlers run in a row before the loop gets a turn

_deadline: ContextVar[float] = ContextVar("irismesh_deadline", default=float("inf"))
# The trace context the call being handled came with, as it came (b"": none): what a node
# passes on when it makes no spans of its own (a gateway), see `incoming_trace`.
_trace_in: ContextVar[bytes] = ContextVar("irismesh_trace", default=b"")
# What round trips and handler runs are timed by: the loop's own clock is no good for that,
# as uvloop's moves in whole milliseconds (once per turn of the loop).
_perf_counter = time.perf_counter
_Coroutine = types.CoroutineType


class TurnedAway(Exception):
    """Raised by a handler that forwards requests (a gateway) when it cannot: the caller is
    answered as if admission had turned the request away unrun, so it goes to another member."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ForwardedError(Exception):
    """Raised by a handler that forwards requests with the error another member answered: the
    caller's RemoteError names that error's type and message, not this one's."""

    def __init__(self, remote_type: str, remote_message: str) -> None:
        super().__init__(remote_message)
        self.remote_type = remote_type
        self.remote_message = remote_message


def deadline() -> float | None:
    """The deadline of the request being handled, on the monotonic clock (`time.monotonic()`,
    the event loop's own, at full resolution): when its caller gives up. None outside a request
    handler, or for a request without one.

    Requests a handler makes in turn inherit it: their timeout is at most what is left."""
    at = _deadline.get()
    return None if at == float("inf") else at


def incoming_trace() -> bytes:
    """The W3C trace context (`telemetry.tracing`'s bytes) of the call being handled, as its
    caller sent it; b"" outside a handler or for a call without one."""
    return _trace_in.get()


def continue_trace(trace: bytes) -> None:
    """Calls made from here on in this task (or context) carry `trace` as their parent
    context, as if they were made within a handler of a call that came with it."""
    _trace_in.set(trace)


def time_left() -> float | None:
    """Seconds left until `deadline()` (negative once passed); None outside a handler. Safe
    in a blocking handler's thread too: the loop's clock is the monotonic clock."""
    at = _deadline.get()
    if at == float("inf"):
        return None
    return at - time.monotonic()


class HandlerRunner:
    """Runs one node's request handler for each RequestArrived, within admission.

    With an `admission` (the request and survey handlers), each request is offered to it on
    arrival: started at once, queued, or turned away (`turn_away`, with the reason); whatever
    waits starts as running handlers finish, in the order admission chooses, and requests that
    can no longer be served in time are turned away before they start. Plain-function handlers
    run on the event loop, at most `SLICE` seconds of them in a row: then the runner yields to
    the loop (the rest wait in the queue), so membership's probes and other clusters' traffic
    are answered between slices however busy the handlers keep the node. Blocking handlers run
    in the runner's thread pool, whose size caps admission's limit.

    A handler's deadline (`deadline()`) is the request's: an `async def` handler still running
    at its deadline, or whose caller gives up (`cancel`), is cancelled. A blocking handler
    cannot be interrupted: its caller is answered at once, and its thread runs on to its end.
    """

    def __init__(
        self,
        reply: Reply,
        reply_error: ReplyError,
        after_async: Callable[[], None],
        serving: Mapping[str, Series] | None = None,
        *,
        ack_only: bool = False,
        admission: Admission[RequestArrived] | None = None,
        turn_away: Callable[[Token, str], None] | None = None,
        stats: Counter[str] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._reply = reply
        self._reply_error = reply_error
        self._after_async = after_async  # flush what a handler finishing in a Task queued
        # Telemetry: cluster -> the series that times its handler runs (a Recorder's `serving`)
        self._serving = serving
        self._ack_only = ack_only  # broadcasts: the reply only says the handler ran
        self.admission = admission
        self._turn_away = turn_away
        self.stats: Counter[str] = Counter() if stats is None else stats
        self.handler: RequestHandler | None = None
        # A forwarder's (`Node.forward_requests`): requests go to it as they arrive, no handler
        # run, no Future, no timer; it answers with `answer`.
        self.forward: Forward | None = None
        self.forward_cancelled: ForwardCancelled | None = None
        self.blocking = False  # the handler blocks: it runs in `pool`
        self.pool: ThreadPoolExecutor | None = None
        self.tasks: set[asyncio.Future[Any]] = set()
        self.running = 0  # handlers suspended in a Task (or running in a thread)
        # (caller id, request id) -> (the handler's task, its deadline timer), while it runs
        self._active: dict[
            tuple[bytes, int], tuple[asyncio.Future[Any], asyncio.Handle | None]
        ] = {}
        self._waiting: dict[tuple[bytes, int], RequestArrived] = {}  # queued, by request
        self._spent = 0.0  # seconds of inline handler runs since the runner last yielded
        self._pumping = False  # a pump is scheduled on the loop
        self._shed: list[tuple[RequestArrived, str]] = []  # what one offer sheds (`run`)
        self._expiring: asyncio.TimerHandle | None = None
        # Tracing on: a SERVER span for each run of a request that came with context, by
        # (caller id, request id) while it runs.
        self.tracing = tracing
        self._spans: dict[tuple[bytes, int], Span] = {}

    # ----------------------------------------------------------------- admission

    def run(self, event: RequestArrived, traced: bool = False) -> None:
        """Run `event`'s handler, now or once admission lets it (or forward it). `traced`: it
        came with its caller's trace context (a TracedRequestArrived, or a job made from
        one), which its handler then runs in."""
        admission = self.admission
        if admission is None:
            forward = self.forward
            if forward is None:
                if traced:
                    self._start_traced(event, 0.0)
                else:
                    self._start(event, 0.0)
                return
            serving = self._serving
            if serving is not None:  # a forwarded request is counted, not timed
                serving[event.cluster].untimed += 1
            forward(event)
            return
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        shed = self._shed  # reused: a request rarely sheds another
        priority = event.priority
        verdict = admission.offer(
            event, event.deadline, now, shed, priority, may_start=self._spent < SLICE
        )
        if verdict is None:
            if traced:
                self._start_traced(event, now)
            else:
                self._start(event, now)
            if not shed:
                return
        elif verdict == "queued":
            self.stats["requests_queued"] += 1
            if priority:
                self.stats["requests_queued_" + label(priority)] += 1
            self._waiting[event.token[:2]] = event
            self._schedule(loop)
        else:
            self._reject(event, verdict)
        if shed:
            items = shed.copy()
            shed.clear()
            for item, reason in items:
                self._reject(item, reason)

    def handler_pool(
        self, threads: int, admission: Admission[RequestArrived] | None
    ) -> ThreadPoolExecutor:
        """The node's pool of `threads` threads for blocking handlers, made on first use (and
        its module loaded then: a node whose handlers are coroutines never needs it); an
        `admission` that starts them lets no more run at once than there are threads."""
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(threads, thread_name_prefix="irismesh-handler")
        if admission is not None:
            admission.max_limit = threads
            admission.limit = min(admission.limit, threads)
        return self.pool

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start what waits: on the loop's next turn (after it has polled for I/O)."""
        if not self._pumping:
            self._pumping = True
            loop.call_soon(self._pump)
        if self._expiring is None and self.admission is not None:
            standing = self.admission.standing
            self._expiring = loop.call_later(standing / 2, self._expire)

    def _pump(self) -> None:
        self._pumping = False
        self._spent = 0.0
        admission = self.admission
        if admission is None:
            return
        loop = asyncio.get_running_loop()
        shed: list[tuple[RequestArrived, str]] = []
        while self._spent < SLICE:
            now = time.monotonic()
            event = admission.take(now, shed)
            if event is None:
                break
            self._waiting.pop(event.token[:2], None)
            if event.trace:
                self._start_traced(event, now)
            else:
                self._start(event, now)
        for item, reason in shed:
            self._reject(item, reason)
        if admission.waiting and admission.can_start:  # the slice is over: the rest next turn
            self._schedule(loop)

    def _expire(self) -> None:
        """While requests wait, those that can no longer be served in time go at once."""
        self._expiring = None
        admission = self.admission
        if admission is None or not admission.waiting:
            return
        loop = asyncio.get_running_loop()
        shed: list[tuple[RequestArrived, str]] = []
        admission.expire(time.monotonic(), shed)
        for item, reason in shed:
            self._reject(item, reason)
        if admission.waiting:
            self._expiring = loop.call_later(admission.standing / 2, self._expire)
        if shed:
            self._after_async()

    def _reject(self, event: RequestArrived, reason: str) -> None:
        self._waiting.pop(event.token[:2], None)
        if event.priority:  # the totals are the core's requests_shed_<reason>
            self.stats[f"requests_shed_{reason}_{label(event.priority)}"] += 1
        if self._turn_away is not None:
            self._turn_away(event.token, reason)

    def cancel(self, event: RequestCancelled) -> None:
        """The caller gave up: a waiting request goes, a running `async def` handler is
        cancelled (a blocking one runs on, unheard); a forwarder hears of it (`forward`)."""
        if self.forward_cancelled is not None:
            if self.forward_cancelled(event):
                self.stats["requests_cancelled"] += 1
            return
        key = event.token[:2]
        waiting = self._waiting.pop(key, None)
        if waiting is not None and self.admission is not None:
            if self.admission.remove(waiting):
                self.stats["requests_cancelled"] += 1
                if self._turn_away is not None:
                    self._turn_away(waiting.token, "cancelled")
            return
        active = self._active.get(key)
        if active is not None and not self.blocking:
            self.stats["requests_cancelled"] += 1
            active[0].cancel()

    def _finished(self, started_at: float) -> None:
        admission = self.admission
        if admission is None:
            return
        admission.finished(_perf_counter() - started_at)
        if admission.waiting:
            self._schedule(asyncio.get_running_loop())

    # ----------------------------------------------------------------- running

    def _start(self, event: RequestArrived, now: float) -> None:
        """Run `event`'s handler (admitted): `_start_traced` runs it in its caller's trace."""
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
        admission = self.admission
        if admission is not None:
            admission.started()
            self.stats["requests_admitted"] += 1
            if event.priority:
                self.stats["requests_admitted_" + label(event.priority)] += 1
        mark = _deadline.set(event.deadline)
        began = _perf_counter()
        try:
            if self.blocking:
                self._run_blocking(event, started, handler, began)
                return
            result = handler(event.payload)
            # A plain function's bytes (the common case) skip the awaitable checks.
            if type(result) is not bytes:
                if type(result) is _Coroutine or inspect.iscoroutine(result):
                    try:
                        yielded = result.send(None)
                    except StopIteration as stop:
                        # Done in its first step (the common case): answered below, as a
                        # plain function's bytes are.
                        result = stop.value
                    else:
                        loop = asyncio.get_running_loop()
                        resume = self._resume(event, started, result, yielded, began)
                        task = loop.create_task(resume)
                        self._track(event, task)
                        self._spent += _perf_counter() - began
                        return
                elif isinstance(result, asyncio.Future):
                    # A handler passing the request on (a gateway): answered when the future
                    # resolves, with no Task in between.
                    result.add_done_callback(partial(self._settled, event, started, began))
                    self._track(event, result)
                    self._spent += _perf_counter() - began
                    return
                elif inspect.isawaitable(result):
                    task = asyncio.ensure_future(self._await(event, started, result, began))
                    self._track(event, task)
                    self._spent += _perf_counter() - began
                    return
        except Exception as exc:
            self._fail(event, started, exc)
            self._inline_done(began, now)
            return
        finally:
            _deadline.reset(mark)
        if type(result) is bytes and not self._ack_only:  # _finish's common case, inlined
            self._reply(event.token, result)
            if started and serving is not None:
                serving[event.cluster].finish(event.token[0], started, len(result), _OK)
        else:
            self._finish(event, started, result)
        # _inline_done, inlined: the hot path.
        took = _perf_counter() - began
        spent = self._spent = self._spent + took
        if admission is not None:
            admission.finished(took)
            if spent >= SLICE and not self._pumping:
                self._pumping = True  # a fresh slice once the loop has polled for I/O
                asyncio.get_running_loop().call_soon(self._pump)

    def _start_traced(self, event: RequestArrived, now: float) -> None:
        """`_start` for a request that came with its caller's trace context: the handler runs
        in that context (tracing on, in a SERVER span of its own), left once the handler has
        run or suspended. The span of a request answered at once ends here; that of one still
        running ends with its answer (`_finish`, `_fail`)."""
        traced = self._enter(event)
        try:
            self._start(event, now)
        finally:
            self._leave(traced)
        if self._spans and event.token[:2] not in self._active:
            self._end_span(event, None)

    def _enter(self, event: RequestArrived) -> tuple[ContextToken[bytes], object]:
        """The run of `event`, which came with trace context, starts: in that context (and,
        tracing on, in a SERVER span of its own, made current); what `_leave` takes."""
        reset = _trace_in.set(event.trace)
        entered = None
        if self.tracing is not None:
            method = METHODS.get(event.kind, "request")
            span, entered = self.tracing.serve(event.cluster, method, event.trace)
            self._spans[event.token[:2]] = span
        return reset, entered

    def _leave(self, traced: tuple[ContextToken[bytes], object]) -> None:
        """The handler has run (or suspended): the context `_enter` set is left."""
        reset, entered = traced
        _trace_in.reset(reset)
        if entered is not None and self.tracing is not None:
            self.tracing.leave(entered)

    def _end_span(self, event: RequestArrived, error: BaseException | None) -> None:
        """The run of `event` is over: its SERVER span (if it has one) ends."""
        span = self._spans.pop(event.token[:2], None)
        if span is not None and self.tracing is not None:
            self.tracing.end(span, error)

    def _inline_done(self, began: float, now: float) -> None:
        """A handler ran start to end inline: it counts against the slice, and as a run."""
        took = _perf_counter() - began
        self._spent += took
        if self.admission is not None:
            self.admission.finished(took)
            if not self._pumping and self._spent >= SLICE:
                self._pumping = True  # a fresh slice once the loop has polled for I/O
                asyncio.get_running_loop().call_soon(self._pump)

    def _run_blocking(
        self, event: RequestArrived, started: int, handler: RequestHandler, began: float
    ) -> None:
        loop = asyncio.get_running_loop()
        if self.pool is None:
            raise ConfigurationError("a blocking handler needs the node's thread pool")
        context = contextvars.copy_context()  # the handler reads its deadline in the thread
        future = loop.run_in_executor(self.pool, context.run, handler, event.payload)
        self._track(event, asyncio.ensure_future(self._await(event, started, future, began)))

    def _track(self, event: RequestArrived, task: asyncio.Future[Any]) -> None:
        self.running += 1
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        key = event.token[:2]
        loop = asyncio.get_running_loop()
        timer = None
        if not self.blocking and event.deadline != float("inf"):
            # Its caller gives up then: the handler stops too.
            timer = loop.call_at(event.deadline, self._overdue, key)
        self._active[key] = (task, timer)

    def _overdue(self, key: tuple[bytes, int]) -> None:
        active = self._active.get(key)
        if active is not None:
            self.stats["requests_deadline_cancelled"] += 1
            active[0].cancel()

    def _untrack(self, event: RequestArrived, began: float) -> None:
        self.running -= 1
        active = self._active.pop(event.token[:2], None)
        if active is not None and active[1] is not None:
            active[1].cancel()
        self._finished(began)
        self._after_async()

    async def _resume(
        self,
        event: RequestArrived,
        started: int,
        coro: Coroutine[Any, Any, Any],
        yielded: Any,
        began: float,
    ) -> None:
        try:
            while True:
                cancelled = False
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
                except asyncio.CancelledError:
                    # This task was cancelled (the caller gave up, the deadline passed, the
                    # node closes): the handler is, too, where it waits.
                    cancelled = yielded is None or not yielded.cancelled()
                except BaseException:
                    pass
                try:
                    yielded = coro.throw(asyncio.CancelledError()) if cancelled else coro.send(None)
                except StopIteration as stop:
                    self._finish(event, started, stop.value)
                    return
                except asyncio.CancelledError:
                    self._fail(event, started, _cancelled(event))
                    return
                except Exception as exc:
                    self._fail(event, started, exc)
                    return
        finally:
            self._untrack(event, began)

    async def _await(
        self, event: RequestArrived, started: int, awaitable: Awaitable[Any], began: float
    ) -> None:
        try:
            value = await awaitable
        except asyncio.CancelledError:
            self._fail(event, started, _cancelled(event))
        except Exception as exc:
            self._fail(event, started, exc)
        else:
            self._finish(event, started, value)
        finally:
            self._untrack(event, began)

    def _settled(
        self, event: RequestArrived, started: int, began: float, future: asyncio.Future[Any]
    ) -> None:
        try:
            if future.cancelled():
                self._fail(event, started, _cancelled(event))
            elif (exc := future.exception()) is not None:
                self._fail(event, started, exc)
            else:
                self._finish(event, started, future.result())
        finally:
            self._untrack(event, began)

    def answer(self, event: RequestArrived, reply: bytes | BaseException) -> None:
        """A forwarder's answer to `event`: the reply's bytes, or what a handler would have
        raised (TurnedAway: turned away unrun; ForwardedError: another member's error)."""
        if type(reply) is bytes:
            self._reply(event.token, reply)
        else:
            assert isinstance(reply, BaseException)
            self._fail(event, 0, reply)
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
        if self._spans:
            self._end_span(event, None)

    def _fail(self, event: RequestArrived, started: int, exc: BaseException) -> None:
        if isinstance(exc, TurnedAway) and self._turn_away is not None:
            self._turn_away(event.token, exc.reason)
        else:
            self._reply_error(event.token, exc)
        if self._serving is not None:
            self._serving[event.cluster].finish(event.token[0], started, 0, _REMOTE_ERROR)
        if self._spans:
            self._end_span(event, exc)

    async def close(self) -> None:
        if self._expiring is not None:
            self._expiring.cancel()
            self._expiring = None
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _cancelled(event: RequestArrived) -> BaseException:
    """What a cancelled handler answers (its caller has given up or the node is closing)."""
    if time.monotonic() >= event.deadline:
        return TimeoutError("the request's deadline passed while its handler ran")
    return ConnectionAbortedError("the caller gave up, or the member is shutting down")


ReplyCallback = Callable[[bytes | None, BaseException | None], None]


class _Callback:
    """Stands in for a request's Future where `Caller.start_callback` was used: the reply (or
    the error) goes straight to the callback as it arrives, with no turn of the loop."""

    __slots__ = ("_callback", "_done")

    def __init__(self, callback: ReplyCallback) -> None:
        self._callback = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, reply: bytes) -> None:
        self._done = True
        try:
            self._callback(reply, None)
        except Exception as exc:
            _callback_raised(exc)

    def set_exception(self, error: BaseException) -> None:
        self._done = True
        try:
            self._callback(None, error)
        except Exception as exc:
            _callback_raised(exc)


def _callback_raised(exc: Exception) -> None:
    """Reported as a Future's callback's would be; the node's events go on."""
    asyncio.get_running_loop().call_exception_handler(
        {"message": "a request's reply callback raised", "exception": exc}
    )


class Caller:
    """One node's calls in flight: a future per request, resolved by the core.

    `request` and `fanout` check their arguments, hand the call to the core and wait on the
    futures; the core resolves them as it reads each reply (`replied`, its reply sink) and
    through RequestFailed events (`on_failed`), and, with telemetry, they are timed by
    perf_counter through the cluster's `Series` (inlined: the caller's hot path).
    `events_at` is when the events being handled arrived: the node sets it once per batch.
    """

    def __init__(
        self, *, default_timeout: float, busy_poll: float, telemetry: NodeTelemetry | None
    ) -> None:
        self.default_timeout = default_timeout
        self.busy_poll = busy_poll
        # Whether spinning for a lone request's reply pays (set with the core, `attach`), and
        # the lone request being timed for it: id (-1: none), when sent, whether spun for.
        self.reply_spin: Spin | None = None
        self._lone = -1
        self._lone_at = 0.0
        self._lone_spun = False
        self.events_at = 0.0
        self.closed = False  # the node is closing: no new calls
        self._telemetry = telemetry
        self._recorder = telemetry.recorder if telemetry is not None else None
        # The node's account of calls that completed without waiting (shared with its other
        # patterns): a loop of them still gives the event loop its turns.
        self.turns = Turns()
        self._core: MeshCore | None = None
        self._driver: Driver | None = None
        # req id -> (future, cluster, sent at, the telemetry series that times it, if any)
        self._waiting: dict[
            int, tuple[asyncio.Future[bytes] | _Callback, str, float, Series | None]
        ] = {}
        # Tracing on (`telemetry.tracing`): the CLIENT span of each request in flight that has
        # one, by request id.
        self.tracing: Tracing | None = None
        self._spans: dict[int, Span] = {}
        # Where each reply goes (`attach` chooses): `_replied_traced` only where spans are made.
        self._take_reply: Callable[[int, int, bytes, bytes, float], None] = self.replied

    def attach(self, core: MeshCore, driver: Driver) -> None:
        self._core = core
        self._driver = driver
        # Each reply as it arrives: no event for it. Only a tracing node has CLIENT spans to end
        # (`_request_traced`), so only its replies pass through `_replied_traced`.
        self._take_reply = self.replied if self.tracing is None else self._replied_traced
        core.calls.reply_sink = self._take_reply
        if self.busy_poll:
            self.reply_spin = Spin(self.busy_poll, core.stats, "busy_poll_replies", compare=False)

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
        self,
        cluster: str,
        payload: bytes,
        timeout: float | None,
        hedge: float | bool | None,
        kind: int = _KIND_REQUEST,
        priority: int = 0,
        trace: bytes = b"",
    ) -> bytes:
        """`Node.request`: one member's reply (`kind` JOB: a queued job the memory hands out,
        continuing the `trace` it was queued in)."""
        try:
            req_id, fut = self.send(cluster, payload, timeout, hedge, kind, priority, trace=trace)
        except MeshError:
            if self.turns.spend():  # refused at once: a retry loop must not keep the loop
                await self.turns.pause()
            raise
        try:
            if fut.done() and self.turns.spend():  # answered while busy polling
                await self.turns.pause()
            return await fut
        except asyncio.CancelledError:
            self.abandon(req_id)
            raise

    def abandon(self, req_id: int) -> None:
        """The caller of `send` was cancelled while it waited: the core cancels the request."""
        if self._waiting.pop(req_id, None) is not None and self._core is not None:
            self._core.cancel(req_id)
        if self._spans:
            self._end_span(req_id, "cancelled")

    def _end_span(self, req_id: int, error: BaseException | str | None) -> None:
        span = self._spans.pop(req_id, None)
        if span is not None and self.tracing is not None:
            self.tracing.end(span, error)

    def start(self, cluster: str, payload: bytes, timeout: float | None) -> asyncio.Future[bytes]:
        """`Node.start_request`: the reply's future; cancelling it cancels the request."""
        req_id, fut = self.send(cluster, payload, timeout, None, _KIND_REQUEST, spin=False)
        core = self._core
        assert core is not None  # send has raised Closed otherwise

        def cancelled(done: asyncio.Future[bytes]) -> None:
            if done.cancelled() and self._waiting.pop(req_id, None) is not None:
                core.cancel(req_id)
                if self._spans:
                    self._end_span(req_id, "cancelled")

        fut.add_done_callback(cancelled)
        return fut

    def start_callback(
        self,
        cluster: str,
        payload: bytes,
        timeout: float | None,
        callback: ReplyCallback,
        trace: bytes = b"",
    ) -> None:
        """`Node.request_callback`: `callback(reply, None)` or `callback(None, error)` once,
        as the reply (or the failure) arrives; no Future. `trace`: the context it continues."""
        self.send(
            cluster, payload, timeout, None, spin=False, callback=_Callback(callback), trace=trace
        )

    @overload
    def send(
        self,
        cluster: str,
        payload: bytes,
        timeout: float | None,
        hedge: float | bool | None,
        kind: int = _KIND_REQUEST,
        priority: int = 0,
        *,
        spin: bool = True,
        callback: None = None,
        trace: bytes = b"",
    ) -> tuple[int, asyncio.Future[bytes]]: ...

    @overload
    def send(
        self,
        cluster: str,
        payload: bytes,
        timeout: float | None,
        hedge: float | bool | None,
        kind: int = _KIND_REQUEST,
        priority: int = 0,
        *,
        spin: bool = True,
        callback: _Callback,
        trace: bytes = b"",
    ) -> tuple[int, _Callback]: ...

    def send(
        self,
        cluster: str,
        payload: bytes,
        timeout: float | None,
        hedge: float | bool | None,
        kind: int = _KIND_REQUEST,
        priority: int = 0,
        *,
        spin: bool = True,
        callback: _Callback | None = None,
        trace: bytes = b"",
    ) -> tuple[int, asyncio.Future[bytes] | _Callback]:
        """`request` up to its wait: check the request, hand it to the core, and arm the timer
        of its deadline; returns its id and the future of its reply, which the caller awaits
        (and `abandon`s when cancelled). `Node.request` awaits it itself: one coroutine per
        request instead of two. With `callback`, the reply goes to it instead of a Future
        (returned in the Future's place). `trace`: the context the request continues (a
        gateway passing a call on), else the current one's when tracing is on."""
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
        now = time.monotonic()
        inherited = _deadline.get()
        if inherited < now + timeout:  # called from a handler: within its caller's deadline
            timeout = inherited - now
            if timeout <= 0:
                raise RequestTimeout(cluster, 0.0, 0)
        if hedge is not None and hedge is not False:
            hedge = self._hedge_delay(cluster) if hedge is True else float(hedge)
            if not hedge > 0:
                raise ConfigurationError(f"hedge must be a positive delay, got {hedge!r}")
        else:
            hedge = None
        if priority:
            priority = check_priority(priority)
        if not trace and self.tracing is None:  # the plain path: two checks, no more
            try:
                req_id = core.calls.request(cluster, payload, timeout, now, hedge, kind, priority)
            except MeshError as exc:
                if self._telemetry is not None:
                    self._telemetry.refused(cluster, len(payload), exc, REQUEST_KIND)
                raise
        else:
            req_id = self._request_traced(
                self.tracing, core, cluster, payload, timeout, now, hedge, kind, priority, trace
            )
        fut: asyncio.Future[bytes] | _Callback = (
            loop.create_future() if callback is None else callback
        )
        recorder = self._recorder
        series = recorder.requests[cluster] if recorder is not None else None
        waiting = self._waiting
        waiting[req_id] = (fut, cluster, _perf_counter() if series is not None else 0.0, series)
        # A flush is queued (behind the tasks a batch of replies woke): the request goes in
        # it. Others are in flight: at the end of this loop iteration, together with the
        # requests other tasks are about to make (one seal and one send for all of them).
        if not driver.flush_pending:
            if len(waiting) > 1:
                driver.flush_soon()
            else:
                driver.flush()  # alone: no reason to wait
        wake = now + (hedge if hedge is not None else timeout)
        if wake < driver.timer_at:
            driver.arm(wake)
        if self.busy_poll and spin and len(waiting) == 1:
            self._spin_for(req_id, fut, core, driver)
        return req_id, fut

    def _request_traced(
        self,
        tracing: Tracing | None,
        core: MeshCore,
        cluster: str,
        payload: bytes,
        timeout: float,
        now: float,
        hedge: float | None,
        kind: int,
        priority: int,
        parent: bytes,
    ) -> int:
        """`send`'s request to the core with tracing on, or with a `parent` context to pass
        on: with tracing, in a CLIENT span of its own (the child of the current span, else of
        `parent`), whose context goes with it, and which ends with the reply or the failure;
        without, with `parent` as it came."""
        if tracing is None:
            try:
                return core.calls.request(
                    cluster, payload, timeout, now, hedge, kind, priority, parent or None
                )
            except MeshError as exc:
                if self._telemetry is not None:
                    self._telemetry.refused(cluster, len(payload), exc, REQUEST_KIND)
                raise
        span, trace = tracing.call(cluster, METHODS.get(kind, "request"), parent)
        try:
            req_id = core.calls.request(
                cluster, payload, timeout, now, hedge, kind, priority, trace or None
            )
        except MeshError as exc:
            tracing.end(span, exc)
            if self._telemetry is not None:
                self._telemetry.refused(cluster, len(payload), exc, REQUEST_KIND)
            raise
        self._spans[req_id] = span
        return req_id

    def _spin_for(
        self, req_id: int, fut: asyncio.Future[bytes] | _Callback, core: MeshCore, driver: Driver
    ) -> None:
        """Opt-in (`busy_poll`), a lone request: wait for its reply without a trip through the
        loop (awaiting a done future then returns at once) while `reply_spin` finds replies
        come within `busy_poll`; either way its round trip is timed for it (see `replied`)."""
        spin = self.reply_spin
        budget = self.busy_poll if spin is None else spin.budget()
        began = time.perf_counter()
        self._lone, self._lone_at, self._lone_spun = req_id, began, bool(budget)
        if budget:
            driver.flush()  # sent, not merely staged
            driver.spin(core.request_link(req_id), budget, fut.done)
            if spin is not None:
                spin.spun(time.perf_counter() - began, fut.done())

    def _hedge_delay(self, cluster: str) -> float:
        """The cluster's measured p95 round trip (a power-of-two bound), or 10 ms unknown."""
        telemetry = self._telemetry
        delay = telemetry.hedge_delay(cluster) if telemetry is not None else None
        return delay or 0.010

    async def fanout(
        self, kind: Kind, cluster: str, payload: bytes, timeout: float | None
    ) -> tuple[dict[str, bytes], dict[str, MeshError], list[str]]:
        """`Node.broadcast` and `Node.survey`: (answers, errors, missing) by member hex id."""
        try:
            core, driver = self.running()
            timeout = self.default_timeout if timeout is None else timeout
            if not timeout > 0:
                raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
            if type(payload) is not bytes:
                payload = as_bytes(payload)
            loop = driver.loop
            now = time.monotonic()
            inherited = _deadline.get()
            if inherited < now + timeout:  # called from a handler: within its caller's deadline
                timeout = inherited - now
                if timeout <= 0:
                    raise RequestTimeout(cluster, 0.0, 0)
            label = BROADCAST_KIND if kind is Kind.BROADCAST else SURVEY_KIND
            span = None
            trace = _trace_in.get()  # a call handled here (or a gateway's) continues
            if self.tracing is not None:  # one CLIENT span for the call to every member
                span, trace = self.tracing.call(cluster, METHODS[int(kind)], trace)
            try:
                sent = core.fanout(int(kind), cluster, payload, timeout, now, trace)
            except MeshError as exc:
                if span is not None and self.tracing is not None:
                    self.tracing.end(span, exc)
                if self._telemetry is not None:
                    self._telemetry.refused(cluster, len(payload), exc, label)
                raise
        except MeshError:
            if self.turns.spend():  # refused at once: a retry loop must not keep the loop
                await self.turns.pause()
            raise
        futures: dict[str, asyncio.Future[bytes]] = {}
        series = self._recorder.series(label, cluster) if self._recorder is not None else None
        for req_id, member_id in sent:
            fut: asyncio.Future[bytes] = loop.create_future()
            started = _perf_counter() if series is not None else 0.0
            self._waiting[req_id] = (fut, cluster, started, series)
            futures[member_id.hex()] = fut
        driver.flush()
        driver.arm(now + timeout)
        try:
            await asyncio.wait(futures.values())
        except asyncio.CancelledError:
            for req_id, _member in sent:
                if self._waiting.pop(req_id, None) is not None:
                    core.cancel(req_id)
            if span is not None and self.tracing is not None:
                self.tracing.end(span, "cancelled")
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
        if span is not None and self.tracing is not None:
            span.set_attribute("irismesh.members", len(futures))
            span.set_attribute("irismesh.members_answered", len(answers))
            self.tracing.end(span)
        return answers, errors, missing

    def on_reply(self, event: ReplyArrived) -> None:
        """A reply as an event (a core without the sink `attach` sets)."""
        self._take_reply(event.req_id, event.status, event.payload, event.peer, self.events_at)

    def replied(self, req_id: int, status: int, payload: bytes, peer: bytes, now: float) -> None:
        """The reply to request `req_id` arrived at `now`: the core calls this as it reads it
        (`Calls.reply_sink`), which spares an event object and its dispatch per reply."""
        entry = self._waiting.pop(req_id, None)
        if entry is None:
            return
        if req_id == self._lone:  # busy polling: a lone request's round trip
            self._lone = -1
            if self.reply_spin is not None:
                self.reply_spin.observe(self._lone_spun, time.perf_counter() - self._lone_at)
        fut, cluster, started, series = entry
        if status == STATUS_OK:
            if not fut.done():
                fut.set_result(payload)
            if series is not None:  # Series.observe inlined: the caller's hot path
                us = int((_perf_counter() - started) * 1e6)
                series.histogram[us.bit_length()] += 1
                n = series.countdown - 1
                if n:
                    series.countdown = n
                else:
                    series.sample(peer, us, len(payload), _OK)
        else:
            kind, message = unpack_error(payload)
            if not fut.done():
                fut.set_exception(remote_error(cluster, kind, message))
            if series is not None:
                us = int((_perf_counter() - started) * 1e6)
                series.observe(peer, us, len(payload), _REMOTE_ERROR)

    def _replied_traced(
        self, req_id: int, status: int, payload: bytes, peer: bytes, now: float
    ) -> None:
        """`replied` for a tracing node: the request's CLIENT span (if it has one) ends first."""
        if self._spans:
            self._end_span(req_id, None if status == STATUS_OK else unpack_error(payload)[0])
        self.replied(req_id, status, payload, peer, now)

    def on_failed(self, event: RequestFailed) -> None:
        if event.req_id == self._lone:
            self._lone = -1
        entry = self._waiting.pop(event.req_id, None)
        if self._spans:
            self._end_span(event.req_id, event.error)
        if entry is not None:
            fut, _cluster, started, series = entry
            if not fut.done():
                fut.set_exception(event.error)
            if series is not None:
                us = int((_perf_counter() - started) * 1e6)
                series.observe(None, us, 0, outcome(event.error))


def as_bytes(payload: Any) -> bytes:
    """A bytes-like payload as bytes (TypeError for anything else)."""
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
