"""The election and standby buffers of redundant gateways, without I/O."""

from __future__ import annotations

from irismesh.federation.crossing import Crossing
from irismesh.federation.redundancy import STALE_AFTER, SUSPECT_SILENCE, Redundancy


def crossing(i: int) -> Crossing:
    return Crossing("a", i.to_bytes(16, "big"), ("a",), "feeds.x", b"%d" % i)


def pair() -> tuple[Redundancy, Redundancy]:
    first = Redundancy("01", 100.0, ["feeds.#"], bound=4)
    second = Redundancy("02", 200.0, ["feeds.#"], bound=4)
    return first, second


def test_the_gateway_that_started_first_forwards_and_the_other_stands_by() -> None:
    first, second = pair()
    first.on_message(second.state_message(["b"], ["b"]), now=1.0)
    second.on_message(first.state_message(["b"], ["b"]), now=1.0)
    assert first.elect("b", own_up=True, since=0.0, now=1.5) is True
    assert second.elect("b", own_up=True, since=0.0, now=1.5) is False
    # Its link down, the first gives way to one whose link is up.
    second.on_message(first.state_message([], ["b"]), now=2.0)
    assert second.elect("b", own_up=True, since=0.0, now=2.0) is True
    # Silent for STALE_AFTER: taken for gone.
    second.on_message(first.state_message(["b"], ["b"]), now=3.0)
    assert second.elect("b", own_up=True, since=0.0, now=3.0) is False
    assert second.elect("b", own_up=True, since=0.0, now=3.1 + STALE_AFTER) is True


def test_a_fellow_membership_holds_dead_or_suspect_and_silent_is_out_at_once() -> None:
    first, second = pair()
    second.on_message(first.state_message(["b"], ["b"]), now=1.0)
    assert second.judge("01", "alive", now=1.1) is False
    assert second.judge("01", "suspect", now=1.0 + SUSPECT_SILENCE / 2) is False  # heard lately
    assert second.elect("b", own_up=True, since=0.0, now=1.2) is False
    assert second.judge("01", "dead", now=1.2) is True  # long before STALE_AFTER
    assert second.elect("b", own_up=True, since=0.0, now=1.2) is True
    assert second.judge("01", "dead", now=1.3) is False  # not a fellow any more
    # A wrong verdict, refuted: its next state message makes it the forwarder again.
    second.on_message(first.state_message(["b"], ["b"]), now=2.0)
    assert second.elect("b", own_up=True, since=0.0, now=2.0) is False
    assert second.judge("01", "suspect", now=2.1 + SUSPECT_SILENCE) is True
    assert second.elect("b", own_up=True, since=0.0, now=2.2 + SUSPECT_SILENCE) is True
    second.on_message(first.state_message(["b"], ["b"]), now=4.0)
    assert second.judge("01", "left", now=4.0) is True
    assert second.stats["fellows_declared_dead"] == 2
    assert second.stats["fellows_suspect_and_silent"] == 1


def test_shared_meshes_are_those_fresh_fellows_with_the_same_topics_link_to() -> None:
    first, second = pair()
    other = Redundancy("03", 1.0, ["other.#"], bound=4)
    second.on_message(first.state_message(["b"], ["b", "c"]), now=1.0)  # c: its link down
    second.on_message(other.state_message(["d"], ["d"]), now=1.0)
    assert second.shared(now=1.5) == {"b", "c"}
    assert second.shared(now=1.1 + STALE_AFTER) == frozenset()


def test_undecided_while_a_fellow_has_not_told_its_links_since_this_one_came_up() -> None:
    first, second = pair()
    second.on_message(first.state_message([], []), now=1.0)  # before its link to b
    assert second.elect("b", own_up=True, since=1.0, now=1.2) is None
    second.on_message(first.state_message([], []), now=2.0)  # it has no link to b
    assert second.elect("b", own_up=True, since=1.0, now=2.0) is True


def test_other_topics_are_another_election() -> None:
    first, _ = pair()
    other = Redundancy("00", 1.0, ["other.#"], bound=4)
    first.on_message(other.state_message(["b"], ["b"]), now=1.0)
    assert first.elect("b", own_up=True, since=0.0, now=1.0) is True


def test_the_standby_keeps_what_is_not_delivered_and_resends_it_in_order() -> None:
    _, standby = pair()
    for i in range(3):
        standby.hold("b", crossing(i))
    standby.on_message(["1", "01", "b", [crossing(0).origin_id]], now=1.0)  # malformed kind
    standby.on_message([1, "01", "b", [crossing(0).origin_id, crossing(5).origin_id]], now=1.0)
    standby.hold("b", crossing(5))  # reported before it came here: not kept
    assert standby.held() == 2
    assert [c.payload for c in standby.take_over("b")] == [b"1", b"2"]
    assert standby.stats["takeover_resent"] == 2
    assert standby.stats["sync_malformed"] == 1
    assert standby.take_over("b") == []


def test_the_standby_buffer_is_bounded_and_counts_what_it_drops() -> None:
    _, standby = pair()
    for i in range(6):
        standby.hold("b", crossing(i))
    assert standby.held() == 4
    assert standby.stats["standby_dropped"] == 2
    assert [c.payload for c in standby.take_over("b")] == [b"2", b"3", b"4", b"5"]


def test_malformed_messages_are_counted() -> None:
    first, _ = pair()
    for body in ([], "x", [0, "02", "t", [], [], []], [7, "02"], [1, "02", 3, []]):
        first.on_message(body, now=1.0)
    assert first.stats["sync_malformed"] == 5
    assert first.fellows == {}


def test_a_forwarder_busy_telling_deliveries_is_not_taken_for_gone() -> None:
    """Its state messages may wait behind its acknowledgements: any message is a sign of life."""
    first, second = pair()
    second.on_message(first.state_message(["b"], ["b"]), now=1.0)
    for i in range(1, 8):  # deliveries only, for longer than STALE_AFTER
        second.on_message(first.delivered_message("b", [crossing(i).origin_id]), now=1.0 + i)
    assert second.elect("b", own_up=True, since=0.0, now=8.5) is False
    assert second.elect("b", own_up=True, since=0.0, now=8.1 + STALE_AFTER) is True


def test_messages_waiting_for_fellows_are_merged_the_state_first() -> None:
    first, _ = pair()
    ids = [crossing(i).origin_id for i in range(10)]
    waiting = [
        first.delivered_message("b", ids[:3]),
        first.state_message([], ["b"]),
        first.delivered_message("c", ids[3:4]),
        first.delivered_message("b", ids[4:9]),
        first.state_message(["b"], ["b"]),
    ]
    assert (
        Redundancy.merged(waiting, most=4)
        == [
            first.state_message(["b"], ["b"]),  # the newest state stands for both
            first.delivered_message("b", ids[0:3] + ids[4:5]),
            first.delivered_message("b", ids[5:9]),
            first.delivered_message("c", ids[3:4]),
        ]
    )
    assert Redundancy.merged([], most=4) == []
    # What the merged messages say is what the waiting ones said.
    second = Redundancy("02", 200.0, ["feeds.#"], bound=16)
    for i in range(10):
        second.hold("b", crossing(i))
    for body in Redundancy.merged(waiting, most=4):
        second.on_message(body, now=1.0)
    assert [c.origin_id for c in second.take_over("b")] == [ids[3], ids[9]]  # 3 went to c
