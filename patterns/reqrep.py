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
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from irismesh._core.events import RequestArrived, Token

RequestHandler = Callable[[bytes], Awaitable[bytes | bytearray | memoryview] | bytes]
Reply = Callable[[Token, bytes], None]
ReplyError = Callable[[Token, BaseException], None]
# (event, seconds the handler took, reply size, whether it succeeded): for telemetry
Served = Callable[[RequestArrived, float, int, bool], None]


_monotonic = time.monotonic  # one global lookup per request, not a module attribute too


class HandlerRunner:
    """Runs one node's request handler for each RequestArrived."""

    def __init__(
        self,
        reply: Reply,
        reply_error: ReplyError,
        after_async: Callable[[], None],
        served: Served | None = None,
        *,
        ack_only: bool = False,
    ) -> None:
        self._reply = reply
        self._reply_error = reply_error
        self._after_async = after_async  # flush what a handler finishing in a Task queued
        self._served = served
        self._ack_only = ack_only  # broadcasts: the reply only says the handler ran
        self.handler: RequestHandler | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.running = 0  # handlers suspended in a Task

    def run(self, event: RequestArrived) -> None:
        started = _monotonic() if self._served is not None else 0.0
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
        started: float,
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

    async def _await(
        self, event: RequestArrived, started: float, awaitable: Awaitable[Any]
    ) -> None:
        try:
            value = await awaitable
        except Exception as exc:
            self._fail(event, started, exc)
        else:
            self._finish(event, started, value)
        finally:
            self.running -= 1
            self._after_async()

    def _finish(self, event: RequestArrived, started: float, value: object) -> None:
        if self._ack_only:
            value = b""
        elif type(value) is not bytes:
            if not isinstance(value, bytearray | memoryview):
                kind = type(value).__name__
                self._fail(event, started, TypeError(f"request handler returned {kind}, not bytes"))
                return
            value = bytes(value)
        self._reply(event.token, value)
        if self._served is not None:
            self._served(event, _monotonic() - started, len(value), True)

    def _fail(self, event: RequestArrived, started: float, exc: BaseException) -> None:
        self._reply_error(event.token, exc)
        if self._served is not None:
            self._served(event, _monotonic() - started, 0, False)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
