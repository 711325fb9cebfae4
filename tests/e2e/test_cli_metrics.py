"""`--metrics` on `mesh memory` and `mesh gateway`: their nodes' metrics, scraped over HTTP.
(`mesh node --metrics` is scraped by the real Prometheus in test_prometheus.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import MESH, run_all
from prometheus_client.parser import text_string_to_metric_families

import irismesh

LOCAL = "tcp://127.0.0.1:0"


def scrape(address: str) -> dict[str, set[str]]:
    """Metric family names (a counter's without _total) -> the `node` labels of its samples."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        nodes = found.setdefault(family.name, set())
        nodes.update(s.labels["node"] for s in family.samples if "node" in s.labels)
    return found


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def start(procs: list[subprocess.Popen[str]], *argv: str, env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.Popen([*MESH, *argv], stdout=subprocess.PIPE, text=True, env=env)
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"mesh {' '.join(argv)} did not start"
    return json.loads(line)  # type: ignore[no-any-return]


def test_a_memory_member_serves_its_store_figures(
    tmp_path: Path, keyfile: Path, started: list[subprocess.Popen[str]]
) -> None:
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    argv = ["memory", "--data", str(tmp_path / "memory"), "--bind", LOCAL, "--json"]
    info = start(started, *argv, "--metrics", "127.0.0.1:0", env=env)
    found = scrape(str(info["metrics"]))
    assert len(found["irismesh_memory_paths"]) == 1
    assert len(found["irismesh_memory_jobs_pending"]) == 1


def test_a_gateway_serves_every_node_it_makes_and_its_own_counters(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    a_file, b_file = tmp_path / "a.keys", tmp_path / "b.keys"
    irismesh.Keyring.generate().save(a_file)
    irismesh.Keyring.generate().save(b_file)
    argv = ["gateway", "--mesh", "a", "--keys", str(a_file), "--bind", LOCAL, "--no-discovery"]
    argv += ["--json", "--export", "db", "--join", f"b;keys={b_file};discovery=off"]
    info = start(started, *argv, "--metrics", "127.0.0.1:0", "--name", "gw", env=dict(os.environ))
    found = scrape(str(info["metrics"]))
    # Both meshes' gateway nodes and the node serving the exported cluster in mesh b, on one
    # port, told apart by the node label (the two named alike by their ids).
    nodes = found["irismesh_members"]
    assert len(nodes) == 3, nodes
    assert "gw" in nodes, nodes
    assert len(found["irismesh_gateway_links_up"]) == 2  # a gauge of the gateways' stats
    assert len(found["irismesh_gateway_duplicates_dropped"]) == 2  # and a counter


def test_a_bad_metrics_address_is_a_usage_error(keyfile: Path, tmp_path: Path) -> None:
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    run_all(
        [
            (["node", "--cluster", "x", "--metrics", "somewhere:1"], 2, "bad metrics address"),
            (["memory", "--data", str(tmp_path), "--metrics", "127.0.0.1:70000"], 2, "bad metrics"),
        ],
        env,
    )


def test_the_env_var_serves_a_mesh_node(
    keyfile: Path, started: list[subprocess.Popen[str]]
) -> None:
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile), IRISMESH_METRICS="127.0.0.1:0")
    info = start(started, "node", "--cluster", "echo", "--bind", LOCAL, "--json", env=env)
    assert "irismesh_requests" in scrape(str(info["metrics"]))  # the family of _total
