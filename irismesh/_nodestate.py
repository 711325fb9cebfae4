"""What a node holds, declared once for the modules that make up `Node`.

`Node` (`irismesh.node`) is its constructor, lifecycle and event dispatch, plus a mixin of
methods per part of its API: request/reply (`patterns.reqrep_api`), broadcasts and surveys
(`patterns.fanout_api`), publish/subscribe (`patterns.pubsub_api`), tunnels
(`patterns.tunnel_api`), what it knows of the mesh (`introspection`), its discovery
(`discovery.node_discovery`), and the memory's, the data's, the keyring's and the traffic
split's (`memory.api`, `data.api`, `security.node_keys`, `patterns.split`). The mixins work on
the state below, which `Node.__init__` and `Node.start` set. The declarations cost nothing at
run time (a method found on a mixin is found as fast as one on `Node`): they are for the type
checker, and for the reader who wants the whole state in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from irismesh._core.config import CoreConfig
    from irismesh._core.engine import MeshCore
    from irismesh._core.events import Token
    from irismesh._driver import Driver
    from irismesh.discovery.mdns import MdnsConfig, MdnsDiscovery
    from irismesh.discovery.survey import SurveyConfig, SurveyDiscovery
    from irismesh.introspection import PeerInfo, ServedClusters
    from irismesh.memory.queued import QueuedJobs
    from irismesh.memory.service import NodeMemory
    from irismesh.patterns.pubsub import PubSub
    from irismesh.patterns.reqrep import Caller, HandlerRunner
    from irismesh.patterns.tunnel import Tunnels
    from irismesh.security.grants import NodeGrants
    from irismesh.security.keyring import Keyring
    from irismesh.telemetry.recorder import Recorder
    from irismesh.telemetry.tracing import Tracing


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel a node's background `task` (None: there is none) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class NodeState:
    """The attributes every part of a node may use (see `Node.__init__`)."""

    node_id: bytes
    name: str
    keyring: Keyring
    grants: NodeGrants  # what this node's grant lets it do (`security.node_grants`)
    clusters: ServedClusters
    served_clusters: tuple[str, ...]
    endpoint: str
    tracing: Tracing | None
    recorder: Recorder | None
    _config: CoreConfig
    _default_timeout: float
    _handler_threads: int
    # Set by `start`; None until then.
    _core: MeshCore | None
    _driver: Driver | None
    _loop: asyncio.AbstractEventLoop | None
    _membership_changed: asyncio.Event | None
    _closing: bool
    # Calls and handlers (`patterns.reqrep`), messages, tunnels.
    _caller: Caller
    _runner: HandlerRunner  # requests
    _broadcasts: HandlerRunner
    _surveys: HandlerRunner | None  # None: surveys go to the request handler
    _queued: QueuedJobs
    _serving_stats: Counter[str]  # admission's counters, every runner's
    _relays_failures: bool  # `_relay_failed` hears of RequestFailed events
    _pubsub: PubSub
    _tunnels: Tunnels
    # The memory (`memory.api`).
    _memory: NodeMemory | None  # made on first use, or by a memory member's constructor
    _newest_live_id: bytes  # the newest retained id heard live before the memory was made
    _replicas: int
    _priming: set[asyncio.Task[None]]  # subscriptions rereading the memory
    _catching_up: asyncio.Task[None] | None
    # What the node knows of the mesh (`introspection`) and how it finds it (`discovery`).
    _departed: dict[str, PeerInfo]  # hex id -> the peer as it went
    _discovery: list[MdnsDiscovery | SurveyDiscovery]  # started, in order
    _discovery_asked: tuple[bool | SurveyConfig, bool | MdnsConfig, str]
    _survey_config: SurveyConfig | None
    _mdns_config: MdnsConfig | None
    _survey_required: bool
    _rediscovering: asyncio.Task[None] | None

    if TYPE_CHECKING:  # the node's own, or one part's that another calls
        close: Callable[[], Awaitable[None]]
        _listen: Callable[[type[Any], Callable[[Any], None]], None]
        _flush_soon: Callable[[], None]
        _reply: Callable[[Token, bytes], None]
        _reply_error: Callable[[Token, BaseException], None]
        _turn_away: Callable[[Token, str], None]
        _linked: Callable[..., Awaitable[float]]
        _serving_runner: Callable[..., HandlerRunner]
        _retain: Callable[[str, bytes, float | None], Awaitable[bytes]]
        _prime: Callable[..., Coroutine[Any, Any, None]]
        _data_figures: Callable[[], dict[str, int]]
        wait_for_members: Callable[..., Awaitable[int]]
