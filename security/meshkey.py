"""The mesh key: what admits a node to the mesh's membership at all.

Membership (who is alive, suspect, dead or gone, and where each node listens) is shared by the
whole mesh, so it is guarded by one key the whole mesh holds: the keyring's ``@mesh`` key, else
its ``*`` key (`Keyring.mesh_keys`). A keyring with neither joins an *open* mesh, whose key is
public: fine on a trusted machine, and every cluster and topic is still guarded by its own key.

Membership datagrams are sealed with AES-256-GCM under a key of their sender's own:
HMAC-SHA256(mesh secret, domain | sender id). Node ids are random per process start, so each
sender's counter (the nonce) never repeats under one key; a receiver derives the sender's key
from the id in the header, which the seal then authenticates, so no one without the mesh key
can read a datagram, forge one, or speak for a node id. During a rotation two mesh keys are
valid: datagrams are sealed under the primary and opened under either. A node that rereads its
keyring swaps the secrets in place (`KeyedMembershipSecurity.replace`), so the sealer its
membership holds seals and opens under the new ones from then on.

A record also says which keys its node holds, again only to holders of each key: one *key tag*
per key of its keyring, a MAC under that key over the node id, the scope and whether the key
is the scope's primary (`key_tags`). `mesh keys status` counts them (`key_use`), so an operator
sees how far a rotation has spread; a node without a key learns nothing from its tags.

Versions and notes. A member's version travels as one *version tag* per cluster it serves and
key it holds for it: a MAC over the node id, the cluster and the version ("" for none), which a
key holder checks against the versions it asks about (`version_of`), as a serving tag. A *note*
says something of a cluster to every holder of its key, whoever carries it (a traffic split,
which members copy from record to record): AES-256-GCM under a key of its own, drawn from the
cluster's key and a fresh salt (so its fixed nonce never repeats under one key), the cluster
bound in as associated data. It sits in the tags 8-byte aligned behind a *locator*, a MAC
under the cluster's key over the cluster's name (6 bytes) and its length (2 bytes), padded to
a multiple of 8 bytes; to anyone else it is a run of tags that match nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Iterable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from irismesh._core.gossip import DatagramSealer, NullDatagramSealer
from irismesh._core.records import NOTE_SALT
from irismesh.errors import ProtocolError
from irismesh.security.keyring import MESH_SCOPE, Keyring, ScopeKey

_GOSSIP_DOMAIN = b"irismesh/v1/gossip\x00"
OPEN_MESH_SECRET = hashlib.sha256(b"irismesh/v1/open-mesh").digest()
_NONCE = struct.Struct("!4xQ")
_CACHE = 4096  # senders whose keys are kept derived


def mesh_secrets(keyring: Keyring) -> tuple[bytes, ...]:
    """The mesh secrets of a keyring, primary first; the open mesh's without a mesh key."""
    return tuple(key.secret for key in keyring.mesh_keys()) or (OPEN_MESH_SECRET,)


def is_open_mesh(keyring: Keyring) -> bool:
    return not keyring.mesh_keys()


def _sender_key(secret: bytes, sender: bytes) -> AESGCM:
    return AESGCM(hmac.new(secret, _GOSSIP_DOMAIN + sender, hashlib.sha256).digest())


class MeshDatagramSealer:
    """Seals this node's membership datagrams, opens its peers'."""

    __slots__ = ("_cache", "_encrypt", "_node_id", "_secrets")

    overhead = 16

    def __init__(self, secrets: Sequence[bytes], node_id: bytes) -> None:
        self._cache: dict[tuple[int, bytes], AESGCM] = {}
        self._node_id = node_id
        self.rekey(secrets)

    def rekey(self, secrets: Sequence[bytes]) -> None:
        """Seal under the first of `secrets` from now on, and open under any of them."""
        if not secrets:
            raise ValueError("a mesh sealer needs at least one secret")
        self._secrets = tuple(secrets)
        self._encrypt = _sender_key(self._secrets[0], self._node_id).encrypt
        self._cache.clear()  # indexed by position in the old secrets

    def seal(self, header: bytes, counter: int, body: bytes) -> bytes:
        return self._encrypt(_NONCE.pack(counter), body, header)

    def open(self, sender: bytes, header: bytes, counter: int, sealed: bytes) -> bytes:
        nonce = _NONCE.pack(counter)
        cache = self._cache
        for index, secret in enumerate(self._secrets):
            aead = cache.get((index, sender))
            known = aead is not None
            if aead is None:
                aead = _sender_key(secret, sender)
            try:
                body = aead.decrypt(nonce, sealed, header)
            except InvalidTag:
                continue
            if not known:  # only an authentic sender earns a place in the cache
                if len(cache) >= _CACHE:
                    del cache[next(iter(cache))]
                cache[(index, sender)] = aead
            return body
        raise ProtocolError("bad_seal")


def datagram_sealer(keyring: Keyring, node_id: bytes, *, sealing: bool = True) -> DatagramSealer:
    """The sealer a node uses for membership; `sealing=False` (benchmarks only) seals nothing."""
    if not sealing:
        return NullDatagramSealer()
    return MeshDatagramSealer(mesh_secrets(keyring), node_id)


TAG_SIZE = 8
# More topic interest tags than this, and a record says "every scope it can read" instead.
MAX_INTEREST_TAGS = 64
_PROOF_DOMAIN = b"irismesh/v1/mesh-proof\x00"
_MEMBER_DOMAIN = b"irismesh/v1/member\x00"
_INTEREST_DOMAIN = b"irismesh/v1/interest\x00"
_EVERY_SCOPE = "\x00every"
_HOLDS_DOMAIN = b"irismesh/v1/holds\x00"
_VERSION_DOMAIN = b"irismesh/v1/version\x00"
_NOTE_AT_DOMAIN = b"irismesh/v1/note-at\x00"
_NOTE_KEY_DOMAIN = b"irismesh/v1/note-key\x00"
_NOTE_HEAD = struct.Struct("!6sH")  # locator, length of the salt and the sealed note
_NOTE_NONCE = bytes(12)  # every note has a key of its own
# Key tags in one record: the mesh key's and `*`'s first, then other scopes' in file order.
MAX_KEY_TAGS = 16
FIRST, ALSO = "first", "also"


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _split(tags: bytes) -> set[bytes]:
    return {tags[i : i + TAG_SIZE] for i in range(0, len(tags) - TAG_SIZE + 1, TAG_SIZE)}


class KeyedMembershipSecurity:
    """Membership proofs and record tags from a keyring (see `MembershipSecurity`)."""

    __slots__ = ("_keyring", "_mesh", "_sealers")

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring
        self._mesh = mesh_secrets(keyring)
        self._sealers: list[MeshDatagramSealer] = []

    @property
    def keyring(self) -> Keyring:
        return self._keyring

    def replace(self, keyring: Keyring) -> None:
        """Decide with `keyring` from now on; the datagram sealers handed out follow it."""
        self._keyring = keyring
        self._mesh = mesh_secrets(keyring)
        for sealer in self._sealers:
            sealer.rekey(self._mesh)

    def key_tags(self, node_id: bytes) -> bytes:
        """Tags saying which keys `node_id` holds, each readable only with that key."""
        keyring = self._keyring
        scopes = sorted(keyring.scopes, key=lambda s: (s != MESH_SCOPE, s != "*"))
        tags = [
            self._holds_tag(key.secret, node_id, scope, FIRST if i == 0 else ALSO)
            for scope in scopes
            for i, key in enumerate(keyring.accepted(scope))
        ]
        return b"".join(tags[:MAX_KEY_TAGS])

    def key_use(self, node_id: bytes, tags: bytes, key: ScopeKey) -> str | None:
        """How a record's node holds `key` of `key.scope`: FIRST, ALSO, or None (not at all,
        or not that this key can tell)."""
        if not tags:
            return None
        offered = _split(tags)
        for use in (FIRST, ALSO):
            if self._holds_tag(key.secret, node_id, key.scope, use) in offered:
                return use
        return None

    def mesh_proof(self, label: bytes, transcript: bytes) -> bytes:
        return _mac(self._mesh[0], _PROOF_DOMAIN, label, b"\x00", transcript)[:16]

    def mesh_proof_ok(self, label: bytes, transcript: bytes, proof: bytes) -> bool:
        return any(
            hmac.compare_digest(_mac(s, _PROOF_DOMAIN, label, b"\x00", transcript)[:16], proof)
            for s in self._mesh
        )

    def _tags(self, names: Iterable[str], tag: Callable[[bytes, str], bytes]) -> bytes:
        """`tag(secret, name)` under every key accepted for each of `names`, one after another."""
        return b"".join(
            tag(key.secret, name) for name in names for key in self._keyring.accepted(name)
        )

    def member_tags(self, node_id: bytes, clusters: Iterable[str]) -> bytes:
        return self._tags(
            clusters, lambda secret, cluster: self._member_tag(secret, node_id, cluster)
        )

    def serves(self, node_id: bytes, tags: bytes, cluster: str) -> bool:
        if not tags:
            return False
        offered = _split(tags)
        return any(
            self._member_tag(key.secret, node_id, cluster) in offered
            for key in self._keyring.accepted(cluster)
        )

    def interest_tags(self, node_id: bytes, scopes: Iterable[str], every_scope: bool) -> bytes:
        wanted = sorted(set(scopes))
        if every_scope or len(wanted) > MAX_INTEREST_TAGS:
            # Every key it reads topics with: each scope's own, and the default key.
            names = [s for s in self._keyring.scopes if s not in ("*", MESH_SCOPE)]
            return self._tags(
                [*names, "*"], lambda secret, _: self._interest_tag(secret, node_id, _EVERY_SCOPE)
            )
        return self._tags(wanted, lambda secret, scope: self._interest_tag(secret, node_id, scope))

    def reads(self, node_id: bytes, tags: bytes, scope: str) -> bool:
        if not tags:
            return False
        offered = _split(tags)
        # A publisher seals a topic scope under the scope's own key, else the default key: the
        # subscriber must read it with the same key, named or as "every scope".
        for key in self._keyring.accepted(scope):
            for name in (scope, _EVERY_SCOPE):
                if self._interest_tag(key.secret, node_id, name) in offered:
                    return True
        return False

    def version_tags(self, node_id: bytes, clusters: Iterable[str], version: str) -> bytes:
        return self._tags(
            clusters, lambda secret, cluster: self._version_tag(secret, node_id, cluster, version)
        )

    def version_of(
        self, node_id: bytes, tags: bytes, cluster: str, versions: Iterable[str]
    ) -> str | None:
        if not tags:
            return None
        offered = _split(tags)
        keys = self._keyring.accepted(cluster)
        for version in versions:
            for key in keys:
                if self._version_tag(key.secret, node_id, cluster, version) in offered:
                    return version
        return None

    def seal_note(self, cluster: str, salt: bytes, note: bytes) -> bytes:
        secret = self._keyring.require(cluster).secret
        name = cluster.encode()
        aead = AESGCM(_mac(secret, _NOTE_KEY_DOMAIN, name, b"\x00", salt))
        locator = _mac(secret, _NOTE_AT_DOMAIN, name)[:6]
        sealed = salt + aead.encrypt(_NOTE_NONCE, note, locator + name)
        return _NOTE_HEAD.pack(locator, len(sealed)) + sealed + bytes(-len(sealed) % TAG_SIZE)

    def open_notes(self, tags: bytes, cluster: str) -> list[tuple[bytes, bytes]]:
        found: list[tuple[bytes, bytes]] = []
        if not tags:
            return found
        name = cluster.encode()
        for key in self._keyring.accepted(cluster):
            locator = _mac(key.secret, _NOTE_AT_DOMAIN, name)[:6]
            at = tags.find(locator)
            while at >= 0:
                if at % TAG_SIZE == 0 and at + _NOTE_HEAD.size <= len(tags):
                    _, length = _NOTE_HEAD.unpack_from(tags, at)
                    start = at + _NOTE_HEAD.size
                    sealed = tags[start : start + length]
                    if len(sealed) == length > NOTE_SALT:
                        salt = sealed[:NOTE_SALT]
                        aead = AESGCM(_mac(key.secret, _NOTE_KEY_DOMAIN, name, b"\x00", salt))
                        whole = tags[at : start + length + (-length % TAG_SIZE)]
                        try:
                            note = aead.decrypt(_NOTE_NONCE, sealed[NOTE_SALT:], locator + name)
                        except InvalidTag:
                            pass  # noise that looked like a locator, or a forgery
                        else:
                            found.append((note, whole))
                at = tags.find(locator, at + 1)
        return found

    @staticmethod
    def _version_tag(secret: bytes, node_id: bytes, cluster: str, version: str) -> bytes:
        message = (_VERSION_DOMAIN, node_id, cluster.encode(), b"\x00", version.encode())
        return _mac(secret, *message)[:TAG_SIZE]

    @staticmethod
    def _holds_tag(secret: bytes, node_id: bytes, scope: str, use: str) -> bytes:
        message = (_HOLDS_DOMAIN, node_id, scope.encode(), b"\x00", use.encode())
        return _mac(secret, *message)[:TAG_SIZE]

    @staticmethod
    def _member_tag(secret: bytes, node_id: bytes, cluster: str) -> bytes:
        return _mac(secret, _MEMBER_DOMAIN, node_id, cluster.encode())[:TAG_SIZE]

    @staticmethod
    def _interest_tag(secret: bytes, node_id: bytes, scope: str) -> bytes:
        return _mac(secret, _INTEREST_DOMAIN, node_id, scope.encode())[:TAG_SIZE]
