"""The id window that lets a subscription deliver each message id once."""

from __future__ import annotations

from irismesh.patterns.dedup import IdWindow


def test_an_id_is_a_copy_within_the_window_and_new_again_past_it() -> None:
    window = IdWindow(3)
    assert [window.seen(b"a"), window.seen(b"b"), window.seen(b"a")] == [False, False, True]
    assert not window.seen(b"c")
    assert not window.seen(b"d")  # a leaves: the window holds b, c, d
    assert len(window) == 3
    assert window.seen(b"b")
    assert not window.seen(b"a")  # past the window: taken as new
    assert len(window) == 3


def test_the_window_stays_bounded_over_many_ids() -> None:
    window = IdWindow(1000)
    for i in range(100_000):
        assert not window.seen(i.to_bytes(16, "big"))
    assert len(window) == 1000
    assert window.seen((99_999).to_bytes(16, "big"))
    assert not window.seen((0).to_bytes(16, "big"))
