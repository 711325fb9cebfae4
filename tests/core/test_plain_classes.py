"""The core's records, events and link tables are plain classes written to behave as the
dataclasses they replaced: the same constructor (positional or keyword-only, defaults), `==`
over the same fields, a hash for the frozen ones (none for the mutable ones), a dataclass's
repr, and, compiled, read-only attributes for the frozen ones."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import irismesh._core as core
from irismesh._core.events import (
    CloseLink,
    CreditArrived,
    LinksChanged,
    MemberEjected,
    MessagesArrived,
    PeerDown,
    PeerUp,
    ReplyArrived,
    RequestFailed,
    TunnelFrame,
)
from irismesh._core.links import DialRecord, LinkState, OutLink
from irismesh._core.records import MemberDown, MemberRecord, MemberUp
from irismesh._core.rights import UNCHECKED, PeerGrant, Rights
from irismesh._core.split import Split
from irismesh.errors import MeshError

RECORD = MemberRecord(b"n1", "tcp://127.0.0.1:1", "127.0.0.1:2", b"t", "one")


def _as_dataclass(obj: object, values: dict[str, Any], **options: bool) -> str:
    """The repr a dataclass of `obj`'s name with these fields (in this order) would give."""
    reference = dataclasses.make_dataclass(type(obj).__name__, list(values), **options)
    return repr(reference(**values))


def test_a_record_compares_and_hashes_by_what_it_says_not_by_its_proof() -> None:
    signed = MemberRecord(
        b"n1", "tcp://127.0.0.1:1", "127.0.0.1:2", b"t", "one", public=b"k", signature=b"s"
    )
    assert signed == RECORD
    assert hash(signed) == hash(RECORD)
    assert len({signed, RECORD}) == 1
    assert MemberRecord(b"n1", "tcp://127.0.0.1:1", "127.0.0.1:2", b"u", "one") != RECORD
    assert RECORD != (b"n1", "tcp://127.0.0.1:1", "127.0.0.1:2", b"t", "one")
    assert signed.public == b"k"
    assert signed.signature == b"s"
    assert MemberRecord(b"n", "e", "a").tags == b""
    assert MemberRecord(b"n", "e", "a").name == ""


def test_frozen_events_take_keywords_only_and_hash_by_their_fields() -> None:
    up = PeerUp(node_id=b"n1", endpoint="tcp://127.0.0.1:1")
    assert up.name == ""
    assert up == PeerUp(node_id=b"n1", endpoint="tcp://127.0.0.1:1", name="")
    assert up != PeerDown(node_id=b"n1", endpoint="tcp://127.0.0.1:1", reason="dead")
    assert len({up, PeerUp(node_id=b"n1", endpoint="tcp://127.0.0.1:1")}) == 1
    assert MemberUp(record=RECORD) == MemberUp(record=RECORD)
    assert hash(MemberDown(record=RECORD, reason="left")) == hash((RECORD, "left"))
    # Events without fields are all alike.
    assert CreditArrived() == CreditArrived()
    assert hash(LinksChanged()) == hash(LinksChanged())
    assert CreditArrived() != LinksChanged()
    with pytest.raises(TypeError):
        PeerUp(b"n1", "tcp://127.0.0.1:1")  # type: ignore[misc]
    with pytest.raises(TypeError):
        CloseLink()  # type: ignore[call-arg]


@pytest.mark.skipif(not core.COMPILED, reason="read-only only where compiled (mypy checks both)")
def test_frozen_ones_are_read_only_compiled() -> None:
    up = PeerUp(node_id=b"n1", endpoint="tcp://127.0.0.1:1")
    with pytest.raises(AttributeError):
        up.node_id = b"n2"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        RECORD.tags = b"x"  # type: ignore[misc]
    grant = PeerGrant(rights=Rights(), expires=1.0)
    with pytest.raises(AttributeError):
        grant.expires = 2.0  # type: ignore[misc]
    assert up.node_id == b"n1"
    assert RECORD.tags == b"t"
    assert grant.expires == 1.0


def test_mutable_events_compare_by_fields_and_have_no_hash() -> None:
    reply = ReplyArrived(7, 0, b"ok")
    assert reply.peer == b""
    assert reply == ReplyArrived(req_id=7, status=0, payload=b"ok", peer=b"")
    reply.peer = b"m"
    assert reply != ReplyArrived(7, 0, b"ok")
    with pytest.raises(TypeError):
        hash(reply)
    messages = MessagesArrived(b"r", b"p", [("t", b"x")])
    assert messages.gaps is None
    assert messages.traces is None
    assert messages == MessagesArrived(b"r", b"p", [("t", b"x")], None, None, None, None)


def test_reprs_read_as_the_dataclasses_did() -> None:
    assert repr(RECORD) == _as_dataclass(
        RECORD,
        {
            "node_id": b"n1",
            "endpoint": "tcp://127.0.0.1:1",
            "address": "127.0.0.1:2",
            "tags": b"t",
            "name": "one",
            "public": b"",
            "signature": b"",
        },
    )
    ejected = MemberEjected(cluster="c", node_id=b"n", reason="errors", seconds=5.0, ejections=1)
    assert repr(ejected) == _as_dataclass(
        ejected,
        {"cluster": "c", "node_id": b"n", "reason": "errors", "seconds": 5.0, "ejections": 1},
    )
    failed = RequestFailed(req_id=3, error=MeshError("gone"))
    assert repr(failed) == _as_dataclass(failed, {"req_id": 3, "error": failed.error})
    frame = TunnelFrame(1, 2, 3, b"d")
    assert repr(frame) == _as_dataclass(frame, {"handle": 1, "op": 2, "arg": 3, "data": b"d"})
    assert repr(LinksChanged()) == "LinksChanged()"


def test_a_split_is_positional_ordered_and_hashable() -> None:
    older = Split(1, (("a", 1),), b"p", b"s")
    newer = Split(stamp=2, weights=(), plain=b"p", sealed=b"s")
    assert older == Split(1, (("a", 1),), b"p", b"s")
    assert older != newer
    assert len({older, Split(1, (("a", 1),), b"p", b"s"), newer}) == 2
    assert newer.newer_than(older)
    assert not older.newer_than(newer)
    assert older.newer_than(None)


def test_link_tables_start_with_their_defaults_and_tables_of_their_own() -> None:
    one = OutLink(1, "tcp://127.0.0.1:1", b"n", 0.0)
    two = OutLink(2, "tcp://127.0.0.1:2", b"n", 0.0, state=LinkState.UP, peer_id=b"p")
    assert one.state is LinkState.HANDSHAKING
    assert two.state is LinkState.UP
    assert one.grant is UNCHECKED
    assert one.keys is None
    assert one.credit == 0
    assert one.offers == {}
    assert one.staged == []
    assert one.interest == set()
    one.offers[b"t"] = 1
    one.staged.append((1, 2, b""))
    assert two.offers == {}
    assert two.staged == []
    assert one != OutLink(1, "tcp://127.0.0.1:1", b"n", 0.0)  # compared by identity
    record = DialRecord("tcp://127.0.0.1:1", True)
    assert (record.failures, record.link_id, record.join, record.dropped) == (0, 0, True, b"")
    assert len({record, DialRecord("tcp://127.0.0.1:1", True)}) == 2
