"""What crosses an inter-mesh link: frames, the handshake's messages and keys, items.

`linkproto` tells the whole protocol and keeps a link's state (`LinkEnd`); this module holds
its parts without state: the frame header; what each end says of itself in its handshake
(`Exports` among it) and the MAC over it under a link key, the check of a HELLO
(`open_hello`), the identity a gateway may show in it (`Shown`: its public key, grant and
signature over the transcript), and the X25519 agreement and HKDF that give a session its two
AES-256-GCM sealers (`Session`); and the items sealed frames carry, tunnel items among them.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from irismesh.errors import ConfigurationError, ProtocolError
from irismesh.security.identity import verify
from irismesh.security.keyring import Keyring
from irismesh.security.linksecurity import AeadSealer

Item = list[Any]  # what a sealed frame carries: [kind, ...fields]

LINK_SCOPE = "federation"  # the link key's scope in its keyring (else the default key)
VERSION = 1
MAGIC = b"IMF"
HEADER = struct.Struct("!3sBBQ")  # magic, version, kind, session counter: 13 bytes
HELLO, WELCOME, SEALED = 1, 2, 3
MAX_FRAME = 16 * 1024 * 1024
HELLO_DOMAIN = b"irismesh/v1/federation-hello\x00"
WELCOME_DOMAIN = b"irismesh/v1/federation-welcome\x00"
SESSION_DOMAIN = b"irismesh/v1/federation-session\x00"
# What a gateway's identity signs when it shows itself (`Shown`): the HELLO's fields, or the
# HELLO's and then the WELCOME's (the whole transcript, the ephemeral keys among it).
HELLO_SIGN_DOMAIN = b"irismesh/v1/federation-hello-signed\x00"
WELCOME_SIGN_DOMAIN = b"irismesh/v1/federation-welcome-signed\x00"
_PUBLIC_SIZE = 32  # an Ed25519 public key
_SIGNATURE_SIZE = 64
MAX_GRANT = 1024  # a grant token's bound (`irismesh.security.grants.MAX_TOKEN`)


@dataclass(frozen=True, slots=True, kw_only=True)
class Exports:
    """What one gateway lets through from its mesh: cluster names and topic patterns."""

    clusters: tuple[str, ...] = ()
    topics: tuple[str, ...] = ()

    def wire(self) -> list[list[str]]:
        return [list(self.clusters), list(self.topics)]

    @classmethod
    def from_wire(cls, value: object) -> Exports:
        if not (isinstance(value, list) and len(value) == 2):
            raise ProtocolError("bad_handshake", "exports")
        clusters, topics = value
        if not all(isinstance(v, list) and all(type(s) is str for s in v) for v in value):
            raise ProtocolError("bad_handshake", "exports")
        return cls(clusters=tuple(clusters), topics=tuple(topics))


@dataclass(frozen=True, slots=True)
class Shown:
    """A gateway's identity as its HELLO or WELCOME showed it: its Ed25519 public key and the
    grant it presented (b"": none). The signature over the transcript was checked."""

    public: bytes
    grant: bytes


def link_secrets(keyring: Keyring) -> tuple[bytes, ...]:
    """The link keys a keyring holds, primary first (scope `federation`, else `*`)."""
    keys = tuple(k.secret for k in keyring.accepted(LINK_SCOPE))
    if not keys:
        raise ConfigurationError(
            f"the link keyring has no key for {LINK_SCOPE!r} and no default key: "
            "make one with `mesh keygen link.keys`"
        )
    return keys


def mac(secret: bytes, domain: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, domain + b"".join(parts), hashlib.sha256).digest()


def hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


def pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise ProtocolError("malformed") from None


@dataclass(frozen=True, slots=True)
class Hello:
    """A HELLO whose MAC held under `secret` (one of the listener's link keys)."""

    said: list[Any]
    raw_said: bytes
    secret: bytes
    gateway_id: bytes
    mesh: str
    nonce: bytes
    public: bytes
    stream: bytes
    acked: tuple[bytes, int]  # (the listener's stream it read, up to which seq)
    exports: Exports
    shown: Shown | None = None  # the dialler's identity and grant, if it showed them


def said_fields(
    said: object,
) -> tuple[bytes, str, bytes, bytes, bytes, tuple[bytes, int], Exports]:
    """The eight fields every HELLO and WELCOME carries (the two optional trailing ones, a
    gateway's identity and grant, are `shown_fields`')."""
    if not (isinstance(said, list) and len(said) in (8, 10) and said[0] == VERSION):
        raise ProtocolError("bad_handshake", "version or shape")
    _, gid, mesh, nonce, public, stream, acked, exports = said[:8]
    ok = (
        type(gid) is bytes
        and len(gid) == 16
        and type(mesh) is str
        and 0 < len(mesh) <= 200
        and type(nonce) is bytes
        and len(nonce) == 16
        and type(public) is bytes
        and len(public) == 32
        and type(stream) is bytes
        and len(stream) == 8
        and isinstance(acked, list)
        and len(acked) == 2
        and type(acked[0]) is bytes
        and type(acked[1]) is int
        and acked[1] >= 0
    )
    if not ok:
        raise ProtocolError("bad_handshake", "fields")
    return gid, mesh, nonce, public, stream, (acked[0], acked[1]), Exports.from_wire(exports)


def shown_fields(said: list[Any], body: list[Any], signed: bytes) -> Shown | None:
    """The identity a HELLO or WELCOME shows, its signature over `signed` checked: None if it
    shows none (eight fields, no signature); ProtocolError (`bad_handshake`, `bad_signature`)
    if what it shows is malformed or not signed by the key it names."""
    if len(said) == 8 and len(body) == 2:
        return None
    if not (len(said) == 10 and len(body) == 3):
        raise ProtocolError("bad_handshake", "identity fields")
    public, grant = said[8], said[9]
    signature = body[2]
    if not (
        type(public) is bytes
        and len(public) == _PUBLIC_SIZE
        and type(grant) is bytes
        and len(grant) <= MAX_GRANT
        and type(signature) is bytes
        and len(signature) == _SIGNATURE_SIZE
    ):
        raise ProtocolError("bad_handshake", "identity fields")
    if not verify(public, signed, signature):
        raise ProtocolError("bad_signature")
    return Shown(public, grant)


def handshake_body(frame: bytes) -> list[Any]:
    """The [fields said, MAC, (signature)] of a HELLO or WELCOME; ProtocolError if not."""
    body = unpack(frame[HEADER.size :])
    if not (
        isinstance(body, list)
        and len(body) in (2, 3)
        and type(body[0]) is bytes
        and type(body[1]) is bytes
    ):
        raise ProtocolError("malformed")
    return body


def open_hello(frame: bytes, secrets: Sequence[bytes]) -> Hello:
    """Check a HELLO frame; ProtocolError (`malformed`, `bad_handshake`, `bad_proof`,
    `bad_signature`) if not."""
    if len(frame) < HEADER.size or len(frame) > MAX_FRAME:
        raise ProtocolError("malformed")
    magic, version, kind, _ = HEADER.unpack_from(frame)
    if magic != MAGIC or version != VERSION or kind != HELLO:
        raise ProtocolError("malformed")
    body = handshake_body(frame)
    raw_said, proof = body[0], body[1]
    secret = next(
        (s for s in secrets if hmac.compare_digest(mac(s, HELLO_DOMAIN, raw_said), proof)), None
    )
    if secret is None:
        raise ProtocolError("bad_proof")
    said = unpack(raw_said)
    gid, mesh, nonce, public, stream, acked, exports = said_fields(said)
    shown = shown_fields(said, body, HELLO_SIGN_DOMAIN + raw_said)
    return Hello(said, raw_said, secret, gid, mesh, nonce, public, stream, acked, exports, shown)


class Session:
    """One handshake's keys: a sealer per direction and the counters that make nonces."""

    __slots__ = ("in_counter", "inbound", "out_counter", "outbound")

    def __init__(self, key: bytes, nonces: bytes, *, dialler: bool) -> None:
        out_dir, in_dir = (b"d", b"l") if dialler else (b"l", b"d")
        self.outbound = AeadSealer(hkdf(key, nonces, SESSION_DOMAIN + out_dir))
        self.inbound = AeadSealer(hkdf(key, nonces, SESSION_DOMAIN + in_dir))
        self.out_counter = 0
        self.in_counter = 0


def agree(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:
        raise ProtocolError("bad_handshake", "unusable X25519 key") from None


# A plain item [REHELLO]: the listener's grant changed, and the dialler (which showed its own
# identity, so it checks far grants) is asked to handshake again to see it. A gateway of an
# earlier release never gets one (it shows no identity).
REHELLO = "rehello"


# ----------------------------------------------------------------- tunnel items

# Tunnels crossing gateways (`irismesh.federation.tunnels`) ride plain items of their own kind:
# [TUNNEL, TUNNEL_VERSION, tunnel id, from opener (bool), sequence, op, arg, data].
# The tunnel id is the opening gateway's; `from opener` says which end sent the item, so
# tunnels opened from either side of a link never share an id. `sequence` counts a
# direction's items from 1: a gap means items were lost and the tunnel cannot go on.
TUNNEL = "tun"
TUNNEL_VERSION = 1
T_OPEN, T_ACCEPT, T_DATA, T_CREDIT, T_FIN, T_RESET = 1, 2, 3, 4, 5, 6
T_MAX_CHUNK = 64 << 10  # data in one item
T_MAX_WINDOW = 1 << 30
_T_MAX_ID = (1 << 63) - 1
_T_MAX_TEXT = 1000  # a reset's reason, an OPEN's cluster name
T_MAX_OPEN = _T_MAX_TEXT  # an OPEN's data: the cluster's name (then NUL, a trace context)


@dataclass(frozen=True, slots=True)
class TunnelItem:
    """One checked tunnel item (see `parse_tunnel_item`)."""

    tunnel_id: int
    from_opener: bool
    seq: int
    op: int
    arg: int
    data: bytes

    def wire(self) -> Item:
        return [
            TUNNEL,
            TUNNEL_VERSION,
            self.tunnel_id,
            self.from_opener,
            self.seq,
            self.op,
            self.arg,
            self.data,
        ]


def parse_tunnel_item(item: Item) -> TunnelItem:
    """Check a tunnel item's version, shape and bounds; ProtocolError (its reason a counter
    name: `tunnel_version`, `tunnel_malformed`) if it is not one this gateway can use.

    OPEN: arg the window granted (bytes), data the cluster's name (then a NUL and the
    caller's trace context, when it has one and there is room); ACCEPT and CREDIT: arg a
    grant in bytes; DATA: arg 1 if more of the message follows, data at most T_MAX_CHUNK
    bytes; FIN: nothing; RESET: data the reason."""
    if len(item) < 2 or item[0] != TUNNEL:
        raise ProtocolError("tunnel_malformed", "kind")
    if type(item[1]) is not int or item[1] != TUNNEL_VERSION:
        raise ProtocolError("tunnel_version", repr(item[1])[:20])
    if len(item) != 8:
        raise ProtocolError("tunnel_malformed", "length")
    _, _, tunnel_id, from_opener, seq, op, arg, data = item
    if not (
        type(tunnel_id) is int
        and 0 < tunnel_id <= _T_MAX_ID
        and type(from_opener) is bool
        and type(seq) is int
        and 0 < seq <= _T_MAX_ID
        and type(op) is int
        and T_OPEN <= op <= T_RESET
        and type(arg) is int
        and type(data) is bytes
    ):
        raise ProtocolError("tunnel_malformed", "fields")
    if op in (T_OPEN, T_ACCEPT, T_CREDIT):
        ok = 0 < arg <= T_MAX_WINDOW and (op != T_OPEN or 0 < len(data) <= _T_MAX_TEXT)
        ok = ok and (op == T_OPEN or not data)
    elif op == T_DATA:
        ok = arg in (0, 1) and len(data) <= T_MAX_CHUNK
    else:
        ok = arg == 0 and len(data) <= _T_MAX_TEXT and (op == T_RESET or not data)
    opening = op == T_OPEN
    if (
        not ok
        or (opening and (seq != 1 or not from_opener))
        or (from_opener and seq == 1) != opening
    ):
        raise ProtocolError("tunnel_malformed", f"op {op}")
    return TunnelItem(tunnel_id, from_opener, seq, op, arg, data)
