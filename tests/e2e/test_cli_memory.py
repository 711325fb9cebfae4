"""`mesh memory`, `mesh publish --retain` and `mesh reread`, as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MESH, kill_all, run_mesh

import irismesh


def mesh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_mesh(args, env)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    keyfile = tmp_path / "mesh.keys"
    irismesh.Keyring.generate().save(keyfile)
    return dict(os.environ, IRISMESH_KEYFILE=str(keyfile))


@pytest.fixture
def memory(tmp_path: Path, env: dict[str, str]) -> Iterator[dict[str, object]]:
    args = ["memory", "--data", str(tmp_path / "data"), "--bind", "tcp://127.0.0.1:0", "--json"]
    proc = subprocess.Popen([*MESH, *args], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["messages"] == 0
        yield first
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_retained_messages_are_reread_by_pattern(
    env: dict[str, str], memory: dict[str, object]
) -> None:
    seed = ["--seed", str(memory["endpoint"])]
    for topic, payload in [("news.a", "v1"), ("news.a", "v2"), ("news.b", "only"), ("x.y", "z")]:
        done = mesh(env, "publish", *seed, topic, payload, "--retain")
        assert done.returncode == 0, done.stderr
    text = mesh(env, "reread", *seed, "news.#")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines() == ["news.a\tv2", "news.b\tonly"]
    rows = mesh(env, "reread", *seed, "news.a", "--latest", "5", "--json")
    assert rows.returncode == 0, rows.stderr
    found = [json.loads(line) for line in rows.stdout.splitlines()]
    assert [r["payload"] for r in found] == ["v2", "v1"]
    assert found[0]["id"] > found[1]["id"]  # time-ordered ids, newest first


def test_without_a_memory_member_retain_and_reread_say_so_in_one_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    member = subprocess.Popen(
        [*MESH, "node", "--cluster", "echo", "--bind", "tcp://127.0.0.1:0", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert member.stdout is not None
        seed = ["--seed", json.loads(member.stdout.readline())["endpoint"], "--wait", "1"]
        for args in (["publish", *seed, "news.a", "x", "--retain"], ["reread", *seed, "news.#"]):
            done = mesh(env, *args)
            assert done.returncode == 1, done.stderr
            assert "_memory" in done.stderr
            assert len(done.stderr.strip().splitlines()) == 1
            assert "Traceback" not in done.stderr
        blocker = tmp_path / "file"
        blocker.write_text("in the way")
        bad = mesh(env, "memory", "--data", str(blocker / "data"))
        assert bad.returncode != 0
        assert "cannot create its directory" in bad.stderr
        assert "Traceback" not in bad.stderr
    finally:
        member.kill()
        member.wait(timeout=10)


def test_a_memory_member_killed_while_publishing_loses_no_retained_message(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Two memory members; one is SIGKILLed mid-stream and restarted on its database; then
    the other is killed: the restarted one alone still holds every path's latest version."""
    keys = irismesh.Keyring.load(env["IRISMESH_KEYFILE"])

    def member(name: str, seed: str | None) -> tuple[subprocess.Popen[str], str]:
        args = ["memory", "--data", str(tmp_path / name), "--bind", "tcp://127.0.0.1:0", "--json"]
        proc = subprocess.Popen(
            [*MESH, *args, *(["--seed", seed] if seed else [])],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        return proc, str(json.loads(proc.stdout.readline())["endpoint"])

    first, seed = member("one", None)
    second, _ = member("two", seed)
    procs = [first, second]
    paths, versions = 30, 10

    async def main() -> None:
        nonlocal second
        async with irismesh.Node(keyring=keys, seeds=[seed]) as node:
            await node.wait_for_members("_memory", 2, timeout=20)
            for version in range(versions):
                if version == versions // 2:
                    second.send_signal(signal.SIGKILL)  # mid-stream, nothing said
                    second.wait(timeout=10)
                for path in range(paths):
                    await node.publish(f"news.{path}", b"%d" % version, retain=True, timeout=10)
            second, _ = member("two", seed)  # back on its database; it catches up
            procs.append(second)
            await node.wait_for_members("_memory", 2, timeout=20)
            found = await node.reread("news.#", timeout=10)
            assert sorted(m.payload for m in found) == [b"%d" % (versions - 1)] * paths
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
            deadline = asyncio.get_running_loop().time() + 20
            while True:  # until membership has the dead one out and the other answers alone
                try:
                    alone = await node.reread("news.#", timeout=2)
                    if len(alone) == paths:
                        break
                except irismesh.MeshError:
                    await asyncio.sleep(0.05)  # no memory member known alive yet: look again
                assert asyncio.get_running_loop().time() < deadline, "no answer from the other"
            assert sorted(m.payload for m in alone) == [b"%d" % (versions - 1)] * paths

    try:
        asyncio.run(asyncio.wait_for(main(), 90))
    finally:
        kill_all(procs)
