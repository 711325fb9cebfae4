"""Fixtures shared by every test; plain helpers live in tests/helpers.py."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import sys
import tempfile
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


# Nodes discover each other by default; tests say whom each node joins, so that the nodes of
# one test never find those of another (or of another test run on this machine). Tests of
# discovery itself ask for it (survey=, mdns=, discovery=True) or set IRISMESH_DISCOVERY=1.
# `mesh` and the library read their config and default keyring under XDG_CONFIG_HOME: a
# directory of the run's own, never the user's. Subprocesses inherit all of it.
os.environ["IRISMESH_DISCOVERY"] = "0"
for _name in ("IRISMESH_SEEDS", "IRISMESH_INTERFACE", "IRISMESH_CONFIG"):
    os.environ.pop(_name, None)
os.environ["XDG_CONFIG_HOME"] = _config_home = tempfile.mkdtemp(prefix="irismesh-tests-config-")
atexit.register(shutil.rmtree, _config_home, True)


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
