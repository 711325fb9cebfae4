"""The wire format: round trips of every kind, and hostile bytes that never escape as anything
but ProtocolError with the right reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from irismesh._core.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_ACKS,
    MAX_CANCELS,
    MAX_ENDPOINT,
    MAX_OFFERS,
    MAX_PATTERNS_PER_FRAME,
    REPLY_FIELDS,
    REQUEST_FIELDS,
    STATUS_ERROR,
    STATUS_OK,
    VERSION,
    BodyCodec,
    Kind,
    batch_spans,
    decode_batch,
    decode_header,
    decode_reply,
    decode_request,
    encode_batch,
    encode_header,
    encode_reply,
    encode_request,
    pack_error,
    unpack_error,
)
from irismesh._core.priority import MAX_PRIORITY, MIN_PRIORITY
from irismesh.errors import ProtocolError

MAX_PAYLOAD = 1 << 17  # room for the largest control frames
MAX_FRAME = MAX_PAYLOAD + 1024
CODEC = BodyCodec(MAX_PAYLOAD)

ids = st.binary(min_size=16, max_size=16)
nonces = st.binary(min_size=16, max_size=16)
endpoints = st.text(min_size=1, max_size=MAX_ENDPOINT - len("tcp://")).map(lambda s: "tcp://" + s)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
msgpack_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
payloads = st.binary(max_size=2048)
reasons = st.text(max_size=1000)  # at most 4000 UTF-8 bytes: within max_str_len
scalars = st.none() | st.booleans() | msgpack_ints | st.text(max_size=20) | st.binary(max_size=20)
caps = st.dictionaries(st.text(max_size=10), scalars, max_size=8)

# REQUEST, BROADCAST, SURVEY, JOB and REPLY have fixed layouts, not msgpack envelopes.
FIXED_KINDS = (Kind.REQUEST, Kind.REPLY, Kind.BROADCAST, Kind.SURVEY, Kind.JOB, Kind.BATCH)
BINARY_KINDS = (
    *FIXED_KINDS,
    Kind.PUBLISH,
    Kind.PUBLISH_STAMPED,
    Kind.PUBLISH_RETAINED,
    Kind.PUBLISH_RUN,
    Kind.TUNNEL,
    Kind.TRACED,
    Kind.PUBLISH_TRACED,
)
MSGPACK_KINDS = [k for k in Kind if k not in BINARY_KINDS]
patterns = st.lists(st.binary(max_size=255), max_size=MAX_PATTERNS_PER_FRAME)
credits = st.integers(min_value=1, max_value=2**31 - 1)
ENVELOPES: dict[Kind, st.SearchStrategy[list[Any]]] = {
    Kind.HELLO: st.tuples(ids, nonces, endpoints, caps).map(list),
    Kind.WELCOME: st.tuples(
        ids, nonces, endpoints, st.lists(st.binary(min_size=16, max_size=16), max_size=8), caps
    ).map(list),
    Kind.PING: st.tuples(msgpack_ints, st.lists(msgpack_ints, max_size=200)).map(list),
    Kind.PONG: st.tuples(msgpack_ints, msgpack_ints).map(list),
    Kind.BYE: st.tuples(reasons).map(list),
    Kind.REFUSE: st.tuples(reasons).map(list),
    Kind.SUBSCRIBE: st.tuples(credits | st.just(0), patterns).map(list),
    Kind.UNSUBSCRIBE: st.tuples(patterns).map(list),
    Kind.CREDIT: st.tuples(credits).map(list),
    Kind.CANCEL: st.tuples(st.lists(u64, min_size=1, max_size=MAX_CANCELS)).map(list),
}
envelopes = st.sampled_from(MSGPACK_KINDS).flatmap(
    lambda kind: st.tuples(st.just(kind), ENVELOPES[kind])
)
headers = st.tuples(st.integers(0, 2**16 - 1), u64)

msgpack_values = st.recursive(
    scalars | st.floats(allow_nan=False),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=20,
)


def decode(frame: bytes) -> tuple[int, int, int, Any]:
    """What the engine does with a frame, minus the seal."""
    kind, scope, seq = decode_header(frame, MAX_FRAME)
    body = frame[HEADER_SIZE:]
    if kind == Kind.REQUEST:
        return kind, scope, seq, decode_request(body)
    if kind == Kind.REPLY:
        return kind, scope, seq, decode_reply(body)
    return kind, scope, seq, CODEC.unpack(body, kind)


def reason_of(frame: bytes) -> str:
    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    return caught.value.reason


def valid_frame() -> bytes:
    return encode_header(Kind.PING, 0, 7) + CODEC.pack([123, []])


# ---------------------------------------------------------------------- round trips


@settings(max_examples=150)
@given(envelopes, headers)
def test_every_kind_round_trips(kind_env: tuple[Kind, list[Any]], header: tuple[int, int]) -> None:
    kind, env = kind_env
    scope, seq = header
    frame = encode_header(kind, scope, seq) + CODEC.pack(env)
    assert decode(frame) == (kind, scope, seq, env)


acks = st.lists(u64, max_size=MAX_ACKS)


@given(
    headers, u64, st.integers(0, 2**32 - 1), acks, payloads, st.integers(MIN_PRIORITY, MAX_PRIORITY)
)
def test_requests_round_trip(
    header: tuple[int, int],
    req_id: int,
    timeout_ms: int,
    acked: list[int],
    payload: bytes,
    priority: int,
) -> None:
    frame = encode_header(Kind.REQUEST, *header) + encode_request(
        req_id, timeout_ms, acked, payload, priority
    )
    expected = (req_id, timeout_ms, tuple(acked), payload, priority)
    assert decode(frame) == (Kind.REQUEST, *header, expected)


def test_a_request_of_the_default_priority_is_the_layout_old_nodes_send() -> None:
    old = REQUEST_FIELDS.pack(9, 100, 1) + (7).to_bytes(8, "big") + b"p"
    assert encode_request(9, 100, [7], b"p") == old
    assert decode_request(old) == (9, 100, (7,), b"p", 0)
    # The priority nibble below the range (-8) is no priority: rejected, counted as any other.
    with pytest.raises(ProtocolError, match="priority"):
        decode_request(REQUEST_FIELDS.pack(9, 100, 0x80))


@given(headers, u64, st.sampled_from([STATUS_OK, STATUS_ERROR]), payloads)
def test_replies_round_trip(
    header: tuple[int, int], req_id: int, status: int, payload: bytes
) -> None:
    frame = encode_header(Kind.REPLY, *header) + encode_reply(req_id, status, payload)
    assert decode(frame) == (Kind.REPLY, *header, (req_id, status, payload))


@given(
    st.lists(
        st.tuples(
            st.booleans(), u64, st.integers(0, 2**32 - 1), acks, payloads, st.integers(0, 255)
        ),
        min_size=1,
        max_size=8,
    )
)
def test_batch_entries_decode_in_place_as_their_copies_do(
    entries: list[tuple[bool, int, int, list[int], bytes, int]],
) -> None:
    bodies = [
        (int(Kind.REQUEST), encode_request(req_id, timeout_ms, acked, payload))
        if is_request
        else (int(Kind.REPLY), encode_reply(req_id, status % 3, payload))
        for is_request, req_id, timeout_ms, acked, payload, status in entries
    ]
    body = encode_batch(bodies)
    kinds = frozenset((int(Kind.REQUEST), int(Kind.REPLY)))
    assert decode_batch(body, kinds) == bodies
    for (kind, start, end), (_kind, entry) in zip(batch_spans(body, kinds), bodies, strict=True):
        if kind == Kind.REQUEST:
            assert decode_request(body, start, end) == decode_request(entry)
        else:
            assert decode_reply(body, start, end) == decode_reply(entry)


def test_an_entry_decoded_in_place_never_reads_past_its_end() -> None:
    body = encode_batch(
        [(int(Kind.REPLY), b"\x00" * 4), (int(Kind.REPLY), encode_reply(1, 0, b""))]
    )
    (_k1, start, end), _second = batch_spans(body, frozenset((int(Kind.REPLY),)))
    with pytest.raises(ProtocolError, match="bad_envelope"):
        decode_reply(body, start, end)  # four bytes: short, though the next entry follows
    request = encode_request(1, 10, [5], b"")
    body = encode_batch([(int(Kind.REQUEST), request[:-4]), (int(Kind.REPLY), b"x" * 20)])
    (_k2, start, end), _rest = batch_spans(body, frozenset((int(Kind.REQUEST), int(Kind.REPLY))))
    with pytest.raises(ProtocolError, match="bad_envelope"):
        decode_request(body, start, end)  # its ack is cut short by its own end


def test_limits_in_the_shapes_are_inclusive() -> None:
    patterns = [b"x" * 255] * MAX_PATTERNS_PER_FRAME
    assert decode(encode_header(Kind.UNSUBSCRIBE, 0, 1) + CODEC.pack([patterns]))[3] == [patterns]
    welcome = [
        bytes(16),
        bytes(16),
        "tcp://" + "x" * (MAX_ENDPOINT - 6),
        [bytes(16)] * MAX_OFFERS,
        {},
    ]
    assert decode(encode_header(Kind.WELCOME, 0, 0) + CODEC.pack(welcome))[3] == welcome
    body = encode_request(2**64 - 1, 2**32 - 1, [2**64 - 1] * MAX_ACKS, bytes(MAX_PAYLOAD))
    request = decode(encode_header(Kind.REQUEST, 1, 1) + body)[3]
    assert request == (2**64 - 1, 2**32 - 1, (2**64 - 1,) * MAX_ACKS, bytes(MAX_PAYLOAD), 0)


def test_header_layout() -> None:
    header = encode_header(Kind.REPLY, 3, 2**40 + 5)
    assert len(header) == HEADER_SIZE == 14
    assert HEADER.unpack(header) == (MAGIC, VERSION, Kind.REPLY, 0, 3, 2**40 + 5)


# ---------------------------------------------------------------------- hostile bytes


FRAME_REASONS = {
    "short_frame",
    "oversize",
    "bad_magic",
    "bad_version",
    "bad_kind",
    "bad_body",
    "bad_envelope",
}


def outcome(decoder: Callable[..., object], *args: Any) -> str:
    """ "ok", or the reason of the ProtocolError raised; any other exception propagates."""
    try:
        decoder(*args)
    except ProtocolError as exc:
        return exc.reason
    return "ok"


@settings(max_examples=300)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    assert outcome(decode, data) in {"ok"} | FRAME_REASONS


@settings(max_examples=300)
@given(st.sampled_from(list(Kind)), st.binary(max_size=600))
def test_arbitrary_bodies_unpack_or_raise_protocol_error(kind: Kind, body: bytes) -> None:
    assert outcome(CODEC.unpack, body, kind) in {"ok", "bad_body", "bad_envelope"}
    assert outcome(decode_request, body) in {"ok", "bad_envelope"}
    assert outcome(decode_reply, body) in {"ok", "bad_envelope"}


@settings(max_examples=150)
@given(st.sampled_from(list(Kind)), msgpack_values)
def test_any_msgpack_value_is_an_envelope_or_a_protocol_error(kind: Kind, value: Any) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    reason = outcome(CODEC.unpack, body, kind)
    assert reason in {"ok", "bad_body", "bad_envelope"}
    if reason == "ok":
        assert CODEC.unpack(body, kind) == value


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    kind, env = draw(envelopes)
    scope, seq = draw(headers)
    frame = bytearray(encode_header(kind, scope, seq) + CODEC.pack(env))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
        if how == "flip" and frame:
            bit = draw(st.integers(0, len(frame) * 8 - 1))
            frame[bit // 8] ^= 1 << (bit % 8)
        elif how == "truncate":
            del frame[draw(st.integers(0, len(frame))) :]
        elif how == "extend":
            frame += draw(st.binary(min_size=1, max_size=40))
        else:
            at = draw(st.integers(0, len(frame)))
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(frame)


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_frames())
def test_mutated_frames_decode_or_raise_protocol_error(frame: bytes) -> None:
    assert outcome(decode, frame) in {"ok"} | FRAME_REASONS


# ---------------------------------------------------------------------- specific reasons


def test_short_frame() -> None:
    assert reason_of(b"") == "short_frame"
    assert reason_of(valid_frame()[: HEADER_SIZE - 1]) == "short_frame"


def test_oversize_is_checked_before_anything_is_read() -> None:
    # A frame of garbage one byte too long is refused on its size alone.
    assert reason_of(b"\x00" * (MAX_FRAME + 1)) == "oversize"
    frame = encode_header(Kind.REQUEST, 1, 1) + encode_request(1, 1, [], b"")
    assert reason_of(frame + b"\x00" * (MAX_FRAME + 1 - len(frame))) == "oversize"
    # At exactly max_frame the size is fine and the next check speaks.
    assert reason_of(b"\x00" * MAX_FRAME) == "bad_magic"


def test_bad_magic_version_kind() -> None:
    frame = bytearray(valid_frame())
    frame[0] = 0x50
    assert reason_of(bytes(frame)) == "bad_magic"
    frame = bytearray(valid_frame())
    frame[1] = VERSION + 1
    assert reason_of(bytes(frame)) == "bad_version"
    for kind in (0, max(Kind) + 1, 255):
        frame = bytearray(valid_frame())
        frame[2] = kind
        assert reason_of(bytes(frame)) == "bad_kind"


@pytest.mark.parametrize(
    "body",
    [
        b"",  # nothing
        b"\xc1",  # never used in msgpack
        CODEC.pack([1, []]) + b"\x00",  # extra data
        CODEC.pack([1, []])[:-1],  # truncated
        msgpack.packb({"a": 1}),  # not an array
        msgpack.packb([msgpack.ExtType(1, b"x")]),  # ext types are refused
        msgpack.packb([{1: 2}]),  # non-string map key
        b"\x91" * 5000 + b"\xc0",  # nested deeper than any unpacker stack
        msgpack.packb([b"x" * (MAX_PAYLOAD + 1)], use_bin_type=True),  # bin over the limit
        msgpack.packb(["x" * 4097]),  # str over the limit
        msgpack.packb(
            [0] * (2 * max(MAX_PATTERNS_PER_FRAME, MAX_OFFERS) + 1)
        ),  # array over the limit
    ],
)
def test_bad_body(body: bytes) -> None:
    assert reason_of(encode_header(Kind.PING, 0, 1) + body) == "bad_body"


@pytest.mark.parametrize(
    ("kind", "env"),
    [
        (Kind.PING, []),
        (Kind.PING, [1]),
        (Kind.PING, ["1", []]),
        (Kind.PING, [1, ["not an id"]]),
        (Kind.PING, [1, {}]),
        (Kind.PONG, [1]),
        (Kind.CANCEL, [[]]),  # at least one request
        (Kind.CANCEL, [list(range(MAX_CANCELS + 1))]),
        (Kind.CANCEL, [[-1]]),
        (Kind.CANCEL, [1]),
        (Kind.REQUEST, [1, 1, []]),  # REQUEST and REPLY never come through msgpack
        (Kind.REPLY, [1, 0, b""]),
        (Kind.HELLO, [bytes(15), bytes(16), "tcp://a", {}]),
        (Kind.HELLO, [bytes(16), bytes(17), "tcp://a", {}]),
        (Kind.HELLO, [bytes(16), bytes(16), "udp://a", {}]),
        (Kind.HELLO, [bytes(16), bytes(16), "tcp://" + "a" * MAX_ENDPOINT, {}]),
        (Kind.HELLO, [bytes(16), bytes(16), "tcp://a", []]),
        (Kind.WELCOME, [bytes(16), bytes(16), "tcp://a", [bytes(15)], {}]),
        (Kind.WELCOME, [bytes(16), bytes(16), "tcp://a", [bytes(16)] * (MAX_OFFERS + 1), {}]),
        (Kind.BYE, []),
        (Kind.BYE, [b"bytes"]),
        (Kind.REFUSE, ["a", "b"]),
    ],
)
def test_bad_envelope(kind: Kind, env: list[Any]) -> None:
    assert reason_of(encode_header(kind, 0, 1) + CODEC.pack(env)) == "bad_envelope"
    with pytest.raises(ProtocolError) as caught:
        CODEC.unpack(CODEC.pack(env), kind)
    assert caught.value.reason == "bad_envelope"


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (Kind.REQUEST, b""),
        (Kind.REQUEST, REQUEST_FIELDS.pack(1, 1, 0)[:-1]),  # short of the fixed fields
        (Kind.REQUEST, REQUEST_FIELDS.pack(1, 1, 2) + bytes(15)),  # fewer acks than announced
        (Kind.REQUEST, REQUEST_FIELDS.pack(1, 1, MAX_ACKS + 1) + bytes(8 * (MAX_ACKS + 1))),
        (Kind.REQUEST, REQUEST_FIELDS.pack(1, 1, 255)),
        (Kind.REPLY, b""),
        (Kind.REPLY, REPLY_FIELDS.pack(1, 0)[:-1]),
        (Kind.REPLY, REPLY_FIELDS.pack(1, 3)),  # no such status
        (Kind.REPLY, REPLY_FIELDS.pack(1, 255) + b"payload"),
    ],
)
def test_bad_fixed_layout(kind: Kind, body: bytes) -> None:
    assert reason_of(encode_header(kind, 1, 1) + body) == "bad_envelope"


def test_fixed_layouts_accept_empty_payloads_and_no_acks() -> None:
    assert decode_request(REQUEST_FIELDS.pack(5, 0, 0)) == (5, 0, (), b"", 0)
    assert decode_reply(REPLY_FIELDS.pack(5, STATUS_ERROR)) == (5, STATUS_ERROR, b"")


# ---------------------------------------------------------------------- error payloads


ascii_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=3000)


@given(ascii_text, ascii_text)
def test_error_payload_round_trip_truncates_long_fields(type_name: str, message: str) -> None:
    assert unpack_error(pack_error(type_name, message)) == (type_name[:200], message[:2000])


@given(st.binary(max_size=200))
@example(msgpack.packb(["only one"]))
@example(msgpack.packb([1, "x"]))
@example(msgpack.packb(["a", "b", "c"]))
def test_unpack_error_of_garbage_is_an_unknown_error(payload: bytes) -> None:
    type_name, message = unpack_error(payload)
    if (type_name, message) != ("UnknownError", "malformed error payload"):
        assert msgpack.unpackb(payload) == [type_name, message]


def test_error_payload_round_trip_of_a_long_non_ascii_message() -> None:
    type_name, _message = unpack_error(pack_error("ValueError", "€" * 2000))
    assert type_name == "ValueError"


def test_error_payload_of_a_message_with_a_lone_surrogate() -> None:
    type_name, _message = unpack_error(pack_error("FileNotFoundError", "no file '\udcff'"))
    assert type_name == "FileNotFoundError"
