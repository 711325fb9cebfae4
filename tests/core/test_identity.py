"""Node identities: an id derives from an Ed25519 key, a handshake proves the key, and a
membership record is believed only when its node signed it.

The liars here hold the mesh key (they are members): what the mesh key alone can no longer
do is link as another node or put words in its record.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
from memnet import MemNet, MemNode, member_and_client

from irismesh._core.engine import MeshCore
from irismesh._core.gossip import encode_compound, encode_message, seal_datagram
from irismesh._core.records import (
    MemberRecord,
    MemberState,
    node_id_of,
    record_proven,
    record_transcript,
)
from irismesh.errors import ConfigurationError
from irismesh.security.identity import Identity, verify
from irismesh.security.linksecurity import KeyedLinkSecurity


def _identity(seed: str) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(seed.encode()).digest())


class Liar:
    """Signs with its own key but shows whatever public key the test sets."""

    def __init__(self, own: Identity, shown: bytes) -> None:
        self._own = own
        self.public = shown

    def sign(self, message: bytes) -> bytes:
        return self._own.sign(message)

    def verify(self, public: bytes, message: bytes, signature: bytes) -> bool:
        return verify(public, message, signature)


def _public(node: MemNode) -> bytes:
    return node.core.membership.signed_me().public


# ---------------------------------------------------------------------- the id


def test_a_node_id_is_the_derivation_of_its_public_key() -> None:
    identity = _identity("a")
    expected = hashlib.sha256(b"irismesh node id v1\x00" + identity.public).digest()[:16]
    assert identity.node_id == node_id_of(identity.public) == expected
    assert len(identity.node_id) == 16
    assert _identity("b").node_id != identity.node_id


def test_a_core_refuses_an_id_its_identity_does_not_derive() -> None:
    security = KeyedLinkSecurity(MemNet().keyring)
    with pytest.raises(ConfigurationError, match="derives"):
        MeshCore(
            node_id=os.urandom(16),
            endpoint="tcp://a:1",
            clusters=(),
            security=security,
            rng=__import__("random").Random(1),
            randbytes=os.urandom,
            identity=_identity("a"),
        )


def test_memnet_nodes_link_under_their_derived_ids() -> None:
    net = MemNet(seed=3)
    member, client = member_and_client(net)
    assert client.peer_ids() == {member.node_id}
    assert member.node_id == node_id_of(_public(member))
    seen = client.core.membership.get(member.node_id)
    assert seen is not None
    assert seen.record.public == _public(member)
    assert member.core.stats["dropped_bad_identity"] == 0


def test_an_identity_file_is_private_and_keeps_the_id(tmp_path: Path) -> None:
    path = tmp_path / "node.identity"
    identity = Identity.generate()
    identity.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Identity.load(path)
    assert loaded.node_id == identity.node_id
    assert loaded.sign(b"x") == identity.sign(b"x")  # Ed25519 signs deterministically
    with pytest.raises(ConfigurationError, match="already exists"):
        identity.save(path)
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match="chmod 600"):
        Identity.load(path)
    (tmp_path / "junk").write_text("# irismesh identity v1\ned25519 not-base64!\n")
    (tmp_path / "junk").chmod(0o600)
    with pytest.raises(ConfigurationError, match="base64"):
        Identity.load(tmp_path / "junk")
    assert identity.public.hex() not in repr(identity)


# ---------------------------------------------------------------------- the handshake


def test_a_hello_signed_by_another_key_is_refused_and_counted() -> None:
    net = MemNet(seed=4)
    member = net.add("member", clusters=["db"])
    victim = net.add("victim", seeds=[member])
    net.advance(0.5)
    # The liar claims the victim's id and shows its public key, but cannot sign with it.
    liar = Liar(_identity("liar"), _public(victim))
    net.add("liar", seeds=[member], identity=liar, node_id=victim.node_id)
    net.advance(0.5)
    assert member.core.stats["dropped_bad_identity"] >= 1
    held = member.core.membership.get(victim.node_id)
    assert held is not None
    assert held.record.endpoint == victim.endpoint


def test_a_hello_whose_id_is_not_its_keys_is_refused_and_counted() -> None:
    net = MemNet(seed=5)
    member = net.add("member", clusters=["db"])
    victim = net.add("victim", seeds=[member])
    net.advance(0.5)
    own = _identity("liar")
    liar = Liar(own, _public(victim))  # passes the core's own check at construction...
    net.add("liar", seeds=[member], identity=liar, node_id=victim.node_id)
    liar.public = own.public  # ...then signs honestly with a key the id does not derive from
    net.advance(0.5)
    assert member.core.stats["dropped_bad_identity"] >= 1
    held = member.core.membership.get(victim.node_id)
    assert held is not None
    assert held.record.endpoint == victim.endpoint
    assert held.state is MemberState.ALIVE


def test_a_welcome_signed_by_another_key_is_refused_and_counted() -> None:
    net = MemNet(seed=6)
    victim = net.add("victim", clusters=["db"])
    liar = Liar(_identity("liar"), _public(victim))
    impostor = net.add("impostor", clusters=["db"], identity=liar, node_id=victim.node_id)
    client = net.add("client", seeds=[impostor])
    net.advance(0.5)
    assert client.core.stats["dropped_bad_identity"] >= 1
    assert client.core.stats["dials_failed_bad_identity"] >= 1
    assert victim.node_id not in client.peer_ids()


def test_a_node_without_identity_proof_is_refused_by_one_with() -> None:
    net = MemNet(seed=7)
    member = net.add("member", clusters=["db"])
    stranger = net.add("stranger", seeds=[member], plain=True)
    net.advance(0.5)
    assert member.core.stats["dropped_bad_identity"] >= 1
    assert stranger.peer_ids() == set()
    assert member.core.membership.get(stranger.node_id) is None


@pytest.mark.parametrize("how", ["left", "crashed"])
def test_a_node_restarted_under_its_identity_is_back_at_once(how: str) -> None:
    net = MemNet(seed=11)
    member = net.add("member", clusters=["db"])
    identity = _identity("db-1")
    kept = net.add("kept", clusters=["db"], seeds=[member], identity=identity)
    client = net.add("client", seeds=[member])
    net.advance(2.0)
    assert client.core.membership.get(kept.node_id) is not None
    if how == "left":
        kept.core.close()
        net.settle()
        assert client.core.membership.get(kept.node_id).state is MemberState.LEFT  # type: ignore[union-attr]
    else:
        net.crash(kept)
        net.advance(8.0)
        assert client.core.membership.get(kept.node_id).state is MemberState.DEAD  # type: ignore[union-attr]
    back = net.restart(kept, identity)
    assert back.node_id == kept.node_id
    back.core.add_candidate(member.endpoint, net.now, seed=True)
    net.collect(back)
    # Well before a departure or a death is forgotten (30 s, 600 s): the restarted node
    # outbids its earlier run's incarnation, and its signed record revives it everywhere.
    net.advance(3.0)
    for node in (member, client):
        held = node.core.membership.get(back.node_id)
        assert held is not None
        assert held.state is MemberState.ALIVE, node.name
    assert back.core.membership.incarnation > 0


# ---------------------------------------------------------------------- signed records


def _inject(net: MemNet, insider: MemNode, target: MemNode, messages: list[list[object]]) -> None:
    """A datagram from `insider`, properly sealed under the mesh key, carrying `messages`."""
    sealer = KeyedLinkSecurity(net.keyring).datagram_sealer(insider.node_id)
    _inject.counter += 1  # type: ignore[attr-defined]
    body = encode_compound([encode_message(m) for m in messages])
    datagram = seal_datagram(sealer, insider.node_id, _inject.counter, body)  # type: ignore[attr-defined]
    target.core.receive_datagram(insider.core.address, datagram, net.now)
    net.collect(target)


_inject.counter = 1 << 40  # type: ignore[attr-defined]


def _forgeries(victim: MemNode, mallory: MemNode, incarnation: int) -> dict[str, MemberRecord]:
    """The victim's record, rewritten to send its traffic to mallory, proven three wrong ways."""
    own = mallory.core.membership.signed_me()
    fake = MemberRecord(victim.node_id, own.endpoint, own.address, b"", "victim")
    transcript = record_transcript(fake, incarnation)
    mallorys_key = _identity("mallory")
    assert node_id_of(mallorys_key.public) == mallory.node_id
    return {
        "unsigned": fake,
        "signed by another key": MemberRecord(
            *_fields(fake), _public(victim), mallorys_key.sign(transcript)
        ),
        "a key the id does not derive": MemberRecord(
            *_fields(fake), mallorys_key.public, mallorys_key.sign(transcript)
        ),
    }


def _fields(record: MemberRecord) -> tuple[bytes, str, str, bytes, str]:
    return record.node_id, record.endpoint, record.address, record.tags, record.name


def _alive(record: MemberRecord, incarnation: int) -> list[object]:
    return [5, record.node_id, incarnation, *_fields(record)[1:], record.public, record.signature]


def _state(record: MemberRecord, incarnation: int) -> list[object]:
    entry = [record.node_id, incarnation, 0, *_fields(record)[1:], record.public, record.signature]
    return [8, False, [entry]]


def test_a_forged_record_is_dropped_counted_and_takes_no_id() -> None:
    net = MemNet(seed=9)
    names = ["a", "b", "c", "victim"]
    nodes = {name: net.add(name, clusters=["db"]) for name in names}
    for name in names[1:]:
        nodes[name].core.add_candidate(nodes["a"].endpoint, net.now, seed=True)
    mallory = net.add("mallory", seeds=[nodes["a"]], identity=_identity("mallory"))
    net.advance(3.0)
    victim = nodes["victim"]
    honest = [nodes[name] for name in names[:3]]
    for node in honest:
        assert node.core.membership.get(victim.node_id) is not None
    before = {n.name: n.core.membership.get(victim.node_id) for n in honest}
    high = before["a"].incarnation + 10  # type: ignore[union-attr]
    for what, forged in _forgeries(victim, mallory, high).items():
        for node in honest:
            dropped = node.core.stats["dropped_bad_record_signature"]
            _inject(net, mallory, node, [_alive(forged, high)])
            _inject(net, mallory, node, [_state(forged, high)])
            assert node.core.stats["dropped_bad_record_signature"] == dropped + 2, what
    net.advance(5.0)  # long enough for a wrongly held suspicion to ripen
    for node in [*honest, mallory]:
        held = node.core.membership.get(victim.node_id)
        assert held is not None
        assert held.state is MemberState.ALIVE
        assert held.record.endpoint == victim.endpoint
        assert held.incarnation < high
        assert record_proven(held.record, held.incarnation, victim.core.membership._identity)  # type: ignore[arg-type]
    assert victim.core.stats["refutations"] == 0  # the real node was never even suspected


def test_a_record_is_checked_once_however_often_it_comes() -> None:
    net = MemNet(seed=10)
    target = net.add("target")
    mallory = net.add("mallory", seeds=[target], identity=_identity("mallory"))
    victim = net.add("victim", seeds=[target])
    net.advance(1.0)
    forged = _forgeries(victim, mallory, 50)["signed by another key"]
    checked = target.core.stats["record_signatures_checked"]
    for _ in range(20):
        _inject(net, mallory, target, [_alive(forged, 50)])
    assert target.core.stats["record_signatures_checked"] == checked + 1
    assert target.core.stats["dropped_bad_record_signature"] == 20


def test_a_record_signature_covers_every_field() -> None:
    identity = _identity("n")
    record = MemberRecord(identity.node_id, "tcp://n:1", "n:1", b"\x01" * 8, "n")
    signature = identity.sign(record_transcript(record, 3))
    signed = MemberRecord(*_fields(record), identity.public, signature)
    assert record_proven(signed, 3, identity)
    assert not record_proven(signed, 4, identity)
    fields = list(_fields(record))
    for i, other in enumerate([bytes(16), "tcp://m:1", "m:1", b"", "m"]):
        changed = fields.copy()
        changed[i] = other
        assert not record_proven(MemberRecord(*changed, identity.public, signature), 3, identity)  # type: ignore[arg-type]
