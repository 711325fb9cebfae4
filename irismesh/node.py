"""`Node`: one service's place in the mesh (asyncio API).

async with irismesh.Node(cluster="db", keyring=keys) as node:
    @node.on_request
    async def handle(payload: bytes) -> bytes: ...

async with irismesh.Node(keyring=keys, seeds=["tcp://127.0.0.1:7400"]) as client:
    reply = await client.request("db", b"GET k", timeout=1.0)

A `Node` is a facade: the protocol is the sans-I/O core (`irismesh._core`), sockets and the
event loop are the driver's (`irismesh._driver`), calls and handlers live in `patterns.reqrep`
(`Caller`, `HandlerRunner`), messages in `patterns.pubsub`, tunnels in `patterns.tunnel`,
telemetry in `telemetry.node_telemetry`. What stays here is the wiring, argument checks, and
the membership the node reports (`members`, `peers`, `wait_for_members`).

The core's events are dispatched by type (`_on_events`): each concern signs up for the types
it handles with `listen`, so a node's event loop is one dict lookup and one call per event.
Replies skip even that: the core hands each to the caller as it reads it (`Caller.replied`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from irismesh import _env, _stream
from irismesh._core.admission import Admission
from irismesh._core.config import CoreConfig
from irismesh._core.engine import MeshCore
from irismesh._core.events import (
    Event,
    LinksChanged,
    PeerDown,
    PeerUp,
    RequestArrived,
    RequestCancelled,
    RequestFailed,
    Token,
)
from irismesh._core.frames import MAX_CLUSTERS, Kind, pack_error
from irismesh._core.gossip import MAX_NAME
from irismesh._core.priority import Priority, check_priority
from irismesh._core.records import MemberState, validate_name
from irismesh._core.split import validate_version
from irismesh._datagrams import DatagramSocket
from irismesh._driver import Driver, ZmqDriver, listen
from irismesh._spin import Spin
from irismesh._stream import StreamDriver
from irismesh.data.api import DataApi
from irismesh.discovery.mdns import MdnsConfig, MdnsDiscovery, mdns_config
from irismesh.discovery.survey import SurveyConfig, SurveyDiscovery, survey_config
from irismesh.errors import (
    Closed,
    ConfigurationError,
    MembershipTimeout,
    MeshError,
    NoResponders,
    RequestTimeout,
)
from irismesh.memory.api import MemoryApi
from irismesh.memory.queued import QueuedJobs
from irismesh.memory.service import MAX_LATEST, MEMORY_CLUSTER, MemoryMember, NodeMemory
from irismesh.memory.store import Retention
from irismesh.patterns.pubsub import Message, Policy, PubSub, Subscription
from irismesh.patterns.reqrep import (
    Caller,
    Forward,
    ForwardCancelled,
    ForwardedError,
    HandlerRunner,
    ReplyCallback,
    RequestHandler,
    as_bytes,
    deadline,
)
from irismesh.patterns.split import SplitApi
from irismesh.patterns.tunnel import (
    DEFAULT_MAX_MESSAGE,
    DEFAULT_WINDOW,
    Tunnel,
    TunnelHandler,
    TunnelOpening,
    Tunnels,
)
from irismesh.security.identity import Identity
from irismesh.security.keyring import MESH_SCOPE, Keyring
from irismesh.security.linksecurity import KeyedLinkSecurity
from irismesh.security.node_keys import KeyHolders, KeyringApi
from irismesh.telemetry.node_telemetry import (
    NodeTelemetry,
    TelemetryConfig,
)
from irismesh.telemetry.recorder import Recorder, Series
from irismesh.telemetry.tracing import tracing_wanted

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from irismesh.telemetry.metrics_endpoint import MetricsEndpoint
    from irismesh.telemetry.tracing import Tracing

H = TypeVar("H", bound=RequestHandler)
B = TypeVar("B", bound=Callable[[bytes], Any])
T = TypeVar("T", bound=TunnelHandler)
E = TypeVar("E")

DEFAULT_BIND = "tcp://127.0.0.1:0"
_log = logging.getLogger(__name__)
_KIND_REQUEST, _KIND_BROADCAST = int(Kind.REQUEST), int(Kind.BROADCAST)
_KIND_JOB = int(Kind.JOB)


@dataclass(frozen=True, slots=True, kw_only=True)
class SurveyResult:
    """What `Node.survey` gathered: answers by member (hex id), and who did not answer."""

    answers: dict[str, bytes]
    errors: dict[str, MeshError]  # members whose handler raised (RemoteError) or who left
    missing: list[str]  # members that did not answer within the timeout


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    """What `Node.peers()` reports of one peer."""

    node_id: str
    endpoint: str
    rtt_ms: float  # the link's ping, else membership's last probe (0: not measured yet)
    latency_ms: float
    outstanding: int
    # "alive"; "suspect": a probe went unanswered, the mesh waits for it to refute; and, from
    # peers(departed=True), "dead" (declared by membership) or "left" (said goodbye); in
    # clusters(), "announced": heard of by discovery only, not a peer of this mesh (yet).
    state: str = "alive"
    load: int = 0  # replies the peer still holds for its callers, as it last reported
    linked: bool = False  # this node has a link to it (the figures above are the link's)
    name: str = ""  # what it is called (`Node(name=...)`; "" for a node that gave none)
    # The clusters whose rotation this node keeps it out of for now (outlier ejection: its
    # requests go to the other members), sorted; () while it is in every rotation.
    ejected: tuple[str, ...] = ()


_STATES = {
    MemberState.ALIVE: "alive",
    MemberState.SUSPECT: "suspect",
    MemberState.DEAD: "dead",
    MemberState.LEFT: "left",
}


class ServedClusters(tuple[str, ...]):
    """`Node.clusters`: the clusters the node serves, a tuple of names as it always was; and,
    called as `node.clusters()`, every cluster the node's keyring can open, each with its live
    members (`Node._list_clusters` says how it finds them)."""

    lister: Callable[[], dict[str, tuple[PeerInfo, ...]]]

    def __call__(self) -> dict[str, tuple[PeerInfo, ...]]:
        return self.lister()


class Node(MemoryApi, DataApi, KeyringApi, SplitApi):
    """A node of the mesh: member of `cluster` (or a pure client when None).

    `name` labels the node for people: its peers (`peers()`, `mesh peers`, `mesh top`) and its
    telemetry show it. 1 to 64 printable characters without whitespace; by default this host's
    name and this process's id. Names need not be unique (the node id is the identity), and
    travel only under the mesh key.

    `memory_sync` (a memory member's): "fsync" (the default) acknowledges a retained message or
    a job once it is on the disk, so it survives a power cut; "os" once the operating system
    holds it, faster, and it survives this process crashing but not the machine losing power.
    `identity` is the node's Ed25519 key pair (an `Identity`, a private key, or the path of a
    file `mesh identity new` wrote; else IRISMESH_IDENTITY; else a fresh one): the node id is
    derived from its public key, and the node signs its handshakes and membership records with
    it, so no other node can link or gossip under its id. Give each node its own.

    `metrics="127.0.0.1:9464"` (or IRISMESH_METRICS) serves the node's counters live in the
    Prometheus text format at http://127.0.0.1:9464/metrics (`telemetry.metrics_endpoint`).

    `version="v2"` is the version this member serves its clusters as: a traffic split
    (`set_split`) weighs a cluster's versions. Up to 32 printable characters without
    whitespace or '='; a member without one belongs to the version "". Callers learn it under
    each cluster's key only.

    `tracing=True` (or IRISMESH_TRACING=1) carries W3C trace context with the node's calls
    and messages and makes OpenTelemetry spans of them (the `otel` extra); by default a node
    traces when the API is installed and a tracer provider was set before it was made
    (`telemetry.tracing`). `tracing=False` turns it off; `tracing=provider` (an OpenTelemetry
    TracerProvider) traces into that provider rather than the global one.
    """

    def __init__(
        self,
        cluster: str | None = None,
        *,
        keyring: Keyring | None = None,
        clusters: Iterable[str] = (),
        bind: str | None = None,
        seeds: Iterable[str] = (),
        survey: bool | SurveyConfig | None = None,
        mdns: bool | MdnsConfig = False,
        discovery: bool | None = None,
        interface: str | None = None,
        config: CoreConfig | None = None,
        default_timeout: float = 5.0,
        sealing: bool = True,
        telemetry: TelemetryConfig | bool = True,
        busy_poll: float = 0.0,
        handler_threads: int = 8,
        memory: str | os.PathLike[str] | None = None,
        memory_retention: Sequence[tuple[str, Retention]] = (),
        memory_sync: str = "fsync",
        replicas: int = 2,
        name: str | None = None,
        zmq_context: zmq.Context[zmq.Socket[bytes]] | None = None,
        transport: str | None = None,
        metrics: str | None = None,
        version: str | None = None,
        tracing: bool | TracerProvider | None = None,
        identity: Identity | Ed25519PrivateKey | str | os.PathLike[str] | None = None,
    ) -> None:
        if identity is None:
            identity = _env.identity_file()
        # The node's key pair: its id derives from the public key (fresh each run without one).
        self.identity = Identity.of(identity)
        self.name = default_name() if name is None else validate_name(name)
        self.version = validate_version("" if version is None else version)
        if keyring is None:
            keyring = Keyring.from_env() or _default_keyring()
        names = ([cluster] if cluster else []) + list(clusters)
        if memory is not None:
            names.append(MEMORY_CLUSTER)  # a memory member serves the memory's cluster too
        if len(set(names)) > MAX_CLUSTERS:
            raise ConfigurationError(f"a node serves at most {MAX_CLUSTERS} clusters")
        for name in names:
            _check_cluster_name(name)
            keyring.require(name)  # serving a cluster needs its key: fail now, not at a peer
        if interface is None:
            interface = _env.interface()
        if bind is None:  # discovery finds nodes on its interface: they must reach us there
            bind = DEFAULT_BIND if interface is None else f"tcp://{interface}:0"
        if not bind.startswith("tcp://"):
            raise ConfigurationError(f"bind must be a tcp:// endpoint, got {bind!r}")
        if transport is None:
            transport = _env.transport()
        elif transport not in _env.TRANSPORTS:
            raise ConfigurationError(
                f"transport must be one of {', '.join(_env.TRANSPORTS)}, got {transport!r}"
            )
        # What links run on: "tcp", irismesh's framing over the event loop's own TCP (no zmq
        # I/O thread), or "zmq". Every node of a mesh must use the same.
        self.transport = transport
        self.cluster = cluster
        # The clusters this node serves, as a tuple; called, `clusters()` lists every cluster
        # of the mesh the keyring opens (see ServedClusters).
        self.clusters = ServedClusters(dict.fromkeys(names))
        self.clusters.lister = self._list_clusters
        self.served_clusters: tuple[str, ...] = self.clusters
        self.keyring = keyring
        self._security: KeyedLinkSecurity | None = None
        # Reread when its file changes (security.rotation).
        self._watch_keyring(keyring, self.clusters)
        self.node_id = self.identity.node_id
        self._bind = bind
        self._seeds = [_check_endpoint(s) for s in dict.fromkeys([*seeds, *_env.seeds()])]
        # Discovery on by default (survey on `interface`); survey= and mdns= say what to run.
        if discovery is None:
            discovery = _env.discovery_enabled()
        elif not discovery and (survey or mdns):
            raise ConfigurationError("discovery=False, yet survey= or mdns= asks for discovery")
        self._survey_required = survey is not None  # asked for: failing to start is an error
        where = interface or "127.0.0.1"
        # What discovery was asked for, kept to make its configuration again with new keys.
        self._discovery_asked = (discovery if survey is None else survey, mdns, where)
        self._survey_config = survey_config(discovery if survey is None else survey, keyring, where)
        self._config = config or CoreConfig()
        self._default_timeout = default_timeout
        self._sealing = sealing  # False only to measure what sealing costs
        if not 0.0 <= busy_poll <= 0.01:
            raise ConfigurationError(f"busy_poll must be 0 to 0.01 s, got {busy_poll!r}")
        # Latency for CPU: poll for a reply (a lone request) or the next request (a member with
        # no handler awaiting) this long before sleeping in the loop. Off by default.
        self._busy_poll = busy_poll
        self._core: MeshCore | None = None
        self._driver: Driver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        # With transport="zmq": a zmq context shared with other nodes of this process (fewer
        # I/O threads), which whoever made it terminates; None: one of its own, made at start
        # and terminated as the node closes. Set it before `start`. TCP links use none.
        self.zmq_context = zmq_context
        self._mdns_config = mdns_config(mdns, keyring, where)
        self._discovery: list[MdnsDiscovery | SurveyDiscovery] = []  # started, in order
        self._rediscovering: asyncio.Task[None] | None = None
        # Prometheus metrics at HOST:PORT (telemetry.prometheus), else $IRISMESH_METRICS; ""
        # none. Once started, the address served (a port 0 given is the one the system chose).
        self.metrics_address = _env.metrics() if metrics is None else metrics
        if self.metrics_address:
            _env.metrics_address(self.metrics_address)
        self._metrics: MetricsEndpoint | None = None
        # Exact counters and histograms unless telemetry=False; records only with a spool.
        spool = telemetry if isinstance(telemetry, TelemetryConfig) else None
        self.telemetry = (
            NodeTelemetry(self.node_id, spool, self._config.max_payload, name=self.name)
            if telemetry
            else None
        )
        self.recorder: Recorder | None = self.telemetry.recorder if self.telemetry else None
        # Spans and trace context (telemetry.tracing), or None: one check per message.
        self.tracing: Tracing | None = None
        if tracing_wanted(tracing):
            from irismesh.telemetry.tracing import Tracing  # imports OpenTelemetry

            provider = None if tracing is None or isinstance(tracing, bool) else tracing
            self.tracing = Tracing(self.name, provider)
        self._caller = Caller(
            default_timeout=default_timeout, busy_poll=busy_poll, telemetry=self.telemetry
        )
        self._caller.tracing = self.tracing
        if not 1 <= handler_threads <= 1024:
            raise ConfigurationError(f"handler_threads must be 1 to 1024, got {handler_threads!r}")
        self._handler_threads = handler_threads
        serving = self.recorder.serving if self.recorder is not None else None
        self._serving_stats: Counter[str] = Counter()  # admission's counters, both runners'
        self._runner = self._serving_runner(serving)
        # Queued jobs the memory hands this member: their own admission, repeats absorbed.
        self._queued = QueuedJobs(
            lambda reply, reply_error, turn_away: self._serving_runner(
                serving, reply=reply, reply_error=reply_error, turn_away=turn_away
            ),
            self._reply,
            self._reply_error,
            self._turn_away,
            self._runner,
            self._serving_stats,
        )
        self._broadcasts = HandlerRunner(
            self._reply,
            self._reply_error,
            self._flush_soon,
            serving,
            ack_only=True,
            tracing=self.tracing,
        )
        self._surveys: HandlerRunner | None = None  # None: surveys go to the request handler
        self._pubsub = PubSub(self.node_id, self._flush_soon, self._flush_now)
        self._pubsub.tracing = self.tracing
        # The memory: retained publishes and rereads; with `memory=DIR`, a store served here
        # (opened now, so a directory that cannot hold it is an error at once).
        member = None
        if memory is not None:
            member = MemoryMember(memory, keyring, retention=memory_retention, sync=memory_sync)
        self.memory = NodeMemory(
            self.node_id,
            self._memory_survey,
            replicas=replicas,
            member=member,
            max_payload=self._config.max_payload,
        )
        self._pubsub.observe_id = self.memory.observe  # live retained messages advance its clock
        self._memory_runner: HandlerRunner | None = None
        self._catching_up: asyncio.Task[None] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._priming: set[asyncio.Task[None]] = set()  # subscriptions rereading the memory
        if member is not None:
            self._memory_runner = HandlerRunner(
                self._reply, self._reply_error, self._flush_soon, serving, tracing=self.tracing
            )
            self._memory_runner.handler = member.serve
        self._tunnels = Tunnels(self._flush_soon, self._flush_now, self._caller.turns)
        self._tunnels.tracing = self.tracing
        self._membership_changed: asyncio.Event | None = None
        self._departed: dict[str, PeerInfo] = {}  # hex id -> the peer as it went
        self._closing = False
        self._relays_failures = False  # `_relay_failed` hears of RequestFailed events
        self.endpoint = ""
        # The core's events, by type: each concern signs up for its own.
        self._handlers: dict[type[Any], Callable[[Any], None]] = {}
        self._caller.listen(self._listen)
        self._listen(RequestArrived, self._on_request)
        self._listen(RequestCancelled, self._on_cancelled)
        self._listen(PeerUp, self._on_membership)
        self._listen(PeerDown, self._on_membership)
        self._listen(LinksChanged, self._on_links)
        self._pubsub.listen(self._listen)
        self._tunnels.listen(self._listen)
        if self.telemetry is not None:
            self.telemetry.listen(self._listen)
            self._pubsub.record = self.telemetry.record_message
            self._pubsub.record_delivery = self.telemetry.record_delivery
            recorder = self.telemetry.recorder
            self._pubsub.stamp_every = lambda: recorder.sample_every
            self._tunnels.record = self.telemetry.record_tunnel

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> Node:
        if self._core is not None:
            return self
        loop = asyncio.get_running_loop()
        shared = self.zmq_context
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        router: zmq.Socket[bytes] | None = None
        listener: socket.socket | None = None
        if self.transport == "zmq":
            ctx = zmq.Context() if shared is None else shared
            router, endpoint = listen(ctx, self._bind, self._config.max_frame, term=shared is None)
        else:
            listener, endpoint = _stream.listen(self._bind)
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        try:  # membership's datagrams: the same host, the same port number if it is free
            datagrams = DatagramSocket(host.strip("[]"), int(port))
        except OSError as exc:
            if listener is not None:
                listener.close()
            if router is not None:
                router.close(0)
            if ctx is not None and shared is None:
                ctx.term()
            raise ConfigurationError(f"cannot take datagrams on {host}: {exc}") from None
        self.endpoint = endpoint
        self._ctx = ctx if shared is None else None  # terminated as the node closes
        self._loop = loop
        self._security = KeyedLinkSecurity(self.keyring, sealing=self._sealing)
        self._core = core = MeshCore(
            node_id=self.node_id,
            endpoint=endpoint,
            clusters=self.served_clusters,
            security=self._security,
            rng=random.Random(os.urandom(16)),
            randbytes=os.urandom,
            config=self._config,
            address=datagrams.address,
            now=loop.time(),
            name=self.name,
            version=self.version,
            identity=self.identity,
        )
        self._membership_changed = asyncio.Event()
        self._tunnels.attach(core)
        driver: Driver
        if ctx is not None and router is not None:
            driver = ZmqDriver(core, ctx, router, loop, self._on_events, datagrams)
        else:
            assert listener is not None
            driver = StreamDriver(core, listener, loop, self._on_events, datagrams)
            try:
                await driver.serve()
            except ConfigurationError:
                driver.close(0)
                self._core = None
                raise
        self._driver = driver
        self._caller.attach(core, driver)
        self._pubsub.attach(core, driver.flush_soon)
        if self._busy_poll:
            driver.busy_poll = self._busy_poll
            driver.request_spin = Spin(self._busy_poll, core.stats, "busy_poll_requests")
            driver.idle = lambda: self._runner.running == 0
        now = loop.time()
        for seed in self._seeds:
            core.add_candidate(seed, now, seed=True)
        driver.process()
        driver.start()
        self._start_keyring_watch(loop)
        if self.memory.member is not None:  # copy what the other memory members hold
            self._keep_data(self.memory.member.store.path)
            self._catching_up = loop.create_task(self._memory_catch_up())
            self._dispatcher = loop.create_task(
                self.memory.dispatch(self._dispatch_job, self._memory_peer_ids)
            )
        if self.telemetry is not None:
            self.telemetry.start(
                core,
                clock=loop.time,
                gauges=self._gauges,
                flush_tally=self._pubsub.flush_tally,
                publish=self.publish,
            )
        if self.metrics_address:
            await self._serve_metrics()
        await self._start_all_discovery(endpoint, required=True)
        return self

    async def _serve_metrics(self) -> None:
        from irismesh.telemetry import metrics_endpoint  # imported only when asked for

        try:
            self._metrics = await metrics_endpoint.serve(self, self.metrics_address)
        except BaseException:
            await self.close()
            raise
        self.metrics_address = self._metrics.address

    async def _start_all_discovery(self, endpoint: str, *, required: bool) -> None:
        """Start the discovery configured; `required`: failing to start closes the node."""
        if self._mdns_config is not None:
            await self._start_discovery(
                MdnsDiscovery(
                    node_id=self.node_id,
                    endpoint=endpoint,
                    config=self._mdns_config,
                    on_candidate=self._on_candidate,
                ),
                required=required,
            )
        if self._survey_config is not None:
            await self._start_discovery(
                SurveyDiscovery(
                    node_id=self.node_id,
                    endpoint=endpoint,
                    config=self._survey_config,
                    on_candidate=self._on_candidate,
                    keyring=self.keyring,
                    clusters=self.served_clusters,
                    live_peers=self._live_peers,
                    alive=self._alive_at,
                ),
                required=required and self._survey_required,
            )

    def _live_peers(self) -> int:
        """How many other nodes membership holds alive: discovery quiets down once joined."""
        return 0 if self._core is None else len(self._core.membership)

    def _alive_at(self, node_id: bytes, endpoint: str) -> bool:
        """Whether membership holds `node_id` alive at `endpoint` (discovery neither answers
        nor dials a node the mesh already has)."""
        member = None if self._core is None else self._core.membership.get(node_id)
        return (
            member is not None
            and member.state <= MemberState.SUSPECT
            and member.record.endpoint == endpoint
        )

    def _rediscover(self, keyring: Keyring) -> None:
        """Discovery seals cluster names under their keys: the running survey takes the new
        keyring. And it tags what it sends with the '*' key: after a rotation of that key,
        start it again with the new one (a node that starts with only the new key must find
        us)."""
        for running in self._discovery:  # cluster names: sealed and opened with the new keys
            if isinstance(running, SurveyDiscovery):
                running.use_keyring(keyring)
        survey, mdns, where = self._discovery_asked
        configs = (survey_config(survey, keyring, where), mdns_config(mdns, keyring, where))
        if configs == (self._survey_config, self._mdns_config):
            return
        self._survey_config, self._mdns_config = configs
        if self._loop is None or self._closing:
            return
        previous = self._rediscovering

        async def restart() -> None:
            if previous is not None:
                await previous
            running, self._discovery = self._discovery, []
            for discovery in running:
                await discovery.close()
            if not self._closing:
                await self._start_all_discovery(self.endpoint, required=False)

        self._rediscovering = self._loop.create_task(restart())

    async def _start_discovery(
        self, discovery: MdnsDiscovery | SurveyDiscovery, *, required: bool = True
    ) -> None:
        self._discovery.append(discovery)
        try:
            await discovery.start()
        except ConfigurationError as exc:
            if required:
                await self.close()
                raise
            # Discovery by default only: a node with seeds works without it, so go on.
            self._discovery.remove(discovery)
            _log.warning("default discovery is off for this node: %s", exc)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Leave the mesh: say goodbye to peers, fail pending requests with Closed."""
        if self._closing:
            return
        self._closing = self._caller.closed = True
        if self._metrics is not None:
            await self._metrics.withdraw(self)
        await self._stop_keyring_watch()
        if self._rediscovering is not None:
            with contextlib.suppress(Exception):
                await self._rediscovering
        for discovery in self._discovery:
            await discovery.close()
        if self.telemetry is not None:
            await self.telemetry.stop(self._pubsub.publish)
        await self._queued.close()
        await self._runner.close()
        await self._close_data()
        for priming in list(self._priming):
            priming.cancel()
        for task in (self._catching_up, self._dispatcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._memory_runner is not None:
            await self._memory_runner.close()
        self.memory.close()
        self._pubsub.close()
        if self._core is not None and self._driver is not None:
            self._core.close()
            self._driver.process()
            if self._core.calls.relaying:  # relayed requests, left: answered where they came
                self._core.calls.drop_relays(Closed("node closed"))
                for partner in self._driver.partners:
                    partner.flush_soon()
            self._driver.close()
            await self._driver.wait_closed(0.2)
        await self._tunnels.close()
        self._caller.close()
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            await asyncio.get_running_loop().run_in_executor(None, ctx.term)
        if self.telemetry is not None:
            await self.telemetry.close()

    async def __aenter__(self) -> Node:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ----------------------------------------------------------------- serving

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
                if runner.pool is None:
                    runner.pool = ThreadPoolExecutor(
                        self._handler_threads, thread_name_prefix="irismesh-handler"
                    )
                if runner.admission is not None:
                    runner.admission.max_limit = self._handler_threads
                    runner.admission.limit = min(runner.admission.limit, self._handler_threads)
            return handler

        return register if handler is None else register(handler)

    def forward_requests(self, forward: Forward, cancelled: ForwardCancelled) -> None:
        """For a node that only passes requests on and answers them later (a gateway), with no
        handler run, Future or timer per request: `forward(request)` gets each request (a
        `RequestArrived`: its `payload`, `cluster`, and `deadline` on the event loop's clock)
        as it arrives, unadmitted (whoever answers it in the end admits it or not), and answers
        it once with `answer`, whatever happens: this node keeps each request's place until
        then. `cancelled(event)` hears of each caller that gave up (`event.token` is its
        request's), and says whether that request was still being forwarded; it is answered
        at once then (with an error: nobody reads it), and its reply forgotten."""
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster serves no requests: pass cluster=")
        runner = self._runner
        runner.handler = None
        runner.admission = None
        runner.forward = forward
        runner.forward_cancelled = cancelled

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

    @overload
    def on_queued(self, handler: H, *, blocking: bool = False) -> H: ...

    @overload
    def on_queued(self, handler: None = None, *, blocking: bool = False) -> Callable[[H], H]: ...

    def on_queued(
        self, handler: H | None = None, *, blocking: bool = False
    ) -> H | Callable[[H], H]:
        """Decorator: `handler(payload) -> bytes` (sync or async) runs the jobs queued for this
        node's cluster with `enqueue` (default: the request handler runs them);
        `@node.on_queued` or `@node.on_queued(blocking=True)`.

        A job is the mesh memory's until the handler's answer reaches it, so a job whose member
        dies mid-run runs again elsewhere (at least once); a repeat that reaches this member
        after it answered is answered again without running (`jobs_absorbed` in `stats()`).
        Jobs have an admission of their own, next to the requests'.
        """
        if not self.clusters:
            raise ConfigurationError("a node without a cluster runs no queued jobs: pass cluster=")

        def register(handler: H) -> H:
            pool = None
            if blocking:
                if self._runner.pool is None:
                    self._runner.pool = ThreadPoolExecutor(
                        self._handler_threads, thread_name_prefix="irismesh-handler"
                    )
                pool = self._runner.pool
                admission = self._queued.runner.admission
                if admission is not None:
                    admission.max_limit = self._handler_threads
                    admission.limit = min(admission.limit, self._handler_threads)
            self._queued.handle(handler, blocking=blocking, pool=pool)
            return handler

        return register if handler is None else register(handler)

    def on_broadcast(self, handler: B) -> B:
        """Decorator: `handler(payload)` (sync or async) gets every broadcast to this member.

        The caller learns that this member received a broadcast once the handler has returned.
        """
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster gets no broadcasts: pass cluster=")
        self._broadcasts.handler = handler
        return handler

    def on_survey(self, handler: H) -> H:
        """Decorator: `handler(payload) -> bytes` answers surveys (default: the request handler)."""
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster answers no surveys: pass cluster=")
        serving = self.recorder.serving if self.recorder is not None else None
        runner = self._serving_runner(serving)
        runner.handler = handler
        self._surveys = runner
        return handler

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

    def on_tunnel(self, handler: T, *, accept: bool = True) -> T:
        """Decorator: `async def handler(tunnel)` serves each tunnel a caller opens to this member.

        The tunnel closes when the handler returns; if it raises, the caller's end is reset
        with the error's message. With `accept=False` (`node.on_tunnel(handler, accept=False)`)
        the handler gets the tunnel unaccepted, the caller's `node.tunnel` still waiting: it
        calls `tunnel.accept()`, or `tunnel.reset(reason)` to refuse it (a reason starting
        "no live member" makes the caller's `node.tunnel` raise NoResponders).
        """
        if not self.served_clusters:
            raise ConfigurationError("a node without a cluster serves no tunnels: pass cluster=")
        self._tunnels.handler = handler
        self._tunnels.accept_first = accept
        return handler

    # ----------------------------------------------------------------- calling

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

    async def caught_up(self) -> None:
        """Until this memory member, once started, has copied what the other memory members
        stored while it was away (returns at once on other nodes)."""
        if self._catching_up is not None:
            await asyncio.shield(self._catching_up)

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
        _core, driver = self._caller.running()
        loop = driver.loop
        budget = self._default_timeout if timeout is None else timeout
        if not budget > 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        until = loop.time() + budget
        inherited = deadline()  # within a handler: its caller's deadline bounds it
        if inherited is not None:
            until = min(until, inherited)
        waited = 0
        while True:
            left = until - loop.time()
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

    async def broadcast(
        self, cluster: str, payload: bytes, *, timeout: float | None = None
    ) -> list[str]:
        """Deliver `payload` once to every live member of `cluster`.

        Returns the hex ids of the members whose broadcast handler ran within `timeout`
        (members that left or timed out are not listed). NoResponders if there is none.
        """
        timeout = await self._linked(cluster, timeout)
        answers, _errors, _missing = await self._caller.fanout(
            Kind.BROADCAST, cluster, payload, timeout
        )
        return sorted(answers)

    async def survey(
        self, cluster: str, payload: bytes, *, timeout: float | None = None
    ) -> SurveyResult:
        """Ask every live member of `cluster`; return as soon as all answered, or at `timeout`."""
        timeout = await self._linked(cluster, timeout)
        answers, errors, missing = await self._caller.fanout(Kind.SURVEY, cluster, payload, timeout)
        return SurveyResult(answers=answers, errors=errors, missing=sorted(missing))

    # ----------------------------------------------------------------- publish/subscribe

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        timeout: float | None = None,
        retain: bool = False,
        priority: int = Priority.NORMAL,
    ) -> int:
        """Send `payload` to every subscription matching `topic`, here and on other nodes.

        Returns how many nodes it went to (this one included when it has a matching
        subscription); 0 is not an error. A subscriber whose policy is "block" and whose buffer
        is full makes this wait for room, up to `timeout`, then raise SlowConsumer. The payload
        is sealed under the key of the topic's first segment (else the default key).

        `retain=True` first stores the message with the mesh's memory under its path (the
        topic), for `reread`: it is sent once `replicas` memory members (or every one there
        is, if fewer) hold it, and raises NoResponders at once when there is none.

        `priority` (as in `request`): publishes that wait for a subscriber's room go in the
        order of their priority (and of their arrival within one), so a higher one overtakes
        lower ones that wait. A subscriber gets each publisher's messages in the order they
        were sent, so messages of one topic stay in order when they share a priority.
        """
        turns = self._caller.turns
        try:
            if self._closing or self._core is None:
                self._caller.running()  # raises Closed, saying why
            if timeout is not None and not timeout > 0:
                raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
            if priority:
                priority = check_priority(priority)
            if type(payload) is not bytes:
                payload = as_bytes(payload)
            msg_id = b""
            if retain:
                msg_id = await self.memory.retain(topic, payload, timeout)
            pubsub = self._pubsub
            if self.tracing is not None:
                return await self._publish_traced(
                    self.tracing, topic, payload, timeout, msg_id, priority
                )
            sent = pubsub.publish_now(topic, payload, msg_id, priority)  # the common case
        except MeshError:
            if turns.spend():  # refused at once: a retry loop must not keep the loop
                await turns.pause()
            raise
        if sent is not None:
            # Sent without waiting (or to nobody): a publishing loop still lets its loop run
            # (`Turns.spend` inlined: the publisher's hot path).
            credit = turns.credit - 1
            if credit > 0:
                turns.credit = credit
            elif turns.due():
                await turns.pause()
            return sent
        return await pubsub.publish_later(
            topic, payload, self._default_timeout if timeout is None else timeout, msg_id, priority
        )

    async def _publish_traced(
        self,
        tracing: Tracing,
        topic: str,
        payload: bytes,
        timeout: float | None,
        msg_id: bytes,
        priority: int,
    ) -> int:
        """`publish` with tracing on: in a PRODUCER span, whose context goes with the message."""
        span, trace = tracing.publish(topic)
        try:
            pubsub = self._pubsub
            sent = pubsub.publish_now(topic, payload, msg_id, priority, trace)
            if sent is None:
                wait = self._default_timeout if timeout is None else timeout
                sent = await pubsub.publish_later(topic, payload, wait, msg_id, priority, trace)
            else:
                turns = self._caller.turns
                if turns.spend():
                    await turns.pause()
        except BaseException as exc:
            tracing.end(span, exc)
            raise
        span.set_attribute("irismesh.subscribers", sent)
        tracing.end(span)
        return sent

    def subscribe(
        self,
        pattern: str,
        *,
        policy: Policy = "block",
        maxsize: int = 1024,
        callback: Callable[[Message], object] | None = None,
        reread: bool | int = False,
    ) -> Subscription:
        """Receive messages on topics matching `pattern` (`*` one segment, `#` any number).

        `async with node.subscribe("feeds.#") as sub: async for msg in sub: ...`. When the
        reader falls behind, `policy` decides: "block" the publishers (nothing lost) or
        "drop_oldest" beyond `maxsize` (and count what was missed in `Message.missed`).

        With `callback`, each message is handed to `callback(msg)` as it arrives, on the
        event loop, instead of being buffered (the fastest way to receive; `policy` and
        `maxsize` do not apply). It must not block; an exception it raises is logged and
        counted in `sub.errors`, and the messages after it still come. `sub.close()` ends it.

        `reread=True` (or a number N) first delivers what the mesh's memory holds for the
        pattern (each path's newest message, or N newest, oldest first, with `Message.id`
        and an empty `publisher`), then the live messages, with no gap and no duplicate
        between them: live messages wait while the memory is read, a retained message comes
        once whether it was reread or live, and the memory is read again once the new
        interest has had time to reach every publisher. Without a memory member the
        subscription is live only and `sub.reread_error` says why.
        """
        self._caller.running()
        if type(reread) is not bool and (type(reread) is not int or not 1 <= reread <= MAX_LATEST):
            raise ConfigurationError(f"reread must be a bool or 1 to {MAX_LATEST}, not {reread!r}")
        sub = self._pubsub.subscribe(pattern, policy, maxsize, callback, priming=bool(reread))
        if reread:
            latest = 1 if reread is True else int(reread)
            task = asyncio.get_running_loop().create_task(self._prime(sub, latest))
            self._priming.add(task)
            task.add_done_callback(self._priming.discard)
        return sub

    def tunnel(
        self,
        cluster: str,
        *,
        timeout: float | None = None,
        window: int = DEFAULT_WINDOW,
        max_message: int = DEFAULT_MAX_MESSAGE,
    ) -> TunnelOpening:
        """Open an ordered, flow-controlled stream to one live member of `cluster`.

        `async with node.tunnel("db", timeout=1.0) as t: await t.send(b"..."); await t.recv()`
        (or `t = await node.tunnel(...)` and `await t.close()`). Raises NoResponders at once
        without a member, RequestTimeout if none accepted within `timeout`, TunnelReset if the
        member refused. `window` is what this end buffers unread, in bytes.
        """
        timeout = self._default_timeout if timeout is None else timeout
        if not timeout > 0:
            raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        if type(window) is not int or not 1 <= window <= 1 << 30:
            raise ConfigurationError(f"window must be 1 byte to 1 GiB, got {window!r}")
        if type(max_message) is not int or max_message < 1:
            raise ConfigurationError(f"max_message must be a positive int, got {max_message!r}")

        async def opener() -> Tunnel:
            try:
                self._caller.running()
                remaining = await self._linked(cluster, timeout, every=False)
                return await self._tunnels.open(cluster, remaining, window, max_message)
            except MeshError:
                await self._caller.turns.maybe_pause()  # refused at once: still fair
                raise

        return TunnelOpening(opener)

    async def wait_for_subscribers(
        self, topic: str, count: int = 1, *, timeout: float = 10.0
    ) -> int:
        """Wait until at least `count` other nodes subscribe to `topic`; returns how many."""
        self._caller.running()
        return await self._pubsub.wait_for_subscribers(topic, count, timeout)

    async def wait_for_members(self, cluster: str, count: int = 1, *, timeout: float = 10.0) -> int:
        """Wait until `cluster` has at least `count` live members; returns how many it has."""
        core, driver = self._caller.running()
        changed = self._membership_changed
        assert changed is not None
        deadline = driver.loop.time() + timeout
        while True:
            core.want(cluster, driver.loop.time())  # link to its members, if not yet
            driver.flush_soon()
            found = len(core.members(cluster))
            if found >= count:
                return found
            remaining = deadline - driver.loop.time()
            if remaining <= 0:
                raise MembershipTimeout(cluster, count, found, timeout)
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def wait_for_peers(self, count: int = 1, *, timeout: float = 10.0) -> int:
        """Wait until membership knows at least `count` other live nodes (alive or suspect),
        whatever clusters they serve; returns how many it knows. Opens no link."""
        core, driver = self._caller.running()
        changed = self._membership_changed
        assert changed is not None
        deadline = driver.loop.time() + timeout
        while True:
            found = len(core.membership)
            if found >= count:
                return found
            remaining = deadline - driver.loop.time()
            if remaining <= 0:
                raise MembershipTimeout(None, count, found, timeout)
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def connect(self, cluster: str, *, timeout: float = 5.0) -> list[str]:
        """Link to every live member of `cluster` membership knows, waiting at most `timeout`
        for the links; returns the hex ids of the members linked. Calls open their links on
        demand anyway: this only spares the first calls the wait."""
        await self._linked(cluster, 2 * timeout)
        return self.members(cluster)

    def members(self, cluster: str) -> list[str]:
        """Hex node ids of the live members of `cluster` this node is linked to (asking opens
        links to the others, which `wait_for_members` waits for)."""
        core, driver = self._caller.running()
        core.want(cluster, driver.loop.time())
        driver.flush_soon()
        return [link.peer_id.hex() for link in core.members(cluster)]

    def known_members(self, cluster: str) -> int:
        """How many live members of `cluster` membership knows, linked to this node or not
        (the members whose records say, under a key this node holds, that they serve it).
        Opens no link: `members` and `wait_for_members` do."""
        core, _ = self._caller.running()
        return len(core.directory.servers(cluster))

    def peers(self, *, departed: bool = False) -> list[PeerInfo]:
        """Every node of the mesh that membership holds alive (state "alive" or "suspect"),
        with its link's figures where this node has a link to it; with `departed`, also the
        nodes that died or left lately (state "dead" or "left", the most recent 256)."""
        core, _ = self._caller.running()
        gone = list(self._departed.values()) if departed else []
        live = []
        outliers = core.calls.outliers
        for member, link in core.known():
            if member.state > MemberState.SUSPECT:
                continue
            state = "suspect" if member.state is MemberState.SUSPECT else "alive"
            ejected = outliers.ejected_from(member.record.node_id) if outliers.ejected else ()
            if link is None:
                rtt = core.membership.rtt(member.record.node_id) or 0.0
                info = PeerInfo(
                    node_id=member.record.node_id.hex(),
                    endpoint=member.record.endpoint,
                    rtt_ms=rtt * 1000,
                    latency_ms=0.0,
                    outstanding=0,
                    state=state,
                    name=member.record.name,
                    ejected=ejected,
                )
            else:
                info = PeerInfo(
                    node_id=link.peer_id.hex(),
                    endpoint=link.endpoint,
                    rtt_ms=(link.rtt or core.membership.rtt(link.peer_id) or 0.0) * 1000,
                    latency_ms=link.latency * 1000,
                    outstanding=link.outstanding,
                    state=state,
                    load=link.peer_load,
                    linked=True,
                    name=member.record.name,
                    ejected=ejected,
                )
            live.append(info)
        return gone + live

    def _list_clusters(self) -> dict[str, tuple[PeerInfo, ...]]:
        """`node.clusters()`: the clusters this node's keyring can open, each with its live
        members (other nodes than this one), as cluster name -> members' `PeerInfo` by node
        id; names sorted.

        A cluster is here when survey discovery heard a node name it, sealed under a key this
        keyring opens it with (its own key, else '*'; nodes seal their names under their '*'
        key too, so a '*' key lists every cluster of the nodes that hold it), or when a member
        this node links to proved it serves one of the keyring's scopes. A member that is a
        peer of this mesh is as `peers()` shows it; one only heard by discovery (of another
        mesh, or not joined yet) has state "announced" and no figures. Without the survey
        (`discovery=False`, or mDNS alone) only the keyring's scopes can appear."""
        core, _ = self._caller.running()
        live = {p.node_id: p for p in self.peers()}
        gone = {
            member.record.node_id.hex()
            for member, _ in core.known()
            if member.state > MemberState.SUSPECT
        }
        found: dict[str, dict[str, PeerInfo]] = {}
        for discovery in self._discovery:
            if not isinstance(discovery, SurveyDiscovery):
                continue
            for name, heard in discovery.clusters_heard().items():
                members = found.setdefault(name, {})
                for raw_id, endpoint in heard.items():
                    node_id = raw_id.hex()
                    if node_id in gone or raw_id == self.node_id:
                        continue
                    members[node_id] = live.get(node_id) or PeerInfo(
                        node_id=node_id,
                        endpoint=endpoint,
                        rtt_ms=0.0,
                        latency_ms=0.0,
                        outstanding=0,
                        state="announced",
                    )
        for scope in self.keyring.scopes:
            if scope in ("*", MESH_SCOPE):
                continue
            for link in core.members(scope):
                node_id = link.peer_id.hex()
                if node_id in live:
                    found.setdefault(scope, {})[node_id] = live[node_id]
        return {
            name: tuple(sorted(members.values(), key=lambda p: p.node_id))
            for name, members in sorted(found.items())
        }

    def peer_state(self, node_id: str) -> str | None:
        """How membership holds the node with hex id `node_id` now: "alive", "suspect",
        "dead" or "left"; None if it does not know it (never heard of, or forgotten). Costs
        one lookup, whatever the size of the mesh (`peers()` lists them all)."""
        core, _ = self._caller.running()
        try:
            member = core.membership.get(bytes.fromhex(node_id))
        except ValueError:
            raise ConfigurationError(f"bad node id {node_id!r}: expected hex") from None
        if member is None:
            return None
        return _STATES[member.state]

    @property
    def stats(self) -> Mapping[str, int]:
        """Counters: drops by reason, requests resent and timed out, peers up and down; the
        survey's as `survey_dropped_replay`, `survey_dropped_stale`, ..."""
        if self._core is None:
            return {}
        stats = dict(self._core.stats)
        stats["requests_pending"] = self._core.pending_count
        stats["handlers_running"] = self._runner.running
        stats.update(self._serving_stats)
        admission = self._runner.admission
        if admission is not None:
            stats["requests_waiting"] = admission.waiting
            stats["handler_limit"] = int(admission.limit)
        stats["reply_cache_entries"] = len(self._core.reply_cache)
        stats["members_ejected_now"] = self._core.calls.outliers.ejected
        stats["messages_published"] = self._pubsub.published
        stats["messages_delivered"] = self._pubsub.delivered
        stats["messages_unmatched"] = self._pubsub.unmatched
        stats["messages_duplicates_dropped"] = self._pubsub.duplicates
        stats["tunnels_open"] = self._tunnels.open_count
        stats["loop_turns_given"] = self._caller.turns.given
        stats.update(self.memory.stats)
        stats.update(self._data_figures())
        if self.memory.member is not None:
            for name, value in self.memory.member.figures().items():
                stats["memory_" + name] = value
        for discovery in self._discovery:  # the survey's drops, replays and stale ones too
            if isinstance(discovery, SurveyDiscovery):
                for name, value in discovery.stats.items():
                    if name.startswith("dropped_") or name in _SURVEY_STATS:
                        stats["survey_" + name] = value
        return stats

    def flush_telemetry(self) -> None:
        """Hand the publishes and deliveries tallied so far to `recorder` (the node does this
        every 1024 messages, every gauge interval, and as it closes)."""
        self._pubsub.flush_tally()

    # ----------------------------------------------------------------- internals

    def _listen(self, event_type: type[E], handler: Callable[[E], None]) -> None:
        """Call `handler` with each event of `event_type`, after those registered before."""
        earlier = self._handlers.get(event_type)
        if earlier is None:
            self._handlers[event_type] = handler
            return

        def both(event: E) -> None:
            earlier(event)
            handler(event)

        self._handlers[event_type] = both

    def _on_events(self, events: list[Event]) -> None:
        """The core's events, each to the handler of its type (none: the driver's own)."""
        driver = self._driver
        self._caller.events_at = driver.loop.time() if driver is not None else 0.0
        handlers = self._handlers
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event)

    def _on_request(self, event: RequestArrived) -> None:
        if self._memory_runner is not None and event.cluster == MEMORY_CLUSTER:
            self._memory_runner.run(event)
            return
        if event.kind == _KIND_REQUEST:
            self._runner.run(event)
        elif event.kind == _KIND_JOB:
            self._queued.run(event)
        elif event.kind == _KIND_BROADCAST:
            self._broadcasts.run(event)
        else:
            (self._surveys or self._runner).run(event)

    def _on_cancelled(self, event: RequestCancelled) -> None:
        self._runner.cancel(event)
        self._queued.cancel(event)
        if self._memory_runner is not None:
            self._memory_runner.cancel(event)
        if self._surveys is not None:
            self._surveys.cancel(event)

    def _on_membership(self, event: PeerUp | PeerDown) -> None:
        """A peer came or went: `peers(departed=True)` and `wait_for_members` hear of it."""
        key = event.node_id.hex()
        self._departed.pop(key, None)
        if type(event) is PeerDown:
            self._departed[key] = PeerInfo(
                node_id=key,
                endpoint=event.endpoint,
                rtt_ms=0.0,
                latency_ms=0.0,
                outstanding=0,
                state="left" if event.reason == "left" else "dead",
                name=event.name,
            )
            if len(self._departed) > 256:
                del self._departed[next(iter(self._departed))]
        if self._membership_changed is not None:
            self._membership_changed.set()

    def _on_links(self, event: LinksChanged) -> None:
        if self._membership_changed is not None:
            self._membership_changed.set()

    async def _linked(self, cluster: str, timeout: float | None, *, every: bool = True) -> float:
        """Wait until this node is linked to every member of `cluster` membership knows (or,
        not `every`, to one), within half of `timeout`; returns what is left of `timeout`."""
        try:
            core, driver = self._caller.running()
            timeout = self._default_timeout if timeout is None else timeout
            if not timeout > 0:
                raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        except MeshError:
            await self._caller.turns.maybe_pause()  # refused at once: still fair
            raise
        loop = driver.loop
        start = loop.time()
        changed = self._membership_changed
        assert changed is not None
        while True:
            known = core.want(cluster, loop.time())
            linked = len(core.members(cluster))
            if linked >= (known if every else min(known, 1)):
                break
            driver.flush_soon()
            remaining = start + timeout / 2 - loop.time()
            if remaining <= 0:
                break
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
        return timeout - (loop.time() - start)

    def _gauges(self) -> dict[str, float]:
        core = self._core
        if core is None:
            return {}
        return {
            "requests_in_flight": core.pending_count,
            "handlers_running": self._runner.running,
            "peers": len(core.membership),
            "links": len(core.peers()),
            "reply_cache_entries": len(core.reply_cache),
            "members_ejected_now": core.calls.outliers.ejected,
            **self._overload_counters(),
        }

    def _overload_counters(self) -> dict[str, float]:
        """Admission's and the throttle's counters so far (cumulative), for the gauges."""
        counters: dict[str, float] = dict(self._serving_stats)
        stats = self._core.stats if self._core is not None else {}
        for name in ("requests_throttled", "requests_turned_away", "cancels_received"):
            counters[name] = stats.get(name, 0)
        counters.update((k, v) for k, v in stats.items() if k.startswith("requests_shed_"))
        admission = self._runner.admission
        if admission is not None:
            counters["requests_waiting"] = admission.waiting
            counters["handler_limit"] = admission.limit
        return counters

    def _reply(self, token: Token, payload: bytes) -> None:
        if self._core is not None and not self._closing:
            self._core.calls.reply(token, payload)

    def _turn_away(self, token: Token, reason: str) -> None:
        if self._core is not None and not self._closing:
            self._core.calls.turn_away(token, reason)

    def _reply_error(self, token: Token, exc: BaseException) -> None:
        if self._core is not None and not self._closing:
            if isinstance(exc, ForwardedError):  # a gateway passing another member's error on
                self._core.reply(token, pack_error(exc.remote_type, exc.remote_message), error=True)
            else:
                self._core.reply_error(token, exc)

    @staticmethod
    def _check_cluster(name: str) -> None:
        _check_cluster_name(name)

    def _flush_soon(self) -> None:
        if self._driver is not None and not self._closing:
            self._driver.flush_soon()

    def _flush_now(self) -> None:
        if self._driver is not None and not self._closing:
            self._driver.flush()

    def _on_candidate(self, node_id: bytes, endpoint: str) -> None:
        if self._core is None or self._driver is None or self._closing:
            return
        self._core.add_candidate(endpoint, self._driver.loop.time())
        self._driver.process()


# The survey's counters besides its drops that node.stats shows, prefixed "survey_".
_SURVEY_STATS = (
    "candidates",
    "announcements",
    "questions_sent",
    "answers_sent",
    "answers_withheld",
    "candidates_passed",
)


def default_name() -> str:
    """This host's name (its first label) and this process's id: "web-3-4711"."""
    suffix = f"-{os.getpid()}"
    host = socket.gethostname().partition(".")[0]
    host = "".join(c for c in host if c.isprintable() and not c.isspace()) or "node"
    return host[: MAX_NAME - len(suffix)] + suffix


def _check_cluster_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > 200 or any(c.isspace() for c in name):
        raise ConfigurationError(f"bad cluster name {name!r}: 1-200 characters, no whitespace")


def _check_endpoint(endpoint: str) -> str:
    if (
        not isinstance(endpoint, str)
        or not endpoint.startswith("tcp://")
        or ":" not in endpoint[6:]
    ):
        raise ConfigurationError(f"bad endpoint {endpoint!r}: expected tcp://HOST:PORT")
    return endpoint


__all__ = ["KeyHolders", "Node", "PeerInfo", "SurveyResult", "TelemetryConfig"]


def _default_keyring() -> Keyring:
    """The keyring `mesh keygen` writes by default, when no other was given."""
    path = _env.default_keyfile()
    if not path.exists():
        raise ConfigurationError(
            "a node needs a keyring: pass keyring=Keyring.load(path), set IRISMESH_KEYFILE, or "
            f"run `mesh keygen` to write the default one ({path})"
        )
    return Keyring.load(path)
