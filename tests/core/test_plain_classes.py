"""The core's records, events and link tables are plain classes written to behave as the
dataclasses they replaced: the same constructor (positional or keyword-only, defaults), `==`
over the same fields, a hash for the frozen ones (none for the mutable ones), a dataclass's
repr, and, compiled, read-only attributes for the frozen ones. Their fields, which the repr,
`==` and hash go through, are the annotations of the class body, in order, compiled or not."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

import irismesh._core as core
from irismesh._core import admission, events, links, outliers, plain, probes, records, rights, split
from irismesh._core.events import (
    CloseLink,
    CreditArrived,
    LinksChanged,
    MemberEjected,
    MessagesArrived,
    PeerDown,
    PeerUp,
    ReplyArrived,
    RequestArrived,
    RequestFailed,
    TunnelFrame,
)
from irismesh._core.links import DialRecord, InLink, LinkState, OutLink, TunnelEnd
from irismesh._core.records import MemberDown, MemberRecord, MemberUp
from irismesh._core.rights import UNCHECKED, PeerGrant, Rights
from irismesh._core.split import Split
from irismesh.errors import MeshError

MODULES = (admission, events, links, outliers, probes, records, rights, split)

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
    two = OutLink(2, "tcp://127.0.0.1:2", b"n", 0.0)
    two.state = LinkState.UP
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
    inlink = InLink(b"r", b"p", "tcp://127.0.0.1:3", b"n", b"m", 0.0, [None])
    assert (inlink.send_seq, inlink.public, inlink.grant, inlink.topics_heard) == (
        0,
        b"",
        UNCHECKED,
        None,
    )
    assert inlink.refused == frozenset()
    assert inlink.staged is not InLink(b"r", b"p", "e", b"n", b"m", 0.0, []).staged
    end = TunnelEnd(3, 4, "db", b"p", 1)
    assert (end.out, end.inlink, end.send_credit, end.recv_allowed, end.accepted) == (
        None,
        None,
        0,
        0,
        False,
    )


def _declared(cls: type) -> list[str]:
    """The names annotated in `cls`'s body, in order, read from its source: after those of
    its bases in the same module (a subclass's fields follow its base's)."""
    name = cls.__module__.rsplit(".", 1)[1]
    source = (Path(core.__file__).parent / f"{name}.py").read_text()
    classes = {
        node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)
    }

    def fields(node: ast.ClassDef) -> list[str]:
        inherited = [
            field
            for base in node.bases
            if isinstance(base, ast.Name) and base.id in classes
            for field in fields(classes[base.id])
        ]
        body = [item for item in node.body if isinstance(item, ast.AnnAssign)]
        own = [item.target.id for item in body if isinstance(item.target, ast.Name)]
        return inherited + own

    if cls.__name__ not in classes:
        raise AssertionError(f"no class {cls.__name__}")
    return fields(classes[cls.__name__])


def test_every_plain_class_finds_its_fields_in_the_order_declared() -> None:
    found = [
        cls
        for module in MODULES
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, plain.Plain)
        and cls.__module__ == module.__name__
    ]
    assert len(found) >= 30
    for cls in found:
        assert list(plain._fields_of(cls)) == _declared(cls), cls.__name__


def test_a_request_and_a_link_repr_every_field_in_order() -> None:
    request = RequestArrived((b"c", 1, b"l", 2), "db", b"x", priority=3)
    assert repr(request) == _as_dataclass(
        request,
        {
            "token": (b"c", 1, b"l", 2),
            "cluster": "db",
            "payload": b"x",
            "kind": 5,
            "deadline": float("inf"),
            "priority": 3,
            "trace": b"",
        },
    )
    assert request == RequestArrived((b"c", 1, b"l", 2), "db", b"x", 5, float("inf"), 3)
    # Every field has its value, from the class body or from __init__: the repr reads each.
    assert repr(InLink(b"r", b"p", "e", b"n", b"m", 0.0, [])).endswith("topics_heard=None)")
    assert repr(TunnelEnd(3, 4, "db", b"p", 1)).endswith("accepted=False)")
    assert repr(DialRecord("e", False)).endswith("dropped=b'')")
    text = repr(OutLink(1, "tcp://127.0.0.1:1", b"n", 0.5))
    assert text.startswith(
        "OutLink(link_id=1, endpoint='tcp://127.0.0.1:1', nonce=b'n', opened=0.5, "
        "state=<LinkState.HANDSHAKING: 'handshaking'>, peer_id=b'', "
    )
    assert text.endswith("pub_slot=0, topic_slots={}, handles={})")
