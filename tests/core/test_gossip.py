"""The pieces under SWIM: the datagram codec (hostile input included), the replay window,
the dissemination queue and Lifeguard's suspicion timer."""

from __future__ import annotations

import contextlib
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh._core.broadcasts import TransmitQueue, transmit_limit
from irismesh._core.gossip import (
    HEADER,
    MAX_NAME,
    NAME_MAGIC,
    VERSION,
    NullDatagramSealer,
    ReplayWindows,
    decode_compound,
    encode_compound,
    encode_message,
    encode_state,
    is_name,
    open_datagram,
    open_name,
    seal_datagram,
    seal_name,
)
from irismesh._core.membership import Membership
from irismesh._core.records import MemberRecord, validate_name
from irismesh._core.suspicion import Awareness, Suspicion, suspicion_bounds
from irismesh.errors import ConfigurationError, ProtocolError
from irismesh.security.meshkey import MeshDatagramSealer

ID_A, ID_B = b"a" * 16, b"b" * 16
MESSAGES: list[list[object]] = [
    [1, 7, ID_B],
    [2, 8, ID_B, "127.0.0.1:7001"],
    [3, 7],
    [4, 7],
    [5, ID_B, 3, "tcp://127.0.0.1:7001", "127.0.0.1:7001", b"\x01" * 16, "w2", b"", b""],
    [6, ID_B, 3, ID_A],
    [7, ID_B, 3, ID_A],
]


def test_every_message_round_trips_through_a_sealed_datagram() -> None:
    sealer = MeshDatagramSealer([b"k" * 32], ID_A)
    state_entry = encode_message([ID_B, 3, 1, "tcp://h:1", "h:1", b"", "bée-2", b"", b""])
    packed = [encode_message(m) for m in MESSAGES] + [encode_state(True, [state_entry] * 20)]
    datagram = seal_datagram(sealer, ID_A, 5, encode_compound(packed))
    opener = MeshDatagramSealer([b"k" * 32], ID_B)
    sender, counter, messages = open_datagram(opener, datagram, 65507)
    assert (sender, counter) == (ID_A, 5)
    assert messages[: len(MESSAGES)] == MESSAGES
    assert messages[-1][:2] == [8, True]
    assert len(messages[-1][2]) == 20


def test_a_datagram_opens_only_under_the_mesh_key_and_its_senders_id() -> None:
    sealer = MeshDatagramSealer([b"k" * 32], ID_A)
    datagram = seal_datagram(sealer, ID_A, 1, encode_compound([encode_message([3, 1])]))
    with pytest.raises(ProtocolError, match="bad_seal"):
        open_datagram(MeshDatagramSealer([b"x" * 32], ID_B), datagram, 65507)
    claimed = datagram[:2] + ID_B + datagram[18:]  # the same bytes, claiming another sender
    with pytest.raises(ProtocolError, match="bad_seal"):
        open_datagram(MeshDatagramSealer([b"k" * 32], ID_B), claimed, 65507)
    rotated = MeshDatagramSealer([b"n" * 32, b"k" * 32], ID_B)  # new key first, old accepted
    assert open_datagram(rotated, datagram, 65507)[2] == [[3, 1]]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bodies_raise_only_protocol_errors(body: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_compound(body)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_messages_are_rejected_or_well_formed(data: st.DataObject) -> None:
    message = list(data.draw(st.sampled_from(MESSAGES)))
    at = data.draw(st.integers(0, len(message) - 1))
    message[at] = data.draw(
        st.one_of(
            st.none(),
            st.integers(-(2**63), 2**64 - 1),
            st.binary(max_size=40),
            st.text(max_size=40),
        )
    )
    try:
        [checked] = decode_compound(encode_compound([encode_message(message)]))
    except ProtocolError:
        return
    assert checked == message  # what passes has exactly a valid shape


NAMES_OK = ["", "w1", "db-7.eu", "bée", "東京-1", "x" * MAX_NAME, "a/b:c@d"]
NAMES_BAD = ["w 1", "tab\there", "line\n", "\x1b[31mred", "nbsp\xa0", "zw\u200bsp", "x" * 65]


def test_names_are_short_printable_and_without_whitespace() -> None:
    assert all(is_name(name) for name in NAMES_OK)
    assert not any(is_name(name) for name in NAMES_BAD)
    assert not is_name(b"w1")
    assert not is_name(None)
    assert validate_name("w1") == "w1"
    for bad in ["", *NAMES_BAD, b"w1", None]:
        with pytest.raises(ConfigurationError, match="bad node name"):
            validate_name(bad)


@pytest.mark.parametrize("bad", [*NAMES_BAD, b"w1", None, 7])
def test_a_datagram_with_a_bad_name_is_dropped_whole_and_counted(bad: object) -> None:
    me = MemberRecord(ID_A, "tcp://127.0.0.1:1", "127.0.0.1:1", name="a")
    stats: Counter[str] = Counter()
    membership = Membership(me, sealer=NullDatagramSealer(), rng=random.Random(1), stats=stats)
    good = [5, ID_B, 3, "tcp://127.0.0.1:7001", "127.0.0.1:7001", b"", "w2", b"", b""]
    third = [5, b"c" * 16, 1, "tcp://127.0.0.1:7002", "127.0.0.1:7002", b"", "w3", b"", b""]
    alive = [*good[:6], bad, b"", b""]
    entry = [b"c" * 16, 1, 0, "tcp://127.0.0.1:7002", "127.0.0.1:7002", b"", bad, b"", b""]
    compounds = [[third, alive], [third, [8, False, [[*good[1:2], 3, 0, *good[3:]], entry]]]]
    for counter, messages in enumerate(compounds, start=1):
        body = encode_compound([encode_message(m) for m in messages])
        membership.receive(
            "127.0.0.1:9", seal_datagram(NullDatagramSealer(), ID_B, counter, body), 0.0
        )
    # A text that is not a name: `bad_name`; another type: the record's shape is wrong.
    reason = "bad_name" if isinstance(bad, str) else "bad_envelope"
    assert stats["dropped_" + reason] == 2
    assert stats["datagrams_received"] == 0
    assert list(membership.members()) == []  # nothing of either datagram was believed
    membership.receive(
        "127.0.0.1:9",
        seal_datagram(NullDatagramSealer(), ID_B, 3, encode_compound([encode_message(good)])),
        0.0,
    )
    [member] = membership.members()
    assert member.record.name == "w2"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_text_in_a_name_field_is_a_name_or_bad_name(name: str) -> None:
    message = [*MESSAGES[4][:6], name, b"", b""]
    state = [8, False, [[ID_B, 3, 1, "tcp://h:1", "h:1", b"", name, b"", b""]]]
    for checked in (message, state):
        packed = encode_compound([encode_message(checked)])
        if is_name(name):
            assert decode_compound(packed) == [checked]
        else:
            with pytest.raises(ProtocolError, match="bad_name"):
                decode_compound(packed)


def test_a_sealed_name_opens_only_as_its_senders_name() -> None:
    sealer = MeshDatagramSealer([b"k" * 32], ID_A)
    sealed = seal_name(sealer, ID_A, 9, "bée-1")
    assert b"b\xc3\xa9e-1" not in sealed
    opener = MeshDatagramSealer([b"k" * 32], ID_B)
    assert open_name(opener, ID_A, sealed) == "bée-1"
    with pytest.raises(ProtocolError, match="bad_seal"):
        open_name(opener, ID_B, sealed)  # claimed by another node
    with pytest.raises(ProtocolError, match="bad_seal"):
        open_name(MeshDatagramSealer([b"x" * 32], ID_B), ID_A, sealed)
    # A sealed name is never a datagram: its header differs, so the seal fails as one.
    as_datagram = HEADER.pack(0x53, VERSION, ID_A, 9) + sealed[8:]
    with pytest.raises(ProtocolError, match="bad_seal"):
        open_datagram(opener, as_datagram, 65507)
    null = NullDatagramSealer()
    raw = HEADER.pack(NAME_MAGIC, VERSION, ID_A, 1)[18:]
    for body, reason in [(b"\xff\xfe", "bad_name"), (b"w 1", "bad_name"), (b"w1", None)]:
        if reason is None:
            assert open_name(null, ID_A, raw + body) == "w1"
        else:
            with pytest.raises(ProtocolError, match=reason):
                open_name(null, ID_A, raw + body)
    for junk in (None, "w1", b"short", bytes(1000)):
        with pytest.raises(ProtocolError, match="bad_name"):
            open_name(null, ID_A, junk)


def test_a_member_counts_hostile_datagrams_and_stays_well() -> None:
    me = MemberRecord(ID_A, "tcp://127.0.0.1:1", "127.0.0.1:1")
    stats: Counter[str] = Counter()
    membership = Membership(me, sealer=NullDatagramSealer(), rng=random.Random(1), stats=stats)
    rng = random.Random(2)
    good = seal_datagram(
        NullDatagramSealer(), ID_B, 1, encode_compound([encode_message(m) for m in MESSAGES])
    )
    for i in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        membership.receive("127.0.0.1:9", bytes(data[: rng.randint(0, len(data))]), float(i))
        membership.tick(float(i))
    # Every datagram is either dropped whole (and counted) or taken; messages inside a taken
    # one may still be dropped one by one.
    per_message = {"dropped_misdirected_ping", "dropped_relay_overflow"}
    dropped = sum(n for name, n in stats.items() if name.startswith("dropped_"))
    whole = dropped - sum(stats[name] for name in per_message)
    assert whole + stats["datagrams_received"] == 2000
    assert whole > 1000


@given(st.lists(st.integers(1, 3000), max_size=300))
def test_each_counter_is_fresh_at_most_once(counters: list[int]) -> None:
    windows = ReplayWindows(8)
    accepted = [c for c in counters if windows.fresh(ID_A, c)]
    assert len(accepted) == len(set(accepted))
    highest = 0
    for counter in accepted:  # nothing older than the window is ever taken
        assert counter > highest - 1024
        highest = max(highest, counter)


def test_the_replay_window_takes_reordered_counters_once() -> None:
    windows = ReplayWindows(8)
    counters = (5, 3, 4, 3, 5, 1030, 6, 7, 1029)  # 6 is past the 1024-wide window, 7 is not
    fresh = [True, True, True, False, False, True, False, True, True]
    assert [windows.fresh(ID_A, c) for c in counters] == fresh


def test_the_queue_sends_fresh_updates_first_and_each_a_limited_number_of_times() -> None:
    queue = TransmitQueue()
    queue.queue(ID_A, b"a" * 10)
    assert queue.take(1000, limit=2) == [b"a" * 10]
    queue.queue(ID_B, b"b" * 10)
    assert queue.take(1000, limit=2) == [b"b" * 10, b"a" * 10]  # fewest transmissions first
    assert queue.take(1000, limit=2) == [b"b" * 10]  # a's two transmissions are done
    assert queue.take(1000, limit=2) == []
    assert len(queue) == 0


def test_a_newer_update_replaces_the_older_and_the_queue_is_bounded() -> None:
    queue = TransmitQueue(capacity=3)
    queue.queue(ID_A, b"old")
    queue.queue(ID_A, b"new")
    assert queue.take(1000, limit=5) == [b"new"]
    for i in range(5):
        queue.queue(bytes([i]) * 16, b"x%d" % i)
    assert len(queue) == 3
    assert queue.dropped == 3  # the most sent first, then the oldest
    assert queue.take(5, limit=5) == [b"x2"]  # within the budget: 4 bytes with overhead


def test_transmit_limit_grows_like_log_n() -> None:
    assert [transmit_limit(4, n) for n in (1, 9, 10, 99, 100, 9999)] == [4, 4, 8, 8, 12, 16]


def test_suspicion_shrinks_with_independent_confirmations_to_its_minimum() -> None:
    minimum, maximum = suspicion_bounds(3.0, 2.5, 100, 0.2)
    assert minimum == pytest.approx(1.2)
    assert maximum == pytest.approx(3.0)
    suspicion = Suspicion(
        incarnation=0, start=10.0, minimum=minimum, maximum=maximum, expected=3, first=ID_A
    )
    deadlines = [suspicion.deadline]
    assert not suspicion.confirm(ID_A)  # the first suspecter again: not independent
    for by in (b"1" * 16, b"2" * 16, b"3" * 16, b"4" * 16):
        suspicion.confirm(by)
        deadlines.append(suspicion.deadline)
    assert deadlines[0] == pytest.approx(13.0)
    assert deadlines == sorted(deadlines, reverse=True)
    assert deadlines[3] == deadlines[4] == pytest.approx(11.2)  # at the minimum after three


def test_awareness_scales_timeouts_within_its_limit() -> None:
    awareness = Awareness(limit=4)
    awareness.apply(10)
    assert awareness.scale(0.2) == pytest.approx(0.8)
    awareness.apply(-10)
    assert awareness.scale(0.2) == pytest.approx(0.2)
