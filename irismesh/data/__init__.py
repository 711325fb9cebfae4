"""Replicated data without a server: counters, sets, registers, flags and maps that converge.

`types` holds the delta-state CRDTs (pure, no I/O) and their msgpack encoding; `clock` the
hybrid logical clock that orders registers; `wire` what holders say to each other, sealed;
`replicas` a node's replicas and their replication (`node.data`); `disk` a memory member's
copy at rest. The handles' types are importable from `irismesh.data.replicas`.
"""

from irismesh.data.clock import HybridClock, Stamp
from irismesh.data.types import Flag, LWWRegister, ORMap, ORSet, PNCounter, decode, encode

__all__ = [
    "Flag",
    "HybridClock",
    "LWWRegister",
    "ORMap",
    "ORSet",
    "PNCounter",
    "Stamp",
    "decode",
    "encode",
]
