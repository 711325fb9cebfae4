"""The members' idempotency window: what it remembers, for how long, and within what bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh._core.replycache import ReplyCache

A, B = b"a" * 16, b"b" * 16


def test_start_finish_get() -> None:
    cache = ReplyCache(10, 1000)
    entry = cache.start((A, 1), expires=5.0)
    assert cache.get((A, 1)) is entry
    assert entry.status == -1  # running
    assert cache.get((B, 1)) is None  # keyed by caller and id
    cache.finish((A, 1), 0, b"done")
    assert (entry.status, entry.payload) == (0, b"done")
    assert cache.size_bytes == 4
    assert len(cache) == 1


def test_finish_of_an_unknown_key_is_ignored() -> None:
    cache = ReplyCache(10, 1000)
    cache.finish((A, 9), 0, b"late")
    assert len(cache) == 0
    assert cache.size_bytes == 0


def test_expire_drops_finished_entries_in_order_up_to_the_first_live_one() -> None:
    cache = ReplyCache(10, 1000)
    for i, expires in enumerate([1.0, 2.0, 5.0, 3.0], start=1):
        cache.start((A, i), expires)
        cache.finish((A, i), 0, b"xx")
    cache.expire(0.5)
    assert len(cache) == 4
    cache.expire(2.0)  # an entry lives while its expiry is in the future
    assert [cache.get((A, i)) is None for i in (1, 2, 3, 4)] == [True, True, False, False]
    cache.expire(4.0)  # entry 4 is due but waits behind entry 3
    assert cache.get((A, 4)) is not None
    cache.expire(5.0)
    assert len(cache) == 0
    assert cache.size_bytes == 0
    assert cache.evicted == 0  # expiry is not eviction


def test_discard_forgets_a_finished_entry_but_not_a_running_one() -> None:
    cache = ReplyCache(10, 1000)
    cache.start((A, 1), 10.0)
    cache.start((A, 2), 10.0)
    cache.finish((A, 1), 0, b"abc")
    cache.discard((A, 1), b"")
    cache.discard((A, 2), b"")  # still running: the resend of it must still find it
    cache.discard((B, 1), b"")  # unknown: ignored
    assert cache.get((A, 1)) is None
    assert cache.get((A, 2)) is not None
    assert cache.size_bytes == 0
    assert cache.evicted == 0


def test_a_running_entry_is_never_expired() -> None:
    cache = ReplyCache(10, 1000)
    cache.start((A, 1), 1.0)
    cache.expire(100.0)
    assert cache.get((A, 1)) is not None
    cache.finish((A, 1), 1, b"err")
    cache.expire(100.0)
    assert cache.get((A, 1)) is None


def test_bounded_by_entries_oldest_evicted_first() -> None:
    cache = ReplyCache(3, 1000)
    for i in range(1, 6):
        cache.start((A, i), 10.0)
        cache.finish((A, i), 0, b"r")
    assert len(cache) == 3
    assert cache.evicted == 2
    assert [cache.get((A, i)) is not None for i in range(1, 6)] == [False, False, True, True, True]
    assert cache.size_bytes == 3


def test_bounded_by_bytes_oldest_evicted_first() -> None:
    cache = ReplyCache(100, 100)
    for i in range(1, 6):
        cache.start((A, i), 10.0)
        cache.finish((A, i), 0, b"x" * 30)
    assert cache.size_bytes <= 100
    assert len(cache) == 3
    assert cache.evicted == 2
    assert cache.get((A, 1)) is None
    assert cache.get((A, 5)) is not None


def test_a_reply_larger_than_the_whole_budget_is_not_kept() -> None:
    cache = ReplyCache(100, 100)
    cache.start((A, 1), 10.0)
    cache.finish((A, 1), 0, b"x" * 101)
    assert cache.size_bytes == 0
    assert len(cache) == 0
    assert cache.evicted == 1


@settings(max_examples=100)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("start"), st.integers(0, 30), st.floats(0, 50)),
            st.tuples(st.just("finish"), st.integers(0, 30), st.integers(0, 60)),
            st.tuples(st.just("expire"), st.integers(0, 0), st.floats(0, 60)),
            st.tuples(st.just("discard"), st.integers(0, 30), st.integers(0, 0)),
        ),
        max_size=200,
    ),
    st.integers(1, 10),
    st.integers(0, 200),
)
def test_bounds_and_byte_count_hold_under_any_use(
    ops: list[tuple[str, int, float]], max_entries: int, max_bytes: int
) -> None:
    """Each key started once and finished at most once, as the engine does."""
    cache = ReplyCache(max_entries, max_bytes)
    started: set[int] = set()
    finished: set[int] = set()
    for op, key, value in ops:
        if op == "start" and key not in started:
            started.add(key)
            cache.start((A, key), value)
        elif op == "finish" and key in started and key not in finished:
            finished.add(key)
            cache.finish((A, key), 0, b"x" * int(value))
        elif op == "expire":
            cache.expire(value)
        elif op == "discard":
            cache.discard((A, key), b"")
        assert len(cache) <= max_entries
        assert cache.size_bytes <= max_bytes
        held = [cache.get((A, k)) for k in started]
        assert cache.size_bytes == sum(len(e.payload) for e in held if e is not None)
        assert len(cache) == sum(e is not None for e in held)


def test_finishing_twice_keeps_the_byte_count_right() -> None:
    cache = ReplyCache(10, 1000)
    cache.start((A, 1), 10.0)
    cache.finish((A, 1), 0, b"x" * 100)
    cache.finish((A, 1), 0, b"y" * 100)
    assert cache.size_bytes == len(cache.get((A, 1)).payload)  # type: ignore[union-attr]
