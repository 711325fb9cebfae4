"""The mesh's memory: messages kept at rest under their paths, found again by pattern.

`store` keeps retained messages in SQLite, sealed under keys derived from their topics' keys;
`service` is what memory members and their callers say to each other; `api` the node's
methods. A node loads the store and the service when it first uses the memory (or serves it),
so the names below come from their modules on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from irismesh.memory.store import MemoryStore, Retention, Stored, message_id

MEMORY_CLUSTER: Final = "_memory"  # the cluster every memory member serves
MAX_LATEST: Final = 100_000  # the most messages of one path a reread returns

_LAZY = {
    "MemoryStore": "irismesh.memory.store",
    "Retention": "irismesh.memory.store",
    "Stored": "irismesh.memory.store",
    "message_id": "irismesh.memory.store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["MAX_LATEST", "MEMORY_CLUSTER", "MemoryStore", "Retention", "Stored", "message_id"]
