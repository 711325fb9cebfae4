"""`mesh gateway --join`: one process joining two meshes, seen from both and from `mesh top`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import irismesh

LOCAL = "tcp://127.0.0.1:0"


def keyring(tmp: Path, name: str) -> tuple[irismesh.Keyring, str]:
    keys = irismesh.Keyring.generate()
    path = tmp / f"{name}.keys"
    keys.save(path)
    return keys, str(path)


def mesh(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "irismesh", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.fixture
def gateway_process(
    tmp_path: Path,
) -> Iterator[tuple[dict[str, object], irismesh.Keyring, irismesh.Keyring, str]]:
    a_keys, a_file = keyring(tmp_path, "a")
    b_keys, b_file = keyring(tmp_path, "b")
    cmd = [sys.executable, "-m", "irismesh", "gateway", "--mesh", "a", "--keys", a_file]
    cmd += ["--bind", LOCAL, "--no-discovery", "--json", "--export", "db"]
    cmd += ["--tunnel-window", "256KiB"]
    cmd += ["--join", f"b;keys={b_file};discovery=off;export=search"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the gateway did not start"
        yield json.loads(line), a_keys, b_keys, b_file
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.returncode == 0  # SIGTERM: closed cleanly


def test_one_gateway_process_joins_two_meshes(
    gateway_process: tuple[dict[str, object], irismesh.Keyring, irismesh.Keyring, str],
) -> None:
    info, a_keys, b_keys, b_file = gateway_process
    assert info["mesh"] == "a"
    [joined] = info["joined"]  # type: ignore[misc]
    assert joined["mesh"] == "b"

    async def main() -> None:
        seed_a, seed_b = str(info["node_endpoint"]), str(joined["node_endpoint"])
        member = irismesh.Node("db", keyring=a_keys, seeds=[seed_a], bind=LOCAL)
        other = irismesh.Node("search", keyring=b_keys, seeds=[seed_b], bind=LOCAL)
        client_b = irismesh.Node(keyring=b_keys, seeds=[seed_b], bind=LOCAL)
        client_a = irismesh.Node(keyring=a_keys, seeds=[seed_a], bind=LOCAL)
        member.on_request(lambda payload: b"A:" + payload)
        other.on_request(lambda payload: b"B:" + payload)
        async with member, other, client_b, client_a:
            await client_b.wait_for_members("db", timeout=10)
            await client_a.wait_for_members("search", timeout=10)
            assert await client_b.request("db", b"x", timeout=5) == b"A:x"
            assert await client_a.request("search", b"y", timeout=5) == b"B:y"

    asyncio.run(asyncio.wait_for(main(), 30))
    seed = str(joined["node_endpoint"])
    top = ["top", "--once", "--json", "--keys", b_file, "--seed", seed, "--no-discovery"]
    views: list[dict[str, Any]] = []
    for _ in range(10):  # until the frame has the gateway's answer (a busy machine: retried)
        done = mesh(*top, "--wait", "2")
        assert done.returncode == 0, done.stderr
        views = json.loads(done.stdout)["gateways"]
        if views:
            break
    [view] = views
    assert view["mesh"] == "b"
    assert view["stats"]["links_up"] == 1
    assert view["stats"]["requests_forwarded"] == 1
    assert view["stats"]["tunnel_window"] == 256 << 10  # --tunnel-window reached the gateway


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--join", "b"], "keys=FILE"),
        (["--join", "b;keys=b.keys;colour=red"], "the fields are"),
        (["--join", "a;keys=b.keys"], "another mesh"),
        (["--join", "b;keys=b.keys", "--peer", "tcp://127.0.0.1:1"], "need --link-keys"),
        (["--join", "b;keys=b.keys", "--tunnel-window", "0"], "1 byte to 1 GiB"),
        (["--join", "b;keys=b.keys", "--tunnel-window", "lots"], "KiB, MiB or GiB"),
        (["--join", "b;keys=b.keys", "--import-ports", "7420-7410"], "first <= last"),
        (["--join", "b;keys=b.keys", "--import-ports", "many"], "FIRST-LAST"),
        ([], "--link-keys is needed"),
        (["--link-keys", "a.keys"], "--listen or --peer is needed"),
    ],
)
def test_bad_combinations_are_usage_errors(argv: list[str], says: str, tmp_path: Path) -> None:
    _, a_file = keyring(tmp_path, "a")
    done = mesh("gateway", "--mesh", "a", "--keys", a_file, "--no-discovery", *argv)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


def test_the_help_shows_joining_in_one_process() -> None:
    done = mesh("gateway", "--help")
    assert done.returncode == 0
    assert "--join 'west;keys=west.keys" in done.stdout
