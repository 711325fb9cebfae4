"""The sealing seam: every frame's body passes through a `Sealer`, the header as associated data.

The core never chooses keys or ciphers. A `LinkSecurity` (implemented in `irismesh.security`)
answers two questions during and after a link's handshake:

- `offer_tag(cluster, listener_nonce, dialler_nonce)`: a 16-byte tag that proves possession of
  the cluster's key bound to this link's fresh nonces, or None without a key. Tags are all a
  peer ever sees of the clusters a node serves: without the key a tag is noise.
- `sealer(scope, listener_nonce, dialler_nonce, from_dialler)`: the sealer of the frames that
  flow one way (`from_dialler`: dialler to listener) in one scope of one link (`scope` is None
  for the link's own control traffic). Both ends ask with the same arguments for the same
  direction, and the two directions always differ, so each direction has keys of its own and
  both may count `seq` from 1 without ever reusing an AEAD nonce.

Nonce discipline belongs to the sealer: the core hands it the frame's `seq`, which is strictly
increasing per link and direction and is checked on receipt (replays and reordering are
rejected before the envelope is decoded).
"""

from __future__ import annotations

from typing import Protocol


class Sealer(Protocol):
    """Seals and opens the body of frames of one direction of one scope of one link."""

    def seal(self, header: bytes, seq: int, body: bytes) -> bytes: ...

    def open(self, header: bytes, seq: int, sealed: bytes) -> bytes:
        """Return the plaintext body, or raise ProtocolError('bad_seal')."""
        ...


class LinkSecurity(Protocol):
    """Key-dependent decisions of a node's links."""

    def offer_tag(
        self, cluster: str, listener_nonce: bytes, dialler_nonce: bytes
    ) -> bytes | None: ...

    def sealer(
        self, scope: str | None, listener_nonce: bytes, dialler_nonce: bytes, from_dialler: bool
    ) -> Sealer: ...


class NullSealer:
    """No confidentiality or integrity: for benchmarks that measure what sealing costs."""

    __slots__ = ()

    def seal(self, header: bytes, seq: int, body: bytes) -> bytes:
        return body

    def open(self, header: bytes, seq: int, sealed: bytes) -> bytes:
        return sealed


NULL_SEALER = NullSealer()
