"""Event marks on the report's time charts: a caller's outlier ejections and readmissions
are drawn beside joins, leaves and deaths (no Spark session needed)."""

from __future__ import annotations

import datetime as dt

from irismesh.spark_telemetry import charts


def test_ejections_and_readmissions_are_marked_and_labelled() -> None:
    start = dt.datetime(2026, 11, 28, 5, 0, tzinfo=dt.UTC)
    times = [start + dt.timedelta(seconds=s) for s in (0, 60, 120)]
    line = charts.Series(label="db", times=times, values=[1.0, 2.0, 3.0], color="#1f77b4")
    marks = [
        charts.Mark(time=times[1], event="ejected", label="db-2"),
        charts.Mark(time=times[2], event="readmitted", label="db-2"),
    ]
    svg = charts.time_chart(
        "lat", [line], span=(times[0], times[2]), marks=marks, ylabel="ms", yformat=str
    )
    assert {"ejected", "readmitted"} <= set(charts.EVENT_STYLE)
    assert svg.count('id="lat-event-') == 2
    assert "ejected db-2" in svg
    assert "readmitted db-2" in svg
