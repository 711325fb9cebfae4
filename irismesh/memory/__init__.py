"""The mesh's memory: messages kept at rest under their paths, found again by pattern.

`store` keeps retained messages in SQLite, sealed under keys derived from their topics' keys;
`service` is what memory members and their callers say to each other.
"""

from irismesh.memory.store import MemoryStore, Retention, Stored, message_id

__all__ = ["MemoryStore", "Retention", "Stored", "message_id"]
