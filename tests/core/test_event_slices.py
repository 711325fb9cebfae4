"""How the driver cuts a long run of events between flushes: slices of equal length."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from irismesh._driver import EVENT_SLICE, slice_length


@given(st.integers(1, 20 * EVENT_SLICE))
def test_a_run_is_cut_into_as_few_slices_as_fit_and_of_nearly_one_length(count: int) -> None:
    step = slice_length(count)
    lengths = [min(step, count - start) for start in range(0, count, step)]
    assert sum(lengths) == count
    assert max(lengths) <= EVENT_SLICE
    assert len(lengths) == -(-count // EVENT_SLICE)  # no more slices than the limit needs
    assert max(lengths) - min(lengths) < len(lengths)


def test_a_window_of_a_hundred_goes_back_in_two_halves() -> None:
    assert EVENT_SLICE == 64
    assert slice_length(100) == 50
    assert slice_length(64) == 64
    assert slice_length(71) == 36
