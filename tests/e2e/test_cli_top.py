"""`mesh top` in a real terminal: tmux runs it, capture-pane reads the screen, send-keys quits."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import wait_until_sync

import irismesh

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(
    TMUX is None,
    reason="tmux is not installed (apt-get install -y tmux): mesh top needs a real terminal",
)


@dataclass
class Member:
    keyfile: Path
    endpoint: str
    node_id: str


@pytest.fixture(scope="module")
def member(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Member]:
    keyfile = tmp_path_factory.mktemp("top") / "mesh.keys"
    irismesh.Keyring.generate().save(keyfile)
    cmd = [sys.executable, "-m", "irismesh", "node", "--keys", str(keyfile), "--json"]
    cmd += ["--cluster", "echo", "--name", "echo-one"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline())
        yield Member(keyfile, started["endpoint"], started["node_id"])
    finally:
        proc.kill()
        proc.communicate(timeout=10)


class Tmux:
    """A tmux server of its own (-L), so the test never touches a user's sessions."""

    def __init__(self, name: str) -> None:
        self.base = [str(TMUX), "-L", name, "-f", "/dev/null"]  # and no user's tmux.conf

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.base, *args], capture_output=True, text=True, check=check, timeout=10
        )

    def screen(self, session: str) -> str:
        return self("capture-pane", "-p", "-t", session, check=False).stdout


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    server = Tmux(f"irismesh-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        yield server
    finally:
        server("kill-server", check=False)  # and with it whatever still runs in it


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_top_shows_the_member_and_quits_cleanly(
    member: Member, tmux: Tmux, tmp_path: Path, key: str
) -> None:
    status, terminal = tmp_path / "status", tmp_path / "stty"
    # tmux hands the pane COLUMNS=80 and LINES=24 when started from a process without a
    # terminal (as here), and rich obeys them over the real size: drop them.
    top = ["env", "-u", "COLUMNS", "-u", "LINES"]
    top += [sys.executable, "-m", "irismesh", "top", "--keys", str(member.keyfile)]
    top += ["--seed", member.endpoint, "--cluster", "echo", "--interval", "0.2"]
    # After top exits, the same shell records its exit status and the terminal's modes.
    script = f"{shlex.join(top)}; echo $? > {status}; stty -a > {terminal}"
    tmux("new-session", "-d", "-s", "top", "-x", "120", "-y", "40", script)

    screen = ""

    def member_shown() -> bool:
        nonlocal screen
        screen = tmux.screen("top")
        shown = member.node_id[:12] in screen and "alive" in screen
        # The clusters table can come a frame after the peers table.
        return shown and any(line.startswith("│ echo ") for line in screen.splitlines())

    try:
        wait_until_sync(member_shown, 20, "the member in mesh top's peers table", step=0.05)
    except pytest.fail.Exception:
        print(screen)
        raise
    assert "peers (1)" in screen
    assert member.endpoint in screen
    peer = next(line for line in screen.splitlines() if member.endpoint in line)
    assert member.node_id[:12] in peer
    assert "echo-one" in peer  # its name, in a column of its own
    row = next(line for line in screen.splitlines() if line.startswith("│ echo "))
    assert "echo-one" in row  # the clusters table: echo and its one member, by name
    assert "q or Ctrl-C quits" in screen

    tmux("send-keys", "-t", "top", key)
    wait_until_sync(
        lambda: status.exists() and status.read_text().strip(), 10, "mesh top to exit", step=0.05
    )
    assert status.read_text().strip() == "0"
    wait_until_sync(
        lambda: terminal.exists() and terminal.read_text(), 10, "stty after mesh top", step=0.05
    )
    modes = terminal.read_text().split()
    assert "icanon" in modes, "mesh top left the terminal in cbreak mode"
    assert "echo" in modes, "mesh top left the terminal without echo"
