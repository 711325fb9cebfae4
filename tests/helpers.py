"""Helpers shared by the tests: condition waits with deadlines, worker processes, `mesh` runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MESH = [sys.executable, "-m", "irismesh"]  # the `mesh` tool, as a subprocess


async def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> float:
    """Poll `predicate` every 5 ms; return seconds taken, or fail the test at the deadline."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        if loop.time() - start > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.005)
    return loop.time() - start


def wait_until_sync(predicate: Callable[[], object], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - start


class Workers:
    """Worker processes of examples/failover.py, killed at teardown whatever happens."""

    def __init__(self, keyfile: Path) -> None:
        self.env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
        self.env.pop("IRISMESH_KEYS", None)
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, seeds: list[str] = (), delay: float = 0.0) -> str:  # type: ignore[assignment]
        cmd = [sys.executable, str(ROOT / "examples" / "failover.py"), "--worker", name]
        cmd += ["--delay", str(delay)]
        for seed in seeds:
            cmd += ["--seed", seed]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=self.env)
        self.procs[name] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["READY"], f"worker {name} did not start: {line!r}"
        return line[1]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)


def assert_error(result: subprocess.CompletedProcess[str], status: int, *fragments: str) -> None:
    """One line `mesh: ...` on stderr, the right exit status, no traceback, nothing on stdout."""
    where = f"stdout={result.stdout!r} stderr={result.stderr!r}"
    assert result.returncode == status, where
    lines = result.stderr.splitlines()
    assert len(lines) == 1, where
    assert lines[0].startswith("mesh: "), where
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], where
    assert result.stdout == "", where


def run_all(
    cases: Sequence[tuple[Sequence[str], int, str]],
    env: dict[str, str],
    cwd: Path | None = None,
    timeout: float = 60,
) -> None:
    """Run `mesh` error cases in parallel: (argv, exit status, fragment of the one-line message)."""
    procs = [
        subprocess.Popen(
            [*MESH, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        for argv, _, _ in cases
    ]
    failures = []
    try:
        for proc, (argv, status, fragment) in zip(procs, cases, strict=True):
            out, err = proc.communicate(timeout=timeout)
            result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            try:
                assert_error(result, status, fragment)
            except AssertionError as exc:
                failures.append(f"mesh {' '.join(argv)}: {exc}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert not failures, "\n".join(failures)
