"""Traces across processes: A asks B, B (in its handler) asks C and publishes an event D
consumes; each process has an OpenTelemetry SDK and writes its finished spans to a file.
One trace, whose parent chain runs A to B to C and B to D; the same through two gateways
between two meshes (`mesh gateway` processes, which make no spans and pass context on)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import kill_all

import irismesh

pytest.importorskip("opentelemetry.sdk.trace", reason="the tracing tests need opentelemetry-sdk")

WORKER = str(Path(__file__).resolve().parent.parent / "trace_worker.py")
LOCAL = "tcp://127.0.0.1:0"
Span = dict[str, Any]


class Processes:
    """Worker and `mesh` processes, killed at teardown whatever happens."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str, cmd: list[str], keyfile: str) -> dict[str, str]:
        env = dict(os.environ, IRISMESH_KEYFILE=keyfile)
        env.pop("IRISMESH_KEYS", None)
        env.pop("IRISMESH_TRACING", None)
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.procs[name] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"{name} did not start"
        return json.loads(line)  # type: ignore[no-any-return]

    def worker(self, role: str, keyfile: str, *argv: str) -> str:
        spans = str(self.tmp / f"{role}.json")
        cmd = [sys.executable, WORKER, "--role", role, "--spans", spans, *argv]
        return self.start(role, cmd, keyfile)["endpoint"]

    def finish(self, role: str) -> list[Span]:
        """Close the worker's stdin, wait for it to leave, and read its spans."""
        proc = self.procs[role]
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, f"{role} failed"
        return json.loads((self.tmp / f"{role}.json").read_text())  # type: ignore[no-any-return]

    def close(self) -> None:
        kill_all(self.procs.values())


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with contextlib.closing(Processes(tmp_path)) as group:
        yield group


def keyfile(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.keys"
    irismesh.Keyring.generate().save(path)
    return str(path)


def one(spans: list[Span], kind: str, name: str) -> Span:
    found = [s for s in spans if s["kind"] == kind and s["name"] == name]
    assert len(found) == 1, f"{kind} {name!r} in {[(s['kind'], s['name']) for s in spans]}"
    return found[0]


def check_the_trace(spans: dict[str, list[Span]]) -> None:
    """One trace: A's call the root, B's run its child, C's and D's spans B's descendants."""
    a_call = one(spans["a"], "CLIENT", "b/request")
    b_run = one(spans["b"], "SERVER", "b/request")
    b_call = one(spans["b"], "CLIENT", "c/request")
    b_publish = one(spans["b"], "PRODUCER", "publish events.done")
    c_run = one(spans["c"], "SERVER", "c/request")
    d_process = one(spans["d"], "CONSUMER", "process events.done")
    call = [a_call, b_run, b_call, b_publish, c_run, d_process]
    assert {span["trace_id"] for span in call} == {a_call["trace_id"]}
    every = [span for role in "abcd" for span in spans[role]]
    assert [s for s in every if s["trace_id"] == a_call["trace_id"] and s not in call] == []
    assert a_call["parent_id"] is None
    assert b_run["parent_id"] == a_call["span_id"]
    assert b_call["parent_id"] == b_run["span_id"]
    assert c_run["parent_id"] == b_call["span_id"]
    assert b_publish["parent_id"] == b_run["span_id"]
    assert d_process["parent_id"] == b_publish["span_id"]
    assert a_call["attributes"] == {
        "rpc.system": "irismesh",
        "rpc.service": "b",
        "rpc.method": "request",
    }
    assert c_run["attributes"]["rpc.service"] == "c"
    assert b_publish["attributes"]["messaging.system"] == "irismesh"
    assert b_publish["attributes"]["messaging.destination.name"] == "events.done"
    assert d_process["attributes"]["messaging.destination.name"] == "events.done"
    assert all(span["status"] == "UNSET" for span in call)


def test_one_trace_runs_from_a_through_b_to_c_and_d(tmp_path: Path, procs: Processes) -> None:
    keys = keyfile(tmp_path, "mesh")
    c = procs.worker("c", keys)
    d = procs.worker("d", keys)
    b = procs.worker("b", keys, "--seed", c, "--seed", d)
    procs.worker("a", keys, "--seed", b)
    spans = {role: procs.finish(role) for role in "adbc"}
    check_the_trace(spans)


def test_one_trace_runs_through_gateways_between_two_meshes(
    tmp_path: Path, procs: Processes
) -> None:
    """A is in mesh one; B, C and D in mesh two, which exports cluster b to mesh one."""
    one_keys, two_keys = keyfile(tmp_path, "one"), keyfile(tmp_path, "two")
    link_keys = keyfile(tmp_path, "link")
    c = procs.worker("c", two_keys)
    d = procs.worker("d", two_keys)
    b = procs.worker("b", two_keys, "--seed", c, "--seed", d)
    mesh = [sys.executable, "-m", "irismesh", "gateway", "--link-keys", link_keys]
    mesh += ["--bind", LOCAL, "--no-discovery", "--json"]
    exporting = [*mesh, "--mesh", "two", "--keys", two_keys, "--seed", b, "--export", "b"]
    far = procs.start("gateway-two", [*exporting, "--listen", LOCAL], two_keys)["endpoint"]
    importing = [*mesh, "--mesh", "one", "--keys", one_keys, "--peer", far]
    near = procs.start("gateway-one", importing, one_keys)["node_endpoint"]
    procs.worker("a", one_keys, "--seed", near)
    spans = {role: procs.finish(role) for role in "adbc"}
    check_the_trace(spans)
