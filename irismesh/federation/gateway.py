"""`Gateway`: one mesh's door to other meshes.

A gateway is a node of its own mesh (that mesh's keyring, seeds and discovery) plus links to
peer gateways of other meshes (`irismesh.federation.link`), authenticated and sealed under a
link key of their own. What it lets out of its mesh is its `export`: clusters, and topics by
pattern. What it lets in is what its peers export and its own keyring can serve.

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

Topics. The gateway subscribes in its mesh to the topics it exports and sends each message
published there, as a `Crossing`, over every link to a mesh the message has not been in; the
link keeps it until acknowledged (see `linkproto`). A gateway receiving a crossing republishes
it in its own mesh, once (`crossing.Barrier`), and passes it on to its other links. The
republished message carries its origin id (as `Message.id`): a subscriber delivers each id
once within its window of the last `pubsub.SEEN_IDS` ids, so a message that two gateways of
its mesh republish (one died before it acknowledged, or a restarted one was sent it again)
reaches each subscriber once (`Subscription.duplicates`, the node's
`messages_duplicates_dropped`).
Messages a gateway republished are not exported again by the gateways of that mesh (they know
each other as members of the cluster `_gateway`): a crossing carries its history only from
gateway to gateway, so a message crosses from mesh to mesh through one gateway process at a
time.

Redundant gateways. Several gateways of a mesh may export the same topics (for when one
dies): for each mesh they send to, they elect one forwarder, and the others keep what it has
not yet delivered and send it on when they take over (`irismesh.federation.redundancy`). Such
resends come marked (`RESENT`): the gateway receiving them asks the other gateways of its
mesh which of them they have republished already, and drops those.

In-process links. Gateways of several meshes in one process (`local.LocalGateways`) are
linked by `locallink.LocalEnd`s, which sit among the transport's ends: items cross them as they
are, with the same window and buffer bounds, and a request is handed straight to the far
gateway's `serve_request` (no item, no call id), which asks its mesh as `_on_request` does.
Where such a link is the only one up exporting a cluster, the importing gateway's node hands
that cluster's requests to the far gateway's node itself (`Node.relay_requests`): core to core,
with no Python call, event or Future per request (`_update_relays`).

Stats. `gateway.stats` counts what crossed, what was refused and what was dropped, with the
links' buffered items; the gateway's node answers requests to cluster `_gateway` with them,
which is how `mesh top` shows every gateway's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import msgpack
import zmq

from irismesh._core.events import RequestArrived, RequestCancelled
from irismesh._core.frames import MAX_TRACE, pack_error, unpack_error
from irismesh._core.topics import topic_matches, validate_pattern
from irismesh.errors import (
    Closed,
    ConfigurationError,
    MeshError,
    NoKey,
    NoResponders,
    Overloaded,
    RemoteError,
    SlowConsumer,
)
from irismesh.federation.crossing import CROSSING, RESENT, Barrier, Crossing, OriginIds
from irismesh.federation.link import LinkTransport, describe
from irismesh.federation.linkproto import TUNNEL as _TUNNEL
from irismesh.federation.linkproto import Exports, Item, LinkConfig, LinkEnd, link_secrets
from irismesh.federation.redundancy import Redundancy
from irismesh.federation.tunnels import MAX_TUNNEL_WINDOW, GatewayTunnels
from irismesh.node import DEFAULT_BIND, Node, SurveyResult
from irismesh.patterns.pubsub import Message, Subscription
from irismesh.patterns.reqrep import (
    ForwardedError,
    TurnedAway,
    continue_trace,
    incoming_trace,
    time_left,
)
from irismesh.patterns.tunnel import DEFAULT_WINDOW
from irismesh.security.keyring import Keyring
from irismesh.security.rotation import POLL_INTERVAL, KeyringFile

__all__ = ["GATEWAY_CLUSTER", "Gateway", "far_answers"]

log = logging.getLogger("irismesh.federation")

GATEWAY_CLUSTER = "_gateway"  # the gateways of a mesh: they answer it with their stats
_REQUEST, _REPLY, _BROADCAST, _SURVEY = "req", "rep", "bc", "sv"
_EMPTY_MAP: bytes = msgpack.packb({})
_FAR_SHARE = 0.8  # of a broadcast's or survey's time the far mesh gets: its answer must return
_OK, _ERROR, _TURNED_AWAY = 0, 1, 2
_MAX_MESH_NAME = 200
_SYNC_EVERY = 0.05  # redundant gateways: delivered ids told this often
_STATE_EVERY = 0.2  # and each one's links this often (a fellow silent for 3 s is gone)
_TOLD_BOUND = 1024  # messages for the other gateways waiting to be sent
_ACKED_PENDING_BOUND = 65_536  # delivered ids held back (`_report_delivered`); past it, told
_WARM_UP = 0.6  # a gateway holds what it would export this long: fellows make themselves known
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
_ASK_BATCH = 4096  # resent crossings one question to the other gateways covers, at most
_ASK_TIMEOUT = 1.0  # how long a takeover's resends wait for the other gateways' answers
_NOT_REPUBLISHED_KEPT = 4096  # crossings let through but not republished, remembered
_NATIVE_PUBLISHERS_KEPT = 4096  # publishers of this mesh known not to be gateways
_IMPORT_RETRY = 5.0  # an import that could not start is tried again this often
_MESH_WAIT = 3.0  # a gateway waits at most this long to know its mesh before it republishes
_MESH_SETTLED = 0.3  # ... and until the number of peers it knows has stayed the same this long
_ASKED = 2  # a question to the other gateways (STATE and DELIVERED are 0 and 1): which of
# these origin ids have you republished?


# A gateway's nodes and its link transport share one zmq context, and so do the gateways joined
# in one process (`LocalGateways`): one I/O thread for them all instead of one each (a gateway
# joining two meshes ran three nodes and a link transport, each with its own; sharing saved
# about a tenth of its CPU per request, measured). It holds what several contexts held, so its
# socket limit is raised. It is terminated once everything on it has closed, which waits for
# the goodbyes its sockets still hold to leave (as each node's own context did).
_SHARED_MAX_SOCKETS = 16384


def new_context() -> zmq.Context[zmq.Socket[bytes]]:
    """A zmq context for a gateway's nodes and links (its I/O thread starts with its first
    socket)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, _SHARED_MAX_SOCKETS)
    return ctx


def _check_link_keys(keyring: Keyring) -> None:
    link_secrets(keyring)  # ConfigurationError if it holds no link key


class Gateway:
    """A gateway of mesh `mesh` (a name every gateway of the federation uses for it).

    `keyring` is this mesh's; `link_keyring` holds the link key (scope `federation`, else its
    default key) that every gateway linked to this one shares. `listen` is where peer gateways
    dial in (tcp://HOST:PORT), `peers` the gateways this one dials. `export` names the clusters,
    `topics` the topic patterns, that leave this mesh through it. `buffer` bounds the published
    messages a link keeps for a peer it cannot reach (beyond it they are dropped and counted).
    `local=True`: the gateway is joined in-process to gateways of other meshes
    (`irismesh.federation.LocalGateways`), so it needs no `listen`, `peers` or `link_keyring`
    (it may have them too, for TCP links besides). `tunnel_window` is how many bytes of each
    tunnel through this gateway it lets the far gateway send before it grants more (its buffer
    per tunnel is about that much, plus one message).
    The rest (`seeds`, `bind`, `discovery`, `interface`, `name`) are the gateway's node's.
    `import_ports` (first, last): the ports the nodes serving imported clusters take, one each,
    on the host of `bind` (or `interface`); without it they take any free port there.
    """

    def __init__(
        self,
        mesh: str,
        *,
        keyring: Keyring,
        link_keyring: Keyring | None = None,
        listen: str | None = None,
        peers: Iterable[str] = (),
        export: Iterable[str] = (),
        topics: Iterable[str] = (),
        buffer: int = 100_000,
        link_config: LinkConfig | None = None,
        name: str | None = None,
        seeds: Iterable[str] = (),
        bind: str | None = None,
        discovery: bool | None = None,
        interface: str | None = None,
        default_timeout: float = 5.0,
        local: bool = False,
        tunnel_window: int = DEFAULT_WINDOW,
        import_ports: tuple[int, int] | None = None,
    ) -> None:
        if not mesh or len(mesh) > _MAX_MESH_NAME or not mesh.isprintable():
            raise ConfigurationError(f"a mesh name is 1-{_MAX_MESH_NAME} printable characters")
        peers = list(peers)
        if listen is None and not peers and not local:
            raise ConfigurationError("a gateway needs listen= or peers= (or both), or local=True")
        if link_keyring is None and (listen is not None or peers):
            raise ConfigurationError("a gateway with listen= or peers= needs link_keyring=")
        if type(tunnel_window) is not int or not 1 <= tunnel_window <= MAX_TUNNEL_WINDOW:
            raise ConfigurationError(
                f"tunnel_window must be 1 byte to 1 GiB, got {tunnel_window!r}"
            )
        if import_ports is not None:
            first, last = import_ports
            if not (type(first) is int and type(last) is int and 1 <= first <= last <= 65535):
                raise ConfigurationError(
                    "import_ports is (first, last), 1 <= first <= last <= 65535, got"
                    f" {import_ports!r}"
                )
        self.import_ports = import_ports
        self.mesh = mesh
        self.keyring = keyring
        self.export = Exports(
            clusters=tuple(dict.fromkeys(export)),
            topics=tuple(validate_pattern(p) for p in dict.fromkeys(topics)),
        )
        for cluster in self.export.clusters:
            keyring.require(cluster)  # to ask this mesh's members, the gateway needs the key
        if link_config is None:
            link_config = LinkConfig(buffer=buffer)
        elif buffer != 100_000:
            raise ConfigurationError("pass buffer= or link_config=, not both")
        self._link_config = link_config
        self.gateway_id = os.urandom(16)
        self.name = name
        self._context = new_context()  # terminated as the gateway closes, if its own
        self._owns_context = True
        self._node_args: dict[str, Any] = {
            "zmq_context": self._context,
            "keyring": keyring,
            "seeds": list(seeds),
            "bind": bind,
            "discovery": discovery,
            "interface": interface,
            "default_timeout": default_timeout,
        }
        self._default_timeout = default_timeout
        serves = [GATEWAY_CLUSTER] if keyring.primary(GATEWAY_CLUSTER) is not None else []
        self.node = Node(clusters=serves, name=name, **self._node_args)
        if serves:
            self.node.on_request(self._describe)
            self.node.on_survey(self._on_gateway_survey)
            self.node.on_broadcast(self._on_sync)
        self.link_keyring = link_keyring
        self._link_file: KeyringFile | None = None
        # The link keyring file is reread when it changes, as nodes reread theirs.
        if link_keyring is not None and link_keyring.path is not None:
            self._link_file = KeyringFile(link_keyring.path, link_keyring, check=_check_link_keys)
        self.transport = LinkTransport(
            gateway_id=self.gateway_id,
            mesh=mesh,
            secrets=() if link_keyring is None else link_secrets(link_keyring),
            exports=self.export,
            config=link_config,
            listen=listen,
            peers=peers,
            on_items=self._on_items,
            on_state=self._on_link_state,
            context=self._context,
        )
        self.stats_counter: Counter[str] = Counter()
        self._imports: dict[str, Node] = {}  # cluster -> the node that serves it here
        self.import_errors: dict[str, str] = {}  # cluster -> why its import could not start
        self._import_retry: asyncio.TimerHandle | None = None
        self._reconciling: asyncio.Task[None] | None = None
        self._reconcile_again = False
        self._calls: dict[int, tuple[asyncio.Future[bytes], LinkEnd]] = {}  # fan-outs
        # Requests passed on (`_pass_on`): call id -> (request, link, node), and the call ids
        # by request (the caller's id and its request id), for callers that give up.
        self._passed: dict[int, tuple[RequestArrived, LinkEnd, Node]] = {}
        self._passed_ids: dict[tuple[bytes, int], int] = {}
        self._sweeping: asyncio.TimerHandle | None = None
        self._ends_for: dict[str, list[LinkEnd]] = {}  # cluster -> links up exporting it
        # id(link end) -> the sequence number up to which what it held was carried over to
        # another link to the same mesh (`_carry_over`).
        self._carried: dict[int, int] = {}
        self._broadcasting: set[asyncio.Task[bytes]] = set()  # from across a link
        self._call_ids = itertools.count(1)
        self._outstanding: Counter[int] = Counter()  # id(link end) -> requests through it
        self._origin_ids = OriginIds()
        self._barrier = Barrier()
        # Crossings to republish, with the link each came by (acknowledged once republished)
        # and whether a takeover resent it.
        self._inbound: asyncio.Queue[tuple[LinkEnd, Crossing, bool]] | None = None
        self._queued = 0  # crossings put in `_inbound`, and taken out and done with
        self._done = 0
        self._progress: asyncio.Event | None = None  # set as each is done
        self._not_republished: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Subscription] = []
        self._drained: asyncio.Event | None = None
        self._gateway_ids: set[str] = set()
        self._native_publishers: OrderedDict[str, None] = OrderedDict()  # see `_native`
        self._redundancy: Redundancy | None = None
        self._warm: asyncio.Event | None = None  # set once the first election is made
        self._told: deque[list[Any]] = deque()  # for the other gateways here, to send
        # Acknowledged by the far side, not yet told the standbys: (when, mesh, origin ids).
        self._acked_pending: deque[tuple[float, str, list[bytes]]] = deque()
        self._acked_pending_ids = 0
        self._telling: asyncio.Task[None] | None = None
        self._state_at = 0.0  # when this gateway last told its links
        self._linked_since: dict[str, float] = {}  # mesh -> when a link to it was first known
        self._shared: frozenset[str] = frozenset()  # meshes fellows link to too (see _reach)
        self._closing = False
        # Tunnels across the links (see `irismesh.federation.tunnels`).
        self.tunnels = GatewayTunnels(
            links=lambda: self.transport.ends,
            exports=lambda: self.export.clusters,
            node=lambda: self.node,
            flush_soon=self.transport.flush_soon,
            stats=self.stats_counter,
            window=tunnel_window,
            open_timeout=default_timeout,
        )

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> Gateway:
        await self.node.start()
        self._gateway_ids = {self.node.node_id.hex()}
        self._inbound = asyncio.Queue()
        self._progress = asyncio.Event()
        self._drained = asyncio.Event()
        self.transport.start()
        self._tasks.append(asyncio.create_task(self._republish()))
        if self._link_file is not None:
            self._tasks.append(asyncio.create_task(self._watch_link_keyring()))
        if GATEWAY_CLUSTER in self.node.clusters:
            self._tasks.append(asyncio.create_task(self._watch_gateways()))
            if self.export.topics:
                self._redundancy = Redundancy(
                    self.node.node_id.hex(),
                    time.time(),
                    self.export.topics,
                    self.transport.config.buffer,
                )
                self._warm = asyncio.Event()
                self._tasks.append(asyncio.create_task(self._sync()))
        for index, pattern in enumerate(self.export.topics):
            earlier = self.export.topics[:index]
            sub = self.node.subscribe(pattern, policy="block", maxsize=4096)
            self._subs.append(sub)
            self._tasks.append(asyncio.create_task(self._export_topic(sub, earlier)))
        return self

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        await self.tunnels.close()  # every tunnel through here reset, at both ends
        self.transport.flush()
        for sub in self._subs:
            sub.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._redundancy is not None:  # the last acknowledgements, for who takes over
            with contextlib.suppress(Exception):
                await self._report_delivered()
                if self._telling is not None:
                    await asyncio.wait_for(self._telling, 1.0)
        if self._telling is not None:
            self._telling.cancel()
        for broadcast in list(self._broadcasting):
            broadcast.cancel()
        if self._sweeping is not None:
            self._sweeping.cancel()
        if self._import_retry is not None:
            self._import_retry.cancel()
        if self._reconciling is not None:
            self._reconciling.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reconciling
        self.transport.close()
        for node in list(self._imports.values()):
            await node.close()
        self._imports.clear()
        await self.node.close()
        if self._owns_context:  # once the goodbyes its sockets hold have left
            self._owns_context = False
            await asyncio.get_running_loop().run_in_executor(None, self._context.term)

    async def __aenter__(self) -> Gateway:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def share_context(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Use `ctx` for this gateway's nodes and links instead of a context of its own, and
        leave terminating it to whoever made it (`LocalGateways`); before `start`."""
        if self.node.endpoint:
            raise ConfigurationError("a gateway takes a shared context before it starts")
        own, self._context, self._owns_context = self._context, ctx, False
        own.term()  # no socket was made on it
        self._node_args["zmq_context"] = ctx
        self.node.zmq_context = ctx
        self.transport.context = ctx

    # ------------------------------------------------------------- the link keyring

    def use_link_keyring(self, keyring: Keyring) -> None:
        """Take these link keys now (ConfigurationError, keys in use kept, if none is a link
        key). Links whose session used a key no longer in it are dialled again under the new
        one; the others go on."""
        secrets = link_secrets(keyring)
        self.link_keyring = keyring
        self.transport.use_secrets(secrets)
        self.stats_counter["link_keyring_changes"] += 1

    def reload_link_keyring(self) -> bool:
        """Read the link keyring file now (SIGHUP): True if it held new keys, now in use; a
        file that cannot be used is refused with one logged line, the keys in use kept."""
        if self._link_file is None:
            return False
        keyring = self._link_file.reload()
        if keyring is None:
            return False
        self.use_link_keyring(keyring)
        return True

    async def _watch_link_keyring(self) -> None:
        """Poll the link keyring file, as a node polls its own (`security.rotation`)."""
        assert self._link_file is not None
        while True:
            await asyncio.sleep(POLL_INTERVAL)
            try:
                keyring = self._link_file.poll()
                if keyring is not None:
                    self.use_link_keyring(keyring)
            except Exception:  # the watch outlives an error in applying a keyring (logged)
                log.exception("gateway: applying the link keyring failed")

    # ------------------------------------------------------------- views

    @property
    def endpoint(self) -> str:
        """Where this gateway listens for peer gateways ("" when it only dials)."""
        return self.transport.endpoint

    @property
    def stats(self) -> dict[str, int]:
        """What crossed, was refused or dropped; `link_buffered` and `links_up` are gauges."""
        out = dict(self.stats_counter)
        self._relay_figures(out)
        out.update(self.transport.figures())
        out["duplicates_dropped"] = self._barrier.duplicates
        out["imports"] = len(self._imports)
        out["imports_not_started"] = len(self.import_errors)
        if self._link_file is not None:
            out["link_keyring_refused"] = self._link_file.refused
        out["republish_queue"] = 0 if self._inbound is None else self._inbound.qsize()
        out["requests_in_flight"] = len(self._passed)  # passed on, not answered yet
        out.update(self.tunnels.figures())
        if self._redundancy is not None:
            out.update(self._redundancy.stats)
            out["standby_held"] = self._redundancy.held()
            out["forwarding"] = sum(self._redundancy.forwarding.values())
            out["fellows"] = len(self._redundancy.fellows)
        return out

    def links(self) -> list[dict[str, Any]]:
        return [describe(end) for end in self.transport.ends]

    def imports(self) -> list[str]:
        """The clusters this gateway serves in its mesh for its peers."""
        return sorted(self._imports)

    def _describe(self, payload: bytes) -> bytes:
        """The `_gateway` cluster's answer: this gateway's stats and links."""
        report = {
            "mesh": self.mesh,
            "name": self.node.name,
            "gateway_id": self.gateway_id.hex(),
            "stats": self.stats,
            "links": self.links(),
            "errors": [f"cannot serve cluster {c!r}: {e}" for c, e in self.import_errors.items()],
        }
        return msgpack.packb(report, use_bin_type=True)  # type: ignore[no-any-return]

    # ------------------------------------------------------------- links

    def _on_link_state(self, end: LinkEnd, up: bool) -> None:
        self.stats_counter["link_ups" if up else "link_down_events"] += 1
        self._ends_for.clear()
        self._update_relays()
        if up:
            self._carry_over(end, end)
        else:
            self._carry_over(end, None)
            for call_id, (future, via) in list(self._calls.items()):
                if via is end and not future.done():
                    future.set_exception(TurnedAway("gateway_link_down"))
                    self._calls.pop(call_id, None)
            for call_id, (_request, via, _node) in list(self._passed.items()):
                if via is end and (settled := self._settle(call_id)) is not None:
                    settled[1].answer(settled[0], TurnedAway("gateway_link_down"))
            self.tunnels.link_down(end)
        if self._drained is not None:
            self._drained.set()  # exporters waiting on this link's window wake and look again
        self._reconcile()

    def _carry_over(self, end: LinkEnd, to: LinkEnd | None) -> None:
        """Messages a link to a mesh holds unacknowledged are sent on another link to that
        mesh too, marked resent, before any new one: when a link comes up (`to`: a gateway
        restarted there dialled in as a new peer, while the link to the one that died may not
        know yet) from every other link to that mesh, and when a link goes down (`to` None)
        from it, to a link up. The far gateway asks its fellows which of them it republished,
        and the subscribers deliver each once. The source link keeps its copies (its peer may
        come back); each message is carried over once (`_carried`)."""
        mesh = end.peer_mesh
        ends = self.transport.ends
        live = {id(e) for e in ends}
        for gone in [k for k in self._carried if k not in live]:  # forgotten ends
            del self._carried[gone]
        if to is None:
            to = next((e for e in ends if e.up and e.peer_mesh == mesh), None)
            sources = [end]
        else:
            sources = [e for e in ends if e is not to and e.peer_mesh == mesh]
        if to is None:
            return
        now = asyncio.get_running_loop().time()
        for source in sources:
            if source.peer_id == to.peer_id:
                continue
            # With what its peer acknowledged a moment ago: that peer may have died with the
            # messages still in its node's buffers (`LinkConfig.keep_acked`). The far side
            # asks its fellows about resends, and the subscribers deliver each id once.
            items, next_seq = source.unacknowledged(self._carried.get(id(source), 0), now)
            self._carried[id(source)] = next_seq
            for item in items:
                if item[0] in (CROSSING, RESENT) and self._send(to, [RESENT, *item[1:]]):
                    self.stats_counter["messages_carried_over"] += 1
        self.transport.flush_soon()

    def _send(self, end: LinkEnd, wire: Item) -> bool:
        """A reliable item on `end`; counted as carried over already if `end` is the source
        of a carry-over (it was sent on every other link to its mesh too)."""
        if not end.send(wire):
            return False
        carried = self._carried
        if carried and id(end) in carried:
            carried[id(end)] += 1
        return True

    def _on_items(self, end: LinkEnd, items: list[Item]) -> None:
        for item in items:
            if not item or type(item[0]) is not str:
                self.stats_counter["dropped_malformed"] += 1
                continue
            kind = item[0]
            try:
                if kind in (CROSSING, RESENT):
                    try:
                        crossing = Crossing.from_wire(item)
                    except MeshError:
                        end.consumed()
                        raise
                    self._on_crossing(end, crossing, resent=kind == RESENT)
                elif kind == _REQUEST:
                    self._on_request(end, item)
                elif kind in (_BROADCAST, _SURVEY):
                    self._on_fanout(end, item)
                elif kind == _REPLY:
                    self._on_reply(item)
                elif kind == _TUNNEL:
                    self.tunnels.on_item(end, item)
                else:
                    self.stats_counter["dropped_unknown_item"] += 1
            except MeshError:
                self.stats_counter["dropped_malformed"] += 1
        if self._drained is not None:
            self._drained.set()

    # ------------------------------------------------------------- requests, importing side

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
        for node in self._imports.values():
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
                if self.keyring.primary(cluster) is not None:
                    wanted.add(cluster)
                else:
                    self.stats_counter["imports_without_key"] += 1
        return wanted

    async def _reconcile_loop(self) -> None:
        while True:
            self._reconcile_again = False
            wanted = self._wanted()
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

    def _forward(self, cluster: str, payload: bytes, kind: str = _REQUEST) -> asyncio.Future[bytes]:
        """Pass a request (or a broadcast, a survey: `kind`) on over a link exporting
        `cluster`; its reply's future (no Task)."""
        ends = [e for e in self.transport.ends if e.up and cluster in e.peer_exports.clusters]
        if not ends:
            if kind == _REQUEST:
                self.stats_counter["requests_turned_away"] += 1
            raise TurnedAway("gateway_down")
        end = ends[0] if len(ends) == 1 else min(ends, key=lambda e: self._outstanding[id(e)])
        left = time_left()
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
        trace = incoming_trace()  # the caller's context, passed on as it came
        if trace:
            item.append(trace)
        end.send_plain(item)
        if kind == _REQUEST:
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
        item = [_REQUEST, call_id, cluster, max(1, int(budget * 1000)), request.payload]
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

    async def _forward_broadcast(self, cluster: str, node: Node, payload: bytes) -> None:
        """A broadcast to `cluster` here reaches every gateway serving it: one of them (the
        lowest node id among those this one is linked to) passes it on, so that the far mesh's
        members get it once; the far gateway broadcasts it there and answers once it has."""
        if not self._fans_out(cluster, node):
            self.stats_counter["broadcasts_left_to_another_gateway"] += 1
            return
        self.stats_counter["broadcasts_forwarded"] += 1
        await self._forward(cluster, payload, _BROADCAST)

    async def _forward_survey(self, cluster: str, node: Node, payload: bytes) -> bytes:
        """A survey of `cluster` here: one gateway (as for broadcasts) asks the far mesh and
        answers with its members' answers, a msgpack map of member id to answer (`far_answers`
        merges them); the other gateways answer with an empty map."""
        if not self._fans_out(cluster, node):
            self.stats_counter["surveys_left_to_another_gateway"] += 1
            return _EMPTY_MAP
        self.stats_counter["surveys_forwarded"] += 1
        return await self._forward(cluster, payload, _SURVEY)

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
                if status == _OK:
                    node.answer(request, body)
                elif status == _TURNED_AWAY:
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
        if status == _OK:
            future.set_result(body)
        elif status == _TURNED_AWAY:
            self.stats_counter["requests_turned_away"] += 1
            future.set_exception(TurnedAway(body.decode("utf-8", "replace")[:40] or "gateway"))
        else:
            future.set_exception(ForwardedError(*unpack_error(body)))

    # ------------------------------------------------------------- requests, exporting side

    def _on_request(self, end: LinkEnd, item: Item) -> None:
        if not _is_call(item):
            self.stats_counter["dropped_malformed"] += 1
            return
        _, call_id, cluster, budget_ms, payload = item[:5]
        trace = item[5] if len(item) > 5 else b""
        if cluster not in self.export.clusters:
            self.stats_counter["requests_refused_not_exported"] += 1
            self._answer(
                end,
                call_id,
                _ERROR,
                pack_error("NoResponders", f"no cluster {cluster!r} is exported here"),
            )
            return
        self.stats_counter["requests_served"] += 1
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
            self.stats_counter["requests_refused_not_exported"] += 1
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
        if not _is_call(item):
            self.stats_counter["dropped_malformed"] += 1
            return
        kind, call_id, cluster, budget_ms, payload = item[:5]
        trace = item[5] if len(item) > 5 else b""
        what = "broadcasts" if kind == _BROADCAST else "surveys"
        if cluster not in self.export.clusters:
            self.stats_counter[f"{what}_refused_not_exported"] += 1
            self._answer(
                end,
                call_id,
                _ERROR,
                pack_error("NoResponders", f"no cluster {cluster!r} is exported here"),
            )
            return
        self.stats_counter[f"{what}_served"] += 1
        timeout = budget_ms / 1000 * _FAR_SHARE
        if kind == _BROADCAST:
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
                self._answer(end, call_id, _OK, task.result())
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
            self._answer(end, call_id, _OK, reply)
        elif error is not None:
            self._answered(end, call_id, error)

    def _answered(self, end: LinkEnd, call_id: int, exc: BaseException) -> None:
        """Send back what this mesh's request raised: turned away if another gateway could
        still take it (nobody here, or overloaded), else the error itself."""
        if isinstance(exc, NoResponders | Overloaded):
            self._answer(end, call_id, _TURNED_AWAY, type(exc).__name__.lower().encode())
        elif isinstance(exc, RemoteError):
            self._answer(end, call_id, _ERROR, pack_error(exc.remote_type, exc.remote_message))
        else:
            self._answer(end, call_id, _ERROR, pack_error(type(exc).__name__, str(exc)))

    def _answer(self, end: LinkEnd, call_id: int, status: int, body: bytes) -> None:
        if not end.send_plain([_REPLY, call_id, status, body]):
            self.stats_counter["replies_lost_link_down"] += 1
        self.transport.flush_soon()

    # ------------------------------------------------------------- topics

    async def _export_topic(self, sub: Subscription, earlier: Sequence[str]) -> None:
        async for msg in sub:
            if any(topic_matches(p, msg.topic) for p in earlier):
                continue  # an earlier pattern's subscription has it
            if not self._native(msg):
                continue
            if self._warm is not None and not self._warm.is_set():
                await self._warm.wait()  # the publishers wait the while, as on a full window
            origin_id = self._origin_ids.origin_id(msg.publisher, msg.topic, msg.payload)
            crossing = Crossing(
                self.mesh, origin_id, (self.mesh,), msg.topic, msg.payload, msg.trace
            )
            self._barrier.first(crossing)  # a copy coming back by another way is dropped
            self.stats_counter["messages_exported"] += 1
            await self._cross(crossing, native=True)

    def _native(self, msg: Message) -> bool:
        """Published in this mesh, not republished by one of its gateways.

        The ids of the gateways are a snapshot, refreshed each second; a publisher met for the
        first time is looked up in membership at once, so a gateway that joined since (or
        before this one's first look) is known before its first republished message is taken
        for a native one: exported again under a new origin id, that message would reach the
        other meshes twice. A node that serves `_gateway` says so when it links to this one,
        and a message comes only over such a link. Publishers found not to be gateways are
        remembered (a bounded table), so the lookup is made once per publisher."""
        publisher = msg.publisher
        if publisher in self._gateway_ids:
            return False
        if publisher in self._native_publishers:
            self._native_publishers.move_to_end(publisher)
            return True
        if GATEWAY_CLUSTER in self.node.clusters:
            self._gateway_ids = self._gateway_ids | set(self.node.members(GATEWAY_CLUSTER))
            if publisher in self._gateway_ids:
                self.stats_counter["gateways_learned_from_messages"] += 1
                return False
        self._native_publishers[publisher] = None
        if len(self._native_publishers) > _NATIVE_PUBLISHERS_KEPT:
            self._native_publishers.popitem(last=False)
        return True

    async def _watch_gateways(self) -> None:
        """Keep the ids of this mesh's gateways (members of `_gateway`) a second fresh (and
        fresher where `_native` meets a publisher it does not know)."""
        own = self.node.node_id.hex()
        while True:
            self._gateway_ids = {own, *self.node.members(GATEWAY_CLUSTER)}
            await asyncio.sleep(1.0)

    async def _cross(self, crossing: Crossing, *, native: bool = False) -> None:
        """Send to every link towards a mesh the message has not been in. A message published
        here (`native`) waits while a link that is up has a full window (its publishers wait
        too); one passing on from another mesh does not: the republishing run that passes it
        on is what acknowledges the link it came by, and in meshes linked in a cycle each
        gateway's run would wait on the next one's window, for ever. Such a message goes into
        the link's buffer, past its window (`relayed_past_window`), and past the buffer's bound
        it is dropped and counted, as a link that is down keeps what it is sent up to that
        bound. A message published here goes only to the meshes this gateway is the forwarder
        for; for the others it is held (see `redundancy`).

        Such a message is marked, on each copy, as seen in the other meshes that this gateway
        and another gateway of this mesh both link to: the elected one of them sends it there,
        the others hold it for their takeover, so the receiver does not relay it there too
        (the copies would reach that mesh through two gateway processes, each republishing
        it, where one barrier sees them both when a single gateway links to it)."""
        reach = self._reach(crossing) if native else []
        plain = crossing.wire()
        known = False
        redundancy = self._redundancy if native else None
        for end in self.transport.ends:
            if not end.peer_mesh:
                continue  # a link never up: whose mesh it leads to is not known yet
            known = True
            if end.peer_mesh in crossing.seen:
                continue
            if redundancy is not None and not redundancy.forwarding.get(end.peer_mesh, False):
                redundancy.hold(end.peer_mesh, crossing)
                continue
            if end.buffered >= end.config.window * 2:
                if not native:
                    self.stats_counter["relayed_past_window"] += 1
                while native and end.up and end.buffered >= end.config.window * 2:
                    assert self._drained is not None
                    self.transport.flush_soon()  # what waits goes out while this waits
                    self._drained.clear()
                    await self._drained.wait()
            marked = reach and (len(reach) > 1 or reach[0] != end.peer_mesh)
            wire = self._marked(crossing, end.peer_mesh, reach) if marked else plain
            if self._send(end, wire):
                self.stats_counter["messages_sent"] += 1
        if not known:
            self.stats_counter["messages_no_link"] += 1  # no mesh to send it to yet
        self.transport.flush_soon()

    def _reach(self, crossing: Crossing) -> list[str]:
        """The meshes, not yet seen by `crossing`, this gateway links to (its link up or
        down: a link down keeps what it is sent, to replay in order) and so does another
        gateway of this mesh exporting the same topics (see `_cross`)."""
        shared = self._shared
        reach: list[str] = []
        for end in self.transport.ends:
            mesh = end.peer_mesh
            if mesh in shared and mesh not in crossing.seen and mesh not in reach:
                reach.append(mesh)
        return reach

    @staticmethod
    def _marked(crossing: Crossing, to: str, reach: list[str], kind: str = CROSSING) -> list[Any]:
        """`crossing` as sent to mesh `to`, marked as seen in the rest of `reach`."""
        return crossing.wire(kind, [m for m in reach if m != to])

    def _on_crossing(self, end: LinkEnd, crossing: Crossing, *, resent: bool = False) -> None:
        if self.mesh in crossing.seen:
            self.stats_counter["loops_dropped"] += 1
            end.consumed()
            return
        if not self._barrier.first(crossing):
            end.consumed()
            return
        self.stats_counter["messages_received"] += 1
        if resent:
            self.stats_counter["resends_received"] += 1
        assert self._inbound is not None
        self._inbound.put_nowait((end, crossing, resent))
        self._queued += 1

    async def _republish(self) -> None:
        """Publish crossings here one at a time, in the order they came, then pass them on.
        What a takeover resent is first checked with this mesh's other gateways (see
        `_republished_elsewhere`), a run of them at a time."""
        inbound, progress = self._inbound, self._progress
        assert inbound is not None
        assert progress is not None
        carried: tuple[LinkEnd, Crossing, bool] | None = None
        await self._know_the_mesh()
        while True:
            entry = carried if carried is not None else await inbound.get()
            carried = None
            end, crossing, resent = entry
            if not resent:
                await self._republish_one(end, crossing)
                self._done += 1
                progress.set()
                continue
            run = [(end, crossing)]
            while len(run) < _ASK_BATCH and not inbound.empty():
                following = inbound.get_nowait()
                if not following[2] or following[1].origin != crossing.origin:
                    carried = following
                    break
                run.append((following[0], following[1]))
            there = await self._republished_elsewhere(crossing.origin, [c for _, c in run])
            for (end, crossing), elsewhere in zip(run, there, strict=True):
                if elsewhere:
                    self.stats_counter["resends_dropped_republished_elsewhere"] += 1
                    end.consumed()
                    self.transport.flush_soon()
                else:
                    await self._republish_one(end, crossing)
                self._done += 1
                progress.set()

    async def _know_the_mesh(self) -> None:
        """Before the first republish: wait until this gateway's node knows its mesh. A node
        just started knows no subscriber yet, and what it published would reach nobody (a
        restarted gateway is sent at once what its link holds). Done when it has peers and
        their number has not changed for `_MESH_SETTLED`; at most `_MESH_WAIT` (a gateway
        alone in its mesh, or with its imports' nodes only). Crossings wait meanwhile,
        unacknowledged."""
        loop = asyncio.get_running_loop()
        started = since = loop.time()
        count = -1
        while (now := loop.time()) - started < _MESH_WAIT:
            # Its own imports' nodes do not count: seeded with this node, they are the first
            # peers it knows, and a mesh of them alone has no subscriber in it.
            own = {node.node_id.hex() for node in self._imports.values()}
            known = sum(1 for peer in self.node.peers() if peer.node_id not in own)
            if known != count:
                count, since = known, now
            elif known and now - since >= _MESH_SETTLED:
                return
            await asyncio.sleep(0.05)
        self.stats_counter["republish_started_alone"] += 1

    async def _republish_one(self, end: LinkEnd, crossing: Crossing) -> None:
        while True:
            try:
                reached = await _publish_identified(
                    self.node, crossing.topic, crossing.payload, crossing.origin_id, crossing.trace
                )
                self.stats_counter["messages_republished"] += 1
                if not reached:
                    self.stats_counter["republished_to_no_subscriber"] += 1
                break
            except SlowConsumer:
                # A subscriber here is slow (or its link lossy): wait on, as a publisher
                # whose subscribers block would; the messages after this one wait too.
                self.stats_counter["republish_waits"] += 1
            except NoKey:
                self.stats_counter["dropped_no_key"] += 1
                self._not_republished_here(crossing)
                break
            except MeshError as exc:
                log.warning("gateway could not republish on %r: %s", crossing.topic, exc)
                self.stats_counter["dropped_republish_failed"] += 1
                self._not_republished_here(crossing)
                break
        if any(topic_matches(p, crossing.topic) for p in self.export.topics):
            await self._cross(crossing.through(self.mesh))
        # Done with it: acknowledged now, so a mesh that reads slowly holds the sender
        # back by the link's window instead of filling this gateway's memory.
        end.consumed()
        self.transport.flush_soon()

    def _not_republished_here(self, crossing: Crossing) -> None:
        """Let through the barrier but not published: not among what this gateway tells its
        fellows it republished."""
        self._not_republished[(crossing.origin, crossing.origin_id)] = None
        if len(self._not_republished) > _NOT_REPUBLISHED_KEPT:
            self._not_republished.popitem(last=False)

    # ------------------------------------------------------------- redundant gateways

    def _on_sync(self, payload: bytes) -> None:
        """A broadcast from another gateway of this mesh (see `redundancy`)."""
        if self._redundancy is None:
            return
        try:
            body = msgpack.unpackb(payload, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            self.stats_counter["sync_malformed"] += 1
            return
        self._redundancy.on_message(body, time.monotonic())

    async def _sync(self) -> None:
        """Tell this mesh's other gateways what was delivered and which links are up; elect
        the forwarder for each mesh linked to, and take over where this gateway becomes it."""
        redundancy = self._redundancy
        assert redundancy is not None
        warm_until = time.monotonic() + _WARM_UP
        while True:
            try:
                warm_until = await self._sync_once(redundancy, warm_until)
            except Exception:  # the election outlives an error (logged with its traceback)
                self.stats_counter["sync_errors"] += 1
                log.exception("gateway: redundant gateways' sync failed")
            await asyncio.sleep(_SYNC_EVERY)

    async def _sync_once(self, redundancy: Redundancy, warm_until: float) -> float:
        now = time.monotonic()
        redundancy.forget_stale(now)
        for fellow_id in list(redundancy.fellows):
            # Membership's verdict (a SIGKILLed gateway's broken links make it probe at once)
            # comes well before the fellow's silence reaches STALE_AFTER.
            redundancy.judge(fellow_id, self.node.peer_state(fellow_id), now)
        self._shared = redundancy.shared(now)
        ends = [e for e in self.transport.ends if e.peer_mesh]
        if now - self._state_at >= _STATE_EVERY:
            self._state_at = now
            up = {e.peer_mesh for e in ends if e.up}
            known = {e.peer_mesh for e in ends}
            self._tell(redundancy.state_message(up, known))
        await self._report_delivered()
        for mesh in {e.peer_mesh for e in ends}:
            own_up = any(e.up for e in ends if e.peer_mesh == mesh)
            since = self._linked_since.setdefault(mesh, now)
            decided = redundancy.elect(mesh, own_up=own_up, since=since, now=now)
            if decided is None:  # until the fellows have told their links, as it was
                decided = redundancy.forwarding.get(mesh, False)
            elected = now >= warm_until and decided
            if elected and not redundancy.forwarding.get(mesh, False):
                self._take_over(mesh, ends)
            if elected != redundancy.forwarding.get(mesh, not elected):
                self.stats_counter["forwarding_changes"] += 1
            redundancy.forwarding[mesh] = elected
        if now >= warm_until and self._warm is not None:
            self._warm.set()
        return warm_until

    async def _report_delivered(self) -> None:
        """Tell the standbys which of this mesh's messages the far side has acknowledged."""
        redundancy = self._redundancy
        assert redundancy is not None
        now = asyncio.get_running_loop().time()
        pending, keep = self._acked_pending, self._link_config.keep_acked
        for end in self.transport.ends:
            if end.acked_items is None:
                end.acked_items = []
                continue
            if end.acked_items:
                items, end.acked_items = end.acked_items, []
                if redundancy.fellows:
                    ids = [i[2] for i in items if i[0] in (CROSSING, RESENT) and i[1] == self.mesh]
                    if ids:
                        pending.append((now, end.peer_mesh, ids))
                        self._acked_pending_ids += len(ids)
        # Told only `keep_acked` after the far side acknowledged them: a far gateway SIGKILLed
        # just after its acknowledgement may not have passed them on, and a standby that takes
        # over from this one then still holds them (they are asked about there, not doubled).
        delivered: dict[str, list[bytes]] = {}
        while pending and (
            now - pending[0][0] >= keep or self._acked_pending_ids > _ACKED_PENDING_BOUND
        ):
            _at, mesh, ids = pending.popleft()
            self._acked_pending_ids -= len(ids)
            delivered.setdefault(mesh, []).extend(ids)
        for mesh, ids in delivered.items():
            self._tell(redundancy.delivered_message(mesh, ids))

    def _take_over(self, mesh: str, ends: list[LinkEnd]) -> None:
        assert self._redundancy is not None
        resend = self._redundancy.take_over(mesh)
        if resend:
            log.info("gateway forwards to mesh %r now; resends %d messages", mesh, len(resend))
        for crossing in resend:
            # Marked RESENT: the far side asks its gateways if they have it already.
            wire = self._marked(crossing, mesh, self._reach(crossing), RESENT)
            for end in ends:
                if end.peer_mesh == mesh and self._send(end, wire):
                    self.stats_counter["messages_sent"] += 1
        self.transport.flush_soon()

    async def _republished_elsewhere(self, origin: str, run: list[Crossing]) -> list[bool]:
        """Which of these crossings, resent by a takeover on the far side, another gateway of
        this mesh has republished (received from the forwarder that died, before it died):
        those are not republished again. A survey of `_gateway`; a gateway that does not
        answer in time is taken to have none of them (what is republished then may be a
        double: counted, `resends_unchecked`, as when no other gateway is here to ask)."""
        no = [False] * len(run)
        if GATEWAY_CLUSTER not in self.node.clusters:
            self.stats_counter["resends_unchecked"] += len(run)
            return no
        ids = [c.origin_id for c in run]
        question = msgpack.packb([_ASKED, self.node.node_id.hex(), origin, ids])
        try:
            result = await self.node.survey(GATEWAY_CLUSTER, question, timeout=_ASK_TIMEOUT)
        except NoResponders:  # no other gateway here now: one that died may have had them
            self.stats_counter["resends_unchecked"] += len(run)
            return no
        except MeshError as exc:
            log.debug("gateway could not ask its fellows about resends: %s", exc)
            self.stats_counter["resends_unchecked"] += len(run)
            return no
        own = self.node.node_id.hex()
        there = no
        for member, answer in result.answers.items():
            try:
                body = msgpack.unpackb(answer, raw=False)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                body = None
            if member == own or not isinstance(body, list) or len(body) != 2:
                continue
            kind, bitmap = body
            if kind != _ASKED or type(bitmap) is not bytes or len(bitmap) != (len(run) + 7) // 8:
                continue
            bits = int.from_bytes(bitmap, "little")
            there = [had or bool(bits >> i & 1) for i, had in enumerate(there)]
        if result.errors or result.missing:
            self.stats_counter["resends_unchecked"] += there.count(False)
        return there

    async def _on_gateway_survey(self, payload: bytes) -> bytes:
        """A survey of `_gateway`: `mesh top` asks for the stats (an empty payload); a fellow
        gateway asks which of a takeover's resends this one has republished, and gets a
        bitmap ([_ASKED, bits]) once what this gateway had queued to republish is done."""
        try:
            body = msgpack.unpackb(payload, raw=False) if payload else None
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            body = None
        if not (isinstance(body, list) and len(body) == 4 and body[0] == _ASKED):
            return self._describe(payload)
        _, _, origin, ids = body
        if type(origin) is not str or not isinstance(ids, list):
            self.stats_counter["sync_malformed"] += 1
            return b""  # the asker finds no answer in it
        progress, target = self._progress, self._queued
        while progress is not None and self._done < target:  # the caller's deadline bounds the wait
            progress.clear()
            await progress.wait()
        bits = 0
        for i, origin_id in enumerate(ids):
            key = (origin, origin_id)
            if (
                type(origin_id) is bytes
                and self._barrier.holds(*key)
                and key not in self._not_republished
            ):
                bits |= 1 << i
        self.stats_counter["resends_asked"] += len(ids)
        bitmap = bits.to_bytes((len(ids) + 7) // 8, "little")
        return msgpack.packb([_ASKED, bitmap], use_bin_type=True)  # type: ignore[no-any-return]

    def _tell(self, body: list[Any]) -> None:
        """Broadcast to this mesh's other gateways, in order, without holding up the caller."""
        if len(self._told) >= _TOLD_BOUND:
            self._told.popleft()
            self.stats_counter["sync_dropped"] += 1
        self._told.append(body)
        if self._telling is None or self._telling.done():
            self._telling = asyncio.get_running_loop().create_task(self._send_told())

    async def _send_told(self) -> None:
        while self._told:
            body = self._told.popleft()
            payload = msgpack.packb(body, use_bin_type=True)
            try:
                await self.node.broadcast(GATEWAY_CLUSTER, payload, timeout=1.0)
            except NoResponders:
                pass  # no other gateway here (yet)
            except MeshError as exc:
                self.stats_counter["sync_not_sent"] += 1
                log.debug("gateway could not tell its fellows: %s", exc)


async def _publish_identified(
    node: Node, topic: str, payload: bytes, msg_id: bytes, trace: bytes = b""
) -> int:
    """`node.publish(topic, payload)`, the message carrying `msg_id` (its origin id) to the
    subscribers, which deliver each id once (`Subscription`: a bounded window of ids), and
    its publisher's `trace` context as it came; how many it went to."""
    if node._closing or node._core is None:
        node._caller.running()  # raises Closed, saying why
    # No turn of the loop given between publishes here, unlike `Node.publish`: a run
    # republishes what one read of its link brought (at most a batch), so it ends by itself,
    # and the turns it would give slow the republishing that the far publishers wait on.
    pubsub = node._pubsub
    sent = pubsub.publish_now(topic, payload, msg_id, 0, trace)
    if sent is None:
        sent = await pubsub.publish_later(topic, payload, node._default_timeout, msg_id, 0, trace)
    return sent


def far_answers(result: SurveyResult) -> dict[str, bytes]:
    """The answers of a survey of a cluster imported through gateways, merged: each gateway
    answers with a msgpack map of far member id to answer (one of them asks, the others answer
    with an empty map). An answer that is not such a map is kept under its own member's id."""
    merged: dict[str, bytes] = {}
    for member_id, answer in result.answers.items():
        try:
            far = msgpack.unpackb(answer, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            far = None
        if isinstance(far, dict) and all(
            type(k) is str and type(v) is bytes for k, v in far.items()
        ):
            merged.update(far)
        else:
            merged[member_id] = answer
    return merged


def _is_call(item: Item) -> bool:
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
