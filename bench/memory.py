"""The mesh's memory, measured: reread latency over a large store, retained publish throughput.

    python bench/memory.py [--paths 10000] [--messages 1000000] [--size 100] [--rounds 15]
                           [--publishes 2000] [--jobs 2000] [--quick]
                           [--only-versus] [--versus-publishes 20000] [--versus-paths 1000]
                           [--only-tombstones 150000,500000]

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
6. Beside NATS JetStream, in the same run (--only-versus: this step alone): for one memory
   member with `--sync fsync`, one with `--sync os`, and one `nats-server -js` (file storage,
   one replica, 16 messages kept per subject, its store in a temporary directory), each started
   on 127.0.0.1 by the bench (all three up at once, each irismesh member a mesh of its own):
   --versus-publishes retained publishes of --size bytes on --versus-paths paths with 32 in
   flight (the rate), 2,000 one at a time (p50 and p99), and a reread of the newest message of
   every path (irismesh: `reread("news.#")`; JetStream: an ordered consumer delivering the last
   message per subject of `news.>`), split into --rounds rounds taken in turns (a round of each
   system, then the next), so that the machine's other load falls on all three alike; medians
   of the rounds' rates and rereads.
   JetStream needs `nats-server` (Debian: `apt-get install -y nats-server`) and nats-py (the
   `bench` extra); without either its column says why it is missing.
7. --only-tombstones 150000,500000 (this step alone): for each count, a memory member (`mesh
   memory`, a process of its own) that finished that many jobs over the last six days, and a
   memory member that starts empty in this process: the seconds from its start to the end of
   its catch-up (`caught_up`), in which it learns every tombstone and copies 100 jobs held,
   --rounds rounds (each starting empty again; 3 unless given).

Medians and p90 of one run; figures in bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sized
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import irismesh
from irismesh.memory import MemoryStore, Retention, message_id
from irismesh.memory.jobs import Job, JobStore, Tombstone

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as harness

IN_FLIGHT = 32
ONE_AT_A_TIME = 2000


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


def start_member(
    procs: harness.ChildProcesses, data: Path, keyfile: Path, seed: str | None, sync: str = "fsync"
) -> str:
    """A memory member (`mesh memory`) in a child process; its endpoint."""
    argv = [sys.executable, "-m", "irismesh", "memory", "--data", str(data), "--keys", str(keyfile)]
    argv += ["--sync", sync]
    argv += ["--bind", "tcp://127.0.0.1:0", "--json"] + (["--seed", seed] if seed else [])
    line = procs.first_line(f"memory member {data.name}", argv, timeout=60, stops_on_eof=False)
    return str(json.loads(line)["endpoint"])


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


# ------------------------------------------------------------------ beside NATS JetStream


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


class Side:
    """One system under test: `publish(i)` stores the i-th retained message, `reread()`
    returns the newest message of every path, `close()` lets go of the client."""

    def __init__(
        self,
        name: str,
        publish: Callable[[int], Awaitable[None]],
        reread: Callable[[], Awaitable[Sized]],
        close: Callable[[], Awaitable[None]],
    ) -> None:
        self.name, self.publish, self.reread, self.close = name, publish, reread, close


async def irismesh_client(
    name: str, keys: irismesh.Keyring, seed: str, paths: int, size: int
) -> Side:
    """A client node of one memory member (replicas=1: the member is the only replica)."""
    payload = os.urandom(size)
    node = irismesh.Node(keyring=keys, seeds=[seed], telemetry=False, replicas=1)
    await node.start()
    await node.wait_for_members("_memory", 1, timeout=30)

    async def publish(i: int) -> None:
        await node.publish(f"news.{i % paths:06d}", payload, retain=True, timeout=30)

    async def reread() -> Sized:
        return await node.reread("news.#", timeout=60)

    return Side(name, publish, reread, node.close)


async def jetstream_client(url: str, paths: int, size: int) -> Side:
    """A nats-py client of one nats-server with JetStream: a stream of `news.>` on file."""
    import nats
    from nats.js.api import DeliverPolicy, StorageType, StreamConfig

    payload = os.urandom(size)
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    js = nc.jetstream(timeout=30)
    await js.add_stream(
        StreamConfig(
            name="NEWS",
            subjects=["news.>"],
            storage=StorageType.FILE,
            num_replicas=1,
            max_msgs_per_subject=16,  # as the memory's default retention
        )
    )

    async def publish(i: int) -> None:
        await js.publish(f"news.{i % paths:06d}", payload)

    async def reread() -> Sized:
        latest: dict[str, bytes] = {}
        done = asyncio.Event()

        async def got(msg: Any) -> None:
            latest[msg.subject] = msg.data
            if msg.metadata.num_pending == 0:
                done.set()

        sub = await js.subscribe(
            "news.>", cb=got, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
        )
        try:
            await asyncio.wait_for(done.wait(), 60)
        finally:
            await sub.unsubscribe()
        return latest

    return Side("JetStream", publish, reread, nc.close)


async def compare(
    sides: list[Side], publishes: int, paths: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Every side's figures, measured in turns (a round of each side, then the next round), so
    that the machine's other load falls on all of them alike: medians over the rounds."""
    rates: dict[str, list[float]] = {side.name: [] for side in sides}
    one: dict[str, list[float]] = {side.name: [] for side in sides}
    rereads: dict[str, list[float]] = {side.name: [] for side in sides}
    for side in sides:  # warm up: links, pages of the stores, and every path exists
        for i in range(paths):
            await side.publish(i)
    per_round = max(IN_FLIGHT, publishes // rounds)
    singles = max(1, ONE_AT_A_TIME // rounds)
    for _ in range(rounds):
        for side in sides:
            left = per_round

            async def worker(side: Side = side) -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await side.publish(left)

            began = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
            rates[side.name].append(per_round / (time.perf_counter() - began))
            for i in range(singles):
                began = time.perf_counter()
                await side.publish(i)
                one[side.name].append(time.perf_counter() - began)
            began = time.perf_counter()
            found = await side.reread()
            rereads[side.name].append(time.perf_counter() - began)
            assert len(found) == paths, f"{side.name} reread {len(found)} paths, wanted {paths}"
    return {
        side.name: {
            "rate": statistics.median(rates[side.name]),
            "p50": statistics.median(one[side.name]),
            "p99": percentile(one[side.name], 0.99),
            "reread": statistics.median(rereads[side.name]),
        }
        for side in sides
    }


async def versus_clients(
    members: dict[str, tuple[irismesh.Keyring, str]], url: str | None, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    sides = [
        await irismesh_client(name, keys, seed, args.versus_paths, args.size)
        for name, (keys, seed) in members.items()
    ]
    if url is not None:
        sides.append(await jetstream_client(url, args.versus_paths, args.size))
    try:
        return await compare(sides, args.versus_publishes, args.versus_paths, args.rounds)
    finally:
        for side in sides:
            await side.close()


def fdatasync_p50(directory: Path, rounds: int = 200) -> float:
    """Seconds one 4 KiB append and its fdatasync take on this disk, median: the floor of a
    commit that waits for the disk."""
    directory.mkdir(parents=True, exist_ok=True)
    samples = []
    fd = os.open(directory / "fsync-probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        block = os.urandom(4096)
        for _ in range(rounds):
            began = time.perf_counter()
            os.write(fd, block)
            os.fdatasync(fd)
            samples.append(time.perf_counter() - began)
    finally:
        os.close(fd)
    return statistics.median(samples)


def versus(args: argparse.Namespace, root: Path) -> Table:
    """The memory beside JetStream: rate with 32 in flight, p50 one at a time, reread."""
    members: dict[str, tuple[irismesh.Keyring, str]] = {}
    results: dict[str, dict[str, float] | str] = {}
    with harness.ChildProcesses() as procs:
        for sync in ("fsync", "os"):
            # A mesh (keyring) each: the two members must not find each other and share work.
            keys = irismesh.Keyring.generate()
            keyfile = root / f"versus-{sync}.keys"
            keys.save(keyfile)
            seed = start_member(procs, root / f"versus-{sync}", keyfile, None, sync)
            members[f"irismesh {sync}"] = (keys, seed)
        url = None
        missing = harness.nats_missing()
        if missing is not None:
            print(f"[versus] JetStream skipped: {missing}", file=sys.stderr)
        else:
            _, url = harness.start_nats_server(procs, "-js", "-sd", str(root / "jetstream"))
        print(
            f"[versus] {', '.join(members)}{', JetStream' if url else ''}: "
            f"{args.rounds} rounds each, in turns",
            file=sys.stderr,
        )
        results.update(irismesh.run(versus_clients(members, url, args)))
        if missing is not None:
            results["JetStream"] = f"skipped: {missing}"
    js = results["JetStream"]
    floor = fdatasync_p50(root / "probe")
    table = Table(
        title=f"beside JetStream: {args.versus_paths:,} paths, {args.size} B, "
        f"{args.versus_publishes:,} retained publishes; one server each; "
        "(x): irismesh / JetStream",
        caption=f"this disk: a 4 KiB append + fdatasync takes {floor * 1e6:,.0f} us (median); "
        f"load average {os.getloadavg()[0]:.1f}",
    )
    table.add_column("figure")
    for name in results:
        table.add_column(name, justify="right")
    rows = [
        (f"retained publish, {IN_FLIGHT} in flight", "rate", "{:,.0f}/s", True),
        ("p50 one at a time", "p50", "{:,.0f} us", False),
        ("p99 one at a time", "p99", "{:,.0f} us", False),
        (f"reread of the latest of {args.versus_paths:,} paths", "reread", "{:,.1f} ms", False),
    ]
    for label, key, form, higher in rows:
        cells = []
        for figures in results.values():
            if isinstance(figures, str):
                cells.append(escape(figures))  # not rich markup: "[bench]"
                continue
            value = figures[key] * (1e6 if key.startswith("p") else 1e3 if key == "reread" else 1)
            cell = form.format(value)
            if figures is not js and not isinstance(js, str):
                ratio = figures[key] / js[key] if higher else js[key] / figures[key]
                cell += f" ({ratio:.2f}x)"
            cells.append(cell)
        table.add_row(label, *cells)
    return table


def tombstones(keys: irismesh.Keyring, root: Path, counts: list[int], rounds: int) -> Table:
    """Step 7: a starting member's catch-up on `counts` tombstones, `rounds` times each."""
    table = Table(title=f"a starting memory member's catch-up on tombstones; median of {rounds}")
    for column in ("tombstones", "start to caught up", "tombstones/s"):
        table.add_column(column, justify="right")
    keyfile = root / "mesh.keys"
    keys.save(keyfile)
    for count in counts:
        source = root / f"finished-{count}"
        store = MemoryStore(source, keys)
        jobs = JobStore(store)
        now = time.time()
        step = 6 * 24 * 3600 / count
        node = os.urandom(16)
        jobs.finished_at(
            (
                Tombstone(now - 6 * 24 * 3600 + i * step, message_id(node, i, now))
                for i in range(count)
            ),
            now,
        )
        jobs.add(
            Job(message_id(node, count + i, now), "work", b"j" * 100, now, now + 3600)
            for i in range(100)
        )
        store.close()
        with harness.ChildProcesses() as procs:
            seed = start_member(procs, source, keyfile, None, sync="os")
            samples = [
                asyncio.run(catch_up(keys, seed, root / f"fresh-{count}-{i}", count))
                for i in range(rounds)
            ]
        seconds = statistics.median(samples)
        table.add_row(f"{count:,}", f"{seconds:.2f} s", f"{count / seconds:,.0f}")
    return table


async def catch_up(keys: irismesh.Keyring, seed: str, data: Path, count: int) -> float:
    """Seconds from a memory member's start to the end of its catch-up, checked whole."""
    began = time.perf_counter()
    async with irismesh.Node(keyring=keys, memory=data, seeds=[seed], telemetry=False) as node:
        await node.caught_up()
        seconds = time.perf_counter() - began
        member = node.memory.member
        assert member is not None
        learnt = await member.run(member.jobs.tombstones, 0.0, count + 1)
        assert len(learnt) == count, f"{len(learnt):,} tombstones, wanted {count:,}"
        assert node.stats["memory_jobs_pending"] == 100
        assert node.stats.get("jobs_catch_up_incomplete", 0) == 0
    return seconds


def main() -> int:
    parser = harness.rounds_parser(__doc__, rounds=15)
    parser.add_argument("--paths", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--publishes", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=2000, help="jobs queued for a worker")
    parser.add_argument("--quick", action="store_true", help="1,000 paths, 100,000 messages")
    parser.add_argument("--only-versus", action="store_true", help="step 6 alone")
    parser.add_argument("--versus-publishes", type=int, default=20_000)
    parser.add_argument("--versus-paths", type=int, default=1000)
    parser.add_argument("--only-tombstones", help="step 7 alone: tombstone counts, 150000,...")
    args = harness.parse_args(parser)
    if args.only_tombstones:
        counts = [int(count) for count in args.only_tombstones.split(",")]
        rounds = args.rounds if "--rounds" in sys.argv else 3
        with tempfile.TemporaryDirectory(prefix="irismesh-memory-bench-") as tmp:
            Console().print(tombstones(irismesh.Keyring.generate(), Path(tmp), counts, rounds))
        return 0
    if args.only_versus:
        with tempfile.TemporaryDirectory(prefix="irismesh-memory-bench-") as tmp:
            Console().print(versus(args, Path(tmp)))
        return 0
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
        with harness.ChildProcesses() as procs:
            seed = start_member(procs, root / "one", keyfile, None)
            start_member(procs, root / "two", keyfile, seed)
            print("[4/4] ... retained publishes and queued jobs", file=sys.stderr)
            mesh = asyncio.run(
                over_the_mesh(
                    keys, seed, args.rounds, args.paths, args.publishes, args.size, args.jobs
                )
            )
        beside = versus(args, root)
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
    Console().print(beside)
    return 0


if __name__ == "__main__":
    sys.exit(main())
