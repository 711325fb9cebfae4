"""The directory: which live nodes serve a cluster or read a scope, kept current by events."""

from __future__ import annotations

from swimnet import SwimNet

from irismesh._core.directory import Directory
from irismesh.security.keyring import Keyring
from irismesh.security.meshkey import KeyedMembershipSecurity


def test_servers_and_readers_follow_joins_changes_and_deaths() -> None:
    keys = Keyring.generate(["*", "db"])
    security = KeyedMembershipSecurity(keys)
    stranger = KeyedMembershipSecurity(Keyring.generate(["*", "db"]))
    net = SwimNet(seed=1)
    first = net.add("caller")
    directory = Directory(security)
    blind = Directory(stranger)  # holds another key for db
    gained: list[bool] = []

    def watch(node, event) -> None:  # type: ignore[no-untyped-def]
        if node is first:
            gained.append(directory.on_event(event))
            blind.on_event(event)

    net.on_event = watch
    assert directory.servers("db") == {}  # in use before anyone is there
    members = []
    for name in ("m1", "m2"):
        node = net.add(name, join=[first])
        node.membership.update(net.now, tags=security.member_tags(node.node_id, ["db"]))
        members.append(node)
    reader = net.add("reader", join=[first])
    reader.membership.update(net.now, tags=security.interest_tags(reader.node_id, ["feeds"], False))
    net.run_until(lambda: len(directory.servers("db")) == 2, limit=5)
    assert set(directory.servers("db")) == {m.node_id for m in members}
    assert any(gained)
    assert set(directory.readers("feeds")) == {reader.node_id}
    assert directory.readers("sport") == {}
    assert blind.servers("db") == {}  # the tags say nothing to another key
    assert len(blind) == 3  # though it sees the nodes themselves
    assert directory.knows_endpoint(members[0].membership.me.endpoint)
    net.kill(members[0])
    net.run_until(lambda: len(directory.servers("db")) == 1, limit=10)
    assert not directory.knows_endpoint(members[0].membership.me.endpoint)
    members[1].membership.update(net.now, tags=b"")  # stops serving db
    net.run_until(lambda: directory.servers("db") == {}, limit=5)
