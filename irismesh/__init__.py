"""irismesh: a decentralised, brokerless service mesh.

Every service embeds a `Node`; nodes find each other, join clusters addressed by name, and
talk request/reply load-balanced over a cluster's members. `irismesh.sync.Node` is the same
API for code that does not run asyncio. docs/getting-started.md is a tour.
"""

from irismesh._core.config import CoreConfig
from irismesh._core.outliers import OutlierConfig
from irismesh._core.priority import MAX_PRIORITY, MIN_PRIORITY, Priority
from irismesh._core.rights import Rights
from irismesh._loop import loop_factory, new_event_loop, run
from irismesh.discovery.mdns import MdnsConfig
from irismesh.discovery.survey import SurveyConfig
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
from irismesh.federation import Gateway, LocalGateways
from irismesh.memory.store import Retention
from irismesh.memory.store import Stored as Remembered
from irismesh.node import Node, PeerInfo, SurveyResult, TelemetryConfig
from irismesh.patterns.pubsub import Message, Subscription
from irismesh.patterns.reqrep import deadline, time_left
from irismesh.patterns.split import SplitView
from irismesh.patterns.tunnel import Tunnel
from irismesh.security.grants import Authority, Grant, Revocation
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring, ScopeKey

__version__ = "0.1.0"

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
