"""The request/reply part of the Node API: serving requests, and making them.

`Node` inherits it. A member's handler runs in a `HandlerRunner` (admission, deadlines, a thread
pool for blocking handlers); a caller's requests go through the node's `Caller`, whose `request`
is inlined here (the hot path: one coroutine per request, not two). A gateway's nodes pass
requests on without a handler (`forward_requests`, `answer`), or relay them core to core
between two nodes of one process (`relay_requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar, overload

from irismesh._core.admission import Admission
from irismesh._core.events import RequestArrived, RequestFailed, Token
from irismesh._core.frames import Kind
from irismesh._core.priority import Priority
from irismesh._nodestate import NodeState
from irismesh.errors import (
    Closed,
    ConfigurationError,
    MembershipTimeout,
    MeshError,
    NoResponders,
    RequestTimeout,
)
from irismesh.patterns.reqrep import (
    Forward,
    ForwardCancelled,
    HandlerRunner,
    ReplyCallback,
    RequestHandler,
    deadline,
)
from irismesh.telemetry.recorder import Series

if TYPE_CHECKING:
    from irismesh.node import Node


H = TypeVar("H", bound=RequestHandler)
_KIND_REQUEST = int(Kind.REQUEST)


class RequestApi(NodeState):
    """Node's methods for request/reply."""

    @overload
    def on_request(self, handler: H, *, blocking: bool = False, admission: bool = True) -> H: ...

    @overload
    def on_request(
        self, handler: None = None, *, blocking: bool = False, admission: bool = True
    ) -> Callable[[H], H]: ...

    def on_request(
        self, handler: H | None = None, *, blocking: bool = False, admission: bool = True
    ) -> H | Callable[[H], H]:
        """Decorator: `handler(payload) -> bytes` (sync or async) answers this node's requests;
        `@node.on_request` or `@node.on_request(blocking=True)`.

        A plain function runs on the event loop, a few milliseconds of them at a time, and must
        not block; an `async def` handler may await freely. A handler that calls blocking code
        (a database driver, file I/O, a long computation in a C library) is declared
        `blocking=True`: it runs in the node's thread pool (`handler_threads` threads, which is
        then the most handlers that run at once), and the event loop stays free.

        Every request carries its caller's deadline: a handler reads it with
        `irismesh.deadline()` or `irismesh.time_left()`, requests it makes inherit what is left,
        and an `async def` handler still running when the caller gives up is cancelled. Requests
        beyond what the member can finish in time are turned away before they start (the caller
        gets `Overloaded`, or another member takes them): see docs/overload.md.

        `admission=False` is for a handler that only passes requests on (a gateway, a proxy):
        every request starts at once, and whoever answers it in the end admits it or not.
        """
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster serves no requests: pass cluster=")
        if blocking and not admission:
            raise ConfigurationError("a blocking handler runs within its thread pool's limit")

        def register(handler: H) -> H:
            runner = self._runner
            runner.handler = handler
            runner.blocking = blocking
            if not admission:
                runner.admission = None
            if blocking:
                runner.handler_pool(self._handler_threads, runner.admission)
            return handler

        return register if handler is None else register(handler)

    def forward_requests(
        self, forward: Forward, cancelled: ForwardCancelled, *, fanouts: bool = False
    ) -> None:
        """For a node that only passes requests on and answers them later (a gateway), with no
        handler run, Future or timer per request: `forward(request)` gets each request (a
        `RequestArrived`: its `payload`, `cluster`, and `deadline` on the event loop's clock)
        as it arrives, unadmitted (whoever answers it in the end admits it or not), and answers
        it once with `answer`, whatever happens: this node keeps each request's place until
        then. `cancelled(event)` hears of each caller that gave up (`event.token` is its
        request's), and says whether that request was still being forwarded; it is answered
        at once then (with an error: nobody reads it), and its reply forgotten.
        `fanouts=True`: broadcasts and surveys come to `forward` too (`request.kind` says
        which, `request.cluster` whose), for a node serving several clusters that answers
        each in its own way; a broadcast's answer is only its acknowledgement."""
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster serves no requests: pass cluster=")
        runner = self._runner
        runner.handler = None
        runner.admission = None
        runner.forward = forward
        runner.forward_cancelled = cancelled
        if fanouts:
            self._surveys = None  # surveys go to the request runner, so to `forward`
            self._broadcasts.forward = forward

    def answer(self, request: RequestArrived, reply: bytes | BaseException) -> None:
        """Answer a request `forward_requests` passed on: with the reply's bytes, or with what a
        handler would have raised (`TurnedAway`: turned away unrun, so the caller tries another
        member; `ForwardedError`: the error another member answered)."""
        core, driver = self._core, self._driver
        if type(reply) is bytes and core is not None and driver is not None and not self._closing:
            core.calls.reply(request.token, reply)  # the common case, without the runner
            driver.flush_soon()
        else:
            self._runner.answer(request, reply)

    def relay_requests(self, cluster: str, to: Node | None) -> None:
        """For a node that `forward_requests` (a gateway joining two meshes in one process):
        requests for `cluster` go straight to node `to`, of this process and event loop, which
        asks its own mesh for each as `request_callback` would; its reply, or its member's
        error, is this node's answer as it arrives, both nodes' sends in one pass, with no
        event, Future or Python call per request. What `to` cannot serve (no member, too many
        requests in flight, closing) is turned away unrun, so that its caller tries another
        member; any other failure is the answer. `to=None`: `forward` gets them again (those
        relayed already are answered as they come). Both nodes are started."""
        core, driver = self._core, self._driver
        if core is None or driver is None or self._closing:
            raise Closed("relaying needs a started node")
        if to is None:
            core.calls.relays.pop(cluster, None)
            return
        if to._core is None or to._driver is None or to._closing:
            raise Closed("relaying needs a started node to relay to")
        if to is self or to._driver.loop is not driver.loop:
            raise ConfigurationError("a relay joins two nodes of one event loop")
        if not to._relays_failures:  # its relayed requests that fail are answered here
            to._relays_failures = True
            to._listen(RequestFailed, to._relay_failed)
        core.calls.relays[cluster] = to._core.calls
        for one, other in ((driver, to._driver), (to._driver, driver)):
            if other not in one.partners:
                one.partners.append(other)

    def _relay_failed(self, event: RequestFailed) -> None:
        """A request this node asked for another's (`relay_requests`) failed: answered there."""
        core, driver = self._core, self._driver
        if (
            core is not None
            and driver is not None
            and core.calls.relaying
            and core.calls.relay_failed(event.req_id, event.error)
        ):
            for partner in driver.partners:
                partner.flush_soon()

    def _serving_runner(
        self,
        serving: Mapping[str, Series] | None,
        *,
        reply: Callable[[Token, bytes], None] | None = None,
        reply_error: Callable[[Token, BaseException], None] | None = None,
        turn_away: Callable[[Token, str], None] | None = None,
    ) -> HandlerRunner:
        """A runner for requests (or surveys, or queued jobs): within admission, answering
        Overloaded."""
        return HandlerRunner(
            reply or self._reply,
            reply_error or self._reply_error,
            self._flush_soon,
            serving,
            admission=Admission(
                max_limit=self._config.max_concurrency, max_queue=self._config.max_waiting
            ),
            turn_away=turn_away or self._turn_away,
            stats=self._serving_stats,
            tracing=self.tracing,
        )

    async def request(
        self,
        cluster: str,
        payload: bytes,
        *,
        timeout: float | None = None,
        hedge: float | bool | None = None,
        queue: bool = False,
        priority: int = Priority.NORMAL,
    ) -> bytes:
        """Send `payload` to one live member of `cluster` and return its reply.

        Raises NoResponders at once if the cluster has no live member, RequestTimeout after
        `timeout` seconds, RemoteError if the member's handler raised.

        `hedge` (for idempotent requests): if no reply came within `hedge` seconds (True: the
        cluster's measured p95 latency), send a copy to a second member; the first reply wins.

        `queue=True`: when the cluster has no live member, wait for one within the deadline
        instead of raising NoResponders (RequestTimeout if none came in time).

        `priority` (`Priority.LOW`, `NORMAL`, `HIGH`, or an int from -7 to 7; higher is more
        important): a busy member serves queued requests of a higher priority first, and turns
        away lower ones first; this node's outbox and the member's send a higher priority's
        request and reply ahead of lower ones. The lower classes keep a share of the member's
        handler runs, so they are never starved. See docs/overload.md.
        """
        if not queue:
            # Caller.request inlined (the hot path: one coroutine per request, not two).
            caller = self._caller
            try:
                req_id, fut = caller.send(cluster, payload, timeout, hedge, _KIND_REQUEST, priority)
            except MeshError:
                turns = caller.turns
                if turns.spend():  # refused at once: a retry loop must not keep the loop
                    await turns.pause()
                raise
            try:
                if caller.busy_poll and fut.done() and caller.turns.spend():
                    await caller.turns.pause()  # answered while it spun: no wait of its own
                return await fut
            except asyncio.CancelledError:
                caller.abandon(req_id)
                raise
        return await self._queued_request(cluster, payload, timeout, hedge, priority=priority)

    def start_request(
        self, cluster: str, payload: bytes, *, timeout: float | None = None
    ) -> asyncio.Future[bytes]:
        """Start a request and return the future of its reply, without a coroutine or a Task
        of its own: for code that passes many requests on (a gateway). The future fails as
        `request` raises; cancelling it cancels the request."""
        return self._caller.start(cluster, payload, timeout)

    def request_callback(
        self,
        cluster: str,
        payload: bytes,
        callback: ReplyCallback,
        *,
        timeout: float | None = None,
        trace: bytes = b"",
    ) -> None:
        """Start a request whose reply goes to `callback(reply, None)`, or its failure (what
        `request` would raise) to `callback(None, error)`, once, as it arrives: no Future and
        no turn of the event loop in between, for code that passes many requests on (a
        gateway). Raises at once what `request` would raise before sending. `trace` is the
        W3C trace context the request continues (`RequestArrived.trace` of a request passed
        on), sent as it is when this node makes no spans."""
        self._caller.start_callback(cluster, payload, timeout, callback, trace)

    async def _queued_request(
        self,
        cluster: str,
        payload: bytes,
        timeout: float | None,
        hedge: float | bool | None,
        kind: int = _KIND_REQUEST,
        priority: int = 0,
        trace: bytes = b"",
    ) -> bytes:
        self._caller.running()  # raises Closed, saying why
        budget = self._default_timeout if timeout is None else timeout
        if not budget > 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        until = time.monotonic() + budget
        inherited = deadline()  # within a handler: its caller's deadline bounds it
        if inherited is not None:
            until = min(until, inherited)
        waited = 0
        while True:
            left = until - time.monotonic()
            if left <= 0:
                raise RequestTimeout(cluster, budget, waited)
            try:
                return await self._caller.request(
                    cluster, payload, left, hedge, kind, priority, trace
                )
            except NoResponders:
                waited += 1
                self._serving_stats["requests_queued_for_member"] += 1
                with contextlib.suppress(MembershipTimeout):
                    await self.wait_for_members(cluster, 1, timeout=max(left, 0.001))
