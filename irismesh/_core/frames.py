"""The wire format: one zmq frame per message, a fixed header and a sealed msgpack body.

    offset  size  field
    0       1     magic    0x49 ('I')
    1       1     version  1
    2       1     kind     Kind below
    3       1     flags    reserved, 0
    4       2     scope    link-local key slot: 0 is the link itself, n > 0 the peer's n-th cluster
    6       8     seq      per link, per direction, strictly increasing: the AEAD nonce counter
    14      ...   body     sealer.seal(header, msgpack(envelope)); the header is associated data

One frame, never several: a multipart send costs about three times a single frame in pyzmq.
Every length is checked before anything is allocated for it: the transport caps whole frames
(zmq MAXMSGSIZE), `decode_header` rejects short, foreign and oversize frames, and msgpack is
unpacked with explicit limits. Everything wrong raises `ProtocolError(reason)`, whose reason is
the name of the counter the node increments; nothing else escapes.

Control envelopes are msgpack arrays, one shape per kind (positional; shapes listed with
`Kind`). The two kinds on the message hot path have a fixed binary layout instead, because
msgpack and its shape checks were a quarter of the core's cost per request (measured):

    REQUEST  !QIB  req_id, timeout_ms, priority << 4 | n_acks | n_acks x !Q acknowledged
             req ids | payload  (priority: a signed nibble, -7 to 7, 0 the default; sent only
             to members whose WELCOME says caps["prio"], see `priority`; BROADCAST, SURVEY and
             JOB have the same layout)
    JOB      REQUEST's layout, whose payload is the job's id (16) | the job: a job the mesh's
             memory held for the cluster, handed to one member (which answers a job id it has
             already answered from what it answered then)
    REPLY    !QB   req_id, status (STATUS_OK, _ERROR or _OVERLOADED) | payload
    PUBLISH  !QB   stream seq, topic length | topic (UTF-8) | payload
             (in the scope slot of the topic's key, offered like a cluster's: `LinkSecurity`)
    PUBLISH_STAMPED  !QBd  stream seq, topic length, publish time | topic | payload
             (one publish in `sample_every` when the publisher records telemetry: the
             publisher's wall clock, seconds since the epoch, for publish-to-deliver latency)
    PUBLISH_RETAINED  !QB  stream seq, topic length | message id (16) | topic | payload
             (a message the mesh's memory also holds: its id lets a subscriber that rereads
             the memory tell the live copy from the remembered one)
    TUNNEL   !IBI  tunnel id, op, argument | data  (ops and their argument: `TunnelOp`)

Acks name replies the caller has received, so the member can forget them at once (see
`replycache`). Under load, the bodies a flush sends on one link in one scope travel as one
BATCH frame, sealed once and sent as one zmq message (sealing and sending were the two largest
costs per request, measured):

    BATCH    repeated: !BI  kind, length | body of that kind (at most MAX_BATCH entries)

Publishes that one flush sends to one subscriber in one scope travel as a PUBLISH_RUN when the
subscriber's WELCOME says caps["run"]: the entries carry no stream seq of their own (the
first entry's is in the run's head, and each next one counts up by one), so a publish to N
subscribers encodes its entry once and stages the very same bytes for all of them:

    PUBLISH_RUN  !Q  stream seq of the first entry | repeated: !BIB  kind (PUBLISH,
             PUBLISH_STAMPED or PUBLISH_RETAINED), length of what follows, topic length |
             [publish time !d | message id (16)] topic | payload  (at most MAX_BATCH entries)

Trace context (the W3C `traceparent`, and `tracestate` when there is one) travels with a
call or a publish only when the caller has one, and only to peers whose WELCOME says
caps["trace"]: a message without it is sent exactly as before, byte for byte. A call with it
is wrapped whole, as a frame of its own or as a BATCH entry:

    TRACED   !BH  kind (REQUEST, BROADCAST, SURVEY, JOB or TUNNEL), context length |
             context | body of that kind

A publish with it is a PUBLISH_TRACED, whose context sits where a stamp or an id sits, ahead
of the publish it wraps (in a BATCH and in a PUBLISH_RUN alike):

    PUBLISH_TRACED  !QB  stream seq, topic length | !BH kind (PUBLISH, PUBLISH_STAMPED or
             PUBLISH_RETAINED), context length | context | [publish time | message id]
             topic | payload

The context is opaque here (at most MAX_TRACE bytes, sealed with the payload): its text is
the traceparent, then a newline and the tracestate when there is one (`irismesh.telemetry.
tracing` reads and writes it; a gateway passes it on as it came).

The body layout belongs to this module alone.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Final

import msgpack

from irismesh._core.priority import MIN_PRIORITY
from irismesh.errors import ProtocolError

MAGIC: Final = 0x49
VERSION: Final = 1
HEADER: Final = struct.Struct("!BBBBHQ")
HEADER_SIZE: Final = HEADER.size


class Kind(enum.IntEnum):
    """What a frame carries."""

    HELLO = 1  # dialler -> listener: [node_id, nonce, endpoint, caps]
    WELCOME = 2  # listener -> dialler: [node_id, nonce, endpoint, offers, caps]
    PING = 3  # dialler -> listener: [token, [acked req ids]]
    PONG = 4  # listener -> dialler: [token, load]
    REQUEST = 5  # dialler -> listener: fixed layout, see the module docstring
    REPLY = 6  # listener -> dialler: fixed layout, see the module docstring
    # 7 was PEERS, 18 and 19 PROBE and PROBE_ACK: membership travels as datagrams now.
    BYE = 8  # either way: [reason]
    REFUSE = 9  # listener -> dialler: [reason]  (handshake refused; retried with backoff)
    BROADCAST = 10  # dialler -> listener: REQUEST's layout; answered by an empty REPLY (an ack)
    SURVEY = 11  # dialler -> listener: REQUEST's layout; answered by a REPLY
    BATCH = 12  # either way: several REQUEST/BROADCAST/SURVEY (or REPLY) bodies, one seal
    SUBSCRIBE = 13  # listener -> dialler: [credit granted, [pattern bytes, ...]] (interest)
    UNSUBSCRIBE = 14  # listener -> dialler: [[pattern bytes, ...]]
    CREDIT = 15  # listener -> dialler: [messages the dialler may publish to us, in addition]
    PUBLISH = 16  # dialler -> listener, in a topic scope: fixed layout, see the module docstring
    TUNNEL = 17  # either way, in a cluster's scope: fixed layout, see the module docstring
    CANCEL = 20  # dialler -> listener: [[req ids the caller gave up on]] (at most MAX_CANCELS)
    PUBLISH_STAMPED = 21  # PUBLISH with the publisher's clock: fixed layout, see the docstring
    PUBLISH_RETAINED = 22  # PUBLISH with the message's id: fixed layout, see the docstring
    JOB = 23  # dialler -> listener: REQUEST's layout; a queued job (the docstring's JOB)
    PUBLISH_RUN = 24  # dialler -> listener, in a topic scope: publishes, see the docstring
    TRACED = 25  # dialler -> listener: a call with its trace context, see the docstring
    PUBLISH_TRACED = 26  # PUBLISH with its trace context, see the docstring


KINDS: Final = frozenset(int(k) for k in Kind)

# REPLY status values.
STATUS_OK: Final = 0
STATUS_ERROR: Final = 1  # payload is msgpack [type name, message]
# The member did not run the request and will not: it could not have answered in time. The
# payload is the reason (ASCII); the caller may send the request to another member.
STATUS_OVERLOADED: Final = 2
MAX_CANCELS: Final = 64

NODE_ID_SIZE: Final = 16
NONCE_SIZE: Final = 16
MAX_ENDPOINT: Final = 256
MAX_OFFERS: Final = 128  # two keys (a rotation) for each of at most 64 clusters
MAX_CLUSTERS: Final = 64


PUBLISH_FIELDS: Final = struct.Struct("!QB")
PUBLISH_STAMP: Final = struct.Struct("!d")
MAX_STAMP: Final = 1e11  # seconds since the epoch: a publish time past this is not one
MESSAGE_ID_SIZE: Final = 16  # a retained message's or a job's id (irismesh.memory.message_id)
TUNNEL_FIELDS: Final = struct.Struct("!IBI")
MAX_PATTERNS_PER_FRAME: Final = 128  # x 255 B patterns fits CONTROL_ALLOWANCE


class TunnelOp(enum.IntEnum):
    """What a TUNNEL frame does; `arg` is the number after the op."""

    OPEN = 1  # caller -> member: arg = receive window (bytes) the caller grants
    ACCEPT = 2  # member -> caller: arg = receive window the member grants
    DATA = 3  # arg = 1 if the message continues in the next DATA frame, 0 if this ends it
    CREDIT = 4  # arg = bytes the receiver grants in addition
    FIN = 5  # the sender will send nothing more (half close); arg unused
    RESET = 6  # abort both directions; data = reason (UTF-8)


REQUEST_FIELDS: Final = struct.Struct("!QIB")
TRACE_FIELDS: Final = struct.Struct("!BH")  # a TRACED body's (or a PUBLISH_TRACED's) head
MAX_TRACE: Final = 1024  # traceparent (55), a newline, tracestate (at most 512 by its spec)
TRACED_KINDS: Final = frozenset(
    (int(Kind.REQUEST), int(Kind.BROADCAST), int(Kind.SURVEY), int(Kind.JOB), int(Kind.TUNNEL))
)
REPLY_FIELDS: Final = struct.Struct("!QB")
MAX_ACKS: Final = 8
ACKS: Final = tuple(struct.Struct(f"!{n}Q") for n in range(MAX_ACKS + 1))


BATCH_ENTRY: Final = struct.Struct("!BI")
# A BATCH entry's header and the PUBLISH fields after it, read in one go by a subscriber.
PUBLISH_ENTRY: Final = struct.Struct("!BIQB")
MAX_BATCH: Final = 4096
# A PUBLISH_RUN's head (its first entry's stream seq) and each entry's header.
RUN_HEAD: Final = struct.Struct("!Q")
RUN_ENTRY: Final = struct.Struct("!BIB")


def encode_batch(entries: list[tuple[int, bytes]]) -> bytes:
    """A BATCH body of (kind, body) entries."""
    return encode_batch_of([(0, kind, body) for kind, body in entries], 0, len(entries))


def encode_batch_of(entries: list[tuple[int, int, bytes]], start: int, end: int) -> bytes:
    """A BATCH body of the staged (slot, kind, body) entries `entries[start:end]`, in one join
    of entry headers and bodies: each body is copied once."""
    pack = BATCH_ENTRY.pack
    parts: list[bytes] = []
    for i in range(start, end):
        _slot, kind, body = entries[i]
        parts.append(pack(kind, len(body)))
        parts.append(body)
    return b"".join(parts)


def batch_spans(body: bytes, kinds: frozenset[int]) -> list[tuple[int, int, int]]:
    """The (kind, start, end) of each entry of a BATCH body, whose kind must be in `kinds`:
    an entry is `body[start:end]`, which the hot paths decode in place (one copy less)."""
    spans: list[tuple[int, int, int]] = []
    offset, size, unpack = 0, len(body), BATCH_ENTRY.unpack_from
    while offset < size:
        if size - offset < BATCH_ENTRY.size or len(spans) >= MAX_BATCH:
            raise ProtocolError("bad_envelope", "BATCH")
        kind, length = unpack(body, offset)
        offset += BATCH_ENTRY.size
        if kind not in kinds or length > size - offset:
            raise ProtocolError("bad_envelope", "BATCH entry")
        spans.append((kind, offset, offset + length))
        offset += length
    if not spans:
        raise ProtocolError("bad_envelope", "empty BATCH")
    return spans


def decode_batch(body: bytes, kinds: frozenset[int]) -> list[tuple[int, bytes]]:
    """The (kind, body) entries of a BATCH body; every kind must be in `kinds`."""
    return [(kind, body[start:end]) for kind, start, end in batch_spans(body, kinds)]


def encode_tunnel(tunnel_id: int, op: int, arg: int, data: bytes = b"") -> bytes:
    return TUNNEL_FIELDS.pack(tunnel_id, op, arg) + data


def decode_tunnel(body: bytes) -> tuple[int, int, int, bytes]:
    """Return (tunnel id, op, arg, data) of a TUNNEL body."""
    if len(body) < TUNNEL_FIELDS.size:
        raise ProtocolError("bad_envelope", "TUNNEL")
    tunnel_id, op, arg = TUNNEL_FIELDS.unpack_from(body)
    if not TunnelOp.OPEN <= op <= TunnelOp.RESET:
        raise ProtocolError("bad_envelope", "TUNNEL op")
    return tunnel_id, op, arg, body[TUNNEL_FIELDS.size :]


def encode_traced(kind: int, trace: bytes, body: bytes) -> bytes:
    """A TRACED body: the call `body` of `kind` with its trace context."""
    return TRACE_FIELDS.pack(kind, len(trace)) + trace + body


def decode_traced(body: bytes, start: int = 0, end: int = -1) -> tuple[int, bytes, int]:
    """Return (kind, trace context, where the wrapped body starts) of a TRACED body: all of
    `body`, or the entry `body[start:end]` of a BATCH; the wrapped body ends at `end`."""
    if end < 0:
        end = len(body)
    if end - start < TRACE_FIELDS.size:
        raise ProtocolError("bad_envelope", "TRACED")
    kind, length = TRACE_FIELDS.unpack_from(body, start)
    first = start + TRACE_FIELDS.size + length
    if kind not in TRACED_KINDS or not 0 < length <= MAX_TRACE or first > end:
        raise ProtocolError("bad_envelope", "TRACED")
    return kind, body[start + TRACE_FIELDS.size : first], first


def encode_request(
    req_id: int, timeout_ms: int, acks: list[int], payload: bytes, priority: int = 0
) -> bytes:
    n = len(acks)
    return (
        REQUEST_FIELDS.pack(req_id, timeout_ms, rank_byte(priority, n))
        + ACKS[n].pack(*acks)
        + payload
    )


def rank_byte(priority: int, n_acks: int) -> int:
    """A REQUEST's third field: its priority (a signed nibble) and how many acks follow."""
    return ((priority & 0xF) << 4) | n_acks


def decode_request(
    body: bytes, start: int = 0, end: int = -1
) -> tuple[int, int, tuple[int, ...], bytes, int]:
    """Return (req_id, timeout_ms, acks, payload, priority) of a REQUEST body: all of `body`,
    or the entry `body[start:end]` of a BATCH (`batch_spans`)."""
    if end < 0:
        end = len(body)
    if end - start < REQUEST_FIELDS.size:
        raise ProtocolError("bad_envelope", "REQUEST")
    req_id, timeout_ms, ranked = REQUEST_FIELDS.unpack_from(body, start)
    n = ranked & 0xF
    priority = ranked >> 4
    if priority >= 8:
        priority -= 16
        if priority < MIN_PRIORITY:
            raise ProtocolError("bad_envelope", "REQUEST priority")
    first = start + REQUEST_FIELDS.size + 8 * n
    if n > MAX_ACKS or end < first:
        raise ProtocolError("bad_envelope", "REQUEST acks")
    acks = ACKS[n].unpack_from(body, start + REQUEST_FIELDS.size) if n else ()
    return req_id, timeout_ms, acks, body[first:end], priority


def encode_reply(req_id: int, status: int, payload: bytes) -> bytes:
    return REPLY_FIELDS.pack(req_id, status) + payload


def decode_reply(body: bytes, start: int = 0, end: int = -1) -> tuple[int, int, bytes]:
    """Return (req_id, status, payload) of a REPLY body: all of `body`, or the entry
    `body[start:end]` of a BATCH (`batch_spans`)."""
    if end < 0:
        end = len(body)
    if end - start < REPLY_FIELDS.size:
        raise ProtocolError("bad_envelope", "REPLY")
    req_id, status = REPLY_FIELDS.unpack_from(body, start)
    if status > STATUS_OVERLOADED:
        raise ProtocolError("bad_envelope", "REPLY status")
    return req_id, status, body[start + REPLY_FIELDS.size : end]


def encode_header(kind: int, scope: int, seq: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, 0, scope, seq)


def decode_header(frame: bytes, max_frame: int) -> tuple[int, int, int]:
    """Return (kind, scope, seq) of a frame, or raise ProtocolError."""
    size = len(frame)
    if size < HEADER_SIZE:
        raise ProtocolError("short_frame", f"{size} bytes")
    if size > max_frame:
        raise ProtocolError("oversize", f"{size} > {max_frame} bytes")
    magic, version, kind, _flags, scope, seq = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError("bad_magic")
    if version != VERSION:
        raise ProtocolError("bad_version", f"version {version}, expected {VERSION}")
    if kind not in KINDS:
        raise ProtocolError("bad_kind", str(kind))
    return kind, scope, seq


class BodyCodec:
    """msgpack with limits sized from the configured maximum payload."""

    __slots__ = ("_limits", "_packb")

    def __init__(self, max_payload: int) -> None:
        # Control envelopes carry ids, nonces, tags and endpoints, never payloads.
        self._limits = {
            "max_bin_len": 1024,  # patterns are at most 255 bytes, a record's tags 1 KiB
            "max_str_len": 4096,
            # Above every shape's own limit, so _check_shape names the offence.
            "max_array_len": 2 * max(MAX_PATTERNS_PER_FRAME, MAX_OFFERS),
            "max_map_len": 64,
            "max_ext_len": 0,
        }
        self._packb = msgpack.Packer(use_bin_type=True).pack

    def pack(self, envelope: list[Any]) -> bytes:
        return self._packb(envelope)  # type: ignore[no-any-return]

    def unpack(self, body: bytes, kind: int) -> list[Any]:
        try:
            value = msgpack.unpackb(body, raw=False, strict_map_key=True, **self._limits)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise ProtocolError("bad_body", type(exc).__name__) from None
        except msgpack.StackError:
            raise ProtocolError("bad_body", "nesting") from None
        if type(value) is not list:
            raise ProtocolError("bad_body", "not an array")
        return _check_shape(kind, value)


def _check_shape(kind: int, env: list[Any]) -> list[Any]:
    """Validate an envelope's shape for its kind; the core may then index it blindly."""
    ok: bool
    if kind == Kind.PING:
        ok = (
            len(env) == 2
            and type(env[0]) is int
            and type(env[1]) is list
            and all(type(a) is int for a in env[1])
        )
    elif kind == Kind.CANCEL:
        ok = (
            len(env) == 1
            and type(env[0]) is list
            and 0 < len(env[0]) <= MAX_CANCELS
            and all(type(a) is int and 0 <= a < 1 << 64 for a in env[0])
        )
    elif kind == Kind.PONG:
        ok = len(env) == 2 and type(env[0]) is int and type(env[1]) is int
    elif kind == Kind.HELLO:
        ok = (
            len(env) == 4
            and _is_id(env[0])
            and type(env[1]) is bytes
            and len(env[1]) == NONCE_SIZE
            and _is_endpoint(env[2])
            and type(env[3]) is dict
        )
    elif kind == Kind.WELCOME:
        ok = (
            len(env) == 5
            and _is_id(env[0])
            and type(env[1]) is bytes
            and len(env[1]) == NONCE_SIZE
            and _is_endpoint(env[2])
            and type(env[3]) is list
            and len(env[3]) <= MAX_OFFERS
            and all(type(t) is bytes and len(t) == 16 for t in env[3])
            and type(env[4]) is dict
        )
    elif kind == Kind.SUBSCRIBE:
        ok = (
            len(env) == 2 and type(env[0]) is int and 0 <= env[0] < 1 << 31 and _is_patterns(env[1])
        )
    elif kind == Kind.UNSUBSCRIBE:
        ok = len(env) == 1 and _is_patterns(env[0])
    elif kind == Kind.CREDIT:
        ok = len(env) == 1 and type(env[0]) is int and 0 < env[0] < 1 << 31
    elif kind in (Kind.BYE, Kind.REFUSE):
        ok = len(env) == 1 and type(env[0]) is str
    else:  # REQUEST and REPLY have fixed layouts and never come through msgpack
        ok = False
    if not ok:
        raise ProtocolError("bad_envelope", Kind(kind).name)
    return env


def _is_patterns(value: object) -> bool:
    return (
        type(value) is list
        and len(value) <= MAX_PATTERNS_PER_FRAME
        and all(type(p) is bytes for p in value)
    )


def _is_id(value: object) -> bool:
    return type(value) is bytes and len(value) == NODE_ID_SIZE


def _is_endpoint(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_ENDPOINT and value.startswith("tcp://")


def pack_error(type_name: str, message: str) -> bytes:
    """The payload of a STATUS_ERROR reply; any text (lone surrogates included) survives."""
    parts = [_clean(type_name, 200), _clean(message, 2000)]
    return msgpack.packb(parts, use_bin_type=True)  # type: ignore[no-any-return]


def _clean(text: str, limit: int) -> str:
    return text[:limit].encode("utf-8", "replace").decode("utf-8")


def unpack_error(payload: bytes) -> tuple[str, str]:
    try:
        value = msgpack.unpackb(payload, raw=False, max_str_len=8192, max_array_len=2)
    except Exception:
        return ("UnknownError", "malformed error payload")
    if type(value) is list and len(value) == 2 and all(type(v) is str for v in value):
        return (value[0], value[1])
    return ("UnknownError", "malformed error payload")
