"""Grants and revocations: the token format, its verification, rights, trust and files."""

from __future__ import annotations

import base64
import os
import random
import stat
from collections import Counter

import grant_fuzz
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh._core.rights import (
    UNCHECKED,
    UNGRANTED,
    Rights,
    pattern_covers,
    patterns_meet,
    subscription_allowed,
)
from irismesh._core.topics import topic_matches
from irismesh.errors import ConfigurationError, ProtocolError
from irismesh.security.grants import (
    MAX_TOKEN,
    Authority,
    Grant,
    GrantError,
    GrantFile,
    NodeGrants,
    Revocation,
    parse_duration,
)
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring

NOW = 1_800_000_000.0
AUTHORITY = Authority.generate()
NODE = Identity.generate()

segments = st.sampled_from(["a", "b", "c", "*", "#"])
patterns = st.lists(segments, min_size=1, max_size=5).map(".".join)
topics = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=6).map(".".join)
names = st.lists(st.sampled_from(["db", "cache", "payroll", "*"]), max_size=3, unique=True)
topic_lists = st.lists(patterns, max_size=3, unique=True)
rights_st = st.builds(
    Rights,
    serve=names.map(tuple),
    call=names.map(tuple),
    publish=topic_lists.map(tuple),
    publish_deny=topic_lists.map(tuple),
    subscribe=topic_lists.map(tuple),
    subscribe_deny=topic_lists.map(tuple),
    memory=st.booleans(),
    gateway_export=names.map(tuple),
    gateway_import=names.map(tuple),
)


def all_topics(depth: int = 5) -> list[str]:
    found: list[str] = []
    layer = [""]
    for _ in range(depth):
        layer = [f"{t}.{s}" if t else s for t in layer for s in "abc"]
        found += layer
    return found


TOPICS = all_topics()
TOPICS_6 = all_topics(6)
short_patterns = st.lists(segments, min_size=1, max_size=3).map(".".join)


# ----------------------------------------------------------------- rights


@settings(max_examples=300, deadline=None)
@given(patterns, patterns)
def test_covers_agrees_with_the_matcher(allow: str, pattern: str) -> None:
    """Over every topic of up to five segments: `allow` covers `pattern` iff every topic the
    pattern matches, allow matches (the short topics decide: wildcards match alike deeper)."""
    matched = [t for t in TOPICS if topic_matches(pattern, t)]
    if all(topic_matches(allow, t) for t in matched):
        # Agreement on short topics; deeper ones can differ only when "#" spans more.
        if pattern_covers(allow, pattern):
            return
        assert "#" in pattern
    else:
        assert not pattern_covers(allow, pattern)


@settings(max_examples=300, deadline=None)
@given(short_patterns, short_patterns)
def test_meet_agrees_with_the_matcher(first: str, second: str) -> None:
    """Two patterns of up to three segments meet, if at all, in a topic of up to six."""
    both = any(topic_matches(first, t) and topic_matches(second, t) for t in TOPICS_6)
    assert patterns_meet(first, second) == both
    assert patterns_meet(second, first) == both


@given(topics, patterns)
def test_a_topic_is_covered_exactly_when_matched(topic: str, pattern: str) -> None:
    assert pattern_covers(pattern, topic) == topic_matches(pattern, topic)


@given(rights_st, topics)
def test_deny_wins_for_publishing(rights: Rights, topic: str) -> None:
    allowed = rights.may_publish(topic)
    if any(topic_matches(p, topic) for p in rights.publish_deny):
        assert not allowed
    else:
        # A gateway republishes what it may import.
        allow = (*rights.publish, *rights.gateway_import)
        assert allowed == any(topic_matches(p, topic) for p in allow)


@given(rights_st, patterns, topics)
def test_an_allowed_subscription_never_reads_a_denied_topic(
    rights: Rights, pattern: str, topic: str
) -> None:
    if rights.may_subscribe(pattern) and topic_matches(pattern, topic):
        # A gateway subscribes to what it may export.
        assert any(topic_matches(p, topic) for p in (*rights.subscribe, *rights.gateway_export))
        assert not any(topic_matches(p, topic) for p in rights.subscribe_deny)


def test_subscription_examples() -> None:
    assert subscription_allowed("feeds.#", ("feeds.#",), ())
    assert subscription_allowed("feeds.sport.*", ("feeds.#",), ())
    assert not subscription_allowed("feeds.#", ("feeds.sport.#",), ())
    assert not subscription_allowed("feeds.#", ("feeds.#",), ("feeds.secret.#",))
    assert subscription_allowed("feeds.sport.#", ("feeds.#",), ("feeds.secret.#",))
    assert not subscription_allowed("#", ("feeds.#",), ())
    assert Rights(call=("*",)).may_call("anything")
    assert not Rights(call=("db",)).may_call("payroll")


def test_gateway_rights_cover_what_exercising_them_takes() -> None:
    gateway = Rights(gateway_export=("db", "feeds.#"), gateway_import=("cache", "news.#"))
    assert gateway.may_call("db")
    assert not gateway.may_call("cache")
    assert gateway.may_serve("cache")
    assert not gateway.may_serve("db")
    assert gateway.may_subscribe("feeds.sport.#")
    assert not gateway.may_subscribe("news.#")
    assert gateway.may_publish("news.x")
    assert not gateway.may_publish("feeds.x")
    assert gateway.may_call("_gateway")
    assert gateway.may_serve("_gateway")
    assert not Rights(call=("*",)).may_serve("_gateway")
    assert gateway.may_export_topics("feeds.x.#")
    assert not gateway.may_export_topics("#")
    assert gateway.may_import_topic("news.x")
    assert not gateway.may_import_topic("feeds.x")
    denied = Rights(gateway_import=("news.#",), publish_deny=("news.secret",))
    assert not denied.may_publish("news.secret")  # a deny list still wins


# ----------------------------------------------------------------- tokens


@settings(max_examples=100, deadline=None)
@given(rights_st, st.integers(1, 10**8))
def test_a_grant_round_trips(rights: Rights, lifetime: int) -> None:
    grant = AUTHORITY.grant(NODE.public, rights, expires_in=lifetime, issued=NOW)
    again = Grant.decode(grant.token)
    assert again == grant
    assert again.rights == rights
    assert again.node == NODE.public
    assert (again.issued, again.expires) == (int(NOW), int(NOW) + lifetime)
    assert Grant.from_text(grant.to_text()) == grant
    assert Grant.from_text(base64.b64encode(grant.token).decode()) == grant
    assert len(grant.token) <= MAX_TOKEN


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 255))
def test_any_changed_byte_is_refused(position: int, xor: int) -> None:
    grant = AUTHORITY.grant(NODE.public, Rights(call=("db",)), expires_in=60, issued=NOW)
    token = bytearray(grant.token)
    token[position % len(token)] ^= xor
    with pytest.raises(GrantError):
        Grant.decode(bytes(token))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    for decode in (Grant.decode, Revocation.decode):
        with pytest.raises(GrantError):
            decode(data)
        with pytest.raises(GrantError):
            decode(b"IG\x01" + data)


def _resigned(body: object) -> bytes:
    """A token of `body` signed properly by AUTHORITY (a well-signed but odd grant)."""
    return AUTHORITY._sign(b"irismesh grant v1\x00", b"IG", msgpack.packb(body))


@pytest.mark.parametrize(
    "body",
    [
        [1, 2, 3],
        {"node": b"x" * 31, "iat": 1, "exp": 2},
        {"node": b"x" * 32, "iat": 5, "exp": 5},
        {"node": b"x" * 32, "iat": 1, "exp": 2, "root": True},
        {"node": b"x" * 32, "iat": 1, "exp": 2, "call": "db"},
        {"node": b"x" * 32, "iat": 1, "exp": 2, "sub": ["feeds..x"]},
        {"node": b"x" * 32, "iat": 1, "exp": 2, "mem": 1},
        {"node": b"x" * 32, "iat": 1.5, "exp": 2},
    ],
)
def test_well_signed_nonsense_is_refused(body: object) -> None:
    with pytest.raises(GrantError):
        Grant.decode(_resigned(body))


def test_a_revocation_is_not_a_grant() -> None:
    revocation = AUTHORITY.revoke(NODE.public, before=NOW)
    assert Revocation.decode(revocation.token) == revocation
    with pytest.raises(GrantError):
        Grant.decode(revocation.token)
    grant = AUTHORITY.grant(NODE.public, Rights(), issued=NOW)
    with pytest.raises(GrantError):
        Revocation.decode(grant.token)
    # The kind is signed: a grant relabelled as a revocation fails its signature.
    with pytest.raises(GrantError):
        Revocation.decode(b"IR" + grant.token[2:])


def test_seeded_fuzz_run_of_mutated_tokens() -> None:
    """20,000 mutations of real tokens (flips, cuts, splices, random tails): each is refused
    with GrantError or decodes to the very token it came from (bench/fuzz_grants.py runs
    longer)."""
    tokens = grant_fuzz.sources()
    rng = random.Random(7)
    verdicts = Counter(
        grant_fuzz.verdict(grant_fuzz.mutate(tokens, rng), tokens) for _ in range(20_000)
    )
    # Only a splice at byte 0 or a cut at the end keeps a token whole.
    assert verdicts["refused"] > 19_500
    assert set(verdicts) <= {"refused", "intact"}


# ----------------------------------------------------------------- the policy


def policy(
    *, required: bool = True, grant: Grant | None = None, trusted: bool = True
) -> NodeGrants:
    authorities = [AUTHORITY.public] if trusted else []
    return NodeGrants(
        public=NODE.public,
        authorities=authorities,
        required=required,
        grant=grant,
        clock=lambda: NOW,
    )


def test_a_peer_grant_is_checked_once_and_holds() -> None:
    peer = Identity.generate()
    grant = AUTHORITY.grant(peer.public, Rights(call=("db",)), expires_in=60, issued=NOW - 1)
    checks = policy()
    held = checks.admit(peer.public, grant.token)
    assert held.rights.may_call("db")
    assert not held.rights.may_call("payroll")
    assert checks.holds(peer.public, held)
    # Another key presenting it gets nothing; so does an untrusted authority's grant.
    assert checks.admit(NODE.public, grant.token) is UNGRANTED
    assert policy(trusted=False).admit(peer.public, grant.token) is UNGRANTED
    # Not required: anything goes, unchecked.
    assert policy(required=False).admit(peer.public, b"") is UNCHECKED


def test_expiry_and_revocation() -> None:
    peer = Identity.generate()
    grant = AUTHORITY.grant(peer.public, Rights(call=("db",)), expires_in=60, issued=NOW - 1)
    clock = [NOW]
    checks = NodeGrants(
        public=NODE.public, authorities=[AUTHORITY.public], required=True, clock=lambda: clock[0]
    )
    held = checks.admit(peer.public, grant.token)
    clock[0] = NOW + 58.9  # issued NOW - 1: expires at NOW + 59
    assert checks.holds(peer.public, held)
    clock[0] = grant.expires
    assert not checks.holds(peer.public, held)
    assert checks.admit(peer.public, grant.token) is UNGRANTED
    clock[0] = NOW
    revocation = AUTHORITY.revoke(peer.public, before=NOW)
    assert checks.learn_revocation(revocation.token) == revocation
    assert checks.learn_revocation(revocation.token) is None  # known already
    assert not checks.holds(peer.public, held)
    with pytest.raises(ProtocolError):
        checks.admit(peer.public, grant.token)
    with pytest.raises(ProtocolError):
        checks.admit(peer.public, b"")
    # A grant issued after the revocation works again.
    renewed = AUTHORITY.grant(peer.public, Rights(call=("db",)), issued=NOW + 5)
    clock[0] = NOW + 6
    assert checks.admit(peer.public, renewed.token).rights.may_call("db")
    # An untrusted authority's revocation changes nothing.
    stranger = Authority.generate()
    assert checks.learn_revocation(stranger.revoke(peer.public).token) is None
    assert checks.stats["revocations_untrusted"] == 1


def test_own_grant() -> None:
    grant = AUTHORITY.grant(NODE.public, Rights(serve=("db",)), issued=NOW - 1)
    assert policy(grant=grant).own().rights.may_serve("db")
    assert policy(grant=None).own() is UNGRANTED
    other = AUTHORITY.grant(Identity.generate().public, Rights(serve=("db",)), issued=NOW)
    assert policy(grant=other).own() is UNGRANTED
    assert policy(required=False).own() is UNCHECKED


# ----------------------------------------------------------------- files and trust


def test_authority_file_is_private(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "authority.key")
    AUTHORITY.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Authority.load(path).public == AUTHORITY.public
    with pytest.raises(ConfigurationError):
        AUTHORITY.save(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigurationError):
        Authority.load(path)


def test_keyring_trust_lines() -> None:
    public = base64.b64encode(AUTHORITY.public).decode()
    text = f"# irismesh keyring v1\n* {base64.b64encode(bytes(32)).decode()}\n"
    text += f"@authority {public}\n@require-grants\n"
    keyring = Keyring.from_text(text)
    assert keyring.authorities == (AUTHORITY.public,)
    assert keyring.require_grants
    again = Keyring.from_text(keyring.to_text())
    assert again == keyring
    assert keyring.with_key("db").require_grants
    assert keyring != keyring.with_trust(require_grants=False)
    with pytest.raises(ConfigurationError):
        Keyring.from_text(text + "@authority abc\n")


def test_grant_file_is_reread_when_it_changes(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "node.grant")
    first = AUTHORITY.grant(NODE.public, Rights(call=("db",)), issued=NOW)
    first.save(path)
    watch = GrantFile(path, Grant.load(path))
    assert watch.poll() is None
    second = AUTHORITY.grant(NODE.public, Rights(call=("db", "cache")), issued=NOW + 1)
    second.save(path)
    seen = [watch.poll() for _ in range(3)]
    assert seen[0] is None  # seen changed once: read at the next poll if it stays so
    assert seen[1] == second
    assert seen[2] is None


def test_durations() -> None:
    assert parse_duration("30d") == 30 * 86400
    assert parse_duration("90s") == 90
    assert parse_duration("2") == 2
    for bad in ("", "x", "-1d", "0"):
        with pytest.raises(ConfigurationError):
            parse_duration(bad)
