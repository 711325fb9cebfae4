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
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from irismesh._core.events import RequestArrived, Token

RequestHandler = Callable[[bytes], Awaitable[bytes | bytearray | memoryview] | bytes]
Reply = Callable[[Token, bytes], None]
ReplyError = Callable[[Token, BaseException], None]


class HandlerRunner:
    """Runs one node's request handler for each RequestArrived."""

    def __init__(self, reply: Reply, reply_error: ReplyError, after_async: Callable[[], None]):
        self._reply = reply
        self._reply_error = reply_error
        self._after_async = after_async  # flush what a handler finishing in a Task queued
        self.handler: RequestHandler | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.running = 0  # handlers suspended in a Task

    def run(self, event: RequestArrived) -> None:
        token = event.token
        handler = self.handler
        if handler is None:
            self._reply_error(token, LookupError("this member has no request handler"))
            return
        try:
            result = handler(event.payload)
            if inspect.iscoroutine(result):
                try:
                    yielded = result.send(None)
                except StopIteration as stop:
                    self._finish(token, stop.value)
                    return
                self.running += 1
                task = asyncio.get_running_loop().create_task(self._resume(token, result, yielded))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                return
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(self._await(token, result))
                self.running += 1
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                return
        except Exception as exc:
            self._reply_error(token, exc)
            return
        self._finish(token, result)

    async def _resume(self, token: Token, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
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
                    self._finish(token, stop.value)
                    return
                except asyncio.CancelledError:
                    self._reply_error(token, ConnectionAbortedError("member is shutting down"))
                    return
                except Exception as exc:
                    self._reply_error(token, exc)
                    return
        finally:
            self.running -= 1
            self._after_async()

    async def _await(self, token: Token, awaitable: Awaitable[Any]) -> None:
        try:
            self._finish(token, await awaitable)
        except Exception as exc:
            self._reply_error(token, exc)
        finally:
            self.running -= 1
            self._after_async()

    def _finish(self, token: Token, value: object) -> None:
        if type(value) is bytes:
            self._reply(token, value)
        elif isinstance(value, bytearray | memoryview):
            self._reply(token, bytes(value))
        else:
            self._reply_error(
                token, TypeError(f"request handler returned {type(value).__name__}, not bytes")
            )

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
