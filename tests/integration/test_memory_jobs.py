"""Durable work queues: jobs held by the memory until a member of their cluster handled them."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
from helpers import deadline, memory_members, memory_mesh, wait_until

import irismesh
from irismesh._core.frames import Kind
from irismesh.errors import ProtocolError
from irismesh.memory import MemoryStore, message_id
from irismesh.memory.jobs import TOMBSTONE_KEEP, Job, Tombstone
from irismesh.memory.service import (
    MAX_ATTEMPTS,
    PAGE_BYTES,
    MemoryMember,
    NodeMemory,
    _decode_jobs,
    _read_finished,
)
from irismesh.memory.store import clock_id

BIG = 100 << 10  # a job's payload: 40 of them are four times a reply's limit


async def memories(keys: irismesh.Keyring, tmp_path: Path, count: int) -> list[irismesh.Node]:
    return await memory_members(keys, *(tmp_path / f"m{i}" for i in range(count)))


def big_jobs(memory: NodeMemory, count: int) -> list[Job]:
    now = time.time()
    return [
        Job(clock_id(memory.clock, memory.physical()), "work", bytes([i]) * BIG, now, now + 3600)
        for i in range(count)
    ]


def worker(keys: irismesh.Keyring, seed: str, handled: Counter[bytes]) -> irismesh.Node:
    node = irismesh.Node("work", keyring=keys, seeds=[seed])

    @node.on_request
    def handle(payload: bytes) -> bytes:
        handled[payload] += 1
        return b"ok"

    return node


@asynccontextmanager
async def worked_mesh(
    keys: irismesh.Keyring, tmp_path: Path
) -> AsyncIterator[tuple[list[Any], Any, Counter[bytes]]]:
    """Two memory members, a producer, and a worker of "work": what it handled, counted."""
    handled: Counter[bytes] = Counter()
    async with (
        memory_mesh(keys, tmp_path / "m0", tmp_path / "m1") as (held, producer),
        worker(keys, held[0].endpoint, handled),
    ):
        yield held, producer, handled


@deadline(40)
async def test_every_job_is_handled_once_and_then_forgotten(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    async with worked_mesh(keys, tmp_path) as (held, producer, handled):
        ids = [await producer.enqueue("work", b"job %d" % i) for i in range(50)]
        assert len(set(ids)) == 50
        await wait_until(lambda: len(handled) == 50, 15, "every job handled")
        assert set(handled.values()) == {1}
        await wait_until(
            lambda: all(m.stats.get("memory_jobs_pending", 1) == 0 for m in held),
            10,
            "every memory member to forget the jobs",
        )
        with pytest.raises(irismesh.ConfigurationError):
            await producer.enqueue("work", b"x", expiry=0)


@deadline(40)
async def test_jobs_wait_for_a_member_and_expire_if_none_comes(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    handled: Counter[bytes] = Counter()
    async with memory_mesh(keys, tmp_path / "m0") as ([memory], producer):
        await producer.enqueue("work", b"short-lived", expiry=0.3)
        for i in range(5):
            await producer.enqueue("work", b"patient %d" % i)
        await wait_until(lambda: memory.stats.get("memory_jobs_expired", 0) == 1, 10, "the expiry")
        assert memory.stats["memory_jobs_pending"] == 5
        member = worker(keys, memory.endpoint, handled)
        async with member:
            await wait_until(lambda: len(handled) == 5, 15, "the waiting jobs handled")
        assert b"short-lived" not in handled


@deadline(40)
async def test_a_job_whose_handler_keeps_failing_is_set_aside(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    [memory] = await memories(keys, tmp_path, 1)
    runs = 0
    member = irismesh.Node("work", keyring=keys, seeds=[memory.endpoint])

    @member.on_request
    def handle(payload: bytes) -> bytes:
        nonlocal runs
        runs += 1
        raise ValueError("cannot do it")

    await member.start()
    try:
        await memory.wait_for_members("work", 1, timeout=10)
        await memory.enqueue("work", b"doomed")
        await wait_until(
            lambda: memory.stats.get("memory_jobs_dead", 0) == 1, 15, "the dead letter"
        )
        assert runs == MAX_ATTEMPTS
        assert memory.stats["jobs_failed"] == MAX_ATTEMPTS
    finally:
        await asyncio.gather(member.close(), memory.close())


@deadline(40)
async def test_another_memory_member_takes_over_when_the_dispatcher_leaves(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    held = await memories(keys, tmp_path, 2)
    handled: Counter[bytes] = Counter()
    gate = asyncio.Event()  # jobs after the first five wait until the dispatcher is gone
    member = irismesh.Node("work", keyring=keys, seeds=[held[0].endpoint])

    @member.on_request
    async def handle(payload: bytes) -> bytes:
        if int(payload.split()[1]) >= 5:
            await gate.wait()
        handled[payload] += 1
        return b"ok"

    await member.start()
    producer = irismesh.Node(keyring=keys, seeds=[held[0].endpoint])
    await producer.start()
    try:
        await producer.wait_for_members("_memory", 2, timeout=10)
        await held[1].wait_for_members("_memory", 1, timeout=10)
        dispatcher = min(held, key=lambda m: m.node_id)
        other = max(held, key=lambda m: m.node_id)
        for i in range(40):
            await producer.enqueue("work", b"job %d" % i)
        await wait_until(lambda: len(handled) == 5, 15, "the first jobs handled")
        await dispatcher.close()
        gate.set()
        # The other hands out what was left: its store forgets each job (in its thread)
        # just before its dispatcher counts it done (on the loop): wait for both.
        await wait_until(
            lambda: (
                other.stats.get("memory_jobs_pending", 1) == 0
                and other.stats.get("jobs_done", 0) > 0
            ),
            20,
            "the other's turn",
        )
        assert len(handled) == 40
        # At least once: a job in hand as its dispatcher left may run twice, not more.
        assert max(handled.values()) <= 2
    finally:
        await asyncio.gather(member.close(), producer.close(), *(m.close() for m in held))


async def dispatcher_and_other(held: list[irismesh.Node]) -> tuple[irismesh.Node, irismesh.Node]:
    """Once the memory members see each other: the one that dispatches (the lowest id), and
    the other."""
    for each in held:
        await each.wait_for_members("_memory", 1, timeout=10)
    return min(held, key=lambda m: m.node_id), max(held, key=lambda m: m.node_id)


@deadline(40)
async def test_a_job_only_a_member_that_does_not_dispatch_holds_is_handed_out(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """An enqueue can reach only the members that do not dispatch (the dispatcher had just
    started again and copied their jobs a moment before the enqueuer knew of it): the
    dispatcher takes such a job on from them, and tells them to forget one it finished; they
    drop one past its expiry themselves."""
    async with worked_mesh(keys, tmp_path) as (held, producer, handled):
        dispatcher, other = await dispatcher_and_other(held)
        await producer.enqueue("work", b"held by both")
        await wait_until(lambda: handled[b"held by both"] == 1, 15, "the first job handled")
        gathered = dispatcher.stats.get("jobs_gathered", 0)
        memory, mine = other.memory, dispatcher.memory.member
        member = memory.member
        assert member is not None
        assert mine is not None
        now = time.time()
        only_there, done_here, expired = (
            Job(clock_id(memory.clock, memory.physical()), "work", payload, now, now + expiry)
            for payload, expiry in (
                (b"held by the other only", 3600),
                (b"finished, its done missed", 3600),
                (b"expired", -1),
            )
        )
        await mine.run(mine.jobs.finish, [done_here.id], now)
        await member.run(member.jobs.add, [only_there, done_here, expired])
        await wait_until(
            lambda: handled[b"held by the other only"] == 1, 15, "the other's job handled"
        )
        await wait_until(
            lambda: other.stats.get("memory_jobs_pending", 1) == 0, 10, "the other to forget all"
        )
        assert dispatcher.stats["jobs_gathered"] == gathered + 1
        assert handled[b"finished, its done missed"] == handled[b"expired"] == 0
        assert other.stats["memory_jobs_expired"] == 1
        assert set(handled.values()) == {1}


@deadline(40)
async def test_enqueue_without_a_memory_member_fails_at_once(keys: irismesh.Keyring) -> None:
    async with irismesh.Node(keyring=keys) as node:
        with pytest.raises(irismesh.NoResponders):
            await node.enqueue("work", b"x")
        assert node.stats["jobs_enqueue_failed"] == 1


@deadline(40)
async def test_on_queued_runs_the_jobs_and_on_request_the_requests(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    held = await memories(keys, tmp_path, 1)
    producer = await irismesh.Node(keyring=keys, seeds=[held[0].endpoint]).start()
    member = irismesh.Node("work", keyring=keys, seeds=[held[0].endpoint])
    jobs: list[bytes] = []

    @member.on_request
    def request(payload: bytes) -> bytes:
        return b"request " + payload

    @member.on_queued
    async def job(payload: bytes) -> bytes:
        jobs.append(payload)
        return b"done"

    await member.start()
    try:
        await producer.wait_for_members("_memory", 1, timeout=10)
        await producer.enqueue("work", b"job 1")
        await wait_until(lambda: jobs == [b"job 1"], 10, "the job to run in on_queued")
        await producer.wait_for_members("work", 1, timeout=10)
        assert await producer.request("work", b"x") == b"request x"
        assert jobs == [b"job 1"]
        assert member.stats["jobs_run"] == 1
    finally:
        await asyncio.gather(member.close(), producer.close(), *(m.close() for m in held))


@deadline(40)
async def test_a_job_handed_out_again_to_its_member_is_answered_without_running_again(
    keys: irismesh.Keyring,
) -> None:
    """The memory hands a job out again when it never heard the answer: a member that already
    answered it (or still runs it) answers the repeat with the same outcome, unrun."""
    member = await irismesh.Node("work", keyring=keys).start()
    runs: Counter[bytes] = Counter()
    release = asyncio.Event()

    @member.on_request
    async def handle(payload: bytes) -> bytes:
        runs[payload] += 1
        if payload == b"slow":
            await release.wait()
        return b"answer to " + payload

    dispatcher = await irismesh.Node(keyring=keys, seeds=[member.endpoint]).start()
    try:
        await dispatcher.wait_for_members("work", 1, timeout=10)
        first, again = bytes(range(16)), bytes(range(1, 17))
        assert await dispatcher._dispatch_job("work", first, b"fast", 5) == b"answer to fast"
        assert await dispatcher._dispatch_job("work", first, b"fast", 5) == b"answer to fast"
        # A repeat while the first run is still going waits for that run's answer.
        running = [
            asyncio.ensure_future(dispatcher._dispatch_job("work", again, b"slow", 5))
            for _ in range(2)
        ]
        await wait_until(lambda: runs[b"slow"] == 1, 5, "the slow job to start")
        await wait_until(lambda: member.stats["jobs_absorbed"] == 2, 5, "the repeat to wait")
        release.set()
        assert await asyncio.gather(*running) == [b"answer to slow"] * 2
        assert runs == Counter({b"fast": 1, b"slow": 1})
        assert member.stats["jobs_run"] == 2
        # A request is not a job: the same payload runs every time.
        await dispatcher.request("work", b"fast")
        assert runs[b"fast"] == 2
        # A job frame too short to carry its id is an error for the sender, counted.
        with pytest.raises(irismesh.RemoteError):
            await dispatcher._queued_request("work", b"short", 5, None, int(Kind.JOB))
        assert member.stats["jobs_malformed"] == 1
    finally:
        await asyncio.gather(dispatcher.close(), member.close())


@deadline(30)
async def test_a_jobs_answer_comes_a_page_at_a_time_and_whole(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """40 jobs of 100 KiB: page after page below the reply limit, no gap, no repeat; the
    previous release's request still gets them all at once; bad pages are dropped, counted."""
    member = MemoryMember(MemoryStore(tmp_path / "one", keys))
    now = time.time()
    jobs = [
        Job(message_id(b"jobs", i, now), "work", bytes([i]) * BIG, now, now + 60) for i in range(40)
    ]
    member.jobs.add(jobs)
    member.jobs.finish([message_id(b"done", 0, now)], now)
    pages: list[list[Job]] = []
    finished: list[bytes] = []
    after = None
    while len(pages) <= len(jobs):  # at least one job a page
        answer = member.handle(msgpack.packb(["jobs", now - 60, after]))
        assert len(answer) < 1 << 20
        page, done, after = _decode_jobs(answer)
        pages.append(page)
        finished.extend(done)
        if after is None:
            break
    assert len(pages) >= 8
    assert [job.id for page in pages for job in page] == [job.id for job in jobs]
    assert all(got.payload == job.payload for got, job in zip(pages[0], jobs, strict=False))
    assert finished == [message_id(b"done", 0, now)]  # with the first page only
    # The previous release's request: what fits in a page, the rest for a later look.
    whole = member.handle(msgpack.packb(["jobs", now - 60]))
    rows, _done = msgpack.unpackb(whole)
    assert len(whole) <= PAGE_BYTES
    assert [row[0] for row in rows] == [job.id for job in jobs[: len(rows)]]
    assert member.figures()["jobs_answers_truncated"] == 1
    bad_requests = (
        ["jobs", now, b"short"],
        ["jobs", now, 5],
        ["jobs", "x", None],
        ["jobs", 1, 2, 3],
    )
    for bad in bad_requests:
        with pytest.raises(irismesh.ConfigurationError):
            member.handle(msgpack.packb(bad))
    assert member.figures()["requests_malformed"] == 4
    for answer in (
        b"\xc1",
        msgpack.packb([[], [], b"short"]),
        msgpack.packb([[[b"x", "work"]], []]),
        msgpack.packb([[], 5, None]),
        msgpack.packb([[]]),
    ):
        with pytest.raises(ProtocolError):
            _decode_jobs(answer)
    member.close()


@deadline(40)
async def test_a_restarted_member_catches_up_on_jobs_past_the_reply_limit(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """Jobs enqueued while a member was away, four times a reply's limit together: it copies
    them all when it starts again, a page at a time."""
    held = await memories(keys, tmp_path, 2)
    try:
        first, second = held
        await first.wait_for_members("_memory", 1, timeout=10)
        await second.close()
        member = first.memory.member
        assert member is not None
        await member.run(member.jobs.add, big_jobs(first.memory, 40))
        held[1] = back = irismesh.Node(keyring=keys, memory=tmp_path / "m1", seeds=[first.endpoint])
        await back.start()
        # Copied as it started, or taken on as it began dispatching (its id the lower).
        await wait_until(
            lambda: back.stats.get("jobs_caught_up", 0) + back.stats.get("jobs_gathered", 0) == 40,
            20,
            "every job copied",
        )
        assert back.stats["memory_jobs_pending"] == 40
        assert back.stats.get("memory_answers_malformed", 0) == 0
    finally:
        await asyncio.gather(*(m.close() for m in held))


@deadline(40)
async def test_jobs_past_the_reply_limit_only_a_member_that_does_not_dispatch_holds_are_handed_out(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    async with worked_mesh(keys, tmp_path) as (held, _producer, handled):
        dispatcher, other = await dispatcher_and_other(held)
        # Their catch-up done: the dispatcher's must not be what copies the jobs.
        await wait_until(
            lambda: all(m._catching_up is None or m._catching_up.done() for m in held),
            10,
            "the members' catch-up",
        )
        gathered = dispatcher.stats.get("jobs_gathered", 0)
        member = other.memory.member
        assert member is not None
        await member.run(member.jobs.add, big_jobs(other.memory, 40))
        await wait_until(lambda: len(handled) == 40, 20, "every job handled")
        await wait_until(
            lambda: other.stats.get("memory_jobs_pending", 1) == 0, 10, "the other to forget all"
        )
        assert dispatcher.stats["jobs_gathered"] == gathered + 40
        assert set(handled.values()) == {1}


@deadline(40)
async def test_a_member_of_the_previous_release_is_still_copied_from(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """A member that knows only the "jobs" request without a page's cursor refuses the new
    one: a starting member asks it again the way it knows."""
    [old] = await memories(keys, tmp_path, 1)
    member = old.memory.member
    assert member is not None
    handle = member.handle

    def previous_release(payload: bytes) -> bytes:
        request = msgpack.unpackb(payload)
        if request[0] == "finished" or (request[0] == "jobs" and len(request) != 2):
            raise irismesh.ConfigurationError(f"unknown memory request {request[0]!r}")
        return handle(payload)

    member.handle = previous_release  # type: ignore[method-assign]
    await member.run(member.jobs.add, big_jobs(old.memory, 5))
    finished = [Job(message_id(b"done", i, time.time()), "work", b"", 0, 0) for i in range(3)]
    await member.run(member.jobs.finish, [job.id for job in finished], time.time())
    new = irismesh.Node(keyring=keys, memory=tmp_path / "new", seeds=[old.endpoint])
    try:
        await new.start()
        await wait_until(lambda: new.stats.get("memory_jobs_pending", 0) == 5, 20, "the copies")
        await asyncio.wait_for(new.caught_up(), 20)
        learnt = new.memory.member
        assert learnt is not None
        ids = [job.id for job in finished]
        assert await learnt.run(learnt.jobs.finished, ids) == ids
        assert new.stats.get("memory_answers_malformed", 0) == 0
        assert new.stats.get("jobs_catch_up_incomplete", 0) == 0
    finally:
        await asyncio.gather(new.close(), old.close())


TOMBSTONES = 150_000  # about two and a half times what one answer of ids could carry


def week_of_tombstones(count: int, now: float) -> list[Tombstone]:
    """`count` finished jobs, oldest first, spread over the last six days."""
    step = 6 * 24 * 3600 / count
    start = now - 6 * 24 * 3600
    return [Tombstone(start + i * step, message_id(b"done", i, now)) for i in range(count)]


async def tombstones_held(node: irismesh.Node) -> list[Tombstone]:
    member = node.memory.member
    assert member is not None
    return await member.run(member.jobs.tombstones, 0.0, TOMBSTONES + 1)


@deadline(40)
async def test_a_week_of_tombstones_comes_a_page_at_a_time_and_a_starting_member_learns_all(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """150,000 jobs finished in a week: every answer within a page, and a member that
    starts learns every one of them (with the time it was finished) and copies the jobs."""
    [first] = await memories(keys, tmp_path, 1)
    fresh = None
    try:
        member = first.memory.member
        assert member is not None
        now = time.time()
        stones = week_of_tombstones(TOMBSTONES, now)
        await member.run(member.jobs.finished_at, stones, now)
        jobs = big_jobs(first.memory, 8)  # 800 KiB: two pages of jobs
        await member.run(member.jobs.add, jobs)
        learnt: list[Tombstone] = []
        mark = None
        for _page in range(TOMBSTONES // 1000):  # at least 1,000 a page
            answer = await member.serve(msgpack.packb(["finished", now - TOMBSTONE_KEEP, mark]))
            assert len(answer) <= PAGE_BYTES
            _none, page, following = _read_finished(answer, now)
            learnt.extend(page)
            if following is None:
                break
            mark = list(following)
        assert learnt == stones
        after = None
        for _page in range(len(jobs)):
            answer = await member.serve(msgpack.packb(["jobs", now - TOMBSTONE_KEEP, after]))
            assert len(answer) <= PAGE_BYTES
            _rows, _done, after = _decode_jobs(answer)
            if after is None:
                break
        assert after is None

        fresh = irismesh.Node(keyring=keys, memory=tmp_path / "fresh", seeds=[first.endpoint])
        await fresh.start()
        await asyncio.wait_for(fresh.caught_up(), 30)
        assert await tombstones_held(fresh) == stones
        assert fresh.stats["memory_jobs_pending"] == len(jobs)
        assert fresh.stats.get("jobs_catch_up_incomplete", 0) == 0
        assert fresh.stats.get("memory_answers_malformed", 0) == 0
        assert member.figures().get("jobs_answers_truncated", 0) == 1  # the first "jobs" page
    finally:
        await asyncio.gather(first.close(), *([fresh.close()] if fresh else []))


@deadline(30)
async def test_the_older_forms_of_jobs_answer_within_a_page_with_the_newest_finished_ids(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """A request of a previous release for jobs and finished ids at once, to a member that
    finished more than a page of them: the jobs and the newest ids that fit, counted."""
    member = MemoryMember(MemoryStore(tmp_path / "one", keys))
    try:
        now = time.time()
        stones = week_of_tombstones(40_000, now)
        ids = [t.id for t in stones]
        member.jobs.finished_at(stones, now)
        small = [
            Job(message_id(b"jobs", i, now), "work", bytes([i]) * 1000, now, now + 60)
            for i in range(3)
        ]
        member.jobs.add(small)
        since = now - TOMBSTONE_KEEP

        def ask(request: list[Any]) -> list[Any]:
            answer = member.handle(msgpack.packb(request))
            assert len(answer) <= PAGE_BYTES
            unpacked: list[Any] = msgpack.unpackb(answer)
            return unpacked

        rows, done = ask(["jobs", since])  # the previous release's: all at once
        assert [row[0] for row in rows] == [job.id for job in small]
        assert 20_000 < len(done) < len(ids)
        assert done == ids[-len(done) :]
        rows, done, following = ask(["jobs", since, None])  # paged, ids with the first page
        assert [row[0] for row in rows] == [job.id for job in small]
        assert following is None
        assert 10_000 < len(done) <= PAGE_BYTES // 2 // 18
        assert done == ids[-len(done) :]
        assert ask(["jobs", now + 1, None])[1] == []  # none since then: nothing left out
        assert member.figures()["jobs_answers_truncated"] == 2
        # A first job larger than the room the ids leave takes it from the oldest of them.
        large = Job(message_id(b"jobs", 9, now), "work", b"x" * (400 << 10), now, now + 60)
        member.jobs.add([large])
        rows, done, following = ask(["jobs", since, small[-1].id])
        assert [row[0] for row in rows] == [large.id]
        assert done == []
        rows, done, following = ask(["jobs", since, None])
        assert [row[0] for row in rows] == [job.id for job in small]
        rows, done = ask(["jobs", since])
        assert len(rows) == 4
        assert 0 < len(done) < 10_000
        assert done == ids[-len(done) :]
        assert member.figures()["jobs_answers_truncated"] == 4
    finally:
        member.close()


@deadline(30)
async def test_a_malformed_tombstone_cursor_or_answer_is_refused_and_counted(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    """A "finished" request with a bad cursor is refused (the caller's error), counted; a
    starting member drops a bad answer, counts it, learns from the others and says it
    stopped short; a member of a previous release is asked the way it knows."""
    source = MemoryMember(MemoryStore(tmp_path / "source", keys))
    old = MemoryMember(MemoryStore(tmp_path / "old", keys))
    own = MemoryMember(MemoryStore(tmp_path / "own", keys))
    try:
        now = time.time()
        job_id = message_id(b"done", 0, now)
        for bad in (
            [1.0, b"short"],
            [float("nan"), job_id],
            [1.0, job_id, 2],
            5,
            [None, job_id],
        ):
            with pytest.raises(irismesh.ConfigurationError):
                source.handle(msgpack.packb(["finished", now - 60, bad]))
        assert source.figures()["requests_malformed"] == 5

        stones = week_of_tombstones(40_000, now)
        source.jobs.finished_at(stones, now)
        old_stones = week_of_tombstones(3, now - 1)
        old.jobs.finished_at(old_stones[:2], now)
        old.jobs.add(
            [
                Job(message_id(b"old", 0, now), "work", b"j", now, now + 60),
                Job(old_stones[2].id, "work", b"finished here", now, now + 60),
            ]
        )
        source.jobs.finished_at(old_stones[2:], now)  # finished: the copy does not keep it

        async def survey(
            payload: bytes, _timeout: float | None
        ) -> tuple[dict[str, bytes], dict[str, irismesh.MeshError], list[str]]:
            request = msgpack.unpackb(payload)
            answers = {"source": await source.serve(payload)}
            if hostile:
                answers["garbage"] = b"\xc1"
            errors: dict[str, irismesh.MeshError] = {}
            if request[0] == "jobs" and len(request) == 2:
                answers["old"] = await old.serve(payload)
            else:
                errors["old"] = irismesh.RemoteError("_memory", "ConfigurationError", "unknown")
            if hostile and request[0] == "finished" and request[2] is not None:  # back to the start
                answers["backwards"] = msgpack.packb([[], [0.0, job_id]])
            return answers, errors, []

        hostile = True
        for answer in (
            b"\xc1",
            msgpack.packb([[None], None]),
            msgpack.packb([[[1.0, b"short"]], None]),
            msgpack.packb([[], [1.0, job_id], 3]),
            msgpack.packb([[], "next"]),
        ):
            with pytest.raises(ProtocolError):
                _read_finished(answer, now)
        memory = NodeMemory(b"\x01" * 16, survey, member=own)
        assert await memory.catch_up_jobs(timeout=5) == 1
        # The source's with their times; the old member's as of when they were learnt.
        learnt = own.jobs.tombstones(0.0, 50_000)
        assert [t for t in learnt if t.done_at < now] == sorted([*stones, old_stones[2]])
        assert own.jobs.finished([t.id for t in old_stones]) == [t.id for t in old_stones]
        assert own.figures()["jobs_pending"] == 1
        assert memory.stats["memory_answers_malformed"] >= 3
        assert memory.stats["jobs_catch_up_incomplete"] == 1
        hostile = False  # the old member still refuses every paged request: that is no loss
        assert await memory.catch_up_jobs(timeout=5) == 0
        assert memory.stats["jobs_catch_up_incomplete"] == 1
    finally:
        for each in (source, old, own):
            each.close()
