"""Traffic splits: members carry versions, a split weighs them, every caller applies it.

A split set at any node travels sealed in membership records; the cluster's members carry it
on, so it reaches callers that join later and outlives its setter. Callers draw a version by
weight, then make the balancer's usual choice within it; a version without a live member has
its share spread over the others. Cores wired in memory (memnet), virtual time, seeded.
"""

from __future__ import annotations

import random
from collections import Counter

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from memnet import MemNet, MemNode, hold

from irismesh._core.links import OutLink
from irismesh._core.records import NOTE_SALT
from irismesh._core.split import (
    MAX_VERSIONS,
    Route,
    check_weights,
    decode_split,
    encode_split,
    validate_version,
)
from irismesh.errors import ConfigurationError
from irismesh.security.keyring import Keyring, ScopeKey
from irismesh.security.meshkey import KeyedMembershipSecurity

STAMP = 1_000


def versioned(
    net: MemNet, versions: dict[str, str], callers: int = 1, handler: object = None
) -> tuple[dict[str, MemNode], list[MemNode]]:
    """Members of "db" (name -> version) and callers linked to them all."""
    extra = {} if handler is None else {"handler": handler}
    members = {
        name: net.add(name, clusters=["db"], version=version, **extra)  # type: ignore[arg-type]
        for name, version in versions.items()
    }
    clients = [net.add(f"caller{i}", seeds=list(members.values())) for i in range(callers)]
    net.advance(1.0)
    for client in clients:
        client.core.want("db", net.now)
        net.collect(client)
    net.advance(0.5)
    for client in clients:
        assert len(client.core.members("db")) == len(members)
    return members, clients


def by_version(
    net: MemNet, client: MemNode, members: dict[str, MemNode], versions: dict[str, str], n: int
) -> Counter[str]:
    """Send `n` requests (each answered at once); count the replies by the version of their
    member."""
    version_of = {members[name].node_id: version for name, version in versions.items()}
    counts: Counter[str] = Counter()
    for i in range(n):
        req_id = net.request(client, "db", b"%d" % i)
        [reply] = client.replies.pop(req_id)
        counts[version_of[reply.peer]] += 1
    assert not client.failures
    return counts


def split_at(node: MemNode) -> dict[str, int] | None:
    found = node.core.split("db")
    return None if found is None or not found.weights else dict(found.weights)


def test_a_split_of_95_to_5_gives_v2_five_percent_of_20000_requests() -> None:
    net = MemNet(seed=30)
    versions = {"a1": "v1", "a2": "v1", "b1": "v2", "b2": "v2"}
    members, [client] = versioned(net, versions)
    operator = net.add("operator", seeds=[members["a1"]])
    net.advance(1.0)
    operator.core.set_split("db", {"v1": 95, "v2": 5}, STAMP)
    net.collect(operator)
    net.advance(1.0)
    assert split_at(client) == {"v1": 95, "v2": 5}
    counts = by_version(net, client, members, versions, 20_000)
    share = counts["v2"] / 20_000
    assert abs(share - 0.05) < 0.01, counts
    # Within a version, the balancer's usual choice: both v2 members take their part.
    per_member = Counter(event.token[0] for m in ("b1", "b2") for event in members[m].arrived)
    assert min(per_member.values()) > 0.3 * counts["v2"], per_member


def test_a_split_reaches_every_caller_within_a_second_and_outlives_its_setter() -> None:
    net = MemNet(seed=31)
    versions = {"a1": "v1", "a2": "v1", "b1": "v2"}
    members, clients = versioned(net, versions, callers=3)
    operator = net.add("operator", seeds=[members["a1"]])
    net.advance(1.0)
    operator.core.set_split("db", {"v1": 0, "v2": 1}, STAMP)
    net.collect(operator)
    started, step = net.now, 0.05
    while not all(split_at(c) == {"v1": 0, "v2": 1} for c in clients):
        assert net.now - started < 1.0, [split_at(c) for c in clients]
        net.advance(step, step)
    print(f"every caller applied the split after {net.now - started:.2f} s (virtual)")
    for client in clients:  # in effect: v1 has no weight
        assert by_version(net, client, members, versions, 50) == {"v2": 50}
    # The setter leaves; the members carry the split, and a caller joining later reads it.
    operator.core.close()
    net.collect(operator)
    net.kill(operator)
    net.advance(5.0)
    late = net.add("late", seeds=[members["a2"]])
    net.advance(1.0)
    late.core.want("db", net.now)
    net.collect(late)
    net.advance(0.5)
    assert split_at(late) == {"v1": 0, "v2": 1}
    assert by_version(net, late, members, versions, 50) == {"v2": 50}


def test_every_v2_member_crashed_under_load_fails_no_request() -> None:
    net = MemNet(seed=32)
    versions = {"a1": "v1", "a2": "v1", "b1": "v2", "b2": "v2"}
    members, [client] = versioned(net, versions, handler=hold)
    client.core.set_split("db", {"v1": 50, "v2": 50}, STAMP)
    net.collect(client)
    net.advance(0.5)
    sent = [net.request(client, "db", b"%d" % i, timeout=5.0) for i in range(200)]
    held_by_v2 = sum(len(members[m].held) for m in ("b1", "b2"))
    assert 60 < held_by_v2 < 140, held_by_v2
    net.crash(members["b1"])
    net.crash(members["b2"])
    sent += [net.request(client, "db", b"%d" % i, timeout=5.0) for i in range(200, 300)]
    for name in ("a1", "a2"):  # v1 answers everything: what it held, and what moved to it
        node = members[name]
        while node.held:
            token = node.held.pop()
            net.reply(node, token, b"ok")
    assert not client.failures, client.failures
    assert all(req_id in client.replies for req_id in sent)
    net.advance(5.0)  # membership declares them dead: v1 takes every request
    before = sum(len(members[name].arrived) for name in ("a1", "a2"))
    for i in range(50):
        net.request(client, "db", b"late %d" % i, timeout=5.0)
    assert sum(len(members[name].arrived) for name in ("a1", "a2")) == before + 50
    assert not client.failures


def test_a_version_with_no_live_member_has_its_share_spread_over_the_others() -> None:
    net = MemNet(seed=33)
    versions = {"a1": "v1", "b1": "v2"}
    members, [client] = versioned(net, versions)
    client.core.set_split("db", {"v1": 50, "v2": 30, "v3": 20}, STAMP)
    counts = by_version(net, client, members, versions, 4000)
    assert abs(counts["v2"] / 4000 - 30 / 80) < 0.03, counts


def test_versions_a_split_does_not_name_serve_only_when_no_named_version_lives() -> None:
    net = MemNet(seed=34)
    versions = {"a1": "v1", "c1": "v3", "n1": ""}
    members, [client] = versioned(net, versions)
    client.core.set_split("db", {"v1": 1}, STAMP)
    assert by_version(net, client, members, versions, 100) == {"v1": 100}
    net.crash(members["a1"])
    counts = by_version(net, client, members, versions, 400)
    assert set(counts) == {"v3", ""}, counts  # never NoResponders while a member lives
    assert min(counts.values()) > 100, counts


def test_members_without_a_version_form_a_version_of_their_own() -> None:
    net = MemNet(seed=35)
    versions = {"n1": "", "n2": "", "b1": "v2"}
    members, [client] = versioned(net, versions)
    client.core.set_split("db", {"": 3, "v2": 1}, STAMP)
    counts = by_version(net, client, members, versions, 4000)
    assert abs(counts["v2"] / 4000 - 0.25) < 0.03, counts
    names, others = client.core.split_versions("db")
    assert (names, others) == ({"": 2, "v2": 1}, 0)


def test_a_cleared_split_wins_over_older_ones_and_costs_requests_nothing() -> None:
    net = MemNet(seed=36)
    versions = {"a1": "v1", "b1": "v2"}
    members, [client] = versioned(net, versions)
    operator = net.add("operator", seeds=[members["a1"]])
    net.advance(1.0)
    operator.core.set_split("db", {"v2": 1}, STAMP)
    net.collect(operator)
    net.advance(1.0)
    assert client.core.calls.routes
    operator.core.set_split("db", None, STAMP + 1)
    net.collect(operator)
    net.advance(1.0)
    assert split_at(client) is None
    assert client.core.calls.routes == {}  # no split: a request checks one empty dict
    assert client.core.split("db") is not None  # the clearing itself is known (and carried)
    # Every member carries the clearing, so no older split comes back.
    assert client.core.split_carriers("db", STAMP + 1) == (2, 2)
    for name in versions:
        assert members[name].core.split("db") == client.core.split("db")
    counts = by_version(net, client, members, versions, 400)
    assert min(counts.values()) > 100, counts


def test_the_newest_stamp_wins_whichever_node_set_it_and_when() -> None:
    net = MemNet(seed=37)
    versions = {"a1": "v1", "b1": "v2"}
    members, clients = versioned(net, versions, callers=2)
    one, two = clients
    one.core.set_split("db", {"v1": 1}, STAMP + 5)
    net.collect(one)
    net.advance(1.0)
    two.core.set_split("db", {"v2": 1}, STAMP)  # later, but stamped older: it loses
    net.collect(two)
    net.advance(1.0)
    for node in [*clients, *members.values()]:
        assert split_at(node) == {"v1": 1}, node.name


def test_a_node_without_the_clusters_key_learns_neither_split_nor_versions() -> None:
    net = MemNet(seed=38)
    versions = {"a1": "v1", "b1": "v2"}
    members, [client] = versioned(net, versions)
    client.core.set_split("db", {"v1": 1}, STAMP)
    net.collect(client)
    mesh_only = net.keyring.with_key("db", primary=True)  # a db key of its own
    outsider = net.add("outsider", seeds=[members["a1"]], keyring=mesh_only)
    net.advance(1.0)
    assert outsider.core.split("db") is None
    assert outsider.core.split_versions("db") == ({}, 0)


def test_a_split_and_versions_survive_a_key_rotation_done_node_by_node() -> None:
    rng = random.Random(39)
    old, new = (ScopeKey(scope="*", secret=rng.randbytes(32)) for _ in range(2))
    net = MemNet(seed=39, keyring=Keyring([old]))
    versions = {"a1": "v1", "b1": "v2"}
    members, [client] = versioned(net, versions)
    client.core.set_split("db", {"v2": 1}, STAMP)
    net.collect(client)
    net.advance(1.0)
    nodes = [*members.values(), client]
    for step in ([old, new], [new, old], [new]):  # add the new key, make it first, drop the old
        for node in nodes:
            net.rekey(node, Keyring(step))
            net.advance(0.5)
    net.advance(2.0)
    late = net.add("late", seeds=[members["a1"]], keyring=Keyring([new]))
    net.advance(1.0)
    for node in [*nodes, late]:
        assert split_at(node) == {"v2": 1}, node.name
    late.core.want("db", net.now)
    net.collect(late)
    net.advance(0.5)
    assert by_version(net, late, members, versions, 50) == {"v2": 50}


def test_a_bad_version_or_split_is_a_configuration_error() -> None:
    for bad in ("v 2", "a=b", "x" * 33, "tab\t", 2):
        with pytest.raises(ConfigurationError):
            validate_version(bad)
    assert validate_version("") == ""
    for weights in ({}, {"v1": 0}, {"v1": -1}, {"v1": 1.5}, {"v1": True}, {"a=b": 1}):
        with pytest.raises(ConfigurationError):
            check_weights(weights)  # type: ignore[arg-type]
    many = {f"v{i}": 1 for i in range(MAX_VERSIONS + 1)}
    with pytest.raises(ConfigurationError):
        check_weights(many)
    assert check_weights({"v2": 5, "v1": 95}) == (("v1", 95), ("v2", 5))


@given(st.binary(max_size=200))
def test_any_bytes_decode_to_a_split_or_to_none(data: bytes) -> None:
    decoded = decode_split(data)
    assert decoded is None or decoded == decode_split(encode_split(*decoded))


@given(
    st.integers(0, 1 << 62),
    st.dictionaries(
        st.text(
            st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp")), max_size=8
        ).filter(lambda v: "=" not in v and v.isprintable()),
        st.integers(0, 1000),
        min_size=1,
        max_size=MAX_VERSIONS,
    ),
)
def test_a_split_round_trips_through_its_note(stamp: int, weights: dict[str, int]) -> None:
    ordered = tuple(sorted(weights.items()))
    assert decode_split(encode_split(stamp, ordered)) == (stamp, ordered)


def test_hostile_notes_are_none() -> None:
    assert decode_split(b"") is None
    assert decode_split(msgpack.packb([1, -1, []])) is None
    assert decode_split(msgpack.packb([2, 5, []])) is None
    assert decode_split(msgpack.packb([1, 5, [["v1", 10**9]]])) is None
    assert decode_split(msgpack.packb([1, 5, [["a b", 1]]])) is None


def test_notes_open_only_with_the_clusters_key_and_only_untouched() -> None:
    keyring = Keyring.generate(["*"], randbytes=random.Random(1).randbytes)
    security = KeyedMembershipSecurity(keyring)
    note = security.seal_note("db", bytes(NOTE_SALT), b"hello")
    assert len(note) % 8 == 0
    tags = security.member_tags(b"n" * 16, ["db"]) + note
    assert security.open_notes(tags, "db") == [(b"hello", note)]
    assert security.open_notes(tags, "other") == []
    stranger = KeyedMembershipSecurity(Keyring.generate(["*"]))
    assert stranger.open_notes(tags, "db") == []
    tampered = bytearray(tags)
    tampered[-9] ^= 1
    assert security.open_notes(bytes(tampered), "db") == []
    assert security.serves(b"n" * 16, tags, "db")  # a note does not disturb the tags around it
    version = security.version_tags(b"n" * 16, ["db"], "v2")
    assert security.version_of(b"n" * 16, version, "db", ["v1", "v2"]) == "v2"
    assert security.version_of(b"m" * 16, version, "db", ["v1", "v2"]) is None  # bound to its id
    assert security.version_of(b"n" * 16, version, "db", ["", "v1"]) is None


def link(peer: bytes) -> OutLink:
    out = OutLink(0, "tcp://x:1", b"", 0.0)
    out.peer_id = peer
    return out


def test_a_route_groups_again_only_for_a_new_list_or_a_change() -> None:
    route = Route((("v1", 3), ("v2", 1)))
    a, b, c = link(b"a"), link(b"b"), link(b"c")
    route.versions.update({b"a": "v1", b"b": "v2"})
    members = [a, b, c]
    rng = random.Random(5)
    drawn = Counter(id(route.narrow(members, rng)[0]) for _ in range(4000))
    assert abs(drawn[id(b)] / 4000 - 0.25) < 0.03
    assert route.narrow(members, rng) in ([a], [b])  # c's version is not named
    route.versions.pop(b"a")
    route.versions.pop(b"b")
    assert route.narrow(members, rng) in ([a], [b])  # the groups are kept until told
    route.changed()
    assert route.narrow(members, rng) is members  # no named version: every member
