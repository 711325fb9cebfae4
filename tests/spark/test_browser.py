"""The report as a person sees it: rendered by headless Chromium, checked, and photographed.

Fails on a console error or an uncaught exception, an image that does not load, a request
for anything but the page itself (the page must travel alone), a chart that draws no data
point, or scientific notation on the screen. The screenshot stays beside the report in the
test's tmp_path, and the test prints its path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

from irismesh.spark_telemetry.browser import Browser, chromium, find_chromium
from irismesh.spark_telemetry.report import run_jobs, write_report

_CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    _CHROMIUM is None, reason="Chromium not installed (bash .ci/setup installs Debian's chromium)"
)

CHARTS = """
[...document.querySelectorAll('figure.chart')].map(f => ({
  name: f.dataset.chart,
  points: [...f.querySelectorAll('[id*="-series-"] use, [id*="-bar-"] path')]
    .filter(e => { const b = e.getBBox(); return b.width > 0 || b.height > 0; }).length,
  width: f.querySelector('svg').getBoundingClientRect().width,
}))
"""
IMAGES = "[...document.images].map(i => ({src: i.src, ok: i.complete && i.naturalWidth > 0}))"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert _CHROMIUM is not None
    with chromium(_CHROMIUM) as running:
        yield running


def check_page(browser: Browser, page: Path, shot: Path) -> list[dict[str, Any]]:
    log = browser.open(page.as_uri())
    screenshot = browser.screenshot(shot)
    print(f"\nscreenshot: {screenshot}")
    assert log.console_errors == []
    assert log.exceptions == []
    assert log.failed_requests == []
    assert log.requests == [page.as_uri()]  # nothing fetched: the page travels alone
    broken = [image for image in browser.evaluate(IMAGES) if not image["ok"]]
    assert broken == []
    text = browser.evaluate("document.body.innerText")
    assert not re.search(r"\d\.?\d*e[+-]\d+", text, re.IGNORECASE)
    charts: list[dict[str, Any]] = browser.evaluate(CHARTS)
    empty = [chart["name"] for chart in charts if chart["points"] == 0]
    assert empty == [], f"charts without a data point: {empty}"
    assert all(chart["width"] > 300 for chart in charts)
    assert screenshot.stat().st_size > 10_000
    return charts


def test_the_report_in_a_real_browser(browser: Browser, results: Any, tmp_path: Path) -> None:
    page = write_report(results, tmp_path / "report")
    charts = check_page(browser, page, tmp_path / "report" / "screenshot.png")
    names = {chart["name"] for chart in charts}
    assert {"throughput", "latency-request", "latency-serve", "load"} <= names
    headline = browser.evaluate("document.querySelector('.headline').innerText")
    for label in ("span", "nodes", "clusters", "calls", "failed", "worst p99", "deaths"):
        assert label in headline
    marks = browser.evaluate(
        "document.querySelectorAll('figure[data-chart=throughput] [id*=\"-event-\"]').length"
    )
    assert marks > 0  # joins and the death on the time axis


def test_an_empty_report_in_a_real_browser(browser: Browser, spark: Any, tmp_path: Path) -> None:
    from irismesh.telemetry.schema import spark_schema

    results = run_jobs(spark.createDataFrame([], spark_schema()))
    page = write_report(results, tmp_path / "report")
    assert check_page(browser, page, tmp_path / "report" / "screenshot.png") == []
    assert "No records" in browser.evaluate("document.body.innerText")
