"""`Node`: one service's place in the mesh (asyncio API).

async with irismesh.Node(cluster="db", keyring=keys) as node:
    @node.on_request
    async def handle(payload: bytes) -> bytes: ...

async with irismesh.Node(keyring=keys, seeds=["tcp://127.0.0.1:7400"]) as client:
    reply = await client.request("db", b"GET k", timeout=1.0)

A `Node` is a facade: the protocol is the sans-I/O core (`irismesh._core`), sockets and the
event loop are the driver's (`irismesh._driver`), calls and handlers live in `patterns.reqrep`
(`Caller`, `HandlerRunner`), messages in `patterns.pubsub`, tunnels in `patterns.tunnel`,
telemetry in `telemetry.node_telemetry`. Its API is a list of parts, each a mixin of methods in
a module of its own (`irismesh._nodestate` lists them, with the state they share): requests,
broadcasts and surveys, publish/subscribe, tunnels, the memory, shared data, traffic splits,
what the node knows of the mesh, its discovery, its keyring. What stays here is the wiring:
the constructor's argument checks, starting and closing, and the core's events to each part.

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
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from irismesh import _env, _stream
from irismesh._core.config import CoreConfig
from irismesh._core.engine import MeshCore
from irismesh._core.events import (
    Event,
    LinksChanged,
    PeerDown,
    PeerUp,
    RequestArrived,
    RequestCancelled,
    Token,
    TracedRequestArrived,
)
from irismesh._core.frames import MAX_CLUSTERS, Kind, pack_error
from irismesh._core.gossip import MAX_NAME
from irismesh._core.records import validate_name
from irismesh._core.split import validate_version
from irismesh._datagrams import DatagramSocket
from irismesh._driver import Driver
from irismesh._spin import Spin
from irismesh._stream import StreamDriver
from irismesh.data.api import DataApi
from irismesh.discovery.config import MdnsConfig, SurveyConfig, mdns_config, survey_config
from irismesh.discovery.node_discovery import DiscoveryApi
from irismesh.errors import Closed, ConfigurationError
from irismesh.introspection import IntrospectionApi, PeerInfo, ServedClusters
from irismesh.memory import MEMORY_CLUSTER
from irismesh.memory.api import MemoryApi
from irismesh.memory.queued import QueuedJobs
from irismesh.patterns.fanout_api import FanoutApi, SurveyResult
from irismesh.patterns.pubsub import PubSub
from irismesh.patterns.pubsub_api import PubSubApi
from irismesh.patterns.reqrep import Caller, ForwardedError, HandlerRunner
from irismesh.patterns.reqrep_api import RequestApi
from irismesh.patterns.split import SplitApi
from irismesh.patterns.tunnel import Tunnels
from irismesh.patterns.tunnel_api import TunnelApi
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring
from irismesh.security.linksecurity import KeyedLinkSecurity
from irismesh.security.node_grants import GrantsApi, GrantSource
from irismesh.security.node_keys import KeyHolders, KeyringApi
from irismesh.telemetry.node_telemetry import NodeTelemetry, TelemetryConfig
from irismesh.telemetry.recorder import Recorder
from irismesh.telemetry.tracing import tracing_wanted

if TYPE_CHECKING:
    import zmq
    from opentelemetry.trace import TracerProvider

    from irismesh.discovery.mdns import MdnsDiscovery
    from irismesh.discovery.survey import SurveyDiscovery
    from irismesh.memory.service import NodeMemory
    from irismesh.memory.store import Retention
    from irismesh.telemetry.metrics_endpoint import MetricsEndpoint
    from irismesh.telemetry.tracing import Tracing

E = TypeVar("E")

DEFAULT_BIND = "tcp://127.0.0.1:0"
_log = logging.getLogger(__name__)
_KIND_REQUEST, _KIND_BROADCAST = int(Kind.REQUEST), int(Kind.BROADCAST)
_KIND_JOB = int(Kind.JOB)


class Node(
    RequestApi,
    FanoutApi,
    PubSubApi,
    TunnelApi,
    MemoryApi,
    DataApi,
    SplitApi,
    IntrospectionApi,
    DiscoveryApi,
    KeyringApi,
    GrantsApi,
):
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
    `grant` is what an authority lets the node do (a `Grant`, or the path of a file `mesh grant
    --out` wrote; else IRISMESH_GRANT; else node.grant beside the default keyring when the
    identity is the default one). It counts only where the keyring says `@require-grants`:
    then the node presents it at every handshake, and peers refuse what it does not allow with
    `Forbidden` (see `irismesh.security.grants`). A changed grant file is reread as it runs.

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
        grant: GrantSource = None,
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
        self._init_grants(grant)  # what this node may do, where the keyring requires grants
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
        self._pubsub.waited = self._caller.turns.turned  # a publish that waited gave a turn
        # The memory: retained publishes and rereads (`memory`, made on first use); with
        # `memory=DIR`, a store served here (opened now, so a directory that cannot hold it is
        # an error at once).
        if type(replicas) is not int or replicas < 1:
            raise ConfigurationError(f"replicas must be a positive integer, not {replicas!r}")
        self._replicas = replicas
        self._memory: NodeMemory | None = None
        self._newest_live_id = b""
        self._pubsub.observe_id = self._observe_live_id  # retained ids heard advance its clock
        member = None
        if memory is not None:
            from irismesh.memory.service import MemoryMember
            from irismesh.memory.store import MemoryStore

            store = MemoryStore(memory, keyring, retention=memory_retention, sync=memory_sync)
            member = MemoryMember(store)
            self._memory = self._node_memory(member)
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
        self._listen(TracedRequestArrived, self._on_traced_request)
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
            import zmq  # a node on zmq only: the others leave pyzmq unloaded

            from irismesh._zmqdriver import listen

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
            now=time.monotonic(),
            name=self.name,
            version=self.version,
            identity=self.identity,
            grants=self.grants,
        )
        self._membership_changed = asyncio.Event()
        self._tunnels.attach(core)
        driver: Driver
        if ctx is not None and router is not None:
            from irismesh._zmqdriver import ZmqDriver

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
        now = time.monotonic()
        for seed in self._seeds:
            core.add_candidate(seed, now, seed=True)
        driver.process()
        driver.start()
        self._start_keyring_watch(loop)
        self._start_grants(loop)
        if self._memory is not None and self._memory.member is not None:
            # A memory member: copy what the other memory members hold.
            self._keep_data(self._memory.member.store.path)
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

    def set_clusters(self, clusters: Iterable[str]) -> None:
        """Serve `clusters` from now on instead of those named so far (`node.clusters` names
        them; a memory member keeps serving the memory's cluster). Each needs its key, and a
        node serves at most 64 (ConfigurationError, nothing changed). Started, the node
        announces the change and has every caller linked to it handshake again (their
        requests in flight are resent meanwhile), so that callers find a cluster added at once
        and leave one dropped at once. For a node whose clusters come and go, as a gateway's
        node serving what its peers export does; where grants are required, its grant still
        decides what it may serve."""
        names = list(dict.fromkeys(clusters))
        if self._memory is not None and self._memory.member is not None:
            names = list(dict.fromkeys([*names, MEMORY_CLUSTER]))
        if len(names) > MAX_CLUSTERS:
            raise ConfigurationError(f"a node serves at most {MAX_CLUSTERS} clusters")
        for name in names:
            _check_cluster_name(name)
            self.keyring.require(name)
        served = ServedClusters(names)
        served.lister = self._list_clusters
        self.clusters = served
        self.served_clusters = self._served = served  # the keyring watch needs their keys
        core, driver = self._core, self._driver
        if core is not None and driver is not None and not self._closing:
            core.serve(served, time.monotonic())
            driver.process()

    async def _serve_metrics(self) -> None:
        from irismesh.telemetry import metrics_endpoint  # imported only when asked for

        try:
            self._metrics = await metrics_endpoint.serve(self, self.metrics_address)
        except BaseException:
            await self.close()
            raise
        self.metrics_address = self._metrics.address

    async def close(self) -> None:
        """Leave the mesh: say goodbye to peers, fail pending requests with Closed."""
        if self._closing:
            return
        self._closing = self._caller.closed = True
        if self._metrics is not None:
            await self._metrics.withdraw(self)
        await self._stop_keyring_watch()
        await self._stop_grants()
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
        if self._memory is not None:
            self._memory.close()
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
        self._caller.events_at = time.monotonic() if driver is not None else 0.0
        handlers = self._handlers
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event)

    def _on_request(self, event: RequestArrived, traced: bool = False) -> None:
        """A request for a cluster this node serves, to the runner of its kind. `traced`: it
        came with its caller's trace context (a TracedRequestArrived, `_on_traced_request`)."""
        if self._memory_runner is not None and event.cluster == MEMORY_CLUSTER:
            if self.grants.required and self._memory_refused(event):
                return
            self._memory_runner.run(event, traced)
            return
        if event.kind == _KIND_REQUEST:
            self._runner.run(event, traced)
        elif event.kind == _KIND_JOB:
            self._queued.run(event, traced)
        elif event.kind == _KIND_BROADCAST:
            self._broadcasts.run(event, traced)
        else:
            (self._surveys or self._runner).run(event, traced)

    def _on_traced_request(self, event: TracedRequestArrived) -> None:
        self._on_request(event, True)

    def _memory_refused(self, event: RequestArrived) -> bool:
        """With grants required, a memory member checks its callers' topic rights (`refused`
        in irismesh.memory.service): a request beyond them is answered Forbidden, which the
        caller raises, and counted (`memory_refused_forbidden`)."""
        core = self._core
        member = self._memory.member if self._memory is not None else None
        if core is None or member is None:
            return False
        rights = core.caller_rights(event.token[2])
        if rights is None:  # its link is gone: no answer would reach it anyway
            return False
        refusal = member.refused(event.payload, rights)
        if refusal is None:
            return False
        name, right = refusal
        core.stats["memory_refused_forbidden"] += 1
        core.reply(event.token, pack_error("Forbidden", f"{right} {name}"), error=True)
        self._flush_soon()
        return True

    def _on_cancelled(self, event: RequestCancelled) -> None:
        self._runner.cancel(event)
        self._queued.cancel(event)
        if self._memory_runner is not None:
            self._memory_runner.cancel(event)
        if self._surveys is not None:
            self._surveys.cancel(event)

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
