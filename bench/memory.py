"""The mesh's memory, measured: reread latency over a large store, retained publish throughput.

    python bench/memory.py [--paths 10000] [--messages 1000000] [--size 100] [--rounds 15]
                           [--publishes 2000] [--jobs 2000] [--quick]

1. Fills one memory store with --messages retained messages spread over --paths paths (each
   path's messages a publisher's successive versions), then copies it, so that two memory
   members hold the same data.
2. Rereads the newest message of every path (`news.#`, latest=1) --rounds times from the store
   itself, in this process: the database's share.
3. Starts the two memory members (`mesh memory`, each its own process, on 127.0.0.1) and rereads
   the same from a third node: what a subscriber that logs in waits for.
4. Publishes --publishes retained messages with replicas=2, one at a time (the latency of a
   retained publish) and with 32 in flight (its throughput).
5. Queues --jobs jobs (`enqueue`, replicas=2, 32 in flight) for a worker node in this process
   (`@on_queued`): how fast they are held, how fast the worker runs them from the first
   enqueue to the last run, and how long each waited from its enqueue to its run.

Medians and p90 of one run; figures in bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import irismesh
from irismesh.memory import MemoryStore, Retention, message_id


def fill(directory: Path, keys: irismesh.Keyring, paths: int, messages: int, size: int) -> float:
    """The store, filled in batches; seconds it took."""
    per_path = max(1, messages // paths)
    store = MemoryStore(directory, keys, default=Retention(max_per_path=per_path))
    node = os.urandom(16)
    payload = os.urandom(size)
    # Published long enough ago that a starting member's catch-up does not copy them again.
    start = time.time() - 7200
    step = 7000 / messages
    batch: list[tuple[str, bytes, float, bytes]] = []
    began = time.perf_counter()
    for i in range(messages):
        at = start + i * step
        batch.append((f"news.{i % paths:06d}", payload, at, message_id(node, i, at)))
        if len(batch) == 4096:
            store.put_many(batch)
            batch.clear()
            if (i + 1) % (messages // 10 or 1) < 4096:
                print(f"  filled {i + 1:,} of {messages:,}", file=sys.stderr, flush=True)
    store.put_many(batch)
    store.close()
    return time.perf_counter() - began


def timed(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
    return f"{statistics.median(ms):,.1f} ms [{p90:,.1f}]"


def store_rereads(directory: Path, keys: irismesh.Keyring, rounds: int, paths: int) -> list[float]:
    store = MemoryStore(directory, keys)
    samples = []
    for _ in range(rounds):
        began = time.perf_counter()
        found = store.latest("news.#", 1)
        samples.append(time.perf_counter() - began)
        assert len(found) == paths, f"{len(found)} paths, wanted {paths}"
    store.close()
    return samples


def start_member(data: Path, keyfile: Path, seed: str | None) -> tuple[subprocess.Popen[str], str]:
    args = [sys.executable, "-m", "irismesh", "memory", "--data", str(data), "--keys", str(keyfile)]
    args += ["--bind", "tcp://127.0.0.1:0", "--json"] + (["--seed", seed] if seed else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"memory member on {data} did not start")
    return proc, str(json.loads(line)["endpoint"])


async def over_the_mesh(
    keys: irismesh.Keyring,
    seed: str,
    rounds: int,
    paths: int,
    publishes: int,
    size: int,
    jobs: int,
) -> dict[str, str]:
    async with irismesh.Node(keyring=keys, seeds=[seed], telemetry=False) as node:
        await node.wait_for_members("_memory", 2, timeout=30)
        rereads = []
        for _ in range(rounds):
            began = time.perf_counter()
            found = await node.reread("news.#", latest=1, timeout=60)
            rereads.append(time.perf_counter() - began)
            assert len(found) == paths, f"{len(found)} paths, wanted {paths}"
        payload = os.urandom(size)
        one = []
        began_all = time.perf_counter()
        for i in range(publishes):
            began = time.perf_counter()
            await node.publish(f"live.{i % 100}", payload, retain=True)
            one.append(time.perf_counter() - began)
        sequential = publishes / (time.perf_counter() - began_all)
        left = publishes

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await node.publish(f"live.{left % 100}", payload, retain=True)

        began_all = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        concurrent = publishes / (time.perf_counter() - began_all)
        assert node.stats.get("retained_underreplicated", 0) == 0
        queued = await enqueue_to_handled(node, keys, seed, jobs, size)
        return {
            "reread over the mesh (2 members)": timed(rereads),
            "retained publish, 1 in flight": f"{sequential:,.0f}/s, {timed(one)}",
            "retained publish, 32 in flight": f"{concurrent:,.0f}/s",
            **queued,
        }


async def enqueue_to_handled(
    node: irismesh.Node, keys: irismesh.Keyring, seed: str, jobs: int, size: int
) -> dict[str, str]:
    """Jobs queued 32 at a time for a worker (a node of its own in this process): how fast
    they are held, and how fast and how soon after queueing the worker runs them."""
    queued_at: dict[bytes, float] = {}
    waits: list[float] = []
    all_done = asyncio.Event()
    async with irismesh.Node("work", keyring=keys, seeds=[seed], telemetry=False) as worker:

        @worker.on_queued
        def job(payload: bytes) -> bytes:
            waits.append(time.perf_counter() - queued_at[payload[:8]])
            if len(waits) == jobs:
                all_done.set()
            return b"ok"

        await node.wait_for_members("work", 1, timeout=30)
        filler = os.urandom(max(size - 8, 0))
        left = jobs

        async def producer() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                key = left.to_bytes(8, "big")
                queued_at[key] = time.perf_counter()
                await node.enqueue("work", key + filler)

        began = time.perf_counter()
        await asyncio.gather(*(producer() for _ in range(32)))
        held = jobs / (time.perf_counter() - began)
        await asyncio.wait_for(all_done.wait(), 120)
        handled = jobs / (time.perf_counter() - began)
    return {
        "enqueue (replicas=2), 32 in flight": f"{held:,.0f}/s",
        "enqueue -> handled": f"{handled:,.0f}/s; queued to run {timed(waits)}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100, help="payload bytes")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--publishes", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=2000, help="jobs queued for a worker")
    parser.add_argument("--quick", action="store_true", help="1,000 paths, 100,000 messages")
    args = parser.parse_args()
    if args.quick:
        args.paths, args.messages, args.publishes, args.jobs = 1000, 100_000, 500, 500
    keys = irismesh.Keyring.generate()
    with tempfile.TemporaryDirectory(prefix="irismesh-memory-bench-") as tmp:
        root = Path(tmp)
        keyfile = root / "mesh.keys"
        keys.save(keyfile)
        print(f"[1/4] filling a store: {args.messages:,} messages on {args.paths:,} paths",
              file=sys.stderr)  # fmt: skip
        fill_s = fill(root / "one", keys, args.paths, args.messages, args.size)
        shutil.copytree(root / "one", root / "two")
        print("[2/4] rereading from the store", file=sys.stderr)
        local = store_rereads(root / "one", keys, args.rounds, args.paths)
        print("[3/4] two memory members, rereading over the mesh", file=sys.stderr)
        first, seed = start_member(root / "one", keyfile, None)
        second, _ = start_member(root / "two", keyfile, seed)
        try:
            print("[4/4] ... retained publishes and queued jobs", file=sys.stderr)
            mesh = asyncio.run(
                over_the_mesh(
                    keys, seed, args.rounds, args.paths, args.publishes, args.size, args.jobs
                )
            )
        finally:
            for proc in (first, second):
                proc.terminate()
                proc.wait(timeout=30)
    table = Table(
        title=f"the mesh's memory: {args.messages:,} messages of {args.size} B on "
        f"{args.paths:,} paths; median [p90]"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("fill (put_many, 4096 a transaction)", f"{args.messages / fill_s:,.0f} msg/s")
    table.add_row(f"reread news.# latest=1 ({args.paths:,} paths), store", timed(local))
    for name, value in mesh.items():
        table.add_row(name, value)
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
