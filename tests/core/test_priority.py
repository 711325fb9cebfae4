"""Priorities: the member's queue serves the higher class first without starving the lower,
and outboxes send the higher class first; the wire carries it to members that read it."""

from __future__ import annotations

from random import Random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from memnet import MemNet, MemNode, hold, mesh

from irismesh._core.admission import SHARE_EVERY, Admission
from irismesh._core.events import Event, ReplyArrived, RequestArrived, RequestCancelled
from irismesh._core.frames import HEADER_SIZE, Kind, decode_header
from irismesh._core.priority import MAX_PRIORITY, MIN_PRIORITY, Priority, check_priority
from irismesh._core.throttle import Throttle
from irismesh._core.throttle import key as throttle_key
from irismesh._driver import urgent_first
from irismesh.errors import ConfigurationError

FOREVER = 1e9

# ---------------------------------------------------------------------- the levels


def test_the_named_levels_and_the_range() -> None:
    assert (Priority.LOW, Priority.NORMAL, Priority.HIGH) == (-1, 0, 1)
    assert check_priority(Priority.HIGH) == 1
    assert check_priority(MIN_PRIORITY) == MIN_PRIORITY
    assert check_priority(MAX_PRIORITY) == MAX_PRIORITY
    for bad in (MAX_PRIORITY + 1, MIN_PRIORITY - 1):
        with pytest.raises(ConfigurationError, match="priority must be from"):
            check_priority(bad)
    for wrong in ("high", 1.0, True, None):
        with pytest.raises(ConfigurationError, match="priority must be an int"):
            check_priority(wrong)


# ---------------------------------------------------------------------- the member's queue


def busy(limit: int = 1) -> Admission[str]:
    """An admission whose limit is full, with a measured service time and a queue that
    never counts as standing (first in, first out within a class)."""
    admission: Admission[str] = Admission(initial_limit=limit, max_limit=limit, standing=FOREVER)
    for _ in range(5):
        admission.started()
        admission.finished(0.001)
    for _ in range(limit):
        admission.started()
    return admission


def take_one(admission: Admission[str], now: float = 0.0) -> str | None:
    shed: list[tuple[str, str]] = []
    admission.finished(0.001)
    item = admission.take(now, shed)
    assert shed == []
    admission.started()
    return item


def test_the_higher_class_is_served_first_each_class_in_order() -> None:
    admission = busy()
    shed: list[tuple[str, str]] = []
    for name, priority in [("n1", 0), ("l1", -1), ("h1", 1), ("n2", 0), ("h2", 1), ("l2", -1)]:
        assert admission.offer(name, FOREVER, 0.0, shed, priority) == "queued"
    assert [take_one(admission) for _ in range(6)] == ["h1", "h2", "n1", "n2", "l1", "l2"]


def test_the_lower_class_keeps_one_start_in_share_every() -> None:
    admission = busy()
    shed: list[tuple[str, str]] = []
    admission.offer("low", FOREVER, 0.0, shed, Priority.LOW)
    for i in range(3 * SHARE_EVERY):
        admission.offer(f"h{i}", FOREVER, 0.0, shed, Priority.HIGH)
    taken = [take_one(admission) for _ in range(SHARE_EVERY)]
    assert taken == [f"h{i}" for i in range(SHARE_EVERY - 1)] + ["low"]


def test_the_share_goes_to_the_lower_class_that_waited_longest_even_on_one_clock_reading() -> None:
    admission = busy()
    shed: list[tuple[str, str]] = []
    admission.offer("lowest", FOREVER, 0.0, shed, -2)  # all at the same clock reading
    for i in range(SHARE_EVERY):
        admission.offer(f"h{i}", FOREVER, 0.0, shed, 0)
    admission.offer("low", FOREVER, 0.0, shed, -1)
    taken = [take_one(admission) for _ in range(SHARE_EVERY)]
    assert taken[-1] == "lowest"


def test_a_flood_of_low_priority_work_does_not_get_a_high_one_turned_away() -> None:
    admission = busy()
    shed: list[tuple[str, str]] = []
    admission.service = 0.010
    # 0.5 s budgets: 40 low requests ahead (0.4 s of work) leave room for no more of them.
    verdicts = [admission.offer(f"l{i}", 0.5, 0.0, shed, Priority.LOW) for i in range(60)]
    assert verdicts.count("queue") > 0
    assert admission.offer("high", 0.1, 0.0, shed, Priority.HIGH) == "queued"
    assert take_one(admission, 0.01) == "high"


def test_a_full_queue_sheds_the_lowest_class_first_and_never_for_a_lower_newcomer() -> None:
    admission: Admission[str] = Admission(initial_limit=1, max_limit=1, max_queue=3)
    admission.started()
    shed: list[tuple[str, str]] = []
    admission.offer("normal", 5.0, 0.0, shed, 0)
    admission.offer("low-old", 5.0, 0.0, shed, -1)
    admission.offer("low-new", 5.0, 0.1, shed, -1)
    assert admission.offer("high", 5.0, 0.2, shed, 1) == "queued"
    assert shed == [("low-old", "queue")]
    assert admission.offer("lower", 5.0, 0.3, shed, -2) == "queue"
    assert admission.offer("low-again", 5.0, 0.3, shed, -1) == "queue"  # not above low-new
    assert [w.item for w in admission.queue] == ["high", "normal", "low-new"]


def test_cancelling_and_expiring_keep_the_classes_consistent() -> None:
    admission = busy()
    shed: list[tuple[str, str]] = []
    admission.offer("h", 1.0, 0.0, shed, 1)
    admission.offer("l", 0.05, 0.0, shed, -1)
    admission.offer("n", 1.0, 0.0, shed, 0)
    assert admission.remove("h")
    admission.expire(0.1, shed)
    assert shed == [("l", "deadline")]
    assert admission.waiting == 1
    assert admission.levels == [0]
    assert take_one(admission, 0.1) == "n"
    assert admission.waiting == 0
    assert admission.levels == []


priorities = st.integers(MIN_PRIORITY, MAX_PRIORITY)
steps = st.lists(st.one_of(st.tuples(st.just("offer"), priorities), st.just("take")), max_size=300)


@settings(max_examples=600, deadline=None)
@given(steps)
@example(  # the highest class empties and the next becomes highest: its oldest comes first
    [
        *[("offer", -1), ("offer", 0), ("offer", 0), ("offer", 0), "take", ("offer", 0)],
        *[("offer", -2), "take", ("offer", 0), "take", "take", ("offer", 0), "take"],
        *[("offer", 0), "take", "take", "take"],
    ]
)
def test_no_class_starves_and_the_higher_class_goes_first(ops: list[object]) -> None:
    """Whatever arrives, in whatever order: (1) a waiting request starts within SHARE_EVERY
    starts per request that waited when it came (plus one), so it never starves however much
    more important work keeps coming; (2) a start that skips a waiting higher class (the
    lower share) comes at most once in SHARE_EVERY starts; (3) within a class, first in, first
    out; and nothing is lost or started twice."""
    admission = busy()
    shed: list[tuple[str, str]] = []
    waiting: dict[str, tuple[int, int, int]] = {}  # item -> (priority, arrival n, bound)
    order: dict[int, list[str]] = {}
    starts, last_skip, n = 0, -SHARE_EVERY, 0
    started: set[str] = set()
    for op in ops:
        if op == "take":
            higher = max((p for p, _, _ in waiting.values()), default=None)
            item = take_one(admission)
            if item is None:
                assert not waiting
                continue
            starts += 1
            priority, _n, _bound = waiting.pop(item)
            assert item not in started
            started.add(item)
            assert order[priority].pop(0) == item  # first in, first out within its class
            if higher is not None and priority < higher:
                assert starts - last_skip >= SHARE_EVERY
                last_skip = starts
            for other, (_p, _n, bound) in waiting.items():
                assert starts < bound, f"{other} starved"
        else:
            assert isinstance(op, tuple)
            priority = op[1]
            n += 1
            item = f"r{n}"
            assert admission.offer(item, FOREVER, 0.0, shed, priority) == "queued"
            waiting[item] = (priority, n, starts + SHARE_EVERY * len(waiting) + SHARE_EVERY)
            order.setdefault(priority, []).append(item)
    assert shed == []
    assert admission.waiting == len(waiting)
    assert sorted(w.item for w in admission.queue) == sorted(waiting)


# ---------------------------------------------------------------------- the driver


def test_the_driver_hands_urgent_requests_to_the_handlers_first() -> None:
    def arrived(name: str, priority: int) -> RequestArrived:
        return RequestArrived((b"p", len(name), b"r", 1), "db", name.encode(), priority=priority)

    cancel = RequestCancelled((b"p", 9, b"r", 1))
    reply = ReplyArrived(1, 0, b"", b"x")
    events: list[Event] = [
        arrived("n", 0),
        cancel,
        arrived("h", 1),
        reply,
        arrived("l", -1),
        arrived("top", 7),
        arrived("h2", 1),
    ]
    names = [
        e.payload.decode() if isinstance(e, RequestArrived) else type(e).__name__
        for e in urgent_first(events)
    ]
    assert names == ["top", "h", "h2", "n", "RequestCancelled", "ReplyArrived", "l"]
    plain: list[Event] = [arrived("a", 0), arrived("b", -1)]
    assert urgent_first(plain) is plain


# ---------------------------------------------------------------------- outboxes and the wire


def batched(net: MemNet) -> tuple[MemNode, MemNode]:
    nodes = mesh(net, {"member": ["db"]}, handler=hold)
    client, member = nodes["client"], nodes["member"]
    client.core.batching = member.core.batching = True
    return client, member


def frame_kinds(node: MemNode) -> list[int]:
    return [decode_header(f, node.core.config.max_frame)[0] for _l, f in node.core.out_frames]


def test_a_flush_sends_the_higher_class_first_and_the_member_reads_each_priority() -> None:
    net = MemNet(seed=11)
    client, member = batched(net)
    assert client.core.members("db")[0].priorities  # the member's WELCOME said it reads them
    plan = [(b"n1", 0), (b"l1", -1), (b"n2", 0), (b"h1", 1), (b"top", 7), (b"h2", 1)]
    ids = {client.core.request("db", p, 2.0, net.now, priority=prio): p for p, prio in plan}
    client.core.seal_staged()
    # One frame per class, highest first: top, the two highs (a batch), the normals, the low.
    assert frame_kinds(client) == [Kind.REQUEST, Kind.BATCH, Kind.BATCH, Kind.REQUEST]
    seqs = [int.from_bytes(f[6:HEADER_SIZE], "big") for _l, f in client.core.out_frames]
    assert seqs == sorted(seqs)
    net.collect(client)
    net.run(net.now)
    got = [(e.payload, e.priority) for e in member.arrived]
    assert got == [(b"top", 7), (b"h1", 1), (b"h2", 1), (b"n1", 0), (b"n2", 0), (b"l1", -1)]
    assert member.core.stats["requests_arrived_high"] == 2
    # The member answers in the worst order; its outbox sends the replies by class.
    for token in reversed(member.held):
        member.core.reply(token, b"re")
    member.core.seal_staged()
    net.collect(member)
    net.run(net.now)
    answered = [ids[e.req_id] for e in client.events(ReplyArrived)]
    assert answered == [b"top", b"h2", b"h1", b"n2", b"n1", b"l1"]  # in order within a class


def test_a_member_that_does_not_read_priorities_gets_the_default() -> None:
    net = MemNet(seed=12)
    client, member = batched(net)
    link = client.core.members("db")[0]
    link.priorities = False  # as a member from before priorities: its WELCOME said nothing
    client.core.request("db", b"h", 2.0, net.now, priority=Priority.HIGH)
    client.core.seal_staged()
    net.collect(client)
    net.run(net.now)
    assert [(e.payload, e.priority) for e in member.arrived] == [(b"h", 0)]
    assert member.core.stats["dropped_bad_envelope"] == 0


def test_a_caller_throttles_each_priority_of_a_cluster_on_its_own() -> None:
    throttle = Throttle()
    rng = Random(1)
    low, high = throttle_key("db", Priority.LOW), throttle_key("db", Priority.HIGH)
    assert throttle_key("db", 0) == "db"
    for i in range(200):  # the member turns the low ones away and answers the high ones
        throttle.refused(low, i * 0.001)
        throttle.accepted(high, i * 0.001)
    assert throttle.probability(low) > 0.9
    assert throttle.probability(high) == 0.0
    assert throttle.probability("db") == 0.0
    assert all(throttle.admit(high, 0.2, rng) for _ in range(100))
