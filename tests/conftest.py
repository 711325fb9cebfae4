"""Fixtures shared by every test; plain helpers live in tests/helpers.py."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import Workers

import irismesh

if irismesh.loop_factory() is not asyncio.new_event_loop:
    # irismesh's own loop (uvloop where installed) for the tests' asyncio.run too, unless
    # IRISMESH_LOOP=asyncio: CI runs the integration tests both ways.
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


@pytest.fixture
def keys() -> irismesh.Keyring:
    return irismesh.Keyring.generate()


@pytest.fixture
def keyfile(tmp_path: Path, keys: irismesh.Keyring) -> Path:
    path = tmp_path / "mesh.keys"
    keys.save(path)
    return path


@pytest.fixture
def workers(keyfile: Path) -> Iterator[Workers]:
    group = Workers(keyfile)
    try:
        yield group
    finally:
        group.close()
