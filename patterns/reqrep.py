"""Request/reply on the asyncio side: running handlers and resolving callers' futures.

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

from irismesh._core.events import RequestArrived, Token
from irismesh.telemetry.schema import Outcome

if TYPE_CHECKING:
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
