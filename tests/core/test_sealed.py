"""Cluster names sealed into survey slots: who opens what, and what a slot is bound to."""

from __future__ import annotations

import os

from irismesh.discovery.sealed import SLOT_LEN, SLOTS, ClusterSeal
from irismesh.security.keyring import Keyring, ScopeKey

NODE, ENDPOINT, TIME = bytes(range(16)), "tcp://127.0.0.1:7400", 1_700_000_000_000


def key(scope: str, secret: bytes | None = None) -> ScopeKey:
    return ScopeKey(scope=scope, secret=os.urandom(32) if secret is None else secret)


def opened(sender: ClusterSeal, receiver: ClusterSeal, turns: int = 1) -> set[str]:
    names: set[str] = set()
    for turn in range(turns):
        slots = sender.seal(NODE, ENDPOINT, TIME, turn)
        assert len(slots) == SLOTS
        assert all(len(s) == SLOT_LEN for s in slots)
        names |= set(receiver.open(NODE, ENDPOINT, TIME, slots).names)
    return names


STAR, DB, MESH = key("*"), key("db"), key("@mesh")
MEMBER = Keyring([STAR, DB])


def test_each_name_opens_under_its_own_key_and_the_star_key() -> None:
    member = ClusterSeal(MEMBER, ["db", "echo"])
    assert opened(member, ClusterSeal(Keyring([STAR]))) == {"db", "echo"}
    assert opened(member, ClusterSeal(Keyring([DB]))) == {"db"}
    assert opened(member, ClusterSeal(Keyring([key("*")]))) == set()
    assert opened(member, ClusterSeal(Keyring([MESH]))) == set()
    assert opened(member, ClusterSeal(None)) == set()


def test_a_receiver_shows_a_name_only_where_its_keyring_would_use_that_key() -> None:
    # Every node shares one key; the receiver holds it as db's key alone, not as '*'.
    shared = key("*")
    member = ClusterSeal(Keyring([shared]), ["db", "echo"])
    assert opened(member, ClusterSeal(Keyring([key("db", shared.secret)]))) == {"db"}


def test_a_slot_is_bound_to_its_sender_endpoint_and_time() -> None:
    member, star = ClusterSeal(MEMBER, ["db"]), ClusterSeal(Keyring([STAR]))
    slots = member.seal(NODE, ENDPOINT, TIME, 0)
    assert star.open(NODE, ENDPOINT, TIME, slots).names == ("db",)
    for node, endpoint, at in [
        (bytes(16), ENDPOINT, TIME),
        (NODE, "tcp://127.0.0.1:7401", TIME),
        (NODE, ENDPOINT, TIME + 1),
    ]:
        assert star.open(node, endpoint, at, slots).proven is False


def test_a_node_holding_a_key_proves_it_even_serving_nothing() -> None:
    client = ClusterSeal(Keyring([DB]))
    result = ClusterSeal(MEMBER, ["db"]).open(
        NODE, ENDPOINT, TIME, client.seal(NODE, ENDPOINT, TIME, 0)
    )
    assert result.proven
    assert result.names == ()
    stranger = ClusterSeal(Keyring([key("db")]))
    assert not stranger.open(NODE, ENDPOINT, TIME, client.seal(NODE, ENDPOINT, TIME, 0)).proven


def test_many_long_names_go_out_a_datagram_at_a_time() -> None:
    names = [f"{i:02d}" + "x" * 198 for i in range(64)]  # the most a node serves, the longest
    member = ClusterSeal(Keyring([STAR]), names)
    assert member.slot_count == 64
    assert opened(member, ClusterSeal(Keyring([STAR])), turns=16) == set(names)


def test_names_a_key_holder_sealed_badly_are_ignored() -> None:
    star = ClusterSeal(Keyring([STAR]))
    # A holder of the key may seal anything; what is not a cluster name is dropped.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from irismesh.discovery import sealed

    aead: AESGCM = sealed._slot_aead(STAR.secret)
    plain = b"ok\n*\n@mesh\nno spaces\n\xff\n" + b"x" * 201
    plain += bytes(sealed.SLOT_PLAIN - len(plain))
    nonce = os.urandom(sealed.NONCE_LEN)
    slot = nonce + aead.encrypt(nonce, plain, sealed._associated(NODE, ENDPOINT, TIME))
    assert star.open(NODE, ENDPOINT, TIME, [slot]).names == ("ok",)
