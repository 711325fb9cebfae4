"""The mesh's memory: retained publishes held by memory members, reread by pattern."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from helpers import deadline, memory_members, memory_mesh, wait_until

import irismesh
from irismesh.memory import MemoryStore, message_id
from irismesh.memory.service import MemoryMember, decode_page, encode_latest


@deadline(30)
async def test_a_late_reader_rereads_the_latest_message_of_every_path(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    async with memory_mesh(keys, tmp_path / "m1", tmp_path / "m2") as ((first, second), publisher):
        for round_ in range(5):
            for path in range(40):
                payload = f"story {path} v{round_}".encode()
                await publisher.publish(f"news.{path}", payload, retain=True)
        await publisher.publish("sport.final", b"2-1", retain=True)
        assert publisher.stats["retained"] == 201
        assert publisher.stats.get("retained_underreplicated", 0) == 0
        for member in (first, second):  # each member holds every message
            assert member.stats["memory_messages"] == 201

        reader = irismesh.Node(keyring=keys, seeds=[second.endpoint])
        await reader.start()
        try:
            await reader.wait_for_members("_memory", 2, timeout=10)
            latest = await reader.reread("news.#")
            assert [m.topic for m in latest] == sorted(f"news.{p}" for p in range(40))
            assert all(m.payload.endswith(b"v4") for m in latest)
            three = await reader.reread("news.7", latest=3)
            assert [m.payload for m in three] == [b"story 7 v4", b"story 7 v3", b"story 7 v2"]
            assert three[0].id > three[1].id > three[2].id  # ids are time-ordered
            assert three[0].published_at >= three[1].published_at
            assert [m.payload for m in await reader.reread("*.final")] == [b"2-1"]
            assert await reader.reread("weather.#") == []
            with pytest.raises(irismesh.ConfigurationError):
                await reader.reread("news..x")
        finally:
            await reader.close()


@deadline(30)
async def test_retain_without_a_memory_member_fails_at_once(keys: irismesh.Keyring) -> None:
    async with irismesh.Node(keyring=keys) as node:
        started = time.monotonic()
        with pytest.raises(irismesh.NoResponders):
            await node.publish("news.a", b"x", retain=True)
        with pytest.raises(irismesh.NoResponders):
            await node.reread("news.#")
        assert time.monotonic() - started < 1.0
        assert node.stats["retained_failed"] == 1


@deadline(30)
async def test_a_restarted_member_catches_up_and_then_answers_alone(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    async with memory_mesh(keys, tmp_path / "steady", tmp_path / "flaky") as (
        (steady, flaky),
        publisher,
    ):
        for i in range(20):
            await publisher.publish(f"jobs.{i}", b"before %d" % i, retain=True)
        await flaky.close()  # down while more is published
        for i in range(20, 30):
            await publisher.publish(f"jobs.{i}", b"while down %d" % i, retain=True)
        assert publisher.stats.get("retained_underreplicated", 0) == 0  # one was all there was

        again = irismesh.Node(keyring=keys, memory=tmp_path / "flaky", seeds=[steady.endpoint])
        await again.start()
        try:
            await wait_until(lambda: "caught_up" in again.stats, 10, "the catch-up")
            assert again.stats["caught_up"] == 10
            assert again.stats["memory_messages"] == 30
            await steady.close()
            await publisher.wait_for_members("_memory", 1, timeout=10)
            found = await publisher.reread("jobs.#")
            assert len(found) == 30
            assert {m.payload for m in found} >= {b"while down 25", b"before 3"}
        finally:
            await again.close()


def test_a_member_that_cannot_open_its_store_fails_at_construction(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    with pytest.raises(irismesh.StorageError, match="cannot create its directory"):
        irismesh.Node(keyring=keys, memory=blocker / "memory")


@deadline(30)
async def test_a_long_answer_comes_a_page_at_a_time_and_whole(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """3,000 paths of 400 B (1.2 MB, above a frame's limit) reread through two members."""
    rows = [
        (f"big.{p:05d}", bytes([p % 251]) * 400, 1.0, message_id(b"x" * 16, p)) for p in range(3000)
    ]
    for name in ("one", "two"):
        store = MemoryStore(tmp_path / name, keys)
        store.put_many(rows)
        store.close()
    member = MemoryMember(MemoryStore(tmp_path / "one", keys))
    pages, after = [], None
    while True:
        answer = member.handle(encode_latest("big.#", 1, after))
        assert len(answer) < 1 << 20
        page, after = decode_page(answer)
        pages.append(page)
        if after is None:
            break
    member.close()
    assert len(pages) >= 3
    assert [s.topic for page in pages for s in page] == [r[0] for r in rows]  # no gap, no repeat
    async with memory_mesh(keys, tmp_path / "one", tmp_path / "two") as (_members, reader):
        found = await reader.reread("big.#")
        assert [m.topic for m in found] == [r[0] for r in rows]
        assert all(m.payload == r[1] for m, r in zip(found, rows, strict=True))
        with pytest.raises(irismesh.PayloadTooLarge):
            await reader.publish("big.x", bytes(reader.memory.max_retained + 1), retain=True)


@deadline(60)
async def test_a_rereading_subscriber_gets_the_latest_of_each_path_then_live_without_gap_or_repeat(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    paths, versions, live = 400, 5, 300
    one, two = await memory_members(keys, tmp_path / "one", tmp_path / "two")
    publisher = irismesh.Node(keyring=keys, seeds=[one.endpoint])
    await publisher.start()
    reader = irismesh.Node(keyring=keys, seeds=[one.endpoint])
    await reader.start()
    try:
        await publisher.wait_for_members("_memory", 2, timeout=10)
        await reader.wait_for_members("_memory", 2, timeout=10)

        async def versions_of(share: int) -> None:  # each path's versions in order
            for version in range(versions):
                for path in range(share, paths, 8):
                    await publisher.publish(f"news.{path}", b"%d" % version, retain=True)

        await asyncio.gather(*(versions_of(share) for share in range(8)))
        got: dict[str, list[int]] = {}
        first: list[irismesh.Message] = []

        def take(message: irismesh.Message) -> None:
            if len(first) < paths:
                first.append(message)
            got.setdefault(message.topic, []).append(int(message.payload))

        sub = reader.subscribe("news.#", callback=take, reread=True)
        for i in range(live):  # while the subscriber starts: across the switch
            await publisher.publish(f"news.{i}", b"%d" % versions, retain=True)
            await asyncio.sleep(0.01)
        final = {f"news.{p}": versions if p < live else versions - 1 for p in range(paths)}
        await wait_until(
            lambda: all(got.get(t, [-1])[-1] == v for t, v in final.items()),
            15,
            "every path's last version",
        )
        assert sub.reread_error is None
        # The memory's messages first: the newest of each path, by id, without publisher.
        assert all(m.publisher == "" and m.id is not None for m in first[: paths // 2])
        for topic, seen in got.items():
            assert seen[0] >= versions - 1, (topic, seen)  # nothing older than the latest
            assert seen == list(range(seen[0], final[topic] + 1)), (topic, seen)
        sub.close()
    finally:
        await asyncio.gather(reader.close(), publisher.close(), two.close(), one.close())


@deadline(30)
async def test_a_rereading_subscription_without_a_memory_is_live_and_says_why(
    keys: irismesh.Keyring,
) -> None:
    async with (
        irismesh.Node(keyring=keys) as publisher,
        irismesh.Node(keyring=keys, seeds=[publisher.endpoint]) as reader,
    ):
        sub = reader.subscribe("news.#", reread=True)
        await wait_until(lambda: sub.reread_error is not None, 5, "the failed reread")
        assert isinstance(sub.reread_error, irismesh.NoResponders)
        await publisher.wait_for_subscribers("news.a", 1, timeout=5)
        await publisher.publish("news.a", b"live")
        message = await sub.get(timeout=5)
        assert (message.payload, message.id) == (b"live", None)
        with pytest.raises(irismesh.ConfigurationError):
            reader.subscribe("news.#", reread=0)


@deadline(30)
async def test_a_queued_request_waits_for_a_member_within_its_deadline(
    keys: irismesh.Keyring,
) -> None:
    async with irismesh.Node(keyring=keys) as caller:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(irismesh.RequestTimeout):
            await caller.request("late", b"x", timeout=0.5, queue=True)
        assert 0.45 < loop.time() - started < 2.0
        with pytest.raises(irismesh.NoResponders):  # not queued: at once
            await caller.request("late", b"x", timeout=5)

        waiting = asyncio.ensure_future(caller.request("late", b"hi", timeout=10, queue=True))
        await asyncio.sleep(1.0)  # the cluster is empty for a while
        assert not waiting.done()
        member = irismesh.Node("late", keyring=keys, seeds=[caller.endpoint])
        member.on_request(lambda payload: payload.upper())
        async with member:
            assert await waiting == b"HI"
        assert caller.stats["requests_queued_for_member"] >= 1
