"""Which live nodes serve a cluster or read a topic scope: membership records, read by key.

Membership knows every node, but says what each serves only through its record's tags, which
this node can check for a cluster or topic scope only with that scope's key
(`MembershipSecurity.serves`, `reads`). The directory keeps the answers this node has asked
for, one table per cluster or scope it *uses* (calls, publishes in), and keeps them current
from membership events: a record that comes, changes or goes is checked against each table in
use, so a question costs one tag check per node once, not per request.

What it answers is what links to open (`servers`, `readers`); the links themselves, and the
offer tags they exchange, remain the proof that a node serves a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from irismesh._core.gossip import MAX_TAGS
from irismesh._core.records import (
    MemberChanged,
    MemberDown,
    MemberEvent,
    MemberRecord,
    MembershipSecurity,
    MemberState,
    MemberUp,
)

_SUSPECT = MemberState.SUSPECT
KEY_TAG_SIZE = 8
_MAX_TABLES = 1024  # clusters and scopes tracked at once


class Directory:
    """Live records by cluster served and by topic scope read, for the ones in use here."""

    def __init__(self, security: MembershipSecurity) -> None:
        self._security = security
        self._records: dict[bytes, MemberRecord] = {}  # every live member
        self._by_endpoint: dict[str, bytes] = {}
        self._servers: dict[str, dict[bytes, MemberRecord]] = {}
        self._readers: dict[str, dict[bytes, MemberRecord]] = {}
        # This node's own record: the version it serves its clusters as ("" none), and the
        # sealed notes it carries by cluster (traffic splits: `split`).
        self.version = ""
        self.notes: dict[str, bytes] = {}
        # The sealed notes on the members it keeps out of rotation, by cluster (`outliers`).
        self.ejections: dict[str, bytes] = {}

    def own_tags(self, node_id: bytes, clusters: Iterable[str], patterns: Iterable[str]) -> bytes:
        """The tags of this node's own record: the clusters it serves and as which version, the
        topic scopes its subscription `patterns` read (a pattern whose first word is a wildcard
        reads them all), and its notes (those that fit; its ejections' last)."""
        scopes = {pattern.partition(".")[0] for pattern in patterns}
        every = bool(scopes & {"*", "#"})
        served = tuple(clusters)
        tags = self._security.member_tags(node_id, served)
        if scopes:
            tags += self._security.interest_tags(node_id, scopes - {"*", "#"}, every)
        # Versions and notes only weigh the balance: they never crowd out what routes.
        room = max(0, MAX_TAGS - len(tags)) // KEY_TAG_SIZE * KEY_TAG_SIZE
        tags += self._security.version_tags(node_id, served, self.version)[:room]
        for note in self.notes.values():
            if len(tags) + len(note) <= MAX_TAGS:
                tags += note
        # Key tags only report a rotation's progress: they never crowd out what routes.
        room = max(0, MAX_TAGS - len(tags)) // KEY_TAG_SIZE * KEY_TAG_SIZE
        tags += self._security.key_tags(node_id)[:room]
        # Ejections are only for operators to see: they have the room that is left.
        for note in self.ejections.values():
            if len(tags) + len(note) <= MAX_TAGS:
                tags += note
        return tags

    def recheck(self) -> bool:
        """The keys changed: answer every table in use again; True if one gained a node."""
        gained = False
        for tables, holds in (
            (self._servers, self._security.serves),
            (self._readers, self._security.reads),
        ):
            for name, table in tables.items():
                fresh = {
                    node_id: record
                    for node_id, record in self._records.items()
                    if holds(node_id, record.tags, name)
                }
                gained |= not fresh.keys() <= table.keys()
                tables[name] = fresh
        return gained

    def records(self) -> list[MemberRecord]:
        """Every live member's record."""
        return list(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def get(self, node_id: bytes) -> MemberRecord | None:
        return self._records.get(node_id)

    def knows_endpoint(self, endpoint: str) -> bool:
        """Whether a live member listens at `endpoint` (no need to dial it to join)."""
        return endpoint in self._by_endpoint

    def servers(self, cluster: str) -> dict[bytes, MemberRecord]:
        """Live members whose tags show they serve `cluster` (under a key we hold)."""
        return self._table(self._servers, cluster, self._security.serves)

    def readers(self, scope: str) -> dict[bytes, MemberRecord]:
        """Live members whose tags show interest in topic `scope` (under our key for it)."""
        return self._table(self._readers, scope, self._security.reads)

    def _table(
        self,
        tables: dict[str, dict[bytes, MemberRecord]],
        name: str,
        holds: Callable[[bytes, bytes, str], bool],
    ) -> dict[bytes, MemberRecord]:
        table = tables.get(name)
        if table is None:
            table = {
                node_id: record
                for node_id, record in self._records.items()
                if holds(node_id, record.tags, name)
            }
            if len(tables) >= _MAX_TABLES:
                del tables[next(iter(tables))]
            tables[name] = table
        return table

    def forget(self, *, cluster: str | None = None, scope: str | None = None) -> None:
        """A cluster or scope no longer in use here: stop keeping its table."""
        if cluster is not None:
            self._servers.pop(cluster, None)
        if scope is not None:
            self._readers.pop(scope, None)

    def on_event(self, event: MemberEvent) -> bool:
        """Keep the tables current; True if a table in use gained a node (worth a dial)."""
        if isinstance(event, MemberDown):
            self._remove(event.record.node_id)
            return False
        if not isinstance(event, MemberUp | MemberChanged):
            return False
        record = event.record
        node_id = record.node_id
        old = self._records.get(node_id)
        if old is not None and old.endpoint != record.endpoint:
            self._by_endpoint.pop(old.endpoint, None)
        self._records[node_id] = record
        self._by_endpoint[record.endpoint] = node_id
        gained = False
        serves, reads = self._security.serves, self._security.reads
        for cluster, table in self._servers.items():
            gained |= _place(table, record, serves(node_id, record.tags, cluster))
        for scope, table in self._readers.items():
            gained |= _place(table, record, reads(node_id, record.tags, scope))
        return gained

    def _remove(self, node_id: bytes) -> None:
        record = self._records.pop(node_id, None)
        if record is None:
            return
        if self._by_endpoint.get(record.endpoint) == node_id:
            del self._by_endpoint[record.endpoint]
        for table in self._servers.values():
            table.pop(node_id, None)
        for table in self._readers.values():
            table.pop(node_id, None)


def _place(table: dict[bytes, MemberRecord], record: MemberRecord, belongs: bool) -> bool:
    """Keep `record` in `table` if its node belongs there, else take it out; True if it came
    in new."""
    node_id = record.node_id
    if not belongs:
        table.pop(node_id, None)
        return False
    new = node_id not in table
    table[node_id] = record
    return new
