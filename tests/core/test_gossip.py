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
    NullDatagramSealer,
    ReplayWindows,
    decode_compound,
    encode_compound,
    encode_message,
    encode_state,
    open_datagram,
    seal_datagram,
)
from irismesh._core.membership import Membership
from irismesh._core.records import MemberRecord
from irismesh._core.suspicion import Awareness, Suspicion, suspicion_bounds
from irismesh.errors import ProtocolError
from irismesh.security.meshkey import MeshDatagramSealer

ID_A, ID_B = b"a" * 16, b"b" * 16
MESSAGES: list[list[object]] = [
    [1, 7, ID_B],
    [2, 8, ID_B, "127.0.0.1:7001"],
    [3, 7],
    [4, 7],
    [5, ID_B, 3, "tcp://127.0.0.1:7001", "127.0.0.1:7001", b"\x01" * 16],
    [6, ID_B, 3, ID_A],
    [7, ID_B, 3, ID_A],
]


def test_every_message_round_trips_through_a_sealed_datagram() -> None:
    sealer = MeshDatagramSealer([b"k" * 32], ID_A)
    state_entry = encode_message([ID_B, 3, 1, "tcp://h:1", "h:1", b""])
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
