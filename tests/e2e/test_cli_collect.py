"""`mesh telemetry collect` as a user runs it, against a small mesh whose nodes export.

The mesh is a process of its own (NODES below): a member of "db" and a client sending it
requests, both with telemetry and an exporter (`attach_exporter`, exported every 0.1 s as the
node's telemetry loop does).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import MESH, assert_error, mesh_workdir, run_mesh

import irismesh
from irismesh.telemetry.spool import SpoolReader, complete_files, decode_spool

NODES = """\
import asyncio, json, sys
import irismesh
from irismesh.node import TelemetryConfig
from irismesh.telemetry.export import attach_exporter

async def main(keyfile, spool):
    keys = irismesh.Keyring.load(keyfile)
    config = TelemetryConfig(spool_dir=spool, sample_every=1, gauge_interval=0.2)
    async with irismesh.Node("db", keyring=keys, telemetry=config) as member:
        member.on_request(lambda payload: payload)
        async with irismesh.Node(keyring=keys, seeds=[member.endpoint], telemetry=config) as client:
            nodes = [member, client]
            exporters = [attach_exporter(node) for node in nodes]
            await client.wait_for_members("db", timeout=10)
            ids = [node.node_id.hex() for node in nodes]
            print(json.dumps({"endpoint": member.endpoint, "nodes": ids}), flush=True)
            while True:
                await client.request("db", b"x")
                for node, exporter in zip(nodes, exporters):
                    await exporter.export(node.publish)
                await asyncio.sleep(0.1)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@dataclass
class Mesh:
    keyfile: Path
    env: dict[str, str]
    seed: str
    nodes: list[str]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir, env = mesh_workdir(tmp_path_factory, "collect")
    keyfile = workdir / "mesh.keys"
    cmd = [sys.executable, "-c", NODES, str(keyfile), str(workdir / "local")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the mesh process exited at once"
        started = json.loads(line)
        yield Mesh(keyfile, env, started["endpoint"], started["nodes"])
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def collect(mesh: Mesh, *args: str) -> subprocess.CompletedProcess[str]:
    return run_mesh(["telemetry", "collect", *args], mesh.env, timeout=30)


def assert_spool(out: Path, summary: dict[str, object], nodes: list[str]) -> None:
    """--out holds complete files only, which read back to what the summary says."""
    files = complete_files(out)
    assert not [p for p in out.iterdir() if p not in files], "temporary files left"
    assert summary["files"] == len(files) >= len(nodes)
    reader = SpoolReader(out)
    by_node = Counter(r.node for r in reader)
    assert reader.corrupt == 0
    assert dict(by_node) == summary["nodes"]
    assert sum(by_node.values()) == summary["records"]
    for path in files:
        assert decode_spool(path.read_bytes()).node == path.name.partition("-")[0]


def test_collect_for_some_seconds_writes_every_node_s_spool(mesh: Mesh, tmp_path: Path) -> None:
    out = tmp_path / "spool" / "deep"  # made if need be
    result = collect(mesh, "--seed", mesh.seed, "--out", str(out), "--seconds", "1.5", "--json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout)
    assert summary["out"] == str(out.resolve())
    assert set(summary["nodes"]) == set(mesh.nodes)
    assert all(n > 0 for n in summary["nodes"].values())
    assert summary["records"] == sum(summary["nodes"].values())
    assert summary["messages"] > 0
    assert summary["bytes"] > 0
    assert (summary["corrupt"], summary["rejected"], summary["missed"], summary["dropped"]) == (
        0,
        0,
        0,
        0,
    )
    assert 1.5 <= summary["seconds"] < 10
    assert_spool(out, summary, mesh.nodes)
    progress = result.stderr.splitlines()  # not a terminal: a plain line when counts change
    assert progress
    assert all(line.startswith("collecting: ") for line in progress)


def test_ctrl_c_stops_collect_with_complete_files_and_a_summary(mesh: Mesh, tmp_path: Path) -> None:
    out = tmp_path / "spool"
    cmd = [*MESH, "telemetry", "collect", "--seed", mesh.seed, "--out", str(out)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mesh.env
    )
    watchdog = threading.Timer(20, proc.kill)  # readline() below returns "" if it fires
    watchdog.start()
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the first progress line: records are coming
        assert line.startswith("collecting: "), f"no progress shown: {line!r}"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=15)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    first, *per_node = stdout.splitlines()
    assert first.startswith("collected ")
    assert f"records from {len(mesh.nodes)} nodes" in first
    assert {row.split()[0] for row in per_node} == {n[:12] for n in mesh.nodes}
    records = sum(int(row.split()[1]) for row in per_node)
    files = complete_files(out)
    assert files
    assert not [p for p in out.iterdir() if p not in files]
    assert sum(1 for _ in SpoolReader(out)) == records


def test_collect_explains_itself_and_refuses_mistakes_in_one_line(
    mesh: Mesh, tmp_path: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    only_db = tmp_path / "db.keys"
    irismesh.Keyring.generate(["db"]).save(only_db)
    seed = ["--seed", mesh.seed]
    cases = [  # (arguments, exit status, fragment of the one line on stderr)
        ([*seed, "--out", str(a_file)], 2, "not a directory"),
        (["--out", str(tmp_path / "x")], 2, "nothing to join"),
        (seed, 2, "--out"),
        ([*seed, "--out", str(tmp_path / "x"), "--seconds", "0"], 2, "--seconds"),
        (["--keys", str(only_db), *seed, "--out", str(tmp_path / "x")], 2, "'_mesh'"),
        # Nobody there: a mesh problem, exit status 1.
        (
            ["--seed", "tcp://127.0.0.1:9", "--out", str(tmp_path / "y"), "--seconds", "0.5"],
            1,
            "no node of the mesh answered",
        ),
    ]
    procs = [  # all at once: each pays an interpreter's start-up
        subprocess.Popen(
            [*MESH, "telemetry", "collect", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=mesh.env,
        )
        for argv, _, _ in cases
    ]
    help_ = subprocess.run([*MESH, "telemetry", "collect", "--help"], capture_output=True,
                           text=True, env=mesh.env, check=True)  # fmt: skip
    try:
        for proc, (argv, status, fragment) in zip(procs, cases, strict=True):
            out, err = proc.communicate(timeout=30)
            result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
            assert_error(result, status, fragment)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert "mesh telemetry collect" in help_.stdout.partition("examples:")[2]
    assert "--seconds" in help_.stdout
