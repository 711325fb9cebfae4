"""The sealing seam: every frame's body passes through a `Sealer`, the header as associated data.

The core never sees keys or ciphers. A `LinkSecurity` (implemented in `irismesh.security`)
makes the key-dependent decisions of a node's links:

- `begin()` starts the key agreement of one link end (`LinkKeys`): its `public` bytes travel in
  HELLO or WELCOME, and `establish(peer_public, listener_nonce, dialler_nonce)` completes it.
  The link's own control traffic (pings, peer lists, goodbyes) is sealed under the agreed key.
- `offers(cluster, ...)`: the listener's offer tags for a cluster it serves, one per key it
  accepts for it (two during a rotation), each a MAC under that key over the link's fresh
  nonces. Tags are all a peer ever sees of the clusters a node serves: without the key a tag is
  noise, and a recorded tag is useless on another link.
- `match(cluster, ...)`: the dialler's side: which offered tag (if any) was made with a key it
  holds for the cluster, and an opaque handle naming that key.
- `LinkKeys.sealer(handle, from_dialler)`: the sealer of the frames that flow one way
  (`from_dialler`: dialler to listener) in one scope: the link's (handle None) or a cluster key's.
  Both ends ask with the same arguments for the same direction and the two directions always
  differ, so each direction has keys of its own and both may count `seq` from 1 without ever
  reusing an AEAD nonce. Keys are fresh per link, so counters restart safely after a restart.

Nonce discipline belongs to the sealer: the core hands it the frame's `seq`, strictly
increasing per link and direction and checked on receipt (replays and reordering are rejected).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from irismesh._core.gossip import DatagramSealer
from irismesh._core.records import MembershipSecurity


class Sealer(Protocol):
    """Seals and opens the body of frames of one direction of one scope of one link."""

    def seal(self, header: bytes, seq: int, body: bytes) -> bytes: ...

    def open(self, header: bytes, seq: int, sealed: bytes | memoryview) -> bytes:
        """Return the plaintext body (bytes, even from a view), or raise
        ProtocolError('bad_seal')."""
        ...


class LinkKeys(Protocol):
    """The key agreement and sealers of one end of one link."""

    @property
    def public(self) -> bytes: ...

    def establish(self, peer_public: bytes, listener_nonce: bytes, dialler_nonce: bytes) -> None:
        """Complete the agreement, or raise ProtocolError('bad_handshake')."""
        ...

    def sealer(self, handle: object | None, from_dialler: bool) -> Sealer: ...


class LinkSecurity(Protocol):
    """Key-dependent decisions of a node's links."""

    def begin(self) -> LinkKeys: ...

    def has_key(self, cluster: str) -> bool: ...

    def offers(
        self, cluster: str, listener_nonce: bytes, dialler_nonce: bytes
    ) -> list[tuple[bytes, object]]:
        """(tag, key handle) for each key accepted for `cluster`; empty without a key."""
        ...

    def match(
        self,
        cluster: str,
        listener_nonce: bytes,
        dialler_nonce: bytes,
        offered: Mapping[bytes, int],
    ) -> tuple[int, object] | None:
        """(slot, key handle) of an offered tag made with a key we hold, primary key first."""
        ...

    def topic_offers(
        self, listener_nonce: bytes, dialler_nonce: bytes
    ) -> list[tuple[bytes, object, str]]:
        """(tag, key handle, scope) for each key of each topic scope this node can read:
        every scope with a key of its own, and "*" for the topics under the default key."""
        ...

    def match_topic(
        self,
        scope: str,
        listener_nonce: bytes,
        dialler_nonce: bytes,
        offered: Mapping[bytes, int],
    ) -> tuple[int, object] | None:
        """(slot, key handle) of the offer matching the key this node would publish topic
        `scope` under (its own key for the scope, else the default key); None if none."""
        ...

    def owns(self, scope: str) -> bool:
        """Whether `scope` has a key of its own here (not only the default key)."""
        ...

    def holds(self, handle: object) -> bool:
        """Whether the key behind `handle` (from `offers`, `match`, ...) is still accepted for
        what it seals: False once a rotation has removed it from the keyring."""
        ...


class NullSealer:
    """No confidentiality or integrity: for benchmarks that measure what sealing costs."""

    __slots__ = ()

    def seal(self, header: bytes, seq: int, body: bytes) -> bytes:
        return body

    def open(self, header: bytes, seq: int, sealed: bytes | memoryview) -> bytes:
        return sealed if isinstance(sealed, bytes) else bytes(sealed)


NULL_SEALER = NullSealer()


class NodeSecurity(LinkSecurity, MembershipSecurity, Protocol):
    """Every key-dependent decision of a node: its links', and its membership's."""

    def datagram_sealer(self, node_id: bytes) -> DatagramSealer:
        """The sealer of this node's membership datagrams (under the mesh key)."""
        ...
