"""The documentation site as a reader sees it: built with `mkdocs build --strict`, served on
127.0.0.1, and opened page by page in headless Chromium.

Every page must load without a console error, an uncaught exception or a failed request,
fetch nothing from elsewhere, and show its title (the page's h1). The site's search, which
runs in the browser (a web worker over the index the build wrote), must find `reread` on the
page of the memory. A screenshot of the home page stays in the test's tmp_path.
"""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from docs_blocks import ROOT

from irismesh.spark_telemetry.browser import Browser, chromium, find_chromium

_CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    _CHROMIUM is None, reason="Chromium not installed (bash .ci/setup installs Debian's chromium)"
)

# Material opens its search with the query of `?q=`; the results render as the worker answers.
SEARCH_RESULTS = """
new Promise(resolve => {
  const started = Date.now();
  const look = () => {
    const items = [...document.querySelectorAll('.md-search-result__item')];
    if (items.length || Date.now() - started > %d) {
      resolve(items.map(item => ({
        href: item.querySelector('a') ? item.querySelector('a').href : '',
        text: item.innerText.slice(0, 200),
      })));
    } else {
      setTimeout(look, 50);
    }
  };
  look();
})
"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"mkdocs build --strict failed (bash .ci/setup installs it):\n{done.stderr}"
    )
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert _CHROMIUM is not None
    with chromium(_CHROMIUM) as running:
        yield running


def site_pages(site: Path) -> list[str]:
    """Every page's path under the site's root: `index.html` files, but for the 404 page."""
    return sorted(
        str(page.parent.relative_to(site)).removeprefix(".") + "/"
        for page in site.rglob("index.html")
        if not page.relative_to(site).parts[0].startswith(("assets", "search"))
    )


def test_every_page_renders(site: Path, served: str, browser: Browser, tmp_path: Path) -> None:
    paths = site_pages(site)
    assert len(paths) >= 20
    failed: dict[str, str] = {}
    for path in paths:
        url = served + path.lstrip("/")
        log = browser.open(url)
        outside = [
            r for r in log.requests if not r.startswith(served) and not r.startswith("data:")
        ]
        title = browser.evaluate("(document.querySelector('article h1') || {}).textContent")
        problems = [
            *log.console_errors,
            *log.exceptions,
            *log.failed_requests,
            *(f"fetched {r}" for r in outside),
            *([] if title and title.strip() else ["no h1"]),
        ]
        if problems:
            failed[path] = "; ".join(problems)[:500]
    assert failed == {}
    browser.open(served)
    shot = browser.screenshot(tmp_path / "home.png")
    print(f"\nscreenshot: {shot}")
    assert shot.stat().st_size > 10_000


def test_the_search_finds_reread(served: str, browser: Browser) -> None:
    log = browser.open(served + "?q=reread")
    assert log.exceptions == []
    assert log.console_errors == []
    reply = browser.call(
        "Runtime.evaluate",
        {"expression": SEARCH_RESULTS % 15_000, "awaitPromise": True, "returnByValue": True},
        timeout=30.0,
    )
    results = reply["result"]["value"]
    assert results, "the search found nothing for 'reread'"
    assert any("memory/" in result["href"] for result in results), results
    assert all("reread" in result["text"].lower() for result in results[:3]), results
