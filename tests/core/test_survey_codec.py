"""The survey datagram codec: round trips, and hostile bytes never escape as anything but
ProtocolError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from irismesh.discovery.sealed import SLOT_LEN, SLOTS
from irismesh.discovery.survey import (
    MAX_DATAGRAM,
    MAX_SENDERS,
    MAX_TIMES_PER_SENDER,
    TAG_LEN,
    ReplayCache,
    SurveyKind,
    SurveyMessage,
    decode,
    encode_answer,
    encode_question,
)
from irismesh.errors import ConfigurationError, ProtocolError

NODE = bytes(range(16))
ENDPOINT = "tcp://127.0.0.1:5555"
ENCODERS = {SurveyKind.QUESTION: encode_question, SurveyKind.ANSWER: encode_answer}

node_ids = st.binary(min_size=16, max_size=16)
realms = st.binary(max_size=32)
# Printable ASCII without spaces: what the codec promises endpoints look like.
endpoints = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=256 - len("tcp://")
).map(lambda rest: "tcp://" + rest)
kinds = st.sampled_from(list(SurveyKind))
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=10,
)


SLOTS_OK = [bytes(SLOT_LEN)] * SLOTS
TIME = 1_700_000_000_000


def datagram(body: object, *, header: bytes = b"IMSV\x02\x01") -> bytes:
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return header + packed + bytes(TAG_LEN)


@given(
    kind=kinds,
    node_id=node_ids,
    endpoint=endpoints,
    realm=realms,
    timestamp=st.integers(0, 2**63 - 1),
)
def test_round_trip(
    kind: SurveyKind, node_id: bytes, endpoint: str, realm: bytes, timestamp: int
) -> None:
    data = ENCODERS[kind](node_id=node_id, endpoint=endpoint, realm=realm, timestamp_ms=timestamp)
    assert len(data) <= MAX_DATAGRAM
    message = decode(data)
    assert (message.kind, message.node_id, message.endpoint) == (kind, node_id, endpoint)
    assert message.timestamp_ms == timestamp
    assert len(message.slots) == SLOTS
    assert message.verify(realm)
    assert not message.verify(realm + b"x")


def test_every_datagram_has_one_size_whatever_its_slots() -> None:
    empty = encode_question(node_id=NODE, endpoint=ENDPOINT, timestamp_ms=TIME)
    full = encode_question(node_id=NODE, endpoint=ENDPOINT, timestamp_ms=TIME, slots=SLOTS_OK)
    assert len(empty) == len(full)
    assert decode(full).slots == tuple(SLOTS_OK)


def test_the_tag_covers_every_byte() -> None:
    data = encode_answer(node_id=NODE, endpoint=ENDPOINT, realm=b"k", timestamp_ms=TIME)
    for position in range(len(data) - TAG_LEN):
        damaged = bytearray(data)
        damaged[position] ^= 1
        try:
            message = decode(bytes(damaged))
        except ProtocolError:
            continue
        assert not message.verify(b"k"), position


def test_the_first_format_is_refused_by_name() -> None:
    packed: bytes = msgpack.packb([NODE, ENDPOINT, b""], use_bin_type=True)
    assert outcome(b"IMSV\x01\x01" + packed) == "old_version"


REASONS = {"short", "bad_magic", "bad_version", "old_version", "bad_kind", "bad_body", "oversize"}


def outcome(data: bytes) -> SurveyMessage | str:
    try:
        return decode(data)
    except ProtocolError as exc:
        return exc.reason


def _decodes_or_protocol_error(data: bytes) -> None:
    # Any other exception type escapes outcome() and fails the test.
    result = outcome(data)
    assert isinstance(result, SurveyMessage) or result in REASONS, result


@given(st.binary(max_size=2 * MAX_DATAGRAM))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    _decodes_or_protocol_error(data)


@given(header=st.sampled_from([b"IMSV\x02\x01", b"IMSV\x02\x02"]), body=msgpack_values)
def test_arbitrary_msgpack_bodies_decode_or_raise_protocol_error(
    header: bytes, body: object
) -> None:
    _decodes_or_protocol_error(datagram(body, header=header))


@given(
    kind=kinds,
    node_id=node_ids,
    endpoint=endpoints,
    realm=realms,
    cut=st.integers(min_value=0),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(1, 255)), max_size=4),
)
def test_damaged_valid_datagrams_decode_or_raise_protocol_error(
    kind: SurveyKind,
    node_id: bytes,
    endpoint: str,
    realm: bytes,
    cut: int,
    flips: list[tuple[int, int]],
) -> None:
    data = bytearray(ENCODERS[kind](node_id=node_id, endpoint=endpoint, realm=realm))
    for position, mask in flips:
        data[position % len(data)] ^= mask
    _decodes_or_protocol_error(bytes(data[: len(data) - cut % len(data)]))


@pytest.mark.parametrize("data", [b"", b"IMSV", b"IMSV\x02", b"IMSV\x02\x01" + bytes(15)])
def test_short(data: bytes) -> None:
    assert outcome(data) == "short"


def test_truncated_body() -> None:
    data = encode_question(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(data[:-3]) == "bad_body"


def test_bad_magic() -> None:
    data = encode_question(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(b"XMSV" + data[4:]) == "bad_magic"


@pytest.mark.parametrize("version", [0, 3, 255])
def test_bad_version(version: int) -> None:
    data = encode_question(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(data[:4] + bytes([version]) + data[5:]) == "bad_version"


@pytest.mark.parametrize("kind", [0, 3, 255])
def test_bad_kind(kind: int) -> None:
    data = encode_answer(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(data[:5] + bytes([kind]) + data[6:]) == "bad_kind"


def test_oversize_is_refused_before_anything_else() -> None:
    assert outcome(b"IMSV\x02\x01" + b"\x00" * (MAX_DATAGRAM - 5)) == "oversize"
    assert outcome(b"junk" * 400) == "oversize"


@pytest.mark.parametrize(
    "body",
    [
        [NODE, ENDPOINT, TIME],
        [NODE, ENDPOINT, TIME, SLOTS_OK, b""],
        {"node_id": NODE},
        [NODE[:15], ENDPOINT, TIME, SLOTS_OK],
        [NODE.hex(), ENDPOINT, TIME, SLOTS_OK],
        [NODE, "udp://127.0.0.1:1", TIME, SLOTS_OK],
        [NODE, "tcp://127.0.0.1:1\n", TIME, SLOTS_OK],
        [NODE, "tcp://" + "a" * 251, TIME, SLOTS_OK],
        [NODE, ENDPOINT, -1, SLOTS_OK],
        [NODE, ENDPOINT, 1.5, SLOTS_OK],
        [NODE, ENDPOINT, True, SLOTS_OK],
        [NODE, ENDPOINT, TIME, SLOTS_OK[:3]],
        [NODE, ENDPOINT, TIME, [*SLOTS_OK[:3], b"x"]],
        [NODE, ENDPOINT, TIME, [*SLOTS_OK[:3], "x"]],
    ],
)
def test_bad_body(body: object) -> None:
    assert outcome(datagram(body)) == "bad_body"


def test_trailing_bytes_after_body() -> None:
    data = encode_question(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(data[:-TAG_LEN] + b"\x00" + data[-TAG_LEN:]) == "bad_body"


@pytest.mark.parametrize(
    ("node_id", "endpoint", "realm"),
    [
        (NODE[:8], ENDPOINT, b""),
        (NODE, "127.0.0.1:5555", b""),
        (NODE, "tcp://" + "a" * 251, b""),
        (NODE, "tcp://host name:1", b""),
        (NODE, ENDPOINT, b"r" * 33),
    ],
)
def test_encoding_invalid_own_fields_is_a_configuration_error(
    node_id: bytes, endpoint: str, realm: bytes
) -> None:
    with pytest.raises(ConfigurationError):
        encode_question(node_id=node_id, endpoint=endpoint, realm=realm)


def test_the_replay_cache_refuses_a_pair_twice_and_stays_bounded() -> None:
    cache = ReplayCache(window_ms=30_000)
    now = 1_000_000
    assert cache.accept(NODE, now, now)
    assert not cache.accept(NODE, now, now)
    assert cache.accept(bytes(16), now, now)  # another sender, the same time
    # More times than a sender keeps within the window: the oldest go, and at or before them
    # nothing is accepted again.
    times = [now + i for i in range(1, MAX_TIMES_PER_SENDER + 5)]
    assert all(cache.accept(NODE, t, now) for t in times)
    assert not cache.accept(NODE, now + 1, now)
    assert not cache.accept(NODE, times[-1], now)
    assert cache.accept(NODE, times[-1] + 1, now)
    # Times that left the window are forgotten first, without raising the floor.
    later = now + 31_000
    assert cache.accept(NODE, later, later)
    # Senders beyond the bound: the least recently heard is forgotten.
    for i in range(MAX_SENDERS):
        assert cache.accept(i.to_bytes(16, "big"), later + 1, later + 1)
    assert len(cache._senders) == MAX_SENDERS
    assert NODE not in cache._senders
