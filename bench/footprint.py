"""What irismesh costs a process that embeds it, against nats-py: import time and memory.

    python bench/footprint.py [--runs 5] [--requests 200]

Four measures, each the median of `--runs` fresh processes, all in one run:

- `import irismesh` against `import nats`: the time the import takes (measured inside the
  process, around the import statement) and the process's resident memory after it (VmRSS).
- a running member node against a connected nats-py client, each serving requests: the node
  (`Node(cluster=...)`, run by `irismesh.run` as an application would) answers `--requests`
  requests from a client node in this process; the nats-py client (`asyncio.run`, its own
  way) subscribes to a subject and answers as many requests from a nats-py client here
  through nats-server (started on 127.0.0.1 for the run). Each then reports its VmRSS. The
  node is also measured under plain `asyncio.run`, which leaves uvloop out.
- the floor: a process that imports only what a node cannot do without (asyncio, uvloop,
  msgpack, cryptography's AEAD and Ed25519), to say where the rest of the node's memory goes.

Both are timed with their bytecode compiled, as `pip install` leaves an installed package: one
unmeasured import writes irismesh's first (a source checkout under PYTHONDONTWRITEBYTECODE
would otherwise be timed compiling its source). Ratios are irismesh's figure over nats-py's.
The goals: an import no slower than nats-py's, and a running node's RSS at most 1.2x a
connected nats-py client's. Everything listens on 127.0.0.1 only; nats-server is the system
package (`apt-get install -y nats-server`), nats-py the bench extra (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import _harness as harness

NATS_SUBJECT = "bench.footprint"
CLUSTER = "footprint"


# Run with `python -c` in a fresh interpreter: nothing of this script is loaded before the
# import timed (the script itself imports asyncio).
IMPORT_PROBE = """
import sys, time
started = time.perf_counter()
if sys.argv[1] == "floor":
    import asyncio, msgpack
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    try:
        import uvloop
    except ImportError:
        pass
else:
    __import__(sys.argv[1])
took = time.perf_counter() - started
rss = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]
print(f"RESULT {took * 1000:.3f} {rss}", flush=True)
"""


# A serving process, with `python -c` too: it loads what it serves with and no more.
SERVER_PROBE = (
    f"CLUSTER, SUBJECT = {CLUSTER!r}, {NATS_SUBJECT!r}\n"
    + """
import asyncio, sys

def rss():
    return next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]

async def told():  # until the parent writes a line (or closes the pipe)
    loop = asyncio.get_running_loop()
    said = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), said.set)
    await said.wait()
    loop.remove_reader(sys.stdin.fileno())

async def node():
    import irismesh
    async with irismesh.Node(CLUSTER, discovery=False, name="footprint") as node:
        node.on_request(lambda payload: payload)
        print(f"READY {node.endpoint}", flush=True)
        await told()
        print(f"RESULT 0 {rss()}", flush=True)

async def nats_client(url):
    import nats
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    async def answer(msg):
        await msg.respond(msg.data)
    await nc.subscribe(SUBJECT, cb=answer)
    await nc.flush()
    print("READY nats", flush=True)
    await told()
    print(f"RESULT 0 {rss()}", flush=True)
    await nc.close()

kind = sys.argv[1]
if kind == "node":
    import irismesh
    irismesh.run(node())
elif kind == "node-asyncio":
    asyncio.run(node())
else:
    asyncio.run(nats_client(sys.argv[2]))
"""
)


# ------------------------------------------------------------------------------ the parent


def _result(line: str) -> tuple[float, int]:
    _, took, rss = line.split()
    return float(took), int(rss)


def measure_import(module: str, *, env: dict[str, str] | None = None) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, module],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=tempfile.gettempdir(),  # `-c` puts the directory first on sys.path
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return _result(line)


async def measure_server(argv: list[str], requests: int, nats_url: str | None) -> int:
    """Start a serving child, send it `requests` requests, then read its RSS."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER_PROBE,
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=tempfile.gettempdir(),
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        ready = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().split()
        if not ready or ready[0] != "READY":
            raise RuntimeError(f"{argv[0]} did not start: {ready}")
        if nats_url is None:
            await _ask_node(ready[1], requests)
        else:
            await _ask_nats(nats_url, requests)
        proc.stdin.write(b"report\n")
        await proc.stdin.drain()
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        return _result(line)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _ask_node(endpoint: str, requests: int) -> None:
    import irismesh

    async with irismesh.Node(discovery=False, seeds=[endpoint], name="footprint-client") as node:
        await node.wait_for_members(CLUSTER, 1, timeout=30)
        for i in range(requests):
            payload = b"%d" % i
            if await node.request(CLUSTER, payload, timeout=10) != payload:
                raise RuntimeError("a wrong reply")


async def _ask_nats(url: str, requests: int) -> None:
    import nats

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        for i in range(requests):
            payload = b"%d" % i
            reply = await nc.request(NATS_SUBJECT, payload, timeout=10)
            if reply.data != payload:
                raise RuntimeError("a wrong reply")
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per measure")
    parser.add_argument("--requests", type=int, default=200, help="answered before the RSS")
    args = parser.parse_args()
    nats_server = shutil.which("nats-server") or next(
        (p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if os.access(p, os.X_OK)),
        None,
    )
    if nats_server is None or importlib.util.find_spec("nats") is None:
        raise SystemExit("needs nats-server (apt) and nats-py (pip install -e '.[bench]')")
    if not os.environ.get("IRISMESH_KEYS") and not os.environ.get("IRISMESH_KEYFILE"):
        import irismesh

        os.environ["IRISMESH_KEYS"] = irismesh.Keyring.generate().to_text()
    with open("/proc/loadavg", encoding="ascii") as loadavg:
        print(f"load average at start: {' '.join(loadavg.read().split()[:3])}")

    imports: dict[str, list[tuple[float, int]]] = {"irismesh": [], "nats": [], "floor": []}
    # An installed package's bytecode was compiled when pip installed it; a source checkout's
    # is compiled on first import, and not kept under PYTHONDONTWRITEBYTECODE: without this
    # unmeasured import, which writes it, irismesh would be timed compiling its source.
    writing = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for module in imports:
        measure_import(module, env=writing)
    for _ in range(args.runs):  # interleaved: a burst of load hits both sides alike
        for module in imports:
            imports[module].append(measure_import(module))

    port = harness.free_tcp_port()
    broker = subprocess.Popen(
        [nats_server, "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    running: dict[str, list[int]] = {"node": [], "node-asyncio": [], "nats": []}
    try:
        harness.wait_for_tcp(port, 10)
        url = f"nats://127.0.0.1:{port}"
        for _ in range(args.runs):
            for kind in running:
                argv, via = ([kind, url], url) if kind == "nats" else ([kind], None)
                running[kind].append(asyncio.run(measure_server(argv, args.requests, via)))
    finally:
        broker.terminate()
        broker.wait(10)

    def median_ms(module: str) -> float:
        return statistics.median(t for t, _ in imports[module])

    def median_kb(module: str) -> float:
        return statistics.median(r for _, r in imports[module])

    print(f"\nmedians of {args.runs} fresh processes each (python {sys.version.split()[0]})")
    print(f"{'':40}{'irismesh':>12}{'nats-py':>12}{'ratio':>8}")
    ms, nats_ms = median_ms("irismesh"), median_ms("nats")
    print(f"{'import time (ms)':40}{ms:12.1f}{nats_ms:12.1f}{ms / nats_ms:8.2f}x")
    kb, nats_kb = median_kb("irismesh"), median_kb("nats")
    print(f"{'RSS after the import (kB)':40}{kb:12,.0f}{nats_kb:12,.0f}{kb / nats_kb:8.2f}x")
    nats_run = statistics.median(running["nats"])
    for kind, label in (("node", "irismesh.run"), ("node-asyncio", "asyncio.run")):
        node_run = statistics.median(running[kind])
        title = f"RSS serving, node by {label} (kB)"
        print(f"{title:40}{node_run:12,.0f}{nats_run:12,.0f}{node_run / nats_run:8.2f}x")
    floor_ms, floor_kb = median_ms("floor"), median_kb("floor")
    print(
        f"\nthe floor (asyncio, uvloop, msgpack, cryptography's AEAD and Ed25519): "
        f"{floor_ms:.1f} ms ({floor_ms / nats_ms:.2f}x nats-py's import), "
        f"{floor_kb:,.0f} kB ({floor_kb / nats_kb:.2f}x)"
    )
    node_run = statistics.median(running["node"])
    print(
        f"a serving node over the floor: {node_run - floor_kb:,.0f} kB; "
        f"irismesh's import over the floor: {kb - floor_kb:,.0f} kB"
    )
    print(
        "goals: import time <= 1.00x nats-py's "
        f"({'met' if ms <= nats_ms else 'not met'}); a running node's RSS <= 1.20x "
        f"({'met' if node_run <= 1.2 * nats_run else 'not met'})"
    )


if __name__ == "__main__":
    main()
