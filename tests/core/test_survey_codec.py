"""The survey datagram codec: round trips, and hostile bytes never escape as anything but
ProtocolError."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from irismesh.discovery.survey import (
    MAX_DATAGRAM,
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


def datagram(body: object, *, header: bytes = b"IMSV\x01\x01") -> bytes:
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return header + packed


@given(kind=kinds, node_id=node_ids, endpoint=endpoints, realm=realms)
def test_round_trip(kind: SurveyKind, node_id: bytes, endpoint: str, realm: bytes) -> None:
    data = ENCODERS[kind](node_id=node_id, endpoint=endpoint, realm=realm)
    assert len(data) <= MAX_DATAGRAM
    assert decode(data) == SurveyMessage(kind=kind, node_id=node_id, endpoint=endpoint, realm=realm)


REASONS = {"short", "bad_magic", "bad_version", "bad_kind", "bad_body", "oversize"}


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


@given(header=st.sampled_from([b"IMSV\x01\x01", b"IMSV\x01\x02"]), body=msgpack_values)
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


@pytest.mark.parametrize("data", [b"", b"IMSV", b"IMSV\x01"])
def test_short(data: bytes) -> None:
    assert outcome(data) == "short"


def test_truncated_body() -> None:
    data = encode_question(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(data[:-3]) == "bad_body"


def test_bad_magic() -> None:
    data = encode_question(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(b"XMSV" + data[4:]) == "bad_magic"


@pytest.mark.parametrize("version", [0, 2, 255])
def test_bad_version(version: int) -> None:
    data = encode_question(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(data[:4] + bytes([version]) + data[5:]) == "bad_version"


@pytest.mark.parametrize("kind", [0, 3, 255])
def test_bad_kind(kind: int) -> None:
    data = encode_answer(node_id=NODE, endpoint=ENDPOINT)
    assert outcome(data[:5] + bytes([kind]) + data[6:]) == "bad_kind"


def test_oversize_is_refused_before_anything_else() -> None:
    assert outcome(b"IMSV\x01\x01" + b"\x00" * (MAX_DATAGRAM - 5)) == "oversize"
    assert outcome(b"junk" * 300) == "oversize"


@pytest.mark.parametrize(
    "body",
    [
        [NODE, ENDPOINT],
        [NODE, ENDPOINT, b"", b""],
        {"node_id": NODE},
        [NODE[:15], ENDPOINT, b""],
        [NODE.hex(), ENDPOINT, b""],
        [NODE, "udp://127.0.0.1:1", b""],
        [NODE, "tcp://127.0.0.1:1\n", b""],
        [NODE, "tcp://" + "a" * 251, b""],
        [NODE, ENDPOINT, b"r" * 33],
        [NODE, ENDPOINT, "realm"],
    ],
)
def test_bad_body(body: object) -> None:
    assert outcome(datagram(body)) == "bad_body"


def test_trailing_bytes_after_body() -> None:
    assert outcome(encode_question(node_id=NODE, endpoint=ENDPOINT) + b"\x00") == "bad_body"


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
