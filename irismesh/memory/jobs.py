"""Durable work queues at rest: jobs a memory member holds until a member of their cluster has
handled them.

A job is a payload for one cluster, with a 16-byte id (`message_id`), the time it was queued
and the time it expires. Memory members hold every job (each one's copy sealed, cluster name
and payload, under keys derived from the cluster's key, bound to the job's id) until one of
them, the cluster's dispatcher, has had it handled; then every member forgets it and keeps its
id for a while (a tombstone), so a member that was away learns that the job is done and does
not hand it out again. A job whose handler failed is tried again, `max_attempts` times in all,
then set aside (dead-lettered) and counted; a job past its expiry is dropped and counted.

Tombstones are read a page at a time in the order of (done_at, id), the order of their index:
a busy mesh finishes hundreds of thousands of jobs in the week their ids are kept, far more
than one answer can carry. A member that learns tombstones from another keeps their times, so
a tombstone ends a week after its job was done wherever it is held, however often members
copy it from each other.

The jobs live in the memory's database (`MemoryStore.db`), in the same transactions' safety.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Final, NamedTuple

import msgpack
from cryptography.exceptions import InvalidTag

from irismesh.errors import StorageError
from irismesh.memory.store import MemoryStore
from irismesh.memory.store import sqlite_reason as _reason

_PENDING, _DEAD = 0, 1
TOMBSTONE_KEEP: Final = 7 * 24 * 3600.0  # seconds a finished job's id is remembered
_PAGE_ROWS: Final = 32  # jobs read from the database at a time while filling a page
_JOB_ROOM: Final = 64  # a job's id, times and framing in an answer, at most

# Tombstones are found by time too: a starting member reads them page by page in (done_at, id)
# order, and `expire` drops the old ones. The index on done_at serves both: a WITHOUT ROWID
# table's index holds its primary key after its own columns, so it is ordered by (done_at, id)
# and a page starts with a seek, whatever the tombstones before it.
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS jobs (
    id BLOB PRIMARY KEY,
    key_id TEXT NOT NULL,
    sealed BLOB NOT NULL,
    enqueued_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    state INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, id);
CREATE TABLE IF NOT EXISTS job_tombstones (id BLOB PRIMARY KEY, done_at REAL NOT NULL)
    WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS job_tombstones_by_time ON job_tombstones (done_at);
"""


@dataclass(frozen=True, slots=True)
class Job:
    """One queued payload for a cluster."""

    id: bytes
    cluster: str
    payload: bytes
    enqueued_at: float
    expires_at: float
    attempts: int = 0
    trace: bytes = b""  # the W3C trace context it was queued in (b"": none)


class Tombstone(NamedTuple):
    """A finished job's id and when it was finished: also where a page of them goes on from."""

    done_at: float
    id: bytes


class JobStore:
    """The jobs of one memory member, in its store's database."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._db = store.db
        self.stats: Counter[str] = Counter()
        try:
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StorageError(store.path, _reason(exc)) from None

    def add(self, jobs: Iterable[Job]) -> int:
        """Hold jobs (all or none); how many were new (a job already held, or finished, is
        not added again)."""
        db = self._db
        added = 0
        with self._transaction():
            for job in jobs:
                gone = db.execute("SELECT 1 FROM job_tombstones WHERE id = ?", (job.id,)).fetchone()
                if gone is not None:
                    continue
                sealing = self._store.sealing_for(job.cluster)
                held = (
                    [job.cluster, job.payload, job.trace]
                    if job.trace
                    else [
                        job.cluster,
                        job.payload,
                    ]
                )
                sealed = sealing.seal(msgpack.packb(held), job.id)
                cursor = db.execute(
                    "INSERT OR IGNORE INTO jobs (id, key_id, sealed, enqueued_at, expires_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (job.id, sealing.key_id, sealed, job.enqueued_at, job.expires_at),
                )
                added += cursor.rowcount
        self.stats["jobs_held"] += added
        return added

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction: all of it or none; SQLite's failures as StorageError."""
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield
                db.execute("COMMIT")
                self._store.wrote()
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StorageError(self._store.path, _reason(exc)) from None

    def pending(self, limit: int, busy: Collection[bytes] = ()) -> list[Job]:
        """Up to `limit` jobs waiting to be handled, oldest first, those in `busy` left out."""
        out: list[Job] = []
        try:
            rows = self._db.execute(
                "SELECT id, key_id, sealed, enqueued_at, expires_at, attempts FROM jobs"
                " WHERE state = ? ORDER BY id LIMIT ?",
                (_PENDING, limit + len(busy)),
            ).fetchall()
        except sqlite3.Error as exc:
            raise StorageError(self._store.path, _reason(exc)) from None
        for job_id, key_id, sealed, enqueued_at, expires_at, attempts in rows:
            if job_id in busy:
                continue
            opened = self._open(job_id, key_id, sealed)
            if opened is None:
                continue
            cluster, payload, trace = opened
            out.append(Job(job_id, cluster, payload, enqueued_at, expires_at, attempts, trace))
            if len(out) >= limit:
                break
        return out

    def page(self, after: bytes, size: int, limit: int) -> tuple[list[Job], bytes | None]:
        """The jobs waiting to be handled with ids after `after`, oldest first, as many as fit
        in `size` bytes (at least one) and `limit`; and the id to ask after for the next ones
        (None: these were the last). A job's bytes are its sealed form's, about its payload,
        cluster and trace context: one that does not fit is not opened."""
        out: list[Job] = []
        used = 0
        cursor = after
        while True:
            try:
                rows = self._db.execute(
                    "SELECT id, key_id, sealed, enqueued_at, expires_at, attempts FROM jobs"
                    " WHERE state = ? AND id > ? ORDER BY id LIMIT ?",
                    (_PENDING, cursor, _PAGE_ROWS),
                ).fetchall()
            except sqlite3.Error as exc:
                raise StorageError(self._store.path, _reason(exc)) from None
            if not rows:
                return out, None
            for job_id, key_id, sealed, enqueued_at, expires_at, attempts in rows:
                grown = used + len(sealed) + _JOB_ROOM
                if out and (grown > size or len(out) >= limit):
                    return out, out[-1].id
                cursor = job_id
                opened = self._open(job_id, key_id, sealed)
                if opened is None:
                    continue
                cluster, payload, trace = opened
                out.append(Job(job_id, cluster, payload, enqueued_at, expires_at, attempts, trace))
                used = grown

    def _open(self, job_id: bytes, key_id: str, sealed: bytes) -> tuple[str, bytes, bytes] | None:
        """A held job's cluster, payload and trace context (b"" for a job held without one)."""
        sealing = self._store.sealing_of(key_id)
        if sealing is None:
            self.stats["jobs_locked"] += 1
            return None
        try:
            cluster, payload, *traced = msgpack.unpackb(sealing.open(sealed, job_id))
        except (InvalidTag, ValueError, TypeError):
            self.stats["jobs_unreadable"] += 1
            return None
        trace = traced[0] if len(traced) == 1 and type(traced[0]) is bytes else b""
        return str(cluster), bytes(payload), trace

    def finish(self, ids: Iterable[bytes], now: float) -> int:
        """Jobs handled: forgotten, their ids kept as tombstones; how many were held here."""
        ids = list(ids)
        db = self._db
        with self._transaction():
            held = sum(db.execute("DELETE FROM jobs WHERE id = ?", (i,)).rowcount for i in ids)
            db.executemany(
                "INSERT OR IGNORE INTO job_tombstones VALUES (?, ?)", [(i, now) for i in ids]
            )
        return held

    def finished(self, ids: Iterable[bytes]) -> list[bytes]:
        """Those of `ids` whose jobs were finished (their tombstones kept here)."""
        try:
            return [
                i
                for i in ids
                if self._db.execute("SELECT 1 FROM job_tombstones WHERE id = ?", (i,)).fetchone()
            ]
        except sqlite3.Error as exc:
            raise StorageError(self._store.path, _reason(exc)) from None

    def attempted(self, job_id: bytes, dead: bool) -> None:
        """A handler failed on the job: one attempt more, and set aside if that was the last."""
        try:
            self._db.execute(
                "UPDATE jobs SET attempts = attempts + 1, state = ? WHERE id = ?",
                (_DEAD if dead else _PENDING, job_id),
            )
        except sqlite3.Error as exc:
            raise StorageError(self._store.path, _reason(exc)) from None
        if dead:
            self.stats["jobs_dead_lettered"] += 1

    def expire(self, now: float) -> int:
        """Drop the jobs past their expiry and the tombstones past keeping; jobs dropped."""
        try:
            gone = self._db.execute(
                "DELETE FROM jobs WHERE expires_at < ? AND state = ?", (now, _PENDING)
            ).rowcount
            self._db.execute(
                "DELETE FROM job_tombstones WHERE done_at < ?", (now - TOMBSTONE_KEEP,)
            )
        except sqlite3.Error as exc:
            raise StorageError(self._store.path, _reason(exc)) from None
        self.stats["jobs_expired"] += gone
        return gone

    def finished_at(self, tombstones: Iterable[Tombstone], now: float) -> int:
        """Jobs another member finished, at the times given: forgotten here, their ids kept
        from those times (one already past keeping is not kept; one ahead of `now`, another
        machine's clock, is kept from now); how many were held here."""
        oldest = now - TOMBSTONE_KEEP
        kept = [(t.id, min(t.done_at, now)) for t in tombstones if t.done_at >= oldest]
        db = self._db
        with self._transaction():
            held = sum(db.execute("DELETE FROM jobs WHERE id = ?", (i,)).rowcount for i, _ in kept)
            db.executemany("INSERT OR IGNORE INTO job_tombstones VALUES (?, ?)", kept)
        return held

    def tombstones(
        self, since: float, limit: int, after: Tombstone | None = None
    ) -> list[Tombstone]:
        """Up to `limit` tombstones of jobs finished since `since` and ordered after `after`
        (None: from the first), oldest first."""
        start = (since, b"") if after is None or after.done_at < since else after
        try:
            rows = self._db.execute(
                "SELECT done_at, id FROM job_tombstones WHERE (done_at, id) > (?, ?)"
                " ORDER BY done_at, id LIMIT ?",
                (*start, limit),
            ).fetchall()
        except sqlite3.Error as exc:
            raise StorageError(self._store.path, _reason(exc)) from None
        return [Tombstone(float(done_at), bytes(job_id)) for done_at, job_id in rows]

    def newest_tombstones(self, since: float, limit: int) -> list[bytes]:
        """The ids of the `limit` jobs finished last since `since`, oldest first."""
        if limit <= 0:
            return []
        try:
            rows = self._db.execute(
                "SELECT id FROM job_tombstones WHERE done_at >= ?"
                " ORDER BY done_at DESC, id DESC LIMIT ?",
                (since, limit),
            ).fetchall()
        except sqlite3.Error as exc:
            raise StorageError(self._store.path, _reason(exc)) from None
        return [bytes(r[0]) for r in reversed(rows)]

    def figures(self) -> dict[str, int]:
        counts = dict(
            self._db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
        )
        return {
            "jobs_pending": int(counts.get(_PENDING, 0)),
            "jobs_dead": int(counts.get(_DEAD, 0)),
            **self.stats,
        }


__all__ = ["TOMBSTONE_KEEP", "Job", "JobStore", "Tombstone"]
