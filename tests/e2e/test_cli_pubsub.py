"""`mesh publish`, `mesh subscribe` and `mesh tunnel` as a user runs them, on 127.0.0.1.

One small mesh serves the module: E, a `mesh node` of "echo" that echoes tunnels (everyone's
seed), and X, a `mesh node` of "shout" whose --tunnel-exec command upper-cases the stream, or
fails when its first line is "fail". Subscribers are `mesh subscribe` processes; each test
waits (with a deadline) for the line on stderr that says a subscriber is ready, and
publishers use --wait-subscribers, so nothing is published before the interest arrived.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import MESH, InProcess, commands_help, mesh_workdir, run_all, run_mesh, wait_until_sync

from irismesh import cli

# X's --tunnel-exec command; sh, not Python, so that it starts fast on a busy machine.
SHOUT_SCRIPT = r"""
IFS= read -r first || exit 0
case "$first" in
  fail) cat >/dev/null; printf 'first line\nboom: tunnel says no\n' >&2; exit 3 ;;
esac
{ printf '%s\n' "$first"; cat; } | tr a-z A-Z
"""
READY = "mesh: subscribed to "


@dataclass
class Mesh:
    env: dict[str, str]
    seed: str
    workdir: Path

    def run(
        self, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """`mesh ARGS --seed SEED` (with --wait 10 unless told: they stop waiting once the
        mesh is found, and a busy machine can be slow to find it)."""
        extra = [] if "--wait" in args else ["--wait", "10"]
        return run_mesh(
            [*args, "--seed", self.seed, *extra],
            self.env if env is None else env,
            input=stdin,
            text=False,
        )

    def ok(self, *args: str, stdin: bytes | None = None) -> str:
        result = self.run(*args, stdin=stdin)
        assert result.returncode == 0, f"mesh {' '.join(args)}: {result.stderr!r}"
        assert result.stderr == b"", result.stderr
        return result.stdout.decode()


@dataclass
class Subscriber:
    """A running `mesh subscribe`; stderr is read by a thread, stdout at the end."""

    proc: subprocess.Popen[bytes]
    err: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None  # reads stderr into `err`, until the pipe ends

    def read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line.decode().rstrip("\n"))

    def finish(self, timeout: float = 30) -> tuple[int, str, list[str]]:
        """Wait for it to exit by itself: (status, stdout, stderr lines)."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self.proc.wait(timeout)
        if self.reader is not None:  # its last lines: the pipe ends as the process does
            self.reader.join(timeout)
            assert not self.reader.is_alive(), "stderr still open after the process ended"
        return self.proc.returncode, out.decode(), self.err


class Subscribers:
    """`mesh subscribe` processes, killed at teardown whatever happens."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.started: list[Subscriber] = []

    def start(self, *args: str) -> Subscriber:
        """Start `mesh subscribe ARGS` and wait until it says it is ready."""
        proc = subprocess.Popen(
            [*MESH, "subscribe", *args, "--seed", self.mesh.seed, "--wait", "10"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.mesh.env,
        )
        sub = Subscriber(proc)
        self.started.append(sub)
        sub.reader = threading.Thread(target=sub.read_stderr, daemon=True)
        sub.reader.start()
        wait_until_sync(
            lambda: any(line.startswith(READY) for line in sub.err) or proc.poll() is not None,
            20,
            f"mesh subscribe {' '.join(args)} to be ready",
        )
        assert proc.poll() is None, f"mesh subscribe {' '.join(args)} exited: {sub.err}"
        return sub

    def close(self) -> None:
        for sub in self.started:
            if sub.proc.poll() is None:
                sub.proc.kill()
            sub.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir, env = mesh_workdir(tmp_path_factory, "pubsub", **{"shout.sh": SHOUT_SCRIPT})
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        """`mesh node ARGS --json`; its endpoint."""
        proc = subprocess.Popen(
            [*MESH, "node", "--bind", "tcp://127.0.0.1:0", "--json", *args],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append(proc)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first, f"mesh node {' '.join(args)} did not start"
        return str(json.loads(first)["endpoint"])

    try:
        seed = start("--cluster", "echo")
        start("--cluster", "shout", "--tunnel-exec", f"sh {workdir / 'shout.sh'}", "--seed", seed)
        yield Mesh(env, seed, workdir)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def subscribers(mesh: Mesh) -> Iterator[Subscribers]:
    with contextlib.closing(Subscribers(mesh)) as group:
        yield group


def one_line_error(status: int, err: str | bytes, expected: int, *fragments: str) -> None:
    """The command failed with `expected`, saying why in one last line `mesh: ...`."""
    text = err.decode() if isinstance(err, bytes) else err
    lines = text.splitlines()
    assert status == expected, text
    assert "Traceback" not in text
    assert lines, "nothing on stderr"
    assert lines[-1].startswith("mesh: "), text
    for fragment in fragments:
        assert fragment in lines[-1], text


# ----------------------------------------------------------------- help


def test_publish_subscribe_and_tunnel_explain_themselves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    commands_help(("publish", "subscribe", "tunnel"), capsys)
    for name, phrase in (
        ("publish", "--wait-subscribers"),
        ("subscribe", "Exit status: 0 after --count messages"),
        ("tunnel", "Like netcat"),
        ("node", "--tunnel-exec CMD"),
    ):
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        assert phrase in capsys.readouterr().out, name


# ----------------------------------------------------------------- publish and subscribe


def test_three_messages_reach_a_json_subscriber_in_order(
    mesh: Mesh, subscribers: Subscribers
) -> None:
    sub = subscribers.start("news.*", "--json", "--count", "3")
    lines = b"one\ntwo\n\xff\xfe binary\n"  # the last line is not UTF-8
    report = json.loads(
        mesh.ok("publish", "news.today", "-", "--wait-subscribers", "1", "--json", stdin=lines)
    )
    assert report["topic"] == "news.today"
    assert report["published"] == 3
    assert report["reached"] == report["reached_min"] == 1
    status, out, err = sub.finish()
    assert status == 0, err
    assert len(err) == 1, err  # the ready line only
    assert err[0].startswith("mesh: subscribed to 'news.*' on tcp://127.0.0.1:"), err
    messages = [json.loads(line) for line in out.splitlines()]
    assert [m["payload"] for m in messages[:2]] == ["one", "two"]
    assert messages[2]["payload_base64"] == "//4gYmluYXJ5"  # b"\xff\xfe binary", exactly
    assert "payload_base64" not in messages[0]
    assert all(m["topic"] == "news.today" and m["missed"] == 0 for m in messages)
    publishers = {m["publisher"] for m in messages}
    assert len(publishers) == 1
    assert len(publishers.pop()) == 32


def test_wildcards_text_output_and_a_topic_nobody_wants(
    mesh: Mesh, subscribers: Subscribers
) -> None:
    sub = subscribers.start("feeds.#.corrections", "--count", "2")
    # Nobody subscribed to a story: published all the same, reaching no node, exit 0.
    out = mesh.ok("publish", "feeds.world.42", "the story")
    assert out == "published to 'feeds.world.42': reached 0 node(s)\n"
    started = time.monotonic()
    out = mesh.ok(
        "publish", "feeds.world.42.corrections", "fixed", "--count", "2", "--rate", "10",
        "--wait-subscribers", "1",
    )  # fmt: skip
    assert "published 2 messages to 'feeds.world.42.corrections'" in out, out
    assert out.endswith("each reached 1 node(s)\n"), out
    status, text, err = sub.finish()
    assert status == 0, err
    # Only the corrections: the story, published before them, never arrived.
    assert text == "feeds.world.42.corrections fixed\n" * 2
    assert time.monotonic() - started >= 0.1  # two messages at 10 a second


def test_subscriber_idle_timeout_and_sigterm(mesh: Mesh, subscribers: Subscribers) -> None:
    quiet = subscribers.start("quiet.#", "--timeout", "0.5")
    status, out, err = quiet.finish()
    one_line_error(status, "\n".join(err), 1, "no message on 'quiet.#' in 0.5 s")
    assert out == ""
    assert len(err) == 2, err  # ready, then why it gave up
    stopped = subscribers.start("quiet.#")
    stopped.proc.send_signal(signal.SIGTERM)
    status, out, err = stopped.finish()
    assert status == 0, err  # asked to stop: a clean leave
    assert len(err) == 1, err


# ----------------------------------------------------------------- tunnel


def test_tunnel_through_an_echo_member_returns_every_byte(mesh: Mesh) -> None:
    data = os.urandom(200_000) + bytes(range(256)) + b"\xff\xfe not UTF-8\n"  # > 64 KiB
    result = mesh.run("tunnel", "echo", stdin=data)
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
    assert result.stdout == data


def test_tunnel_through_a_command_and_its_failure(mesh: Mesh) -> None:
    assert mesh.ok("tunnel", "shout", stdin=b"hello tunnel\nsecond line\n") == (
        "HELLO TUNNEL\nSECOND LINE\n"
    )
    failed = mesh.run("tunnel", "shout", stdin=b"fail\nmore\n")
    one_line_error(
        failed.returncode, failed.stderr, 1, "tunnel to 'shout' was reset",
        "boom: tunnel says no (exit status 3)",
    )  # fmt: skip
    assert len(failed.stderr.splitlines()) == 1
    assert b"first line" not in failed.stderr  # the last line of the command's stderr only
    assert failed.stdout == b""


# ----------------------------------------------------------------- errors


def test_mesh_refusals_are_one_line_and_exit_1(mesh: Mesh) -> None:
    nobody = "tcp://127.0.0.1:9"  # the discard port: nothing of ours listens there
    quick = ["--wait", "0.5"]
    cases: list[tuple[Sequence[str], int, str]] = [
        (["publish", "--seed", mesh.seed, "lonely.topic", "x", "--wait-subscribers", "1",
          *quick], 1, "0 node(s) subscribed to 'lonely.topic' after 0.5 s, wanted 1"),
        (["publish", "--seed", nobody, "news.a", "x", *quick], 1, "no node answered"),
        (["subscribe", "--seed", nobody, "news.#", *quick], 1, "no node answered"),
        (["tunnel", "--seed", mesh.seed, "nobody", *quick], 1, "no live member"),
    ]  # fmt: skip
    run_all(cases, mesh.env)


def test_user_mistakes_are_one_line_and_exit_2(mesh: Mesh) -> None:
    """In processes of their own: the whole way a user sees them."""
    no_keys = {k: v for k, v in mesh.env.items() if k != "IRISMESH_KEYFILE"}
    seed = ["--seed", mesh.seed]
    run_all(
        [
            (["publish", *seed, "news..today", "x"], 2, "bad topic 'news..today'"),
            (["subscribe", *seed, "news.to#"], 2, "bad subscription pattern"),
        ],
        mesh.env,
    )
    run_all([(["publish", *seed, "news.today", "x"], 2, "no keyring: pass --keys")], no_keys)


def test_more_user_mistakes(mesh: Mesh, tmp_path: Path, in_process: InProcess) -> None:
    """The same error boundary in-process (`cli.main`), to spare an interpreter per case."""
    db_only = in_process.join(mesh.env)
    seed = ["--seed", mesh.seed]
    cases: list[tuple[list[str], str]] = [
        (["publish", *seed, "news.*", "x"], "wildcards belong in subscription patterns"),
        (["publish", *seed, "news today", "x"], "bad topic"),
        (["publish", "news.today", "x"], "nothing to join"),
        (["publish", *seed, "news.today", "x", "--keys", str(db_only)], "no key for 'news'"),
        (["publish", *seed, "news.today", "x", "--rate", "0"], "--rate: must be a positive"),
        (["publish", *seed, "news.today", "x", "--count", "0"], "--count: must be at least 1"),
        (["publish", *seed, "news.today", "x" * 2_000_000], "PAYLOAD is 2000000 bytes"),
        (["subscribe", *seed, "news.#", "--keys", str(db_only)], "no key for 'news'"),
        (["subscribe", *seed, "news.#", "--policy", "sometimes"], "invalid choice"),
        (["subscribe", *seed, "news.#", "--maxsize", "0"], "--maxsize: must be at least 1"),
        (["subscribe", *seed, "news.#", "--timeout", "-1"], "--timeout: must be a positive"),
        (["tunnel", *seed, "echo", "--keys", str(db_only)], "no key for 'echo'"),
        (["tunnel", "echo"], "nothing to join"),
        (["tunnel", *seed, "two words"], "bad cluster name"),
        (["node", "--cluster", "t", "--tunnel-exec", "no-such-program-here"], "not found"),
        (["node", "--cluster", "t", "--tunnel-exec", "'unclosed"], "bad --tunnel-exec command"),
    ]
    in_process.assert_usage_errors(cases)
