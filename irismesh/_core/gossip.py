"""Membership datagrams: a fixed header and a sealed compound of SWIM messages.

    offset  size  field
    0       1     magic    0x53 ('S')
    1       1     version  2
    2       16    sender   the sending node's id
    18      8     counter  per sender, strictly increasing: the AEAD nonce counter
    26      ...   body     sealer.seal(header, msgpack([message, ...])), the header as AAD

A datagram is sealed under a key derived from the mesh key and the sender's id
(`DatagramSealer`), so only holders of the mesh key can read one, forge one, or claim a node id.
The body is a *compound*: a probe and the membership updates piggybacked on it travel in one
datagram. Each message is a msgpack array whose first element is its `Message` type:

    PING      [1, seq, target id]                  answer with ACK seq (target: whom it is for)
    PING_REQ  [2, seq, target id, target address]  probe target for me, relay its ACK or a NACK
    ACK       [3, seq]
    NACK      [4, seq]                             the relay heard nothing from the target
    ALIVE     [5, node id, incarnation, endpoint, address, tags, name, public key, signature]
    SUSPECT   [6, node id, incarnation, suspecter id]
    DEAD      [7, node id, incarnation, declarer id]   declarer == node id: the node left
    STATE     [8, reply wanted, [[node id, incarnation, state, endpoint, address, tags, name,
                                  public key, signature], ...]]

`endpoint` is where the node listens for links (tcp://host:port), `address` where it takes
datagrams (host:port), `tags` the opaque proofs of what it serves and reads (`records`), `name`
the label its operator gave it (`is_name`: up to 64 printable characters without whitespace,
"" for none). `public key` and `signature` prove the record (`records.record_transcript`): the
node's Ed25519 key, from which its id derives, and its signature of the record at that
incarnation, so a holder of the mesh key cannot forge another node's record; both are b"" from
cores built without identities. Version 1 (before records were signed) is dropped as
`bad_version`, and a version-1 node drops these the same way. Shapes are checked here,
completely, before the membership state machine sees a message; anything wrong raises
`ProtocolError(reason)`, never anything else: `bad_name` for a name that breaks the rule (which
keeps what `mesh peers` prints to one plain cell), else `bad_envelope`.

A node's record also travels in its link handshakes, whose frames are not sealed. There its
name travels sealed apart (`seal_name`): under the node's own datagram key, with a header of its
own (magic 'N') as associated data and a counter taken from its datagrams' sequence, so a
sealed name can neither pass for a datagram nor share a nonce with one. Names, like the rest of
membership, are read only by holders of the mesh key.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Final, Protocol

import msgpack

from irismesh.errors import ProtocolError

MAGIC: Final = 0x53
NAME_MAGIC: Final = 0x4E  # 'N': the header of a sealed name, never a datagram's
VERSION: Final = 2
HEADER: Final = struct.Struct("!BB16sQ")
HEADER_SIZE: Final = HEADER.size
NODE_ID_SIZE: Final = 16
PUBLIC_KEY_SIZE: Final = 32  # Ed25519
SIGNATURE_SIZE: Final = 64
MAX_ENDPOINT: Final = 256
MAX_ADDRESS: Final = 262
MAX_TAGS: Final = 1024  # bytes of tags in one record
MAX_NAME: Final = 64  # characters of a node's name (up to 256 bytes of UTF-8)
MAX_SEALED_NAME: Final = 8 + 4 * MAX_NAME + 64  # counter, UTF-8, the seal's overhead and more
MAX_MESSAGES: Final = 512  # messages in one compound
MAX_DATAGRAM: Final = 65507  # what one UDP datagram can carry


class Message(enum.IntEnum):
    PING = 1
    PING_REQ = 2
    ACK = 3
    NACK = 4
    ALIVE = 5
    SUSPECT = 6
    DEAD = 7
    STATE = 8
    NOTICE = 9  # an authority's signed notice (a revocation), carried as opaque bytes


# Member states as they travel in STATE entries.
STATE_ALIVE: Final = 0
STATE_SUSPECT: Final = 1
STATE_DEAD: Final = 2
STATE_LEFT: Final = 3

_PING, _PING_REQ, _ACK, _NACK = 1, 2, 3, 4
_ALIVE, _SUSPECT, _DEAD, _STATE, _NOTICE = 5, 6, 7, 8, 9
MAX_NOTICE: Final = 1024  # bytes of one notice
_MAX_STATE_ENTRIES = 4096
_MAX_STR = max(MAX_ENDPOINT, MAX_ADDRESS, 4 * MAX_NAME)  # bytes of the longest string field
_MAX_INT = 1 << 63
_WINDOW = 1024  # a table exchange arrives as a burst of datagrams, in any order
_WINDOW_MASK = (1 << _WINDOW) - 1


class DatagramSealer(Protocol):
    """Seals this node's datagrams and opens its peers' (under the mesh key)."""

    overhead: int

    def seal(self, header: bytes, counter: int, body: bytes) -> bytes: ...

    def open(self, sender: bytes, header: bytes, counter: int, sealed: bytes) -> bytes:
        """The plaintext body, or raise ProtocolError('bad_seal')."""
        ...


class NullDatagramSealer:
    """No confidentiality or integrity: for simulations that measure the protocol alone."""

    overhead = 0

    def seal(self, header: bytes, counter: int, body: bytes) -> bytes:
        return body

    def open(self, sender: bytes, header: bytes, counter: int, sealed: bytes) -> bytes:
        return sealed


_packb = msgpack.Packer(use_bin_type=True).pack


def encode_message(message: list[Any]) -> bytes:
    """One message, packed: compounds are built from these without packing them again."""
    return _packb(message)  # type: ignore[no-any-return]


def encode_compound(packed: list[bytes]) -> bytes:
    """A msgpack array of already packed messages."""
    return _array_head(len(packed)) + b"".join(packed)


def encode_single(packed: bytes) -> bytes:
    """A compound of one packed message."""
    return b"\x91" + packed


def encode_state(reply: bool, entries: list[bytes]) -> bytes:
    """A STATE message from packed entries."""
    return (
        b"\x93\x08"
        + (b"\xc3" if reply else b"\xc2")
        + _array_head(len(entries))
        + b"".join(entries)
    )


def _array_head(count: int) -> bytes:
    return bytes((0x90 | count,)) if count < 16 else b"\xdc" + count.to_bytes(2, "big")


class ReplayWindows:
    """Per sender, which datagram counters were seen: a sliding window, as IPsec's (1024 wide).

    A counter above the highest seen moves the window; one inside it is new once; one below it
    is too old. Bounded: past `capacity` senders, the oldest window is forgotten.
    """

    __slots__ = ("_windows", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._windows: dict[bytes, list[int]] = {}  # sender -> [highest, bitmap of seen]

    def fresh(self, sender: bytes, counter: int) -> bool:
        """Whether `counter` is new from `sender`; it is then marked seen."""
        window = self._windows.get(sender)
        if window is None:
            if len(self._windows) >= self.capacity:
                del self._windows[next(iter(self._windows))]
            window = self._windows[sender] = [0, 0]
        highest, seen = window
        if counter > highest:
            shift = counter - highest
            window[0] = counter
            window[1] = ((seen << shift) | 1) & _WINDOW_MASK if shift < _WINDOW else 1
            return True
        age = highest - counter
        if age >= _WINDOW or seen >> age & 1:
            return False
        window[1] = seen | 1 << age
        return True

    def forget(self, sender: bytes) -> None:
        self._windows.pop(sender, None)


def seal_datagram(sealer: DatagramSealer, sender: bytes, counter: int, body: bytes) -> bytes:
    header = HEADER.pack(MAGIC, VERSION, sender, counter)
    return header + sealer.seal(header, counter, body)


def seal_name(sealer: DatagramSealer, sender: bytes, counter: int, name: str) -> bytes:
    """`name` sealed for a handshake record: the counter (8 bytes), then the sealed UTF-8."""
    header = HEADER.pack(NAME_MAGIC, VERSION, sender, counter)
    return header[18:] + sealer.seal(header, counter, name.encode())


def open_name(sealer: DatagramSealer, sender: bytes, sealed: object) -> str:
    """The name `sender` sealed with `seal_name`; ProtocolError unless it opens to a name."""
    if type(sealed) is not bytes or not 8 <= len(sealed) <= MAX_SEALED_NAME:
        raise ProtocolError("bad_name", "sealed name")
    counter = int.from_bytes(sealed[:8], "big")
    header = HEADER.pack(NAME_MAGIC, VERSION, sender, counter)
    try:
        name = sealer.open(sender, header, counter, sealed[8:]).decode()
    except UnicodeDecodeError:
        raise ProtocolError("bad_name", "not UTF-8") from None
    if not is_name(name):
        raise ProtocolError("bad_name", "sealed name")
    return name


def open_datagram(
    sealer: DatagramSealer, datagram: bytes, max_datagram: int
) -> tuple[bytes, int, list[list[Any]]]:
    """(sender, counter, messages) of a datagram, every message's shape checked."""
    size = len(datagram)
    if size < HEADER_SIZE:
        raise ProtocolError("short_datagram", f"{size} bytes")
    if size > max_datagram:
        raise ProtocolError("oversize", f"datagram of {size} bytes")
    magic, version, sender, counter = HEADER.unpack_from(datagram)
    if magic != MAGIC:
        raise ProtocolError("bad_magic")
    if version != VERSION:
        raise ProtocolError("bad_version", f"version {version}, expected {VERSION}")
    body = sealer.open(sender, datagram[:HEADER_SIZE], counter, datagram[HEADER_SIZE:])
    return sender, counter, decode_compound(body)


def decode_compound(body: bytes) -> list[list[Any]]:
    try:
        value = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_TAGS,
            max_str_len=_MAX_STR,
            max_array_len=_MAX_STATE_ENTRIES,
            max_map_len=0,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise ProtocolError("bad_body", type(exc).__name__) from None
    except msgpack.StackError:
        raise ProtocolError("bad_body", "nesting") from None
    if type(value) is not list or not value or len(value) > MAX_MESSAGES:
        raise ProtocolError("bad_body", "not a compound")
    for message in value:
        check_message(message)
    return value


def check_message(message: object) -> None:
    """Raise ProtocolError unless `message` has the exact shape of its type."""
    if type(message) is not list or not message or type(message[0]) is not int:
        raise ProtocolError("bad_envelope", "message")
    kind, n = message[0], len(message)
    ok: bool
    if kind == _PING:
        ok = n == 3 and _is_uint(message[1]) and _is_id(message[2])
    elif kind == _PING_REQ:
        ok = n == 4 and _is_uint(message[1]) and _is_id(message[2]) and _is_address(message[3])
    elif kind in (_ACK, _NACK):
        ok = n == 2 and _is_uint(message[1])
    elif kind == _ALIVE:
        ok = n == 9 and _is_id(message[1]) and _is_uint(message[2]) and _is_record(message, 3)
        if ok and not is_name(message[6]):
            raise ProtocolError("bad_name", "ALIVE")
    elif kind in (_SUSPECT, _DEAD):
        ok = n == 4 and _is_id(message[1]) and _is_uint(message[2]) and _is_id(message[3])
    elif kind == _NOTICE:
        ok = n == 2 and type(message[1]) is bytes and 0 < len(message[1]) <= MAX_NOTICE
    elif kind == _STATE:
        ok = n == 3 and type(message[1]) is bool and type(message[2]) is list
        if ok:
            ok = all(_is_state_entry(entry) for entry in message[2])
        if ok and not all(is_name(entry[6]) for entry in message[2]):
            raise ProtocolError("bad_name", "STATE")
    else:
        raise ProtocolError("bad_kind", f"message {kind}")
    if not ok:
        raise ProtocolError("bad_envelope", Message(kind).name)


def is_name(value: object) -> bool:
    """Whether `value` may name a node: a str of up to MAX_NAME printable characters and no
    whitespace ("" for a node without a name)."""
    # Every whitespace character but the space is unprintable to str.isprintable.
    return (
        type(value) is str and len(value) <= MAX_NAME and value.isprintable() and " " not in value
    )


def _is_state_entry(entry: object) -> bool:
    return (
        type(entry) is list
        and len(entry) == 9
        and _is_id(entry[0])
        and _is_uint(entry[1])
        and type(entry[2]) is int
        and STATE_ALIVE <= entry[2] <= STATE_LEFT
        and _is_record(entry, 3)
    )


def _is_record(fields: list[Any], at: int) -> bool:
    """endpoint, address, tags, (its type only: `is_name` judges it) name, public key and
    signature (each of its size, or empty), from `at`."""
    endpoint, address, tags = fields[at], fields[at + 1], fields[at + 2]
    public, signature = fields[at + 4], fields[at + 5]
    return (
        type(public) is bytes
        and len(public) in (0, PUBLIC_KEY_SIZE)
        and type(signature) is bytes
        and len(signature) in (0, SIGNATURE_SIZE)
        and type(endpoint) is str
        and 0 < len(endpoint) <= MAX_ENDPOINT
        and endpoint.startswith("tcp://")
        and _is_address(address)
        and type(tags) is bytes
        and len(tags) <= MAX_TAGS
        and type(fields[at + 3]) is str
    )


def _is_uint(value: object) -> bool:
    return type(value) is int and 0 <= value < _MAX_INT


def _is_id(value: object) -> bool:
    return type(value) is bytes and len(value) == NODE_ID_SIZE


def _is_address(value: object) -> bool:
    return type(value) is str and 2 < len(value) <= MAX_ADDRESS and ":" in value
