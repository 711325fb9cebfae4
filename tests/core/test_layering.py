"""The core is pure: no I/O, no clock, no randomness of its own, no imports from above it.

Checked on the source (ast), so a violation is caught even on a path no test executes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import irismesh._core

CORE = Path(irismesh._core.__file__).resolve().parent
MODULES = sorted(CORE.glob("*.py"))

# I/O, event loops, clocks and threads belong to the driver.
FORBIDDEN_MODULES = {
    "asyncio",
    "zmq",
    "socket",
    "selectors",
    "time",
    "datetime",
    "threading",
    "multiprocessing",
    "subprocess",
    "secrets",
}
ALLOWED_IRISMESH = ("irismesh._core", "irismesh.errors")
# Randomness is passed in: a seeded `Random` is a type the core may name, not a source.
ALLOWED_FROM_RANDOM = {"Random"}


def _top(name: str) -> str:
    return name.split(".")[0]


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _forbidden(module: str) -> bool:
    """A module the core must not import: I/O, clocks, or irismesh above the core."""
    if _top(module) in FORBIDDEN_MODULES:
        return True
    return _top(module) == "irismesh" and not _inside(module, ALLOWED_IRISMESH)


def _resolve(node: ast.ImportFrom, package: str) -> str | None:
    """The absolute module of a `from ... import`, or None if it climbs out of the tree."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    if node.level > len(parts):
        return None
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _randomness(module: str, names: set[str]) -> bool:
    """Importing a source of randomness by name (a seeded Random class is fine)."""
    if module == "random":
        return bool(names - ALLOWED_FROM_RANDOM)
    return module == "os" and bool(names & {"urandom", "getrandom"})


def violations(source: str, package: str = "irismesh._core") -> list[str]:
    """Every rule the module's source breaks, one line each."""
    found: list[str] = []
    tree = ast.parse(source)
    random_names: set[str] = set()  # local names bound to the random module
    os_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _forbidden(alias.name):
                    found.append(f"line {node.lineno}: import {alias.name}")
                elif alias.name == "random":
                    random_names.add(alias.asname or "random")
                elif alias.name == "os":
                    os_names.add(alias.asname or "os")
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            names = {alias.name for alias in node.names}
            if module is None:
                found.append(f"line {node.lineno}: relative import beyond the top package")
            elif _forbidden(module) or _randomness(module, names):
                found.append(f"line {node.lineno}: from {module} import {', '.join(names)}")
            elif module == "irismesh" and names - {"errors", "_core"}:
                found.append(f"line {node.lineno}: from irismesh import {', '.join(names)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, attr = node.value.id, node.attr
            if (owner in random_names and attr not in ALLOWED_FROM_RANDOM) or (
                owner in os_names and attr in ("urandom", "getrandom")
            ):
                found.append(f"line {node.lineno}: {owner}.{attr}")
    return found


def test_the_core_has_modules() -> None:
    names = {path.stem for path in MODULES}
    assert {"engine", "frames", "links", "pending", "replycache", "balancer"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_is_pure(path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "import zmq.asyncio",
        "from time import monotonic",
        "import socket as s",
        "import threading",
        "from irismesh import node",
        "from irismesh.security.keyring import Keyring",
        "import irismesh.patterns",
        "from ..node import Node",  # relative to irismesh._core: irismesh.node
        "from ... import anything",
        "from .. import _driver",
        "import random\nrandom.random()",
        "import random as r\nr.choice([1])",
        "from random import randint",
        "import os\nos.urandom(16)",
        "from os import urandom",
    ],
)
def test_the_checker_catches(source: str) -> None:
    assert violations(source) != []


@pytest.mark.parametrize(
    "source",
    [
        "from random import Random",
        "import random\nrandom.Random(1)",
        "from irismesh.errors import ProtocolError",
        "from irismesh._core.frames import Kind",
        "from . import frames",
        "from .frames import Kind",
        "import msgpack, heapq, struct",
    ],
)
def test_the_checker_allows(source: str) -> None:
    assert violations(source) == []
