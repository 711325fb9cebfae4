"""`mesh clusters` and `mesh peers` as an operator runs them on one machine, discovery on by
default (no seed): members of echo and db run; a '*' keyring lists both clusters with their
members, a keyring holding only db's key lists db alone."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import MESH, run_mesh

import irismesh
from irismesh.security.keyring import ScopeKey


@pytest.fixture
def operator(tmp_path: Path) -> Iterator[tuple[dict[str, str], dict[str, Path], dict[str, str]]]:
    """The environment, the keyrings (members, star, db) and echo's and db's member ids."""
    star = ScopeKey(scope="*", secret=os.urandom(32))
    db = ScopeKey(scope="db", secret=os.urandom(32))
    paths = {name: tmp_path / f"{name}.keys" for name in ("members", "star", "db")}
    irismesh.Keyring([star, db]).save(paths["members"])
    irismesh.Keyring([star]).save(paths["star"])
    irismesh.Keyring([db]).save(paths["db"])
    env = dict(os.environ, IRISMESH_KEYFILE=str(paths["members"]), COLUMNS="160")
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")  # no context from this machine's user
    for name in ("IRISMESH_DISCOVERY", "IRISMESH_KEYS"):  # discovery on, as by default
        env.pop(name, None)
    procs = []
    try:
        ids = {}
        for cluster in ("echo", "db"):
            proc = subprocess.Popen(
                [*MESH, "node", "--cluster", cluster, "--json", "--name", f"{cluster}-member"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            procs.append(proc)
            assert proc.stdout is not None
            ids[cluster] = json.loads(proc.stdout.readline())["node_id"]
        yield env, paths, ids
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.communicate(timeout=10)


def mesh(env: dict[str, str], *args: str) -> str:
    result = run_mesh(args, env, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def clusters_until(
    env: dict[str, str], keys: Path, want: dict[str, list[str]]
) -> list[dict[str, Any]]:
    """`mesh clusters --json` with `keys` until it lists `want` (cluster -> member ids)."""
    deadline = time.monotonic() + 20  # a busy machine can be slow to start the members
    while True:
        views: list[dict[str, Any]] = json.loads(
            mesh(env, "clusters", "--keys", str(keys), "--json")
        )
        got = {v["cluster"]: v["members"] for v in views}
        if got == want or time.monotonic() > deadline:
            assert got == want
            return views


def test_a_star_keyring_lists_echo_and_db_with_their_members(
    operator: tuple[dict[str, str], dict[str, Path], dict[str, str]],
) -> None:
    env, paths, ids = operator
    views = clusters_until(env, paths["star"], {"db": [ids["db"]], "echo": [ids["echo"]]})
    assert all(v["announced"] == [] for v in views)  # both members are peers of its mesh
    out = mesh(env, "clusters", "--keys", str(paths["star"]))
    assert "clusters (2)" in out
    assert "db-member" in next(line for line in out.splitlines() if " db " in line)
    assert "echo-member" in next(line for line in out.splitlines() if " echo " in line)
    peers = json.loads(mesh(env, "peers", "--keys", str(paths["star"]), "--json"))
    served = {p["node_id"]: p["clusters"] for p in peers}
    assert served == {ids["db"]: ["db"], ids["echo"]: ["echo"]}


def test_a_keyring_of_db_s_key_alone_lists_db_alone(
    operator: tuple[dict[str, str], dict[str, Path], dict[str, str]],
) -> None:
    env, paths, ids = operator
    # The members announce before they are found: give them the time the other test took.
    clusters_until(env, paths["star"], {"db": [ids["db"]], "echo": [ids["echo"]]})
    [db] = clusters_until(env, paths["db"], {"db": [ids["db"]]})
    assert db["announced"] == [ids["db"]]  # heard of, not a peer: db's key is no mesh key
