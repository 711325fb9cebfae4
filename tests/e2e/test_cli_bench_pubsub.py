"""`mesh bench --pubsub` as a user runs it: a publisher and subscribers in the command's own
process, on 127.0.0.1, with nothing else running (no --seed: its nodes form the mesh by
themselves). The request/reply form, `mesh bench CLUSTER`, is tested in test_cli.py.

Each run is a subprocess on a fresh keyring (no IRISMESH_KEYFILE from the environment). The
loss and reorder accounting is checked in-process, with a publish that drops one message and
swaps two.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from helpers import MESH, run_mesh

import irismesh
from irismesh import cli
from irismesh._cli import bench


@pytest.fixture
def keyfile(tmp_path: Path) -> Path:
    path = tmp_path / "fresh.keys"
    irismesh.Keyring.generate().save(path)
    return path


@pytest.fixture
def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IRISMESH_")}
    return dict(clean, COLUMNS="160")


def mesh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_mesh(args, env, timeout=30)


def ok(env: dict[str, str], *args: str) -> str:
    result = mesh(env, *args)
    assert result.returncode == 0, f"mesh {' '.join(args)}: {result.stderr}"
    assert result.stderr == "", result.stderr  # no terminal: no progress bar, no spinner
    return result.stdout


def test_pubsub_bench_forms_its_own_mesh_and_loses_nothing(
    keyfile: Path, env: dict[str, str]
) -> None:
    report = json.loads(ok(env, "bench", "--keys", str(keyfile), "--pubsub", "--messages",
                           "2000", "--json"))  # fmt: skip
    assert report["topic"].startswith("bench.")
    assert report["subscribers"] == 1
    assert report["messages"] == report["received"] == 2000
    assert report["lost"] == report["out_of_order"] == 0
    assert report["size"] == 100
    assert report["rate"] is None
    latency = report["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"] < 10_000
    assert latency["p50"] <= latency["mean"] * 10
    assert 0 < report["seconds"] < 20
    assert report["messages_per_second"] == pytest.approx(2000 / report["seconds"], rel=0.01)
    assert report["deliveries_per_second"] == report["messages_per_second"]


def test_pubsub_bench_default_topics_differ(keyfile: Path, env: dict[str, str]) -> None:
    """Two runs side by side must not mix: each makes up its own topic."""
    argv = [*MESH, "bench", "--keys", str(keyfile), "--pubsub", "--messages", "500", "--json"]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [proc.communicate(timeout=30) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    reports = [json.loads(out) for out, _ in outs]
    assert reports[0]["topic"] != reports[1]["topic"]
    for report in reports:
        assert report["received"] == 500
        assert report["lost"] == report["out_of_order"] == 0


def test_pubsub_bench_prints_a_table(keyfile: Path, env: dict[str, str]) -> None:
    out = ok(env, "bench", "--keys", str(keyfile), "--pubsub", "feeds.bench", "--messages",
             "1000", "--size", "64", "--subscribers", "2", "--bind", "tcp://*:0")  # fmt: skip
    title = "bench pubsub 'feeds.bench': 1000 messages of 64 B, 2 subscriber(s)"
    assert title in out
    for column in ("msg/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "received", "lost"):
        assert column in out
    assert "out of order" in out
    row = out.splitlines()[-2]  # the one row, above the table's bottom border
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells[5:8] == ["2000", "0", "0"], row  # received (1000 each), lost, out of order


def test_pubsub_bench_keeps_to_its_rate(keyfile: Path, env: dict[str, str]) -> None:
    report = json.loads(ok(env, "bench", "--keys", str(keyfile), "--pubsub", "--messages",
                           "400", "--rate", "2000", "--size", "16", "--json"))  # fmt: skip
    assert report["received"] == 400
    assert report["rate"] == 2000
    assert report["size"] == 16
    assert report["seconds"] >= 399 / 2000 - 1e-3  # the last one was not due before that


def test_pubsub_bench_mistakes_are_one_line_and_exit_2(keyfile: Path, env: dict[str, str]) -> None:
    result = mesh(env, "bench", "--keys", str(keyfile), "--pubsub", "--messages", "0")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "mesh: argument --messages: must be at least 1, got '0' (see `mesh bench --help`)"
    ]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--pubsub", "--messages", "lots"], "--messages: must be a whole number"),
        (["--pubsub", "--messages", "-5"], "--messages: must be at least 1"),
        (["--pubsub", "--subscribers", "0"], "--subscribers: must be at least 1"),
        (["--pubsub", "--rate", "0"], "--rate: must be a positive number"),
        (["--pubsub", "--size", "15"], "--size: must be at least 16 bytes with --pubsub"),
        (["--pubsub", "feeds.*"], "bad topic 'feeds.*'"),
        (["--pubsub", "--wait", "-1"], "--wait: must be zero or more"),
        (["--pubsub", "-n", "10"], "--requests goes with CLUSTER only"),
        (["--pubsub", "-c", "10"], "--concurrency goes with CLUSTER only"),
        (["echo", "--pubsub"], "CLUSTER ('echo') is for request/reply"),
        (["echo", "--messages", "10"], "--messages goes with --pubsub only"),
        (["echo", "--subscribers", "2"], "--subscribers goes with --pubsub only"),
        (["echo", "--rate", "10"], "--rate goes with --pubsub only"),
        ([], "pass CLUSTER to measure request/reply, or --pubsub"),
    ],
)
def test_more_pubsub_bench_mistakes(
    argv: list[str], fragment: str, keyfile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process (`cli.main`): the same error boundary without an interpreter per case."""
    seed = ["--seed", "tcp://127.0.0.1:9"]  # never dialled: each case fails before it joins
    status: int | str | None
    try:
        status = cli.main(["bench", "--keys", str(keyfile), *seed, *argv])
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert status == 2, captured.err
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("mesh: "), captured.err
    assert fragment in lines[0]
    assert captured.out == ""


def test_no_key_for_the_topic_is_a_user_mistake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keyfile = tmp_path / "db.keys"
    irismesh.Keyring.generate(["db"]).save(keyfile)  # no default key '*'
    status = cli.main(["bench", "--keys", str(keyfile), "--pubsub", "feeds.x"])
    lines = capsys.readouterr().err.splitlines()
    assert status == 2
    assert len(lines) == 1
    assert lines[0].startswith("mesh: ")
    assert "feeds" in lines[0]


Publish = Callable[..., Awaitable[int]]


@pytest.fixture
def lossy_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node.publish, but message 5 is never sent and message 10 goes after message 11."""
    real: Publish = irismesh.Node.publish
    held: list[bytes] = []

    async def publish(self: irismesh.Node, topic: str, payload: bytes, **kw: float) -> int:
        seq = bench.HEADER.unpack_from(payload)[1]
        if seq == 5:
            return 1
        if seq == 10:
            held.append(payload)
            return 1
        sent = await real(self, topic, payload, **kw)
        if seq == 11:
            await real(self, topic, held.pop(), **kw)
        return sent

    monkeypatch.setattr(irismesh.Node, "publish", publish)


@pytest.mark.usefixtures("lossy_publish")
def test_losses_and_reordering_are_counted_and_exit_1(
    keyfile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--keys", str(keyfile), "--pubsub", "--messages", "300", "--json"]
    status = cli.main([*argv, "--timeout", "0.5"])  # the subscriber stops waiting for no. 5
    captured = capsys.readouterr()
    assert status == 1, captured.err
    report = json.loads(captured.out)
    assert report["received"] == 299
    assert report["lost"] == 1
    assert report["out_of_order"] == 1
    assert captured.err.splitlines() == [
        "mesh: 1 of 300 message(s) lost, 1 out of order (no subscriber may lose or reorder one)"
    ]
