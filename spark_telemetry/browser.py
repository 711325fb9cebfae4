"""Headless Chromium driven over the DevTools protocol on a pipe: no library, no port.

`chromium --remote-debugging-pipe` reads protocol commands on its file descriptor 3 and writes
replies and events on 4, each a JSON object ended by a NUL byte (what Puppeteer's `pipe: true`
uses). That needs no WebSocket client and opens no socket, so it also keeps this machine's
network rules. `Browser.open(url)` loads a page and records what a person would notice: console
errors, uncaught exceptions, failed or outside requests. Every wait has a deadline.

The browser test renders the report with it and keeps a screenshot; the demo takes the same
screenshot of its report (`screenshot_page`) when Chromium is installed.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",  # no calls home on a closed network
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageLog:
    """What the page did while it loaded and ran."""

    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)


class Browser:
    """One Chromium process and one page target, over the pipe."""

    def __init__(self, process: subprocess.Popen[bytes], to_browser: int, from_browser: int):
        self._process = process
        self._out = to_browser
        self._in = from_browser
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self.session = ""
        self._target = ""

    def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        timeout: float = 10.0,
        session: bool = True,
    ) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            for reply in self._read(deadline):
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return dict(reply.get("result", {}))
                self._events.append(reply)

    def wait_for(self, method: str, *, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for number, event in enumerate(self._events):
                if event.get("method") == method:
                    del self._events[number]
                    return event
            self._events.extend(self._read(deadline))

    def _read(self, deadline: float) -> list[dict[str, Any]]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self._in], [], [], left)
            if ready:
                chunk = os.read(self._in, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium exited (status {self._process.poll()})")
                self._buffer += chunk
        *messages, self._buffer = self._buffer.split(b"\0")
        return [json.loads(m) for m in messages if m]

    def open(self, url: str, *, timeout: float = 20.0) -> PageLog:
        """Load `url` in a fresh page (the last one closed); wait for its load event; what it
        logged meanwhile."""
        if self._target:  # one page at a time: a site's pages opened in turn hold no memory
            self.call("Target.closeTarget", {"targetId": self._target}, session=False)
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        self._target = target["targetId"]
        attached = self.call(
            "Target.attachToTarget",
            {"targetId": target["targetId"], "flatten": True},
            session=False,
        )
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        )
        self._events.clear()
        self.call("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired", timeout=timeout)
        self.call("Runtime.evaluate", {"expression": "1", "awaitPromise": True})  # drain events
        log = PageLog()
        for event in self._events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                log.console_errors.append(json.dumps(params.get("args"))[:300])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                log.console_errors.append(params["entry"].get("text", "")[:300])
            elif method == "Runtime.exceptionThrown":
                log.exceptions.append(json.dumps(params.get("exceptionDetails"))[:300])
            elif method == "Network.requestWillBeSent":
                log.requests.append(params["request"]["url"])
            elif method == "Network.loadingFailed":
                log.failed_requests.append(params.get("errorText", ""))
        return log

    def evaluate(self, expression: str) -> Any:
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise RuntimeError(f"script failed: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self, path: Path) -> Path:
        """The whole page, not just the viewport, as PNG."""
        metrics = self.call("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        shot = self.call(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {
                    "x": 0,
                    "y": 0,
                    "width": size["width"],
                    "height": size["height"],
                    "scale": 1,
                },
            },
            timeout=30.0,
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


def _high_fd(fd: int) -> int:
    """A copy of `fd` numbered 10 or above, so moving copies onto 3 and 4 clobbers nothing."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return copy


@contextmanager
def chromium(executable: str) -> Iterator[Browser]:
    """A headless Chromium for the block; killed (and its profile removed) after it."""
    commands_read, commands_write = (_high_fd(fd) for fd in os.pipe())
    replies_read, replies_write = (_high_fd(fd) for fd in os.pipe())

    def onto_3_and_4() -> None:  # runs in the child, before exec
        os.dup2(commands_read, 3)
        os.dup2(replies_write, 4)

    profile = tempfile.mkdtemp(prefix="irismesh-chromium-")
    try:
        process = subprocess.Popen(
            [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,  # our own descriptors are not inheritable (PEP 446)
            preexec_fn=onto_3_and_4,  # the pipe must sit on 3 and 4
            start_new_session=True,  # its helpers (renderer, GPU, crash handler) go with it
        )
        os.close(commands_read)
        os.close(replies_write)
        try:
            yield Browser(process, commands_write, replies_read)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            os.close(commands_write)
            os.close(replies_read)
    finally:
        _remove_profile(profile)


def _remove_profile(profile: str, timeout: float = 5.0) -> None:
    """Remove a Chromium profile; a helper process still dying may write one last file."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            shutil.rmtree(profile)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def screenshot_page(page: Path, shot: Path, *, timeout: float = 30.0) -> Path | None:
    """A full-page screenshot of an HTML file in headless Chromium; None without Chromium."""
    executable = find_chromium()
    if executable is None:
        return None
    with chromium(executable) as browser:
        browser.open(page.resolve().as_uri(), timeout=timeout)
        return browser.screenshot(shot)
