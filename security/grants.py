"""Grants and revocations: an authority's signed statements of what a node may do.

Theory of operation
-------------------
An *authority* is an Ed25519 key pair kept by whoever runs the mesh (``mesh authority new``).
It signs *grants*: a grant names one node's public key (`Identity.public`) and its rights
(`irismesh._core.rights.Rights`: clusters to serve and call, topic patterns to publish and
subscribe under with deny lists, the memory, a gateway's exports and imports), with the time
it was issued and the time it expires. Nodes trust the authorities their keyring names
(``@authority`` lines) and require grants of each other when the keyring says so
(``@require-grants``); see `irismesh.security.keyring`.

A node presents its grant in its handshake, inside the transcript its identity signs; the peer
verifies it once (`NodeGrants.admit`): the signature of a trusted authority, the key it names
being the very key that proved the peer's identity, the issue and expiry times, and no
revocation of the key since the grant was issued. What it allows is then decided when a route
or subscription forms, never per message.

A *revocation* names a node's public key and a time: every grant of that key issued before
the time stops working, as NATS revokes user keys. It is signed by an authority and spread
through membership gossip; the memory keeps it for nodes that start later.

Token format (version 1)
------------------------
Both tokens are bytes: a 2-byte magic, a version byte, the authority's 32-byte public key, its
64-byte Ed25519 signature, and a msgpack body. The signature covers a domain string, the magic,
the version, the authority key and the body, so a token cannot be read as the other kind or
under another authority::

    grant       = b"IG" | 0x01 | authority (32) | signature (64) | body
    revocation  = b"IR" | 0x01 | authority (32) | signature (64) | body
    signature   = Ed25519(authority, b"irismesh grant v1\\0" or b"irismesh revocation v1\\0"
                                      | magic | version | authority | body)

A grant's body is a msgpack map with these keys only (an unknown key refuses the token: a
right a verifier cannot read must not be skipped)::

    "node"  bytes (32)     the node's Ed25519 public key
    "iat"   int            issued at, seconds since the epoch
    "exp"   int            expires at, seconds since the epoch (> iat)
    "serve", "call"        [str]  cluster names, or "*" for every cluster
    "pub", "pub!"          [str]  topic patterns allowed, and denied, to publish
    "sub", "sub!"          [str]  topic patterns allowed, and denied, to subscribe
    "mem"   bool           may hold the mesh's memory
    "gwx", "gwi"           [str]  what a gateway may export and import (clusters, patterns)

A revocation's body is a msgpack array ``[node public key (32), before (int seconds)]``. A
token is at most `MAX_TOKEN` bytes (1 KiB: a grant names a few dozen clusters and patterns).
A grant travels in files as text::

    # irismesh grant v1
    <base64 of the token>

and `mesh grant` prints the base64 token alone. An authority key file is like an identity
file under the header ``# irismesh authority v1`` (private to its owner, mode 0600).
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from irismesh._core.rights import NO_RIGHTS, UNCHECKED, UNGRANTED, PeerGrant, Rights
from irismesh._core.topics import validate_pattern
from irismesh.errors import ConfigurationError, ProtocolError
from irismesh.security.identity import verify
from irismesh.security.keyring import _read_private, _write_private

__all__ = [
    "MAX_TOKEN",
    "Authority",
    "Grant",
    "GrantFile",
    "NodeGrants",
    "Revocation",
    "parse_duration",
]

# A handshake's fields and a membership notice carry at most 1 KiB of bytes each.
MAX_TOKEN = 1024
_VERSION = 1
_GRANT_MAGIC = b"IG"
_REVOCATION_MAGIC = b"IR"
_GRANT_DOMAIN = b"irismesh grant v1\x00"
_REVOCATION_DOMAIN = b"irismesh revocation v1\x00"
_PREFIX = 3 + 32 + 64
_GRANT_HEADER = "# irismesh grant v1"
_AUTHORITY_HEADER = "# irismesh authority v1"
_MAX_NAMES = 256  # names or patterns in one list of a grant
_MAX_NAME = 256
_LISTS = {
    "serve": "serve",
    "call": "call",
    "pub": "publish",
    "pub!": "publish_deny",
    "sub": "subscribe",
    "sub!": "subscribe_deny",
    "gwx": "gateway_export",
    "gwi": "gateway_import",
}
_PATTERN_LISTS = frozenset(("pub", "pub!", "sub", "sub!"))
_TIME_LIMIT = 1 << 40  # seconds since the epoch: far enough, and fits every packer
_SKEW = 60  # seconds a grant may seem issued in the future (clocks differ)
_MAX_VERDICTS = 4096  # peers' tokens whose verdict is remembered


class GrantError(ConfigurationError):
    """A token or grant file that cannot be used (bad format, signature, or names)."""


# --------------------------------------------------------------------------------------------
# Tokens


def _signed(domain: bytes, magic: bytes, authority: bytes, body: bytes) -> bytes:
    return domain + magic + bytes((_VERSION,)) + authority + body


def _split(token: bytes, magic: bytes) -> tuple[bytes, bytes, bytes]:
    """(authority, signature, body) of a token of kind `magic`; GrantError if malformed."""
    if type(token) is not bytes or not _PREFIX < len(token) <= MAX_TOKEN:
        raise GrantError(f"a token is {_PREFIX + 1} to {MAX_TOKEN} bytes")
    if token[:2] != magic:
        raise GrantError("not a grant" if magic == _GRANT_MAGIC else "not a revocation")
    if token[2] != _VERSION:
        raise GrantError(f"token version {token[2]} is not understood (this node reads 1)")
    return token[3:35], token[35:99], token[99:]


def _names(key: str, value: object) -> tuple[str, ...]:
    if type(value) is not list or len(value) > _MAX_NAMES:
        raise GrantError(f"grant field {key!r}: a list of at most {_MAX_NAMES} names")
    names: list[str] = []
    for name in value:
        if type(name) is not str or not 0 < len(name) <= _MAX_NAME:
            raise GrantError(f"grant field {key!r}: names are 1-{_MAX_NAME} characters")
        if key in _PATTERN_LISTS:
            try:
                validate_pattern(name)
            except ConfigurationError as exc:
                raise GrantError(f"grant field {key!r}: {exc}") from None
        names.append(name)
    return tuple(names)


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """One grant: the node's public key, its rights, when issued and until when (seconds
    since the epoch), and the authority that signed it; `token` is its wire form."""

    node: bytes
    rights: Rights
    issued: int
    expires: int
    authority: bytes
    token: bytes = field(repr=False)

    @classmethod
    def decode(cls, token: bytes) -> Grant:
        """Parse a grant token and check its signature; GrantError otherwise. Whether its
        authority is trusted, and whether it holds now, is `NodeGrants`' to say."""
        authority, signature, body = _split(token, _GRANT_MAGIC)
        if not verify(authority, _signed(_GRANT_DOMAIN, _GRANT_MAGIC, authority, body), signature):
            raise GrantError("the grant's signature does not hold")
        try:
            fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception:  # msgpack raises several types for bad bytes
            raise GrantError("the grant's body is not msgpack") from None
        if type(fields) is not dict:
            raise GrantError("the grant's body is not a map")
        unknown = set(fields) - {"node", "iat", "exp", "mem", *_LISTS}
        if unknown:
            raise GrantError(f"the grant has fields this node cannot read: {sorted(unknown)}")
        node, issued, expires = fields.get("node"), fields.get("iat"), fields.get("exp")
        if type(node) is not bytes or len(node) != 32:
            raise GrantError("the grant names no 32-byte node key")
        if type(issued) is not int or type(expires) is not int:
            raise GrantError("the grant's times are not integers")
        if not 0 <= issued < expires < _TIME_LIMIT:
            raise GrantError("the grant expires before it is issued")
        memory = fields.get("mem", False)
        if type(memory) is not bool:
            raise GrantError("grant field 'mem' is not a boolean")
        lists = {attr: _names(key, fields.get(key, [])) for key, attr in _LISTS.items()}
        rights = Rights(memory=memory, **lists)
        return cls(
            node=node,
            rights=rights,
            issued=issued,
            expires=expires,
            authority=authority,
            token=token,
        )

    def to_text(self) -> str:
        return f"{_GRANT_HEADER}\n{base64.b64encode(self.token).decode()}\n"

    @classmethod
    def from_text(cls, text: str, *, source: str = "<text>") -> Grant:
        """A grant file's text, or a bare base64 token (what `mesh grant` prints)."""
        lines = [line.strip() for line in text.splitlines()]
        lines = [line for line in lines if line and not line.startswith("#")]
        if len(lines) != 1:
            raise GrantError(f"{source}: expected one line holding a base64 grant")
        try:
            token = base64.b64decode(lines[0], validate=True)
        except ValueError:
            raise GrantError(f"{source}: the grant is not valid base64") from None
        try:
            return cls.decode(token)
        except GrantError as exc:
            raise GrantError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Grant:
        name = os.fspath(path)
        try:
            with open(name, "rb") as file:
                data = file.read(4 * MAX_TOKEN)
        except FileNotFoundError:
            raise ConfigurationError(f"grant {name} not found: `mesh grant` makes one") from None
        except OSError as exc:
            raise ConfigurationError(f"cannot read grant {name}: {exc.strerror or exc}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise GrantError(f"grant {name} is not UTF-8 text") from None
        return cls.from_text(text, source=name)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the grant file atomically (a grant is no secret: mode 0644)."""
        data = self.to_text().encode()
        _write_private(os.fspath(path), data, what="grant", overwrite=True, mode=0o644)


@dataclass(frozen=True, slots=True, kw_only=True)
class Revocation:
    """Every grant of `node` issued before `before` (seconds since the epoch) is void."""

    node: bytes
    before: int
    authority: bytes
    token: bytes = field(repr=False)

    @classmethod
    def decode(cls, token: bytes) -> Revocation:
        authority, signature, body = _split(token, _REVOCATION_MAGIC)
        signed = _signed(_REVOCATION_DOMAIN, _REVOCATION_MAGIC, authority, body)
        if not verify(authority, signed, signature):
            raise GrantError("the revocation's signature does not hold")
        try:
            fields = msgpack.unpackb(body, raw=False)
        except Exception:  # msgpack raises several types for bad bytes
            raise GrantError("the revocation's body is not msgpack") from None
        if (
            type(fields) is not list
            or len(fields) != 2
            or type(fields[0]) is not bytes
            or len(fields[0]) != 32
            or type(fields[1]) is not int
            or not 0 <= fields[1] < _TIME_LIMIT
        ):
            raise GrantError("the revocation is not [node key, time]")
        return cls(node=fields[0], before=fields[1], authority=authority, token=token)


# --------------------------------------------------------------------------------------------
# The authority


def parse_duration(text: str) -> int:
    """Seconds in '90s', '30m', '12h', '30d', '2w' (or a bare number of seconds)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip()
    scale = units.get(text[-1:], 0)
    number = text[:-1] if scale else text
    if not scale:
        scale = 1
    try:
        value = float(number)
    except ValueError:
        raise ConfigurationError(f"bad duration {text!r}: use 90s, 30m, 12h, 30d or 2w") from None
    seconds = int(value * scale)
    if not 0 < seconds < _TIME_LIMIT // 2:
        raise ConfigurationError(f"bad duration {text!r}: it must be positive")
    return seconds


class Authority:
    """An authority's Ed25519 key pair: it signs grants and revocations."""

    __slots__ = ("_key", "path", "public")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public: bytes = key.public_key().public_bytes_raw()
        self.path: str | None = None

    @classmethod
    def generate(cls) -> Authority:
        return cls(Ed25519PrivateKey.generate())

    def _sign(self, domain: bytes, magic: bytes, body: bytes) -> bytes:
        prefix = magic + bytes((_VERSION,)) + self.public
        return prefix + self._key.sign(_signed(domain, magic, self.public, body)) + body

    def grant(
        self,
        node: bytes,
        rights: Rights = NO_RIGHTS,
        *,
        expires_in: float = 30 * 86400,
        issued: float | None = None,
    ) -> Grant:
        """A grant of `rights` to the node whose public key is `node`, valid `expires_in`
        seconds from `issued` (now by default)."""
        if type(node) is not bytes or len(node) != 32:
            raise ConfigurationError("a grant names a node's 32-byte public key")
        start = int(time.time() if issued is None else issued)
        fields: dict[str, object] = {"node": node, "iat": start, "exp": start + int(expires_in)}
        for key, attr in _LISTS.items():
            names = list(getattr(rights, attr))
            if names:
                _names(key, names)
                fields[key] = names
        if rights.memory:
            fields["mem"] = True
        token = self._sign(_GRANT_DOMAIN, _GRANT_MAGIC, msgpack.packb(fields))
        if len(token) > MAX_TOKEN:
            raise ConfigurationError(f"the grant would be {len(token)} bytes, over {MAX_TOKEN}")
        return Grant.decode(token)

    def revoke(self, node: bytes, *, before: float | None = None) -> Revocation:
        """Void every grant of `node` issued before `before` (now by default)."""
        if type(node) is not bytes or len(node) != 32:
            raise ConfigurationError("a revocation names a node's 32-byte public key")
        when = int(time.time() if before is None else before) + 1  # grants of this second too
        token = self._sign(_REVOCATION_DOMAIN, _REVOCATION_MAGIC, msgpack.packb([node, when]))
        return Revocation.decode(token)

    def to_text(self) -> str:
        raw = self._key.private_bytes_raw()
        public = base64.b64encode(self.public).decode()
        hint = f"# public key {public} (trust it with '@authority {public}' in a keyring)"
        return f"{_AUTHORITY_HEADER}\n{hint}\ned25519 {base64.b64encode(raw).decode()}\n"

    @classmethod
    def from_text(cls, text: str, *, source: str = "<text>") -> Authority:
        lines = [line.strip() for line in text.splitlines()]
        lines = [line for line in lines if line]
        if not lines or lines[0] != _AUTHORITY_HEADER:
            raise ConfigurationError(f"{source} is not an authority file: no header line")
        keys = [line.split() for line in lines[1:] if not line.startswith("#")]
        if len(keys) != 1 or len(keys[0]) != 2 or keys[0][0] != "ed25519":
            raise ConfigurationError(f"{source}: expected one line 'ed25519 <base64 key>'")
        try:
            secret = base64.b64decode(keys[0][1], validate=True)
        except ValueError:
            raise ConfigurationError(f"{source}: the key is not valid base64") from None
        if len(secret) != 32:
            raise ConfigurationError(f"{source}: an Ed25519 private key is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(secret))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Authority:
        """Read an authority file, refusing one that group or others may access."""
        name = os.fspath(path)
        text = _read_private(name, what="authority", maker="`mesh authority new`")
        authority = cls.from_text(text, source=name)
        authority.path = name
        return authority

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the key as a new 0600 file, atomically; replace one only if asked."""
        data = self.to_text().encode()
        _write_private(os.fspath(path), data, what="authority", overwrite=overwrite)

    def __repr__(self) -> str:
        return f"Authority(public={base64.b64encode(self.public).decode()})"


# --------------------------------------------------------------------------------------------
# A node's verdicts


class NodeGrants:
    """One node's grant policy (the core's `GrantPolicy`): its trusted authorities, whether
    it requires grants, its own grant, and the revocations it knows.

    `clock` is wall-clock seconds since the epoch (grants are stamped so); tests pass their
    own. Verdicts on peers' tokens are remembered by token (bounded), so a peer that links
    again costs no second signature check.
    """

    def __init__(
        self,
        *,
        public: bytes,
        authorities: Iterable[bytes] = (),
        required: bool = False,
        grant: Grant | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._public = public
        self.authorities = frozenset(authorities)
        self._required = required
        self.clock = clock
        self.grant = grant
        self.revocations: dict[bytes, Revocation] = {}  # node key -> the latest revocation
        self._verdicts: dict[bytes, Grant | None] = {}
        self.stats: dict[str, int] = {}

    @property
    def required(self) -> bool:
        return self._required

    def configure(self, authorities: Iterable[bytes], required: bool) -> None:
        """The keyring changed: trust these authorities from now on."""
        self.authorities = frozenset(authorities)
        self._required = required
        self._verdicts.clear()

    def token(self) -> bytes:
        return b"" if self.grant is None else self.grant.token

    def own(self) -> PeerGrant:
        if not self._required:
            return UNCHECKED
        grant = self.grant
        if grant is None or grant.node != self._public:
            return UNGRANTED
        return self._held(grant) or UNGRANTED

    def admit(self, public: bytes, token: bytes) -> PeerGrant:
        if not self._required:
            return UNCHECKED
        revocation = self.revocations.get(public)
        grant: Grant | None = None
        if token:
            if token in self._verdicts:
                grant = self._verdicts[token]
            else:
                try:
                    grant = Grant.decode(token)
                except GrantError:
                    grant = None
                if len(self._verdicts) >= _MAX_VERDICTS:
                    self._verdicts.clear()
                self._verdicts[token] = grant
            if grant is not None and grant.node != public:
                grant = None
        if revocation is not None and (grant is None or grant.issued < revocation.before):
            # A revoked key links again only with a grant issued after its revocation.
            raise ProtocolError("revoked", "the peer's key is revoked")
        if grant is None:
            if token:
                self._count("grants_refused")
            return UNGRANTED
        held = self._held(grant)
        if held is None:
            self._count("grants_refused")
            return UNGRANTED
        return held

    def _held(self, grant: Grant) -> PeerGrant | None:
        """The grant as a link holds it, if it holds now."""
        if grant.authority not in self.authorities:
            return None
        now = self.clock()
        # Not yet valid (a minute of clock skew allowed), or expired.
        if not grant.issued - _SKEW <= now < grant.expires:
            return None
        if self.revoked(grant.node, grant.issued):
            return None
        return PeerGrant(
            rights=grant.rights,
            expires=float(grant.expires),
            issued=float(grant.issued),
            authority=grant.authority,
        )

    def holds(self, public: bytes, grant: PeerGrant) -> bool:
        if not self._required:
            return True
        if grant is UNGRANTED:  # no rights to lose; but a revoked key loses its links
            return public not in self.revocations
        if self.clock() >= grant.expires:
            return False
        return not self.revoked(public, grant.issued)

    def revoked(self, public: bytes, issued: float) -> bool:
        """Whether `public`'s grant issued at `issued` is revoked."""
        revocation = self.revocations.get(public)
        return revocation is not None and issued < revocation.before

    def learn(self, notice: bytes) -> bool:
        return self.learn_revocation(notice) is not None

    def learn_key(self, notice: bytes) -> bytes | None:
        revocation = self.learn_revocation(notice)
        return None if revocation is None else revocation.node

    def revoked_keys(self) -> Collection[bytes]:
        return self.revocations.keys()

    def learn_revocation(self, token: bytes) -> Revocation | None:
        """A revocation heard: the revocation if it is new and signed by a trusted authority
        (then it applies from now on), else None (counted)."""
        try:
            revocation = Revocation.decode(token)
        except GrantError:
            self._count("revocations_refused")
            return None
        if revocation.authority not in self.authorities:
            self._count("revocations_untrusted")
            return None
        known = self.revocations.get(revocation.node)
        if known is not None and known.before >= revocation.before:
            return None
        self.revocations[revocation.node] = revocation
        self._count("revocations_applied")
        return revocation

    def _count(self, name: str) -> None:
        self.stats[name] = self.stats.get(name, 0) + 1


# --------------------------------------------------------------------------------------------
# Rereading a grant file


class GrantFile:
    """The grant file behind a node's grant: a new grant once the file changes (one stat per
    poll; read once the same new signature is seen at two polls in a row, as `KeyringFile`)."""

    def __init__(self, path: str, grant: Grant | None) -> None:
        self.path = path
        self.grant = grant
        self._read = self._seen = self._signature()
        self.refused = 0

    def _signature(self) -> tuple[int, int, int, int] | None:
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def poll(self) -> Grant | None:
        now = self._signature()
        seen, self._seen = self._seen, now
        if now == self._read or now != seen:
            return None
        self._read = now
        try:
            grant = Grant.load(self.path)
        except ConfigurationError:
            self.refused += 1
            return None
        if self.grant is not None and grant.token == self.grant.token:
            return None
        self.grant = grant
        return grant
