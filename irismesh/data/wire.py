"""What the holders of a data key say to each other, and the seal that keeps it to them.

Every message travels by publish/subscribe on the key's internal topic, `_data.` + the key
(`DATA_PREFIX`), and is one msgpack array [op, key, ref, to, body], sealed under the key of
the data key's first segment (its scope), as a topic is: the mesh seals the publish under the
`_data` scope's key like any other, and this seal, inside it, keeps the content to the holders
of the data key's own scope key. A holder of only the default key can neither read a scope that
has keys of its own nor write into it: a message that does not open is dropped and counted.

Ops: DELTA (a delta or folded deltas; `ref` non-zero asks for an ACK from each holder),
ACK (`ref` of the write acknowledged, `to` the writer), ASK (a holder wants everyone's state:
they answer STATE with its `ref` and `to`), STATE (a full state, answered or pushed), DIGEST (a
hash of the sender's state: a holder whose own differs pushes its STATE).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from irismesh.errors import ConfigurationError, NoKey, ProtocolError
from irismesh.security.keyring import Keyring, ScopeKey

__all__ = ["DATA_PREFIX", "Op", "Sealer", "WireMessage", "validate_key"]

DATA_PREFIX = "_data."
MAX_KEY = 200  # bytes of UTF-8 in a data key: its topic must fit the topic limit
_NONCE = 12
_SALT = b"irismesh data v1"


class Op:
    DELTA = 0
    ACK = 1
    ASK = 2
    STATE = 3
    DIGEST = 4


@dataclass(frozen=True, slots=True)
class WireMessage:
    op: int
    key: str
    ref: int = 0
    to: bytes = b""
    body: bytes = b""

    def pack(self) -> bytes:
        packed: bytes = msgpack.packb(
            [self.op, self.key, self.ref, self.to, self.body], use_bin_type=True
        )
        return packed

    @classmethod
    def unpack(cls, data: bytes) -> WireMessage:
        try:
            fields: Any = msgpack.unpackb(data, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ProtocolError("bad_data", type(exc).__name__) from None
        if not isinstance(fields, list) or len(fields) != 5:
            raise ProtocolError("bad_data", "message")
        op, key, ref, to, body = fields
        if (
            type(op) is not int
            or not Op.DELTA <= op <= Op.DIGEST
            or type(key) is not str
            or type(ref) is not int
            or type(to) is not bytes
            or type(body) is not bytes
        ):
            raise ProtocolError("bad_data", "message fields")
        return cls(op, key, ref, to, body)


def validate_key(key: object) -> str:
    """A data key: a dot-separated path, as a topic (no wildcards), at most MAX_KEY bytes."""
    from irismesh._core.topics import validate_topic

    if not isinstance(key, str) or len(key.encode()) > MAX_KEY:
        raise ConfigurationError(f"a data key is a topic-like path of at most {MAX_KEY} bytes")
    return validate_topic(key)


class Sealer:
    """Seals and opens data messages under the keys of their data keys' scopes."""

    def __init__(self, keyring: Callable[[], Keyring]) -> None:
        self._keyring = keyring  # the node's, read at each use (it may be reloaded)
        self._aeads: dict[str, AESGCM] = {}  # key id -> its derived AEAD
        self._indexes: dict[str, bytes] = {}  # key id -> its derived index key

    def _aead(self, key: ScopeKey) -> AESGCM:
        aead = self._aeads.get(key.key_id)
        if aead is None:
            derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=b"seal").derive(
                key.secret
            )
            aead = self._aeads[key.key_id] = AESGCM(derived)
        return aead

    def require(self, key: str) -> None:
        """NoKey unless this node holds a key for `key`'s scope."""
        scope = key.partition(".")[0]
        if self._keyring().primary(scope) is None:
            raise NoKey(scope)

    def seal(self, topic: str, data: bytes) -> bytes:
        return self._seal(topic[len(DATA_PREFIX) :], data, topic.encode())

    def seal_at_rest(self, key: str, data: bytes, bound: bytes) -> bytes:
        return self._seal(key, data, bound)

    def _seal(self, key: str, data: bytes, bound: bytes) -> bytes:
        scope = key.partition(".")[0]
        scope_key = self._keyring().primary(scope)
        if scope_key is None:
            raise NoKey(scope)
        kid = scope_key.key_id.encode()
        nonce = os.urandom(_NONCE)
        sealed = self._aead(scope_key).encrypt(nonce, data, bound)
        return bytes([len(kid)]) + kid + nonce + sealed

    def open(self, topic: str, sealed: bytes) -> bytes:
        """The plain message; ProtocolError("unsealed") if no key of the scope opens it."""
        scope = topic[len(DATA_PREFIX) :].partition(".")[0]
        return self._open(self._keyring().accepted(scope), sealed, topic.encode())

    def open_at_rest(self, sealed: bytes, bound: bytes) -> bytes:
        """What `seal_at_rest` sealed, under whichever key of the keyring it names."""
        return self._open(tuple(self._keyring()), sealed, bound)

    def _open(self, keys: tuple[ScopeKey, ...], sealed: bytes, bound: bytes) -> bytes:
        if not sealed:
            raise ProtocolError("unsealed")
        n = sealed[0]
        kid = sealed[1 : 1 + n].decode("ascii", "replace")
        for key in keys:
            if key.key_id == kid:
                rest = sealed[1 + n :]
                try:
                    return self._aead(key).decrypt(rest[:_NONCE], rest[_NONCE:], bound)
                except (InvalidTag, ValueError):
                    break
        raise ProtocolError("unsealed")

    def tag(self, key: str) -> bytes:
        """A keyed hash of `key` under its scope's key: a row's name at rest."""
        scope = key.partition(".")[0]
        scope_key = self._keyring().primary(scope)
        if scope_key is None:
            raise NoKey(scope)
        index = self._indexes.get(scope_key.key_id)
        if index is None:
            index = self._indexes[scope_key.key_id] = HKDF(
                algorithm=hashes.SHA256(), length=32, salt=_SALT, info=b"index"
            ).derive(scope_key.secret)
        return hashlib.blake2b(key.encode(), key=index, digest_size=20).digest()
