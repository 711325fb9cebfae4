"""The memory's ids come from hybrid logical clocks: a write made after seeing another orders
after it, whatever the machines' clocks say. The skewed node is a real process whose wall clock
libfaketime moves 10 s ahead (its monotonic clock left alone)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgpack
import pytest
from helpers import MESH, deadline, memory_mesh

import irismesh
from irismesh.memory import MemoryStore, message_id
from irismesh.memory.service import MemoryMember, NodeMemory
from irismesh.memory.store import (
    clock_id,
    clock_state,
    id_time,
    memory_clock,
    observe_id,
    physical_us,
)

FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)


def faketime_lib() -> str | None:
    return next((lib for lib in FAKETIME_LIBS if os.path.exists(lib)), None)


def mesh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MESH, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(
    faketime_lib() is None or shutil.which("faketime") is None,
    reason="libfaketime is not installed (Debian: faketime; .ci/setup installs it)",
)
@deadline(60)
async def test_a_write_after_reading_a_fast_clocks_write_is_reread_everywhere(
    tmp_path: Path,
) -> None:
    keys = irismesh.Keyring.generate()
    keyfile = tmp_path / "mesh.keys"
    keys.save(keyfile)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    fast = dict(
        env,
        LD_PRELOAD=str(faketime_lib()),
        FAKETIME="+10s",
        FAKETIME_DONT_FAKE_MONOTONIC="1",  # timers and deadlines run as they do everywhere
    )
    async with memory_mesh(keys, tmp_path / "m1", tmp_path / "m2") as ((first, second), correct):
        seed = ["--seed", first.endpoint, "--wait", "10"]
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(
            None, lambda: mesh(fast, "publish", *seed, "cfg.mode", "v1", "--retain")
        )
        assert done.returncode == 0, done.stderr

        (v1,) = await correct.reread("cfg.mode")
        assert v1.payload == b"v1"
        # The skew is real: the fast process stamped its publish 10 s ahead of ours.
        assert 9.0 < v1.published_at - time.time() < 11.0
        assert 9.0 < id_time(v1.id) - time.time() < 11.0

        await correct.publish("cfg.mode", b"v2", retain=True)
        for node in (correct, first, second):
            assert [m.payload for m in await node.reread("cfg.mode")] == [b"v2"]
        both = await correct.reread("cfg.mode", latest=2)
        assert [m.payload for m in both] == [b"v2", b"v1"]
        assert both[0].id > both[1].id
        seen = await loop.run_in_executor(
            None, lambda: mesh(fast, "reread", *seed, "cfg.mode", "--json")
        )
        assert seen.returncode == 0, seen.stderr
        assert [json.loads(line)["payload"] for line in seen.stdout.splitlines()] == ["v2"]


@contextlib.asynccontextmanager
async def skewed_pair(
    keys: irismesh.Keyring, tmp_path: Path
) -> AsyncIterator[tuple[irismesh.Node, irismesh.Node]]:
    """Two nodes seeded with a memory member (all in this process); the first one's memory
    clock runs 10 s ahead of the machine's."""
    async with AsyncExitStack() as stack:
        member = await stack.enter_async_context(irismesh.Node(keyring=keys, memory=tmp_path / "m"))
        ahead, other = [
            await stack.enter_async_context(irismesh.Node(keyring=keys, seeds=[member.endpoint]))
            for _ in range(2)
        ]
        ahead.memory.physical = lambda: time.time_ns() // 1000 + 10_000_000
        yield ahead, other


@deadline(60)
async def test_a_skewed_clock_in_process_orders_writes_by_what_each_node_saw(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    async with skewed_pair(keys, tmp_path) as (ahead, behind):
        await behind.wait_for_members("_memory", 1, timeout=10)
        await ahead.wait_for_members("_memory", 1, timeout=10)
        await ahead.publish("cfg.mode", b"v1", retain=True)
        # `behind` has not seen v1: its write is concurrent, and the clocks order it.
        await behind.publish("cfg.other", b"x", retain=True)
        # The member's answer carried its clock, which had taken v1 in.
        await behind.publish("cfg.mode", b"v2", retain=True)
        assert [m.payload for m in await ahead.reread("cfg.mode")] == [b"v2"]
        # A job queued after seeing v2 orders after it too.
        job = await behind.enqueue("work", b"job", expiry=60)
        (v2,) = await behind.reread("cfg.mode")
        assert job > v2.id


def test_ids_of_the_earlier_layout_load_and_interleave_by_time(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    node = os.urandom(16)
    store = MemoryStore(tmp_path, keys)
    old = message_id(node, 1, 1_800_000_000.0)
    store.put("news.a", b"old", 1_800_000_000.0, old)
    store.close()

    store = MemoryStore(tmp_path, keys)  # reopened as an upgraded member finds it
    clock = memory_clock(node)
    before = clock_id(clock, 1_799_999_999_000_000)
    after = clock_id(clock, 1_800_000_001_000_000)
    store.put("news.a", b"new before", 1_799_999_999.0, before)
    store.put("news.a", b"new after", 1_800_000_001.0, after)
    assert [m.payload for m in store.latest("news.a", 3)] == [b"new after", b"old", b"new before"]
    assert id_time(after) == 1_800_000_001.0
    store.close()

    # A clock that sees an old id makes a larger one, though its own time is behind.
    late = memory_clock(b"\1" * 16)
    observe_id(late, old, 1_799_999_990_000_000)  # 10 s behind
    assert clock_id(late, 1_799_999_990_000_000) > old


@deadline(60)
async def test_a_member_that_restarts_starts_its_clock_past_what_it_stored(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    future = message_id(os.urandom(16), 1, time.time() + 30)
    member = MemoryMember(MemoryStore(tmp_path, keys, sync="os"))
    assert member.store.put("news.a", b"ahead", time.time(), future)
    member.close()
    async with irismesh.Node(keyring=keys, memory=tmp_path) as node:
        await node.caught_up()
        await node.publish("news.a", b"later", retain=True)
        assert [m.payload for m in await node.reread("news.a")] == [b"later"]


class FakeMembers:
    """A survey of the memory cluster answered here: one member that refuses any request
    holding a row of a `bad.` topic, and records the rows of every request."""

    def __init__(self) -> None:
        self.requests: list[int] = []
        self.clock = memory_clock(b"m" * 16)

    async def __call__(
        self, payload: bytes, timeout: float | None
    ) -> tuple[dict[str, bytes], dict[str, irismesh.MeshError], list[str]]:
        op, rows = msgpack.unpackb(payload)
        assert op == "store"
        self.requests.append(len(rows))
        if any(row[0].startswith("bad.") for row in rows):
            return {}, {"m": irismesh.RemoteError("_memory", "NoKey", "bad")}, []
        answer = msgpack.packb([len(rows), clock_id(self.clock, physical_us())])
        return {"m": answer}, {}, []


@deadline(60)
async def test_concurrent_retains_share_a_request_and_a_bad_row_fails_alone() -> None:
    members = FakeMembers()
    memory = NodeMemory(b"n" * 16, members)
    ids = await asyncio.gather(*(memory.retain(f"news.{i}", b"x", 1.0) for i in range(64)))
    assert members.requests == [64]  # one turn of the loop, one request
    assert len(set(ids)) == 64
    assert memory.stats["retained"] == 64

    members.requests.clear()
    topics = ["news.a", "bad.b", "news.c"]
    outcomes = await asyncio.gather(
        *(memory.retain(topic, b"x", 1.0) for topic in topics), return_exceptions=True
    )
    assert members.requests == [3, 1, 1, 1]  # refused together, then one by one
    assert isinstance(outcomes[1], irismesh.RemoteError)
    assert all(type(o) is bytes for o in (outcomes[0], outcomes[2]))
    assert memory.stats["retained"] == 66
    assert memory.stats["retained_failed"] == 1
    # The member's clock came back with each answer: the next id is past it.
    assert clock_id(memory.clock, physical_us()) > clock_state(members.clock)


@deadline(60)
async def test_retains_a_turn_apart_share_a_request() -> None:
    """Publishers one reply woke do not all call in the same turn (a publishing loop's
    fairness holds some back a turn): a batch waits one turn more for them, so a member
    with "fsync" commits and waits for the disk once for all of them, not twice."""
    members = FakeMembers()
    memory = NodeMemory(b"n" * 16, members)

    async def publisher(i: int) -> bytes:
        if i % 2:
            await asyncio.sleep(0)  # held back a turn
        return await memory.retain(f"news.{i}", b"x", 1.0)

    await asyncio.gather(*(publisher(i) for i in range(32)))
    assert members.requests == [32]
    for _ in range(3):  # ... and no more than that: three turns apart is another request
        await asyncio.sleep(0)
    members.requests.clear()

    async def late(i: int) -> bytes:
        for _ in range(3 * i):
            await asyncio.sleep(0)
        return await memory.retain(f"news.{i}", b"x", 1.0)

    await asyncio.gather(late(0), late(1))
    assert members.requests == [1, 1]


@deadline(60)
async def test_a_batch_cut_short_by_closing_fails_its_callers() -> None:
    async def never(
        payload: bytes, timeout: float | None
    ) -> tuple[dict[str, bytes], dict[str, irismesh.MeshError], list[str]]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    memory = NodeMemory(b"n" * 16, never)
    publishes = [asyncio.ensure_future(memory.retain(f"news.{i}", b"x", 1.0)) for i in range(3)]
    await asyncio.sleep(0)  # sent or still open (it waits a turn for more rows): either way
    await asyncio.sleep(0)  # closing fails its callers
    memory.close()
    for publish in publishes:
        with pytest.raises(irismesh.Closed):
            await asyncio.wait_for(publish, 5)


def test_an_id_too_far_ahead_is_counted_and_not_adopted() -> None:
    memory = NodeMemory(b"n" * 16, FakeMembers())
    memory.observe(message_id(os.urandom(16), 1, time.time() + 120))
    assert memory.stats["memory_ids_refused_ahead"] == 1
    assert abs(id_time(clock_id(memory.clock, physical_us())) - time.time()) < 5
    memory.observe(message_id(os.urandom(16), 1, time.time() + 30))  # within the bound: adopted
    assert id_time(clock_id(memory.clock, physical_us())) - time.time() > 25


@pytest.mark.parametrize(("sync", "synchronous"), [("fsync", 2), ("os", 1)])
@deadline(60)
async def test_memory_sync_chooses_when_a_commit_waits_for_the_disk(
    keys: irismesh.Keyring, tmp_path: Path, sync: str, synchronous: int
) -> None:
    async with irismesh.Node(keyring=keys, memory=tmp_path, memory_sync=sync) as node:
        member = node.memory.member
        assert member is not None
        # SQLite's synchronous: FULL (2) syncs every commit, NORMAL (1) only checkpoints.
        assert member.store.db.execute("PRAGMA synchronous").fetchone() == (synchronous,)
        await node.publish("news.a", b"kept", retain=True)
        assert [m.payload for m in await node.reread("news.a")] == [b"kept"]


def test_an_unknown_memory_sync_is_refused(keys: irismesh.Keyring, tmp_path: Path) -> None:
    with pytest.raises(irismesh.ConfigurationError, match="sync"):
        irismesh.Node(keyring=keys, memory=tmp_path, memory_sync="never")


@deadline(60)
async def test_a_live_retained_message_advances_the_receivers_clock(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """A subscriber that received a retained message live (not reread) orders its next id
    after it, even when the publisher's clock runs ahead of its own."""
    async with skewed_pair(keys, tmp_path) as (ahead, reader):
        got: list[irismesh.Message] = []
        reader.subscribe("cfg.#", callback=got.append)
        await ahead.wait_for_members("_memory", 1, timeout=10)
        await ahead.wait_for_subscribers("cfg.mode", 1, timeout=10)
        await ahead.publish("cfg.mode", b"v1", retain=True)
        until = time.monotonic() + 10
        while not got:
            assert time.monotonic() < until, "the retained message did not arrive"
            await asyncio.sleep(0.01)
        v1 = got[0].id
        assert v1 is not None
        assert id_time(v1) > time.time() + 5  # from the fast clock
        # No reread, no answer of a member: only the live message told the reader.
        assert clock_id(reader.memory.clock, reader.memory.physical()) > v1
