"""`Gateway`: one mesh's door to other meshes.

A gateway is a node of its own mesh (that mesh's keyring, seeds and discovery) plus links to
peer gateways of other meshes (`irismesh.federation.link`), authenticated and sealed under a
link key of their own. What it lets out of its mesh is its `export`: clusters, and topics by
pattern. What it lets in is what its peers export and its own keyring can serve.

What it does is in modules of its own, each a part of `Gateway` (a mixin of its methods):
`imports` serves here the clusters its peers export and passes their calls on, `exports`
answers the calls far gateways pass on, `topics` carries messages from mesh to mesh, and
`fellows` keeps it in step with the other gateways of its mesh, and `grants` limits it to what
its grant allows where its mesh requires grants. This module holds the gateway's state, its
links and its lifecycle.

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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from irismesh._core.events import RequestArrived
from irismesh._core.topics import validate_pattern
from irismesh.errors import ConfigurationError, MeshError
from irismesh.federation.crossing import CROSSING, RESENT, Barrier, Crossing, OriginIds
from irismesh.federation.exports import BROADCAST, REPLY, REQUEST, SURVEY, ExportedClusters
from irismesh.federation.fellows import GATEWAY_CLUSTER, FellowGateways
from irismesh.federation.grants import FarGrantPolicy, GatewayGrant
from irismesh.federation.imports import ImportedClusters
from irismesh.federation.link import LinkTransport, describe
from irismesh.federation.linkproto import (
    REHELLO,
    Exports,
    Item,
    LinkConfig,
    LinkEnd,
    link_secrets,
)
from irismesh.federation.linkwire import TUNNEL as _TUNNEL
from irismesh.federation.redundancy import Redundancy
from irismesh.federation.topics import TopicCrossings
from irismesh.federation.tunnels import MAX_TUNNEL_WINDOW, GatewayTunnels
from irismesh.node import Node, SurveyResult
from irismesh.patterns.pubsub import Subscription
from irismesh.patterns.reqrep import TurnedAway
from irismesh.patterns.tunnel import DEFAULT_WINDOW
from irismesh.security.grants import Revocation
from irismesh.security.keyring import Keyring
from irismesh.security.rotation import POLL_INTERVAL, KeyringFile

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from irismesh.security.identity import Identity
    from irismesh.security.node_grants import GrantSource

__all__ = ["GATEWAY_CLUSTER", "Gateway", "far_answers"]

log = logging.getLogger("irismesh.federation")

_MAX_MESH_NAME = 200


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


def _far_authorities(keyring: Keyring, link_keyring: Keyring | None) -> frozenset[bytes]:
    """The authorities a gateway trusts for far gateways' grants."""
    return frozenset(keyring.authorities) | frozenset(
        () if link_keyring is None else link_keyring.authorities
    )


def _check_link_keys(keyring: Keyring) -> None:
    link_secrets(keyring)  # ConfigurationError if it holds no link key


class Gateway(ImportedClusters, ExportedClusters, TopicCrossings, FellowGateways):
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
    The rest (`seeds`, `bind`, `discovery`, `interface`, `name`, `identity`, `grant`) are the
    gateway's node's. Where the keyring requires grants, the grant's gateway rights limit what
    it exports and imports (`irismesh.federation.grants`), and a grant without one is refused
    with `Forbidden`.
    `require_far_grants=True`: every far gateway linked over TCP must show its identity and a
    grant from an authority this gateway trusts (the link keyring's `@authority` lines and the
    mesh keyring's), and its link is limited to that grant's `export` and `import` and follows
    its expiry and revocation (`irismesh.federation.grants`); this gateway then shows its own
    identity and grant in its handshakes, which a gateway of an earlier release refuses. Off,
    handshakes are as before.
    `import_ports` (first, last): the ports the nodes serving imported clusters take, one each,
    on the host of `bind` (or `interface`); without it they take any free port there. Where
    grants are required the gateway's node serves the imported clusters itself, under the
    gateway's grant, and takes no import port.
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
        identity: Identity | Ed25519PrivateKey | str | os.PathLike[str] | None = None,
        grant: GrantSource = None,
        require_far_grants: bool = False,
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
        self.node = Node(
            clusters=serves, name=name, identity=identity, grant=grant, **self._node_args
        )
        self.stats_counter: Counter[str] = Counter()
        try:
            self.grant = GatewayGrant.of(mesh, self.node)
        except MeshError:
            self._context.term()  # no socket was made on it
            raise
        refused_clusters, refused_topics = self.grant.exports(self.export)
        if refused_clusters or refused_topics:
            log.warning(
                "gateway's grant does not allow exporting %s: not exported",
                ", ".join(map(repr, [*refused_clusters, *refused_topics])),
            )
            self.stats_counter["exports_refused_forbidden"] += len(refused_clusters) + len(
                refused_topics
            )
            self.export = Exports(
                clusters=tuple(c for c in self.export.clusters if c not in refused_clusters),
                topics=tuple(p for p in self.export.topics if p not in refused_topics),
            )
        self._export_forbidden = frozenset(refused_clusters)
        # Where grants are required, the gateway's node serves the imported clusters itself
        # (`imports`): it holds the grant whose `import` lets it serve them.
        self._imports_here = self.grant.rights is not None
        self._serving_here = False  # the node's requests come to `_on_node_request`
        self._serves = tuple(serves)  # what the node serves besides the imports
        if serves and self._imports_here:
            self._serve_here()
        elif serves:
            self.node.on_request(self._describe)
            self.node.on_survey(self._on_gateway_survey)
            self.node.on_broadcast(self._on_sync)
        self.link_keyring = link_keyring
        self.far_grants: FarGrantPolicy | None = None
        if require_far_grants:
            trusted = _far_authorities(keyring, link_keyring)
            if not trusted:
                self._context.term()  # no socket was made on it
                raise ConfigurationError(
                    "require_far_grants needs an authority to trust: `@authority` lines in the "
                    "link keyring (or the mesh keyring)"
                )
            self.far_grants = FarGrantPolicy(self.node.grants, trusted)
            if self.node.grants.grant is None:
                log.warning(
                    "gateway of mesh %r requires far grants but has no grant to show (grant=,"
                    " --grant): far gateways that require grants will refuse it",
                    mesh,
                )
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
            identity=self.node.identity,
            grant_token=self.node.grants.token,
            far_grants=self.far_grants,
        )
        self._imports: dict[str, Node] = {}  # cluster -> the node that serves it here
        self._answering: set[asyncio.Future[Any]] = set()
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
        for answering in list(self._answering):
            answering.cancel()
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
            if node is not self.node:  # closed last, as the gateway's own
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
        if self.far_grants is not None:  # its authorities are trusted from now on
            self.far_grants.configure(_far_authorities(self.keyring, keyring), True)
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

    def revoke(self, revocation: Revocation | bytes) -> bool:
        """Apply a revocation (an authority's token): in this mesh as `Node.revoke` does, and
        to far gateways where far grants are required, from any authority trusted for them (a
        far mesh's authority among them). True if either took it as new; a link to the
        revoked gateway goes down at its next tick."""
        token = revocation.token if isinstance(revocation, Revocation) else revocation
        far = self.far_grants is not None and self.far_grants.learn(token)
        return self.node.revoke(token) or far

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
                elif kind == REQUEST:
                    self._on_request(end, item)
                elif kind in (BROADCAST, SURVEY):
                    self._on_fanout(end, item)
                elif kind == REPLY:
                    self._on_reply(item)
                elif kind == _TUNNEL:
                    self.tunnels.on_item(end, item)
                elif kind == REHELLO:  # the far gateway's grant changed
                    self.transport.rehandshake(end)
                else:
                    self.stats_counter["dropped_unknown_item"] += 1
            except MeshError:
                self.stats_counter["dropped_malformed"] += 1
        if self._drained is not None:
            self._drained.set()

    # ------------------------------------------------------------- requests, importing side


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
