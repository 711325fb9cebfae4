"""Publish/subscribe in the core: interest, credit, ordering, keys, over cores wired in memory."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memnet import MemNet, MemNode

from irismesh._core.config import CoreConfig
from irismesh._core.events import CreditArrived, MessagesArrived
from irismesh._core.frames import Kind
from irismesh.errors import NoKey, PayloadTooLarge, ProtocolError
from irismesh.security.keyring import Keyring

WINDOW = 8
CONFIG = CoreConfig(pubsub_window=WINDOW)


def pair(net: MemNet) -> tuple[MemNode, MemNode]:
    """Two nodes linked both ways (each joined through the other): what each publishes goes
    out on its own link at once, with no wait for membership to spread the interest."""
    pub = net.add("pub")
    sub = net.add("sub", seeds=[pub])
    pub.core.add_candidate(sub.endpoint, net.now, seed=True)
    net.advance(0.5)
    return pub, sub


def deliver(net: MemNet) -> None:
    """Everything sent so far arrives (the clock moves past the network's largest delay)."""
    net.settle()
    net.run(net.now + net.max_delay)


def subscribe(net: MemNet, node: MemNode, pattern: str) -> None:
    node.core.subscribe(pattern)
    net.collect(node)
    deliver(net)


def linked_for(net: MemNet, publisher: MemNode, topic: str) -> None:
    """Membership spreads the subscribers' interest; the publisher links to them."""
    net.advance(0.6)
    publisher.core.subscribers(topic)
    net.collect(publisher)
    net.advance(0.3)


def publish(net: MemNet, node: MemNode, topic: str, payload: bytes = b"x") -> int:
    sent = node.core.publish(topic, payload)
    net.collect(node)
    net.settle()
    return sent


class Arrived(NamedTuple):
    """One message of a MessagesArrived event."""

    routing_id: bytes
    topic: str
    payload: bytes
    publisher: bytes
    gap: int


def messages(node: MemNode) -> list[Arrived]:
    return [
        Arrived(event.routing_id, topic, payload, event.publisher, (event.gaps or {}).get(i, 0))
        for event in node.events(MessagesArrived)
        for i, (topic, payload) in enumerate(event.messages)
    ]


def test_interest_travels_and_only_matching_topics_are_sent() -> None:
    net = MemNet(seed=1)
    pub, sub = pair(net)
    subscribe(net, sub, "feeds.*.breaking")
    assert pub.core.subscribers("feeds.world.breaking") == [sub.node_id]
    assert publish(net, pub, "feeds.world.breaking", b"one") == 1
    assert publish(net, pub, "feeds.world.sports") == 0  # nobody wants it: nothing is sent
    assert publish(net, pub, "other") == 0
    [msg] = messages(sub)
    assert (msg.topic, msg.payload, msg.publisher, msg.gap) == (
        "feeds.world.breaking",
        b"one",
        pub.node_id,
        0,
    )
    assert len(net.kinds_delivered(Kind.PUBLISH)) == 1


def test_a_pattern_subscribed_before_the_link_exists_is_announced_on_connect() -> None:
    net = MemNet(seed=2)
    sub = net.add("sub")
    sub.core.subscribe("a.#")
    pub = net.add("pub", seeds=[sub])
    net.advance(0.5)
    assert pub.core.subscribers("a.b.c") == [sub.node_id]


def test_unsubscribing_the_last_subscription_withdraws_the_interest() -> None:
    net = MemNet(seed=3)
    pub, sub = pair(net)
    subscribe(net, sub, "a.#")
    subscribe(net, sub, "a.#")  # two local subscriptions, one pattern
    sub.core.unsubscribe("a.#")
    net.collect(sub)
    net.settle()
    assert pub.core.subscribers("a.b") == [sub.node_id]
    sub.core.unsubscribe("a.#")
    net.collect(sub)
    net.settle()
    assert pub.core.subscribers("a.b") == []
    assert publish(net, pub, "a.b") == 0


def test_a_publisher_never_exceeds_the_window_and_resumes_on_credit() -> None:
    net = MemNet(seed=4, config=CONFIG)
    pub, sub = pair(net)
    subscribe(net, sub, "t")
    for _ in range(WINDOW):
        assert publish(net, pub, "t") == 1
    assert publish(net, pub, "t") == -1  # no credit: nothing sent, publish_blocked set
    assert pub.core.publish_blocked
    assert pub.core.blocked_subscribers("t") == [sub.node_id]
    assert len(messages(sub)) == WINDOW
    routing_id = messages(sub)[0].routing_id
    assert not sub.core.release(routing_id, WINDOW // 4 - 1)  # below a quarter: held back
    assert sub.core.release(routing_id, 1)
    net.collect(sub)
    net.settle()
    assert pub.events(CreditArrived)
    for _ in range(WINDOW // 4):
        assert publish(net, pub, "t") == 1
    assert publish(net, pub, "t") == -1


def test_a_subscriber_that_leaves_unblocks_the_publisher() -> None:
    net = MemNet(seed=5, config=CONFIG)
    pub, sub = pair(net)
    subscribe(net, sub, "t")
    for _ in range(WINDOW):
        publish(net, pub, "t")
    assert publish(net, pub, "t") == -1
    sub.core.close()
    net.collect(sub)
    net.settle()
    assert pub.events(CreditArrived)
    assert publish(net, pub, "t") == 0


def test_messages_arrive_in_publish_order_across_topics() -> None:
    net = MemNet(seed=6, max_delay=0.01)
    pub, sub = pair(net)
    subscribe(net, sub, "#")
    topics = [f"t.{i % 7}" for i in range(200)]
    for i, topic in enumerate(topics):
        pub.core.publish(topic, b"%d" % i)
        net.collect(pub)
        if i % 50 == 49:
            [last] = messages(sub)[-1:] or [None]
            if last is not None:
                sub.core.release(last.routing_id, 50)
                net.collect(sub)
        net.run(net.now + 0.001)
    deliver(net)
    got = messages(sub)
    assert [m.payload for m in got] == [b"%d" % i for i in range(200)]
    assert [m.topic for m in got] == topics
    assert all(m.gap == 0 for m in got)


def test_publish_checks_the_payload_size_and_the_topic_key() -> None:
    net = MemNet(seed=7, config=CoreConfig(max_payload=100))
    only_db = Keyring.generate(["db"], randbytes=net.rng.randbytes)
    pub = net.add("pub", keyring=only_db)
    with pytest.raises(PayloadTooLarge):
        pub.core.publish("db.x", b"x" * 101)
    with pytest.raises(NoKey):
        pub.core.publish("feeds.x", b"no key for feeds, no default")
    assert pub.core.publish("db.x", b"ok") == 0


def intruder_linked_to_insider(net: MemNet) -> tuple[MemNode, MemNode]:
    """An intruder holding only the default key, linked to an insider (who holds the "secret"
    key and subscribes to everything) as a publisher of "secret.orders"."""
    _publisher_keys, insider_keys, outsider_keys = keyrings(net)
    intruder = net.add("intruder", keyring=outsider_keys)
    insider = net.add("insider", seeds=[intruder], keyring=insider_keys)
    net.advance(0.5)
    subscribe(net, insider, "#")
    linked_for(net, intruder, "secret.orders")
    return intruder, insider


def keyrings(net: MemNet) -> tuple[Keyring, Keyring, Keyring]:
    """A default key all share; "secret" topics keyed apart, held by `insider` and `publisher`."""
    base = Keyring.generate(["*", "secret"], randbytes=net.rng.randbytes)
    default, secret = base.require("*"), base.require("secret")
    outsider = Keyring([default])
    return base, Keyring([default, secret]), outsider


def test_a_topic_with_a_key_of_its_own_reaches_only_holders_of_that_key() -> None:
    net = MemNet(seed=8, config=CONFIG)
    publisher_keys, insider_keys, outsider_keys = keyrings(net)
    pub = net.add("pub", keyring=publisher_keys)
    insider = net.add("insider", seeds=[pub], keyring=insider_keys)
    outsider = net.add("outsider", seeds=[pub], keyring=outsider_keys)
    net.advance(0.5)
    subscribe(net, insider, "secret.#")
    subscribe(net, outsider, "secret.#")  # interest alone is not a key
    subscribe(net, outsider, "public.#")
    linked_for(net, pub, "secret.plans")
    for _ in range(WINDOW * 3):  # more than a window: the outsider holds no credit hostage
        assert publish(net, pub, "secret.plans", b"classified") == 1
        sub_msgs = messages(insider)
        insider.core.release(sub_msgs[-1].routing_id)
        net.collect(insider)
    assert len(messages(insider)) == WINDOW * 3
    assert messages(outsider) == []
    # The outsider's record shows no interest in "secret" under the publisher's key (its tag
    # is under the default key): the publisher never even linked to it for these.
    assert pub.core.stats["publish_unreadable"] == 0
    assert outsider.node_id not in pub.peer_ids()
    # Every PUBLISH frame went to the insider: the outsider saw none, sealed or not.
    frames = net.kinds_delivered(Kind.PUBLISH) + net.kinds_delivered(Kind.BATCH)
    assert all(d.conn.listener is insider for d in frames)
    linked_for(net, pub, "public.news")
    assert publish(net, pub, "public.news", b"for all") == 1
    assert [m.payload for m in messages(outsider)] == [b"for all"]
    # Linked now, for "public": its interest in "secret" shows, and is still refused a key.
    assert publish(net, pub, "secret.plans", b"classified") == 1
    assert pub.core.stats["publish_unreadable"] == 1
    assert messages(outsider)[-1].payload == b"for all"


def test_a_default_key_holder_cannot_inject_into_a_scope_keyed_apart() -> None:
    net = MemNet(seed=9, config=CONFIG)
    intruder, insider = intruder_linked_to_insider(net)
    [link] = intruder.core.peers()
    # The intruder publishes "secret.*" under the default key (all it has); the insider's
    # interest makes it try. It must be refused, and cost the intruder nothing it can use.
    for _ in range(WINDOW * 3):
        assert publish(net, intruder, "secret.orders", b"forged") == 1
    assert messages(insider) == []
    assert insider.core.stats["dropped_bad_scope"] == WINDOW * 3
    assert link.credit > 0  # refused messages give their credit back
    assert publish(net, intruder, "other.news", b"fine") == 1
    assert [m.payload for m in messages(insider)] == [b"fine"]


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "batches"])
def test_a_batch_delivers_its_good_messages_in_order_around_the_refused_ones(runs: bool) -> None:
    net = MemNet(seed=10, config=CONFIG)
    intruder, insider = intruder_linked_to_insider(net)
    intruder.core.batching = True
    for link in intruder.core.peers():
        link.pub_runs = runs
    # Both scopes go in the default key's slot, so they share one BATCH frame.
    for i in range(WINDOW):
        topic = "secret.orders" if i % 2 else "other.news"
        assert intruder.core.publish(topic, b"%d" % i) == 1
    intruder.core.seal_staged()
    net.collect(intruder)
    net.settle()
    assert intruder.core.stats["batches_sent"] == 1
    assert [(m.topic, m.payload) for m in messages(insider)] == [
        ("other.news", b"%d" % i) for i in range(0, WINDOW, 2)
    ]
    assert insider.core.stats["dropped_bad_scope"] == WINDOW // 2
    [link] = intruder.core.peers()
    assert link.credit == WINDOW // 2  # the refused half came back (a quarter window a grant)


@pytest.mark.parametrize("runs", [True, False], ids=["runs", "batches"])
def test_messages_lost_in_transit_show_as_a_gap_before_the_next_one(runs: bool) -> None:
    net = MemNet(seed=11, config=CONFIG)
    pub, sub = pair(net)
    subscribe(net, sub, "t.#")
    pub.core.batching = True
    for link in pub.core.peers():
        link.pub_runs = runs
    for i in range(3):
        pub.core.publish("t.lost", b"lost %d" % i)
    pub.core.seal_staged()
    assert len(pub.core.out_frames) == 1
    pub.core.out_frames.clear()  # the batch dies on the wire (its link lives on)
    for i in range(3):
        pub.core.publish("t.kept", b"kept %d" % i)
    pub.core.seal_staged()
    net.collect(pub)
    net.settle()
    assert [(m.payload, m.gap) for m in messages(sub)] == [
        (b"kept 0", 3),
        (b"kept 1", 0),
        (b"kept 2", 0),
    ]
    assert sub.core.stats["publish_gaps"] == 3


def test_publish_without_credit_is_dropped_and_counted() -> None:
    net = MemNet(seed=9, config=CONFIG)
    pub, sub = pair(net)
    subscribe(net, sub, "t")
    [link] = [p for p in pub.core.peers() if p.peer_id == sub.node_id]
    link.credit = 10 * WINDOW  # a publisher that ignores the subscriber's window
    for _ in range(WINDOW + 3):
        publish(net, pub, "t")
    assert len(messages(sub)) == WINDOW
    assert sub.core.stats["dropped_over_credit"] == 3


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("pub"), st.sampled_from(["a.b", "a.c", "x.y", "a.b.c"])),
            st.tuples(st.just("release"), st.integers(1, WINDOW)),
            st.tuples(st.just("run"), st.floats(0, 0.02)),
        ),
        max_size=120,
    ),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("mode", ["frames", "runs", "batches"])
def test_credit_bounds_what_is_in_flight_and_nothing_is_lost_or_reordered(
    ops: list[tuple[str, object]], seed: int, mode: str
) -> None:
    net = MemNet(seed=seed, max_delay=0.005, config=CONFIG)
    pub, sub = pair(net)
    batched = mode != "frames"
    pub.core.batching = batched  # batched: publishes wait to be sealed together
    subscribe(net, sub, "a.#")
    [link] = [p for p in pub.core.peers() if p.peer_id == sub.node_id]
    if mode == "batches":  # a subscriber whose WELCOME did not offer PUBLISH_RUN
        link.pub_runs = False
    sent: list[bytes] = []
    released = 0
    for op, arg in ops:
        if op == "pub":
            payload = b"%d" % len(sent)
            assert isinstance(arg, str)
            result = pub.core.publish(arg, payload)
            if result == 1:
                sent.append(payload)
            else:
                assert result in (0, -1)
                # Refused only for want of credit: the subscriber's whole window is unreleased,
                # or released but its grant still on the wire.
                assert result == 0 or not arg.startswith("a.") or link.credit <= 0
            if not batched:
                net.collect(pub)
        elif op == "release":
            assert isinstance(arg, int)
            n = min(arg, len(messages(sub)) - released)
            if n:
                sub.core.release(messages(sub)[0].routing_id, n)
                released += n
                net.collect(sub)
        else:
            assert isinstance(arg, float)
            pub.core.seal_staged()
            net.collect(pub)
            net.run(net.now + arg)
        # Never more than a window unreleased, counting what is still on the wire.
        assert len(sent) - released <= WINDOW
    pub.core.seal_staged()
    net.collect(pub)
    deliver(net)
    assert [m.payload for m in messages(sub)] == sent
    # Every message released and the grants delivered: the publisher has its window again,
    # but for what the subscriber keeps back until it makes a quarter window to grant.
    if len(sent) > released:
        sub.core.release(messages(sub)[0].routing_id, len(sent) - released)
        net.collect(sub)
        deliver(net)
    assert WINDOW - WINDOW // 4 < link.credit <= WINDOW
    assert pub.core.publish("a.b", b"after") == 1


def test_one_publish_to_several_subscribers_stages_one_entry_for_all_of_them() -> None:
    net = MemNet(seed=12, config=CONFIG)
    pub = net.add("pub")
    subs = [net.add(f"sub{i}", seeds=[pub]) for i in range(3)]
    net.advance(0.5)
    for sub in subs:
        subscribe(net, sub, "t.#")
    linked_for(net, pub, "t.x")
    pub.core.batching = True
    links = pub.core.peers()
    assert len(links) == 3
    assert all(link.pub_runs for link in links)
    for i in range(3):
        assert pub.core.publish("t.x", b"m%d" % i) == 3
    # The same entry object for every subscriber, after each link's own head (its stream seq).
    for i in range(3):
        entry = links[0].pub_parts[1 + i]
        assert all(link.pub_parts[1 + i] is entry for link in links)
    pub.core.seal_staged()
    kinds = [frame[2] for _link_id, frame in pub.core.out_frames]
    assert kinds == [Kind.PUBLISH_RUN] * 3
    net.collect(pub)
    deliver(net)
    for sub in subs:
        assert [(m.topic, m.payload, m.gap) for m in messages(sub)] == [
            ("t.x", b"m%d" % i, 0) for i in range(3)
        ]


@pytest.mark.parametrize(
    "body",
    [
        b"\0" * 7,  # no room for the head
        b"\0" * 8 + b"\x10\0\0",  # a cut entry header
        b"\0" * 8 + b"\x10\0\0\0\xff\x01t",  # an entry longer than the body
        b"\0" * 8 + b"\x10\0\0\0\x01\x00x",  # an empty topic
        b"\0" * 8 + b"\x05\0\0\0\x02\x01tx",  # not a publish
    ],
)
def test_a_broken_run_is_refused(body: bytes) -> None:
    net = MemNet(seed=13, config=CONFIG)
    pub, sub = pair(net)
    subscribe(net, sub, "t")
    [inlink] = [link for link in sub.core.inbound() if link.peer_id == pub.node_id]
    [slot] = inlink.topic_slots
    with pytest.raises(ProtocolError) as caught:  # the engine counts it and drops the frame
        sub.core.pubsub.on_publish(inlink, body, inlink.topic_slots[slot], int(Kind.PUBLISH_RUN))
    assert caught.value.reason == "bad_envelope"
    assert messages(sub) == []
