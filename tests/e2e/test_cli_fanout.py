"""`mesh broadcast` and `mesh survey` as a user runs them, against a real mesh on 127.0.0.1.

One small mesh serves the module: members A (--json) and B (plain text) of "fan", A also of
"mixed" with X, whose `--exec` command fails, hangs or writes a long answer depending on the
payload, and D of "deaf", a library member without a broadcast handler. Every member's stdout
is read as it comes, so a test can wait (with a deadline) for the broadcast it sent to show.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import (
    MESH,
    InProcess,
    assert_error,
    commands_help,
    kill_all,
    mesh_workdir,
    run_all,
    run_mesh,
    wait_until_sync,
)

from irismesh import cli

# X's --exec command; sh, not Python, so that it starts fast on a busy machine.
EXEC_SCRIPT = r"""
data=$(cat)
case "$data" in
  fail) printf 'first line\nboom: cannot do that\n' >&2; exit 3 ;;
  slow) exec sleep 60 ;;
  long) printf '\033[2Jline-%s\n' 1 2 3 4 5 6 7 8 9 10 ;;
  *) printf %s "$data" | tr a-z A-Z ;;
esac
"""
# D: a member written with the library that serves requests but registers no broadcast handler.
DEAF_MEMBER = """
import asyncio, json, sys
import irismesh

async def main() -> None:
    async with irismesh.Node("deaf", seeds=sys.argv[1:]) as node:
        node.on_request(lambda payload: b"deaf:" + payload)
        print(json.dumps({"node_id": node.node_id.hex(), "endpoint": node.endpoint}), flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


@dataclass
class Member:
    """A running member; its stdout lines after the first are collected by a thread."""

    proc: subprocess.Popen[str]
    log: Path
    first: str
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, what: str, found: Callable[[str], bool]) -> None:
        wait_until_sync(
            lambda: any(found(line) for line in list(self.lines)),
            10,
            f"{what} on stdout of {' '.join(map(str, self.proc.args[3:]))} "
            f"(got {self.lines!r}; stderr {self.log.read_text()[-300:]!r})",
        )


class Members:
    """Long-running members, killed at teardown whatever happens; stderr to files."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.started: list[Member] = []

    def start(self, *argv: str) -> Member:
        log = self.logs / f"member-{len(self.started)}.stderr"
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=self.env
            )
        assert proc.stdout is not None
        member = Member(proc, log, "")
        self.started.append(member)
        member.first = proc.stdout.readline()
        if not member.first:
            proc.wait(timeout=10)
            pytest.fail(f"{' '.join(argv)} exited at once: {log.read_text()}")
        threading.Thread(target=member.read, daemon=True).start()
        return member

    def close(self) -> None:
        kill_all(member.proc for member in self.started)


@dataclass
class Mesh:
    env: dict[str, str]
    seed: str
    ids: dict[str, str]  # A, B, X, D -> node id (hex)
    members: dict[str, Member]

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """`mesh ARGS --seed SEED --wait 10`: it stops waiting once it has found the members;
        a busy machine can be slow to find them."""
        return run_mesh([*args, "--seed", self.seed, "--wait", "10"], self.env, input=stdin)

    def ok(self, *args: str, stdin: str | None = None) -> str:
        result = self.run(*args, stdin=stdin)
        assert result.returncode == 0, f"mesh {' '.join(args)}: {result.stderr}"
        assert result.stderr == ""
        return result.stdout


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    files = {"exec.sh": EXEC_SCRIPT, "deaf.py": DEAF_MEMBER}
    workdir, env = mesh_workdir(tmp_path_factory, "fanout", **files)
    members = Members(env, workdir)
    try:
        node = [*MESH, "node", "--bind", "tcp://127.0.0.1:0"]
        a = members.start(*node, "--json", "--cluster", "fan", "--cluster", "mixed", "--prefix",
                          "A:")  # fmt: skip
        seed = str(json.loads(a.first)["endpoint"])
        b = members.start(*node, "--cluster", "fan", "--prefix", "B:", "--seed", seed)
        command = f"sh {workdir / 'exec.sh'}"
        x = members.start(*node, "--json", "--cluster", "mixed", "--exec", command,
                          "--exec-timeout", "5", "--seed", seed)  # fmt: skip
        d = members.start(sys.executable, str(workdir / "deaf.py"), seed)
        ids = {
            name: str(json.loads(m.first)["node_id"]) for name, m in (("A", a), ("X", x), ("D", d))
        }
        deadline = time.monotonic() + 20
        while True:  # until a newcomer sees the whole mesh
            views_of = ["--json", "--cluster", "fan", "--cluster", "mixed", "--cluster", "deaf"]
            found = run_mesh(["clusters", "--seed", seed, *views_of], env, timeout=30)
            views = {v["cluster"]: v["members"] for v in json.loads(found.stdout or "[]")}
            if [len(views.get(c, [])) for c in ("fan", "mixed", "deaf")] == [2, 2, 1]:
                break
            assert time.monotonic() < deadline, f"mesh not formed: {views} {found.stderr}"
        (ids["B"],) = set(views["fan"]) - {ids["A"]}
        assert ids["B"][:12] in b.first  # "member of 'fan' listening on ... (node 0123456789ab)"
        yield Mesh(env, seed, ids, {"A": a, "B": b, "X": x, "D": d})
    finally:
        members.close()


def json_line(line: str) -> object:
    try:
        return json.loads(line)
    except ValueError:
        return None


# ----------------------------------------------------------------- help


def test_broadcast_and_survey_explain_themselves(capsys: pytest.CaptureFixture[str]) -> None:
    for text in commands_help(("broadcast", "survey"), capsys).values():
        assert "--json" in text
        assert "'-' reads stdin" in text
    with pytest.raises(SystemExit):
        cli.main(["survey", "--help"])
    assert "Exit status: 0 every member answered; 1" in capsys.readouterr().out


# ----------------------------------------------------------------- broadcast


def test_broadcast_reaches_every_member_and_says_which(mesh: Mesh) -> None:
    out = mesh.ok("broadcast", "fan", "hello table")
    assert "broadcast to 'fan': delivered to 2 of 2 member(s)" in out
    for name in ("A", "B"):
        row = next(line for line in out.splitlines() if mesh.ids[name][:12] in line)
        assert "yes" in row
    assert mesh.seed in out  # A's endpoint, beside its id
    # A prints each broadcast as JSON (it runs with --json), B as a line after its --prefix.
    mesh.members["A"].wait_for(
        "A's JSON line", lambda s: json_line(s) == {"broadcast": "hello table"}
    )
    mesh.members["B"].wait_for("B's line", lambda s: s == "B:hello table")
    assert not any("hello table" in line for line in mesh.members["X"].lines)  # not of "fan"


def test_broadcast_json_and_payload_from_stdin(mesh: Mesh) -> None:
    report = json.loads(mesh.ok("broadcast", "fan", "-", "--json", stdin="from stdin\n"))
    assert report == {
        "cluster": "fan",
        "delivered": sorted([mesh.ids["A"], mesh.ids["B"]]),
        "count": 2,
        "missed": [],
    }
    mesh.members["A"].wait_for(
        "A's JSON line", lambda s: json_line(s) == {"broadcast": "from stdin\n"}
    )
    mesh.members["B"].wait_for("B's line", lambda s: s == "B:from stdin")


def test_broadcast_that_no_member_takes_exits_1(mesh: Mesh) -> None:
    """D serves "deaf" but has no broadcast handler: it is known, and not reached."""
    result = mesh.run("broadcast", "deaf", "anyone?")
    assert_error(result, 1, "no member of 'deaf' took the broadcast", mesh.ids["D"][:12])


def test_broadcast_to_a_mixed_cluster_reaches_exec_members_too(mesh: Mesh) -> None:
    report = json.loads(mesh.ok("broadcast", "mixed", "to mixed", "--json"))
    assert report["delivered"] == sorted([mesh.ids["A"], mesh.ids["X"]])
    mesh.members["X"].wait_for("X's JSON line", lambda s: json_line(s) == {"broadcast": "to mixed"})


# ----------------------------------------------------------------- survey


def test_survey_tabulates_every_members_answer(mesh: Mesh) -> None:
    report = json.loads(mesh.ok("survey", "fan", "ping", "--json"))
    assert report == {
        "cluster": "fan",
        "answers": {mesh.ids["A"]: "A:ping", mesh.ids["B"]: "B:ping"},
        "errors": {},
        "missing": [],
    }
    out = mesh.ok("survey", "fan", "ping")
    assert "survey of 'fan': 2 of 2 member(s) answered" in out
    for name in ("A", "B"):
        row = next(line for line in out.splitlines() if mesh.ids[name][:12] in line)
        assert "answered" in row
        assert f"{name}:ping" in row


def test_survey_reports_a_member_whose_handler_failed_and_exits_1(mesh: Mesh) -> None:
    result = mesh.run("survey", "mixed", "fail", "--json")
    assert result.returncode == 1, result.stderr
    assert result.stderr == "mesh: 1 of 2 member(s) of 'mixed' did not answer: 1 errored\n"
    report = json.loads(result.stdout)
    assert report["answers"] == {mesh.ids["A"]: "A:fail"}
    assert report["errors"] == {
        mesh.ids["X"]: "CommandFailed: boom: cannot do that (exit status 3)"
    }
    assert report["missing"] == []

    result = mesh.run("survey", "mixed", "fail")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1
    row = next(line for line in result.stdout.splitlines() if mesh.ids["X"][:12] in line)
    assert "error" in row
    assert "boom: cannot do that" in row
    assert "survey of 'mixed': 1 of 2 member(s) answered" in result.stdout


def test_survey_reports_a_slow_member_missing_at_the_timeout(mesh: Mesh) -> None:
    started = time.monotonic()
    result = mesh.run("survey", "mixed", "slow", "--timeout", "1", "--json")
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert "1 missing (no answer within 1 s)" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    report = json.loads(result.stdout)
    assert report["answers"] == {mesh.ids["A"]: "A:slow"}
    assert report["errors"] == {}
    assert report["missing"] == [mesh.ids["X"]]
    assert took >= 1.0  # waited for X until the timeout, not for its 60 s command

    result = mesh.run("survey", "mixed", "slow", "--timeout", "0.5")
    assert result.returncode == 1
    row = next(line for line in result.stdout.splitlines() if mesh.ids["X"][:12] in line)
    assert "missing" in row


def test_survey_table_shortens_answers_and_json_keeps_them_whole(mesh: Mesh) -> None:
    report = json.loads(mesh.ok("survey", "mixed", "long", "--json"))
    whole = report["answers"][mesh.ids["X"]]
    assert whole.endswith("line-9\n\x1b[2Jline-10\n")
    out = mesh.ok("survey", "mixed", "long")
    assert "line-3" in out
    assert "line-4" not in out
    assert f"({len(whole.encode()):,} bytes in all)" in out
    assert "\x1b" not in out  # a member's escape sequences never reach the terminal


# ----------------------------------------------------------------- errors


def test_fanout_refusals_are_one_line_and_exit_1(mesh: Mesh) -> None:
    nobody = "tcp://127.0.0.1:9"  # the discard port: nothing of ours listens there
    quick = ["--wait", "0.3"]
    cases: list[tuple[Sequence[str], int, str]] = [
        (["broadcast", "--seed", mesh.seed, "nobody", "x", *quick], 1, "no live member"),
        (["survey", "--seed", mesh.seed, "nobody", "x", *quick], 1, "no live member"),
        (["broadcast", "--seed", nobody, "fan", "x", *quick], 1, "no live member after 0.3 s"),
        (["survey", "--seed", nobody, "fan", "x", *quick], 1, "no live member after 0.3 s"),
    ]
    run_all(cases, mesh.env)


def test_fanout_user_mistakes_are_one_line_and_exit_2(mesh: Mesh) -> None:
    """Two in processes of their own (argparse's error, then one of the command's)."""
    no_keys = {k: v for k, v in mesh.env.items() if k != "IRISMESH_KEYFILE"}
    seed = ["--seed", mesh.seed]
    run_all([(["broadcast", *seed, "fan"], 2, "required: PAYLOAD")], mesh.env)
    run_all([(["survey", *seed, "fan", "x"], 2, "no keyring: pass --keys")], no_keys)


def test_more_fanout_user_mistakes(mesh: Mesh, tmp_path: Path, in_process: InProcess) -> None:
    """The same error boundary in-process (`cli.main`), to spare an interpreter per case."""
    db_only = in_process.join(mesh.env)
    seed = ["--seed", mesh.seed]
    cases: list[tuple[list[str], str]] = [
        (["survey", *seed, "fan", "x", "--timeout", "0"], "--timeout: must be a positive"),
        (["broadcast", *seed, "fan", "x", "--timeout", "soon"], "--timeout: must be a number"),
        (["survey", *seed, "two words", "x"], "bad cluster name"),
        (["broadcast", "fan", "x"], "nothing to join"),
        (["survey", "--seed", "localhost:7400", "fan", "x"], "bad endpoint"),
        (["survey", *seed, "fan", "x", "--keys", str(db_only)], "no key for 'fan'"),
        (["broadcast", *seed, "fan", "x", "--keys", str(tmp_path / "none")], "not found"),
        (["broadcast", *seed, "fan", "x", "--wait", "-1"], "--wait: must be zero or more"),
        (["survey", *seed], "required: CLUSTER, PAYLOAD"),
    ]
    in_process.assert_usage_errors(cases)
