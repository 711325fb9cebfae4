"""Far gateways' identities and grants in the inter-mesh link handshake (in memory, no
sockets): the signature over the transcript, the far grant's verdicts, the limits it sets, and
the link following its expiry and revocation."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh._core.rights import Rights
from irismesh.errors import ProtocolError
from irismesh.federation.grants import FarGrantPolicy
from irismesh.federation.linkproto import Exports, LinkConfig, LinkEnd, open_hello
from irismesh.federation.linkwire import HEADER, HELLO_DOMAIN, WELCOME_DOMAIN, mac, pack, unpack
from irismesh.security.grants import Authority, NodeGrants
from irismesh.security.identity import Identity

KEY = os.urandom(32)
AUTHORITY = Authority.generate()
GATEWAY = Rights(gateway_export=("db", "feeds.#"), gateway_import=("db", "news.#"))


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def policy(clock: Clock, *authorities: bytes) -> FarGrantPolicy:
    mesh = NodeGrants(public=b"", clock=clock)
    return FarGrantPolicy(mesh, authorities or (AUTHORITY.public,))


def end(
    *,
    dialler: bool,
    rights: Rights | None = GATEWAY,
    require: FarGrantPolicy | None = None,
    clock: Clock | None = None,
    authority: Authority = AUTHORITY,
    expires_in: float = 3600,
    exports: Exports | None = None,
) -> LinkEnd:
    identity = Identity.generate()
    token = b""
    if rights is not None:
        issued = (clock or Clock())()
        token = authority.grant(identity.public, rights, issued=issued, expires_in=expires_in).token
    return LinkEnd(
        gateway_id=os.urandom(16),
        mesh="b" if dialler else "a",
        secrets=(KEY,),
        exports=exports or Exports(),
        dialler=dialler,
        config=LinkConfig(),
        identity=identity,
        grant_token=lambda: token,
        far_grants=require,
    )


def welcome_for(dialler: LinkEnd, listener: LinkEnd, now: float = 0.0) -> bytes:
    [hello] = dialler.outgoing(now)
    return listener.accept(open_hello(hello, listener.secrets), now)


def remac_hello(fields: list[object], signature: bytes | None) -> bytes:
    """A HELLO a holder of the link key builds from `fields` (and a signature, if any)."""
    raw = pack(fields)
    body: list[bytes] = [raw, mac(KEY, HELLO_DOMAIN, raw)]
    if signature is not None:
        body.append(signature)
    return HEADER.pack(b"IMF", 1, 1, 0) + pack(body)


def test_both_ends_show_and_check_each_others_grant() -> None:
    clock = Clock()
    d = end(dialler=True, require=policy(clock), clock=clock)
    listener_exports = Exports(clusters=("db", "payroll"), topics=("feeds.#", "secret.#"))
    lst = end(dialler=False, require=policy(clock), clock=clock, exports=listener_exports)
    assert d.receive(welcome_for(d, lst), 0.0) == []
    assert d.up
    assert lst.up
    assert d.identity is not None
    assert lst.identity is not None
    assert lst.peer_public == d.identity.public
    assert d.peer_public == lst.identity.public
    assert d.peer_grant is not None
    assert d.peer_grant.rights == GATEWAY
    # What the listener exports beyond its grant's `export` is not taken from it.
    assert d.peer_exports == Exports(clusters=("db",), topics=("feeds.#",))
    assert d.stats["far_exports_refused"] == 2
    assert [d.far_may_import_cluster(c) for c in ("db", "payroll")] == [True, False]
    assert [d.far_may_import_topic(t) for t in ("news.x", "feeds.x")] == [True, False]
    assert [d.far_may_export_topic(t) for t in ("feeds.x", "news.x")] == [True, False]


def test_without_the_switch_the_handshake_is_as_before() -> None:
    d, lst = end(dialler=True), end(dialler=False)
    [hello] = d.outgoing(0.0)
    body = unpack(hello[HEADER.size :])
    assert len(body) == 2
    assert len(unpack(body[0])) == 8
    welcome = lst.accept(open_hello(hello, lst.secrets), 0.0)
    body = unpack(welcome[HEADER.size :])
    assert len(body) == 2
    assert len(unpack(body[0])) == 8
    d.receive(welcome, 0.0)
    assert d.up
    assert d.peer_public == b""
    assert d.peer_grant is None
    assert d.far_may_import_cluster("anything")
    assert d.far_may_export_topic("any.topic")


def test_a_listener_without_the_switch_shows_itself_to_a_dialler_that_requires() -> None:
    clock = Clock()
    d = end(dialler=True, require=policy(clock), clock=clock)
    lst = end(dialler=False, clock=clock)
    [hello] = d.outgoing(0.0)
    assert len(unpack(unpack(hello[HEADER.size :])[0])) == 10
    d.receive(lst.accept(open_hello(hello, lst.secrets), 0.0), 0.0)
    assert d.up
    assert d.peer_grant is not None
    assert lst.peer_grant is None  # shown to it, not checked by it
    assert d.identity is not None
    assert lst.peer_public == d.identity.public


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("none shown", "no_grant"),
        ("no grant", "no_grant"),
        ("untrusted authority", "grant_refused"),
        ("expired", "grant_refused"),
        ("no gateway right", "grant_refused"),
    ],
)
def test_a_far_gateway_whose_grant_does_not_hold_is_refused(case: str, reason: str) -> None:
    clock = Clock()
    kwargs: dict[str, object] = {}
    if case == "none shown":
        kwargs = {"rights": None, "require": None}  # an earlier release's HELLO
    elif case == "no grant":
        kwargs = {"rights": None, "require": policy(clock)}
    elif case == "untrusted authority":
        kwargs = {"authority": Authority.generate(), "require": policy(clock)}
    elif case == "expired":
        kwargs = {"expires_in": 10, "require": policy(clock)}
        clock.now -= 100  # issued 100 s ago, for 10 s
    elif case == "no gateway right":
        kwargs = {"rights": Rights(call=("db",)), "require": policy(clock)}
    d = end(dialler=True, clock=clock, **kwargs)  # type: ignore[arg-type]
    clock.now = Clock().now
    lst = end(dialler=False, require=policy(clock), clock=clock)
    [hello] = d.outgoing(0.0)
    with pytest.raises(ProtocolError) as caught:
        lst.accept(open_hello(hello, lst.secrets), 0.0)
    assert caught.value.reason == reason
    assert not lst.up


def test_a_listener_whose_grant_does_not_hold_is_refused_by_the_dialler() -> None:
    clock = Clock()
    d = end(dialler=True, require=policy(clock), clock=clock)
    lst = end(dialler=False, clock=clock, authority=Authority.generate())
    with pytest.raises(ProtocolError) as caught:
        d.receive(welcome_for(d, lst), 0.0)
    assert caught.value.reason == "grant_refused"
    assert d.stats["dropped_grant_refused"] == 1
    assert not d.up
    assert d.hello_due(1.0)  # it says HELLO again after `retry`


def a_signed_hello() -> tuple[LinkEnd, bytes, bytes, bytes]:
    """A listener requiring far grants, and a dialler's HELLO requiring them: the frame, its
    fields (packed) and its signature."""
    clock = Clock()
    d = end(dialler=True, require=policy(clock), clock=clock)
    lst = end(dialler=False, require=policy(clock), clock=clock)
    [hello] = d.outgoing(0.0)
    raw, _, signature = unpack(hello[HEADER.size :])
    return lst, hello, raw, signature


def test_a_tampered_grant_fails_the_signature() -> None:
    lst, _hello, raw, signature = a_signed_hello()
    fields = unpack(raw)
    # Another grant of the authority's, for a key the holder of the link key controls.
    other = Identity.generate()
    fields[9] = AUTHORITY.grant(other.public, Rights(gateway_import=("*",))).token
    with pytest.raises(ProtocolError) as caught:
        open_hello(remac_hello(fields, signature), lst.secrets)
    assert caught.value.reason == "bad_signature"
    # Its own key in the HELLO, with the grant of the gateway it copies: the grant names
    # another key.
    fields = unpack(raw)
    fields[8] = other.public
    resigned = other.sign(b"irismesh/v1/federation-hello-signed\x00" + pack(fields))
    with pytest.raises(ProtocolError) as caught:
        lst.accept(open_hello(remac_hello(fields, resigned), lst.secrets), 0.0)
    assert caught.value.reason == "grant_refused"


def test_another_gateways_signed_hello_cannot_be_replayed_as_ones_own() -> None:
    lst, hello, raw, signature = a_signed_hello()
    # A holder of the link key keeps the identity, grant and signature but needs its own
    # ephemeral key (and a fresh nonce) to have a session: the signature no longer holds.
    rogue = end(dialler=True, rights=None)
    [own] = rogue.outgoing(0.0)
    fields = unpack(unpack(own[HEADER.size :])[0])
    fields += unpack(raw)[8:]
    with pytest.raises(ProtocolError) as caught:
        open_hello(remac_hello(fields, signature), lst.secrets)
    assert caught.value.reason == "bad_signature"
    # Sent again as it was, the HELLO is a replay the listener refuses.
    lst.accept(open_hello(hello, lst.secrets), 0.0)
    with pytest.raises(ProtocolError) as caught:
        lst.accept(open_hello(hello, lst.secrets), 0.0)
    assert caught.value.reason == "replay"


def test_a_welcome_signed_for_another_hello_fails() -> None:
    clock = Clock()
    d = end(dialler=True, require=policy(clock), clock=clock)
    lst = end(dialler=False, require=policy(clock), clock=clock)
    first = welcome_for(d, lst)
    # The dialler says HELLO again; a holder of the link key answers with the first WELCOME,
    # its MAC made anew over the new HELLO: its signature covered the first HELLO.
    d._pending = None  # the first WELCOME was lost
    [hello] = d.outgoing(1.0)
    raw, _, signature = unpack(first[HEADER.size :])
    new_hello_raw = unpack(hello[HEADER.size :])[0]
    body = [raw, mac(KEY, WELCOME_DOMAIN, new_hello_raw, raw), signature]
    with pytest.raises(ProtocolError) as caught:
        d.receive(HEADER.pack(b"IMF", 1, 2, 0) + pack(body), 1.0)
    assert caught.value.reason == "bad_signature"
    assert not d.up


def test_the_link_goes_down_when_the_far_grant_expires_or_is_revoked() -> None:
    clock = Clock()
    far = policy(clock)
    d = end(dialler=True, require=far, clock=clock)
    lst = end(dialler=False, require=policy(clock), clock=clock, expires_in=60)
    d.receive(welcome_for(d, lst), 0.0)
    assert not d.tick(0.1)
    assert d.up
    clock.now += 61  # the listener's grant expired
    assert d.tick(0.2)
    assert not d.up
    assert d.stats["closed_grant"] == 1
    # Linked again with a fresh grant, then revoked: down at the next tick, refused after.
    clock.now = Clock().now
    lst2 = end(dialler=False, clock=clock)
    d._pending = None
    d.receive(welcome_for(d, lst2, 1.0), 1.0)
    assert d.up
    assert lst2.identity is not None
    assert far.learn(AUTHORITY.revoke(lst2.identity.public, before=clock.now).token)
    assert d.tick(1.1)
    assert d.stats["closed_grant"] == 2
    d._pending = None
    with pytest.raises(ProtocolError) as caught:
        d.receive(welcome_for(d, lst2, 2.0), 2.0)
    assert caught.value.reason == "revoked"


def test_a_revocation_the_gateways_node_applies_holds_for_far_gateways() -> None:
    clock = Clock()
    mesh = NodeGrants(public=b"", authorities=(AUTHORITY.public,), required=True, clock=clock)
    far = FarGrantPolicy(mesh, (AUTHORITY.public,))
    d = end(dialler=True, require=far, clock=clock)
    lst = end(dialler=False, clock=clock)
    d.receive(welcome_for(d, lst), 0.0)
    assert lst.identity is not None
    assert mesh.learn(AUTHORITY.revoke(lst.identity.public, before=clock.now).token)
    assert d.tick(0.1)
    assert d.stats["closed_grant"] == 1


def linked_both_requiring() -> tuple[Clock, LinkEnd, LinkEnd]:
    """A dialler and a listener linked, each requiring the other's grant: a clock, the two."""
    clock = Clock()
    d = end(dialler=True, require=policy(clock), clock=clock)
    lst = end(dialler=False, require=policy(clock), clock=clock)
    d.receive(welcome_for(d, lst), 0.0)
    return clock, d, lst


def refusal(listener: LinkEnd, dialler: LinkEnd) -> str:
    """Why `listener` refuses the HELLO `dialler` says (ProtocolError's reason)."""
    [hello] = dialler.outgoing(1.0)
    with pytest.raises(ProtocolError) as caught:
        listener.accept(open_hello(hello, listener.secrets), 1.0)
    return caught.value.reason


def test_a_refused_hello_leaves_the_session_up() -> None:
    _clock, d, lst = linked_both_requiring()
    # A holder of the link key says HELLO under the linked gateway's id, with no grant.
    rogue = end(dialler=True, rights=None)
    rogue.gateway_id = d.gateway_id
    assert refusal(lst, rogue) == "no_grant"
    assert lst.up
    lst.send(["x"])
    assert pump(lst, d, 1.0) == [["x"]]


def pump(src: LinkEnd, dst: LinkEnd, now: float) -> list[list[object]]:
    got: list[list[object]] = []
    for frame in src.outgoing(now):
        got.extend(dst.receive(frame, now))
    return got


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_mangled_signed_hello_is_refused_or_shows_what_was_signed(data: st.DataObject) -> None:
    """Bytes of a signed HELLO changed, cut or added, by someone holding the link key (the
    MAC made anew over the changed fields): it is refused, or it shows exactly the identity and
    grant that were signed (a change the signature does not cover: the MAC's bytes)."""
    d, signed_hello = SIGNED
    raw, _, signature = unpack(signed_hello[HEADER.size :])
    fields = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(fields) - 1))
        fields[at] = data.draw(st.integers(0, 255))
    signature = bytearray(signature)
    if data.draw(st.booleans()):
        signature[data.draw(st.integers(0, 63))] ^= data.draw(st.integers(1, 255))
    try:
        hello = open_hello(remac_raw(bytes(fields), bytes(signature)), (KEY,))
    except ProtocolError:
        return
    assert hello.shown is not None
    assert hello.raw_said == raw  # only a change that left the fields as they were
    assert d.identity is not None
    assert hello.shown.public == d.identity.public


def remac_raw(raw: bytes, signature: bytes) -> bytes:
    body = [raw, mac(KEY, HELLO_DOMAIN, raw), signature]
    return HEADER.pack(b"IMF", 1, 1, 0) + pack(body)


def _signed() -> tuple[LinkEnd, bytes]:
    clock = Clock()
    dialler = end(dialler=True, require=policy(clock), clock=clock)
    [hello] = dialler.outgoing(0.0)
    return dialler, hello


SIGNED = _signed()


def test_a_link_under_an_authority_no_longer_trusted_goes_down() -> None:
    clock = Clock()
    far = policy(clock)
    d = end(dialler=True, require=far, clock=clock)
    lst = end(dialler=False, clock=clock)
    d.receive(welcome_for(d, lst), 0.0)
    assert not d.tick(0.1)
    far.configure([Authority.generate().public], True)  # the link keyring reread
    assert d.tick(0.2)
    assert d.stats["closed_grant"] == 1


def test_another_granted_gateway_cannot_take_over_a_linked_gateways_id() -> None:
    clock, d, lst = linked_both_requiring()
    # A gateway with a grant of its own says HELLO under the linked gateway's id.
    other = end(dialler=True, require=policy(clock), clock=clock)
    other.gateway_id = d.gateway_id
    assert refusal(lst, other) == "identity_changed"
    assert lst.up
    assert d.identity is not None
    assert lst.peer_public == d.identity.public
