"""Node.use_keyring and reload_keyring on a running node (the rotation itself is in
tests/core/test_rotation.py and, with real processes, tests/e2e/test_rotation.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import wait_until

import irismesh
from irismesh import ConfigurationError, Keyring


def test_a_keyring_without_a_served_clusters_key_is_refused_and_the_keys_kept() -> None:
    async def main() -> None:
        keys = Keyring.generate(["db"])
        async with irismesh.Node("db", keyring=keys, discovery=False) as node:
            with pytest.raises(ConfigurationError, match="no key for cluster 'db'"):
                node.use_keyring(Keyring.generate(["cache"]))
            assert node.keyring == keys
            with pytest.raises(ConfigurationError, match="came from no file"):
                node.reload_keyring()

    asyncio.run(main())


def test_a_node_takes_its_files_new_keys_by_itself(tmp_path: Path) -> None:
    path = tmp_path / "mesh.keys"
    Keyring.generate(["*"]).save(path)

    async def main() -> None:
        keys = Keyring.load(path)
        async with (
            irismesh.Node("db", keyring=keys, discovery=False) as member,
            irismesh.Node(keyring=keys, seeds=[member.endpoint], discovery=False) as caller,
        ):
            member.on_request(lambda payload: payload)
            await caller.wait_for_members("db", timeout=5)
            assert await caller.request("db", b"x", timeout=5) == b"x"
            rotated = keys.with_key("*", primary=False)
            rotated.save(path, overwrite=True)
            await wait_until(
                lambda: member.keyring == caller.keyring == rotated, 3, "both nodes to reread"
            )
            await wait_until(lambda: member.key_holders()[1].holders, 3, "the caller's new record")
            [first, second] = member.key_holders()
            assert (first.primary, first.holders, first.first) == (True, 1, 1)
            assert (second.primary, second.holders, second.first) == (False, 1, 0)
            assert await caller.request("db", b"y", timeout=5) == b"y"

    asyncio.run(main())


def test_after_a_rotation_a_node_with_only_the_new_key_discovers_the_mesh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("IRISMESH_DISCOVERY")  # discovery on, as by default (tests turn it off)
    old = Keyring.generate(["*"])
    [new] = Keyring.generate(["*"])

    async def main() -> None:
        async with irismesh.Node("echo", keyring=old) as member:
            member.on_request(lambda payload: b"echo:" + payload)
            for step in (old.with_key("*", new.secret, primary=False), Keyring([new])):
                member.use_keyring(step)  # discovery's realm follows the '*' primary
            async with irismesh.Node(keyring=Keyring([new])) as client:
                await client.wait_for_members("echo", timeout=10)
                assert await client.request("echo", b"hi", timeout=5) == b"echo:hi"

    asyncio.run(main())
