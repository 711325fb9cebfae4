"""Two meshes joined by two gateway pairs (`mesh gateway` processes), one killed under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_until

import irismesh

LOCAL = "tcp://127.0.0.1:0"


class Processes:
    """`mesh` processes, SIGKILLed at teardown whatever happens."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, *argv: str) -> dict[str, str]:
        cmd = [sys.executable, "-m", "irismesh", *argv]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        self.procs[name] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"{name} did not start"
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[Processes]:
    group = Processes()
    try:
        yield group
    finally:
        group.close()


def keyring(tmp: Path, name: str) -> tuple[irismesh.Keyring, str]:
    keys = irismesh.Keyring.generate()
    path = tmp / f"{name}.keys"
    keys.save(path)
    return keys, str(path)


@pytest.mark.parametrize("victim", ["importing", "exporting"])
def test_sigkill_of_a_gateway_under_load_loses_no_request(
    tmp_path: Path, procs: Processes, victim: str
) -> None:
    """Mesh b calls cluster db of mesh a through two gateway pairs; one gateway of a pair is
    SIGKILLed with requests in flight: every request still gets its own reply."""
    _, a_keys = keyring(tmp_path, "a")
    b, b_keys = keyring(tmp_path, "b")
    _, link_keys = keyring(tmp_path, "link")
    member = ["node", "--keys", a_keys, "--bind", LOCAL, "--no-discovery", "--json"]
    db1 = procs.start("db1", *member, "--cluster", "db", "--prefix", "1:")["endpoint"]
    procs.start("db2", *member, "--cluster", "db", "--prefix", "2:", "--seed", db1)
    gw = ["gateway", "--link-keys", link_keys, "--bind", LOCAL, "--no-discovery", "--json"]
    a_side = [*gw, "--mesh", "a", "--keys", a_keys, "--seed", db1, "--export", "db"]
    a1 = procs.start("a1", *a_side, "--listen", "tcp://127.0.0.1:0")["endpoint"]
    a2 = procs.start("a2", *a_side, "--listen", "tcp://127.0.0.1:0")["endpoint"]
    b_side = [*gw, "--mesh", "b", "--keys", b_keys]
    b1 = procs.start("b1", *b_side, "--peer", a1)["node_endpoint"]
    procs.start("b2", *b_side, "--peer", a2, "--seed", b1)
    kill = {"importing": "b1", "exporting": "a1"}[victim]

    async def main() -> None:
        async with irismesh.Node(keyring=b, seeds=[b1], bind=LOCAL) as client:
            await client.wait_for_members("db", 2, timeout=20)
            total, in_flight, done = 2000, 48, 0
            wrong: list[str] = []
            next_id = 0

            async def caller() -> None:
                nonlocal next_id, done
                while next_id < total:
                    i = next_id
                    next_id += 1
                    reply = await client.request("db", b"%d" % i, timeout=10)
                    if reply.partition(b":")[2] != b"%d" % i:
                        wrong.append(f"{i}: {reply!r}")
                    done += 1

            async def killer() -> None:
                await wait_until(lambda: done >= total // 4, 30, "a quarter served")
                procs.procs[kill].send_signal(signal.SIGKILL)

            await asyncio.wait_for(
                asyncio.gather(killer(), *(caller() for _ in range(in_flight))), 60
            )
            assert not wrong, wrong[:5]
            assert done == total
            # Requests in flight through the dead gateway went through the other one.
            moved = {"importing": "requests_resent", "exporting": "requests_retried_elsewhere"}
            assert client.stats.get(moved[victim], 0) > 0
            if victim == "exporting":  # the orphaned gateway leaves the cluster
                await wait_until(lambda: len(client.members("db")) == 1, 10, "b1 to leave db")

    asyncio.run(main())


def test_mesh_top_shows_the_gateways_counters(tmp_path: Path, procs: Processes) -> None:
    _, a_keys = keyring(tmp_path, "a")
    _, b_keys = keyring(tmp_path, "b")
    _, link_keys = keyring(tmp_path, "link")
    gw = ["gateway", "--link-keys", link_keys, "--bind", LOCAL, "--no-discovery", "--json"]
    a = procs.start("a", *gw, "--mesh", "a", "--keys", a_keys, "--listen", LOCAL, "--topics", "x.#")
    procs.start("b", *gw, "--mesh", "b", "--keys", b_keys, "--peer", a["endpoint"])
    top = [sys.executable, "-m", "irismesh", "top", "--once", "--json", "--keys", a_keys]
    top += ["--seed", a["node_endpoint"], "--no-discovery", "--wait", "2"]
    deadline = 20
    for _ in range(deadline):  # until the link is up
        frame = json.loads(subprocess.run(top, capture_output=True, text=True, check=True).stdout)
        [view] = frame["gateways"]
        if view["stats"]["links_up"] == 1:
            break
    assert view["mesh"] == "a"
    assert view["stats"]["links"] == 1
    assert view["stats"]["link_buffered"] == 0
    assert view["stats"]["link_dropped_buffer_full"] == 0
