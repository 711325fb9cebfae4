"""The handshake: HELLO, WELCOME, REFUSE, and the scope slots a link's offers open.

Theory of operation
-------------------
The dialler sends HELLO (its id, a fresh nonce, its endpoint, its key-agreement public key and
its membership record); the listener answers WELCOME (the same of its own, and one *offer tag*
per key of each cluster it serves, then one per topic scope it holds a key for) or REFUSE
(closing). Each side proves it holds the mesh key with a MAC over everything the handshake has
said so far, its role named (`MembershipSecurity.mesh_proof`): a node without the mesh key
cannot complete a handshake, so it never becomes a peer, and a man in the middle cannot swap
the key-agreement keys, so it learns and changes nothing. A handshake that fails its proof is
dropped and counted (`dropped_bad_proof`), never answered. Both ends then agree the link key;
the link's own control frames (slot 0) are sealed under it. The records go to membership: a
handshake is also how a node joins the mesh. Handshake frames are not sealed, so a record's
name travels sealed under the mesh key apart (`gossip.seal_name`), opened only once the proof
holds: a node without the mesh key learns no name, and costs no more than a MAC.

Given an identity (`records.NodeIdentity`), each side also proves its node id: its HELLO or
WELCOME carries its Ed25519 public key ("id") and its signature ("sig") over the same
transcript as the mesh proof, the key included. The id must be the one the key derives
(`records.node_id_of`) and the signature must hold, else the handshake is dropped and counted
(`dropped_bad_identity`): a holder of the mesh key cannot link as another node. The WELCOME's
transcript holds the dialler's nonce and key-agreement key, so it cannot be replayed; a
replayed HELLO gets a WELCOME whose link key only the real dialler can agree. The record in a
handshake carries its node's record signature too (checked by membership as any record).
A node without an identity sends none and checks none (simulations). A node of the first
version (records of four fields) and a node of this one refuse each other's HELLO as
`bad_handshake`: they never link.

Given a grant policy (`rights.GrantPolicy`: a mesh that requires grants), each side also
presents its grant ("grant": the authority's token, `irismesh.security.grants`), inside what
its identity signs, and each checks the other's once, here: signature, trust, expiry, that it
names the very key that proved the peer's id, and revocations. The verdict stays on the link
(`grant`). A listener offers only the clusters its own grant lets it serve, and marks the
slots whose cluster the dialler may not call (`InLink.refused`: those requests are answered
Forbidden); a dialler opens a slot only to a peer whose grant lets it serve the cluster. A
peer without a grant that holds links with no rights; a revoked one is refused
(`dropped_revoked`).

An offer tag is a MAC under the cluster's key over both nonces (`LinkSecurity.offers`). The
dialler learns that a peer serves cluster X only by computing X's tag itself
(`LinkSecurity.match`), which needs X's name and key: a node without the key learns nothing,
and old tags are useless on a new link. The n-th offer becomes scope slot n of the link;
requests and their replies name the slot, never the cluster, and are sealed under keys derived
from the cluster key, so only holders of the key can read, forge or answer them. The dialler
resolves a slot the first time it needs one (`cluster_slot`, `topic_slot`) and remembers it on
the link, 0 when the peer offers none.

This module builds and checks the handshake frames and fills in the link's keys and sealers;
the engine decides what a handshake means for the link table (a node dialling itself, a
second endpoint of a peer already linked) and who hears of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from irismesh._core.frames import MAX_OFFERS, NONCE_SIZE, BodyCodec, Kind, encode_header
from irismesh._core.gossip import (
    MAX_ADDRESS,
    MAX_SEALED_NAME,
    MAX_TAGS,
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
)
from irismesh._core.links import InLink, LinkState, OutLink
from irismesh._core.outbox import Outbox
from irismesh._core.records import MemberRecord, NodeIdentity, node_id_of
from irismesh._core.rights import UNCHECKED, GrantPolicy, PeerGrant
from irismesh._core.sealing import NodeSecurity
from irismesh.errors import NoKey, ProtocolError

# What a node says of itself in a handshake: (incarnation, datagram address, tags, sealed name,
# record signature).
SelfRecord = Callable[[], tuple[int, str, bytes, bytes, bytes]]
OpenName = Callable[[bytes, bytes], str]  # (peer id, its sealed name) -> the name
Learned = tuple[MemberRecord, int]  # a peer's record and incarnation

_MAX_TOPIC_SCOPES = 4096  # topic scopes whose slots a link remembers at once


class Handshake:
    """Builds and checks handshake frames for one node."""

    def __init__(
        self,
        *,
        node_id: bytes,
        endpoint: str,
        clusters: tuple[str, ...],
        security: NodeSecurity,
        randbytes: Callable[[int], bytes],
        codec: BodyCodec,
        stats: Counter[str],
        outbox: Outbox,
        record: SelfRecord,
        open_name: OpenName,
        identity: NodeIdentity | None = None,
        grants: GrantPolicy | None = None,
    ) -> None:
        self._node_id = node_id
        self._endpoint = endpoint
        # The clusters this node offers: those it serves that its own grant allows (the
        # engine sets them again when its grant changes).
        self.clusters = clusters
        self._grants = grants
        self._security = security
        self._randbytes = randbytes  # handshake nonces: must be unpredictable
        self._codec = codec
        self._stats = stats
        self._outbox = outbox
        self._record = record
        self._open_name = open_name
        self._identity = identity

    # ----------------------------------------------------------------- dialler

    def hello(self, link_id: int, endpoint: str, now: float) -> OutLink:
        """A new dialled link to `endpoint`, its HELLO queued."""
        nonce = self._randbytes(NONCE_SIZE)
        link = OutLink(link_id, endpoint, nonce, now)
        link.last_heard = now
        link.keys = keys = self._security.begin()
        record = list(self._record())
        said = [self._node_id, nonce, self._endpoint, keys.public, record]
        transcript = self._codec.pack(said)
        proof = self._security.mesh_proof(b"hello", transcript)
        caps: dict[str, Any] = {"kx": keys.public, "rec": record, "proof": proof}
        self._sign(b"hello", said, caps)
        body = self._codec.pack([self._node_id, nonce, self._endpoint, caps])
        self._outbox.out_frames.append((link_id, encode_header(Kind.HELLO, 0, 0) + body))
        return link

    def welcome(self, link: OutLink, env: list[Any]) -> Learned:
        """The listener's WELCOME: check its proof, agree the link key and take its offers;
        the link is UP. Returns the listener's record."""
        peer_id, peer_nonce, peer_endpoint, tags, caps = env
        peer_public, record = caps.get("kx"), caps.get("rec")
        keys = link.keys
        if type(peer_public) is not bytes or keys is None:
            raise ProtocolError("bad_handshake", "no key agreement")
        _check_record(record)
        said = [peer_id, peer_nonce, peer_endpoint, tags, peer_public, record]
        said += [link.nonce, keys.public]
        if not self._proven(b"welcome", said, caps):
            raise ProtocolError("bad_proof", "WELCOME")
        public = self._identified(b"welcome", peer_id, said, caps)
        link.grant = self._admitted(public, caps)
        link.public = public
        learned = self._learned(peer_id, peer_endpoint, record, public)
        keys.establish(peer_public, peer_nonce, link.nonce)
        link.peer_id = peer_id
        link.peer_nonce = peer_nonce
        link.offers = {tag: slot for slot, tag in enumerate(tags, start=1)}
        link.send_sealers[0] = keys.sealer(None, True)
        link.recv_sealers[0] = keys.sealer(None, False)
        link.priorities = caps.get("prio") == 1
        link.pub_runs = caps.get("run") == 1
        link.traces = caps.get("trace") == 1
        link.state = LinkState.UP
        return learned

    def cluster_slot(self, link: OutLink, cluster: str) -> int:
        """The slot of `link` serving `cluster` (0: the peer does not); NoKey without a key."""
        slot = link.clusters.get(cluster)
        if slot is None:
            if not self._security.has_key(cluster):
                raise NoKey(cluster)
            found = self._security.match(cluster, link.peer_nonce, link.nonce, link.offers)
            if found is not None and not link.grant.rights.may_serve(cluster):
                self._stats["routes_refused_forbidden"] += 1  # it offers what it may not serve
                found = None
            slot = self._open_slot(link, found, replies=True)
            link.clusters[cluster] = slot
        return slot

    def topic_slot(self, link: OutLink, scope: str) -> int:
        """The slot of `link` whose key seals topics of `scope` (0: the peer offers none)."""
        found = self._security.match_topic(scope, link.peer_nonce, link.nonce, link.offers)
        slot = self._open_slot(link, found, replies=False)
        if len(link.topic_slots) >= _MAX_TOPIC_SCOPES:
            link.topic_slots.clear()
        link.topic_slots[scope] = slot
        return slot

    @staticmethod
    def _open_slot(link: OutLink, found: tuple[int, object] | None, *, replies: bool) -> int:
        """Sealers for a matched offer (`replies`: also to open what comes back in it)."""
        if found is None or link.keys is None:
            return 0
        slot, handle = found
        link.handles[slot] = handle
        link.send_sealers[slot] = link.keys.sealer(handle, True)
        if replies:
            link.recv_sealers[slot] = link.keys.sealer(handle, False)
        return slot

    # ----------------------------------------------------------------- listener

    def accept(self, routing_id: bytes, env: list[Any], now: float) -> tuple[InLink, Learned]:
        """A peer's HELLO: check its proof; the new link with its scope slots, its WELCOME
        queued, and the dialler's record."""
        peer_id, peer_nonce, peer_endpoint, caps = env
        peer_public, peer_record = caps.get("kx"), caps.get("rec")
        if type(peer_public) is not bytes:
            raise ProtocolError("bad_handshake", "no key agreement")
        _check_record(peer_record)
        said = [peer_id, peer_nonce, peer_endpoint, peer_public, peer_record]
        if not self._proven(b"hello", said, caps):
            raise ProtocolError("bad_proof", "HELLO")
        public = self._identified(b"hello", peer_id, said, caps)
        grant = self._admitted(public, caps)
        learned = self._learned(peer_id, peer_endpoint, peer_record, public)
        security = self._security
        nonce = self._randbytes(NONCE_SIZE)
        keys = security.begin()
        keys.establish(peer_public, nonce, peer_nonce)
        scopes: list[str | None] = [None]
        handles: list[object | None] = [None]
        tags: list[bytes] = []
        refused: list[int] = []
        for cluster in self.clusters:
            may_call = grant.rights.may_call(cluster)
            for tag, handle in security.offers(cluster, nonce, peer_nonce):
                if not may_call:
                    refused.append(len(scopes))
                scopes.append(cluster)
                handles.append(handle)
                tags.append(tag)
        topic_slots: dict[int, str] = {}
        for tag, handle, topic_scope in security.topic_offers(nonce, peer_nonce):
            if len(tags) >= MAX_OFFERS:  # a huge keyring: the remaining topic scopes go unread
                self._stats["topic_offers_dropped"] += 1
                break
            topic_slots[len(scopes)] = topic_scope
            scopes.append(None)  # no cluster: requests in this slot are refused
            handles.append(handle)
            tags.append(tag)
        link = InLink(routing_id, peer_id, peer_endpoint, nonce, peer_nonce, now, scopes)
        link.topic_slots = topic_slots
        link.public = public
        link.grant = grant
        if grant is not UNCHECKED:  # grants required: what the peer publishes is checked
            link.topics_heard = {}
        if refused:
            link.refused = frozenset(refused)
        link.handles = [handle for handle in handles if handle is not None]
        for slot, handle in enumerate(handles):
            link.send_sealers[slot] = keys.sealer(handle, False)
            link.recv_sealers[slot] = keys.sealer(handle, True)
        record = list(self._record())
        said = [self._node_id, nonce, self._endpoint, tags, keys.public, record]
        said += [peer_nonce, peer_public]
        proof = security.mesh_proof(b"welcome", self._codec.pack(said))
        # "prio": this member reads requests' priorities (callers send others the default);
        # "run": it reads publishes as PUBLISH_RUN frames (publishers send others BATCHes);
        # "trace": it reads trace context (callers and publishers send others none).
        caps = {"kx": keys.public, "rec": record, "proof": proof, "prio": 1, "run": 1, "trace": 1}
        self._sign(b"welcome", said, caps)
        body = self._codec.pack([self._node_id, nonce, self._endpoint, tags, caps])
        self._outbox.in_frames.append((routing_id, encode_header(Kind.WELCOME, 0, 0) + body))
        return link, learned

    def _learned(self, node_id: bytes, endpoint: str, record: list[Any], public: bytes) -> Learned:
        """A proven peer's record (checked by `_check_record`), its name opened."""
        name = self._open_name(node_id, record[3])
        learned = MemberRecord(node_id, endpoint, record[1], record[2], name, public, record[4])
        return learned, record[0]

    def _sign(self, label: bytes, said: list[Any], caps: dict[str, Any]) -> None:
        """Add this node's public key and its signature of the transcript (with the key, and
        its grant if it presents one)."""
        identity = self._identity
        if identity is not None:
            public = identity.public
            signed = [*said, public]
            grants = self._grants
            if grants is not None and grants.required:
                token = grants.token()
                if token:
                    caps["grant"] = token
                    signed.append(token)
            caps["id"] = public
            caps["sig"] = identity.sign(label + self._codec.pack(signed))

    def _admitted(self, public: bytes, caps: dict[Any, Any]) -> PeerGrant:
        """The peer's verified grant (its signature already checked with the transcript)."""
        grants = self._grants
        if grants is None or not grants.required:
            return UNCHECKED
        token = caps.get("grant", b"")
        if type(token) is not bytes:
            raise ProtocolError("bad_handshake", "grant")
        return grants.admit(public, token)

    def _identified(
        self, label: bytes, peer_id: object, said: list[Any], caps: dict[Any, Any]
    ) -> bytes:
        """The peer's public key, once it is shown to own `peer_id` and to have signed the
        transcript; b"" without an identity here. ProtocolError('bad_identity') otherwise."""
        identity = self._identity
        if identity is None:
            return b""
        public, signature = caps.get("id"), caps.get("sig")
        if (
            type(public) is not bytes
            or len(public) != PUBLIC_KEY_SIZE
            or type(signature) is not bytes
            or len(signature) != SIGNATURE_SIZE
        ):
            raise ProtocolError("bad_identity", "no identity proof")
        if node_id_of(public) != peer_id:
            raise ProtocolError("bad_identity", "node id not derived from its key")
        signed = [*said, public]
        token = caps.get("grant")
        if type(token) is bytes and token:
            signed.append(token)
        if not identity.verify(public, label + self._codec.pack(signed), signature):
            raise ProtocolError("bad_identity", "bad signature")
        return public

    def _proven(self, label: bytes, said: list[Any], caps: dict[Any, Any]) -> bool:
        proof = caps.get("proof")
        if type(proof) is not bytes:
            return False
        return self._security.mesh_proof_ok(label, self._codec.pack(said), proof)

    def refuse(self, routing_id: bytes, reason: str) -> None:
        """Answer a HELLO with REFUSE (this node is closing)."""
        frame = encode_header(Kind.REFUSE, 0, 0) + self._codec.pack([reason])
        self._outbox.in_frames.append((routing_id, frame))


def _check_record(record: object) -> None:
    """A peer's record in its handshake: [incarnation, datagram address, tags, sealed name,
    record signature (b"" from a node without an identity)]."""
    if (
        type(record) is not list
        or len(record) != 5
        or type(record[0]) is not int
        or not 0 <= record[0] < 1 << 63
        or type(record[1]) is not str
        or not 2 < len(record[1]) <= MAX_ADDRESS
        or type(record[2]) is not bytes
        or len(record[2]) > MAX_TAGS
        or type(record[3]) is not bytes
        or len(record[3]) > MAX_SEALED_NAME
        or type(record[4]) is not bytes
        or len(record[4]) not in (0, SIGNATURE_SIZE)
    ):
        raise ProtocolError("bad_handshake", "no membership record")
