"""Outlier ejection: a caller takes a member that stands out of its rotation for a while.

Theory of operation
-------------------
Each caller judges the members it sends requests to by what it sees of them (Envoy's outlier
detection is the model); it tells nobody, and other callers judge for themselves. Three signs
take a member out of the caller's rotation for a cluster:

- errors: `consecutive_errors` replies in a row were errors (its handler raised: the caller's
  RemoteError). Counted as each reply arrives, so a member that fails every request is out
  after its first few failures, whatever the request rate.
- success rate: over the last `interval`, with at least `min_requests` of the caller's requests
  answered or timed out there, its share of good replies is more than `success_rate_gap` below
  the median of the other members' (those with as many requests). Timeouts count against it
  here: a member that stops answering while its peers answer stands out. They do not count
  when every member asked let some time out (a caller whose own overload, a loop too busy to
  take its replies, lets requests time out sees it at every member, unevenly), nor while a
  member of the cluster turned requests away, in the interval or the one before (the cluster
  is overloaded: one member may shed while another, as loaded, lets its queue time out
  before it sheds).
- latency: with as many requests in the interval, none of them turned away, its latency
  estimate (the balancer's) is `latency_factor` times the median of the other members' and
  `latency_floor` seconds above it.

An Overloaded reply counts for nothing: a member that sheds is healthy and says so; the balancer
already gives it less (`balancer.penalise`), and as that penalty inflates its latency estimate,
a member that turned a request away in the interval is not judged by latency.

An ejection lasts `base_ejection` times the member's ejection count, at most `max_ejection`:
a member that fails again as it comes back is out for longer each time, and one that recovered
is back within `max_ejection`. The count decays by one for each `base_ejection` the member
spends in rotation, so an ejection long ago is forgotten. `tick` readmits a member as its
time is up, with its count of errors in a row cleared and the latency estimate of a typical
member of its cluster (its own is stale; its replies correct it). At most `max_ejected_share` of a
cluster's linked members (rounded down) are out at once: with every member failing, the rest
still serve, and fail, in rotation. Ejection routes around a few bad members; it never
empties a cluster, and `rotation` gives every member back if none is left in it.

The member is a link's peer; a peer serving two clusters has its replies counted together,
and is ejected from the cluster whose requests it failed. Ejections outlive the link: a member
whose link closes and opens again is still out.

Shared. A caller's ejections are its own decisions, but an operator wants to see them across
the mesh ("which callers keep this member out?"). So each node says in its membership record
which members it keeps out of each cluster's rotation now: per cluster, a *note* sealed under
the cluster's key (the traffic splits' notes, `split`), of kind NOTE_EJECTED, listing the
first ID_PREFIX bytes of at most MAX_NOTE_IDS members' ids, for at most MAX_NOTE_CLUSTERS
clusters. The record carries them after everything else, only in the room left (its tags
have a budget, `gossip.MAX_TAGS`), and changes at most once per SHARE_EVERY: ejections are
rare, and a change of record costs the mesh one round of gossip. `SharedEjections` keeps the
sealed notes; `ejected_by` reads them out of the live records, for the clusters named.

Cost: `Calls.request` asks `rotation` for the members to choose from only while some member is
ejected (the list is kept per cluster, remade when an ejection or the cluster's links change);
a reply costs its link two integer updates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack

from irismesh._core.events import MemberEjected, MemberReadmitted
from irismesh._core.links import OutLink
from irismesh._core.outbox import Outbox
from irismesh._core.plain import Plain
from irismesh._core.records import NOTE_SALT, MemberRecord, MembershipSecurity
from irismesh._core.split import unpack_note
from irismesh.errors import ConfigurationError, NoKey

ERRORS, SUCCESS_RATE, LATENCY = "errors", "success_rate", "latency"  # why a member was ejected

NOTE_EJECTED = 2  # the kind of note: members out of a cluster's rotation (`split` has 1)
ID_PREFIX = 8  # bytes of a member's id a note names it by
MAX_NOTE_IDS = 8  # members one note names
MAX_NOTE_CLUSTERS = 4  # clusters a record carries notes on
SHARE_EVERY = 1.0  # seconds: the most often a record's notes change


@dataclass(frozen=True, slots=True, kw_only=True)
class OutlierConfig:
    """When a caller takes a member out of its rotation, and for how long (seconds).

    `enabled=False` turns ejection off: every live member stays in rotation."""

    enabled: bool = True
    consecutive_errors: int = 5  # error replies in a row that eject a member at once
    interval: float = 1.0  # the success-rate and latency sweep, and readmissions
    min_requests: int = 20  # requests in an interval before a member is judged by rate
    success_rate_gap: float = 0.3  # below the other members' median success rate by this
    latency_factor: float = 10.0  # this many times the other members' median latency ...
    latency_floor: float = 0.1  # ... and this many seconds above it
    base_ejection: float = 5.0  # the first ejection; the nth lasts n times as long
    max_ejection: float = 30.0  # the longest an ejection lasts
    max_ejected_share: float = 0.5  # of a cluster's linked members, out at once at most

    def __post_init__(self) -> None:
        if self.consecutive_errors < 1 or self.min_requests < 1:
            raise ConfigurationError("consecutive_errors and min_requests must be at least 1")
        if self.interval <= 0:
            raise ConfigurationError("the outlier sweep's interval must be positive")
        if not 0 < self.base_ejection <= self.max_ejection:
            raise ConfigurationError("need 0 < base_ejection <= max_ejection")
        if not 0 <= self.max_ejected_share <= 1:
            raise ConfigurationError("max_ejected_share must be between 0 and 1")
        if not 0 < self.success_rate_gap <= 1:
            raise ConfigurationError("success_rate_gap must be above 0 and at most 1")
        if self.latency_factor <= 1 or self.latency_floor < 0:
            raise ConfigurationError("latency_factor must be above 1, latency_floor not negative")


class Ejection(Plain):
    """One member's ejections from one cluster's rotation."""

    cluster: str
    node_id: bytes
    count: int  # ejections so far, less the decay for time spent in rotation since
    until: float  # when it comes back; 0.0 while it is in rotation
    since: float  # when it last came back (or was first ejected)

    def __init__(
        self, cluster: str, node_id: bytes, count: int, until: float, since: float
    ) -> None:
        self.cluster, self.node_id, self.count = cluster, node_id, count
        self.until, self.since = until, since


def _median(values: list[float]) -> float:
    values.sort()
    n = len(values)
    middle = n // 2
    return values[middle] if n % 2 else (values[middle - 1] + values[middle]) / 2


class OutlierEjection:
    """Which members this caller keeps out of rotation, per cluster, and until when."""

    def __init__(
        self,
        *,
        config: OutlierConfig,
        stats: Counter[str],
        outbox: Outbox,
        peers: dict[bytes, OutLink],
        members: Callable[[str], list[OutLink]],
    ) -> None:
        self.config = config
        self.enabled = config.enabled
        self._stats = stats
        self._outbox = outbox
        self._peers = peers  # the engine's UP dialled links, by node id
        self._members = members  # a cluster's UP links (Calls.members)
        # Members out of rotation now, in all clusters: `Calls.request` filters while nonzero.
        self.ejected = 0
        self._out: dict[str, set[bytes]] = {}  # cluster -> node ids out of its rotation
        self._records: dict[tuple[str, bytes], Ejection] = {}
        # cluster -> (the members list it was made from, those in rotation)
        self._rotations: dict[str, tuple[list[OutLink], list[OutLink]]] = {}
        self._next_sweep = 0.0
        self._shed_lately: set[str] = set()  # clusters a member of which shed load last interval
        self._next_readmission = float("inf")  # the earliest ejection's end
        self.unshared = False  # the ejections changed since `shared` last said which

    # ----------------------------------------------------------------- the caller's choice

    def rotation(self, cluster: str, members: list[OutLink]) -> list[OutLink]:
        """`in_rotation`, kept for the cluster's list of members (`Calls.linked`) until it
        or an ejection changes: a request allocates nothing."""
        kept = self._rotations.get(cluster)
        if kept is not None and kept[0] is members:
            return kept[1]
        chosen = self.in_rotation(cluster, members)
        self._rotations[cluster] = (members, chosen)
        return chosen

    def in_rotation(self, cluster: str, members: list[OutLink]) -> list[OutLink]:
        """`members` of `cluster` less those ejected from it (all of them if none is left)."""
        out = self._out.get(cluster)
        chosen = [m for m in members if m.peer_id not in out] if out else members
        return chosen or members  # an ejected member is better than none

    def is_ejected(self, cluster: str, node_id: bytes) -> bool:
        out = self._out.get(cluster)
        return out is not None and node_id in out

    def ejected_from(self, node_id: bytes) -> tuple[str, ...]:
        """The clusters whose rotation `node_id` is out of, here."""
        return tuple(sorted(c for c, out in self._out.items() if node_id in out))

    # ----------------------------------------------------------------- outcomes

    def failed(self, link: OutLink, cluster: str, now: float) -> None:
        """The member on `link` answered a request to `cluster` with an error."""
        link.errors += 1
        link.errors_in_row += 1
        if link.errors_in_row < self.config.consecutive_errors or not self.enabled:
            return
        if self.is_ejected(cluster, link.peer_id):  # requests sent before it was ejected
            return
        first = link.errors_in_row == self.config.consecutive_errors
        if self._eject(cluster, link, self._members(cluster), ERRORS, now, count_cap=first):
            link.errors_in_row = 0

    # ----------------------------------------------------------------- time

    def tick(self, now: float) -> None:
        """Readmit members whose time is up; every `interval`, judge the interval's rates."""
        if now >= self._next_readmission:
            self._readmit(now)
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.config.interval
        if self._records:
            self._forgive(now)
        if self.enabled:
            self._sweep(now)
        for link in self._peers.values():  # a new interval
            link.replies = link.errors = link.timeouts = link.refusals = 0

    def _forgive(self, now: float) -> None:
        """Forget members in rotation long enough for their count to have decayed away."""
        base = self.config.base_ejection
        for key, record in list(self._records.items()):
            if record.until == 0.0 and record.count - int((now - record.since) / base) <= 0:
                del self._records[key]

    def _readmit(self, now: float) -> None:
        upcoming = float("inf")
        for record in list(self._records.values()):
            if record.until == 0.0:
                continue
            if record.until > now:
                upcoming = min(upcoming, record.until)
                continue
            record.until = 0.0
            record.since = now
            out = self._out.get(record.cluster)
            if out is not None:
                out.discard(record.node_id)
                if not out:
                    del self._out[record.cluster]
            self._changed(-1)
            self._stats["members_readmitted"] += 1
            link = self._peers.get(record.node_id)
            if link is not None:
                link.errors_in_row = 0
                # Its estimate is from before, and a slow one would keep it starved however
                # well it does now: it starts as a typical member, and its replies correct it.
                others = [
                    m.latency
                    for m in self._members(record.cluster)
                    if m is not link and m.latency > 0
                ]
                link.latency = _median(others) if others else 0.0
            self._outbox.events.append(
                MemberReadmitted(cluster=record.cluster, node_id=record.node_id)
            )
        self._next_readmission = upcoming

    def _sweep(self, now: float) -> None:
        """Members whose success rate or latency in the interval stand out of their cluster's."""
        clusters: dict[str, list[OutLink]] = {}
        for link in self._peers.values():
            for cluster, slot in link.clusters.items():
                if slot:
                    clusters.setdefault(cluster, []).append(link)
        cfg = self.config
        shed: set[str] = set()
        for cluster, members in clusters.items():
            if len(members) < 2:
                continue
            judged: list[OutLink] = []
            rates: dict[bytes, float] = {}
            # A member that sheds load says the cluster is overloaded: the timeouts in the
            # interval (and the next: an overload outlasts an interval), at every member, are
            # the overload's. So are they when every member asked let some time out: a caller
            # whose own loop is too busy to take its replies in time sees it at every member.
            overloaded = any(m.refusals for m in members)
            if overloaded:
                shed.add(cluster)
            elif cluster in self._shed_lately:
                overloaded = True
            else:
                asked_any = [m for m in members if m.replies or m.timeouts]
                overloaded = len(asked_any) > 1 and all(m.timeouts for m in asked_any)
            for m in members:
                asked = m.replies + (0 if overloaded else m.timeouts)
                if asked >= cfg.min_requests:
                    judged.append(m)
                    rates[m.peer_id] = (m.replies - m.errors) / asked
            if len(judged) < 2:
                continue
            for link in sorted(judged, key=lambda m: rates[m.peer_id]):  # worst first
                if self.is_ejected(cluster, link.peer_id):
                    continue
                others = [rates[m.peer_id] for m in judged if m is not link]
                if rates[link.peer_id] < _median(others) - cfg.success_rate_gap:
                    self._eject(cluster, link, members, SUCCESS_RATE, now)
                    continue
                if link.refusals or link.replies < cfg.min_requests:
                    continue
                latencies = [m.latency for m in members if m is not link and m.latency > 0]
                if not latencies:
                    continue
                typical = _median(latencies)
                if (
                    link.latency >= typical * cfg.latency_factor
                    and link.latency - typical >= cfg.latency_floor
                ):
                    self._eject(cluster, link, members, LATENCY, now)
        self._shed_lately = shed

    # ----------------------------------------------------------------- ejecting

    def _eject(
        self,
        cluster: str,
        link: OutLink,
        members: list[OutLink],
        reason: str,
        now: float,
        count_cap: bool = True,
    ) -> bool:
        """Take `link`'s member out of `cluster`'s rotation, unless the cap forbids it."""
        out = self._out.get(cluster)
        if out is None:
            out = set()
        allowed = int(len(members) * self.config.max_ejected_share)
        if sum(1 for m in members if m.peer_id in out) >= allowed:
            if count_cap:
                self._stats["ejection_cap_reached"] += 1
            return False
        cfg = self.config
        node_id = link.peer_id
        record = self._records.get((cluster, node_id))
        if record is None:
            record = self._records[(cluster, node_id)] = Ejection(cluster, node_id, 0, 0.0, now)
        else:  # time in rotation since it last came back wears its count down
            decay = int((now - record.since) / cfg.base_ejection)
            record.count = max(0, record.count - decay)
        record.count += 1
        seconds = min(cfg.base_ejection * record.count, cfg.max_ejection)
        record.until = now + seconds
        self._next_readmission = min(self._next_readmission, record.until)
        record.since = now
        out.add(node_id)
        self._out[cluster] = out
        self._changed(1)
        self._stats["members_ejected"] += 1
        self._stats["ejections_" + reason] += 1
        self._outbox.events.append(
            MemberEjected(
                cluster=cluster,
                node_id=node_id,
                reason=reason,
                seconds=seconds,
                ejections=record.count,
            )
        )
        return True

    def _changed(self, by: int) -> None:
        self.ejected += by
        self._rotations.clear()
        self.unshared = True

    def shared(self) -> dict[str, list[bytes]]:
        """What this node's record says (see Shared above): cluster -> the id prefixes of the
        members out of its rotation, both sorted and capped."""
        self.unshared = False
        return {
            cluster: sorted(node_id[:ID_PREFIX] for node_id in out)[:MAX_NOTE_IDS]
            for cluster, out in sorted(self._out.items())[:MAX_NOTE_CLUSTERS]
        }


_packb = msgpack.Packer(use_bin_type=True).pack


def encode_ejected(prefixes: list[bytes]) -> bytes:
    """A note before sealing: [NOTE_EJECTED, [id prefix, ...]]."""
    return _packb([NOTE_EJECTED, prefixes])  # type: ignore[no-any-return]


def decode_ejected(note: bytes) -> list[bytes] | None:
    """The id prefixes of a note of kind NOTE_EJECTED; None if it is none, or not well formed
    (a note of a newer kind is none of ours)."""
    value = unpack_note(note, max_bin_len=ID_PREFIX, max_str_len=0, max_array_len=MAX_NOTE_IDS)
    if (
        type(value) is not list
        or len(value) != 2
        or value[0] != NOTE_EJECTED
        or type(value[1]) is not list
        or not all(type(p) is bytes and len(p) == ID_PREFIX for p in value[1])
    ):
        return None
    return list(value[1])


class SharedEjections:
    """The sealed notes this node's record carries on its ejections (see Shared above)."""

    def __init__(
        self,
        *,
        security: MembershipSecurity,
        randbytes: Callable[[int], bytes],
        carried: dict[str, bytes],
    ) -> None:
        self._security = security
        self._randbytes = randbytes
        # Cluster -> the sealed note this node's record carries: the directory's own dict,
        # which it puts among the record's tags.
        self.carried = carried
        self._plain: dict[str, bytes] = {}  # cluster -> the note as sealed in `carried`
        self._next = 0.0

    def due(self, now: float) -> bool:
        return now >= self._next

    def update(self, shared: dict[str, list[bytes]], now: float) -> bool:
        """Carry notes saying `shared` (`OutlierEjection.shared`); True if they changed. A
        note that says what it said before stays as it was sealed."""
        self._next = now + SHARE_EVERY
        plain: dict[str, bytes] = {}
        carried: dict[str, bytes] = {}
        for cluster, prefixes in shared.items():
            note = encode_ejected(prefixes)
            sealed = self.carried.get(cluster)
            if sealed is None or self._plain.get(cluster) != note:
                try:
                    sealed = self._security.seal_note(cluster, self._randbytes(NOTE_SALT), note)
                except NoKey:  # no key for it any more: nothing to say to its holders
                    continue
            plain[cluster] = note
            carried[cluster] = sealed
        if carried == self.carried:
            return False
        self._plain = plain
        self.carried.clear()
        self.carried.update(carried)
        return True

    def reseal(self) -> None:
        """This node's keys changed: seal every note again at the next `update`."""
        self._plain.clear()
        self._next = 0.0


def ejected_by(
    security: MembershipSecurity, records: Iterable[MemberRecord], clusters: Iterable[str]
) -> dict[bytes, dict[str, list[bytes]]]:
    """What the `records` say of `clusters` (those this node holds keys for): id prefix of a
    member -> cluster -> the ids of the nodes keeping it out of that cluster's rotation."""
    seen: dict[bytes, dict[str, list[bytes]]] = {}
    names = list(clusters)
    for record in records:
        if not record.tags:
            continue
        for cluster in names:
            for plain, _sealed in security.open_notes(record.tags, cluster):
                prefixes = decode_ejected(plain)
                for prefix in prefixes or ():
                    callers = seen.setdefault(prefix, {}).setdefault(cluster, [])
                    if record.node_id not in callers:
                        callers.append(record.node_id)
    return seen
