"""Link security from a keyring: X25519 link keys, keyed offer tags, AES-256-GCM sealers.

Per link end, `begin()` makes an ephemeral X25519 key pair; the two public keys cross in HELLO
and WELCOME, and the shared secret (with both nonces as salt) keys the link's control traffic,
so a passive observer sees no peer list, ping or goodbye, and a later key compromise reveals no
past link (forward secrecy). Control traffic is thus confidential but not authenticated to a
cluster: it carries nothing a cluster key protects.

Cluster traffic is keyed by the cluster key and the link secret together: session keys are
HKDF-SHA256(cluster key | link secret, salt = listener nonce | dialler nonce, info = domain |
direction | cluster), one per direction, so only holders of the cluster key can read, forge or
answer requests (a dialler without it cannot even produce a request the member will open), and
a later leak of the cluster key does not open recorded traffic (forward secrecy).

An offer tag is HMAC-SHA256(cluster key, domain | listener nonce | dialler nonce | cluster)
truncated to 16 bytes. A member offers one tag per key it accepts for a cluster, and a caller
matches them with every key it accepts (primary first), so a rotation works in any order as
long as two nodes share one key.

`Node(sealing=False)` (benchmarks only) keeps the tags and drops sealing.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from irismesh._core.gossip import DatagramSealer
from irismesh._core.sealing import NULL_SEALER, Sealer
from irismesh.errors import ProtocolError
from irismesh.security.keyring import MESH_SCOPE, Keyring, ScopeKey
from irismesh.security.meshkey import (
    KeyedMembershipSecurity,
    MeshDatagramSealer,
    datagram_sealer,
)

_OFFER_DOMAIN = b"irismesh/v1/offer\x00"
_LINK_DOMAIN = b"irismesh/v1/link\x00"
_CLUSTER_DOMAIN = b"irismesh/v1/cluster\x00"
# Offers and session keys for topics are named apart from clusters: topic scope S (a scope with
# a key of its own) is "topic:S", the topics under the default key are "topic-default".
_TOPIC_PREFIX = "topic:"
_TOPIC_DEFAULT = "topic-default"
_NONCE = struct.Struct("!4xQ")  # 96-bit GCM nonce: 32 zero bits, then the frame's seq
TAG_SIZE = 16


def offer_tag(secret: bytes, cluster: str, listener_nonce: bytes, dialler_nonce: bytes) -> bytes:
    message = _OFFER_DOMAIN + listener_nonce + dialler_nonce + cluster.encode()
    return hmac.new(secret, message, hashlib.sha256).digest()[:TAG_SIZE]


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


class AeadSealer:
    """AES-256-GCM with the frame's seq as nonce counter and its header as associated data."""

    __slots__ = ("_decrypt", "_encrypt")

    overhead = 16

    def __init__(self, key: bytes) -> None:
        aead = AESGCM(key)
        self._encrypt = aead.encrypt
        self._decrypt = aead.decrypt

    def seal(self, header: bytes, seq: int, body: bytes) -> bytes:
        return self._encrypt(_NONCE.pack(seq), body, header)

    def open(self, header: bytes, seq: int, sealed: bytes | memoryview) -> bytes:
        try:
            return self._decrypt(_NONCE.pack(seq), sealed, header)
        except InvalidTag:
            raise ProtocolError("bad_seal") from None


class X25519LinkKeys:
    """One link end's key agreement and the sealers derived from it."""

    __slots__ = ("_link_secret", "_nonces", "_private", "_sealers", "_sealing", "public")

    def __init__(self, sealing: bool) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()
        self._sealing = sealing
        self._link_secret = b""
        self._nonces = b""
        self._sealers: dict[tuple[object | None, bool], Sealer] = {}

    def establish(self, peer_public: bytes, listener_nonce: bytes, dialler_nonce: bytes) -> None:
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:  # wrong length, or a low-order point giving an all-zero secret
            raise ProtocolError("bad_handshake", "unusable X25519 key") from None
        self._nonces = listener_nonce + dialler_nonce
        self._link_secret = _hkdf(shared, self._nonces, _LINK_DOMAIN)

    def sealer(self, handle: object | None, from_dialler: bool) -> Sealer:
        cached = self._sealers.get((handle, from_dialler))
        if cached is not None:
            return cached
        if not self._sealing:
            return NULL_SEALER
        if not self._link_secret:
            raise ProtocolError("bad_handshake", "link keys not established")
        direction = b"d" if from_dialler else b"l"
        if handle is None:
            key = _hkdf(self._link_secret, self._nonces, _LINK_DOMAIN + direction)
        else:
            assert isinstance(handle, ScopeKey)
            info = _CLUSTER_DOMAIN + direction + handle.scope.encode()
            key = _hkdf(handle.secret + self._link_secret, self._nonces, info)
        sealer = self._sealers[(handle, from_dialler)] = AeadSealer(key)
        return sealer


class KeyedLinkSecurity(KeyedMembershipSecurity):
    """A node's security from a keyring: its links' and its membership's (`meshkey`);
    `sealing=False` keeps tags and proofs but seals nothing."""

    __slots__ = ("_sealing",)

    def __init__(self, keyring: Keyring, *, sealing: bool = True) -> None:
        super().__init__(keyring)
        self._sealing = sealing

    def datagram_sealer(self, node_id: bytes) -> DatagramSealer:
        sealer = datagram_sealer(self._keyring, node_id, sealing=self._sealing)
        if isinstance(sealer, MeshDatagramSealer):
            self._sealers.append(sealer)  # rekeyed by `replace`
        return sealer

    def holds(self, handle: object) -> bool:
        # A handle names the cluster (or topic name) it seals, not the key's scope: the keys
        # accepted for that name now decide.
        assert isinstance(handle, ScopeKey)
        name = handle.scope
        if name == _TOPIC_DEFAULT:
            name = "*"
        elif name.startswith(_TOPIC_PREFIX):
            name = name.removeprefix(_TOPIC_PREFIX)
        return any(key.key_id == handle.key_id for key in self._keyring.accepted(name))

    def begin(self) -> X25519LinkKeys:
        return X25519LinkKeys(self._sealing)

    def has_key(self, cluster: str) -> bool:
        return self._keyring.primary(cluster) is not None

    def offers(
        self, cluster: str, listener_nonce: bytes, dialler_nonce: bytes
    ) -> list[tuple[bytes, object]]:
        return [
            (offer_tag(key.secret, cluster, listener_nonce, dialler_nonce), _handle(key, cluster))
            for key in self._keyring.accepted(cluster)
        ]

    def match(
        self,
        cluster: str,
        listener_nonce: bytes,
        dialler_nonce: bytes,
        offered: Mapping[bytes, int],
    ) -> tuple[int, object] | None:
        for key in self._keyring.accepted(cluster):  # the primary is listed first
            slot = offered.get(offer_tag(key.secret, cluster, listener_nonce, dialler_nonce))
            if slot is not None:
                return slot, _handle(key, cluster)
        return None

    def topic_offers(
        self, listener_nonce: bytes, dialler_nonce: bytes
    ) -> list[tuple[bytes, object, str]]:
        # One offer per key per scope this node can read topics of: every scope with a key of
        # its own, and "*" (the default key) for all others. (tag, handle, scope) each.
        offers: list[tuple[bytes, object, str]] = []
        for scope in self._keyring.scopes:
            if scope == MESH_SCOPE:
                continue
            name = _TOPIC_DEFAULT if scope == "*" else _TOPIC_PREFIX + scope
            for key in self._keyring.accepted(scope):
                tag = offer_tag(key.secret, name, listener_nonce, dialler_nonce)
                offers.append((tag, _handle(key, name), scope))
        return offers

    def match_topic(
        self,
        scope: str,
        listener_nonce: bytes,
        dialler_nonce: bytes,
        offered: Mapping[bytes, int],
    ) -> tuple[int, object] | None:
        # The key this node publishes `scope` under: its own if it has one, else the default.
        name = _TOPIC_PREFIX + scope if self.owns(scope) else _TOPIC_DEFAULT
        for key in self._keyring.accepted(scope):
            slot = offered.get(offer_tag(key.secret, name, listener_nonce, dialler_nonce))
            if slot is not None:
                return slot, _handle(key, name)
        return None

    def owns(self, scope: str) -> bool:
        return scope != "*" and self._keyring.primary(scope) is not self._keyring.primary("*")


def _handle(key: ScopeKey, cluster: str) -> ScopeKey:
    # The handle names the cluster, not the key's scope: a default '*' key seals cluster X's
    # traffic with X's name in the derivation, so X's and Y's sessions differ.
    return (
        key
        if key.scope == cluster
        else ScopeKey(scope=cluster, secret=key.secret, key_id=key.key_id)
    )
