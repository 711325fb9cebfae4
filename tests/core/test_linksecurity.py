"""X25519 link keys, keyed offer tags and AES-256-GCM sealers (security/linksecurity.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from irismesh.errors import ProtocolError
from irismesh.security.keyring import Keyring
from irismesh.security.linksecurity import KeyedLinkSecurity, X25519LinkKeys

LN, DN = os.urandom(16), os.urandom(16)
HEADER = b"\x49\x01\x05\x00\x00\x01" + bytes(8)


def linked(
    listener_keys: Keyring, dialler_keys: Keyring
) -> tuple[KeyedLinkSecurity, X25519LinkKeys, KeyedLinkSecurity, X25519LinkKeys]:
    listener, dialler = KeyedLinkSecurity(listener_keys), KeyedLinkSecurity(dialler_keys)
    lk, dk = listener.begin(), dialler.begin()
    lk.establish(dk.public, LN, DN)
    dk.establish(lk.public, LN, DN)
    return listener, lk, dialler, dk


def test_each_direction_has_its_own_key_and_both_ends_agree() -> None:
    keys = Keyring.generate()
    _, lk, _, dk = linked(keys, keys)
    for handle in (None, *[h for _t, h in KeyedLinkSecurity(keys).offers("db", LN, DN)]):
        sealed = dk.sealer(handle, True).seal(HEADER, 1, b"request")
        assert lk.sealer(handle, True).open(HEADER, 1, sealed) == b"request"
        assert b"request" not in sealed
        with pytest.raises(ProtocolError, match="bad_seal"):  # the other direction's key
            lk.sealer(handle, False).open(HEADER, 1, sealed)


def test_tampering_with_body_header_or_seq_is_detected() -> None:
    keys = Keyring.generate()
    _, lk, _, dk = linked(keys, keys)
    sealed = dk.sealer(None, True).seal(HEADER, 7, b"hello")
    opener = lk.sealer(None, True)
    flipped = bytes([sealed[0] ^ 1]) + sealed[1:]
    for header, seq, body in [
        (HEADER, 7, flipped),
        (HEADER[:-1] + b"\x01", 7, sealed),
        (HEADER, 8, sealed),
    ]:
        with pytest.raises(ProtocolError, match="bad_seal"):
            opener.open(header, seq, body)


def test_link_keys_are_fresh_per_link() -> None:
    keys = Keyring.generate()
    _, _lk1, _, dk1 = linked(keys, keys)
    _, lk2, _, _ = linked(keys, keys)
    sealed = dk1.sealer(None, True).seal(HEADER, 1, b"x")
    with pytest.raises(ProtocolError):
        lk2.sealer(None, True).open(HEADER, 1, sealed)


def test_cluster_traffic_needs_the_cluster_key_even_with_the_link_keys() -> None:
    member_keys = Keyring.generate(["db"])
    _, lk, _, dk = linked(member_keys, Keyring.generate(["db"]))  # same name, other key
    [(tag, handle)] = KeyedLinkSecurity(member_keys).offers("db", LN, DN)
    rogue = KeyedLinkSecurity(Keyring.generate(["db"]))
    assert rogue.match("db", LN, DN, {tag: 1}) is None  # cannot even tell the member serves db
    [(_rogue_tag, rogue_handle)] = rogue.offers("db", LN, DN)
    forged = dk.sealer(rogue_handle, True).seal(HEADER, 1, b"request")
    with pytest.raises(ProtocolError, match="bad_seal"):
        lk.sealer(handle, True).open(HEADER, 1, forged)


def test_a_default_key_still_separates_clusters() -> None:
    keys = Keyring.generate()  # only '*'
    _, lk, _, dk = linked(keys, keys)
    security = KeyedLinkSecurity(keys)
    [(_t1, db)] = security.offers("db", LN, DN)
    [(_t2, cache)] = security.offers("cache", LN, DN)
    sealed = dk.sealer(db, True).seal(HEADER, 1, b"x")
    with pytest.raises(ProtocolError):
        lk.sealer(cache, True).open(HEADER, 1, sealed)


def test_rotation_works_while_two_nodes_share_one_key() -> None:
    old = Keyring.generate(["db"])
    both = old.with_key("db")  # new key primary, old still accepted
    [new_key] = [k for k in both if k not in set(old)]
    new_only = Keyring([new_key])
    member = KeyedLinkSecurity(both)
    offered = {tag: slot for slot, (tag, _h) in enumerate(member.offers("db", LN, DN), start=1)}
    assert len(offered) == 2
    assert KeyedLinkSecurity(old).match("db", LN, DN, offered) is not None
    assert KeyedLinkSecurity(new_only).match("db", LN, DN, offered) is not None
    stranger = KeyedLinkSecurity(Keyring.generate(["db"]))
    assert stranger.match("db", LN, DN, offered) is None


@pytest.mark.parametrize("public", [bytes(32), b"\x01" + bytes(31), b"short"])
def test_unusable_key_agreement_is_a_handshake_error(public: bytes) -> None:
    keys = X25519LinkKeys(sealing=True)
    with pytest.raises(ProtocolError, match="bad_handshake"):
        keys.establish(public, LN, DN)


@given(st.binary(max_size=200), st.integers(min_value=1, max_value=2**64 - 1))
def test_garbage_never_opens(garbage: bytes, seq: int) -> None:
    keys = Keyring.generate()
    _, lk, _, _ = linked(keys, keys)
    with pytest.raises(ProtocolError, match="bad_seal"):
        lk.sealer(None, True).open(HEADER, seq, garbage)
