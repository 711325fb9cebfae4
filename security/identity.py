"""A node's identity: an Ed25519 key pair, and the node id derived from its public key.

A node's id is the first 16 bytes of SHA-256 over a domain string and its public key
(`irismesh._core.records.node_id_of`), so an id cannot be claimed without the private key: the
link handshake signs its transcript with it and every membership record is signed by its node
(the core checks both through `NodeIdentity`). A node given no identity makes a fresh one in
memory, so it has a new id each time it starts, as before identities; a node given a file keeps
its id across restarts.

File format (UTF-8 text, written by ``mesh identity new`` or :meth:`Identity.save`)::

    # irismesh identity v1
    ed25519 <base64 of the 32-byte private key>

The first non-empty line is exactly the header; other ``#`` lines and blank lines are
comments. The file is private to its owner (``chmod 600``): :meth:`Identity.load` refuses it
otherwise. The private key never appears in a repr or an error message.
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from irismesh._core.gossip import PUBLIC_KEY_SIZE, SIGNATURE_SIZE
from irismesh._core.records import node_id_of
from irismesh.errors import ConfigurationError
from irismesh.security.keyring import _read_private, _write_private

__all__ = ["Identity", "verify"]

_HEADER = "# irismesh identity v1"
_FORMAT_HINT = "# ed25519 <base64 of the 32-byte private key>; the node id derives from it"


def verify(public: bytes, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is `public`'s Ed25519 signature of `message`."""
    if len(public) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """One node's Ed25519 key pair (the core's `NodeIdentity`)."""

    __slots__ = ("_key", "_path", "node_id", "public")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public: bytes = key.public_key().public_bytes_raw()
        self.node_id: bytes = node_id_of(self.public)
        self._path: str | None = None

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, secret: bytes) -> Identity:
        if len(secret) != 32:
            raise ConfigurationError("an Ed25519 private key is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(secret))

    @classmethod
    def of(cls, value: Identity | Ed25519PrivateKey | str | os.PathLike[str] | None) -> Identity:
        """What `Node(identity=...)` takes: an Identity, a private key, a file, or None (a
        fresh identity)."""
        if value is None:
            return cls.generate()
        if isinstance(value, Identity):
            return value
        if isinstance(value, Ed25519PrivateKey):
            return cls(value)
        return cls.load(value)

    @property
    def path(self) -> str | None:
        """The file this identity was loaded from, if any."""
        return self._path

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def verify(self, public: bytes, message: bytes, signature: bytes) -> bool:
        return verify(public, message, signature)

    # ----------------------------------------------------------------- files

    def to_text(self) -> str:
        raw = self._key.private_bytes_raw()
        return f"{_HEADER}\n{_FORMAT_HINT}\ned25519 {base64.b64encode(raw).decode()}\n"

    @classmethod
    def from_text(cls, text: str, *, source: str = "<text>") -> Identity:
        lines = [line.strip() for line in text.splitlines()]
        lines = [line for line in lines if line]
        if not lines or lines[0] != _HEADER:
            raise ConfigurationError(f"{source} is not an identity file: no '{_HEADER}' line")
        keys = [line for line in lines[1:] if not line.startswith("#")]
        if len(keys) != 1 or len(keys[0].split()) != 2 or keys[0].split()[0] != "ed25519":
            raise ConfigurationError(f"{source}: expected one line 'ed25519 <base64 key>'")
        try:
            secret = base64.b64decode(keys[0].split()[1], validate=True)
        except ValueError:
            raise ConfigurationError(f"{source}: the key is not valid base64") from None
        return cls.from_private_bytes(secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read an identity file, refusing one that group or others may access."""
        name = os.fspath(path)
        text = _read_private(name, what="identity", maker="`mesh identity new`")
        identity = cls.from_text(text, source=name)
        identity._path = name
        return identity

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the identity as a new 0600 file, atomically; replace one only if asked."""
        name = os.fspath(path)
        _write_private(name, self.to_text().encode(), what="identity", overwrite=overwrite)

    def __repr__(self) -> str:
        return f"Identity(node_id={self.node_id.hex()})"
