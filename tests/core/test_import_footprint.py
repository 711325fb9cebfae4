"""What `import irismesh` loads: what a node needs to request, serve, publish and subscribe.

The federation, the memory's protocol and store (SQLite), zmq, zeroconf, rich, Spark, the
telemetry spool and discovery's mechanisms (the survey, mDNS: their settings load with the
node) load when first used. Each check runs in a fresh interpreter, since this
process has loaded most of them already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Loaded when first used, never by `import irismesh`.
LAZY = (
    "zmq",
    "zeroconf",
    "sqlite3",
    "_sqlite3",
    "rich",
    "pyspark",
    "pyarrow",
    "prometheus_client",
    "opentelemetry",
    "shtab",
    "tempfile",
    "shlex",
    # cryptography's key serialization (PEM, DER, SSH keys, bcrypt): raw Ed25519 bytes need none.
    "cryptography.hazmat.primitives.serialization",
    "bcrypt",
    "irismesh.federation",
    "irismesh.memory.store",
    "irismesh.memory.service",
    "irismesh.memory.jobs",
    "irismesh.data.replicas",
    "irismesh.data.types",
    "irismesh.telemetry.spool",
    "irismesh.telemetry.export",
    "irismesh._zmqdriver",
    "irismesh.sync",
    "irismesh.cli",
    "irismesh.discovery.survey",
    "irismesh.discovery.sealed",
    "irismesh.discovery.mdns",
)


def _loaded(code: str) -> set[str]:
    """The modules loaded after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    # The defaults: a suite run with IRISMESH_TRANSPORT=zmq rightly loads zmq in a node.
    unset = ("IRISMESH_TRACING", "IRISMESH_TRANSPORT")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def _lazy_among(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in LAZY))


def test_import_irismesh_loads_no_optional_part() -> None:
    loaded = _loaded("import irismesh")
    assert "irismesh.node" in loaded
    assert _lazy_among(loaded) == []


def test_a_running_node_loads_no_optional_part() -> None:
    # A member and a client over TCP links: a request, a publish and a subscription.
    code = """
import asyncio, irismesh
keys = irismesh.Keyring.generate()
async def main():
    async with irismesh.Node("echo", keyring=keys, discovery=False) as member:
        member.on_request(lambda payload: payload)
        seeds = [member.endpoint]
        async with irismesh.Node(keyring=keys, discovery=False, seeds=seeds) as client:
            await client.wait_for_members("echo", timeout=10)
            assert await client.request("echo", b"hi", timeout=5) == b"hi"
            async with member.subscribe("news.#") as sub:
                await client.wait_for_subscribers("news.x", timeout=10)
                await client.publish("news.x", b"m")
                assert (await asyncio.wait_for(sub.__anext__(), 5)).payload == b"m"
irismesh.run(main())
"""
    loaded = _loaded(code)
    assert _lazy_among(loaded) == []


def test_a_node_with_discovery_loads_the_survey_and_not_mdns() -> None:
    code = """
import irismesh
async def main():
    keys = irismesh.Keyring.generate()
    async with irismesh.Node("echo", keyring=keys, discovery=True) as node:
        assert node.stats["survey_questions_sent"] >= 0
irismesh.run(main())
"""
    loaded = _loaded(code)
    assert "irismesh.discovery.survey" in loaded
    assert "irismesh.discovery.mdns" not in loaded


def test_the_thread_pool_loads_with_the_first_blocking_handler() -> None:
    pool = "concurrent.futures.thread"
    assert pool not in _loaded("import irismesh")
    code = """
import irismesh
async def main():
    keys = irismesh.Keyring.generate()
    async with irismesh.Node("echo", keyring=keys, discovery=False) as node:
        node.on_request(lambda payload: payload, blocking=True)
irismesh.run(main())
"""
    assert pool in _loaded(code)


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("Gateway", "irismesh.federation.gateway"),
        ("LocalGateways", "irismesh.federation.local"),
        ("Retention", "irismesh.memory.store"),
        ("Remembered", "irismesh.memory.store"),
    ],
)
def test_names_that_load_on_first_use_are_there(name: str, module: str) -> None:
    loaded = _loaded(f"import irismesh\nvalue = irismesh.{name}\nassert value.__name__")
    assert module in loaded


@pytest.mark.parametrize(
    "path",
    [
        "irismesh.federation.LinkConfig",
        "irismesh.memory.store.MemoryStore",
        "irismesh.discovery.survey.SurveyDiscovery",
        "irismesh.discovery.mdns.MdnsDiscovery",
    ],
)
def test_subpackages_are_attributes_as_they_were(path: str) -> None:
    loaded = _loaded(f"import irismesh\nassert {path}.__name__")
    assert path.rsplit(".", 1)[0] in loaded


def test_a_name_irismesh_does_not_have_is_an_attribute_error() -> None:
    import irismesh

    with pytest.raises(AttributeError, match="no_such_name"):
        _ = irismesh.no_such_name  # type: ignore[attr-defined]
