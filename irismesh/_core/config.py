"""Limits and timings of the core, in one frozen record."""

from __future__ import annotations

from dataclasses import dataclass

from irismesh.errors import ConfigurationError

# Room for a control frame (a peer list is the largest) and sealing overhead, whatever the
# configured payload limit.
CONTROL_ALLOWANCE = 64 << 10


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """Timings are seconds. Defaults aim at failure detection in about a second."""

    max_payload: int = 1 << 20
    heartbeat_interval: float = 0.2
    dead_after: float = 1.0  # no frame from a peer for this long (nor word of it): it is dead
    suspect_after: float = 0.0  # silent this long: ask `indirect_probes` peers whether they
    indirect_probes: int = 3  #   hear it (0: 0.6 x dead_after)
    max_vouched_silence: float = 0.0  # others hear it and we do not, this long: redial (0: 10x)
    handshake_timeout: float = 2.0
    redial_min: float = 0.1
    redial_max: float = 2.0
    forget_after_failures: int = 3  # non-seed endpoints are dropped after this many failed dials
    gossip_interval: float = 3.0
    reply_cache_entries: int = 50_000
    reply_cache_bytes: int = 64 << 20
    max_pending: int = 100_000
    max_links: int = 256  # links this node dials at once (each costs sockets and descriptors)
    pubsub_window: int = 1024  # messages a publisher may have in flight to this node
    max_interest: int = 10_000  # subscription patterns this node keeps for one peer
    max_tunnels: int = 1024  # tunnels open at once at this node, both ends counted
    # Hedged copies a node may send: a token bucket filled by hedge_ratio per hedged request and
    # hedge_rate per second, holding at most hedge_burst (Finagle's retry budget, for hedges).
    hedge_ratio: float = 0.2
    hedge_rate: float = 10.0
    hedge_burst: float = 20.0

    def __post_init__(self) -> None:
        if self.max_payload < 1 or self.max_payload > 256 << 20:
            raise ConfigurationError("max_payload must be between 1 byte and 256 MiB")
        if self.heartbeat_interval <= 0 or self.dead_after < 2 * self.heartbeat_interval:
            raise ConfigurationError(
                "heartbeat_interval must be positive and dead_after at least twice it"
            )
        if not self.suspect_after:
            object.__setattr__(self, "suspect_after", 0.6 * self.dead_after)
        if not self.max_vouched_silence:
            object.__setattr__(self, "max_vouched_silence", 10 * self.dead_after)
        if not 0 < self.suspect_after < self.dead_after <= self.max_vouched_silence:
            raise ConfigurationError("need 0 < suspect_after < dead_after <= max_vouched_silence")
        if self.pubsub_window < 4 or self.max_interest < 1:
            raise ConfigurationError("pubsub_window must be at least 4, max_interest at least 1")
        if self.max_pending < 1 or self.max_links < 1:
            raise ConfigurationError("max_pending and max_links must be at least 1")

    @property
    def max_frame(self) -> int:
        """Largest frame accepted: a full payload plus envelope and sealing overhead."""
        return self.max_payload + CONTROL_ALLOWANCE
