"""Replicated data without a server: counters, sets, registers, flags and maps that converge.

`types` holds the delta-state CRDTs (pure, no I/O) and their msgpack encoding; `clock` the
hybrid logical clock that orders registers; `wire` what holders say to each other, sealed;
`replicas` a node's replicas and their replication (`node.data`); `disk` a memory member's
copy at rest. The handles' types are importable from `irismesh.data.replicas`. A node loads
them when it first touches `node.data`, so the names below come from their modules on first
access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from irismesh import _lazy

if TYPE_CHECKING:
    from irismesh.data.clock import HybridClock, Stamp
    from irismesh.data.types import Flag, LWWRegister, ORMap, ORSet, PNCounter, decode, encode

_LAZY = {
    **{name: ("irismesh.data.clock", name) for name in ("HybridClock", "Stamp")},
    **{
        name: ("irismesh.data.types", name)
        for name in ("Flag", "LWWRegister", "ORMap", "ORSet", "PNCounter", "decode", "encode")
    },
}


def __getattr__(name: str) -> Any:
    return _lazy.attribute(__name__, name, _LAZY)


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
