"""Retained messages at rest: one SQLite database, sealed, trimmed by retention rules.

Theory of operation
-------------------
A retained message is stored under its path (its topic) and found again by the patterns that
subscribe to it (`*` one segment, `#` any number), so that the same grammar serves messages in
motion and at rest. `latest(pattern, n)` answers, for every stored path the pattern matches,
its `n` newest messages, newest first.

Ids. Every message carries a 16-byte id made by its publisher from its hybrid logical clock
(`clock_id`, `irismesh.data.clock.HybridClock` counting microseconds): the clock's wall time (8
bytes, microseconds since the epoch), its logical count (4 bytes) and four bytes of the
publisher's node id. A node's clock takes in the ids it sees (`observe_id`: what it rereads,
what a memory member stores, the clock a member answers with), each as one microsecond after
its wall time, so a message published after its publisher saw another has a larger id,
whatever the two machines' clocks say; otherwise ids follow publish time. One clock never
makes the same id twice, so storing a message twice (a resend, a second replica's copy) is
recognised by its id and ignored.

Ids of earlier versions (`message_id`: microseconds, four bytes of node id, a counter) have the
same first eight bytes, microseconds since the epoch: they load as they are and interleave with
clock ids by time (only the rest of the id, which breaks ties within one microsecond, differs).

At rest nothing is in clear but the shape of the data (how many messages, their sizes and
publish times). Each key of the keyring that opens a topic gives two keys of the store, derived
with HKDF-SHA256: an index key, whose HMAC of the topic names the path in the database, and a
sealing key (AES-256-GCM) for the topic's name and every payload, each payload bound to its id
and path. A path records the id of the key it was sealed under, so a store outlives key
rotations: messages sealed under an old key are read with it as long as the keyring holds it,
and new messages go under the current key. A path whose key the keyring no longer holds is kept
but not served (`paths_locked`). A copied database without the keyring reveals no topic and no
payload.

Why SQLite: the standard library's, with transactions that survive a crash, secondary indexes
and correlated queries (the newest messages of each of 500 paths in one statement, reading
only those rows), so the store needs no dependency and no index code of its own; LMDB would be
faster per key and need both.

Durability. SQLite in write-ahead-log mode. With `sync="fsync"` (the default) each commit
waits for the disk (synchronous=FULL): a message `put` has returned for survives a process
crash and a power cut. With `sync="os"` (synchronous=NORMAL) a commit ends once the operating
system holds it: it survives the process being killed, not the machine losing power (the
commits since the last checkpoint may go; the log's checkpoints still wait for the disk, so the
database stays whole, as of some earlier commit). With "os" the checkpoints run on a thread of
their own, off the commits' path (`_Checkpoints`).
Either way a process killed in the middle of a write leaves the database as it was before that
write. Every SQLite failure (a full disk, a directory that is not writable,
a file that is not a database) is a `StorageError` naming the file, never a half-written store.

Retention. Rules map patterns to limits (`Retention`: messages per path, age, bytes per path);
the first rule whose pattern matches a topic governs it, else the default. Each `put` trims
its path at once; `expire(now)` removes what has grown too old. What retention removes is
counted by reason in `stats`.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import os
import sqlite3
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from irismesh._core.topics import topic_matches, validate_pattern, validate_topic
from irismesh.data.clock import HybridClock, Stamp
from irismesh.errors import ConfigurationError, NoKey, StorageError
from irismesh.security.keyring import Keyring, ScopeKey

SCHEMA_VERSION: Final = 1
CHECKPOINT_AFTER = 0.05  # seconds from a commit to the checkpoint that copies it
CHECKPOINT_BACKSTOP = 20_000  # pages of log past which the writer checkpoints itself
_ID: Final = struct.Struct("!QII")  # microseconds since the epoch, publisher, counter
_CLOCK_ID: Final = struct.Struct("!QI4s")  # clock's wall (microseconds), logical, publisher
ID_SIZE: Final = _ID.size
CLOCK_AHEAD_US: Final = 60_000_000  # an id further ahead of this machine's clock: not adopted
SYNC_MODES: Final = ("fsync", "os")
_NONCE: Final = 12
_SALT: Final = b"irismesh memory at rest v1"
_CHUNK: Final = 500  # path ids per query (SQLite limits the parameters of one statement)

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS paths (
    path_id INTEGER PRIMARY KEY,
    key_id TEXT NOT NULL,
    path_tag BLOB NOT NULL UNIQUE,
    sealed_topic BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    path_id INTEGER NOT NULL REFERENCES paths(path_id),
    id BLOB NOT NULL,
    published_at REAL NOT NULL,
    size INTEGER NOT NULL,
    sealed BLOB NOT NULL,
    PRIMARY KEY (path_id, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS messages_by_age ON messages (published_at);
CREATE INDEX IF NOT EXISTS messages_by_id ON messages (id);
"""


def message_id(node_id: bytes, counter: int, now: float | None = None) -> bytes:
    """A unique, time-ordered id for the `counter`-th message a node publishes."""
    at = time.time() if now is None else now
    return _ID.pack(int(at * 1e6), int.from_bytes(node_id[:4], "big"), counter & 0xFFFFFFFF)


def memory_clock(node_id: bytes) -> HybridClock:
    """A node's clock for the memory's ids (its unit the microsecond)."""
    return HybridClock(node_id, max_ahead=CLOCK_AHEAD_US)


def physical_us() -> int:
    """This machine's wall clock, in microseconds since the epoch."""
    return time.time_ns() // 1000


def clock_id(clock: HybridClock, physical: int) -> bytes:
    """A new message id from `clock` at `physical` microseconds: larger than every id the
    clock has made or taken in."""
    stamp = clock.now(physical)
    return _CLOCK_ID.pack(stamp.wall, stamp.logical & 0xFFFFFFFF, stamp.node[:4].ljust(4, b"\0"))


def clock_state(clock: HybridClock) -> bytes:
    """The clock as an id (what a memory member's answer carries), without advancing it."""
    return _CLOCK_ID.pack(clock.wall, clock.logical & 0xFFFFFFFF, clock.node[:4].ljust(4, b"\0"))


def observe_id(clock: HybridClock, msg_id: bytes, physical: int) -> None:
    """Take a seen id (of either layout) into `clock`, as one microsecond after its time: the
    clock's next id is larger than it whatever the rest of either id holds."""
    if len(msg_id) == ID_SIZE:
        clock.observe(Stamp(_ID.unpack_from(msg_id)[0] + 1, 0, b""), physical)


def id_time(message_id: bytes) -> float:
    """When the message with this id was published (seconds since the epoch)."""
    return float(_ID.unpack(message_id)[0]) / 1e6


@dataclass(frozen=True, slots=True)
class Stored:
    """One remembered message."""

    topic: str
    payload: bytes
    published_at: float
    id: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Retention:
    """How much of a path the memory keeps: its newest `max_per_path` messages, none older
    than `max_age` seconds, at most `max_bytes` of payload (None: no such limit)."""

    max_per_path: int = 16
    max_age: float | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if type(self.max_per_path) is not int or self.max_per_path < 1:
            raise ConfigurationError(f"max_per_path must be at least 1, not {self.max_per_path!r}")
        if self.max_age is not None and not self.max_age > 0:
            raise ConfigurationError(f"max_age must be positive seconds, not {self.max_age!r}")
        if self.max_bytes is not None and not self.max_bytes > 0:
            raise ConfigurationError(f"max_bytes must be positive, not {self.max_bytes!r}")


class Sealing:
    """The store's keys derived from one key of the keyring."""

    __slots__ = ("aead", "index_key", "key_id")

    def __init__(self, key: ScopeKey) -> None:
        def derive(purpose: bytes) -> bytes:
            info = key.scope.encode() + b"\0" + purpose
            return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=info).derive(
                key.secret
            )

        self.key_id = key.key_id
        self.index_key = derive(b"index")
        self.aead = AESGCM(derive(b"seal"))

    def path_tag(self, topic: str) -> bytes:
        return hmac.new(self.index_key, topic.encode(), hashlib.sha256).digest()

    def seal(self, data: bytes, bound: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return nonce + self.aead.encrypt(nonce, data, bound)

    def open(self, sealed: bytes, bound: bytes) -> bytes:
        return self.aead.decrypt(sealed[:_NONCE], sealed[_NONCE:], bound)


class MemoryStore:
    """Retained messages of one memory member, in `directory`/memory.sqlite3."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keyring: Keyring,
        *,
        retention: Sequence[tuple[str, Retention]] = (),
        default: Retention | None = None,
        sync: str = "fsync",
    ) -> None:
        if sync not in SYNC_MODES:
            raise ConfigurationError(f"sync is 'fsync' or 'os', not {sync!r}")
        self.sync = sync
        self.path = str(Path(directory) / "memory.sqlite3")
        self._keyring = keyring
        self._rules = [(validate_pattern(pattern), rule) for pattern, rule in retention]
        self._default = default or Retention()
        self.stats: Counter[str] = Counter()
        self._sealings: dict[str, Sealing] = {}  # key id -> its derived keys
        self._paths: dict[str, list[int]] = {}  # topic -> its path ids (one per key id)
        self._writing: dict[str, tuple[int, Sealing]] = {}  # topic -> path for new messages
        self._tags: dict[int, bytes] = {}  # path id -> path tag (what payloads are bound to)
        self._path_keys: dict[int, str] = {}  # path id -> the id of the key it is sealed under
        self._matches: dict[str, tuple[int, list[str]]] = {}  # pattern -> (paths then, topics)
        self._counts: dict[int, int] = {}  # path id -> messages stored
        self._bytes: dict[int, int] = {}  # path id -> payload bytes stored
        self._db = self._open(Path(directory))
        # With "os", checkpoints leave the commit path (with "fsync" they stay: measured, a
        # checkpoint thread's syncs slowed the commits' own, which share the disk).
        self._checkpoints = _Checkpoints(self.path, self.stats) if sync == "os" else None
        self._load()

    # ----------------------------------------------------------------- opening

    def _open(self, directory: Path) -> sqlite3.Connection:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(self.path, f"cannot create its directory: {exc.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise StorageError(self.path, "its directory is not writable")
        try:
            # One thread at a time (a member serialises its store on a thread of its own).
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            # fsync: every commit waits for the disk; os: only checkpoints do, the OS writes the
            # log back when it will (in WAL mode the database stays consistent either way).
            db.execute("PRAGMA synchronous=" + ("FULL" if self.sync == "fsync" else "NORMAL"))
            if self.sync == "os":
                # Checkpoints run on a thread of their own (`_Checkpoints`); this connection
                # checkpoints only past a backstop the log reaches if that thread falls behind.
                db.execute(f"PRAGMA wal_autocheckpoint={CHECKPOINT_BACKSTOP}")
            db.executescript(_SCHEMA)
            row = db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                db.close()
                raise StorageError(self.path, f"schema version {row[0]}, not {SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            raise StorageError(self.path, _reason(exc)) from None
        return db

    def _load(self) -> None:
        """Every path whose key the keyring holds, its topic opened; counts and sizes."""
        try:
            paths = self._db.execute("SELECT path_id, key_id, path_tag, sealed_topic FROM paths")
            for path_id, key_id, tag, sealed_topic in paths.fetchall():
                sealing = self._sealing_of(key_id)
                if sealing is None:
                    self.stats["paths_locked"] += 1
                    continue
                try:
                    topic = sealing.open(sealed_topic, b"topic").decode()
                except (InvalidTag, UnicodeDecodeError):
                    self.stats["paths_unreadable"] += 1
                    continue
                self._paths.setdefault(topic, []).append(path_id)
                self._tags[path_id] = tag
                self._path_keys[path_id] = key_id
            sizes = self._db.execute(
                "SELECT path_id, count(*), sum(size) FROM messages GROUP BY path_id"
            )
            for path_id, count, size in sizes.fetchall():
                self._counts[path_id] = count
                self._bytes[path_id] = size or 0
        except sqlite3.Error as exc:
            raise StorageError(self.path, _reason(exc)) from None

    def _sealing_of(self, key_id: str) -> Sealing | None:
        sealing = self._sealings.get(key_id)
        if sealing is None:
            key = next((k for k in self._keyring if k.key_id == key_id), None)
            if key is None:
                return None
            sealing = self._sealings[key_id] = Sealing(key)
        return sealing

    @property
    def db(self) -> sqlite3.Connection:
        """The database, for the other tables of the memory (work queues)."""
        return self._db

    def sealing_for(self, scope: str) -> Sealing:
        """The keys new data of `scope` is sealed under; NoKey without one."""
        key = self._keyring.primary(scope)
        if key is None:
            raise NoKey(scope)
        sealing = self._sealing_of(key.key_id)
        assert sealing is not None  # the keyring holds its own primary key
        return sealing

    def sealing_of(self, key_id: str) -> Sealing | None:
        """The keys of the keyring's key `key_id`, if it still holds it."""
        return self._sealing_of(key_id)

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()
        self._db.close()

    def wrote(self) -> None:
        """A write transaction committed (here or in the jobs' table): a checkpoint is due."""
        if self._checkpoints is not None:
            self._checkpoints.due()

    # ----------------------------------------------------------------- writing

    def put(self, topic: str, payload: bytes, published_at: float, message_id: bytes) -> bool:
        """Remember one message; False if it was remembered already (the same id)."""
        return self.put_many([(topic, payload, published_at, message_id)]) == 1

    def put_many(self, messages: Iterable[tuple[str, bytes, float, bytes]]) -> int:
        """Remember messages in one transaction (all or none); how many were new."""
        added = 0
        touched: set[tuple[int, str]] = set()
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                for topic, payload, published_at, msg_id in messages:
                    if len(msg_id) != ID_SIZE:
                        raise ConfigurationError(f"a message id is {ID_SIZE} bytes")
                    path_id, sealing = self._path_for(validate_topic(topic))
                    sealed = sealing.seal(payload, msg_id + self._tags[path_id])
                    cursor = db.execute(
                        "INSERT OR IGNORE INTO messages VALUES (?, ?, ?, ?, ?)",
                        (path_id, msg_id, published_at, len(payload), sealed),
                    )
                    if cursor.rowcount == 1:
                        added += 1
                        self._counts[path_id] = self._counts.get(path_id, 0) + 1
                        self._bytes[path_id] = self._bytes.get(path_id, 0) + len(payload)
                        touched.add((path_id, topic))
                    else:
                        self.stats["duplicates"] += 1
                for path_id, topic in touched:
                    self._trim(path_id, self.retention(topic))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:  # SQLite may have rolled it back itself
                    db.execute("ROLLBACK")
                self._reload_sizes()
                raise
        except sqlite3.Error as exc:
            raise StorageError(self.path, _reason(exc)) from None
        self.stats["stored"] += added
        self.wrote()
        return added

    def _path_for(self, topic: str) -> tuple[int, Sealing]:
        known = self._writing.get(topic)
        if known is not None:
            return known
        key = self._keyring.primary(topic.partition(".")[0])
        if key is None:
            raise NoKey(topic.partition(".")[0])
        sealing = self._sealing_of(key.key_id)
        assert sealing is not None  # the keyring holds its own primary key
        tag = sealing.path_tag(topic)
        row = self._db.execute("SELECT path_id FROM paths WHERE path_tag = ?", (tag,)).fetchone()
        if row is None:
            cursor = self._db.execute(
                "INSERT INTO paths (key_id, path_tag, sealed_topic) VALUES (?, ?, ?)",
                (key.key_id, tag, sealing.seal(topic.encode(), b"topic")),
            )
            path_id = int(cursor.lastrowid or 0)
            self._paths.setdefault(topic, []).append(path_id)
            self._tags[path_id] = tag
            self._path_keys[path_id] = key.key_id
        else:
            path_id = int(row[0])
        self._writing[topic] = (path_id, sealing)
        return path_id, sealing

    def _trim(self, path_id: int, rule: Retention) -> None:
        excess = self._counts.get(path_id, 0) - rule.max_per_path
        if excess > 0:
            self._delete_oldest(path_id, excess, "trimmed_count")
        if rule.max_bytes is not None and self._bytes.get(path_id, 0) > rule.max_bytes:
            rows = self._db.execute(
                "SELECT size FROM messages WHERE path_id = ? ORDER BY id DESC", (path_id,)
            ).fetchall()
            kept = total = 0
            for (size,) in rows:
                if kept and total + size > rule.max_bytes:
                    break
                total += size
                kept += 1
            self._delete_oldest(path_id, len(rows) - kept, "trimmed_bytes")

    def _delete_oldest(self, path_id: int, count: int, reason: str) -> None:
        if count <= 0:
            return
        rows = self._db.execute(
            "SELECT id, size FROM messages WHERE path_id = ? ORDER BY id LIMIT ?",
            (path_id, count),
        ).fetchall()
        self._db.executemany(
            "DELETE FROM messages WHERE path_id = ? AND id = ?", [(path_id, i) for i, _ in rows]
        )
        self._counts[path_id] -= len(rows)
        self._bytes[path_id] -= sum(size for _, size in rows)
        self.stats[reason] += len(rows)

    def _reload_sizes(self) -> None:
        """After a rolled-back write: what the database holds again."""
        self._writing.clear()
        self._counts.clear()
        self._bytes.clear()
        try:
            sizes = self._db.execute(
                "SELECT path_id, count(*), sum(size) FROM messages GROUP BY path_id"
            )
            for path_id, count, size in sizes.fetchall():
                self._counts[path_id] = count
                self._bytes[path_id] = size or 0
        except sqlite3.Error:
            pass  # the next write reports the problem

    def expire(self, now: float) -> int:
        """Remove the messages older than their path's `max_age`; how many went."""
        removed = 0
        try:
            for topic, path_ids in self._paths.items():
                rule = self.retention(topic)
                if rule.max_age is None:
                    continue
                for path_id in path_ids:
                    rows = self._db.execute(
                        "SELECT id, size FROM messages WHERE path_id = ? AND published_at < ?",
                        (path_id, now - rule.max_age),
                    ).fetchall()
                    if rows:
                        self._db.executemany(
                            "DELETE FROM messages WHERE path_id = ? AND id = ?",
                            [(path_id, i) for i, _ in rows],
                        )
                        self._counts[path_id] -= len(rows)
                        self._bytes[path_id] -= sum(size for _, size in rows)
                        removed += len(rows)
        except sqlite3.Error as exc:
            raise StorageError(self.path, _reason(exc)) from None
        self.stats["trimmed_age"] += removed
        return removed

    def retention(self, topic: str) -> Retention:
        """The rule that governs a topic: the first whose pattern matches, else the default."""
        for pattern, rule in self._rules:
            if topic_matches(pattern, topic):
                return rule
        return self._default

    # ----------------------------------------------------------------- reading

    def latest(
        self, pattern: str, latest: int = 1, *, after: str | None = None, paths: int | None = None
    ) -> list[Stored]:
        """For every stored path `pattern` matches, its `latest` newest messages, newest first
        (paths in topic order); only paths after the topic `after`, and at most `paths` of
        them, to read a long answer a page at a time."""
        pattern = validate_pattern(pattern)
        if type(latest) is not int or latest < 1:
            raise ConfigurationError(f"latest must be a positive integer, not {latest!r}")
        topics = self._matching(pattern)
        start = 0 if after is None else bisect.bisect_right(topics, after)
        topics = topics[start : None if paths is None else start + paths]
        by_path = {path_id: topic for topic in topics for path_id in self._paths[topic]}
        found: dict[str, list[Stored]] = {topic: [] for topic in topics}
        ids = list(by_path)
        try:
            for start in range(0, len(ids), _CHUNK):
                chunk = ids[start : start + _CHUNK]
                # Per path, the id of its `latest`-th newest message bounds a range scan of
                # the primary key: only the rows returned are read.
                wanted = ",".join(["(?)"] * len(chunk))
                rows = self._db.execute(
                    f"WITH wanted(path_id) AS (VALUES {wanted})"
                    " SELECT m.path_id, m.id, m.published_at, m.sealed FROM wanted w"
                    " JOIN messages m ON m.path_id = w.path_id AND m.id >= coalesce("
                    "  (SELECT id FROM messages WHERE path_id = w.path_id"
                    "   ORDER BY id DESC LIMIT 1 OFFSET ?), x'')",
                    (*chunk, latest - 1),
                ).fetchall()
                for path_id, msg_id, published_at, sealed in rows:
                    stored = self._open_row(by_path[path_id], path_id, msg_id, published_at, sealed)
                    if stored is not None:
                        found[stored.topic].append(stored)
        except sqlite3.Error as exc:
            raise StorageError(self.path, _reason(exc)) from None
        out: list[Stored] = []
        for topic in topics:
            # A topic stored under two keys (a rotation) has two paths: merge them.
            out.extend(sorted(found[topic], key=lambda s: s.id, reverse=True)[:latest])
        return out

    def _matching(self, pattern: str) -> list[str]:
        """The stored topics `pattern` matches, sorted; kept per pattern until a path is added
        (a reread a page at a time asks again for each page)."""
        known = self._matches.get(pattern)
        if known is not None and known[0] == len(self._paths):
            return known[1]
        topics = sorted(t for t in self._paths if topic_matches(pattern, t))
        if len(self._matches) >= 64:
            self._matches.clear()
        self._matches[pattern] = (len(self._paths), topics)
        return topics

    def _open_row(
        self, topic: str, path_id: int, msg_id: bytes, published_at: float, sealed: bytes
    ) -> Stored | None:
        sealing = self._sealing_of(self._path_keys[path_id])
        if sealing is not None:
            try:
                payload = sealing.open(sealed, msg_id + self._tags[path_id])
            except InvalidTag:
                pass
            else:
                return Stored(topic, payload, published_at, msg_id)
        self.stats["messages_unreadable"] += 1
        return None

    def newest_id(self) -> bytes | None:
        """The id of the newest message held (None: none)."""
        try:
            row = self._db.execute("SELECT max(id) FROM messages").fetchone()
        except sqlite3.Error as exc:
            raise StorageError(self.path, _reason(exc)) from None
        return bytes(row[0]) if row and row[0] is not None else None

    def since(self, after: bytes, max_bytes: int) -> tuple[list[Stored], bytes | None]:
        """Messages with ids after `after`, oldest first, about `max_bytes` of payload of them
        (at least one), and the id to ask after for the rest (None: there is no more)."""
        topics = {path_id: topic for topic, ids in self._paths.items() for path_id in ids}
        out: list[Stored] = []
        size = 0
        cursor = after
        try:
            while True:
                rows = self._db.execute(
                    "SELECT path_id, id, published_at, sealed, size FROM messages"
                    " WHERE id > ? ORDER BY id LIMIT 256",
                    (cursor,),
                ).fetchall()
                for path_id, msg_id, published_at, sealed, length in rows:
                    if out and size + length > max_bytes:
                        return out, out[-1].id
                    cursor = msg_id
                    topic = topics.get(path_id)
                    if topic is None:
                        continue  # a path this keyring cannot open
                    stored = self._open_row(topic, path_id, msg_id, published_at, sealed)
                    if stored is not None:
                        out.append(stored)
                        size += length
                if len(rows) < 256:
                    return out, None
        except sqlite3.Error as exc:
            raise StorageError(self.path, _reason(exc)) from None

    # ----------------------------------------------------------------- figures

    def figures(self) -> dict[str, int]:
        """What the store holds and what it has done: counts by reason."""
        return {
            "paths": len(self._paths),
            "messages": sum(self._counts.values()),
            "payload_bytes": sum(self._bytes.values()),
            **self.stats,
        }


def sqlite_reason(exc: sqlite3.Error) -> str:
    """What a SQLite error means, for a StorageError."""
    return _reason(exc)


def _reason(exc: sqlite3.Error) -> str:
    text = str(exc) or type(exc).__name__
    if "disk is full" in text or "disk I/O" in text:
        return f"{text} (free space on its disk)"
    return text


class _Checkpoints:
    """Checkpoints of the write-ahead log of a store with `sync="os"`, on a thread and a
    connection of their own.

    A checkpoint copies the log's pages into the database and waits for the disk twice (the
    log, then the database): made by the writing connection (SQLite's default, every 1,000
    pages of log) it lands inside one commit in twenty or so, and the publishes waiting on
    that commit wait for it too; with "os", whose commits do not wait for the disk, that is
    most of a commit's average cost. Here the writer only says it wrote (`due`); this thread
    waits CHECKPOINT_AFTER seconds (one checkpoint for the commits of a burst), copies what
    the log holds without holding the writer up (PASSIVE), then, if the writer is not busy at
    that moment, copies the little it added meanwhile and has the log start over (RESTART,
    without waiting), so the log does not keep growing under steady writes. The writer's own
    checkpoint stays past CHECKPOINT_BACKSTOP pages, in case this thread falls behind.
    Durability is unchanged: a checkpoint only moves committed pages into the database.

    Not with "fsync": there, measured, this thread's own waits for the disk slowed the
    commits' waits, which share it, more than taking the checkpoints out of the commits won.
    """

    def __init__(self, path: str, stats: Counter[str]) -> None:
        self._path = path
        self._stats = stats
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def due(self) -> None:
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(
                target=self._run, name="irismesh-memory-checkpoint", daemon=True
            )
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        try:
            db = sqlite3.connect(
                self._path, timeout=0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error:
            self._stats["checkpoints_failed"] += 1
            return
        try:
            while True:
                self._wake.wait()
                if self._closed.is_set():
                    return
                time.sleep(CHECKPOINT_AFTER)
                self._wake.clear()
                if self._closed.is_set():  # closed while asleep: its wake-up was just cleared
                    return
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    busy = db.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()[0]
                    self._stats["checkpoints"] += 1
                    if busy:
                        self._stats["checkpoints_unfinished"] += 1
                except sqlite3.Error:
                    self._stats["checkpoints_failed"] += 1
        finally:
            db.close()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


__all__ = [
    "ID_SIZE",
    "SYNC_MODES",
    "MemoryStore",
    "Retention",
    "Stored",
    "clock_id",
    "clock_state",
    "id_time",
    "memory_clock",
    "message_id",
    "observe_id",
    "physical_us",
]
