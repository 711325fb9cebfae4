"""The memory's store: retained messages at rest, found again by pattern, sealed, trimmed."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from irismesh import ConfigurationError, Keyring, NoKey, StorageError
from irismesh.memory import MemoryStore, Retention, message_id
from irismesh.memory.store import id_time
from irismesh.security.keyring import ScopeKey

NODE = bytes(range(16))


def ids(n: int, start: float = 1_800_000_000.0) -> list[bytes]:
    """`n` ids of one publisher, a millisecond apart."""
    return [message_id(NODE, i, start + i / 1000) for i in range(n)]


def fill(store: MemoryStore, paths: int, each: int) -> dict[str, list[bytes]]:
    """`each` messages on each of `paths` topics news.<p>; payloads say which."""
    made: dict[str, list[bytes]] = {}
    all_ids = iter(ids(paths * each))
    batch = []
    for round_ in range(each):
        for p in range(paths):
            topic = f"news.{p:04d}"
            msg_id = next(all_ids)
            made.setdefault(topic, []).append(msg_id)
            batch.append((topic, f"{topic}#{round_}".encode(), id_time(msg_id), msg_id))
    assert store.put_many(batch) == paths * each
    return made


@pytest.fixture
def keys() -> Keyring:
    return Keyring.generate()


def test_ids_are_unique_and_ordered_by_time() -> None:
    made = [message_id(NODE, i, 1_800_000_000 + i // 3) for i in range(9)]
    assert len(set(made)) == 9
    assert made == sorted(made)
    assert id_time(made[3]) == 1_800_000_001.0
    other = message_id(bytes(16), 0, 1_800_000_000)
    assert other != made[0]


def test_latest_answers_every_matching_path_newest_first(tmp_path: Path, keys: Keyring) -> None:
    store = MemoryStore(tmp_path, keys)
    made = fill(store, paths=30, each=5)
    store.put("sport.x", b"other scope", 1.0, message_id(NODE, 999, 1.0))

    latest = store.latest("news.#")
    assert [s.topic for s in latest] == sorted(made)
    assert all(s.payload == f"{s.topic}#4".encode() for s in latest)
    assert all(s.id == made[s.topic][-1] for s in latest)

    three = store.latest("news.0007", latest=3)
    assert [s.payload for s in three] == [b"news.0007#4", b"news.0007#3", b"news.0007#2"]
    assert [s.published_at for s in three] == sorted((s.published_at for s in three), reverse=True)

    assert [s.topic for s in store.latest("*.x")] == ["sport.x"]
    assert len(store.latest("#")) == 31
    assert store.latest("weather.#") == []


def test_the_same_message_twice_is_stored_once(tmp_path: Path, keys: Keyring) -> None:
    store = MemoryStore(tmp_path, keys)
    msg_id = message_id(NODE, 1)
    assert store.put("news.a", b"one", 1.0, msg_id)
    assert not store.put("news.a", b"one", 1.0, msg_id)
    assert store.figures()["messages"] == 1
    assert store.stats["duplicates"] == 1


def test_retention_trims_each_path_by_count_bytes_and_age(tmp_path: Path, keys: Keyring) -> None:
    rules = [
        ("news.big.#", Retention(max_per_path=100, max_bytes=250)),
        ("news.#", Retention(max_per_path=3)),
        ("logs.#", Retention(max_per_path=100, max_age=60)),
    ]
    store = MemoryStore(tmp_path, keys, retention=rules)
    fill(store, paths=4, each=10)
    assert store.figures()["messages"] == 12  # 3 kept of each path's 10
    assert store.stats["trimmed_count"] == 28
    assert [s.payload for s in store.latest("news.0001", latest=10)] == [
        b"news.0001#9",
        b"news.0001#8",
        b"news.0001#7",
    ]

    for i, msg_id in enumerate(ids(5, start=1_800_000_100)):
        store.put("news.big.x", bytes(100), id_time(msg_id), msg_id)  # the first rule governs
        assert i < 2 or len(store.latest("news.big.x", latest=10)) == 2
    assert store.stats["trimmed_bytes"] == 3

    now = 1_800_000_000.0
    store.put("logs.a", b"old", now - 61, message_id(NODE, 1, now - 61))
    store.put("logs.a", b"new", now - 1, message_id(NODE, 2, now - 1))
    assert store.expire(now) == 1
    assert [s.payload for s in store.latest("logs.a", latest=5)] == [b"new"]
    assert store.stats["trimmed_age"] == 1


def test_a_reopened_store_holds_the_same_messages(tmp_path: Path, keys: Keyring) -> None:
    store = MemoryStore(tmp_path, keys)
    fill(store, paths=5, each=3)
    before = store.latest("#", latest=3)
    store.close()
    again = MemoryStore(tmp_path, keys)
    assert again.latest("#", latest=3) == before
    assert again.figures()["messages"] == 15


def test_nothing_is_in_clear_on_disk(tmp_path: Path, keys: Keyring) -> None:
    store = MemoryStore(tmp_path, keys)
    store.put("secret.plans.alpha", b"PAYLOAD-IN-CLEAR-0123456789", 1.0, message_id(NODE, 1))
    store.close()
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert on_disk  # the database (and its log) are there
    for clear in (b"PAYLOAD-IN-CLEAR", b"secret", b"plans", b"alpha"):
        assert clear not in on_disk


def test_without_the_key_paths_are_kept_but_not_served(tmp_path: Path, keys: Keyring) -> None:
    store = MemoryStore(tmp_path, keys)
    fill(store, paths=2, each=2)
    store.close()
    stranger = MemoryStore(tmp_path, Keyring.generate())
    assert stranger.latest("#") == []
    assert stranger.stats["paths_locked"] == 2
    with pytest.raises(NoKey):
        MemoryStore(tmp_path / "other", Keyring()).put("news.a", b"x", 1.0, message_id(NODE, 1))


def test_a_rotated_key_reads_the_old_messages_and_seals_new_ones(tmp_path: Path) -> None:
    old = ScopeKey(scope="*", secret=os.urandom(32))
    new = ScopeKey(scope="*", secret=os.urandom(32))
    store = MemoryStore(tmp_path, Keyring([old]))
    store.put("news.a", b"before", 1.0, message_id(NODE, 1, 1.0))
    store.close()
    rotated = MemoryStore(tmp_path, Keyring([new, old]))  # new first: the primary
    rotated.put("news.a", b"after", 2.0, message_id(NODE, 2, 2.0))
    assert [s.payload for s in rotated.latest("news.a", latest=5)] == [b"after", b"before"]
    rotated.close()
    only_new = MemoryStore(tmp_path, Keyring([new]))
    assert [s.payload for s in only_new.latest("news.a", latest=5)] == [b"after"]
    assert only_new.stats["paths_locked"] == 1


def test_bad_input_is_a_clear_error(tmp_path: Path, keys: Keyring) -> None:
    store = MemoryStore(tmp_path, keys)
    with pytest.raises(ConfigurationError):
        store.latest("news..x")
    with pytest.raises(ConfigurationError):
        store.latest("news.#", latest=0)
    with pytest.raises(ConfigurationError):
        store.put("news..a", b"x", 1.0, message_id(NODE, 1))
    with pytest.raises(ConfigurationError):
        store.put("news.a", b"x", 1.0, b"short")
    with pytest.raises(ConfigurationError):
        Retention(max_per_path=0)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="cannot create its directory"):
        MemoryStore(blocker / "memory", keys)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "memory.sqlite3").write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(StorageError, match="not a database"):
        MemoryStore(garbage, keys)


def test_a_full_disk_is_a_storage_error_and_the_store_stays_whole(
    tmp_path: Path, keys: Keyring
) -> None:
    store = MemoryStore(tmp_path, keys, default=Retention(max_per_path=10_000))
    fill(store, paths=3, each=2)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages + 2}")  # the disk is full from here
    batch = [("news.big", os.urandom(4000), 1.0, m) for m in ids(50, start=1_900_000_000)]
    with pytest.raises(StorageError, match="full"):
        store.put_many(batch)
    assert store.figures()["messages"] == 6  # the whole batch rolled back
    assert len(store.latest("news.#")) == 3
    store.close()
    check = sqlite3.connect(tmp_path / "memory.sqlite3")
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)


WRITER = textwrap.dedent(
    """
    import os, sys
    from irismesh import Keyring
    from irismesh.memory import MemoryStore, Retention, message_id
    store = MemoryStore(sys.argv[1], Keyring.load(sys.argv[2]),
                        default=Retention(max_per_path=100_000))
    node = os.urandom(16)
    for i in range(1_000_000):
        store.put(f"jobs.{i % 10}", b"payload %d" % i, 1.0, message_id(node, i))
        print(i, flush=True)  # after put returned: on disk
    """
)


def killed_after(program: str, lines: int, data: Path, keyfile: Path, keys: Keyring) -> set[int]:
    """Run a writer `program` on `data` until it has printed `lines` numbers (each one a write
    it had answered; at most 30 s), SIGKILL it, and return the numbers."""
    keys.save(keyfile)
    writer = subprocess.Popen(
        [sys.executable, "-c", program, str(data), str(keyfile)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    answered: set[int] = set()
    deadline = time.monotonic() + 30
    while len(answered) < lines and time.monotonic() < deadline:
        line = writer.stdout.readline()
        assert line, "the writer ended early"
        answered.add(int(line))
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=10)
    return answered


def test_a_store_killed_mid_write_reopens_whole_with_what_it_acknowledged(
    tmp_path: Path, keys: Keyring
) -> None:
    data = tmp_path / "data"
    acknowledged = max(killed_after(WRITER, 201, data, tmp_path / "keys", keys))  # 0 to 200
    assert acknowledged >= 200

    check = sqlite3.connect(data / "memory.sqlite3")
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()
    store = MemoryStore(data, keys, default=Retention(max_per_path=100_000))
    figures = store.figures()
    assert figures["messages"] >= acknowledged + 1
    every = store.latest("jobs.#", latest=100_000)
    assert len(every) == figures["messages"]
    assert store.stats["messages_unreadable"] == 0
    assert {s.payload for s in every} >= {b"payload %d" % i for i in range(acknowledged + 1)}


MEMBER_WRITER = textwrap.dedent(
    """
    import asyncio, os, sys
    from irismesh import Keyring
    from irismesh.memory import message_id
    from irismesh.memory.service import MemoryMember, encode_store
    from irismesh.memory.store import MemoryStore, Retention

    async def main():
        store = MemoryStore(sys.argv[1], Keyring.load(sys.argv[2]), sync="fsync",
                            default=Retention(max_per_path=100_000))
        member = MemoryMember(store)
        node = os.urandom(16)
        count = iter(range(1_000_000))

        async def writer():
            # One row a request, 32 writers: groups of several requests in one commit.
            for i in count:
                row = [(f"jobs.{i % 10}", b"payload %d" % i, 1.0, message_id(node, i))]
                await member.serve(encode_store(row))
                print(i, flush=True)  # the member answered: on disk

        await asyncio.gather(*(writer() for _ in range(32)))

    asyncio.run(main())
    """
)


def test_a_member_killed_mid_write_group_keeps_every_write_it_answered(
    tmp_path: Path, keys: Keyring
) -> None:
    """A memory member writing groups of concurrent store requests (one commit, one wait
    for the disk, for each group) is SIGKILLed: the database reopens whole and holds every
    row whose request was answered."""
    data = tmp_path / "data"
    answered = killed_after(MEMBER_WRITER, 500, data, tmp_path / "keys", keys)
    assert len(answered) >= 500

    check = sqlite3.connect(data / "memory.sqlite3")
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()
    store = MemoryStore(data, keys, default=Retention(max_per_path=100_000))
    every = store.latest("jobs.#", latest=100_000)
    assert store.stats["messages_unreadable"] == 0
    assert {s.payload for s in every} >= {b"payload %d" % i for i in answered}
    store.close()


def test_since_pages_every_newer_message_oldest_first(tmp_path: Path, keys: Keyring) -> None:
    store = MemoryStore(tmp_path, keys, default=Retention(max_per_path=1000))
    made = fill(store, paths=10, each=30)  # 300 messages of about 11 bytes
    every = sorted(i for ids_ in made.values() for i in ids_)
    assert store.newest_id() == every[-1]
    got: list[bytes] = []
    after, pages = b"", 0
    while True:
        page, following = store.since(after, max_bytes=400)
        pages += 1
        got.extend(s.id for s in page)
        if following is None:
            break
        after = following
    assert got == every  # oldest first, none missed, none twice
    assert pages >= 8
    assert store.since(every[-1], 400) == ([], None)
    assert MemoryStore(tmp_path / "empty", keys).newest_id() is None


def test_with_os_sync_checkpoints_run_off_the_writer_and_the_log_starts_over(
    tmp_path: Path, keys: Keyring
) -> None:
    store = MemoryStore(tmp_path, keys, sync="os")
    backstop = store.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
    assert backstop > 1000  # the writer's own checkpoints are only a backstop
    all_ids = iter(ids(3001))
    for round_ in range(30):  # random paths: a few dozen pages of log per commit
        batch = []
        for i in range(100):
            msg_id = next(all_ids)
            batch.append((f"news.{(round_ * 37 + i * 101) % 500:04d}", b"x" * 100, 0.0, msg_id))
        store.put_many(batch)
    deadline = time.monotonic() + 10
    while store.stats["checkpoints"] <= store.stats["checkpoints_unfinished"]:
        assert time.monotonic() < deadline, dict(store.stats)
        time.sleep(0.01)
    store.put(f"news.{0:04d}", b"after", 0.0, next(all_ids))
    other = sqlite3.connect(store.path)
    _busy, log, _copied = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    other.close()
    assert log < 100  # the log started over from its beginning after the checkpoint
    store.close()
    reopened = MemoryStore(tmp_path, keys, sync="fsync")
    assert len(reopened.latest("news.#", 16)) == 3001  # all of it, whatever was checkpointed
    assert reopened.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    reopened.close()
