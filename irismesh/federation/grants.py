"""A gateway's grant: what it may carry between meshes, where its mesh requires grants.

Theory of operation
-------------------
A gateway's node presents the gateway's grant (`Gateway(identity=..., grant=...)`) as any node
does. Where the gateway's keyring says ``@require-grants``, the grant's gateway rights (`mesh
grant --export ... --import ...`: cluster names and topic patterns) decide what crosses, each
thing once, never message by message:

- A gateway whose grant gives no gateway right (or that holds no grant that holds) refuses to
  be made: `Forbidden` (right "gateway").
- Export. Of the clusters and topic patterns the gateway is told to export, it keeps those its
  grant's `export` allows; the others are refused when it is made (logged, and counted in
  `exports_refused_forbidden`): never offered to its peers, never subscribed to, and a far call
  for one is refused (`requests_refused_forbidden`, `broadcasts_...`, `surveys_...`).
- Import. A cluster a peer exports is served here only if the grant's `import` allows it
  (`imports_refused_forbidden` counts each refused cluster once); a message crossing in is
  republished here, and passed on, only if `import` allows its topic: otherwise it is dropped
  and counted (`crossings_refused_forbidden`), the verdict kept per topic.

The gateway's rights also let its node do what they take (`Rights.may_call` and the others): a
grant of ``--export db`` lets the gateway call db in its mesh for far callers. Without
``@require-grants`` nothing here applies and nothing is checked.

Far gateways. The grant above binds this gateway; a far gateway's binds the far one. A gateway
made with ``require_far_grants=True`` (``mesh gateway --require-far-grants``) requires every far
gateway that links to it over TCP, or that it dials, to show its identity and a grant that holds
under an authority it trusts (`FarGrantPolicy`: the link keyring's ``@authority`` lines and the
mesh keyring's), and limits each link to that grant (`irismesh.federation.linkproto`): what the
far gateway exports beyond its `export` is not imported here, calls to a cluster beyond its
`import` are not answered (`requests_refused_far_grant`, and the broadcasts', surveys' and
tunnels' counters), messages on a topic beyond its `import` are not sent to it
(`crossings_withheld_far_grant`) and those beyond its `export` are not taken from it
(`crossings_refused_far_grant`). Such a link goes down once the far grant expires or is revoked
(revocations this gateway's node applies, or `Gateway.revoke`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from irismesh._core.rights import UNCHECKED, PeerGrant, Rights
from irismesh.errors import Forbidden
from irismesh.security.grants import NodeGrants

if TYPE_CHECKING:
    from irismesh.federation.linkproto import Exports
    from irismesh.node import Node

_MAX_TOPICS: Final = 4096  # topics whose import verdict a gateway remembers at once


class GatewayGrant:
    """What a gateway's grant lets it carry; `rights` None: grants are not required."""

    def __init__(self, rights: Rights | None) -> None:
        self.rights = rights
        self._topics: dict[str, bool] = {}
        self.refused_imports: set[str] = set()  # clusters a peer exports that were refused

    @classmethod
    def of(cls, mesh: str, node: Node) -> GatewayGrant:
        """The grant of the gateway whose node is `node`; Forbidden if grants are required
        and it gives no gateway right."""
        own = node.grants.own()
        if own is UNCHECKED:
            return cls(None)
        rights = own.rights
        if not rights.gateway:
            if node.grants.grant is None:
                detail = "grants are required and this gateway has none (grant=, --grant)"
            else:
                detail = "its grant gives no gateway right (mesh grant --export/--import)"
            raise Forbidden(mesh, "gateway", detail)
        return cls(rights)

    def exports(self, export: Exports) -> tuple[list[str], list[str]]:
        """The clusters and the topic patterns of `export` the grant does not allow."""
        rights = self.rights
        if rights is None:
            return [], []
        clusters = [c for c in export.clusters if not rights.may_export_cluster(c)]
        topics = [p for p in export.topics if not rights.may_export_topics(p)]
        return clusters, topics

    def may_import_cluster(self, cluster: str) -> bool:
        rights = self.rights
        return rights is None or rights.may_import_cluster(cluster)

    def may_import_topic(self, topic: str) -> bool:
        """Whether a message on `topic` may cross into this mesh (decided once per topic)."""
        rights = self.rights
        if rights is None:
            return True
        verdict = self._topics.get(topic)
        if verdict is None:
            if len(self._topics) >= _MAX_TOPICS:
                self._topics.clear()
            verdict = self._topics[topic] = rights.may_import_topic(topic)
        return verdict


class FarGrantPolicy(NodeGrants):
    """The verdicts on far gateways' grants: trusting `authorities`, and holding a grant
    revoked if this policy or the gateway's node (`mesh`, the policy its mesh's gossip feeds)
    knows a revocation of it, or if its authority is no longer trusted."""

    def __init__(self, mesh: NodeGrants, authorities: Iterable[bytes]) -> None:
        super().__init__(public=b"", authorities=authorities, required=True, clock=mesh.clock)
        self._mesh = mesh

    def revoked(self, public: bytes, issued: float) -> bool:
        return super().revoked(public, issued) or self._mesh.revoked(public, issued)

    def holds(self, public: bytes, grant: PeerGrant) -> bool:
        # An authority no longer trusted (the link keyring reread) ends its grants' links too.
        return grant.authority in self.authorities and super().holds(public, grant)


__all__ = ["FarGrantPolicy", "GatewayGrant"]
