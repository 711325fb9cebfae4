"""A gateway's importing side: the clusters its peers export, served in its own mesh.

Requests. For each cluster a linked peer exports, the gateway starts a node of its own mesh
that joins that cluster, so in this mesh the cluster's members are the gateways. Its handler
sends the request over a link to a peer exporting the cluster, with what is left of the
caller's deadline; the peer gateway asks its own mesh (`node.request`: that mesh's balancing,
failover and admission) and sends the reply back. A request a gateway cannot pass on (no link
up, or nobody across it could take it) is turned away unrun, so the caller's own failover
sends it to another gateway; when no link exporting a cluster is up, the gateway leaves the
cluster, so callers get `NoResponders` at once. A request for a cluster the peer does not
export is refused on the far side and counted (`requests_refused_not_exported`).

Ports. An import's node listens on the gateway node's host (that of `bind`, else `interface`):
on the first free port of `import_ports` when the operator gave a range, else on any free port;
never on the gateway node's own, so a gateway given a fixed `bind` serves every import too. An
import that cannot start (no free port left in the range, say) is logged once as an error,
shown by `mesh top` (the report's `errors`; `imports_not_started` counts them) and tried again
every `_IMPORT_RETRY` seconds.

Broadcasts and surveys. A broadcast or survey of an imported cluster reaches every gateway
serving it here; the one whose node for the cluster has the lowest id among those it is linked
to passes it on (so the far members get it once), and the far gateway broadcasts or surveys in
its mesh and answers: a survey with its members' answers as a msgpack map of member id to
answer (`far_answers` merges them; the other gateways answer with an empty map). While the
gateways' links to each other change, a broadcast may be passed on by two of them, or none.

Where grants are required. A node of a fresh identity holds no grant, so in such a mesh an
import's node could serve nothing. There the gateway's own node serves the imported clusters
instead (`Node.set_clusters`), beside `_gateway`: it holds the gateway's grant, whose `import`
lets it serve each one, and callers check that grant as any member's. Its requests,
broadcasts and surveys all come to `_on_node_request`, which tells them apart by cluster and
kind, and its tunnels to `tunnels.serve_import`. A change in what it imports has its callers
handshake again (see `Node.set_clusters`); it serves at most 64 clusters, `_gateway` among
them (the others are import errors). Without grants, each import keeps a node of its own.

In-process links. Gateways of several meshes in one process (`local.LocalGateways`) are
linked by `locallink.LocalEnd`s, which sit among the transport's ends: items cross them as they
are, with the same window and buffer bounds, and a request is handed straight to the far
gateway's `serve_request` (no item, no call id), which asks its mesh as `_on_request` does.
Where such a link is the only one up exporting a cluster, the importing gateway's node hands
that cluster's requests to the far gateway's node itself (`Node.relay_requests`): core to core,
with no Python call, event or Future per request (`_update_relays`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from functools import partial
from typing import TYPE_CHECKING

import msgpack

from irismesh._core.events import RequestArrived, RequestCancelled
from irismesh._core.frames import MAX_CLUSTERS, Kind, unpack_error
from irismesh._core.rights import GATEWAY_CLUSTER
from irismesh.errors import Closed, MeshError, NoResponders, Overloaded, RemoteError
from irismesh.federation.exports import BROADCAST, OK, REQUEST, SURVEY, TURNED_AWAY
from irismesh.federation.linkproto import Item
from irismesh.federation.state import GatewayState
from irismesh.node import DEFAULT_BIND, Node
from irismesh.patterns.reqrep import ForwardedError, TurnedAway, incoming_trace, time_left

if TYPE_CHECKING:
    from irismesh.patterns.tunnel import Tunnel

log = logging.getLogger("irismesh.federation")

_EMPTY_MAP: bytes = msgpack.packb({})
_SWEEP_EVERY = 1.0  # requests passed on whose callers' deadlines are gone: forgotten this often
_NEVER = float("inf")  # a request's deadline when it has none
_DEADLINE_PASSED = "the request's deadline passed while it was passed on"
_GAVE_UP = "the caller gave up while the request was passed on"
# An importing node's core counts the requests it relays (`Node.relay_requests`): the gateway's
# counts of the same names, as for requests passed on here.
_RELAY_IMPORTING = {
    "requests_relayed": "requests_forwarded",
    "requests_relay_turned_away": "requests_turned_away",
}
_IMPORT_RETRY = 5.0  # an import that could not start is tried again this often
_KIND_REQUEST, _KIND_BROADCAST = int(Kind.REQUEST), int(Kind.BROADCAST)
_TOO_MANY = f"the gateway's node serves at most {MAX_CLUSTERS} clusters"


class ImportedClusters(GatewayState):
    """Gateway's methods that serve here what its peers export, and pass the calls on."""

    def _reconcile(self) -> None:
        """Serve here every cluster an up link exports (and this keyring can serve); leave the
        others, so callers learn at once that nobody here answers them."""
        if self._closing:
            return
        if self._reconciling is not None and not self._reconciling.done():
            self._reconcile_again = True
            return
        self._reconciling = asyncio.get_running_loop().create_task(self._reconcile_loop())

    def _update_relays(self) -> None:
        """Each import whose one link up exporting it is in-process: its node relays the
        requests to the far gateway's node (`Node.relay_requests`); the others' requests come
        to `_pass_on`, which balances them over the links."""
        for cluster, node in self._imports.items():
            ends = [e for e in self.transport.ends if e.up and cluster in e.peer_exports.clusters]
            target = None
            if len(ends) == 1 and ends[0].relay_target is not None and not self._closing:
                target = ends[0].relay_target(cluster)
            try:
                node.relay_requests(cluster, target)
            except MeshError:  # a node closing: its requests pass on as they come, if any
                with contextlib.suppress(MeshError):
                    node.relay_requests(cluster, None)

    def relay_target(self, cluster: str) -> Node | None:
        """This gateway's node, where a gateway of this process may relay requests for
        `cluster` to it (`Node.relay_requests`): it exports the cluster and is running."""
        if self._closing or cluster not in self.export.clusters or not self.node.endpoint:
            return None
        return self.node

    def _relay_figures(self, out: dict[str, int]) -> None:
        """The relayed requests (counted by the nodes' cores) in the gateway's counts."""
        for node in {id(n): n for n in self._imports.values()}.values():
            figures = node.stats
            for key, into in _RELAY_IMPORTING.items():
                if figures.get(key):
                    out[into] = out.get(into, 0) + figures[key]
        served = self.node.stats.get("requests_relay_served", 0)
        if served:
            out["requests_served"] = out.get("requests_served", 0) + served

    def _wanted(self) -> set[str]:
        wanted = set()
        for end in self.transport.ends:
            if not end.up:
                continue
            for cluster in end.peer_exports.clusters:
                if not self.grant.may_import_cluster(cluster):
                    if cluster not in self.grant.refused_imports:  # counted once each
                        self.grant.refused_imports.add(cluster)
                        self.stats_counter["imports_refused_forbidden"] += 1
                elif self.keyring.primary(cluster) is not None:
                    wanted.add(cluster)
                else:
                    self.stats_counter["imports_without_key"] += 1
        return wanted

    async def _reconcile_loop(self) -> None:
        while True:
            self._reconcile_again = False
            wanted = self._wanted()
            if self._imports_here:
                self._import_here(wanted)
                self._update_relays()
                if not self._reconcile_again:
                    return
                continue
            for cluster in set(self.import_errors) - wanted:
                del self.import_errors[cluster]
            for cluster in sorted(set(self._imports) - wanted):
                node = self._imports.pop(cluster)
                figures = node.stats  # what it relayed stays counted
                for key, into in _RELAY_IMPORTING.items():
                    self.stats_counter[into] += figures.get(key, 0)
                await node.close()
            for cluster in sorted(wanted - set(self._imports)):
                await self._start_import(cluster)
            self._update_relays()
            if not self._reconcile_again:
                return

    async def _start_import(self, cluster: str) -> None:
        node = None
        error = "no port to listen on"
        for bind in self._import_binds():
            args = dict(self._node_args)
            args["seeds"] = [self.node.endpoint, *args["seeds"]]
            args["bind"] = bind
            name = None if self.name is None else f"{self.name}:{cluster}"[:64]
            node = Node(cluster, name=name, **args)
            # Requests pass on as they arrive (the far mesh's members admit), no handler each.
            node.forward_requests(partial(self._pass_on, node), self._given_up)
            node.on_broadcast(partial(self._forward_broadcast, cluster, node))
            node.on_survey(partial(self._forward_survey, cluster, node))
            node.on_tunnel(partial(self.tunnels.serve_import, cluster), accept=False)
            try:
                await node.start()
                break
            except MeshError as exc:  # its port taken, most likely: the next one of the range
                error = str(exc)
                node = None
        if node is None:
            self.stats_counter["imports_failed"] += 1
            if self.import_errors.get(cluster) != error:  # logged once, not at every retry
                log.error("gateway cannot serve cluster %r: %s", cluster, error)
            self.import_errors[cluster] = error
            if self._import_retry is None and not self._closing:
                self._import_retry = asyncio.get_running_loop().call_later(
                    _IMPORT_RETRY, self._retry_imports
                )
            return
        if self.import_errors.pop(cluster, None) is not None:
            log.warning("gateway serves cluster %r now (on %s)", cluster, node.endpoint)
        self._imports[cluster] = node

    def _import_here(self, wanted: set[str]) -> None:
        """The gateway's node serves `wanted` (as many as it can) beside what it serves
        anyway; its relays of clusters dropped stop."""
        room = MAX_CLUSTERS - len(self._serves)
        served = sorted(wanted)[:room]
        for cluster in set(self.import_errors) - wanted:
            del self.import_errors[cluster]
        for cluster in sorted(wanted)[room:]:
            if cluster not in self.import_errors:  # logged once, as an import that cannot start
                log.error("gateway cannot serve cluster %r: %s", cluster, _TOO_MANY)
                self.stats_counter["imports_failed"] += 1
            self.import_errors[cluster] = _TOO_MANY
        if set(served) == set(self._imports):
            return
        for cluster in set(self._imports) - set(served):
            with contextlib.suppress(MeshError):
                self.node.relay_requests(cluster, None)
        self.node.set_clusters([*self._serves, *served])
        self._imports = dict.fromkeys(served, self.node)
        if served:
            self._serve_here()

    def _serve_here(self) -> None:
        """The gateway's node takes its requests, broadcasts and surveys to any cluster in
        `_on_node_request`, its tunnels in `tunnels.serve_import` (once it serves one)."""
        if self._serving_here:
            return
        self._serving_here = True
        self.node.forward_requests(self._on_node_request, self._given_up, fanouts=True)
        self.node.on_tunnel(self._on_node_tunnel, accept=False)

    async def _on_node_tunnel(self, tunnel: Tunnel) -> None:
        await self.tunnels.serve_import(tunnel.cluster, tunnel)

    def _on_node_request(self, request: RequestArrived) -> None:
        """What comes to the gateway's node, where it serves the imported clusters itself:
        `_gateway`'s requests, broadcasts and surveys answered as its handlers would, the
        imported clusters' passed on."""
        cluster, kind, payload = request.cluster, request.kind, request.payload
        node = self.node
        if cluster == GATEWAY_CLUSTER:
            if kind == _KIND_REQUEST:
                try:
                    node.answer(request, self._describe(payload))
                except Exception as exc:  # answered as a handler's error would be
                    node.answer(request, exc)
            elif kind == _KIND_BROADCAST:
                try:
                    self._on_sync(payload)
                except Exception as exc:
                    node.answer(request, exc)
                else:
                    node.answer(request, b"")
            else:
                self._answer_later(request, self._on_gateway_survey(payload))
        elif kind == _KIND_REQUEST:
            self._pass_on(node, request)
        elif kind == _KIND_BROADCAST:
            self._answer_later(request, self._forward_broadcast(cluster, node, payload, request))
        else:
            self._answer_later(request, self._forward_survey(cluster, node, payload, request))

    def _answer_later(self, request: RequestArrived, answer: Awaitable[bytes | None]) -> None:
        """Answer `request` with what `answer` returns (an acknowledgement for None), or the
        error it raises, once it has; at the request's deadline it is given up (its caller
        has), as a handler's run would be."""
        task = asyncio.ensure_future(answer)
        self._answering.add(task)
        timer = None
        if request.deadline != _NEVER:
            left = max(0.0, request.deadline - time.monotonic())
            timer = asyncio.get_running_loop().call_later(left, self._overdue, task)

        def done(task: asyncio.Future[bytes | None]) -> None:
            self._answering.discard(task)
            if timer is not None:
                timer.cancel()
            if task.cancelled():
                if not self._closing:  # its deadline passed; closing, the node answers none
                    self.node.answer(request, TimeoutError(_DEADLINE_PASSED))
                return
            error = task.exception()
            if error is not None:
                self.node.answer(request, error)
            else:
                self.node.answer(request, task.result() or b"")

        task.add_done_callback(done)

    @staticmethod
    def _overdue(task: asyncio.Future[bytes | None]) -> None:
        task.cancel()

    def _retry_imports(self) -> None:
        self._import_retry = None
        self._reconcile()

    def _import_binds(self) -> list[str | None]:
        """Where an import node may listen, in the order tried: each free port of
        `import_ports`, else any free port on the gateway node's host (None: the node's own
        default, where the gateway was given neither `bind` nor a range)."""
        bind = self._node_args["bind"]
        interface = self._node_args["interface"]
        if bind is not None:
            host = bind.removeprefix("tcp://").rpartition(":")[0]
        elif interface is not None:
            host = interface
        elif self.import_ports is not None:
            host = DEFAULT_BIND.removeprefix("tcp://").rpartition(":")[0]
        else:
            return [None]
        if self.import_ports is None:
            return [f"tcp://{host}:0"]
        used = {n.endpoint.rpartition(":")[2] for n in self._imports.values()}
        first, last = self.import_ports
        return [f"tcp://{host}:{p}" for p in range(first, last + 1) if str(p) not in used]

    def _forward(
        self,
        cluster: str,
        payload: bytes,
        kind: str = REQUEST,
        request: RequestArrived | None = None,
    ) -> asyncio.Future[bytes]:
        """Pass a request (or a broadcast, a survey: `kind`) on over a link exporting
        `cluster`; its reply's future (no Task). Its deadline and trace context are its
        handler's (`time_left`), or those `request` came with, where it came with no handler
        run (`_on_node_request`)."""
        ends = [e for e in self.transport.ends if e.up and cluster in e.peer_exports.clusters]
        if not ends:
            if kind == REQUEST:
                self.stats_counter["requests_turned_away"] += 1
            raise TurnedAway("gateway_down")
        end = ends[0] if len(ends) == 1 else min(ends, key=lambda e: self._outstanding[id(e)])
        if request is None:
            left = time_left()
            trace = incoming_trace()  # the caller's context, passed on as it came
        else:
            at = request.deadline
            left = None if at == _NEVER else at - time.monotonic()
            trace = request.trace
        budget = self._default_timeout if left is None else left
        if budget <= 0:
            raise TurnedAway("deadline")
        call_id = next(self._call_ids)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, end)
        outstanding = self._outstanding
        outstanding[id(end)] += 1

        def done(_: asyncio.Future[bytes]) -> None:  # answered, failed, or its caller gave up
            self._calls.pop(call_id, None)
            outstanding[id(end)] -= 1

        future.add_done_callback(done)
        item = [kind, call_id, cluster, max(1, int(budget * 1000)), payload]
        if trace:
            item.append(trace)
        end.send_plain(item)
        if kind == REQUEST:
            self.stats_counter["requests_forwarded"] += 1
        self.transport.flush_soon()
        return future

    def _pass_on(self, node: Node, request: RequestArrived) -> None:
        """Pass a request on over a link exporting its cluster; answered in `_on_reply`."""
        cluster = request.cluster
        ends = self._ends_for.get(cluster)
        if ends is None:  # the links up that export it, until a link comes or goes
            ends = [e for e in self.transport.ends if e.up and cluster in e.peer_exports.clusters]
            self._ends_for[cluster] = ends
        if not ends:
            self.stats_counter["requests_turned_away"] += 1
            node.answer(request, TurnedAway("gateway_down"))
            return
        end = ends[0] if len(ends) == 1 else min(ends, key=lambda e: self._outstanding[id(e)])
        at = request.deadline
        budget = self._default_timeout if at == _NEVER else at - time.monotonic()
        if budget <= 0:
            node.answer(request, TurnedAway("deadline"))
            return
        serve = end.serve_request  # set on an in-process link: the far gateway, called
        if serve is not None:
            self.stats_counter["requests_forwarded"] += 1
            done = partial(self._served, node, request)
            serve(cluster, request.payload, budget, done, request.trace)
            return
        call_id = next(self._call_ids)
        item = [REQUEST, call_id, cluster, max(1, int(budget * 1000)), request.payload]
        if request.trace:  # the caller's trace context, passed on as it came
            item.append(request.trace)
        if not end.send_plain(item):  # the link went down since the ends were looked up
            self._ends_for.clear()
            self.stats_counter["requests_turned_away"] += 1
            node.answer(request, TurnedAway("gateway_down"))
            return
        self._passed[call_id] = (request, end, node)
        self._passed_ids[request.token[:2]] = call_id
        self._outstanding[id(end)] += 1
        self.stats_counter["requests_forwarded"] += 1
        self.transport.flush_soon()
        if self._sweeping is None:
            loop = asyncio.get_running_loop()
            self._sweeping = loop.call_later(_SWEEP_EVERY, self._sweep_passed)

    def _served(
        self,
        node: Node,
        request: RequestArrived,
        reply: bytes | None,
        error: BaseException | None,
    ) -> None:
        """The far gateway's answer to a request passed on in-process (`serve_request`)."""
        if reply is not None:
            node.answer(request, reply)
        elif isinstance(error, NoResponders | Overloaded | Closed):
            # Another gateway may take it (the far one closing is the link going down).
            self.stats_counter["requests_turned_away"] += 1
            node.answer(request, TurnedAway(type(error).__name__.lower()))
        elif isinstance(error, ForwardedError):
            node.answer(request, error)
        elif isinstance(error, RemoteError):
            node.answer(request, ForwardedError(error.remote_type, error.remote_message))
        elif error is not None:
            node.answer(request, ForwardedError(type(error).__name__, str(error)))

    def _settle(self, call_id: int) -> tuple[RequestArrived, Node] | None:
        """A passed-on request is done with: forgotten, its link's count down."""
        entry = self._passed.pop(call_id, None)
        if entry is None:
            return None
        request, end, node = entry
        self._passed_ids.pop(request.token[:2], None)
        self._outstanding[id(end)] -= 1
        return request, node

    def _given_up(self, event: RequestCancelled) -> bool:
        """A caller here gave up on a request passed on: answered at once (a member keeps a
        request's place until it is answered) and forgotten; its reply, if it comes, unknown."""
        call_id = self._passed_ids.get(event.token[:2])
        settled = None if call_id is None else self._settle(call_id)
        if settled is None:
            return False
        settled[1].answer(settled[0], ConnectionAbortedError(_GAVE_UP))
        return True

    def _sweep_passed(self) -> None:
        """Requests passed on whose callers' deadlines are gone, their replies lost: answered
        as a handler's would be at its deadline, and forgotten (one timer for them all)."""
        self._sweeping = None
        now = time.monotonic()
        for call_id, (request, _end, _node) in list(self._passed.items()):
            if request.deadline <= now:
                settled = self._settle(call_id)
                if settled is not None:
                    settled[1].answer(request, TimeoutError(_DEADLINE_PASSED))
        if self._passed and not self._closing:
            loop = asyncio.get_running_loop()
            self._sweeping = loop.call_later(_SWEEP_EVERY, self._sweep_passed)

    async def _forward_broadcast(
        self, cluster: str, node: Node, payload: bytes, request: RequestArrived | None = None
    ) -> None:
        """A broadcast to `cluster` here reaches every gateway serving it: one of them (the
        lowest node id among those this one is linked to) passes it on, so that the far mesh's
        members get it once; the far gateway broadcasts it there and answers once it has."""
        if not self._fans_out(cluster, node):
            self.stats_counter["broadcasts_left_to_another_gateway"] += 1
            return
        self.stats_counter["broadcasts_forwarded"] += 1
        await self._forward(cluster, payload, BROADCAST, request)

    async def _forward_survey(
        self, cluster: str, node: Node, payload: bytes, request: RequestArrived | None = None
    ) -> bytes:
        """A survey of `cluster` here: one gateway (as for broadcasts) asks the far mesh and
        answers with its members' answers, a msgpack map of member id to answer (`far_answers`
        merges them); the other gateways answer with an empty map."""
        if not self._fans_out(cluster, node):
            self.stats_counter["surveys_left_to_another_gateway"] += 1
            return _EMPTY_MAP
        self.stats_counter["surveys_forwarded"] += 1
        return await self._forward(cluster, payload, SURVEY, request)

    @staticmethod
    def _fans_out(cluster: str, node: Node) -> bool:
        """Whether this gateway's node for `cluster` has the lowest id of those serving it."""
        own = node.node_id.hex()
        return not any(other < own for other in node.members(cluster))

    def _on_reply(self, item: Item) -> None:
        if len(item) != 4 or type(item[1]) is not int or type(item[3]) is not bytes:
            self.stats_counter["dropped_malformed"] += 1
            return
        if self._passed:
            passed = self._settle(item[1])
            if passed is not None:
                request, node = passed
                status, body = item[2], item[3]
                if status == OK:
                    node.answer(request, body)
                elif status == TURNED_AWAY:
                    self.stats_counter["requests_turned_away"] += 1
                    reason = body.decode("utf-8", "replace")[:40] or "gateway"
                    node.answer(request, TurnedAway(reason))
                else:
                    node.answer(request, ForwardedError(*unpack_error(body)))
                return
        entry = self._calls.pop(item[1], None)
        if entry is None:
            self.stats_counter["replies_unknown"] += 1  # its caller gave up
            return
        future, status, body = entry[0], item[2], item[3]
        if future.done():
            return
        if status == OK:
            future.set_result(body)
        elif status == TURNED_AWAY:
            self.stats_counter["requests_turned_away"] += 1
            future.set_exception(TurnedAway(body.decode("utf-8", "replace")[:40] or "gateway"))
        else:
            future.set_exception(ForwardedError(*unpack_error(body)))
