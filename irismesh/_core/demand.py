"""Links on demand: which peers this node links to, and when it lets a link go.

Theory of operation
-------------------
A node links only to the peers it talks to. It *wants* a cluster when it calls it (`want`,
from a call, a member list, a wait), and a topic scope when it publishes there (`readers`);
the directory says which live members serve the one or read the other, and each not linked yet
is dialled (`link_to`, through a dial record so that failures back off). A link is *needed*
while it carries requests, replies to acknowledge, tunnels or publishes, while it was used
within `idle_link_after`, or while its peer serves a cluster or reads a scope still wanted; a
want lapses `idle_link_after` after its last use. Every second `housekeep` forgets lapsed
wants, closes the links no longer needed (with a goodbye, so the peer forgets its end too),
dials the wanted members still missing, and redials seeds while this node finds itself alone
(once in the mesh, membership keeps it there). At `max_links` the least recently needed link
closes to make room (`close_least_needed`).

Members this node found gone itself (`unreachable`): when an UP link's connection drops, its
endpoint is dialled again at once, and a refusal there (no process listens any more: a killed
member's kernel closes its sockets and refuses new ones) takes the member out of this node's
routing: `want` and `readers` leave it out, so a call into a cluster with no other member
fails at once. Membership is not told: it still decides with its probes whether the member is
dead. The member is still dialled on demand, with backoff, and comes back (`MeshCore`) when a
handshake with it completes or membership hears a newer incarnation of it; membership's
verdict of death or leave forgets it here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from random import Random

from irismesh._core.config import CoreConfig
from irismesh._core.directory import Directory
from irismesh._core.links import DialRecord, OutLink
from irismesh._core.records import MemberRecord

MAX_DIAL_RECORDS = 4096  # endpoints remembered (seeds always are)
# Why an UP link closes when its transport broke under it (the drivers' and `link_failed`'s
# reasons): the peer may have died, so its endpoint is dialled again at once.
DROPPED = frozenset(("disconnected", "transport"))
# Dials after a drop that may connect and drop again before their handshake (a dying process's
# listener), each followed by another at once, before the drop counts as no evidence.
REDIALS_AFTER_DROP = 2


class LinkDemand:
    """What this node wants links for, kept against the engine's tables (read here)."""

    def __init__(
        self,
        *,
        config: CoreConfig,
        stats: Counter[str],
        directory: Directory,
        peers: dict[bytes, OutLink],
        dials: dict[str, DialRecord],
        own_endpoint: str,
        rng: Random,
        open_link: Callable[[DialRecord, float], None],
        link_count: Callable[[], int],
        goodbye: Callable[[OutLink, float, str], None],
        tunnels_use: Callable[[OutLink], bool],
        alone: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._stats = stats
        self._directory = directory
        self._peers = peers  # the engine's UP dialled links, by node id
        self._dials = dials  # and its dial records, by endpoint
        self._own = own_endpoint
        self._rng = rng
        self._open_link = open_link
        self._link_count = link_count
        self._goodbye = goodbye
        self._tunnels_use = tunnels_use
        self._alone = alone
        self._clock = clock
        # Cluster or topic scope -> when this node last needed links for it.
        self.clusters: dict[str, float] = {}
        self.scopes: dict[str, float] = {}
        # Members out of this node's routing (see the module's docstring): node id -> the
        # incarnation membership held when it was taken out (a newer one puts it back).
        self.unreachable: dict[bytes, int] = {}

    def want(self, cluster: str, now: float) -> int:
        """This node calls `cluster`: link to its members (dialling those not linked yet);
        how many live members membership knows it has, less those `unreachable`."""
        self.clusters[cluster] = now
        servers = self.link_to(self._directory.servers(cluster), now)
        unreachable = self.unreachable
        if unreachable:
            return sum(node_id not in unreachable for node_id in servers)
        return len(servers)

    def readers(self, scope: str) -> dict[bytes, MemberRecord]:
        """Live members that read topic `scope`, less those `unreachable`: this node publishes
        there, so it links to each of them (dialling those not linked yet)."""
        now = self._clock()
        self.scopes[scope] = now
        readers = self.link_to(self._directory.readers(scope), now)
        unreachable = self.unreachable
        if unreachable:
            return {k: v for k, v in readers.items() if k not in unreachable}
        return readers

    def link_to(self, records: dict[bytes, MemberRecord], now: float) -> dict[bytes, MemberRecord]:
        peers = self._peers
        for node_id, record in records.items():
            if node_id not in peers:
                self.dial_member(record, now)
        return records

    def dial_member(self, member: MemberRecord, now: float) -> None:
        """Link to a member this node needs (it serves a cluster called, reads a scope)."""
        record = self._dials.get(member.endpoint)
        if record is None:
            if len(self._dials) >= MAX_DIAL_RECORDS:
                self._stats["candidates_dropped"] += 1
                return
            record = self._dials[member.endpoint] = DialRecord(member.endpoint, seed=False)
            record.join = False
        if not record.link_id and now >= record.next_at:
            self.dial(record, now)

    def candidate(self, endpoint: str, now: float, *, seed: bool) -> None:
        """An endpoint to join the mesh through: a seed, or one discovery found (ignored when
        membership already knows a member there)."""
        if not seed and self._directory.knows_endpoint(endpoint):
            return
        record = self._dials.get(endpoint)
        if record is None:
            if len(self._dials) >= MAX_DIAL_RECORDS and not seed:
                self._stats["candidates_dropped"] += 1
                return
            record = self._dials[endpoint] = DialRecord(endpoint, seed=False)
        if endpoint == self._own:
            return  # never dial ourselves, even when listed as a seed
        record.join = True
        if seed:
            record.seed = True
        if not record.link_id and now >= record.next_at:
            self.dial(record, now)

    def dial(self, record: DialRecord, now: float) -> None:
        """Open a link through `record`; at `max_links`, only if an idle link can make room."""
        if self._link_count() >= self._config.max_links and not self.close_least_needed(now):
            # Each dialled link costs sockets and file descriptors, and all are needed now.
            # The record waits for its turn.
            self._stats["dials_deferred"] += 1
            record.next_at = now + self._config.redial_max * (0.5 + self._rng.random())
            if not record.seed:  # a deferral counts as a failed try: floods drain away
                record.failures += 1
                if record.failures >= self._config.forget_after_failures:
                    del self._dials[record.endpoint]
            return
        self._open_link(record, now)

    def dial_ended(self, record: DialRecord, reason: str, was_up: bool, now: float) -> None:
        """The link dialled through `record` closed for `reason`: when to dial again, if ever."""
        record.link_id = 0
        cfg = self._config
        if reason in ("self", "duplicate"):
            record.next_at = float("inf")  # never useful to dial again
        elif reason in ("rekey", "grant") or (was_up and reason in DROPPED):
            # At once: to handshake again with new keys or grants, or to see whether anyone
            # still listens where a connection dropped.
            record.next_at = now
        elif was_up and reason in ("bye", "idle", "dead", "left"):
            if record.seed:  # dialled again only if this node finds itself alone
                record.next_at = now + cfg.redial_max
            else:
                del self._dials[record.endpoint]
        else:
            record.failures += not was_up
            backoff = min(cfg.redial_max, cfg.redial_min * 2 ** min(record.failures, 10))
            record.next_at = now + backoff * (0.5 + self._rng.random())
            if not record.seed and record.failures >= cfg.forget_after_failures:
                del self._dials[record.endpoint]

    def forget(self, endpoint: str) -> None:
        """A member there died or left: its record goes, unless a seed's or dialled now."""
        record = self._dials.get(endpoint)
        if record is not None and not record.seed and not record.link_id:
            del self._dials[endpoint]

    def dial_wanted(self, now: float) -> None:
        """Dial the members of what is wanted that are not linked yet."""
        directory = self._directory
        for cluster in self.clusters:
            self.link_to(directory.servers(cluster), now)
        for scope in self.scopes:
            self.link_to(directory.readers(scope), now)

    def needed(self, link: OutLink, now: float) -> bool:
        """Whether a link carries, or will soon carry, something: else it may close."""
        if link.outstanding or link.acks or link.busy:
            return True
        if link.pub_seq != link.pub_seen:  # published to since the last look
            link.pub_seen = link.pub_seq
            link.last_sample = now
        if now - link.last_sample < self._config.idle_link_after:
            return True
        if self._tunnels_use(link):
            return True
        wanted = self.clusters
        if any(slot and cluster in wanted for cluster, slot in link.clusters.items()):
            return True
        readers = self._directory.readers
        return any(link.peer_id in readers(scope) for scope in self.scopes)

    def close_least_needed(self, now: float) -> bool:
        """At max_links: close the idle link used longest ago, if there is one."""
        idle = [x for x in self._peers.values() if not self.needed(x, now)]
        if not idle:
            return False
        self._goodbye(min(idle, key=lambda x: x.last_sample), now, "idle")
        return True

    def housekeep(self, now: float) -> None:
        """Forget what is no longer used, close idle links, dial what is missing."""
        idle = self._config.idle_link_after
        for cluster, at in list(self.clusters.items()):
            if now - at > idle:
                del self.clusters[cluster]
                self._directory.forget(cluster=cluster)
        for scope, at in list(self.scopes.items()):
            if now - at > idle:
                del self.scopes[scope]
                self._directory.forget(scope=scope)
        for link in list(self._peers.values()):
            if link.outstanding or now - link.last_sample < idle:
                for cluster, slot in link.clusters.items():
                    if slot and cluster in self.clusters:
                        self.clusters[cluster] = now
            elif not self.needed(link, now):
                self._stats["links_idle_closed"] += 1
                self._goodbye(link, now, "idle")
        self.dial_wanted(now)
        alone = self._alone()
        for record in list(self._dials.values()):
            if record.link_id or now < record.next_at or record.endpoint == self._own:
                continue
            if record.seed and not alone:
                continue  # seeds are for joining: once in the mesh, membership keeps us in
            if record.join:
                self.dial(record, now)
