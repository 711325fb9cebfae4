"""Fixtures shared by every test; plain helpers live in tests/helpers.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import Workers

import irismesh


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
