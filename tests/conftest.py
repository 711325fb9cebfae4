"""Fixtures shared by every test; plain helpers live in tests/helpers.py."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import faulthandler
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import InProcess, Workers

import irismesh

if irismesh.loop_factory() is not asyncio.new_event_loop:
    # irismesh's own loop (uvloop where installed) for the tests' asyncio.run too, unless
    # IRISMESH_LOOP=asyncio: CI runs the integration tests both ways.
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


# Nodes discover each other by default; tests say whom each node joins, so that the nodes of
# one test never find those of another (or of another test run on this machine). Tests of
# discovery itself ask for it (survey=, mdns=, discovery=True) or set IRISMESH_DISCOVERY=1.
# `mesh` and the library read their config and default keyring under XDG_CONFIG_HOME: a
# directory of the run's own, never the user's. Subprocesses inherit all of it.
os.environ["IRISMESH_DISCOVERY"] = "0"
for _name in ("IRISMESH_SEEDS", "IRISMESH_INTERFACE", "IRISMESH_CONFIG", "IRISMESH_METRICS"):
    os.environ.pop(_name, None)
os.environ["XDG_CONFIG_HOME"] = _config_home = tempfile.mkdtemp(prefix="irismesh-tests-config-")
atexit.register(shutil.rmtree, _config_home, True)


@pytest.fixture
def keys() -> irismesh.Keyring:
    return irismesh.Keyring.generate()


@pytest.fixture
def keyfile(tmp_path: Path, keys: irismesh.Keyring) -> Path:
    path = tmp_path / "mesh.keys"
    keys.save(path)
    return path


@pytest.fixture
def in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> InProcess:
    return InProcess(tmp_path, monkeypatch, capsys)


@pytest.fixture
def workers(keyfile: Path) -> Iterator[Workers]:
    with contextlib.closing(Workers(keyfile)) as group:
        yield group


# The last resort against a hung test: pytest-timeout ends a test by raising in the main
# thread, which ends the one coroutine it lands in; an event loop whose other tasks never
# yield then runs on, and the suite with it, until CI's own limit, naming nothing. So a
# watchdog thread ends the whole run once a test has outlived its timeout by GRACE seconds
# (or the run its SUITE_LIMIT): the hung test's name and every thread's stack on stderr,
# exit status 3.
GRACE = 30.0
SUITE_LIMIT = float(os.environ.get("IRISMESH_SUITE_LIMIT", 1800))


class Watchdog:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.test = ""
        self.until = float("inf")
        self.changed = threading.Condition()
        threading.Thread(target=self._watch, name="test-watchdog", daemon=True).start()

    def running(self, test: str, limit: float) -> None:
        with self.changed:
            self.test, self.until = test, time.monotonic() + limit + GRACE
            self.changed.notify()

    def _watch(self) -> None:
        with self.changed:
            while True:
                now = time.monotonic()
                suite_left = self.started + SUITE_LIMIT - now
                if now < self.until and suite_left > 0:
                    self.changed.wait(min(self.until - now, suite_left, 60.0))
                    continue
                why = (
                    f"the suite outlived its limit of {SUITE_LIMIT:.0f} s"
                    if suite_left <= 0
                    else f"it outlived its timeout by {GRACE:.0f} s"
                )
                sys.stderr.write(f"\n\nHUNG TEST: {self.test}: {why}; every thread's stack:\n")
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.write(f"\nHUNG TEST: {self.test}\n")
                sys.stderr.flush()
                os._exit(3)


_watchdog = Watchdog()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        limit = float(marker.args[0])
    else:
        limit = float(item.config.getini("timeout") or 0)
    _watchdog.running(item.nodeid, limit if limit > 0 else SUITE_LIMIT)
    yield
    _watchdog.running("(between tests)", SUITE_LIMIT)
