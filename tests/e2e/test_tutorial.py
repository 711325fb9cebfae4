"""The tutorial (docs/getting-started.md) works as a newcomer follows it.

Its files are written from the page's titled blocks into an empty directory, and its commands,
each checked to be on the page, run as the reader runs them: `mesh keygen` into a config
directory of the test's own, two members of "words" in processes of their own, the client,
the watcher, `mesh request`, `mesh peers` and `mesh clusters`, a member stopped with Ctrl-C
(SIGINT). Discovery is on, as a reader's is; the keyring is the test's own, so no node of
another test or program becomes a peer.
"""

from __future__ import annotations

import ast
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from docs_blocks import DOCS, blocks

PAGE = DOCS / "getting-started.md"
BIN = Path(sys.executable).parent
REPLIES = re.compile(r"^20 replies from (\{.*\})$", re.MULTILINE)


class Program:
    """A long-running program of the tutorial; its stdout read line by line on a thread."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Ctrl-C goes to it alone
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if re.search(pattern, line):
                return line
        stderr = self.process.stderr.read() if self.process.poll() is not None else ""
        pytest.fail(f"no line matching {pattern!r} within {timeout} s {stderr}")

    def interrupt(self, timeout: float = 10.0) -> int:
        os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout=timeout)

    def end(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def tutorial(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], list[Program]]]:
    work = tmp_path / "work"
    work.mkdir()
    for block in blocks(PAGE):
        if block.title:
            (work / block.title).write_text(block.code)
    env = dict(os.environ, IRISMESH_DISCOVERY="1", XDG_CONFIG_HOME=str(tmp_path / "config"))
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    for name in ("IRISMESH_KEYFILE", "IRISMESH_KEYS"):
        env.pop(name, None)
    programs: list[Program] = []
    try:
        yield work, env, programs
    finally:
        for program in programs:
            program.end()


def on_the_page(command: str) -> list[str]:
    """The command's arguments, once it is known to be one of the page's shell lines."""
    lines = {
        line.split("#")[0].strip()
        for block in blocks(PAGE)
        if block.lang == "bash"
        for line in block.code.splitlines()
    }
    assert command in lines, f"{command!r} is not on {PAGE.name}"
    argv = shlex.split(command)
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


def run(command: str, work: Path, env: dict[str, str], timeout: float = 30.0) -> str:
    done = subprocess.run(
        on_the_page(command), cwd=work, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"
    return done.stdout


def replies(output: str) -> dict[str, int]:
    match = REPLIES.search(output)
    assert match is not None, output
    counted: dict[str, int] = ast.literal_eval(match.group(1))
    assert sum(counted.values()) == 20
    return counted


def test_the_tutorial_from_keygen_to_a_member_stopped(
    tutorial: tuple[Path, dict[str, str], list[Program]],
) -> None:
    work, env, programs = tutorial
    assert {"service.py", "client.py", "watch.py"} <= {p.name for p in work.iterdir()}
    run("mesh --version", work, env)
    run("mesh keygen", work, env)
    assert (Path(env["XDG_CONFIG_HOME"]) / "irismesh" / "mesh.keys").exists()

    def start(command: str, ready: str) -> Program:
        program = Program(on_the_page(command), work, env)
        programs.append(program)
        program.expect(ready, timeout=30)
        return program

    member_a = start("python service.py a", r"^a serves the cluster words")
    answer = json.loads(run('mesh request words "to be or not to be"', work, env))
    assert answer == {"words": 6, "member": "a"}
    assert replies(run("python client.py", work, env)) == {"a": 20}

    start("python service.py b", r"^b serves the cluster words")
    assert set(replies(run("python client.py", work, env))) <= {"a", "b"}

    watcher = start("python watch.py", r"^watching words\.\*$")
    # The watcher's interest reaches the members a moment after it subscribed: what they
    # publish before that goes to nobody. So the client runs until the watcher has seen some.
    deadline = time.monotonic() + 30
    seen = ""
    while not seen and time.monotonic() < deadline:
        run("python client.py", work, env)
        try:
            seen = watcher.lines.get(timeout=2)
        except queue.Empty:
            continue
    assert re.fullmatch(r"words\.counted [ab] counted 5", seen), seen

    assert "words" in run("mesh clusters", work, env)
    assert run("mesh peers", work, env).strip()

    assert member_a.interrupt() == 0  # Ctrl-C: a goodbye, no traceback
    assert replies(run("python client.py", work, env)) == {"b": 20}
