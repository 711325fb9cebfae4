"""Data keys at rest on a memory member: one SQLite table of sealed states.

A memory member holds every data key (it subscribes to all of them) and keeps each key's whole
state in `data.sqlite3`, beside the memory's own database: one row per key, the key and its
encoded state sealed together (AES-256-GCM under a key derived from the data key's scope key,
`wire.Sealer`), found by a tag that is a keyed hash of the key, so a copied file without the
keyring shows neither keys nor values. A state is written before the member acknowledges a
majority or all write of it (so a SIGKILL loses no acknowledged write: the rows are in the
operating system's buffers, written through the WAL) and, for other changes, within
SAVE_EVERY seconds. Rows sealed under a key the keyring no longer holds stay but are not
loaded (`figures()["data_rows_locked"]`). Two rows for one key (its scope's key was rotated)
are harmless: states merge.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgpack

from irismesh.data.types import Crdt, decode, encode
from irismesh.data.wire import Sealer
from irismesh.errors import ProtocolError, StorageError

SAVE_EVERY = 0.2  # seconds a change waits at most to reach the disk
_AT_REST = b"data at rest"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS data_keys (
    tag BLOB PRIMARY KEY,
    sealed BLOB NOT NULL
) WITHOUT ROWID
"""


class DataDisk:
    """The sealed states of the keys a memory member holds."""

    def __init__(self, directory: str | Path, sealer: Sealer) -> None:
        self.path = str(Path(directory) / "data.sqlite3")
        self._sealer = sealer
        self.locked = 0
        self.saved = 0
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)
        except sqlite3.Error as exc:
            raise StorageError(self.path, f"cannot open: {exc}") from None

    def load(self) -> list[tuple[str, Crdt]]:
        """Every state whose key the keyring holds."""
        found: list[tuple[str, Crdt]] = []
        self.locked = 0
        for (sealed,) in self._db.execute("SELECT sealed FROM data_keys"):
            try:
                key, state = msgpack.unpackb(self._sealer.open_at_rest(sealed, _AT_REST))
                found.append((key, decode(state)))
            except (ProtocolError, ValueError, TypeError):
                self.locked += 1
        return found

    def save(self, states: list[tuple[str, Crdt]]) -> None:
        rows = []
        for key, state in states:
            packed = msgpack.packb([key, encode(state)], use_bin_type=True)
            rows.append((self._sealer.tag(key), self._sealer.seal_at_rest(key, packed, _AT_REST)))
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO data_keys VALUES (?, ?)", rows)
        except sqlite3.Error as exc:
            raise StorageError(self.path, f"cannot write: {exc}") from None
        self.saved += len(rows)

    def close(self) -> None:
        self._db.close()
