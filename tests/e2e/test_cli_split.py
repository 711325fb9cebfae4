"""Traffic splits as an operator uses them: `mesh node --version`, `mesh split`, real processes.

Members are `mesh node` processes serving "db" as version v1 or v2 (each reply says which);
callers are library nodes in the test's own process. `mesh split` runs as a subprocess while
the callers' loop keeps running, so the test sees when each caller applies what it set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MESH, kill_all, run_all, wait_until

import irismesh


class Members:
    """`mesh node` members of "db", killed at teardown whatever happens."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []
        self.seed = ""

    def start(self, version: str) -> subprocess.Popen[str]:
        argv = [*MESH, "node", "--cluster", "db", "--version", version, "--json"]
        argv += ["--prefix", f"{version}:"]
        if self.seed:
            argv += ["--seed", self.seed]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["version"] == version
        self.seed = self.seed or first["endpoint"]
        return proc

    def close(self) -> None:
        kill_all(self.procs)


@pytest.fixture
def env(keyfile: Path) -> dict[str, str]:
    found = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    found.pop("IRISMESH_KEYS", None)
    return found


@pytest.fixture
def members(env: dict[str, str]) -> Iterator[Members]:
    with contextlib.closing(Members(env)) as group:
        yield group


async def mesh_split(env: dict[str, str], seed: str, *args: str) -> str:
    """Run `mesh split ARGS` (it must succeed); its stdout."""
    proc = await asyncio.create_subprocess_exec(
        *MESH,
        "split",
        "db",
        *args,
        "--seed",
        seed,
        "--wait",
        "10",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def all_applied(callers: list[irismesh.Node], wanted: dict[str, int] | None) -> float:
    """The wall-clock time at which every caller has `wanted` in effect (polled every 5 ms,
    within 30 s)."""
    await wait_until(lambda: all(c.split("db") == wanted for c in callers), 30, f"{wanted}")
    return time.time()


async def versions_serving(node: irismesh.Node, requests: int) -> Counter[bytes]:
    replies = [await node.request("db", b"x", timeout=5) for _ in range(requests)]
    return Counter(reply.partition(b":")[0] for reply in replies)


def test_a_split_set_from_the_cli_is_in_effect_at_every_caller_within_a_second(
    keys: irismesh.Keyring, env: dict[str, str], members: Members
) -> None:
    for version in ("v1", "v1", "v2", "v2"):
        members.start(version)

    async def main() -> None:
        callers = [irismesh.Node(keyring=keys, seeds=[members.seed]) for _ in range(3)]
        for caller in callers:
            await caller.start()
        try:
            for caller in callers:
                await caller.wait_for_members("db", 4, timeout=20)
            for caller in callers:  # no split yet: the usual choice, both versions
                assert caller.split("db") is None
            wanted = {"v1": 0, "v2": 100}
            applied = asyncio.ensure_future(all_applied(callers, wanted))
            status = json.loads(await mesh_split(env, members.seed, "v1=0", "v2=100", "--json"))
            assert status["split"] == wanted
            assert status["carried_by"] == 4
            await asyncio.wait_for(asyncio.shield(applied), 1.0)  # at the latest
            late = applied.result() - status["stamp"] / 1000
            print(f"every caller applied the split {late * 1000:.0f} ms after it was set")
            assert late <= 1.0
            for caller in callers:  # in effect: v1 has no weight
                assert await versions_serving(caller, 100) == {b"v2": 100}

            status = json.loads(await mesh_split(env, members.seed, "--json"))
            assert status["split"] == wanted
            assert status["members"] == {"v1": 2, "v2": 2}

            applied = asyncio.ensure_future(all_applied(callers, None))
            status = json.loads(await mesh_split(env, members.seed, "--clear", "--json"))
            assert status["split"] is None
            assert status["carried_by"] == 4
            await asyncio.wait_for(asyncio.shield(applied), 1.0)
            late = applied.result() - status["stamp"] / 1000
            print(f"every caller applied the clearing {late * 1000:.0f} ms after it was set")
            assert late <= 1.0
            for caller in callers:
                assert set(await versions_serving(caller, 200)) == {b"v1", b"v2"}
        finally:
            for caller in callers:
                await caller.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_every_v2_member_sigkilled_under_load_fails_no_request(
    keys: irismesh.Keyring, members: Members
) -> None:
    members.start("v1")
    members.start("v1")
    doomed = [members.start("v2"), members.start("v2")]

    async def main() -> None:
        async with irismesh.Node(keyring=keys, seeds=[members.seed]) as caller:
            await caller.wait_for_members("db", 4, timeout=20)
            assert await caller.set_split("db", {"v1": 50, "v2": 50}) == 4
            served: Counter[bytes] = Counter()
            failed: Counter[str] = Counter()
            running = True

            async def worker(w: int) -> None:
                i = 0
                while running:
                    i += 1
                    try:
                        reply = await caller.request("db", b"%d-%d" % (w, i), timeout=5)
                    except irismesh.MeshError as exc:  # counted, never listed
                        failed[type(exc).__name__] += 1
                        await asyncio.sleep(0.01)
                        continue
                    served[reply.partition(b":")[0]] += 1

            tasks = [asyncio.ensure_future(worker(w)) for w in range(32)]
            try:
                await wait_until(lambda: served[b"v2"] >= 500 or failed, 30, "load on v2")
                in_flight = caller.stats["requests_pending"]
                for proc in doomed:
                    proc.send_signal(signal.SIGKILL)
                at_kill = served[b"v1"]
                await wait_until(
                    lambda: served[b"v1"] >= at_kill + 3000 or failed, 60, "v1 serving alone"
                )
            finally:
                running = False
                await asyncio.gather(*tasks)
            print(f"{in_flight} in flight at the kill; served {dict(served)}")
            assert not failed, failed
            assert caller.stats.get("requests_resent", 0) > 0, "nothing was in flight on v2"
            assert len(caller.members("db")) == 2

    asyncio.run(asyncio.wait_for(main(), 120))


def test_mesh_split_rejects_bad_arguments_in_one_line(env: dict[str, str]) -> None:
    run_all(
        [
            (["split", "db", "v1"], 2, "expected VERSION=WEIGHT"),
            (["split", "db", "v1=x"], 2, "whole number"),
            (["split", "db", "v1=-1"], 2, "weights are 0 to"),
            (["split", "db", "a b=1"], 2, "bad version"),
            (["split", "db", "v1=1", "--clear"], 2, "--clear takes no"),
            (["split", "db", "v1=1", "v1=2"], 2, "named twice"),
            (["split", "db", "v1=0"], 2, "a weight above 0"),
            (["node", "--cluster", "db", "--version", "a=b"], 2, "bad version"),
        ],
        env,
    )
