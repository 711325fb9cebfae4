"""Rotating the mesh key by editing keyring files, with no process restarted.

Three `mesh node` members and a caller under load, each with a keyring file of its own: the
three steps of SECURITY.md are made by rewriting the four files; every node takes each change
by itself, `mesh keys status` shows each step reach every node, and no request fails. Then a
node holding only the old key can neither call nor serve, and one holding only the new key can.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import MESH, RequestLoad, wait_until

import irismesh
from irismesh import Keyring, ScopeKey

_JOIN = ["--no-discovery"]


class Member:
    """A `mesh node` process: its endpoint, and its stderr lines as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, endpoint: str) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.errors: list[str] = []
        assert proc.stderr is not None
        self._reader = asyncio.ensure_future(self._read(proc.stderr))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            self.errors.append(line.decode().rstrip("\n"))

    def reloads(self) -> int:
        return sum("reloaded" in line for line in self.errors)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self._reader.cancel()


async def spawn(argv: list[str]) -> asyncio.subprocess.Process:
    """`argv` with its output piped, no stdin, and none of the IRISMESH_ settings of the
    environment the tests run in (each command is told what it needs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRISMESH_")}
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )


async def start_member(keys: Path, seeds: list[str], prefix: str = "") -> Member:
    argv = [*MESH, "node", "--cluster", "echo", "--keys", str(keys), "--json", *_JOIN]
    argv += ["--prefix", prefix]
    for seed in seeds:
        argv += ["--seed", seed]
    proc = await spawn(argv)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    assert line, "mesh node did not start"
    return Member(proc, json.loads(line)["endpoint"])


async def mesh(*argv: str) -> tuple[int, str, str]:
    proc = await spawn([*MESH, *argv])
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def key_status(keys: Path, seed: str) -> dict[str, Any]:
    status, out, err = await mesh(
        "keys", "status", "--keys", str(keys), "--seed", seed, *_JOIN, "--wait", "1", "--json"
    )
    assert status == 0, err
    found: dict[str, Any] = json.loads(out)
    return found


def counts(status: dict[str, Any], key: ScopeKey) -> tuple[int, int, int]:
    """(live nodes, nodes holding `key`, nodes using it first) as `mesh keys status` said."""
    [row] = [r for r in status["keys"] if r["key_id"] == key.key_id]
    return status["nodes"], row["holders"], row["first"]


@pytest.mark.skipif(sys.platform == "win32", reason="keyring permissions are POSIX")
def test_three_rotation_steps_by_editing_files_fail_no_request(tmp_path: Path) -> None:
    old, new = (ScopeKey(scope="*", secret=os.urandom(32)) for _ in range(2))
    files = {name: tmp_path / f"{name}.keys" for name in ("m1", "m2", "m3", "caller")}
    for path in files.values():
        Keyring([old]).save(path)
    operator = tmp_path / "operator.keys"  # holds both keys: counts both
    Keyring([new, old]).save(operator)
    steps = [Keyring([old, new]), Keyring([new, old]), Keyring([new])]
    expected = [  # (holders of new, using new first, holders of old) of 4 nodes, after each
        (4, 0, 4),
        (4, 4, 4),
        (4, 4, 0),
    ]

    async def main() -> None:
        members: list[Member] = []
        try:
            first = await start_member(files["m1"], [])
            members.append(first)
            seed = first.endpoint
            for name in ("m2", "m3"):
                members.append(await start_member(files[name], [seed]))
            keyring = Keyring.load(files["caller"])
            async with irismesh.Node(keyring=keyring, seeds=[seed], discovery=False) as caller:
                await caller.wait_for_members("echo", 3, timeout=20)
                load = RequestLoad(caller, "echo", workers=16, timeout=5)
                await load.wait_until(lambda: load.served >= 200, 20, "the load to start")
                progress = []
                timings: list[str] = []
                started = asyncio.get_running_loop().time()
                for step, (keys, (new_held, new_first, old_held)) in enumerate(
                    zip(steps, expected, strict=True), start=1
                ):
                    for path in files.values():  # editing the files: nothing else
                        keys.save(path, overwrite=True)
                    reread = await load.wait_until(
                        lambda step=step, keys=keys: (
                            all(m.reloads() == step for m in members) and caller.keyring == keys
                        ),
                        10,
                        f"every node to reread its file at step {step}",
                    )
                    timings.append(f"step {step}: all reread in {reread:.2f} s")
                    deadline = asyncio.get_running_loop().time() + 15
                    while True:
                        status = await key_status(operator, seed)
                        seen = (counts(status, new), counts(status, old))
                        if seen == ((4, new_held, new_first), (4, old_held, 4 - new_first)):
                            break
                        assert asyncio.get_running_loop().time() < deadline, (step, seen)
                        assert not load.stalled(), f"the load stalled: {load.summary()}"
                    progress.append(seen)
                    before = load.served
                    await load.wait_until(
                        lambda before=before: load.served >= before + 200, 20, "load"
                    )
                await load.stop()
                took = asyncio.get_running_loop().time() - started
                print(
                    f"\nrotation under load: {load.summary()} in {took:.1f} s, "
                    f"{caller.stats.get('requests_resent', 0)} resent, "
                    f"{caller.stats.get('links_down_rekey', 0)} links rekeyed; "
                    + "; ".join(timings)
                )
                assert load.failures == 0, load.summary()
                assert load.wrong == 0, load.summary()
                assert load.served > 800
                assert [e for m in members for e in m.errors if "not reloaded" in e] == []
                # The links under the old key were replaced, not left to run on it.
                assert caller.stats.get("links_down_rekey", 0) >= 3
                assert caller.stats.get("requests_timed_out", 0) == 0

                # A node holding only the old key can neither call nor serve.
                stale, fresh = tmp_path / "stale.keys", tmp_path / "fresh.keys"
                Keyring([old]).save(stale)
                Keyring([new]).save(fresh)
                status, _, err = await mesh(
                    "request", "echo", "hi", "--keys", str(stale), "--seed", seed, *_JOIN,
                    "--wait", "2",
                )  # fmt: skip
                assert status == 1, err
                stale_member = await start_member(stale, [seed], prefix="stale:")
                members.append(stale_member)
                fresh_member = await start_member(fresh, [seed], prefix="fresh:")
                members.append(fresh_member)
                await caller.wait_for_members("echo", 4, timeout=10)
                replies = [await caller.request("echo", b"x", timeout=5) for _ in range(60)]
                assert b"stale:x" not in replies
                assert b"fresh:x" in replies  # the new key's member serves
                assert len(caller.members("echo")) == 4
                # And one holding only the new key calls.
                status, out, err = await mesh(
                    "request", "echo", "hi", "--keys", str(fresh), "--seed", seed, *_JOIN,
                    "--wait", "5",
                )  # fmt: skip
                assert status == 0, err
                assert out.strip().endswith("hi")
        finally:
            for member in members:
                await member.stop()

    asyncio.run(asyncio.wait_for(main(), 150))


def test_sighup_rereads_at_once_and_a_bad_file_is_one_line_while_the_keys_stay(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "member.keys"
    keyring = Keyring.generate(["*"])
    keyring.save(keys)

    async def main() -> None:
        member = await start_member(keys, [])
        try:
            member.proc.send_signal(signal.SIGHUP)  # the file has not changed
            await wait_until(lambda: member.errors, 10, "an answer to SIGHUP")
            assert member.errors == [f"mesh: keyring {keys} unchanged: keys in use kept"]
            os.chmod(keys, 0o644)  # noticed by itself, without a signal
            await wait_until(lambda: len(member.errors) > 1, 10, "the bad file refused")
            [line] = member.errors[1:]
            assert line.startswith(f"mesh: keyring {keys} not reloaded, keeping keys *:")
            assert "chmod 600" in line
            client = tmp_path / "client.keys"
            keyring.save(client)
            status, out, err = await mesh(
                "request", "echo", "hi", "--keys", str(client), "--seed", member.endpoint, *_JOIN
            )
            assert (status, out.strip()) == (0, "hi"), err
            assert member.proc.returncode is None
            assert len(member.errors) == 2  # refused once, not at every poll
        finally:
            await member.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
