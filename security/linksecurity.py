"""Key-dependent decisions of a node's links, from a keyring (see `irismesh._core.sealing`).

An offer tag is HMAC-SHA256(cluster key, domain | listener nonce | dialler nonce | cluster name),
truncated to 16 bytes: it proves possession of the key, is bound to one link's fresh nonces (a
recorded tag is useless on another link), and reveals nothing about the cluster to anyone
without its key. A dialler holding an older or newer key of a cluster during rotation checks
every key its keyring accepts for that cluster.
"""

from __future__ import annotations

import hashlib
import hmac

from irismesh._core.sealing import NULL_SEALER, Sealer
from irismesh.security.keyring import Keyring

_OFFER_DOMAIN = b"irismesh/v1/offer\x00"


def offer_tag(secret: bytes, cluster: str, listener_nonce: bytes, dialler_nonce: bytes) -> bytes:
    message = _OFFER_DOMAIN + listener_nonce + dialler_nonce + cluster.encode()
    return hmac.new(secret, message, hashlib.sha256).digest()[:16]


class KeyedLinkSecurity:
    """Offer tags from the keyring; sealing by the null sealer until AEAD sealers land."""

    __slots__ = ("_keyring",)

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring

    def offer_tag(self, cluster: str, listener_nonce: bytes, dialler_nonce: bytes) -> bytes | None:
        key = self._keyring.primary(cluster)
        if key is None:
            return None
        return offer_tag(key.secret, cluster, listener_nonce, dialler_nonce)

    def sealer(
        self, scope: str | None, listener_nonce: bytes, dialler_nonce: bytes, from_dialler: bool
    ) -> Sealer:
        return NULL_SEALER
