"""Far gateways' grants on a federation link: who the far gateway is, whether its grant holds,
and what that grant lets it send and take (`linkproto.LinkEnd` asks).

A gateway may show *who* it is in its HELLO or WELCOME: two optional trailing fields, its
identity's Ed25519 public key and the grant it holds (its mesh authority's token), and its
identity's signature over the transcript (the HELLO's fields; the HELLO's and the WELCOME's
for a WELCOME), nonces and ephemeral keys among them, so a signed HELLO replayed by another
holder of the link key gives it no session, and a tampered grant fails the signature. A
gateway told to require far grants (`far_grants`) shows itself in its HELLOs, and refuses a
far gateway that shows no identity, or a grant that does not hold under an authority it trusts
(untrusted, expired, revoked, no gateway right): its HELLO or WELCOME is dropped and counted
(`dropped_no_grant`, `dropped_grant_refused`, `dropped_revoked`). A listener shows itself in its
WELCOME when the HELLO did. A link whose far grant stops holding (expired, revoked) goes down
(`closed_grant`) at the next tick. The far grant limits the link: what the far gateway says it
exports is kept only as far as its `export` allows (`far_exports_refused`), and the link's
`far_may_*` say what its `import` takes and what its `export` may send (decided once per name,
per session, in `FarVerdicts`). Without those fields a HELLO and WELCOME are byte-for-byte as
before; a gateway of an earlier release drops one that has them unanswered, as malformed
(`dropped_malformed`), so only a gateway that requires far grants sends them first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Final, Protocol

from irismesh._core.rights import PeerGrant, Rights, topic_allowed
from irismesh.errors import ProtocolError
from irismesh.federation.linkwire import Exports, Shown

__all__ = ["FarGrants", "FarVerdicts", "Signer", "check_far", "granted_exports", "no_grant"]

_MAX_FAR_VERDICTS: Final = 4096  # topics and clusters whose far-grant verdict a link keeps
IMPORT_CLUSTER, IMPORT_TOPIC, EXPORT_TOPIC = 0, 1, 2  # what a verdict is on


class Signer(Protocol):
    """A gateway's identity (`irismesh.security.identity.Identity`)."""

    @property
    def public(self) -> bytes: ...

    def sign(self, message: bytes) -> bytes: ...


class FarGrants(Protocol):
    """The verdicts on far gateways' grants (`irismesh.federation.grants.FarGrantPolicy`)."""

    def admit(self, public: bytes, token: bytes) -> PeerGrant:
        """A far gateway's grant verified (UNGRANTED if none holds; ProtocolError `revoked`)."""
        ...

    def holds(self, public: bytes, grant: PeerGrant) -> bool:
        """Whether a grant admitted earlier still holds (not expired, not revoked)."""
        ...


def no_grant() -> bytes:
    """The grant token of a gateway that shows none."""
    return b""


def check_far(far: FarGrants | None, shown: Shown | None) -> tuple[bytes, PeerGrant | None]:
    """The far gateway's identity and grant as this end takes them (a grant of None: not
    checked); ProtocolError (`no_grant`, `grant_refused`, `revoked`) where far grants are
    required (`far`) and its grant does not hold."""
    if far is None:
        return (b"" if shown is None else shown.public), None
    if shown is None or not shown.grant:
        raise ProtocolError("no_grant", "the far gateway presented no grant")
    grant = far.admit(shown.public, shown.grant)
    if not grant.rights.gateway:
        raise ProtocolError(
            "grant_refused",
            "the far gateway's grant does not hold here (authority not trusted, expired, "
            "revoked, or no gateway right)",
        )
    return shown.public, grant


def granted_exports(grant: PeerGrant, exports: Exports, stats: Counter[str]) -> Exports:
    """What the far gateway says it exports, as far as its grant's `export` allows (the rest
    counted, `far_exports_refused`)."""
    rights = grant.rights
    kept = Exports(
        clusters=tuple(c for c in exports.clusters if rights.may_export_cluster(c)),
        topics=tuple(p for p in exports.topics if rights.may_export_topics(p)),
    )
    refused = len(exports.clusters) + len(exports.topics) - len(kept.clusters) - len(kept.topics)
    if refused:
        stats["far_exports_refused"] += refused
    return kept


def _may_export_topic(rights: Rights, topic: str) -> bool:
    return topic_allowed(topic, rights.gateway_export, ())


_DECIDE: Final[tuple[Callable[[Rights, str], bool], ...]] = (
    Rights.may_import_cluster,
    Rights.may_import_topic,
    _may_export_topic,
)


class FarVerdicts:
    """What a far gateway's grant allows, decided once per name for a session (bounded: past
    `_MAX_FAR_VERDICTS` names the verdicts are decided again)."""

    __slots__ = ("_verdicts", "grant")

    def __init__(self) -> None:
        self.grant: PeerGrant | None = None  # None: not checked, everything allowed
        self._verdicts: dict[tuple[int, str], bool] = {}

    def reset(self, grant: PeerGrant | None) -> None:
        """A new session, under this grant."""
        self.grant = grant
        self._verdicts.clear()

    def allows(self, kind: int, name: str) -> bool:
        grant = self.grant
        if grant is None:
            return True
        verdicts = self._verdicts
        verdict = verdicts.get((kind, name))
        if verdict is None:
            if len(verdicts) >= _MAX_FAR_VERDICTS:
                verdicts.clear()
            verdict = verdicts[(kind, name)] = _DECIDE[kind](grant.rights, name)
        return verdict
