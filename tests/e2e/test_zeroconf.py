"""Zero configuration as a user meets it: `mesh keygen`, then commands with no other flag;
contexts; the order and wording of the first errors; shell completion.

Every process here runs with its own config directory (XDG_CONFIG_HOME) and, where it says
so, with discovery on (on 127.0.0.1); the other tests of the suite run with it off.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MESH, assert_error, kill_all, run_mesh

import irismesh
from irismesh._cli import config

TIMEOUT = 30  # any one command; each waits on its own deadline well within it


class Env:
    """An environment of a user who has nothing set up: a config directory of their own."""

    def __init__(self, home: Path, *, discovery: bool) -> None:
        self.home = home
        self.vars = {k: v for k, v in os.environ.items() if not k.startswith("IRISMESH_")}
        self.vars["XDG_CONFIG_HOME"] = str(home)
        if not discovery:
            self.vars["IRISMESH_DISCOVERY"] = "0"
        self.procs: list[subprocess.Popen[str]] = []

    @property
    def keyfile(self) -> Path:
        return self.home / "irismesh" / "mesh.keys"

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return run_mesh(args, {**self.vars, **env}, timeout=TIMEOUT)

    def ok(self, *args: str, **env: str) -> str:
        result = self.run(*args, **env)
        assert result.returncode == 0, f"mesh {' '.join(args)}: {result.stderr}"
        assert "Traceback" not in result.stderr
        return result.stdout

    def start(self, argv: list[str]) -> str:
        """A long-running process; its first line of output."""
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.vars
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # each prints one as soon as it is up
        if not line:
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"{argv} exited at once: {err}")
        return line

    def close(self) -> None:
        kill_all(self.procs, drain=True)


@pytest.fixture
def user(tmp_path: Path) -> Iterator[Env]:
    with contextlib.closing(Env(tmp_path / "config", discovery=True)) as env:
        yield env


@pytest.fixture
def seeded(tmp_path: Path) -> Iterator[Env]:
    with contextlib.closing(Env(tmp_path / "config", discovery=False)) as env:
        yield env


def test_keygen_then_node_and_request_with_no_other_flag(user: Env) -> None:
    out = user.ok("keygen")
    assert out.strip() == f"wrote {user.keyfile} with keys for: *"
    assert stat.S_IMODE(user.keyfile.stat().st_mode) == 0o600
    assert stat.S_IMODE(user.keyfile.parent.stat().st_mode) == 0o700
    assert_error(user.run("keygen"), 2, "already exists: pass --force")
    line = user.start([*MESH, "node", "--cluster", "echo", "--prefix", "A:"])
    assert line.startswith("member of 'echo' listening on tcp://127.0.0.1:"), line
    assert user.ok("request", "echo", "hi", "--wait", "20") == "A:hi\n"


def test_subscribe_first_then_publish_with_no_flags(user: Env) -> None:
    """A subscriber alone on the machine waits to be found instead of failing."""
    user.ok("keygen")
    proc = subprocess.Popen(
        [*MESH, "subscribe", "news.#", "--count", "1", "--timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=user.vars,
    )
    user.procs.append(proc)
    assert proc.stderr is not None
    assert proc.stderr.readline().startswith("mesh: subscribed to 'news.#'")
    out = user.ok("publish", "news.world", "hello", "--wait-subscribers", "1", "--wait", "20")
    assert "reached 1 node" in out, out
    printed, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0
    assert "hello" in printed


def test_two_library_programs_passing_only_a_cluster_and_a_keyring(user: Env) -> None:
    user.ok("keygen")
    member = textwrap.dedent(
        f"""
        import asyncio, irismesh

        async def main():
            keys = irismesh.Keyring.load({str(user.keyfile)!r})
            async with irismesh.Node("echo", keyring=keys) as node:
                node.on_request(lambda payload: b"lib:" + payload)
                print("READY", flush=True)
                await asyncio.Event().wait()

        irismesh.run(main())
        """
    )
    client = textwrap.dedent(
        f"""
        import irismesh
        from irismesh import sync

        keys = irismesh.Keyring.load({str(user.keyfile)!r})
        with sync.Node(keyring=keys) as node:
            node.wait_for_members("echo", timeout=20)
            print(node.request("echo", b"hi", timeout=5).decode())
        """
    )
    assert user.start([sys.executable, "-c", member]).strip() == "READY"
    result = subprocess.run(
        [sys.executable, "-c", client],
        capture_output=True,
        text=True,
        env=user.vars,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "lib:hi\n"


def test_context_gives_its_keyring_and_seeds(seeded: Env, tmp_path: Path) -> None:
    prod_keys = tmp_path / "prod.keys"
    seeded.ok("keygen", str(prod_keys), "--scope", "db")
    seeded.ok("keygen")  # the default keyring: another mesh, which must not be used
    line = seeded.start(
        [*MESH, "node", "--keys", str(prod_keys), "--cluster", "db", "--prefix", "v:", "--json"]
    )
    endpoint = json.loads(line)["endpoint"]
    out = seeded.ok("context", "add", "prod", "--keys", str(prod_keys), "--seed", endpoint)
    assert "context 'prod' saved in" in out
    assert seeded.ok("--context", "prod", "request", "db", "k", "--wait", "20") == "v:k\n"
    assert seeded.ok("request", "--context", "prod", "db", "k", "--wait", "20") == "v:k\n"
    # Without it: no seeds, and the default keyring, of another mesh.
    assert_error(seeded.run("request", "db", "k"), 2, "nothing to join")
    other = seeded.run("request", "db", "k", "--seed", endpoint, "--wait", "0.5")
    assert_error(other, 1, "no live member", "same keyring there?")
    listed = json.loads(seeded.ok("context", "ls", "--json"))
    assert listed == [
        {
            "name": "prod",
            "current": False,
            "keyring": str(prod_keys),
            "seeds": [endpoint],
            "interface": None,
        }
    ]
    assert "current context: 'prod'" in seeded.ok("context", "use", "prod")
    assert seeded.ok("request", "db", "k", "--wait", "20") == "v:k\n"
    assert seeded.ok("context", "ls", "--names") == "prod\n"
    assert "* " in seeded.ok("context", "ls")
    seeded.ok("context", "use", "--none")
    assert_error(seeded.run("--context", "dev", "peers"), 2, "no context 'dev'", "contexts: prod")
    assert_error(seeded.run("context", "add", "prod"), 2, "already exists in", "pass --force")
    seeded.ok("context", "rm", "prod")
    assert seeded.ok("context", "ls").startswith("no contexts yet")


def test_survey_flag_discovers_even_with_discovery_off(seeded: Env) -> None:
    seeded.ok("keygen")
    line = seeded.start([*MESH, "node", "--cluster", "echo", "--prefix", "S:", "--survey"])
    assert line.startswith("member of 'echo'"), line
    assert seeded.ok("request", "echo", "hi", "--survey", "--wait", "20") == "S:hi\n"


def test_first_errors_come_in_order_and_name_their_fix(seeded: Env, tmp_path: Path) -> None:
    # No keyring anywhere comes first, before there being nothing to join.
    assert_error(
        seeded.run("request", "echo", "x"),
        2,
        "no keyring: pass --keys FILE, set IRISMESH_KEYFILE, or run `mesh keygen`",
        str(seeded.keyfile),
    )
    seeded.ok("keygen")
    assert_error(seeded.run("peers"), 2, "nothing to join: pass --seed", "IRISMESH_DISCOVERY=0")
    assert_error(
        seeded.run("peers", "--no-discovery", IRISMESH_DISCOVERY="1"), 2, "(--no-discovery"
    )
    assert_error(seeded.run("peers", IRISMESH_DISCOVERY="maybe"), 2, "IRISMESH_DISCOVERY='maybe'")
    assert_error(seeded.run("peers", IRISMESH_SEEDS="127.0.0.1:7400"), 2, "IRISMESH_SEEDS: bad")
    assert_error(
        seeded.run("peers", "--seed", "tcp://127.0.0.1:1", IRISMESH_TRANSPORT="udp"),
        2,
        "IRISMESH_TRANSPORT='udp': expected one of tcp, zmq",
    )
    # An address that is no address: refused before any node exists (the addresses refused
    # for being no one interface's are checked without a process, in test_discovery_default).
    assert_error(seeded.run("peers", "--interface", "999.0.0.1"), 2, "--interface: bad interface")
    assert_error(seeded.run("peers", "--survey", "--no-discovery"), 2, "not allowed with")
    bad = tmp_path / "bad.toml"
    bad.write_text('current = "prod"\n\n[contexts.prod]\nseeds = ["10.0.0.5:7400"]\n')
    assert_error(
        seeded.run("peers", IRISMESH_CONFIG=str(bad)), 2, f"{bad} line 4: context 'prod': seeds"
    )
    bad.write_text("[contexts.prod]\nkeyring = /etc/k\n")
    assert_error(seeded.run("peers", IRISMESH_CONFIG=str(bad)), 2, f"{bad} line 2: Invalid")


def test_config_file_round_trips_awkward_names_and_paths(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "config.toml"
    written = config.Config(path=path, current="a.b-c")
    odd = tmp_path / 'dir "quoted" \\ and ünïcode' / "k.keys"
    written.contexts["a.b-c"] = config.Context(
        name="a.b-c", keyring=odd, seeds=("tcp://[::1]:7400",), interface="127.0.0.1"
    )
    written.contexts["plain"] = config.Context(name="plain")
    written.save()
    read = config.load(path)
    assert read.current == "a.b-c"
    assert read.contexts == written.contexts
    relative = tmp_path / "rel.toml"
    relative.write_text('[contexts.x]\nkeyring = "keys/x.keys"\n')
    assert config.load(relative).get("x").keyring == tmp_path / "keys" / "x.keys"
    assert config.load(tmp_path / "missing.toml").contexts == {}
    bad = tmp_path / "c.toml"
    bad.write_text('colour = "red"\n')
    with pytest.raises(irismesh.ConfigurationError, match="line 1: unknown setting 'colour'"):
        config.load(bad)
    bad.write_text('current = "nope"\n')
    with pytest.raises(irismesh.ConfigurationError, match="line 1: current = 'nope' names no"):
        config.load(bad)


def test_completion_scripts_for_bash_and_zsh(user: Env) -> None:
    bash = user.ok("completion", "bash")
    for word in (
        "request",
        "context",
        "completion",
        "--no-discovery",
        "--context",
        "_mesh_contexts",
    ):
        assert word in bash, word
    checked = subprocess.run(
        ["bash", "-n"], input=bash, text=True, capture_output=True, check=False
    )
    assert checked.returncode == 0, checked.stderr
    zsh = user.ok("completion", "zsh")
    assert zsh.startswith("#compdef mesh")
    assert "--interface" in zsh
    if shutil.which("zsh"):
        checked = subprocess.run(["zsh", "-n"], input=zsh, text=True, capture_output=True)
        assert checked.returncode == 0, checked.stderr
    assert_error(user.run("completion", "tcsh"), 2, "invalid choice")
