"""Telemetry records: one schema for the node's writer, the compactor and Spark."""

from typing import Any

from irismesh import _lazy


def __getattr__(name: str) -> Any:  # its modules, on first access (a node loads few of them)
    return _lazy.attribute(__name__, name, {})
