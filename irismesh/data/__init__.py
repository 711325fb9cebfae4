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

if TYPE_CHECKING:
    from irismesh.data.clock import HybridClock, Stamp
    from irismesh.data.types import Flag, LWWRegister, ORMap, ORSet, PNCounter, decode, encode

_LAZY = {
    "HybridClock": "irismesh.data.clock",
    "Stamp": "irismesh.data.clock",
    **dict.fromkeys(
        ("Flag", "LWWRegister", "ORMap", "ORSet", "PNCounter", "decode", "encode"),
        "irismesh.data.types",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


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
