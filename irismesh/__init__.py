"""irismesh: a decentralised, brokerless service mesh.

Every service embeds a `Node`; nodes find each other, join clusters addressed by name, and
talk request/reply load-balanced over a cluster's members. `irismesh.sync.Node` is the same
API for code that does not run asyncio. docs/getting-started.md is a tour.

`import irismesh` loads what a node needs to request, serve, publish and subscribe. The rest
loads when first used: the federation (`Gateway`, `LocalGateways`) and the memory's store
(`Retention`, `Remembered`) on first access to those names, pyzmq with a node whose
transport is zmq, zeroconf with mDNS discovery (a test keeps it so).
"""

from typing import TYPE_CHECKING, Any

from irismesh import _lazy
from irismesh._core.config import CoreConfig
from irismesh._core.outliers import OutlierConfig
from irismesh._core.priority import MAX_PRIORITY, MIN_PRIORITY, Priority
from irismesh._core.rights import Rights
from irismesh._loop import loop_factory, new_event_loop, run
from irismesh.discovery.config import MdnsConfig, SurveyConfig
from irismesh.errors import (
    Closed,
    ConfigurationError,
    DataTimeout,
    EndOfStream,
    Forbidden,
    InterestTimeout,
    MemberLost,
    MembershipTimeout,
    MeshError,
    NoKey,
    NoResponders,
    Overloaded,
    PayloadTooLarge,
    ProtocolError,
    RemoteError,
    RequestError,
    RequestTimeout,
    SlowConsumer,
    StorageError,
    TunnelError,
    TunnelReset,
)
from irismesh.node import Node, PeerInfo, SurveyResult, TelemetryConfig
from irismesh.patterns.pubsub import Message, Subscription
from irismesh.patterns.reqrep import deadline, time_left
from irismesh.patterns.split import SplitView
from irismesh.patterns.tunnel import Tunnel
from irismesh.security.grants import Authority, Grant, Revocation
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring, ScopeKey

if TYPE_CHECKING:
    from irismesh.federation import Gateway, LocalGateways
    from irismesh.memory.store import Retention
    from irismesh.memory.store import Stored as Remembered

__version__ = "0.1.0"

# Names whose modules load on first access: (module, name there).
_LAZY = {
    "Gateway": ("irismesh.federation", "Gateway"),
    "LocalGateways": ("irismesh.federation", "LocalGateways"),
    "Retention": ("irismesh.memory.store", "Retention"),
    "Remembered": ("irismesh.memory.store", "Stored"),
}


def __getattr__(name: str) -> Any:
    return _lazy.attribute(__name__, name, _LAZY)


def __dir__() -> list[str]:  # the names that load on first access too
    return sorted({*globals(), *_LAZY})


__all__ = [
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "Authority",
    "Closed",
    "ConfigurationError",
    "CoreConfig",
    "DataTimeout",
    "EndOfStream",
    "Forbidden",
    "Gateway",
    "Grant",
    "Identity",
    "InterestTimeout",
    "Keyring",
    "LocalGateways",
    "MdnsConfig",
    "MemberLost",
    "MembershipTimeout",
    "MeshError",
    "Message",
    "NoKey",
    "NoResponders",
    "Node",
    "OutlierConfig",
    "Overloaded",
    "PayloadTooLarge",
    "PeerInfo",
    "Priority",
    "ProtocolError",
    "Remembered",
    "RemoteError",
    "RequestError",
    "RequestTimeout",
    "Retention",
    "Revocation",
    "Rights",
    "ScopeKey",
    "SlowConsumer",
    "SplitView",
    "StorageError",
    "Subscription",
    "SurveyConfig",
    "SurveyResult",
    "TelemetryConfig",
    "Tunnel",
    "TunnelError",
    "TunnelReset",
    "__version__",
    "deadline",
    "loop_factory",
    "new_event_loop",
    "run",
    "time_left",
]
