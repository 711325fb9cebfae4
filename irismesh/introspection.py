"""What a node knows of the mesh: its peers, the members of a cluster, its counters.

`Node` inherits `IntrospectionApi`. Membership (the core's) knows every node of the mesh; a
node links to the members of a cluster when it first needs them (`core.want`), and the waits
here (`wait_for_members`, `wait_for_peers`, `_linked`) wake on each change of membership or of
links (`_on_membership`, `_on_links`). `peers(departed=True)` also shows the nodes that went
lately, kept as they went.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from irismesh._core.events import LinksChanged, PeerDown, PeerUp
from irismesh._core.outliers import ID_PREFIX
from irismesh._core.records import MemberState
from irismesh._nodestate import NodeState
from irismesh.discovery.node_discovery import surveys
from irismesh.errors import ConfigurationError, Forbidden, MembershipTimeout, MeshError
from irismesh.security.keyring import MESH_SCOPE

_STATES = {
    MemberState.ALIVE: "alive",
    MemberState.SUSPECT: "suspect",
    MemberState.DEAD: "dead",
    MemberState.LEFT: "left",
}
# The survey's counters besides its drops that node.stats shows, prefixed "survey_".
_SURVEY_STATS = (
    "candidates",
    "announcements",
    "questions_sent",
    "answers_sent",
    "answers_withheld",
    "candidates_passed",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    """What `Node.peers()` reports of one peer."""

    node_id: str
    endpoint: str
    rtt_ms: float  # the link's ping, else membership's last probe (0: not measured yet)
    latency_ms: float
    outstanding: int
    # "alive"; "suspect": a probe went unanswered, the mesh waits for it to refute; and, from
    # peers(departed=True), "dead" (declared by membership) or "left" (said goodbye); in
    # clusters(), "announced": heard of by discovery only, not a peer of this mesh (yet).
    state: str = "alive"
    load: int = 0  # replies the peer still holds for its callers, as it last reported
    linked: bool = False  # this node has a link to it (the figures above are the link's)
    name: str = ""  # what it is called (`Node(name=...)`; "" for a node that gave none)
    # The clusters whose rotation this node keeps it out of for now (outlier ejection: its
    # requests go to the other members), sorted; () while it is in every rotation.
    ejected: tuple[str, ...] = ()
    # Its identity: the Ed25519 public key its node id derives from, in hex ("" if unknown).
    public: str = ""


class ServedClusters(tuple[str, ...]):
    """`Node.clusters`: the clusters the node serves, a tuple of names as it always was; and,
    called as `node.clusters()`, every cluster the node's keyring can open, each with its live
    members (`Node._list_clusters` says how it finds them)."""

    lister: Callable[[], dict[str, tuple[PeerInfo, ...]]]

    def __call__(self) -> dict[str, tuple[PeerInfo, ...]]:
        return self.lister()


class IntrospectionApi(NodeState):
    """Node's methods that report what it knows of the mesh."""

    async def wait_for_members(self, cluster: str, count: int = 1, *, timeout: float = 10.0) -> int:
        """Wait until `cluster` has at least `count` live members; returns how many it has.
        Forbidden at once if this node's grant lets it neither call nor serve the cluster."""
        core, driver = self._caller.running()
        rights = core.calls.rights
        if not (rights.may_call(cluster) or rights.may_serve(cluster)):
            raise Forbidden(cluster, "call", "this node's grant does not allow it")

        def found() -> int:
            core.want(cluster, time.monotonic())  # link to its members, if not yet
            driver.flush_soon()
            return len(core.members(cluster))

        return await self._wait_for_count(found, cluster, count, timeout)

    async def wait_for_peers(self, count: int = 1, *, timeout: float = 10.0) -> int:
        """Wait until membership knows at least `count` other live nodes (alive or suspect),
        whatever clusters they serve; returns how many it knows. Opens no link."""
        core, _driver = self._caller.running()
        return await self._wait_for_count(lambda: len(core.membership), None, count, timeout)

    async def _wait_for_count(
        self, found: Callable[[], int], cluster: str | None, count: int, timeout: float
    ) -> int:
        """Look again at each membership change until `found()` is `count` or more (returned),
        or raise `MembershipTimeout` after `timeout` seconds."""
        self._caller.running()  # raises Closed, saying why
        changed = self._membership_changed
        assert changed is not None
        deadline = time.monotonic() + timeout
        while True:
            now_found = found()
            if now_found >= count:
                return now_found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MembershipTimeout(cluster, count, now_found, timeout)
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def connect(self, cluster: str, *, timeout: float = 5.0) -> list[str]:
        """Link to every live member of `cluster` membership knows, waiting at most `timeout`
        for the links; returns the hex ids of the members linked. Calls open their links on
        demand anyway: this only spares the first calls the wait."""
        await self._linked(cluster, 2 * timeout)
        return self.members(cluster)

    def members(self, cluster: str) -> list[str]:
        """Hex node ids of the live members of `cluster` this node is linked to (asking opens
        links to the others, which `wait_for_members` waits for)."""
        core, driver = self._caller.running()
        core.want(cluster, time.monotonic())
        driver.flush_soon()
        return [link.peer_id.hex() for link in core.members(cluster)]

    def known_members(self, cluster: str) -> int:
        """How many live members of `cluster` membership knows, linked to this node or not
        (the members whose records say, under a key this node holds, that they serve it).
        Opens no link: `members` and `wait_for_members` do."""
        core, _ = self._caller.running()
        return len(core.directory.servers(cluster))

    def peers(self, *, departed: bool = False) -> list[PeerInfo]:
        """Every node of the mesh that membership holds alive (state "alive" or "suspect"),
        with its link's figures where this node has a link to it; with `departed`, also the
        nodes that died or left lately (state "dead" or "left", the most recent 256)."""
        core, _ = self._caller.running()
        gone = list(self._departed.values()) if departed else []
        live = []
        outliers = core.calls.outliers
        for member, link in core.known():
            if member.state > MemberState.SUSPECT:
                continue
            state = "suspect" if member.state is MemberState.SUSPECT else "alive"
            ejected = outliers.ejected_from(member.record.node_id) if outliers.ejected else ()
            if link is None:
                rtt = core.membership.rtt(member.record.node_id) or 0.0
                info = PeerInfo(
                    node_id=member.record.node_id.hex(),
                    endpoint=member.record.endpoint,
                    rtt_ms=rtt * 1000,
                    latency_ms=0.0,
                    outstanding=0,
                    state=state,
                    name=member.record.name,
                    ejected=ejected,
                    public=member.record.public.hex(),
                )
            else:
                info = PeerInfo(
                    node_id=link.peer_id.hex(),
                    endpoint=link.endpoint,
                    rtt_ms=(link.rtt or core.membership.rtt(link.peer_id) or 0.0) * 1000,
                    latency_ms=link.latency * 1000,
                    outstanding=link.outstanding,
                    state=state,
                    load=link.peer_load,
                    linked=True,
                    name=member.record.name,
                    ejected=ejected,
                    public=member.record.public.hex(),
                )
            live.append(info)
        return gone + live

    def ejected_by(self, clusters: Iterable[str]) -> dict[str, dict[str, tuple[str, ...]]]:
        """Which nodes of the mesh keep which peers out of the rotation of `clusters` (outlier
        ejection: each caller decides for itself), as their membership records say: peer id
        -> cluster -> the callers' ids, sorted (ids in hex). Only clusters this keyring holds
        a key for can be read; a caller's record says so within a few seconds of its
        decision, and names at most 8 members per cluster, for at most 4 clusters."""
        core, _ = self._caller.running()
        seen = core.ejected_by([c for c in clusters if self.keyring.primary(c) is not None])
        found: dict[str, dict[str, tuple[str, ...]]] = {}
        if not seen:
            return found
        for member, _link in core.known():
            node_id = member.record.node_id
            by_cluster = seen.get(node_id[:ID_PREFIX])
            if by_cluster and member.state <= MemberState.SUSPECT:
                found[node_id.hex()] = {
                    cluster: tuple(sorted(caller.hex() for caller in callers))
                    for cluster, callers in sorted(by_cluster.items())
                }
        return found

    def _list_clusters(self) -> dict[str, tuple[PeerInfo, ...]]:
        """`node.clusters()`: the clusters this node's keyring can open, each with its live
        members (other nodes than this one), as cluster name -> members' `PeerInfo` by node
        id; names sorted.

        A cluster is here when survey discovery heard a node name it, sealed under a key this
        keyring opens it with (its own key, else '*'; nodes seal their names under their '*'
        key too, so a '*' key lists every cluster of the nodes that hold it), or when a member
        this node links to proved it serves one of the keyring's scopes. A member that is a
        peer of this mesh is as `peers()` shows it; one only heard by discovery (of another
        mesh, or not joined yet) has state "announced" and no figures. Without the survey
        (`discovery=False`, or mDNS alone) only the keyring's scopes can appear."""
        core, _ = self._caller.running()
        live = {p.node_id: p for p in self.peers()}
        gone = {
            member.record.node_id.hex()
            for member, _ in core.known()
            if member.state > MemberState.SUSPECT
        }
        found: dict[str, dict[str, PeerInfo]] = {}
        for discovery in surveys(self._discovery):
            for name, heard in discovery.clusters_heard().items():
                members = found.setdefault(name, {})
                for raw_id, endpoint in heard.items():
                    node_id = raw_id.hex()
                    if node_id in gone or raw_id == self.node_id:
                        continue
                    members[node_id] = live.get(node_id) or PeerInfo(
                        node_id=node_id,
                        endpoint=endpoint,
                        rtt_ms=0.0,
                        latency_ms=0.0,
                        outstanding=0,
                        state="announced",
                    )
        for scope in self.keyring.scopes:
            if scope in ("*", MESH_SCOPE):
                continue
            for link in core.members(scope):
                node_id = link.peer_id.hex()
                if node_id in live:
                    found.setdefault(scope, {})[node_id] = live[node_id]
        return {
            name: tuple(sorted(members.values(), key=lambda p: p.node_id))
            for name, members in sorted(found.items())
        }

    def peer_state(self, node_id: str) -> str | None:
        """How membership holds the node with hex id `node_id` now: "alive", "suspect",
        "dead" or "left"; None if it does not know it (never heard of, or forgotten). Costs
        one lookup, whatever the size of the mesh (`peers()` lists them all)."""
        core, _ = self._caller.running()
        try:
            member = core.membership.get(bytes.fromhex(node_id))
        except ValueError:
            raise ConfigurationError(f"bad node id {node_id!r}: expected hex") from None
        if member is None:
            return None
        return _STATES[member.state]

    @property
    def stats(self) -> Mapping[str, int]:
        """Counters: drops by reason, requests resent and timed out, peers up and down; the
        survey's as `survey_dropped_replay`, `survey_dropped_stale`, ..."""
        if self._core is None:
            return {}
        stats = dict(self._core.stats)
        stats["requests_pending"] = self._core.pending_count
        stats["handlers_running"] = self._runner.running
        stats.update(self._serving_stats)
        admission = self._runner.admission
        if admission is not None:
            stats["requests_waiting"] = admission.waiting
            stats["handler_limit"] = int(admission.limit)
        stats["reply_cache_entries"] = len(self._core.reply_cache)
        stats["members_ejected_now"] = self._core.calls.outliers.ejected
        stats["messages_published"] = self._pubsub.published
        stats["messages_delivered"] = self._pubsub.delivered
        stats["messages_unmatched"] = self._pubsub.unmatched
        stats["messages_duplicates_dropped"] = self._pubsub.duplicates
        stats["tunnels_open"] = self._tunnels.open_count
        stats["loop_turns_given"] = self._caller.turns.given
        memory = self._memory
        if memory is not None:
            stats.update(memory.stats)
            if memory.member is not None:
                for name, value in memory.member.figures().items():
                    stats["memory_" + name] = value
        stats.update(self.grants.stats)
        stats.update(self._data_figures())
        for discovery in surveys(self._discovery):  # the survey's drops, replays, stale ones
            for name, value in discovery.stats.items():
                if name.startswith("dropped_") or name in _SURVEY_STATS:
                    stats["survey_" + name] = value
        return stats

    def _gauges(self) -> dict[str, float]:
        core = self._core
        if core is None:
            return {}
        return {
            "requests_in_flight": core.pending_count,
            "handlers_running": self._runner.running,
            "peers": len(core.membership),
            "links": len(core.peers()),
            "reply_cache_entries": len(core.reply_cache),
            "members_ejected_now": core.calls.outliers.ejected,
            **self._overload_counters(),
        }

    def _overload_counters(self) -> dict[str, float]:
        """Admission's and the throttle's counters so far (cumulative), for the gauges."""
        counters: dict[str, float] = dict(self._serving_stats)
        stats = self._core.stats if self._core is not None else {}
        for name in ("requests_throttled", "requests_turned_away", "cancels_received"):
            counters[name] = stats.get(name, 0)
        counters.update((k, v) for k, v in stats.items() if k.startswith("requests_shed_"))
        admission = self._runner.admission
        if admission is not None:
            counters["requests_waiting"] = admission.waiting
            counters["handler_limit"] = admission.limit
        return counters

    def _on_membership(self, event: PeerUp | PeerDown) -> None:
        """A peer came or went: `peers(departed=True)` and `wait_for_members` hear of it."""
        key = event.node_id.hex()
        self._departed.pop(key, None)
        if type(event) is PeerDown:
            self._departed[key] = PeerInfo(
                node_id=key,
                endpoint=event.endpoint,
                rtt_ms=0.0,
                latency_ms=0.0,
                outstanding=0,
                state="left" if event.reason == "left" else "dead",
                name=event.name,
            )
            if len(self._departed) > 256:
                del self._departed[next(iter(self._departed))]
        if self._membership_changed is not None:
            self._membership_changed.set()

    def _on_links(self, event: LinksChanged) -> None:
        if self._membership_changed is not None:
            self._membership_changed.set()

    async def _linked(self, cluster: str, timeout: float | None, *, every: bool = True) -> float:
        """Wait until this node is linked to every member of `cluster` membership knows (or,
        not `every`, to one), within half of `timeout`; returns what is left of `timeout`."""
        try:
            core, driver = self._caller.running()
            timeout = self._default_timeout if timeout is None else timeout
            if not timeout > 0:
                raise ConfigurationError(f"timeout must be positive, got {timeout!r}")
        except MeshError:
            await self._caller.turns.maybe_pause()  # refused at once: still fair
            raise
        start = time.monotonic()
        changed = self._membership_changed
        assert changed is not None
        while True:
            known = core.want(cluster, time.monotonic())
            linked = len(core.members(cluster))
            if linked >= (known if every else min(known, 1)):
                break
            driver.flush_soon()
            remaining = start + timeout / 2 - time.monotonic()
            if remaining <= 0:
                break
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
        return timeout - (time.monotonic() - start)
