"""Ejections told to the mesh: each caller's membership record says, in a note sealed under
the cluster's key, which members it keeps out of the cluster's rotation now; any node holding
the key reads who ejects whom (`ejected_by`), and nobody without it; the notes stay within
the record's budget, change at most once per SHARE_EVERY, and go when the ejection ends."""

from __future__ import annotations

from collections import Counter

from memnet import Handler, MemNet, MemNode, echo, mesh

from irismesh._core.config import CoreConfig
from irismesh._core.directory import Directory
from irismesh._core.events import RequestArrived
from irismesh._core.gossip import MAX_TAGS
from irismesh._core.outliers import (
    ID_PREFIX,
    MAX_NOTE_CLUSTERS,
    MAX_NOTE_IDS,
    NOTE_EJECTED,
    SHARE_EVERY,
    OutlierConfig,
    SharedEjections,
    decode_ejected,
    encode_ejected,
)
from irismesh._core.split import encode_split, note_kind
from irismesh.security.keyring import Keyring
from irismesh.security.meshkey import KeyedMembershipSecurity

LONG = OutlierConfig(base_ejection=10.0, max_ejection=20.0)  # out long enough to be seen


def fail_on(names: set[str]) -> Handler:
    def handler(node: MemNode, event: RequestArrived) -> bytes | None:
        if node.name in names:
            node.core.calls.reply_error(event.token, RuntimeError("broken"))
            return None
        return echo(node, event)

    return handler


def eject_from(net: MemNet, client: MemNode, requests: int = 100) -> Counter[bytes]:
    """Requests one at a time from `client`; the peers that answered."""
    served: Counter[bytes] = Counter()
    for i in range(requests):
        req_id = net.request(client, "db", b"%d" % i)
        net.settle()
        for reply in client.replies.get(req_id, []):
            served[reply.peer] += 1
    return served


def test_every_node_with_the_key_reads_which_callers_eject_a_member() -> None:
    net = MemNet(seed=3, config=CoreConfig(outliers=LONG))
    nodes = mesh(net, {"a": ["db"], "b": ["db"], "c": ["db"]}, handler=fail_on({"c"}))
    other = net.add("other", seeds=[nodes["a"]])
    observer = net.add("observer", seeds=[nodes["a"]])
    net.advance(0.5)
    bad = nodes["c"].node_id
    for caller in (nodes["client"], other):
        eject_from(net, caller)
        assert caller.core.calls.outliers.is_ejected("db", bad)
    assert observer.core.ejected_by(["db"]) == {}  # not said yet: at most once a second
    net.advance(SHARE_EVERY + 1.0)  # said, and gossiped
    seen = observer.core.ejected_by(["db"])
    assert set(seen) == {bad[:ID_PREFIX]}
    assert sorted(seen[bad[:ID_PREFIX]]["db"]) == sorted([nodes["client"].node_id, other.node_id])
    # A cluster not named is not read (its notes open only under the names asked for).
    assert observer.core.ejected_by(["other-cluster"]) == {}
    # Readmitted (after 10 s), the member is out of nobody's rotation: the notes go too.
    net.advance(LONG.base_ejection + SHARE_EVERY + 1.0)
    assert not nodes["client"].core.calls.outliers.ejected
    assert observer.core.ejected_by(["db"]) == {}


def test_a_node_without_the_clusters_key_reads_nothing() -> None:
    net = MemNet(seed=4, config=CoreConfig(outliers=LONG))
    nodes = mesh(net, {"a": ["db"], "b": ["db"], "c": ["db"]}, handler=fail_on({"c"}))
    keys = Keyring.generate(["cache"])
    stranger = KeyedMembershipSecurity(keys)
    eject_from(net, nodes["client"])
    net.advance(SHARE_EVERY + 1.0)
    tags = nodes["client"].core.membership.me.tags
    assert stranger.open_notes(tags, "db") == []  # sealed: noise to it


def test_the_record_carries_ejection_notes_only_in_the_room_left() -> None:
    keys = Keyring.generate(["*"])
    security = KeyedMembershipSecurity(keys)
    directory = Directory(security)
    notes = SharedEjections(security=security, randbytes=bytes, carried=directory.ejections)
    full = {f"c{i}": [bytes([i, j]) * 4 for j in range(MAX_NOTE_IDS)] for i in range(40)}
    assert notes.update(full, 0.0)
    for served in (4, 100):  # room for some notes; none
        clusters = [f"c{i}" for i in range(served)]
        tags = directory.own_tags(b"n" * 16, clusters, ["#"])
        assert len(tags) <= MAX_TAGS
        kept, directory.ejections = directory.ejections, {}
        bare = directory.own_tags(b"n" * 16, clusters, ["#"])
        directory.ejections = kept
        # Served clusters, interest and keys come first, whole; the notes have what is left.
        assert tags.startswith(bare)
        assert (len(tags) > len(bare)) == (served == 4)


def test_an_unchanged_note_keeps_its_seal_and_the_record_stays_as_it_was() -> None:
    keys = Keyring.generate(["*"])
    security = KeyedMembershipSecurity(keys)
    carried: dict[str, bytes] = {}
    salts = iter(range(1, 100))
    notes = SharedEjections(
        security=security, randbytes=lambda n: bytes([next(salts)]) * n, carried=carried
    )
    assert notes.update({"db": [b"12345678"]}, 0.0)
    sealed = carried["db"]
    assert not notes.due(0.5)
    assert notes.due(SHARE_EVERY)
    assert not notes.update({"db": [b"12345678"]}, SHARE_EVERY)  # the same: no new record
    assert carried["db"] == sealed
    assert notes.update({}, 2 * SHARE_EVERY)  # readmitted: the note goes
    assert carried == {}


def test_ejection_notes_are_checked_and_bounded() -> None:
    note = encode_ejected([b"abcdefgh", b"12345678"])
    assert note_kind(note) == NOTE_EJECTED
    assert decode_ejected(note) == [b"abcdefgh", b"12345678"]
    assert decode_ejected(encode_split(1, (("v1", 1),))) is None  # a split's: not ours
    for bad in (
        b"",
        b"\xc1",
        encode_ejected([b"short"]),
        encode_ejected([b"abcdefgh"] * (MAX_NOTE_IDS + 1)),
        encode_ejected([b"abcdefgh"])[:-1],
        b"\x92\x02\x01",
    ):
        assert decode_ejected(bad) is None
    assert MAX_NOTE_CLUSTERS * (len(encode_ejected([b"abcdefgh"] * MAX_NOTE_IDS)) + 64) < MAX_TAGS


def test_a_callers_note_is_not_a_bad_split_to_the_clusters_members() -> None:
    """Split notes and ejection notes share the cluster's locator: members watching for
    splits skip the other kind without counting it bad."""
    net = MemNet(seed=5, config=CoreConfig(outliers=LONG))
    nodes = mesh(net, {"a": ["db"], "b": ["db"], "c": ["db"]}, handler=fail_on({"c"}))
    eject_from(net, nodes["client"])
    net.advance(SHARE_EVERY + 1.0)
    assert nodes["a"].core.ejected_by(["db"])  # a member of db read it
    for name in ("a", "b", "c"):
        assert nodes[name].core.stats["split_notes_bad"] == 0
