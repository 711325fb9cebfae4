"""Traffic splits through the library: versions, the asyncio API and its blocking mirror.

Real nodes on 127.0.0.1, in this process.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from helpers import wait_until

import irismesh
import irismesh.sync


def test_a_member_version_must_be_one_word(keys: irismesh.Keyring) -> None:
    for bad in ("a b", "a=b", "x" * 33):
        with pytest.raises(irismesh.ConfigurationError, match="bad version"):
            irismesh.Node("db", keyring=keys, version=bad)
    assert irismesh.Node("db", keyring=keys, version="v2").version == "v2"
    assert irismesh.Node("db", keyring=keys).version == ""


def test_set_split_returns_once_every_member_carries_it(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        async with (
            irismesh.Node("db", keyring=keys, version="v1") as one,
            irismesh.Node("db", keyring=keys, version="v2", seeds=[one.endpoint]) as two,
            irismesh.Node(keyring=keys, seeds=[one.endpoint]) as caller,
        ):
            one.on_request(lambda payload: b"v1")
            two.on_request(lambda payload: b"v2")
            await caller.wait_for_members("db", 2, timeout=10)
            assert caller.split("db") is None
            with pytest.raises(irismesh.ConfigurationError):
                await caller.set_split("db", {"v1": 0})
            assert await caller.set_split("db", {"v1": 1, "v2": 3}) == 2
            assert one.split("db") == two.split("db") == {"v1": 1, "v2": 3}
            status = caller.split_status("db")
            assert status.members == {"v1": 1, "v2": 1}
            assert status.other_members == 0
            replies = Counter([await caller.request("db", b"x") for _ in range(400)])
            assert abs(replies[b"v2"] / 400 - 0.75) < 0.1, replies  # 4.6 sd
            assert await caller.clear_split("db") == 2
            await wait_until(lambda: one.split("db") is None, 5, "the clearing at a member")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_blocking_api_mirrors_splits(keys: irismesh.Keyring) -> None:
    with (
        irismesh.sync.Node("db", keyring=keys, version="v1") as one,
        irismesh.sync.Node("db", keyring=keys, version="v2", seeds=[one.endpoint]) as two,
        irismesh.sync.Node(keyring=keys, seeds=[one.endpoint]) as caller,
    ):
        one.on_request(lambda payload: b"v1")
        two.on_request(lambda payload: b"v2")
        assert two.version == "v2"
        caller.wait_for_members("db", 2, timeout=10)
        assert caller.set_split("db", {"v2": 1}) == 2
        assert caller.split("db") == {"v2": 1}
        assert caller.split_status("db").members == {"v2": 1}
        assert {caller.request("db", b"x") for _ in range(50)} == {b"v2"}
        assert caller.clear_split("db") == 2
        assert caller.split("db") is None
