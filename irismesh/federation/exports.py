"""A gateway's exporting side: the calls far gateways pass on, asked in its own mesh.

A request from across a link is [REQUEST, call id, cluster, budget in ms, payload] (and the
caller's trace context, when it has one); a broadcast or survey is the same with its own kind.
The gateway asks its mesh for it (`node.request_callback`: no Future, no loop turn; a
broadcast or survey in a task of its own, given `_FAR_SHARE` of the budget so that its answer
has time to return) and answers [REPLY, call id, status, body]: OK and the reply; TURNED_AWAY
when another gateway could still take it (nobody here, or overloaded), so the far caller's
failover tries it; else ERROR and the error. A call for a cluster not exported here is refused
and counted (`requests_refused_not_exported`). A request from a gateway of this process comes
without an item (`serve_request`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import msgpack

from irismesh._core.frames import MAX_TRACE, pack_error
from irismesh.errors import MeshError, NoResponders, Overloaded, RemoteError
from irismesh.federation.linkproto import Item, LinkEnd
from irismesh.federation.state import GatewayState
from irismesh.patterns.reqrep import ForwardedError, continue_trace

REQUEST, REPLY, BROADCAST, SURVEY = "req", "rep", "bc", "sv"  # the kinds of call items
OK, ERROR, TURNED_AWAY = 0, 1, 2  # a reply's status
_FAR_SHARE = 0.8  # of a broadcast's or survey's time the far mesh gets: its answer must return


class ExportedClusters(GatewayState):
    """Gateway's methods that answer the calls far gateways pass on to its exports."""

    def _exported(self, end: LinkEnd, call_id: int, cluster: str, what: str) -> bool:
        """Whether a far call of kind `what` to `cluster` is served here (counted as
        `<what>_served`); if the cluster is not exported the call is answered NoResponders
        (counted as `<what>_refused_not_exported`, or `<what>_refused_forbidden` for one its grant
        kept from being exported), and so it is if the far gateway's grant, where it is checked,
        does not let it import the cluster (`<what>_refused_far_grant`)."""
        if cluster not in self.export.clusters:
            why = "forbidden" if cluster in self._export_forbidden else "not_exported"
            self.stats_counter[f"{what}_refused_{why}"] += 1
            self._answer(
                end,
                call_id,
                ERROR,
                pack_error("NoResponders", f"no cluster {cluster!r} is exported here"),
            )
            return False
        if end.peer_grant is not None and not end.far_may_import_cluster(cluster):
            self.stats_counter[f"{what}_refused_far_grant"] += 1
            self._answer(
                end,
                call_id,
                ERROR,
                pack_error(
                    "NoResponders",
                    f"cluster {cluster!r} is not exported to a gateway whose grant does not "
                    "import it",
                ),
            )
            return False
        self.stats_counter[f"{what}_served"] += 1
        return True

    def _on_request(self, end: LinkEnd, item: Item) -> None:
        if not is_call(item):
            self.stats_counter["dropped_malformed"] += 1
            return
        _, call_id, cluster, budget_ms, payload = item[:5]
        trace = item[5] if len(item) > 5 else b""
        if not self._exported(end, call_id, cluster, "requests"):
            return
        try:  # answered as the reply arrives: no Future, no loop turn
            self.node.request_callback(
                cluster,
                payload,
                partial(self._replied, end, call_id),
                timeout=budget_ms / 1000,
                trace=trace,
            )
        except MeshError as exc:
            self._answered(end, call_id, exc)

    def serve_request(
        self,
        cluster: str,
        payload: bytes,
        timeout: float,
        done: Callable[[bytes | None, BaseException | None], None],
        trace: bytes = b"",
    ) -> None:
        """A request from a gateway of this process (an in-process link): asked in this mesh
        as one from across a link is (with its caller's `trace` context), its reply or error
        given to `done` as it arrives."""
        if cluster not in self.export.clusters:
            why = "forbidden" if cluster in self._export_forbidden else "not_exported"
            self.stats_counter[f"requests_refused_{why}"] += 1
            done(None, ForwardedError("NoResponders", f"no cluster {cluster!r} is exported here"))
            return
        self.stats_counter["requests_served"] += 1
        try:
            self.node.request_callback(cluster, payload, done, timeout=timeout, trace=trace)
        except MeshError as exc:
            done(None, exc)

    def _on_fanout(self, end: LinkEnd, item: Item) -> None:
        """A broadcast or survey from across the link: made in this mesh, answered once it is
        done (a survey with the answers, a msgpack map of member id to answer)."""
        if not is_call(item):
            self.stats_counter["dropped_malformed"] += 1
            return
        kind, call_id, cluster, budget_ms, payload = item[:5]
        trace = item[5] if len(item) > 5 else b""
        what = "broadcasts" if kind == BROADCAST else "surveys"
        if not self._exported(end, call_id, cluster, what):
            return
        timeout = budget_ms / 1000 * _FAR_SHARE
        if kind == BROADCAST:
            task = asyncio.get_running_loop().create_task(
                self._far_broadcast(cluster, payload, timeout, trace)
            )
        else:
            task = asyncio.get_running_loop().create_task(
                self._far_survey(cluster, payload, timeout, trace)
            )
        self._broadcasting.add(task)
        task.add_done_callback(self._broadcasting.discard)

        def done(task: asyncio.Task[bytes]) -> None:
            if task.cancelled():
                return
            exc = task.exception()
            if exc is None:
                self._answer(end, call_id, OK, task.result())
            else:
                self._answered(end, call_id, exc)

        task.add_done_callback(done)

    async def _far_broadcast(
        self, cluster: str, payload: bytes, timeout: float, trace: bytes
    ) -> bytes:
        continue_trace(trace)  # this task's own context: the far caller's trace goes on
        reached = await self.node.broadcast(cluster, payload, timeout=timeout)
        return msgpack.packb(reached)  # type: ignore[no-any-return]

    async def _far_survey(
        self, cluster: str, payload: bytes, timeout: float, trace: bytes
    ) -> bytes:
        continue_trace(trace)
        result = await self.node.survey(cluster, payload, timeout=timeout)
        return msgpack.packb(result.answers, use_bin_type=True)  # type: ignore[no-any-return]

    def _replied(
        self, end: LinkEnd, call_id: int, reply: bytes | None, error: BaseException | None
    ) -> None:
        if reply is not None:
            self._answer(end, call_id, OK, reply)
        elif error is not None:
            self._answered(end, call_id, error)

    def _answered(self, end: LinkEnd, call_id: int, exc: BaseException) -> None:
        """Send back what this mesh's request raised: turned away if another gateway could
        still take it (nobody here, or overloaded), else the error itself."""
        if isinstance(exc, NoResponders | Overloaded):
            self._answer(end, call_id, TURNED_AWAY, type(exc).__name__.lower().encode())
        elif isinstance(exc, RemoteError):
            self._answer(end, call_id, ERROR, pack_error(exc.remote_type, exc.remote_message))
        else:
            self._answer(end, call_id, ERROR, pack_error(type(exc).__name__, str(exc)))

    def _answer(self, end: LinkEnd, call_id: int, status: int, body: bytes) -> None:
        if not end.send_plain([REPLY, call_id, status, body]):
            self.stats_counter["replies_lost_link_down"] += 1
        self.transport.flush_soon()


def is_call(item: Item) -> bool:
    """A request, broadcast or survey item: [kind, call id, cluster, budget in ms, payload],
    and the caller's trace context after them when it has one."""
    return (
        (
            len(item) == 5
            or (len(item) == 6 and type(item[5]) is bytes and 0 < len(item[5]) <= MAX_TRACE)
        )
        and type(item[1]) is int
        and type(item[2]) is str
        and type(item[3]) is int
        and item[3] > 0
        and type(item[4]) is bytes
    )
