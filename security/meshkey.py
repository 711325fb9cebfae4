"""The mesh key: what admits a node to the mesh's membership at all.

Membership (who is alive, suspect, dead or gone, and where each node listens) is shared by the
whole mesh, so it is guarded by one key the whole mesh holds: the keyring's ``@mesh`` key, else
its ``*`` key (`Keyring.mesh_keys`). A keyring with neither joins an *open* mesh, whose key is
public: fine on a trusted machine, and every cluster and topic is still guarded by its own key.

Membership datagrams are sealed with AES-256-GCM under a key of their sender's own:
HMAC-SHA256(mesh secret, domain | sender id). Node ids are random per process start, so each
sender's counter (the nonce) never repeats under one key; a receiver derives the sender's key
from the id in the header, which the seal then authenticates, so no one without the mesh key
can read a datagram, forge one, or speak for a node id. During a rotation two mesh keys are
valid: datagrams are sealed under the primary and opened under either.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from irismesh._core.gossip import DatagramSealer, NullDatagramSealer
from irismesh.errors import ProtocolError
from irismesh.security.keyring import Keyring

_GOSSIP_DOMAIN = b"irismesh/v1/gossip\x00"
OPEN_MESH_SECRET = hashlib.sha256(b"irismesh/v1/open-mesh").digest()
_NONCE = struct.Struct("!4xQ")
_CACHE = 4096  # senders whose keys are kept derived


def mesh_secrets(keyring: Keyring) -> tuple[bytes, ...]:
    """The mesh secrets of a keyring, primary first; the open mesh's without a mesh key."""
    return tuple(key.secret for key in keyring.mesh_keys()) or (OPEN_MESH_SECRET,)


def is_open_mesh(keyring: Keyring) -> bool:
    return not keyring.mesh_keys()


def _sender_key(secret: bytes, sender: bytes) -> AESGCM:
    return AESGCM(hmac.new(secret, _GOSSIP_DOMAIN + sender, hashlib.sha256).digest())


class MeshDatagramSealer:
    """Seals this node's membership datagrams, opens its peers'."""

    __slots__ = ("_cache", "_encrypt", "_secrets")

    overhead = 16

    def __init__(self, secrets: Sequence[bytes], node_id: bytes) -> None:
        if not secrets:
            raise ValueError("a mesh sealer needs at least one secret")
        self._secrets = tuple(secrets)
        self._encrypt = _sender_key(self._secrets[0], node_id).encrypt
        self._cache: dict[tuple[int, bytes], AESGCM] = {}

    def seal(self, header: bytes, counter: int, body: bytes) -> bytes:
        return self._encrypt(_NONCE.pack(counter), body, header)

    def open(self, sender: bytes, header: bytes, counter: int, sealed: bytes) -> bytes:
        nonce = _NONCE.pack(counter)
        cache = self._cache
        for index, secret in enumerate(self._secrets):
            aead = cache.get((index, sender))
            known = aead is not None
            if aead is None:
                aead = _sender_key(secret, sender)
            try:
                body = aead.decrypt(nonce, sealed, header)
            except InvalidTag:
                continue
            if not known:  # only an authentic sender earns a place in the cache
                if len(cache) >= _CACHE:
                    del cache[next(iter(cache))]
                cache[(index, sender)] = aead
            return body
        raise ProtocolError("bad_seal")


def datagram_sealer(keyring: Keyring, node_id: bytes, *, sealing: bool = True) -> DatagramSealer:
    """The sealer a node uses for membership; `sealing=False` (benchmarks only) seals nothing."""
    if not sealing:
        return NullDatagramSealer()
    return MeshDatagramSealer(mesh_secrets(keyring), node_id)
