"""Limits and timings of the core, in one frozen record."""

from __future__ import annotations

from dataclasses import dataclass

from irismesh._core.outliers import OutlierConfig
from irismesh._core.records import MembershipConfig
from irismesh.errors import ConfigurationError

# Room for a control frame (a handshake with its record is the largest) and sealing overhead,
# whatever the configured payload limit.
CONTROL_ALLOWANCE = 64 << 10
_MEMBERSHIP = MembershipConfig()  # frozen: one instance serves every default
_OUTLIERS = OutlierConfig()


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """Timings are seconds. Defaults aim at a crash known everywhere within about 3 s in a mesh
    of a hundred nodes, and at once by a caller whose link to it breaks."""

    max_payload: int = 1 << 20
    # Links carry requests; whether a node is alive is membership's to say (`membership`).
    heartbeat_interval: float = 0.2  # a link with requests in flight is pinged this often
    dead_after: float = 1.0  # such a link silent this long: its requests move elsewhere
    max_silence: float = 10.0  # and silent this long: it is closed, and redialled on demand
    idle_link_after: float = 30.0  # a link nothing needs is closed after this long
    handshake_timeout: float = 2.0
    # A connection accepted must prove the mesh key (its HELLO) within hello_timeout, or it is
    # closed. Until it has, it is a stranger: it may send only a frame a HELLO fits in, and at
    # most max_strangers of them are open at once (max_strangers_per_address from one
    # address), the oldest closed to make room (the TCP links; zmq's are zmq's to keep).
    hello_timeout: float = 2.0
    max_strangers: int = 512
    max_strangers_per_address: int = 128
    redial_min: float = 0.1
    redial_max: float = 2.0
    forget_after_failures: int = 3  # non-seed endpoints are dropped after this many failed dials
    membership: MembershipConfig = _MEMBERSHIP
    reply_cache_entries: int = 50_000
    reply_cache_bytes: int = 64 << 20
    max_pending: int = 100_000
    # Handlers a member runs at once, at most (admission finds the limit below it by measuring
    # their latency), and requests that may wait for one.
    max_concurrency: int = 256
    max_waiting: int = 4096
    max_links: int = 256  # links this node dials at once (least recently needed close first)
    pubsub_window: int = 1024  # messages a publisher may have in flight to this node
    max_interest: int = 10_000  # subscription patterns this node keeps for one peer
    max_tunnels: int = 1024  # tunnels open at once at this node, both ends counted
    # Hedged copies a node may send: a token bucket filled by hedge_ratio per hedged request and
    # hedge_rate per second, holding at most hedge_burst (Finagle's retry budget, for hedges).
    hedge_ratio: float = 0.2
    hedge_rate: float = 10.0
    hedge_burst: float = 20.0
    # When a caller takes a member that fails or lags far behind its cluster out of its
    # rotation, and for how long (`outliers`); OutlierConfig(enabled=False) turns it off.
    outliers: OutlierConfig = _OUTLIERS

    def __post_init__(self) -> None:
        if self.max_payload < 1 or self.max_payload > 256 << 20:
            raise ConfigurationError("max_payload must be between 1 byte and 256 MiB")
        if self.heartbeat_interval <= 0 or self.dead_after < 2 * self.heartbeat_interval:
            raise ConfigurationError(
                "heartbeat_interval must be positive and dead_after at least twice it"
            )
        if not self.dead_after <= self.max_silence:
            raise ConfigurationError("max_silence must be at least dead_after")
        if self.idle_link_after <= 0:
            raise ConfigurationError("idle_link_after must be positive")
        if self.pubsub_window < 4 or self.max_interest < 1:
            raise ConfigurationError("pubsub_window must be at least 4, max_interest at least 1")
        if self.max_pending < 1 or self.max_links < 1:
            raise ConfigurationError("max_pending and max_links must be at least 1")
        if self.hello_timeout <= 0:
            raise ConfigurationError("hello_timeout must be positive")
        if self.max_strangers < 1 or self.max_strangers_per_address < 1:
            raise ConfigurationError(
                "max_strangers and max_strangers_per_address must be at least 1"
            )
        if self.max_concurrency < 8 or self.max_waiting < 1:
            raise ConfigurationError("max_concurrency must be at least 8, max_waiting at least 1")

    @property
    def max_frame(self) -> int:
        """Largest frame accepted: a full payload plus envelope and sealing overhead."""
        return self.max_payload + CONTROL_ALLOWANCE
