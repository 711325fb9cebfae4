"""What a node asks of discovery: the survey's and mDNS's settings (`SurveyConfig`,
`MdnsConfig`), and how `Node(survey=..., mdns=...)` and the keyring become them.

A node makes its settings when it is constructed; the mechanisms (`survey`, `mdns`) load when
its discovery starts, so a node given its seeds with discovery off never loads them. Both
modules give these names as well.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from irismesh.discovery._common import ipv4_host
from irismesh.errors import ConfigurationError

if TYPE_CHECKING:
    from irismesh.security.keyring import Keyring

__all__ = [
    "DEFAULT_SERVICE_TYPE",
    "MdnsConfig",
    "SurveyConfig",
    "mdns_config",
    "realm_key",
    "survey_config",
]

MAX_REALM_LEN = 32  # bytes of a survey realm key
MAX_INTERVAL = 3600.0  # the longest wait between a joined node's questions
DEFAULT_SERVICE_TYPE = "_irismesh._tcp.local."
REALM_KEY_LEN = 32  # bytes of an mDNS realm key
# RFC 6335 service names: at most 15 characters, a letter among them, no hyphen at either end.
_SERVICE_TYPE = re.compile(
    r"_(?=[A-Za-z0-9-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9-]{0,13}[A-Za-z0-9])?\._tcp\.local\."
)


# ---------------------------------------------------------------------------------------------
# the survey


@dataclass(frozen=True, slots=True, kw_only=True)
class SurveyConfig:
    """Where to ask and how often; the defaults stay on loopback."""

    group: str = "239.255.73.1"
    port: int = 47473
    interface: str = "127.0.0.1"
    fast_interval: float = 0.1
    fast_period: float = 2.0
    slow_interval: float = 5.0
    jitter: float = 0.25
    # A node in a mesh asks every mesh_interval x (the nodes it knows + 1), at least every
    # slow_interval: the whole mesh asks about once per mesh_interval, and each of its nodes
    # hears that many questions (each costs a receiver about 0.1 ms of CPU).
    mesh_interval: float = 2.0
    # How long a candidate may stay unknown to membership before it is taken for a node of
    # another mesh and passed on (to be dialled and merged).
    merge_after: float = 0.5
    # A node with live peers answers after a random delay of up to this (seconds).
    answer_spread: float = 0.2
    # The realm key: datagrams are tagged with it, and only datagrams whose tag verifies under
    # it (or under one of `accepted_realms`, during a key rotation) give candidates.
    realm: bytes = b""
    accepted_realms: tuple[bytes, ...] = ()
    # How far (seconds) a datagram's time may be from this node's clock; older or newer ones
    # are dropped as stale. Clocks of the nodes on one network must agree this closely.
    freshness: float = 30.0
    # Hosts to also ask by unicast, at `port` (for nodes that multicast cannot reach, e.g. the
    # hosts of a node's seeds on another subnet); every node listens for unicast questions on
    # (interface, port).
    unicast_targets: tuple[str, ...] = ()

    def next_interval(self, since_news: float, previous: float) -> float:
        """The wait before the next question of a node alone (`joined_interval`: of a node in
        a mesh), before jitter.

        ``since_news`` is the time since the node started or last heard of a node it did not
        know; ``previous`` is the wait it used last. New or in a changing mesh, it asks every
        ``fast_interval``; once stable it doubles the wait up to ``slow_interval``.
        """
        if since_news < self.fast_period:
            return self.fast_interval
        return min(self.slow_interval, 2 * previous)

    def joined_interval(self, live_peers: int) -> float:
        """The wait between a joined node's questions, before jitter: proportional to the
        mesh's size, so the whole mesh asks about once per ``mesh_interval``."""
        return min(MAX_INTERVAL, max(self.slow_interval, self.mesh_interval * (live_peers + 1)))

    def __post_init__(self) -> None:
        try:
            group = ipaddress.IPv4Address(self.group)
            interface = ipaddress.IPv4Address(self.interface)
        except ValueError as exc:
            raise ConfigurationError(f"survey group and interface must be IPv4: {exc}") from None
        if not group.is_multicast:
            raise ConfigurationError(f"survey group {self.group} is not a multicast address")
        # 0.0.0.0 lets the routing table pick the interface and 255.255.255.255 (reserved) is
        # broadcast: either can leak out of an interface nobody chose.
        if interface.is_unspecified or interface.is_multicast or interface.is_reserved:
            raise ConfigurationError(
                f"survey interface {self.interface} must be the address of one interface, "
                "e.g. 127.0.0.1 (the default) or this host's LAN address"
            )
        if not 1 <= self.port <= 65535:
            raise ConfigurationError(f"survey port {self.port} is not in 1..65535")
        if not (
            self.fast_interval > 0
            and self.slow_interval > 0
            and self.fast_period >= 0
            and self.mesh_interval > 0
            and self.merge_after > 0
            and self.answer_spread >= 0
        ):
            raise ConfigurationError("survey intervals must be positive")
        if not 0 <= self.jitter < 1:
            raise ConfigurationError(f"survey jitter {self.jitter} is not in [0, 1)")
        for target in self.unicast_targets:
            ipv4_host(
                target,
                not_ipv4=f"survey unicast target {target!r} is not an IPv4 address",
                not_host=f"survey unicast target {target} is not a host address",
            )
        if len(self.unicast_targets) > 64:
            raise ConfigurationError("at most 64 survey unicast targets")
        if any(len(realm) > MAX_REALM_LEN for realm in (self.realm, *self.accepted_realms)):
            raise ConfigurationError(f"survey realm is longer than {MAX_REALM_LEN} bytes")
        if not 0.5 <= self.freshness <= 3600:
            raise ConfigurationError(f"survey freshness {self.freshness} is not in 0.5..3600 s")


def survey_config(
    survey: bool | SurveyConfig, keyring: Keyring, interface: str = "127.0.0.1"
) -> SurveyConfig | None:
    """What `Node(survey=...)` asks for. True: on `interface`, and the realm key derived from
    the mesh's '*' key (its primary; datagrams tagged under its other key are heard too, during
    a rotation), so other meshes stay apart."""
    if isinstance(survey, SurveyConfig):
        return survey
    if not survey:
        return None
    realms = [realm_key(key.secret) for key in keyring.accepted("*")]
    if not realms:
        return SurveyConfig(interface=interface)
    return SurveyConfig(interface=interface, realm=realms[0], accepted_realms=tuple(realms[1:]))


def realm_key(secret: bytes) -> bytes:
    """The survey's realm key made from a keyring secret."""
    return hmac.new(secret, b"irismesh/v1/survey-realm", hashlib.sha256).digest()[:16]


# ---------------------------------------------------------------------------------------------
# mDNS


@dataclass(frozen=True, slots=True, kw_only=True)
class MdnsConfig:
    """Where to announce and browse, and the realm key; the defaults stay on loopback.

    ``realm_key`` tags this node's records and admits peers whose tags verify under it (or
    under one of ``accepted_realm_keys``, for a key rotation); None admits any irismesh node.
    A node's realm key is typically its keyring's ``*`` key.
    """

    interfaces: tuple[str, ...] = ("127.0.0.1",)
    service_type: str = DEFAULT_SERVICE_TYPE
    realm_key: bytes | None = None
    accepted_realm_keys: tuple[bytes, ...] = ()
    resolve_timeout: float = 3.0
    # Candidates found are offered again this often: the mesh forgets an endpoint after a few
    # failed dials (a partition), and zeroconf reports a service only when its records change.
    reoffer_interval: float = 5.0

    def __post_init__(self) -> None:
        # A lone string would pass as a tuple of one-character "interfaces".
        if isinstance(cast(object, self.interfaces), str) or not self.interfaces:
            raise ConfigurationError(
                "mdns interfaces must be a non-empty tuple of IPv4 addresses, e.g. ('127.0.0.1',)"
            )
        for text in self.interfaces:
            # 0.0.0.0 and the broadcast address stand for no one interface: mDNS would leave by
            # whichever interface the routing table picks.
            address = ipv4_host(
                text,
                not_ipv4=f"mdns interface {text!r} is not an IPv4 address: name each interface "
                "by its address, e.g. '127.0.0.1'",
                not_host=f"mdns interface {text} must be the address of one interface, e.g. "
                "127.0.0.1 (the default) or this host's LAN address",
            )
            if str(address) != text:
                raise ConfigurationError(f"write mdns interface {text!r} as {str(address)!r}")
        if not _SERVICE_TYPE.fullmatch(self.service_type) or "--" in self.service_type:
            raise ConfigurationError(
                f"mdns service type {self.service_type!r} is not '_<name>._tcp.local.' with a "
                "name of 1-15 letters, digits and inner hyphens (RFC 6335), e.g. "
                f"{DEFAULT_SERVICE_TYPE!r}"
            )
        for key in (self.realm_key, *self.accepted_realm_keys):
            if key is not None and (not isinstance(key, bytes) or len(key) != REALM_KEY_LEN):
                raise ConfigurationError(
                    f"an mdns realm key must be {REALM_KEY_LEN} bytes, e.g. a keyring key's secret"
                )
        if self.accepted_realm_keys and self.realm_key is None:
            raise ConfigurationError("accepted_realm_keys needs a realm_key to tag with")
        if not self.reoffer_interval > 0:
            raise ConfigurationError(f"mdns reoffer_interval {self.reoffer_interval} must be > 0")
        if not 0 < self.resolve_timeout <= 60:
            raise ConfigurationError(f"mdns resolve_timeout {self.resolve_timeout} not in (0, 60]")

    @property
    def verifying_keys(self) -> tuple[bytes, ...]:
        """Every key a peer's tag may verify under: the realm key first."""
        if self.realm_key is None:
            return ()
        return (self.realm_key, *(k for k in self.accepted_realm_keys if k != self.realm_key))


def mdns_config(
    mdns: bool | MdnsConfig, keyring: Keyring, interface: str = "127.0.0.1"
) -> MdnsConfig | None:
    """What `Node(mdns=...)` asks for. True: on `interface`, records tagged with the default
    key, so only this mesh's nodes are candidates."""
    if isinstance(mdns, MdnsConfig):
        return mdns
    if not mdns:
        return None
    keys = keyring.accepted("*")
    if not keys:  # no mesh-wide key: any irismesh node is a candidate; the handshake decides
        return MdnsConfig(interfaces=(interface,))
    return MdnsConfig(
        interfaces=(interface,),
        realm_key=keys[0].secret,
        accepted_realm_keys=tuple(k.secret for k in keys[1:]),
    )
