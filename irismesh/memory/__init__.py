"""The mesh's memory: messages kept at rest under their paths, found again by pattern.

`store` keeps retained messages in SQLite, sealed under keys derived from their topics' keys;
`service` is what memory members and their callers say to each other; `api` the node's
methods. A node loads the store and the service when it first uses the memory (or serves it),
so the names below come from their modules on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from irismesh import _lazy

if TYPE_CHECKING:
    from irismesh.memory.store import MemoryStore, Retention, Stored, message_id

MEMORY_CLUSTER: Final = "_memory"  # the cluster every memory member serves
MAX_LATEST: Final = 100_000  # the most messages of one path a reread returns

_STORE = "irismesh.memory.store"
_LAZY = {name: (_STORE, name) for name in ("MemoryStore", "Retention", "Stored", "message_id")}


def __getattr__(name: str) -> Any:
    return _lazy.attribute(__name__, name, _LAZY)


__all__ = ["MAX_LATEST", "MEMORY_CLUSTER", "MemoryStore", "Retention", "Stored", "message_id"]
