"""Figures as a person reads them: UTC ISO 8601 times, us/ms/s, KiB/MiB/GiB, 12,345.

Every number the report shows goes through one of these, so no page, table or chart label
falls back to Python's repr (scientific notation, 15 significant digits, raw bytes). A missing
value (None or NaN) is shown as an en dash by every formatter.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import Any, Final

__all__ = [
    "BUCKETS",
    "MISSING",
    "bucket_label",
    "choose_bucket",
    "count",
    "duration_s",
    "duration_us",
    "is_missing",
    "number",
    "parse_bucket",
    "percent",
    "size",
    "timestamp",
]

MISSING: Final = "\u2013"
# Bucket widths the report chooses from, seconds: each divides the next or a round unit.
BUCKETS: Final = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
                  21600, 43200, 86400)  # fmt: skip
MAX_POINTS: Final = 300
_UNITS: Final = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600,
                 "hour": 3600, "d": 86400, "day": 86400}  # fmt: skip
_BUCKET: Final = re.compile(r"\s*(\d+)\s*([a-z]+?)s?\s*")


def is_missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN, and pandas' NaT and NA
    except (TypeError, ValueError):
        return False


def timestamp(epoch: Any, *, millis: bool = False) -> str:
    """Epoch seconds (or a pandas Timestamp in UTC) as `2023-11-14T23:55:00Z`."""
    if is_missing(epoch):
        return MISSING
    if hasattr(epoch, "timestamp"):  # datetime / pandas Timestamp, naive meaning UTC
        when = epoch if epoch.tzinfo else epoch.replace(tzinfo=dt.UTC)
    else:
        when = dt.datetime.fromtimestamp(float(epoch), dt.UTC)
    spec = "milliseconds" if millis else "seconds"
    return str(when.astimezone(dt.UTC).replace(tzinfo=None).isoformat(timespec=spec)) + "Z"


def duration_us(micros: Any) -> str:
    """Microseconds as `850 us`, `12.3 ms` or `4.20 s`."""
    if is_missing(micros):
        return MISSING
    value = float(micros)
    if abs(value) < 999.5:
        return f"{value:,.0f} us"
    if abs(value) < 999_500:
        return f"{value / 1000:,.{_decimals(value / 1000)}f} ms"
    return duration_s(value / 1e6)


def duration_s(seconds: Any) -> str:
    """Seconds as `850 ms`, `4.20 s`, `12 min 5 s`, `3 h 02 min` or `2 d 4 h`."""
    if is_missing(seconds):
        return MISSING
    value = float(seconds)
    if abs(value) < 0.9995:  # the same boundary as duration_us's, so neither calls back
        return duration_us(value * 1e6)
    if abs(value) < 60:
        return f"{value:.{_decimals(value)}f} s"
    whole = round(value)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    if whole < 86400:
        return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
    return f"{whole // 86400} d {whole % 86400 // 3600} h"


def size(nbytes: Any) -> str:
    """Bytes as `512 B`, `1.5 KiB`, `16.0 MiB`, `2.31 GiB`."""
    if is_missing(nbytes):
        return MISSING
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:,.0f} B"
            return f"{value:,.{_decimals(value)}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(value: Any) -> str:
    """A count (possibly a float that holds one) with thousands separators."""
    return MISSING if is_missing(value) else f"{round(float(value)):,}"


def number(value: Any) -> str:
    """Any other quantity: thousands separators, three significant digits below 100."""
    if is_missing(value):
        return MISSING
    value = float(value)
    if abs(value) >= 100 or value == round(value):
        return f"{value:,.0f}"
    return f"{value:,.{_decimals(value)}f}"


def percent(ratio: Any, *, digits: int = 2) -> str:
    """A ratio as a percentage: 0.0123 -> `1.23 %`."""
    return MISSING if is_missing(ratio) else f"{100 * float(ratio):.{digits}f} %"


def _decimals(value: float) -> int:
    """Decimals for three significant digits (12.3, 1.23), none from 100 on."""
    magnitude = abs(value)
    return 0 if magnitude >= 100 else 1 if magnitude >= 10 else 2


def choose_bucket(span_seconds: float, *, max_points: int = MAX_POINTS) -> int:
    """The narrowest bucket of `BUCKETS` that spreads the span over at most `max_points`."""
    for width in BUCKETS:
        if span_seconds / width <= max_points:
            return width
    return math.ceil(span_seconds / max_points / 86400) * 86400


def parse_bucket(text: str) -> int:
    """`10s`, `30 seconds`, `1m`, `5 min`, `1h`, `1 day` -> seconds; ValueError otherwise."""
    match = _BUCKET.fullmatch(text.lower())
    if match is None or match.group(2) not in _UNITS or int(match.group(1)) < 1:
        raise ValueError(f"bad bucket {text!r}: expected a width such as 1s, 30s, 5min, 1h, 1d")
    return int(match.group(1)) * _UNITS[match.group(2)]


def bucket_label(seconds: int) -> str:
    """Seconds as the shortest unit that divides them: `1 s`, `5 min`, `2 h`, `1 d`."""
    for unit, width in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds % width == 0:
            return f"{seconds // width} {unit}"
    return f"{seconds} s"
