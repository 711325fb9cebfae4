"""Traffic splits: what share of a cluster's requests each version of its members gets.

Theory of operation
-------------------
Versions. A member may carry a version ("v2"; "" when it has none). Its record says so with a
*version tag* per cluster it serves (`MembershipSecurity.version_tags`), a MAC under the
cluster's key over the node id, the cluster and the version, so only holders of that key can
tell, and only by asking about a version by name (`version_of`): a caller asks about the
versions its split names, which is all it needs. A member without a version carries the tag
of the version "", so members without one form a version of their own, which a split names
as "".

Splits. A split maps the versions of one cluster to whole-number weights, and carries a stamp:
everywhere, the newest stamp wins (ties, the larger encoding). It travels in membership
records, as a *note* sealed under the cluster's key (`seal_note`, `open_notes`) among the
record's tags:

- the node that sets it carries it in its own record at once, and membership spreads a changed
  record to every node in a few gossip rounds (0.3 s measured from `mesh split` to the last
  of three callers, eight nodes in all): every caller applies it within a second;
- every member of the cluster that reads a newer split than its own carries it in turn, so the
  split outlives the node that set it (a `mesh split` command that exits) and reaches a node
  that joins later: a joining node is sent every live record in its first table exchange;
- clearing a split is a newer note with no weights, so an older split carried by a member that
  was away cannot come back;
- a node whose keys change seals what it carries again under its keys now (`reread`), so a
  split outlives a key rotation too.

Membership rather than the memory: every node already holds every live record and reads it
when it changes, no memory member need run, and nothing new travels on the wire but a few
dozen bytes of tags in the records of the cluster's members. The split is lost only when every
node carrying it has gone (every member of the cluster restarted): it is run-time state.

Routing. A node watches the clusters it serves (to carry their split) and those it calls
(`call`, from `want`: to apply it). For each called cluster with a split in effect it keeps a
`Route`: the version of each member, and the linked members grouped by version. A request
(`Calls.request`) first draws a version by weight among the versions named that have a linked
member, so a version with none has its share spread over the others in proportion; then the
balancer makes its usual choice among that version's members. Members of versions the split
does not name get no share while a named version has a linked member; with none, every linked
member is a candidate, so a split never turns a request away while any member lives. The groups
are made again only when the calls' cache of linked members is (a new list) or a record or the
split changed: with no split at all, a request pays one check of an empty dict.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from random import Random
from typing import Any, Final

import msgpack

from irismesh._core.directory import Directory
from irismesh._core.links import OutLink
from irismesh._core.plain import Frozen
from irismesh._core.records import (
    NOTE_SALT,
    MemberChanged,
    MemberEvent,
    MembershipSecurity,
    MemberUp,
)
from irismesh.errors import ConfigurationError

MAX_VERSION = 32  # characters of a version's name
MAX_VERSIONS = 8  # versions one split names
MAX_WEIGHT = 1_000_000
MAX_WATCHED = 1024  # clusters whose splits a node follows at once
_NOTE_SPLIT = 1  # the kind of note: a traffic split (the first element of its encoding)


def is_version(value: object) -> bool:
    """Whether `value` may name a version: "" (none), or up to MAX_VERSION printable
    characters with no whitespace and no '=' (one word of `mesh split db v1=95 v2=5`)."""
    return (
        type(value) is str
        and len(value) <= MAX_VERSION
        and value.isprintable()
        and " " not in value
        and "=" not in value
    )


def validate_version(version: object) -> str:
    """`version` if it may name a version, else ConfigurationError."""
    if is_version(version):
        assert isinstance(version, str)
        return version
    raise ConfigurationError(
        f"bad version {version!r}: up to {MAX_VERSION} printable characters, no whitespace"
        " and no '='"
    )


def check_weights(weights: Mapping[Any, Any]) -> tuple[tuple[str, int], ...]:
    """A split's weights as they travel (sorted by version), or ConfigurationError: 1 to
    MAX_VERSIONS versions, each weight a whole number from 0 to MAX_WEIGHT, one above 0."""
    if not 1 <= len(weights) <= MAX_VERSIONS:
        raise ConfigurationError(f"a split names 1 to {MAX_VERSIONS} versions, got {len(weights)}")
    checked = []
    for name, weight in weights.items():
        version = validate_version(name)
        if type(weight) is not int or not 0 <= weight <= MAX_WEIGHT:
            raise ConfigurationError(
                f"the weight of version {version!r} must be a whole number from 0 to"
                f" {MAX_WEIGHT}, got {weight!r}"
            )
        checked.append((version, int(weight)))
    if not any(weight for _, weight in checked):
        raise ConfigurationError("a split needs a version with a weight above 0")
    return tuple(sorted(checked))


_packb = msgpack.Packer(use_bin_type=True).pack


def encode_split(stamp: int, weights: tuple[tuple[str, int], ...]) -> bytes:
    """A split's note before sealing: [kind, stamp, [[version, weight], ...]]."""
    return _packb([_NOTE_SPLIT, stamp, [[v, w] for v, w in weights]])  # type: ignore[no-any-return]


def note_kind(note: bytes) -> int:
    """The kind of a note: the first element of its encoding, a msgpack array that begins
    with a small int (-1: none such). Notes of every kind on a cluster sit under one locator:
    a split's (_NOTE_SPLIT), and the members a caller ejects (`outliers.NOTE_EJECTED`)."""
    if len(note) >= 2 and 0x91 <= note[0] <= 0x9F and note[1] < 0x80:
        return note[1]
    return -1


def unpack_note(note: bytes, **limits: int) -> Any:
    """A note's msgpack value, read within `limits` (msgpack's max_*_len; maps and extension
    types are never allowed); None if it is not one well-formed value within them."""
    try:
        return msgpack.unpackb(note, raw=False, max_map_len=0, max_ext_len=0, **limits)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None


def decode_split(note: bytes) -> tuple[int, tuple[tuple[str, int], ...]] | None:
    """(stamp, weights) of a split's note; None if it is no well-formed split."""
    value = unpack_note(
        note, max_bin_len=0, max_str_len=4 * MAX_VERSION, max_array_len=MAX_VERSIONS
    )
    if (
        type(value) is not list
        or len(value) != 3
        or value[0] != _NOTE_SPLIT
        or type(value[1]) is not int
        or not 0 <= value[1] < 1 << 63
        or type(value[2]) is not list
        or len(value[2]) > MAX_VERSIONS
    ):
        return None
    weights = []
    for entry in value[2]:
        if (
            type(entry) is not list
            or len(entry) != 2
            or not is_version(entry[0])
            or type(entry[1]) is not int
            or not 0 <= entry[1] <= MAX_WEIGHT
        ):
            return None
        weights.append((str(entry[0]), int(entry[1])))
    return int(value[1]), tuple(weights)


class Split(Frozen):
    """One split of one cluster: its weights (none: cleared), its stamp, and its note (as
    encoded, which orders splits of one stamp, and as sealed, which members carry on)."""

    stamp: Final[int]
    weights: Final[tuple[tuple[str, int], ...]]
    plain: Final[bytes]
    sealed: Final[bytes]

    def __init__(
        self, stamp: int, weights: tuple[tuple[str, int], ...], plain: bytes, sealed: bytes
    ) -> None:
        self.stamp, self.weights, self.plain, self.sealed = stamp, weights, plain, sealed

    def newer_than(self, other: Split | None) -> bool:
        return other is None or (self.stamp, self.plain) > (other.stamp, other.plain)


class Route:
    """A split as a caller applies it to one cluster: member versions, groups by version."""

    def __init__(self, weights: tuple[tuple[str, int], ...]) -> None:
        self.weights = weights
        self.names = [version for version, _ in weights]
        self.versions: dict[bytes, str] = {}  # member id -> its version, if the split names it
        self._source: list[OutLink] | None = None  # the linked members the groups come from
        self._size = 0
        self._groups: list[list[OutLink]] = []
        self._edges: list[float] = []  # the groups' cumulative weights
        self._total = 0.0

    def narrow(self, members: list[OutLink], rng: Random) -> list[OutLink]:
        """The members of one version, drawn by weight (`members` itself when no version the
        split weighs has a linked member)."""
        if members is not self._source or len(members) != self._size:
            self._group(members)
        groups = self._groups
        if len(groups) < 2:
            return groups[0] if groups else members
        draw = rng.random() * self._total
        edges = self._edges
        for i in range(len(groups) - 1):
            if draw < edges[i]:
                return groups[i]
        return groups[-1]

    def changed(self) -> None:
        """A member's version changed: group again before the next request."""
        self._source = None

    def _group(self, members: list[OutLink]) -> None:
        by_version: dict[str, list[OutLink]] = {}
        versions = self.versions
        for link in members:
            version = versions.get(link.peer_id)
            if version is not None:
                by_version.setdefault(version, []).append(link)
        groups: list[list[OutLink]] = []
        edges: list[float] = []
        total = 0.0
        for version, weight in self.weights:
            group = by_version.get(version)
            if group and weight > 0:
                total += weight
                groups.append(group)
                edges.append(total)
        self._groups, self._edges, self._total = groups, edges, total
        self._source, self._size = members, len(members)


class Splits:
    """The splits this node knows, carries and applies (see the module's docstring)."""

    def __init__(
        self,
        *,
        served: Iterable[str],
        security: MembershipSecurity,
        directory: Directory,
        randbytes: Callable[[int], bytes],
        stats: Counter[str],
        routes: dict[str, Route],
        carried: dict[str, bytes],
    ) -> None:
        self._served = frozenset(served)
        self._security = security
        self._directory = directory
        self._randbytes = randbytes
        self._stats = stats
        # Cluster -> its route, for the clusters called with a split in effect: the calls'
        # own dict (`Calls.routes`), read on every request.
        self.routes = routes
        # Cluster -> the sealed note this node's record carries: the directory's own dict,
        # which it puts among the record's tags.
        self.carried = carried
        self.current: dict[str, Split] = {}  # the newest split seen, per watched cluster
        self.called: dict[str, None] = {}  # clusters called, oldest first
        self.watched: list[str] = []
        for cluster in self._served:
            self._watch(cluster)

    # ----------------------------------------------------------------- what to follow

    def serve(self, served: Iterable[str]) -> None:
        """This node serves `served` from now on: their splits are carried too."""
        self._served = frozenset(served)
        for cluster in self._served:
            self._watch(cluster)

    def call(self, cluster: str) -> None:
        """This node calls `cluster`: apply its split from now on."""
        if cluster in self.called:
            return
        if len(self.called) >= MAX_WATCHED:
            oldest = next(iter(self.called))
            del self.called[oldest]
            self.routes.pop(oldest, None)
            if oldest not in self._served and oldest not in self.carried:
                self.watched.remove(oldest)
                self.current.pop(oldest, None)
        self.called[cluster] = None
        self._watch(cluster)
        self._route(cluster)

    def _watch(self, cluster: str) -> None:
        if cluster in self.watched:
            return
        self.watched.append(cluster)
        for record in self._directory.records():
            self._read(cluster, record.node_id, record.tags)

    def reread(self) -> bool:
        """The keys changed: seal what this node carries under its keys now, and read every
        record again; True if this node's notes changed."""
        carried = False
        for cluster in list(self.carried):
            split = self.current[cluster]
            try:
                sealed = self._security.seal_note(cluster, self._randbytes(NOTE_SALT), split.plain)
            except ConfigurationError:  # its key is gone: so is what this node could tell
                del self.carried[cluster]
            else:
                self.carried[cluster] = sealed
                self.current[cluster] = Split(split.stamp, split.weights, split.plain, sealed)
            carried = True
        for cluster in self.watched:
            for record in self._directory.records():
                carried |= self._read(cluster, record.node_id, record.tags)
            if cluster in self.called:
                self._route(cluster)
        return carried

    # ----------------------------------------------------------------- records

    def on_event(self, event: MemberEvent) -> bool:
        """A member's record came or changed: a newer split, or a member's version; True if
        this node's record must carry another note. A member gone takes nothing with it."""
        if not isinstance(event, MemberUp | MemberChanged):
            return False
        record = event.record
        carried = False
        for cluster in self.watched:
            carried |= self._read(cluster, record.node_id, record.tags)
            route = self.routes.get(cluster)
            if route is not None:
                self._place(route, cluster, record.node_id, record.tags)
        return carried

    def _read(self, cluster: str, node_id: bytes, tags: bytes) -> bool:
        """Take the newest split on `cluster` that `tags` carry, if newer than ours; True if
        this node's record must carry it."""
        carried = False
        for plain, sealed in self._security.open_notes(tags, cluster):
            decoded = decode_split(plain)
            if decoded is None:
                if note_kind(plain) == _NOTE_SPLIT:  # other kinds share the cluster's notes
                    self._stats["split_notes_bad"] += 1
                continue
            split = Split(decoded[0], decoded[1], plain, sealed)
            if split.newer_than(self.current.get(cluster)):
                carried |= self._adopt(cluster, split)
        return carried

    def _adopt(self, cluster: str, split: Split) -> bool:
        self.current[cluster] = split
        self._stats["splits_changed"] += 1
        if cluster in self.called:
            self._route(cluster)
        if cluster in self._served or cluster in self.carried:
            self.carried[cluster] = split.sealed
            return True
        return False

    def _route(self, cluster: str) -> None:
        split = self.current.get(cluster)
        if split is None or not split.weights:
            self.routes.pop(cluster, None)
            return
        route = Route(split.weights)
        for node_id, record in self._directory.servers(cluster).items():
            self._place(route, cluster, node_id, record.tags)
        self.routes[cluster] = route

    def _place(self, route: Route, cluster: str, node_id: bytes, tags: bytes) -> None:
        version = self._security.version_of(node_id, tags, cluster, route.names)
        if version is None:
            if route.versions.pop(node_id, None) is not None:
                route.changed()
        elif route.versions.get(node_id) != version:
            route.versions[node_id] = version
            route.changed()

    # ----------------------------------------------------------------- this node's splits

    def set(self, cluster: str, weights: tuple[tuple[str, int], ...], stamp: int) -> Split:
        """Set (weights) or clear (no weights) the split of `cluster`, stamped `stamp`; this
        node carries the newest split of it from now on. Returns the split in effect."""
        self._watch(cluster)
        plain = encode_split(stamp, weights)
        sealed = self._security.seal_note(cluster, self._randbytes(NOTE_SALT), plain)
        split = Split(stamp, weights, plain, sealed)
        if split.newer_than(self.current.get(cluster)):
            self._adopt(cluster, split)
        self.carried[cluster] = self.current[cluster].sealed
        return self.current[cluster]

    def view(self, cluster: str) -> Split | None:
        """The newest split of `cluster` this node knows (watching it from now on)."""
        self._watch(cluster)
        return self.current.get(cluster)

    def carriers(self, cluster: str, stamp: int) -> tuple[int, int]:
        """(members whose records carry a split of `cluster` stamped `stamp` or later, live
        members of `cluster`)."""
        members = self._directory.servers(cluster)
        carrying = 0
        for record in members.values():
            for plain, _ in self._security.open_notes(record.tags, cluster):
                decoded = decode_split(plain)
                if decoded is not None and decoded[0] >= stamp:
                    carrying += 1
                    break
        return carrying, len(members)

    def versions(self, cluster: str) -> tuple[dict[str, int], int]:
        """Live members of `cluster`: how many of each version its split names, and how many
        of other versions."""
        split = self.view(cluster)
        names = [version for version, _ in split.weights] if split is not None else []
        counts = dict.fromkeys(names, 0)
        others = 0
        for node_id, record in self._directory.servers(cluster).items():
            version = self._security.version_of(node_id, record.tags, cluster, names)
            if version is None:
                others += 1
            else:
                counts[version] += 1
        return counts, others
