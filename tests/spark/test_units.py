"""Figures as a person reads them, and the bucket that fits a span (pure: no Spark)."""

from __future__ import annotations

import math

import pytest

from irismesh.spark_telemetry import units


@pytest.mark.parametrize(
    ("micros", "text"),
    [(0, "0 us"), (850, "850 us"), (999.4, "999 us"), (999.6, "1.00 ms"), (1234, "1.23 ms"),
     (44_000, "44.0 ms"), (999_999, "1.00 s"), (1_500_000, "1.50 s"), (75e6, "1 min 15 s"),
     (4e9, "1 h 06 min")],
)  # fmt: skip
def test_durations(micros: float, text: str) -> None:
    assert units.duration_us(micros) == text


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(12, "12 B"), (1536, "1.50 KiB"), (16 * 2**20, "16.0 MiB"), (54_670_000, "52.1 MiB"),
     (2.5 * 2**30, "2.50 GiB")],
)  # fmt: skip
def test_sizes(nbytes: float, text: str) -> None:
    assert units.size(nbytes) == text


def test_times_counts_and_missing_values() -> None:
    assert units.timestamp(1_700_006_100.25) == "2023-11-14T23:55:00Z"
    assert units.timestamp(1_700_006_100.25, millis=True) == "2023-11-14T23:55:00.250Z"
    assert units.count(54_670_000.0) == "54,670,000"
    assert units.number(0.53333) == "0.53"
    assert units.percent(0.0123) == "1.23 %"
    for missing in (None, math.nan):
        assert units.count(missing) == units.timestamp(missing) == units.MISSING


@pytest.mark.parametrize(
    ("span", "bucket"),
    [(0, 1), (58, 1), (300, 1), (600, 2), (3 * 3600, 60), (24 * 3600, 300), (30 * 86400, 10800)],
)
def test_the_bucket_spreads_the_span_over_at_most_300_points(span: float, bucket: int) -> None:
    assert units.choose_bucket(span) == bucket
    assert span / bucket <= units.MAX_POINTS


def test_bucket_widths_from_the_command_line() -> None:
    assert [units.parse_bucket(t) for t in ("1s", "30 seconds", "5min", "1h", "2 days")] == [
        1, 30, 300, 3600, 172_800,
    ]  # fmt: skip
    for bad in ("", "0s", "7q", "soon", "-1s"):
        with pytest.raises(ValueError, match="bad bucket"):
            units.parse_bucket(bad)
    assert units.bucket_label(300) == "5 min"
