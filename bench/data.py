"""Replicated data: local operations, majority writes, reads of a large set, gossip bytes.

    python bench/data.py [--increments 200000] [--writes 2000] [--json out.json]

Two holder processes of the key (children of this one) and a writer in this process, all on
127.0.0.1. Measured in one run:

- local counter increments per second (`await counter.add(1)`, consistency "local": the delta
  folds into the key's pending delta, published once per turn of the loop), beside Redis INCR
  from this same process when `redis-server` and the `redis` package are both here;
- majority writes (a majority of the three holders acknowledged) and "all" writes: p50, p99;
- `get()` of a 10,000-element set;
- gossip bytes per update: what the writer published for the data, divided by its updates,
  for increments at full speed (folded) and for one increment per 2 ms (one delta each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as harness

import irismesh

os.environ.setdefault("IRISMESH_DISCOVERY", "0")
KEY = "quota.bench"


async def holder() -> None:
    keys = irismesh.Keyring.from_env()
    async with irismesh.Node(keyring=keys, telemetry=False) as node:
        node.data.counter(KEY)
        node.data.set("sessions.bench")
        print("READY", node.endpoint, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


def redis_incr(n: int) -> float | None:
    """INCRs per second against a redis-server started here, or None without one."""
    try:
        import redis  # type: ignore[import-not-found]
    except ImportError:
        return None
    with harness.ChildProcesses() as procs:
        port = harness.start_redis_server(procs)
        if port is None:
            return None
        client = redis.Redis(host="127.0.0.1", port=port)
        client.ping()
        start = time.perf_counter()
        for _ in range(n):
            client.incr("bench")
        return n / (time.perf_counter() - start)


def start_holders(count: int) -> tuple[list[subprocess.Popen[str]], list[str]]:
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--holder"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    seeds = []
    for child in children:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        if line[:1] != ["READY"]:
            raise SystemExit("a holder did not start")
        seeds.append(line[1])
    return children, seeds


async def measure(args: argparse.Namespace, seeds: list[str]) -> dict[str, object]:
    keys = irismesh.Keyring.from_env()
    async with irismesh.Node(keyring=keys, seeds=seeds, telemetry=False) as node:
        counter = node.data.counter(KEY)
        await node.wait_for_subscribers("_data." + KEY, 2, timeout=10)
        results: dict[str, object] = {}

        # Local increments, folded: the holders get a few deltas, not one per increment.
        before = node.stats.get("data_bytes_sent", 0)
        start = time.perf_counter()
        for _ in range(args.increments):
            await counter.add(1)
        elapsed = time.perf_counter() - start
        await asyncio.sleep(0.2)  # the last flush
        sent = node.stats.get("data_bytes_sent", 0) - before
        results["local_increments_per_s"] = round(args.increments / elapsed)
        results["bytes_per_update_folded"] = round(sent / args.increments, 3)

        # One increment per 2 ms: a delta each.
        before = node.stats.get("data_bytes_sent", 0)
        spaced = 200
        for _ in range(spaced):
            await counter.add(1)
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.2)
        sent = node.stats.get("data_bytes_sent", 0) - before
        results["bytes_per_update_spaced"] = round(sent / spaced, 1)

        for consistency in ("majority", "all"):
            samples: list[int] = []
            for _ in range(args.writes):
                t0 = time.perf_counter_ns()
                await counter.add(1, consistency=consistency, timeout=5)  # type: ignore[arg-type]
                samples.append(time.perf_counter_ns() - t0)
            summary = harness.latency_summary_us(samples)
            results[f"{consistency}_write_p50_us"] = round(summary["p50_us"])
            results[f"{consistency}_write_p99_us"] = round(summary["p99_us"])
        samples = []
        for _ in range(args.writes // 4):
            t0 = time.perf_counter_ns()
            await counter.get(consistency="majority", timeout=5)
            samples.append(time.perf_counter_ns() - t0)
        summary = harness.latency_summary_us(samples)
        results["majority_read_p50_us"] = round(summary["p50_us"])
        results["majority_read_p99_us"] = round(summary["p99_us"])

        members = node.data.set("sessions.bench")
        for i in range(10_000):
            await members.add(i)
        reads = 200
        start = time.perf_counter()
        for _ in range(reads):
            value = await members.get()
        results["set_10k_read_us"] = round((time.perf_counter() - start) / reads * 1e6, 1)
        assert len(value) == 10_000
        results["writer_stats"] = {k: v for k, v in node.stats.items() if k.startswith("data_")}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--increments", type=int, default=200_000)
    parser.add_argument("--writes", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--holder", action="store_true", help=argparse.SUPPRESS)
    args = harness.parse_args(parser)
    if "IRISMESH_KEYS" not in os.environ and irismesh.Keyring.from_env() is None:
        os.environ["IRISMESH_KEYS"] = irismesh.Keyring.generate().to_text()
    if args.holder:
        asyncio.run(holder())
        return
    children, seeds = start_holders(2)
    try:
        results = asyncio.run(measure(args, seeds))
    finally:
        for child in children:
            assert child.stdin is not None
            child.stdin.close()
        for child in children:
            child.wait(10)
    # Redis after the mesh's figures, in this same process and loop-free, as a client would.
    incr = redis_incr(min(args.increments, 50_000))
    results["redis_incr_per_s"] = round(incr) if incr is not None else "not available here"
    if incr is not None:
        ratio = float(results["local_increments_per_s"]) / incr  # type: ignore[arg-type]
        results["local_vs_redis"] = round(ratio, 1)
    load = os.getloadavg()
    results["load_average"] = [round(x, 2) for x in load]
    for name, value in results.items():
        print(f"{name:>28}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
