"""The inter-mesh link protocol, two ends wired together in memory (no sockets, no clock)."""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh.errors import ConfigurationError, ProtocolError
from irismesh.federation.crossing import MAX_SEEN, RESENT, Barrier, Crossing, OriginIds
from irismesh.federation.linkproto import Exports, LinkConfig, LinkEnd, open_hello

KEY = os.urandom(32)


def ends(config: LinkConfig | None = None, *, dialler_key: bytes = KEY) -> tuple[LinkEnd, LinkEnd]:
    cfg = config or LinkConfig()
    dialler = LinkEnd(
        gateway_id=os.urandom(16),
        mesh="b",
        secrets=(dialler_key,),
        exports=Exports(),
        dialler=True,
        config=cfg,
    )
    listener = LinkEnd(
        gateway_id=os.urandom(16),
        mesh="a",
        secrets=(KEY,),
        exports=Exports(clusters=("db",), topics=("feeds.#",)),
        dialler=False,
        config=cfg,
    )
    return dialler, listener


def connect(dialler: LinkEnd, listener: LinkEnd, now: float) -> None:
    [hello] = dialler.outgoing(now)
    welcome = listener.accept(open_hello(hello, listener.secrets), now)
    assert dialler.receive(welcome, now) == []
    assert dialler.up
    assert listener.up


def pump(src: LinkEnd, dst: LinkEnd, now: float, *, lose: set[int] = frozenset()) -> list[list]:  # type: ignore[assignment]
    """Move every frame `src` has for `dst` (dropping the ones numbered in `lose`)."""
    got: list[list] = []  # type: ignore[type-arg]
    for n, frame in enumerate(src.outgoing(now)):
        if n not in lose:
            got.extend(dst.receive(frame, now))
    return got


def test_handshake_learns_the_peer_and_its_exports() -> None:
    d, lst = ends()
    connect(d, lst, 0.0)
    assert d.peer_mesh == "a"
    assert lst.peer_mesh == "b"
    assert d.peer_exports.clusters == ("db",)
    assert d.peer_exports.topics == ("feeds.#",)
    assert d.peer_id == lst.gateway_id


def test_wrong_link_key_is_refused() -> None:
    d, lst = ends(dialler_key=os.urandom(32))
    [hello] = d.outgoing(0.0)
    with pytest.raises(ProtocolError) as caught:
        open_hello(hello, lst.secrets)
    assert caught.value.reason == "bad_proof"


def test_a_rotated_key_is_accepted_when_either_end_holds_it() -> None:
    old = os.urandom(32)
    d, lst = ends(dialler_key=old)
    lst.secrets = (KEY, old)
    connect(d, lst, 0.0)
    assert d.up
    assert lst.up


def test_items_arrive_in_order_and_acks_free_the_buffer() -> None:
    d, lst = ends()
    connect(d, lst, 0.0)
    for i in range(2000):
        assert lst.send(["pub", i])
    got = pump(lst, d, 0.1)
    assert [item[1] for item in got] == list(range(2000))
    assert lst.buffered == 2000
    pump(d, lst, 0.2)  # the ack
    assert lst.buffered == 0


def test_a_replayed_frame_is_dropped_and_counted() -> None:
    d, lst = ends()
    connect(d, lst, 0.0)
    lst.send(["pub", 1])
    [frame] = lst.outgoing(0.1)
    assert d.receive(frame, 0.1) == [["pub", 1]]
    with pytest.raises(ProtocolError):
        d.receive(frame, 0.2)
    assert d.stats["dropped_replay"] == 1


def test_a_tampered_frame_is_dropped_and_counted() -> None:
    d, lst = ends()
    connect(d, lst, 0.0)
    lst.send(["pub", 1])
    [frame] = lst.outgoing(0.1)
    bad = frame[:-1] + bytes([frame[-1] ^ 1])
    with pytest.raises(ProtocolError):
        d.receive(bad, 0.1)
    assert d.stats["dropped_bad_seal"] == 1


def test_lost_frames_are_sent_again_in_order() -> None:
    cfg = LinkConfig(resend_after=0.5)
    d, lst = ends(cfg)
    connect(d, lst, 0.0)
    for i in range(1500):  # three frames of 512 items
        lst.send(["pub", i])
    got = pump(lst, d, 0.1, lose={1})
    assert [item[1] for item in got] == list(range(512))
    pump(d, lst, 0.1)
    got += pump(lst, d, 0.7)  # acks stalled: back to the oldest
    assert [item[1] for item in got] == list(range(1500))
    assert d.stats["out_of_order"] > 0


def test_an_outage_buffers_to_the_bound_then_counts_drops_and_replays_in_order() -> None:
    cfg = LinkConfig(buffer=100, heartbeat=0.25, dead_after=1.0)
    d, lst = ends(cfg)
    connect(d, lst, 0.0)
    lst.send(["pub", -1])
    pump(lst, d, 0.0)
    pump(d, lst, 0.0)
    assert lst.tick(5.0)  # nothing heard: down
    assert d.tick(5.0)
    sent = [i for i in range(150) if lst.send(["pub", i])]
    assert sent == list(range(100))
    assert lst.stats["dropped_buffer_full"] == 50
    assert lst.outgoing(5.1) == []  # a listener waits for the dialler's HELLO
    connect(d, lst, 10.0)
    got = pump(lst, d, 10.1)
    assert [item[1] for item in got] == list(range(100))
    assert d.stats["duplicates"] == 0


def test_a_session_lost_mid_flight_replays_only_what_was_not_acknowledged() -> None:
    d, lst = ends()
    connect(d, lst, 0.0)
    for i in range(10):
        lst.send(["pub", i])
    pump(lst, d, 0.1)
    pump(d, lst, 0.1)  # acked 0..9
    for i in range(10, 20):
        lst.send(["pub", i])
    lst.outgoing(0.2)  # sent, but lost with the connection
    d.down()
    lst.down()
    connect(d, lst, 1.0)
    got = pump(lst, d, 1.1)
    assert [item[1] for item in got] == list(range(10, 20))


def test_plain_items_are_not_kept_for_a_link_that_is_down() -> None:
    d, lst = ends()
    assert not d.send_plain(["req", 1])
    connect(d, lst, 0.0)
    assert d.send_plain(["req", 1])
    assert pump(d, lst, 0.1) == [["req", 1]]


def test_heartbeats_keep_a_quiet_link_up() -> None:
    cfg = LinkConfig(heartbeat=0.25, dead_after=1.0)
    d, lst = ends(cfg)
    connect(d, lst, 0.0)
    now = 0.0
    while now < 5.0:
        now += 0.1
        pump(d, lst, now)
        pump(lst, d, now)
        assert not d.tick(now)
        assert not lst.tick(now)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.sampled_from(["send", "flush", "lose", "ack", "outage"]), max_size=60),
)
def test_every_item_arrives_once_in_order_under_loss_and_outages(ops: list[str]) -> None:
    cfg = LinkConfig(buffer=10_000, resend_after=0.5, dead_after=1.0, heartbeat=0.25)
    d, lst = ends(cfg)
    connect(d, lst, 0.0)
    now, n, got = 0.0, 0, []
    for op in ops:
        now += 0.3
        if op == "send":
            for _ in range(7):
                lst.send(["pub", n])
                n += 1
        elif op in ("flush", "lose"):
            got += pump(lst, d, now, lose={0} if op == "lose" else set())
        elif op == "ack":
            pump(d, lst, now)
        else:
            d.down()
            lst.down()
            connect(d, lst, now)
    for _ in range(10):  # heal: everything flows
        now += 0.6
        got += pump(lst, d, now)
        pump(d, lst, now)
    assert [item[1] for item in got] == list(range(n))
    assert lst.buffered == 0


def test_origin_ids_agree_between_gateways_and_tell_repeats_apart() -> None:
    one, two = OriginIds(), OriginIds()
    ids = [one.origin_id("p", "t", b"x") for _ in range(3)]
    assert len(set(ids)) == 3
    assert [two.origin_id("p", "t", b"x") for _ in range(3)] == ids
    assert one.origin_id("q", "t", b"x") not in ids
    # Gateways of different versions must agree too: the id is BLAKE2b-128 of publisher, topic
    # and payload (NUL between them), then of that and the repeat count for a repeat.
    first = hashlib.blake2b(b"p\x00t\x00x", digest_size=16).digest()
    assert ids[0] == first
    assert ids[2] == hashlib.blake2b(first + (2).to_bytes(8, "big"), digest_size=16).digest()


def test_the_barrier_lets_each_message_through_once() -> None:
    barrier = Barrier(window=4)
    c = Crossing("a", b"\x01" * 16, ("a",), "t", b"x")
    assert barrier.first(c)
    assert not barrier.first(c.through("b"))
    assert barrier.duplicates == 1


def test_the_barrier_tells_what_it_holds_without_counting() -> None:
    barrier = Barrier(window=4)
    c = Crossing("a", b"\x01" * 16, ("a",), "t", b"x")
    assert not barrier.holds("a", c.origin_id)
    barrier.first(c)
    assert barrier.holds("a", c.origin_id)
    assert not barrier.holds("b", c.origin_id)
    assert barrier.duplicates == 0


def test_a_crossing_marked_as_seen_elsewhere_keeps_its_origin_and_the_bound() -> None:
    c = Crossing("a", b"\x01" * 16, ("a", "c"), "t", b"x")
    item = c.wire(RESENT, ["b"])
    assert item[0] == RESENT
    back = Crossing.from_wire(item)
    assert back.seen == ("a", "c", "b")
    assert back.origin == "a"
    assert back.origin_id == c.origin_id
    assert c.wire()[3] == ["a", "c"]
    many = c.wire(also=[f"m{i}" for i in range(2 * MAX_SEEN)])
    assert len(many[3]) == MAX_SEEN
    assert Crossing.from_wire(many).seen[:2] == ("a", "c")


def test_new_link_keys_end_only_a_session_under_a_key_no_longer_accepted() -> None:
    d, lst = ends()
    connect(d, lst, 0.0)
    new = os.urandom(32)
    # Step 1 and 2 of a rotation: the old key still accepted, the session goes on.
    assert not d.use_secrets((KEY, new))
    assert not lst.use_secrets((new, KEY))
    assert d.up
    assert lst.up
    assert lst.secrets[0] == KEY  # a listener keeps its session's key first
    d.send(["x"])
    assert pump(d, lst, 0.1) == [["x"]]
    # Step 3: the old key removed; the session under it ends, kept items wait for the next.
    d.send(["y"])
    assert d.use_secrets((new,))
    assert lst.use_secrets((new,))
    assert not d.up
    assert d.stats["rekeyed"] == 1
    connect(d, lst, 1.0)  # HELLO again, under the new key
    assert pump(d, lst, 1.1) == [["y"]]
    with pytest.raises(ConfigurationError):
        d.use_secrets(())


def test_acknowledged_items_are_handed_over_when_asked_for() -> None:
    d, lst = ends()
    d.acked_items = []
    connect(d, lst, 0.0)
    d.send(["a", 1])
    d.send(["b", 2])
    assert pump(d, lst, 0.1) == [["a", 1], ["b", 2]]
    pump(lst, d, 0.2)
    assert d.acked_items == [["a", 1], ["b", 2]]


def test_what_the_peer_acknowledged_a_moment_ago_is_kept_to_carry_over() -> None:
    """An importing gateway acknowledges a message once its node has it; SIGKILLed a moment
    later, it may not have passed it on. So what was acknowledged within `keep_acked` is still
    handed out with the unacknowledged (`unacknowledged(now=...)`), oldest first, and after
    that only the unacknowledged are."""
    d, lst = ends(LinkConfig(keep_acked=2.0, keep_acked_items=100))
    connect(d, lst, 0.0)
    for i in range(10):
        lst.send(["pub", i])
    pump(lst, d, 0.1)
    pump(d, lst, 0.2)  # all ten acknowledged at 0.2
    for i in range(10, 13):
        lst.send(["pub", i])
    assert lst.buffered == 3
    items, next_seq = lst.unacknowledged(0, now=1.0)
    assert [item[1] for item in items] == list(range(13))
    assert next_seq == 14
    assert [item[1] for item in lst.unacknowledged(0)[0]] == [10, 11, 12]  # without `now`
    assert [item[1] for item in lst.unacknowledged(0, now=2.5)[0]] == [10, 11, 12]  # too old
    assert [item[1] for item in lst.unacknowledged(12, now=1.0)[0]] == [11, 12]  # `since`


def test_what_is_kept_after_acknowledgement_is_bounded() -> None:
    d, lst = ends(LinkConfig(keep_acked=60.0, keep_acked_items=50))
    connect(d, lst, 0.0)
    now = 0.0
    for round_ in range(40):  # 12,000 items acknowledged within the minute
        for i in range(300):
            lst.send(["pub", round_ * 300 + i])
        now += 0.1
        pump(lst, d, now)
        pump(d, lst, now)
    items, _ = lst.unacknowledged(0, now=now)
    assert 50 <= len(items) <= 50 + 4096 + 300  # trimmed down to keep_acked_items as it goes
    assert [item[1] for item in items] == list(range(12_000 - len(items), 12_000))
    assert len(lst._ack_marks) <= 41


def test_keep_acked_must_not_be_negative() -> None:
    with pytest.raises(ConfigurationError):
        LinkConfig(keep_acked=-1.0)
