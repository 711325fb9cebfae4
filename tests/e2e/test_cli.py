"""`mesh` as a user runs it: every command as a subprocess against a real mesh on 127.0.0.1.

One small mesh serves the whole module: members A and B of "echo" (B also of "db") and X of
"ex", whose `--exec` command upper-cases, fails or hangs depending on the payload; A and B are
named (`--name`), X goes by its default name (host and process id). Each
command's human output, `--json` output and error paths are checked; an error is always one
line `mesh: ...` on stderr, exit status 2 for the user's mistakes and 1 for the mesh's refusals.
"""

from __future__ import annotations

import asyncio
import json
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import MESH, assert_error, assert_usage_errors, kill_all, mesh_workdir, run_all

import irismesh
from irismesh import cli
from irismesh._cli.serve import CommandHandler
from irismesh._core.records import node_id_of
from irismesh.security.identity import Identity

WAITING = {"request", "peers", "clusters", "top", "bench"}
# The --exec command of member X; sh, not Python, so that it starts fast on a busy machine.
EXEC_SCRIPT = """\
data=$(cat)
case "$data" in
  fail) printf 'first line\\nboom: cannot do that\\n' >&2; exit 3 ;;
  hang) exec sleep 60 ;;
  *) printf %s "$data" | tr a-z A-Z ;;
esac
"""


@dataclass
class Mesh:
    """The module's running mesh and how to run `mesh` against it."""

    workdir: Path
    keyfile: Path
    env: dict[str, str]
    seed: str
    members: dict[str, dict[str, object]]  # A, B, X -> their `mesh node --json` line
    procs: Processes

    def run(
        self, *args: str, stdin: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`mesh ARGS`; commands that look for members get --wait 10 unless told otherwise:
        they stop looking once the mesh is found, and a busy machine can be slow to find it."""
        if args[0] in WAITING and "--wait" not in args:
            args = (*args, "--wait", "10")
        return subprocess.run(
            [*MESH, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env if env is None else env,
            timeout=30,
            check=False,
        )

    def ok(self, *args: str, stdin: str | None = None) -> str:
        result = self.run(*args, stdin=stdin)
        assert result.returncode == 0, (
            f"mesh {' '.join(args)}: {result.stderr}\nmembers:\n{self.procs.report()}"
        )
        assert "Traceback" not in result.stderr
        return result.stdout

    def json(self, *args: str) -> object:
        return json.loads(self.ok(*args, "--json"))


class Processes:
    """Long-running `mesh` processes, killed at teardown whatever happens; stderr to files."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: list[tuple[subprocess.Popen[str], Path]] = []

    def start(self, *args: str) -> tuple[subprocess.Popen[str], str]:
        log = self.logs / f"mesh-{len(self.procs)}.stderr"
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                [*MESH, *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=self.env
            )
        self.procs.append((proc, log))
        assert proc.stdout is not None
        first = proc.stdout.readline()
        if not first:
            proc.wait(timeout=10)
            pytest.fail(f"mesh {' '.join(args)} exited at once: {log.read_text()}")
        return proc, first

    def report(self) -> str:
        """How each process is doing, for a failing test's message."""
        lines = []
        for proc, log in self.procs:
            state = "running" if proc.poll() is None else f"exited {proc.returncode}"
            lines.append(f"{' '.join(map(str, proc.args[3:]))}: {state}; {log.read_text()[-500:]}")
        return "\n".join(lines)

    def close(self) -> None:
        kill_all((proc for proc, _ in self.procs), drain=True)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir, env = mesh_workdir(tmp_path_factory, "cli", ("*", "db"), **{"exec.sh": EXEC_SCRIPT})
    procs = Processes(env, workdir)
    try:
        node = ["node", "--bind", "tcp://127.0.0.1:0", "--json"]
        _, line = procs.start(*node, "--cluster", "echo", "--prefix", "A:", "--name", "alpha")
        a = json.loads(line)
        seed = str(a["endpoint"])
        _, line = procs.start(*node, "--cluster", "echo", "--cluster", "db", "--prefix", "B:",
                              "--seed", seed, "--name", "brävo-2")  # fmt: skip
        b = json.loads(line)
        command = f"sh {workdir / 'exec.sh'}"
        _, line = procs.start(*node, "--cluster", "ex", "--exec", command, "--exec-timeout",
                              "1", "--seed", seed)  # fmt: skip
        x = json.loads(line)
        ready = Mesh(workdir, workdir / "mesh.keys", env, seed, {"A": a, "B": b, "X": x}, procs)
        deadline = time.monotonic() + 15
        while True:  # until a newcomer sees the whole mesh
            views = ready.json("clusters", "--seed", seed, "--cluster", "echo", "--cluster", "ex")
            counts = {v["cluster"]: v["member_count"] for v in views}  # type: ignore[union-attr]
            if counts == {"db": 1, "echo": 2, "ex": 1}:
                break
            assert time.monotonic() < deadline, f"mesh not formed: {counts}"
        yield ready
    finally:
        procs.close()


# ----------------------------------------------------------------- help


def test_every_command_explains_itself_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    top = subprocess.run([*MESH, "--help"], capture_output=True, text=True, check=True)
    commands = ["keygen", "node", "request", "peers", "clusters", "top", "bench"]
    for name in commands:
        assert name in top.stdout
    for name in commands:  # in-process: the same parser, without 7 interpreter start-ups
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert f"mesh {name}" in text.partition("examples:")[2], name
    with pytest.raises(SystemExit):
        cli.main(["clusters", "--help"])
    assert "sealed under the keys that open them" in capsys.readouterr().out


def test_console_script_and_module_are_the_same_tool() -> None:
    script = Path(sys.executable).with_name("mesh")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable}")
    version = subprocess.run([script, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == irismesh.__version__


# ----------------------------------------------------------------- keygen


def test_keygen_writes_a_private_keyring(tmp_path: Path) -> None:
    path = tmp_path / "new.keys"
    out = subprocess.run(
        [*MESH, "keygen", str(path), "--scope", "*", "--scope", "db"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == f"wrote {path} with keys for: *, db"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert irismesh.Keyring.load(path).scopes == ("*", "db")
    again = subprocess.run(
        [*MESH, "keygen", str(path), "--force", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(again.stdout)
    assert report["path"] == str(path)
    assert [k["scope"] for k in report["keys"]] == ["*"]
    assert len(report["keys"][0]["key_id"]) == 8


def test_identity_new_writes_a_private_identity_a_node_then_holds(
    mesh: Mesh, tmp_path: Path
) -> None:
    path = tmp_path / "a1.identity"
    out = mesh.json("identity", "new", str(path))
    assert isinstance(out, dict)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    identity = Identity.load(path)
    assert out["node_id"] == identity.node_id.hex() == node_id_of(identity.public).hex()
    assert out["public"] == identity.public.hex()
    again = mesh.run("identity", "new", str(path))
    assert again.returncode == 2
    assert "already exists" in again.stderr
    procs = Processes(mesh.env, tmp_path)
    try:
        node = ["node", "--cluster", "echo", "--seed", mesh.seed, "--identity", str(path)]
        _proc, line = procs.start(*node, "--bind", "tcp://127.0.0.1:0", "--json")
        assert json.loads(line)["node_id"] == identity.node_id.hex()
    finally:
        procs.close()


# ----------------------------------------------------------------- node


def test_node_prints_where_it_listens_and_leaves_cleanly_on_sigterm(
    mesh: Mesh, tmp_path: Path
) -> None:
    procs = Processes(mesh.env, tmp_path)
    try:
        proc, line = procs.start("node", "--cluster", "echo", "--seed", mesh.seed)
        assert line.startswith("member of 'echo' listening on tcp://127.0.0.1:"), line
        assert line.rstrip().endswith(f"-{proc.pid})"), line  # named by host and process id
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        err = procs.procs[0][1].read_text()
        assert proc.returncode == 0, err
        assert err == ""
    finally:
        procs.close()


def test_node_json_line_names_endpoint_and_node_id(mesh: Mesh) -> None:
    a = mesh.members["A"]
    assert str(a["endpoint"]).startswith("tcp://127.0.0.1:")
    assert len(str(a["node_id"])) == 32
    assert a["name"] == "alpha"
    assert mesh.members["B"]["clusters"] == ["echo", "db"]


# ----------------------------------------------------------------- request


def test_request_prints_the_reply(mesh: Mesh) -> None:
    assert mesh.ok("request", "--seed", mesh.seed, "echo", "hello") in ("A:hello\n", "B:hello\n")
    assert mesh.ok("request", "--seed", mesh.seed, "ex", "-", stdin="from stdin") == "FROM STDIN\n"


def test_request_count_and_json(mesh: Mesh) -> None:
    out = mesh.ok("request", "--seed", mesh.seed, "echo", "hi", "--count", "3", "--json")
    replies = [json.loads(line) for line in out.splitlines()]
    assert len(replies) == 3
    for reply in replies:
        assert reply["cluster"] == "echo"
        assert reply["reply"] in ("A:hi", "B:hi")
        assert reply["ms"] > 0


def test_request_and_publish_take_a_priority(mesh: Mesh) -> None:
    out = mesh.ok("request", "--seed", mesh.seed, "echo", "hi", "--priority", "high")
    assert out in ("A:hi\n", "B:hi\n")
    assert mesh.ok("request", "--seed", mesh.seed, "echo", "hi", "--priority", "-3")
    mesh.ok("publish", "--seed", mesh.seed, "prio.test", "hi", "--priority", "LOW")
    wrong = mesh.run("request", "--seed", mesh.seed, "echo", "hi", "--priority", "8")
    assert wrong.returncode == 2
    assert "must be low, normal, high or a whole number from -7 to 7" in wrong.stderr


def test_exec_failure_and_timeout_reach_the_caller_as_remote_errors(mesh: Mesh) -> None:
    failed = mesh.run("request", "--seed", mesh.seed, "ex", "fail")
    assert_error(failed, 1, "CommandFailed", "boom: cannot do that (exit status 3)")
    assert "first line" not in failed.stderr  # the last line of stderr only
    hung = mesh.run("request", "--seed", mesh.seed, "ex", "hang")
    assert_error(hung, 1, "TimeoutError", "longer than 1 s")
    assert mesh.ok("request", "--seed", mesh.seed, "ex", "still serving") == "STILL SERVING\n"


def test_exec_commands_run_at_most_concurrency_at_once() -> None:
    """Four 0.2 s commands two at a time take two rounds; the payload is stdin, stdout the reply."""
    script = "import sys, time; time.sleep(0.2); sys.stdout.write(sys.stdin.read()[::-1])"
    handler = CommandHandler(
        [sys.executable, "-c", script], concurrency=2, timeout=5, max_output=1 << 20
    )

    async def main() -> tuple[list[bytes], float]:
        started = time.monotonic()
        replies = await asyncio.gather(*(handler(b"abc%d" % i) for i in range(4)))
        return replies, time.monotonic() - started

    replies, took = asyncio.run(main())
    assert replies == [b"0cba", b"1cba", b"2cba", b"3cba"]
    assert took >= 0.4, f"4 commands of 0.2 s, 2 at a time, took {took:.2f} s"


# ----------------------------------------------------------------- peers, clusters, top


def test_peers_lists_every_member_alive(mesh: Mesh) -> None:
    # A long --wait: the command returns once every peer answered a probe (well under a second
    # here), but a loaded machine must not cut it short with a peer not yet measured.
    out = mesh.ok("peers", "--seed", mesh.seed, "--wait", "15")
    assert "peers (3)" in out
    for member in mesh.members.values():
        assert str(member["endpoint"]) in out
        assert str(member["node_id"])[:12] in out
        row = next(line for line in out.splitlines() if str(member["endpoint"]) in line)
        assert f" {member['name']} " in row  # the name column, on the member's own row
    assert out.count("alive") == 3
    header = next(line for line in out.splitlines() if " node " in line)
    assert " name " in header  # a column of its own
    peers = mesh.json("peers", "--seed", mesh.seed, "--wait", "15")
    assert isinstance(peers, list)
    by_id = {p["node_id"]: p for p in peers}
    assert set(by_id) == {str(m["node_id"]) for m in mesh.members.values()}
    assert {p["name"] for p in peers} >= {"alpha", "brävo-2"}
    assert by_id[mesh.members["X"]["node_id"]]["name"] == mesh.members["X"]["name"]
    assert all(p["state"] == "alive" and p["rtt_ms"] > 0 for p in peers), peers
    assert by_id[mesh.members["B"]["node_id"]]["clusters"] == ["db"]  # the keyring's own scopes


def test_clusters_shows_members_load_and_latency(mesh: Mesh) -> None:
    out = mesh.ok("clusters", "--seed", mesh.seed, "--cluster", "echo")
    assert "clusters (2)" in out  # db (the keyring's scope) and echo
    row = next(line for line in out.splitlines() if " echo " in line)
    assert " 2 " in row
    assert "alpha" in row  # its members, by name
    assert "brävo-2" in row
    views = mesh.json("clusters", "--seed", mesh.seed, "--cluster", "echo", "--cluster", "ex")
    assert isinstance(views, list)
    echo = next(v for v in views if v["cluster"] == "echo")
    ids = {mesh.members["A"]["node_id"], mesh.members["B"]["node_id"]}
    assert set(echo["members"]) == ids
    assert echo["outstanding"] == 0
    assert echo["rtt_ms"] > 0
    assert [v["cluster"] for v in views] == ["db", "echo", "ex"]


def test_top_once_prints_one_frame(mesh: Mesh) -> None:
    out = mesh.ok("top", "--seed", mesh.seed, "--once", "--cluster", "echo")
    for part in ("peers (3)", "clusters (2)", "peers_up", " alpha ", " brävo-2 "):
        assert part in out
    frame = mesh.json("top", "--seed", mesh.seed, "--once")
    assert isinstance(frame, dict)
    assert len(frame["peers"]) == 3
    assert {p["name"] for p in frame["peers"]} >= {"alpha", "brävo-2"}
    assert frame["stats"]["peers_up"]["value"] == 3
    assert frame["stats"]["requests_pending"]["per_second"] is None  # a gauge


def test_top_subscribes_and_shows_publish_to_deliver_latency(mesh: Mesh) -> None:
    """A publisher stamps its first publish with its clock; `mesh top --subscribe` times it."""
    top, first = mesh.procs.start(
        "top", "--seed", mesh.seed, "--json", "--interval", "0.2", "--subscribe", "stamped.#"
    )
    assert "peers" in json.loads(first)
    mesh.ok("publish", "--seed", mesh.seed, "stamped.x", "hi", "--wait-subscribers", "1")
    assert top.stdout is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = top.stdout.readline()
        assert line, f"mesh top ended: {mesh.procs.report()}"
        rows = [r for r in json.loads(line)["latency"] if r["kind"] == "deliver"]
        if rows:
            [row] = rows
            assert row["cluster"] == "stamped"
            assert row["timed"] == 1
            assert 0 < row["p50_us"] < 5e6
            break
    else:
        pytest.fail("no publish-to-deliver latency within 20 s")
    top.kill()


# ----------------------------------------------------------------- bench


def test_bench_reports_throughput_and_percentiles(mesh: Mesh) -> None:
    report = mesh.json("bench", "--seed", mesh.seed, "echo", "-n", "300", "-c", "8", "--size", "64")
    assert isinstance(report, dict)
    assert report["requests"] == report["ok"] == 300
    assert report["errors"] == 0
    assert report["members"] == 2
    latency = report["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert report["requests_per_second"] > 0
    out = mesh.ok("bench", "--seed", mesh.seed, "echo", "-n", "100")
    for part in ("req/s", "p99 ms", "100 requests of 100 B"):
        assert part in out


# ----------------------------------------------------------------- errors


@pytest.fixture
def keyrings(tmp_path: Path) -> dict[str, Path]:
    """Keyrings that are wrong in one way each."""
    paths = {name: tmp_path / f"{name}.keys" for name in ("loose", "db_only", "star_only")}
    irismesh.Keyring.generate().save(paths["loose"])
    paths["loose"].chmod(0o644)
    irismesh.Keyring.generate(["db"]).save(paths["db_only"])
    irismesh.Keyring.generate().save(paths["star_only"])
    return paths


def test_user_mistakes_are_one_line_and_exit_2(
    mesh: Mesh, tmp_path: Path, keyrings: dict[str, Path]
) -> None:
    """One mistake per command, each in a process of its own."""
    seed = ["--seed", mesh.seed]
    no_keys = {k: v for k, v in mesh.env.items() if k != "IRISMESH_KEYFILE"}
    cases: list[tuple[Sequence[str], int, str]] = [
        (["frobnicate"], 2, "invalid choice"),
        (["keygen", str(mesh.keyfile)], 2, "already exists: pass --force"),
        (["node", "--cluster", "echo", "--exec", "no-such-program-here"], 2, "not found"),
        (["request", *seed, "echo", "x", "--timeout", "0"], 2, "--timeout: must be a positive"),
        (["request", *seed, "echo", "x", "--keys", str(keyrings["loose"])], 2, "chmod 600"),
        (["clusters", *seed, "--keys", str(keyrings["star_only"])], 2, "pass --cluster NAME"),
        (["top", *seed, "--interval", "0"], 2, "--interval: must be a positive"),
        (["bench", *seed, "echo", "-n", "0"], 2, "--requests: must be at least 1"),
    ]
    run_all(cases, mesh.env, tmp_path)
    run_all([(["peers", *seed], 2, "no keyring: pass --keys")], no_keys, tmp_path)


def test_more_user_mistakes(
    mesh: Mesh,
    tmp_path: Path,
    keyrings: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same error boundary in-process (`cli.main`), to spare an interpreter per case."""
    monkeypatch.setenv("IRISMESH_KEYFILE", str(mesh.keyfile))
    monkeypatch.delenv("IRISMESH_KEYS", raising=False)
    seed = ["--seed", mesh.seed]
    cases: list[tuple[list[str], str]] = [
        (["keygen", str(tmp_path / "x.keys"), "--scope", "no spaces"], "bad scope name"),
        (["node", "--cluster", "echo", "--bind", "tcp://127.0.0.1:99999"], "bad endpoint"),
        (["node", "--cluster", "echo", "--bind", "tcp://192.0.2.1:7400"], "cannot listen"),
        (["node", "--cluster", "echo", "--exec", "cat", "--prefix", "x"], "not allowed"),
        (["node", "--cluster", "echo", "--exec", "'unclosed"], "bad --exec command"),
        (["node", "--cluster", "two words"], "bad cluster name"),
        (["node", "--cluster", "echo", "--name", "two words"], "--name: bad node name"),
        (["node", "--cluster", "echo", "--name", "x" * 65], "1-64 printable characters"),
        (["request", *seed, "echo", "x", "--count", "-1"], "--count: must be at least 1"),
        (["request", "--seed", "localhost:7400", "echo", "x"], "bad endpoint"),
        (["request", "echo", "x"], "nothing to join"),
        (["request", *seed, "echo", "x", "--keys", str(tmp_path / "none")], "not found"),
        (["request", *seed, "echo", "x", "--keys", str(keyrings["db_only"])], "no key for 'echo'"),
        (["request", *seed, "echo"], "required: PAYLOAD"),
        (["peers", *seed, "--wait", "-1"], "--wait: must be zero or more"),
        (["clusters", *seed, "--keys", str(keyrings["db_only"]), "--cluster", "echo"], "no key"),
        (["top", *seed, "--interval", "soon"], "--interval: must be a number"),
        (["bench", *seed, "echo", "--size", "99999999"], "--size: must be between"),
        (["bench", *seed, "echo", "-c", "1.5"], "must be a whole number"),
    ]
    assert_usage_errors(cases, capsys)


def test_mesh_refusals_are_one_line_and_exit_1(mesh: Mesh, tmp_path: Path) -> None:
    nobody = "tcp://127.0.0.1:9"  # the discard port: nothing of ours listens there
    quick = ["--wait", "0.3"]
    cases: list[tuple[Sequence[str], int, str]] = [
        (["request", "--seed", mesh.seed, "nobody", "x", *quick], 1, "no live member"),
        (["request", "--seed", nobody, "echo", "x", *quick], 1, "no live member after 0.3 s"),
        (["peers", "--seed", nobody, *quick], 1, "no node answered"),
        (["clusters", "--seed", nobody, *quick], 1, "no node answered"),
        (["top", "--seed", nobody, "--once", *quick], 1, "no node answered"),
        (["bench", "--seed", mesh.seed, "nobody", *quick], 1, "no live member"),
    ]
    run_all(cases, mesh.env, tmp_path)
