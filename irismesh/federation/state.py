"""What a gateway holds, declared once for the modules that make up `Gateway`.

`Gateway` (`gateway`) is its state, links and lifecycle, plus a mixin of methods per concern
(`imports`, `exports`, `topics`, `fellows`); each mixin works on the state below, which
`Gateway.__init__` sets. The declarations cost nothing at run time: they are for the type
checker, and for the reader who wants the whole state in one place.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from irismesh._core.events import RequestArrived
    from irismesh.federation.crossing import Barrier, Crossing, OriginIds
    from irismesh.federation.grants import GatewayGrant
    from irismesh.federation.link import LinkTransport
    from irismesh.federation.linkproto import Exports, Item, LinkConfig, LinkEnd
    from irismesh.federation.redundancy import Redundancy
    from irismesh.federation.tunnels import GatewayTunnels
    from irismesh.node import Node
    from irismesh.security.keyring import Keyring


class GatewayState:
    """The attributes every part of a gateway may use (see `Gateway.__init__`)."""

    mesh: str
    name: str | None
    keyring: Keyring
    export: Exports
    import_ports: tuple[int, int] | None
    node: Node  # the gateway's node of its own mesh
    transport: LinkTransport  # the links to peer gateways
    tunnels: GatewayTunnels
    stats_counter: Counter[str]
    import_errors: dict[str, str]  # cluster -> why its import could not start
    grant: GatewayGrant  # what its grant lets it carry (`grants`)
    _export_forbidden: frozenset[
        str
    ]  # clusters it was told to export that its grant does not allow
    _node_args: dict[str, Any]
    _default_timeout: float
    _link_config: LinkConfig
    _closing: bool
    # The importing side (`imports`).
    _imports: dict[str, Node]  # cluster -> the node that serves it here
    _imports_here: bool  # grants required: the gateway's node serves them itself
    _serving_here: bool  # the gateway's node's requests come to `_on_node_request`
    _serves: tuple[str, ...]  # what the gateway's node serves besides imported clusters
    _answering: set[asyncio.Future[Any]]  # its broadcasts and surveys passed on, unanswered
    _import_retry: asyncio.TimerHandle | None
    _reconciling: asyncio.Task[None] | None
    _reconcile_again: bool
    _calls: dict[int, tuple[asyncio.Future[bytes], LinkEnd]]  # fan-outs
    _passed: dict[int, tuple[RequestArrived, LinkEnd, Node]]
    _passed_ids: dict[tuple[bytes, int], int]
    _sweeping: asyncio.TimerHandle | None
    _ends_for: dict[str, list[LinkEnd]]
    _call_ids: itertools.count[int]
    _outstanding: Counter[int]
    # The exporting side (`exports`).
    _broadcasting: set[asyncio.Task[bytes]]
    # Topics (`topics`).
    _carried: dict[int, int]
    _origin_ids: OriginIds
    _barrier: Barrier
    _inbound: asyncio.Queue[tuple[LinkEnd, Crossing, bool]] | None
    _queued: int
    _done: int
    _progress: asyncio.Event | None
    _not_republished: OrderedDict[tuple[str, bytes], None]
    _drained: asyncio.Event | None
    _gateway_ids: set[str]
    _native_publishers: OrderedDict[str, None]
    # The other gateways of this mesh (`fellows`).
    _redundancy: Redundancy | None
    _warm: asyncio.Event | None
    _told: deque[list[Any]]
    _acked_pending: deque[tuple[float, str, list[bytes]]]
    _acked_pending_ids: int
    _telling: asyncio.Task[None] | None
    _state_at: float
    _linked_since: dict[str, float]
    _shared: frozenset[str]

    if TYPE_CHECKING:  # one part's methods that another calls, with their signatures there
        _send: Callable[[LinkEnd, Item], bool]
        _describe: Callable[[bytes], bytes]
        _on_sync: Callable[[bytes], None]
        _on_gateway_survey: Callable[[bytes], Awaitable[bytes]]
        _reach: Callable[[Crossing], list[str]]
        _marked: Callable[..., list[Any]]
        _republished_elsewhere: Callable[[str, list[Crossing]], Awaitable[list[bool]]]
