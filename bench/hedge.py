"""Hedged requests against a cluster with one member ten times slower than the others.

    python bench/hedge.py [--requests 2000] [--concurrency 8] [--fast-ms 1] [--json out.json]

Three member processes of cluster "work" (two answer in --fast-ms, one in ten times that) and
a client in this process. The same load runs twice, without hedging and with `hedge=True`
(a second copy after the cluster's measured p95), and the latency percentiles are printed side
by side. Hedging trades a few duplicate requests (counted) for a shorter tail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _harness as harness

import irismesh

os.environ.setdefault("IRISMESH_DISCOVERY", "0")  # nodes join by seed only, as measured

CLUSTER = "work"


async def member(delay: float) -> None:
    async with irismesh.Node(CLUSTER, keyring=irismesh.Keyring.from_env()) as node:

        @node.on_request
        async def handle(payload: bytes) -> bytes:
            await asyncio.sleep(delay)
            return payload

        print("READY", node.endpoint, flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {
        "p50_ms": at(0.50),
        "p90_ms": at(0.90),
        "p99_ms": at(0.99),
        "max_ms": ordered[-1] * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
    }


async def load(
    client: irismesh.Node, requests: int, concurrency: int, hedge: bool
) -> dict[str, float]:
    samples: list[float] = []
    remaining = requests
    before = client.stats.get("requests_hedged", 0)

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            await client.request(CLUSTER, b"x" * 100, timeout=10, hedge=True if hedge else None)
            samples.append(time.perf_counter() - started)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result = percentiles(samples)
    result["hedged"] = client.stats.get("requests_hedged", 0) - before
    return result


async def measure(
    args: argparse.Namespace, keys: irismesh.Keyring, endpoints: list[str]
) -> dict[str, dict[str, float]]:
    async with irismesh.Node(keyring=keys, seeds=endpoints) as client:
        await client.wait_for_members(CLUSTER, 3, timeout=10)
        print(f"warming up ({args.requests // 4} requests) ...", file=sys.stderr)
        await load(client, args.requests // 4, args.concurrency, hedge=False)
        results = {}
        for hedge in (False, True):
            label = "hedged" if hedge else "plain"
            print(f"{label}: {args.requests} requests ...", file=sys.stderr)
            results[label] = await load(client, args.requests, args.concurrency, hedge)
        return results


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    keys = irismesh.Keyring.generate()
    workdir = tempfile.TemporaryDirectory(prefix="irismesh-hedge-")
    keyfile = Path(workdir.name) / "mesh.keys"
    keys.save(keyfile)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    env.pop("IRISMESH_KEYS", None)
    fast = args.fast_ms / 1000
    try:
        with harness.ChildProcesses() as procs:
            endpoints = []
            for delay in (fast, fast, 10 * fast):
                argv = [sys.executable, __file__, "--member", str(delay)]
                ready = procs.first_line(f"member {delay:g} s", argv, env=env, stops_on_eof=False)
                endpoints.append(ready.split()[1])
            return asyncio.run(measure(args, keys, endpoints))
    finally:
        workdir.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--fast-ms", type=float, default=1.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--member", type=float, help=argparse.SUPPRESS)
    args = harness.parse_args(parser)
    if args.member is not None:
        asyncio.run(member(args.member))
        return 0
    if args.requests < 100 or args.concurrency < 1 or args.fast_ms <= 0:
        parser.error("need --requests >= 100, --concurrency >= 1 and --fast-ms > 0")
    results = run(args)
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"one member of three is 10x slower ({args.fast_ms:g} ms vs {10 * args.fast_ms:g} ms)"
    )
    table.add_column("latency")
    for label in results:
        table.add_column(label, justify="right")
    table.add_column("hedged / plain", justify="right")
    for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms"):
        plain, hedged = results["plain"][key], results["hedged"][key]
        table.add_row(key, f"{plain:.2f}", f"{hedged:.2f}", f"{hedged / plain:.2f}x")
    table.add_row(
        "copies sent",
        str(int(results["plain"]["hedged"])),
        str(int(results["hedged"]["hedged"])),
        "",
    )
    Console().print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
