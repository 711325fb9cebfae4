"""Key rotation in memory (memnet): the three steps of SECURITY.md applied to running cores, one
node at a time, under a steady stream of requests; links that used a removed key handshake
again; what records say of the keys each node holds.

Time is virtual; nothing here sleeps.
"""

from __future__ import annotations

import random

import pytest
from memnet import MemNet, MemNode, hold, member_and_client

from irismesh._core.directory import Directory
from irismesh._core.frames import STATUS_OK
from irismesh._core.gossip import MAX_TAGS
from irismesh.errors import NoResponders
from irismesh.security.keyring import Keyring, ScopeKey
from irismesh.security.linksecurity import KeyedLinkSecurity
from irismesh.security.meshkey import ALSO, FIRST


def _keys(seed: int) -> tuple[ScopeKey, ScopeKey]:
    rng = random.Random(seed)
    return ScopeKey(scope="*", secret=rng.randbytes(32)), ScopeKey(
        scope="*", secret=rng.randbytes(32)
    )


def _steps(old: ScopeKey, new: ScopeKey) -> list[Keyring]:
    """SECURITY.md's three steps: add the new key second, make it first, remove the old."""
    return [Keyring([old, new]), Keyring([new, old]), Keyring([new])]


class Load:
    """A request from the client every 20 ms of virtual time, each checked at the end."""

    def __init__(self, net: MemNet, client: MemNode) -> None:
        self.net, self.client = net, client
        self.sent: list[int] = []

    def run(self, seconds: float) -> None:
        end = self.net.now + seconds
        while self.net.now < end:
            self.sent.append(self.net.request(self.client, "db", b"%d" % len(self.sent)))
            self.net.advance(0.02, step=0.02)

    def check(self) -> None:
        self.net.advance(3.0)  # past every deadline: each request has its outcome
        assert self.client.failures == {}
        for i, req_id in enumerate(self.sent):
            [reply] = self.client.replies[req_id]
            assert (reply.status, reply.payload) == (STATUS_OK, b"re:%d" % i)


def test_three_rotation_steps_one_node_at_a_time_fail_no_request() -> None:
    old, new = _keys(1)
    net = MemNet(seed=11, keyring=Keyring([old]))
    members = [net.add(f"m{i}", clusters=["db"]) for i in range(3)]
    client = net.add("client", seeds=members)
    net.advance(1.0)
    assert len(client.core.members("db")) == 3
    load = Load(net, client)
    load.run(0.5)
    for step, keyring in enumerate(_steps(old, new)):
        # The client first at one step, last at the next: any order within a step works.
        order = [*members, client] if step == 1 else [client, *members]
        for node in order:
            net.rekey(node, keyring)
            load.run(0.3)
    load.run(1.0)
    load.check()
    rekeyed = sum(node.core.stats["links_rekeyed"] for node in [client, *members])
    assert rekeyed > 0  # the last step closed the links that still used the old key
    assert len(client.core.members("db")) == 3
    # Every link now uses the new key: the old one opens nothing.
    for node in [client, *members]:
        assert node.security is not None
        assert all(
            node.security.holds(h) for link in node.core.links() for h in link.handles.values()
        )


def test_after_the_rotation_only_a_holder_of_the_new_key_can_call_or_serve() -> None:
    old, new = _keys(2)
    net = MemNet(seed=12, keyring=Keyring([old]))
    member, client = member_and_client(net)
    for keyring in _steps(old, new):
        for node in (member, client):
            net.rekey(node, keyring)
        net.advance(0.5)
    stale_caller = net.add("stale-caller", seeds=[member], keyring=Keyring([old]))
    stale_member = net.add("stale-member", clusters=["db"], seeds=[member], keyring=Keyring([old]))
    fresh_caller = net.add("fresh-caller", seeds=[member], keyring=Keyring([new]))
    fresh_member = net.add("fresh-member", clusters=["db"], seeds=[member], keyring=Keyring([new]))
    net.advance(2.0)
    assert stale_caller.ups() == []  # no handshake completes without the mesh key
    with pytest.raises(NoResponders):
        net.request(stale_caller, "db", b"hi")
    assert stale_member.node_id not in client.peer_ids()
    servers = client.core.directory.servers("db")
    assert set(servers) == {member.node_id, fresh_member.node_id}
    req_id = net.request(fresh_caller, "db", b"hi")
    net.advance(0.5)
    assert fresh_caller.replies[req_id][0].payload == b"re:hi"


def test_a_request_running_when_its_key_is_removed_is_answered_once() -> None:
    old, new = _keys(3)
    net = MemNet(seed=13, keyring=Keyring([old]))
    member, client = member_and_client(net, handler=hold)
    for node in (member, client):
        net.rekey(node, Keyring([old, new]))
    for node in (member, client):
        net.rekey(node, Keyring([new, old]))
    req_id = net.request(client, "db", b"slow", timeout=5.0)
    assert len(member.held) == 1  # running on the member
    net.rekey(member, Keyring([new]))  # its link goes; the client dials again and resends
    net.advance(0.3)
    assert member.core.stats["requests_duplicate"] == 1  # the resend waits for the first run
    assert client.core.stats["links_down_rekey"] == 1
    net.reply(member, member.held[0], b"done")
    net.advance(0.5)
    assert [r.payload for r in client.replies[req_id]] == [b"done"]
    assert client.failures == {}
    assert len(member.arrived) == 1  # the handler ran once


def test_records_say_who_holds_a_key_and_who_uses_it_first() -> None:
    old, new = _keys(4)
    net = MemNet(seed=14, keyring=Keyring([old]))
    a = net.add("a", clusters=["db"])
    b = net.add("b", seeds=[a])
    c = net.add("c", seeds=[a])
    net.advance(1.0)
    net.rekey(a, Keyring([old, new]))
    net.rekey(c, Keyring([old, new]))
    net.rekey(b, Keyring([new, old]))
    net.advance(2.0)  # the new records spread
    reader = KeyedLinkSecurity(Keyring([new, old]))
    records = [r for r in c.core.directory.records() if r.node_id != c.node_id]
    uses = {
        r.node_id: (reader.key_use(r.node_id, r.tags, new), reader.key_use(r.node_id, r.tags, old))
        for r in records
    }
    assert uses == {a.node_id: (ALSO, FIRST), b.node_id: (FIRST, ALSO)}
    # A key it does not hold tells a reader nothing of a node.
    stranger = KeyedLinkSecurity(Keyring.generate(["*"]))
    [other] = stranger.keyring
    assert all(stranger.key_use(r.node_id, r.tags, other) is None for r in records)


def test_key_tags_never_push_a_record_past_its_tag_limit() -> None:
    clusters = [f"c{i}" for i in range(64)]
    keyring = Keyring.generate(clusters)
    for cluster in clusters:  # a rotation of every cluster at once: 128 member tags
        keyring = keyring.with_key(cluster, primary=False)
    directory = Directory(KeyedLinkSecurity(keyring))
    tags = directory.own_tags(b"n" * 16, clusters, ())
    assert len(tags) == MAX_TAGS  # every member tag kept, no key tag past the limit
    few = Directory(KeyedLinkSecurity(Keyring.generate(["*", "db"])))
    # db's tag, the version tag of db (none: ""), then two key tags.
    assert len(few.own_tags(b"n" * 16, ["db"], ())) == 8 + 8 + 2 * 8


def test_a_link_opened_before_the_rotation_and_not_used_yet_serves_after_it() -> None:
    # The client's link (its join through the member) predates the new key and carried no
    # request: its WELCOME offered only the old key, so the member, dropping that key,
    # replaces the link, and the new handshake offers the new one.
    old, new = _keys(5)
    net = MemNet(seed=15, keyring=Keyring([old]))
    member, client = member_and_client(net)
    assert client.core.links()  # linked, never called
    for keyring in _steps(old, new):
        for node in (member, client):
            net.rekey(node, keyring)
        net.advance(0.3)
    req_id = net.request(client, "db", b"after")
    net.advance(0.5)
    assert [r.payload for r in client.replies[req_id]] == [b"re:after"]
    assert member.core.stats["links_rekeyed"] == 1  # at step 3


def test_a_new_order_of_the_same_keys_keeps_every_link() -> None:
    old, new = _keys(6)
    net = MemNet(seed=16, keyring=Keyring([old, new]))
    member, client = member_and_client(net)
    net.request(client, "db", b"x")
    for node in (member, client):
        net.rekey(node, Keyring([new, old]))
    net.advance(0.5)
    assert client.core.stats["links_down_rekey"] == 0
    assert member.core.stats["links_rekeyed"] == 0
    req_id = net.request(client, "db", b"y")
    assert [r.payload for r in client.replies[req_id]] == [b"re:y"]
