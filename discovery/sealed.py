"""Cluster names in survey datagrams, sealed so that only a holder of the right key reads them.

Every survey datagram carries exactly `SLOTS` slots of `SLOT_LEN` bytes. A *sealed* slot is
AES-256-GCM under a key derived from one keyring secret (HMAC-SHA256(secret, label)), with a
random 96-bit nonce; its plaintext is the cluster names that secret opens, joined by newlines
and padded with zero bytes to `SLOT_PLAIN`; its associated data is the sender's node id, the
datagram's timestamp and the sender's endpoint, so a slot cannot be moved to another node's
datagram or to another time. Slots not used are random bytes, which nobody can tell from a
sealed slot without the key. So every datagram has the same size, whatever its sender serves.

Which secret seals which names: a node seals each cluster it serves under every key its
keyring accepts for that cluster (both keys during a rotation) and under its ``*`` keys (the
``*`` key opens every cluster's listing). Each secret it holds that opens none of its clusters
gets an empty sealed slot, which proves to other holders of that secret that the sender holds
it (a node answers a question only from a node of its realm or one holding one of its keys).
A node with more slots than fit in one datagram sends them in turn, `SLOTS` at a time.

A receiver tries each slot with each of its own secrets. A name opened under a secret is
kept only where the receiver's keyring would use that secret for the name: a key of the
name's own scope (or ``*`` when the scope has none), or a ``*`` key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

if TYPE_CHECKING:
    from irismesh.security.keyring import Keyring

__all__ = ["NONCE_LEN", "SLOTS", "SLOT_LEN", "SLOT_PLAIN", "ClusterSeal", "Opened"]

SLOTS = 4
SLOT_PLAIN = 224  # one cluster name of the longest (200 characters) fits, or several short ones
NONCE_LEN = 12
_GCM_TAG_LEN = 16
SLOT_LEN = NONCE_LEN + SLOT_PLAIN + _GCM_TAG_LEN
_KEY_LABEL = b"irismesh/v2/survey-clusters"
_AD_DOMAIN = b"irismesh/v2/survey-slot\x00"
_NAME = re.compile(rb"[A-Za-z0-9_.:-]{1,200}")
_MESH_SCOPE = "@mesh"


def _slot_aead(secret: bytes) -> AESGCM:
    return AESGCM(hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest())


def _associated(node_id: bytes, endpoint: str, timestamp_ms: int) -> bytes:
    return _AD_DOMAIN + node_id + timestamp_ms.to_bytes(8, "big") + endpoint.encode("ascii")


def _pages(names: Sequence[str]) -> list[bytes]:
    """`names` joined by newlines into plaintexts of at most SLOT_PLAIN bytes (one, empty,
    when there are no names)."""
    pages: list[bytes] = []
    page = b""
    for name in names:
        encoded = name.encode("ascii")
        joined = page + b"\n" + encoded if page else encoded
        if len(joined) <= SLOT_PLAIN:
            page = joined
            continue
        pages.append(page)
        page = encoded
    pages.append(page)
    return pages


@dataclass(frozen=True, slots=True)
class Opened:
    """What one datagram's slots said to this receiver."""

    proven: bool  # some slot opened: the sender holds one of this receiver's secrets
    names: tuple[str, ...]  # the cluster names the receiver's keyring may read


class ClusterSeal:
    """Seals one node's cluster names into slots, and opens other nodes' slots."""

    __slots__ = ("_keyring", "_openers", "_pages", "_stars")

    def __init__(self, keyring: Keyring | None, served: Sequence[str] = ()) -> None:
        self._keyring = keyring
        # Distinct secrets, in keyring order; the mesh key alone opens no cluster.
        secrets: dict[bytes, None] = {}
        stars: set[bytes] = set()
        if keyring is not None:
            for key in keyring:
                if key.scope != _MESH_SCOPE:
                    secrets.setdefault(key.secret)
            stars = {key.secret for key in keyring.accepted("*")}
        self._stars = frozenset(stars)
        self._openers = tuple((secret, _slot_aead(secret)) for secret in secrets)
        pages: list[tuple[AESGCM, bytes]] = []
        for secret, aead in self._openers:
            names = [name for name in dict.fromkeys(served) if self._opens(secret, name)]
            pages += [(aead, page) for page in _pages(names)]
        self._pages = tuple(pages)

    @property
    def slot_count(self) -> int:
        """How many sealed slots this node sends, `SLOTS` per datagram."""
        return len(self._pages)

    def _opens(self, secret: bytes, name: str) -> bool:
        """Whether this keyring would use `secret` for `name`."""
        if secret in self._stars:
            return True
        assert self._keyring is not None
        return any(hmac.compare_digest(k.secret, secret) for k in self._keyring.accepted(name))

    def seal(self, node_id: bytes, endpoint: str, timestamp_ms: int, turn: int) -> list[bytes]:
        """The `SLOTS` slots of one datagram: the sealed slots of this `turn` (all of them when
        they fit in one datagram), then random ones."""
        pages = self._pages
        if len(pages) > SLOTS:
            start = (turn * SLOTS) % len(pages)
            pages = (pages + pages)[start : start + SLOTS]
        associated = _associated(node_id, endpoint, timestamp_ms)
        slots = []
        for aead, plain in pages:
            nonce = os.urandom(NONCE_LEN)
            padded = plain + bytes(SLOT_PLAIN - len(plain))
            slots.append(nonce + aead.encrypt(nonce, padded, associated))
        slots += [os.urandom(SLOT_LEN) for _ in range(SLOTS - len(slots))]
        return slots

    def open(
        self, node_id: bytes, endpoint: str, timestamp_ms: int, slots: Sequence[bytes]
    ) -> Opened:
        """Try every slot with every secret of this keyring; malformed plaintexts are ignored
        (only a holder of the key could have sealed them)."""
        if not self._openers:
            return Opened(proven=False, names=())
        associated = _associated(node_id, endpoint, timestamp_ms)
        proven = False
        names: dict[str, None] = {}
        for slot in slots:
            nonce, sealed = slot[:NONCE_LEN], slot[NONCE_LEN:]
            for secret, aead in self._openers:
                try:
                    plain = aead.decrypt(nonce, sealed, associated)
                except InvalidTag:
                    continue
                proven = True
                for raw in plain.rstrip(b"\x00").split(b"\n"):
                    if not _NAME.fullmatch(raw):
                        continue
                    name = raw.decode("ascii")
                    if self._opens(secret, name):
                        names.setdefault(name)
                break
        return Opened(proven=proven, names=tuple(names))
