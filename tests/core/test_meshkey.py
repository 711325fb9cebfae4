"""The mesh key's proofs, and the record tags that say what a node serves and reads."""

from __future__ import annotations

import os

from irismesh.security.keyring import Keyring
from irismesh.security.meshkey import MAX_INTEREST_TAGS, TAG_SIZE, KeyedMembershipSecurity

NODE, OTHER = os.urandom(16), os.urandom(16)


def test_mesh_proofs_hold_only_under_the_same_mesh_key() -> None:
    mesh = Keyring.generate(["*", "db"])
    same = KeyedMembershipSecurity(mesh)
    other = KeyedMembershipSecurity(Keyring.generate())
    proof = same.mesh_proof(b"hello", b"transcript")
    assert same.mesh_proof_ok(b"hello", b"transcript", proof)
    assert not same.mesh_proof_ok(b"welcome", b"transcript", proof)  # labels bind the role
    assert not same.mesh_proof_ok(b"hello", b"transcripT", proof)
    assert not other.mesh_proof_ok(b"hello", b"transcript", proof)
    # A keyring with only a cluster key joins the open mesh, whose proofs anyone can make.
    open_a = KeyedMembershipSecurity(Keyring.generate(["db"]))
    open_b = KeyedMembershipSecurity(Keyring.generate(["web"]))
    assert open_b.mesh_proof_ok(b"hello", b"t", open_a.mesh_proof(b"hello", b"t"))
    assert not same.mesh_proof_ok(b"hello", b"t", open_a.mesh_proof(b"hello", b"t"))


def test_a_rotated_mesh_key_is_accepted_beside_the_primary() -> None:
    old = Keyring.generate(["@mesh"])
    both = old.with_key("@mesh")  # the new key first, the old one still accepted
    proof = KeyedMembershipSecurity(old).mesh_proof(b"hello", b"t")
    assert KeyedMembershipSecurity(both).mesh_proof_ok(b"hello", b"t", proof)


def test_member_tags_prove_a_cluster_only_to_holders_of_its_key() -> None:
    keys = Keyring.generate(["*", "db"])
    member = KeyedMembershipSecurity(keys)
    tags = member.member_tags(NODE, ["db", "web"])  # db under its own key, web under '*'
    assert len(tags) == 2 * TAG_SIZE
    assert member.serves(NODE, tags, "db")
    assert member.serves(NODE, tags, "web")
    assert not member.serves(NODE, tags, "mail")
    assert not member.serves(OTHER, tags, "db")  # tags are bound to the node id
    stranger = KeyedMembershipSecurity(Keyring.generate(["*", "db"]))
    assert not stranger.serves(NODE, tags, "db")
    assert not stranger.serves(NODE, tags, "web")


def test_a_member_in_a_rotation_is_found_by_callers_on_either_key() -> None:
    old = Keyring.generate(["db"])
    rotating = old.with_key("db", primary=False)
    tags = KeyedMembershipSecurity(rotating).member_tags(NODE, ["db"])
    assert len(tags) == 2 * TAG_SIZE
    assert KeyedMembershipSecurity(old).serves(NODE, tags, "db")


def test_interest_tags_name_scopes_and_wildcards_cover_every_scope() -> None:
    keys = Keyring.generate(["*", "secret"])
    node = KeyedMembershipSecurity(keys)
    tags = node.interest_tags(NODE, ["feeds", "secret"], every_scope=False)
    assert node.reads(NODE, tags, "feeds")
    assert node.reads(NODE, tags, "secret")
    assert not node.reads(NODE, tags, "sport")
    every = node.interest_tags(NODE, [], every_scope=True)
    assert all(node.reads(NODE, every, scope) for scope in ("feeds", "secret", "sport"))
    star = keys.primary("*")
    assert star is not None
    default_only = KeyedMembershipSecurity(Keyring([star]))
    # A publisher holding only the default key cannot read 'secret' the way its subscriber does.
    assert default_only.reads(NODE, tags, "feeds")
    assert not default_only.reads(NODE, tags, "secret")


def test_too_many_scopes_become_every_scope() -> None:
    node = KeyedMembershipSecurity(Keyring.generate())
    scopes = [f"s{i}" for i in range(MAX_INTEREST_TAGS + 1)]
    tags = node.interest_tags(NODE, scopes, every_scope=False)
    assert len(tags) == TAG_SIZE  # one: every scope under the default key
    assert node.reads(NODE, tags, "anything")
