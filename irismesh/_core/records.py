"""The members of the mesh as the membership protocol sees them, and what it tells its driver."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol

from irismesh._core.gossip import (
    MAX_DATAGRAM,
    MAX_NAME,
    NODE_ID_SIZE,
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    encode_message,
    is_name,
)
from irismesh._core.plain import Frozen
from irismesh.errors import ConfigurationError

NOTE_SALT: Final = 16  # bytes of fresh salt a note is sealed with (`seal_note`)


class MemberState(enum.IntEnum):
    """The order matters: a member is live (probed, sent gossip) while state <= SUSPECT."""

    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


_ID_DOMAIN: Final = b"irismesh node id v1\x00"
_RECORD_DOMAIN: Final = b"irismesh record v1"


def node_id_of(public: bytes) -> bytes:
    """The node id an Ed25519 public key owns: the first 16 bytes of SHA-256 over a domain
    string and the key. Nobody can claim an id without the private key of the public key."""
    return hashlib.sha256(_ID_DOMAIN + public).digest()[:NODE_ID_SIZE]


class NodeIdentity(Protocol):
    """A node's key pair (implemented in `irismesh.security.identity`): it signs this node's
    handshakes and records, and checks its peers'."""

    @property
    def public(self) -> bytes: ...

    def sign(self, message: bytes) -> bytes: ...

    def verify(self, public: bytes, message: bytes, signature: bytes) -> bool:
        """Whether `signature` is `public`'s signature of `message` (never raises)."""
        ...


class MemberRecord(Frozen):
    """What a node says about itself: where to reach it, what it serves (opaque tags), and
    what to call it (a label for people: names need not be unique; the id is the identity).

    `public` and `signature` prove it (`record_transcript`): the node's public key, from which
    its id derives, and its signature of the record at one incarnation. They are not part of
    what the record says (equality ignores them); b"" in cores built without identities.

    A plain class, not a dataclass, as the core's events are (`irismesh._core.events`)."""

    node_id: Final[bytes]
    endpoint: Final[str]  # links: tcp://host:port
    address: Final[str]  # datagrams: host:port
    tags: Final[bytes]
    name: Final[str]  # "": none given (cores built without a name, simulations)
    public: Final[bytes]
    signature: Final[bytes]

    def __init__(
        self,
        node_id: bytes,
        endpoint: str,
        address: str,
        tags: bytes = b"",
        name: str = "",
        public: bytes = b"",
        signature: bytes = b"",
    ) -> None:
        self.node_id, self.endpoint, self.address, self.tags = node_id, endpoint, address, tags
        self.name, self.public, self.signature = name, public, signature

    def _values(self) -> tuple[object, ...]:
        return (self.node_id, self.endpoint, self.address, self.tags, self.name)


def record_transcript(record: MemberRecord, incarnation: int) -> bytes:
    """What a node signs of its record at `incarnation`."""
    fields = [record.node_id, incarnation, record.endpoint, record.address, record.tags]
    return _RECORD_DOMAIN + encode_message([*fields, record.name])


def record_proven(record: MemberRecord, incarnation: int, identity: NodeIdentity) -> bool:
    """Whether `record` is signed, at `incarnation`, by the key its node id derives from."""
    public, signature = record.public, record.signature
    if len(public) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    if node_id_of(public) != record.node_id:
        return False
    return identity.verify(public, record_transcript(record, incarnation), signature)


def validate_name(name: object) -> str:
    """`name` if it may name a node (1 to MAX_NAME printable characters, no whitespace: one
    cell of a table, one word on a command line); ConfigurationError otherwise."""
    if isinstance(name, str) and name and is_name(name):
        return name
    raise ConfigurationError(
        f"bad node name {name!r}: 1-{MAX_NAME} printable characters, no whitespace"
    )


class Member(NamedTuple):
    """One node as this node sees it. Immutable: a change replaces the entry."""

    record: MemberRecord
    incarnation: int
    state: MemberState
    since: float  # when the state last changed


class MemberUp(Frozen):
    """A node joined, or came back from a false death."""

    record: Final[MemberRecord]

    def __init__(self, *, record: MemberRecord) -> None:
        self.record = record


class MemberChanged(Frozen):
    """A live node's record changed (its tags, say: it serves or reads something new)."""

    record: Final[MemberRecord]

    def __init__(self, *, record: MemberRecord) -> None:
        self.record = record


class MemberSuspect(Frozen):
    node_id: Final[bytes]
    suspect: Final[bool]  # False: the suspicion was refuted

    def __init__(self, *, node_id: bytes, suspect: bool) -> None:
        self.node_id, self.suspect = node_id, suspect


class MemberDown(Frozen):
    record: Final[MemberRecord]
    reason: Final[str]  # "dead" or "left"

    def __init__(self, *, record: MemberRecord, reason: str) -> None:
        self.record, self.reason = record, reason


MemberEvent = MemberUp | MemberChanged | MemberSuspect | MemberDown


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipConfig:
    """Timings are seconds; the defaults detect a crash in about 2 to 4 s at 100 nodes, and cost a
    node about a ping and an ack sent and received per 0.4 s, whatever the mesh's size."""

    probe_interval: float = 0.4
    probe_timeout: float = 0.15
    indirect_probes: int = 3
    suspicion_multiplier: float = 2.0  # x log10(N) x probe_interval: 1.6 s at 100 nodes
    suspicion_max_multiplier: float = 2.5
    suspicion_confirmations: int = 3
    retransmit_multiplier: int = 4
    gossip_interval: float = 0.2
    gossip_nodes: int = 3
    gossip_to_dead: float = 3.0  # the dead still hear gossip this long (to refute it)
    push_pull_interval: float = 10.0  # stretched for meshes of more than 32 nodes
    reconnect_interval: float = 2.0  # one dead member is tried this often (healing)
    dead_keep: float = 600.0
    left_keep: float = 30.0
    max_datagram: int = 1400
    max_members: int = 100_000
    awareness_limit: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.probe_timeout < self.probe_interval:
            raise ConfigurationError("need 0 < probe_timeout < probe_interval")
        if self.gossip_interval <= 0 or self.push_pull_interval <= 0:
            raise ConfigurationError("gossip and push-pull intervals must be positive")
        if not 512 <= self.max_datagram <= MAX_DATAGRAM:
            raise ConfigurationError(f"max_datagram must be 512 to {MAX_DATAGRAM} bytes")
        if self.suspicion_multiplier <= 0 or self.suspicion_max_multiplier < 1:
            raise ConfigurationError("suspicion multipliers: > 0, and the maximum's >= 1")


class MembershipSecurity(Protocol):
    """Key-dependent decisions of membership: proofs under the mesh key, and record tags.

    A record's tags say what its node serves and reads without naming it: 8-byte MACs over the
    node's id, under each key that guards a cluster it serves or a topic scope it subscribes
    in. Only a holder of that key can compute one, so only it can tell that a node serves X;
    tags are bound to the node id, so they cannot be copied onto another node's record.
    """

    def mesh_proof(self, label: bytes, transcript: bytes) -> bytes:
        """A MAC under the primary mesh key (handshakes prove mesh membership with it)."""
        ...

    def mesh_proof_ok(self, label: bytes, transcript: bytes, proof: bytes) -> bool:
        """Whether `proof` was made under a mesh key this node accepts."""
        ...

    def member_tags(self, node_id: bytes, clusters: Iterable[str]) -> bytes:
        """The tags proving that `node_id` serves `clusters` (one per accepted key)."""
        ...

    def serves(self, node_id: bytes, tags: bytes, cluster: str) -> bool:
        """Whether the tags show that `node_id` serves `cluster` under a key we hold for it."""
        ...

    def interest_tags(self, node_id: bytes, scopes: Iterable[str], every_scope: bool) -> bytes:
        """The tags saying that `node_id` subscribes in topic `scopes` (or, `every_scope`,
        in every scope it can read: patterns that begin with a wildcard)."""
        ...

    def reads(self, node_id: bytes, tags: bytes, scope: str) -> bool:
        """Whether the tags show interest in topic `scope` under the key we publish it with."""
        ...

    def key_tags(self, node_id: bytes) -> bytes:
        """The tags saying which keys `node_id` holds (and which it uses first), each
        readable only by a holder of that key: how far a key rotation has spread."""
        ...

    def version_tags(self, node_id: bytes, clusters: Iterable[str], version: str) -> bytes:
        """The tags saying that `node_id` serves `clusters` as `version` ("" for none)."""
        ...

    def version_of(
        self, node_id: bytes, tags: bytes, cluster: str, versions: Iterable[str]
    ) -> str | None:
        """Which of `versions` the tags show `node_id` serving `cluster` as (None: none)."""
        ...

    def seal_note(self, cluster: str, salt: bytes, note: bytes) -> bytes:
        """`note` sealed for the holders of `cluster`'s key, as it sits in a record's tags
        (a multiple of 8 bytes); `salt` is fresh random bytes (NOTE_SALT of them)."""
        ...

    def open_notes(self, tags: bytes, cluster: str) -> list[tuple[bytes, bytes]]:
        """The notes on `cluster` that the tags carry (none without its key): each opened,
        and as it sits in the tags (to carry it on as it is)."""
        ...


__all__ = [
    "NOTE_SALT",
    "Member",
    "MemberChanged",
    "MemberDown",
    "MemberEvent",
    "MemberRecord",
    "MemberState",
    "MemberSuspect",
    "MemberUp",
    "MembershipConfig",
    "MembershipSecurity",
    "NodeIdentity",
    "node_id_of",
    "record_proven",
    "record_transcript",
    "validate_name",
]
