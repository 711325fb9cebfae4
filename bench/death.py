"""How soon a caller knows that the only member of a cluster was SIGKILLed.

    python bench/death.py [--runs 7] [--transport tcp zmq] [--idle 0 20] [--json out.json]

Each run starts a member of a cluster of its own ("death-<run>": a member killed in an earlier
run, not yet declared dead everywhere, serves no cluster called now) in a child process, and a
caller in this one, seeded with it. Once a request has been answered, a second one is sent and
held by the member's handler, and the member is SIGKILLed. The caller then asks again and
again, each request with a deadline of 50 ms, until one raises NoResponders: the time from the
kill to that is the run's figure. The held request's outcome, and when it came, are reported
beside it. With --idle N, N nodes of another cluster (one child process) are in the mesh as
well: the member joins through them, so the caller's membership holds N + 1 nodes. Prints the
median and every figure per transport and mesh size.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

from _harness import ChildProcesses, on_stdin_eof, parse_args

import irismesh
from irismesh.errors import NoResponders, RequestTimeout

GIVE_UP = 15.0  # seconds after the kill: the run failed
HELD_TIMEOUT = 3.0  # the deadline of the request in flight at the kill
SLOW = 0.3  # seconds: a run slower than this prints what the caller saw


async def child(transport: str, seeds: list[str], nodes: int, cluster: str) -> None:
    """`nodes` nodes of `cluster` (the first seeded with `seeds`, the others with the first);
    READY <endpoint of the first>, then wait for the parent to close stdin."""
    keys = irismesh.Keyring.from_env()
    started: list[irismesh.Node] = []
    try:
        for _ in range(nodes):
            node = irismesh.Node(
                cluster, keyring=keys, transport=transport, seeds=seeds, bind="tcp://127.0.0.1:0"
            )

            @node.on_request
            async def handle(payload: bytes) -> bytes:
                if payload == b"hold":
                    await asyncio.Event().wait()
                return payload

            await node.start()
            started.append(node)
            seeds = [started[0].endpoint]
        print("READY", started[0].endpoint, flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        on_stdin_eof(lambda: loop.call_soon_threadsafe(stop.set))
        await stop.wait()
    finally:
        for node in reversed(started):
            await node.close()


async def one_run(
    children: ChildProcesses,
    transport: str,
    idle: str | None,
    idle_count: int,
    keys: irismesh.Keyring,
    cluster: str,
) -> tuple[float, str, float]:
    """(seconds from the kill to NoResponders, the held request's outcome, and when)."""
    argv = [sys.executable, __file__, "--child", transport, "1", cluster]
    member = children.spawn("member", [*argv, *([idle] if idle else [])])
    endpoint = member.expect_prefix("READY", 30)
    async with irismesh.Node(keyring=keys, transport=transport, seeds=[endpoint]) as caller:
        await caller.wait_for_members(cluster, 1, timeout=10)
        loop = asyncio.get_running_loop()
        until = loop.time() + 10
        while len(caller.peers()) < idle_count + 1:
            if loop.time() > until:
                raise RuntimeError(
                    f"the caller knows {len(caller.peers())} nodes, not {idle_count + 1}"
                )
            await asyncio.sleep(0.05)
        assert await caller.request(cluster, b"warm", timeout=5) == b"warm"
        held = asyncio.ensure_future(caller.request(cluster, b"hold", timeout=HELD_TIMEOUT))
        await asyncio.sleep(0.05)  # the held request reached the member
        os.kill(member.pid, signal.SIGKILL)
        killed = loop.time()
        while True:
            if loop.time() - killed > GIVE_UP:
                raise RuntimeError(f"no NoResponders within {GIVE_UP} s of the kill")
            try:
                await caller.request(cluster, b"x", timeout=0.05)
            except NoResponders:
                known = loop.time() - killed
                break
            except RequestTimeout:
                continue
        try:
            await held
            outcome = "answered"
        except (NoResponders, RequestTimeout) as exc:
            outcome = type(exc).__name__
        held_at = loop.time() - killed
        if known > SLOW:  # say what the caller saw
            counters = ("links_down_", "dials_failed_", "peers_")
            seen = {k: v for k, v in caller.stats.items() if k.startswith(counters)}
            print(f"  a slow run ({known:.3f} s): {seen}", file=sys.stderr)
    children.stop(member)
    return known, outcome, held_at


async def measure(args: argparse.Namespace, keys: irismesh.Keyring) -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    runs = itertools.count(1)
    with ChildProcesses() as children:
        for idle_count in args.idle:
            for transport in args.transport:
                idle = None
                idle_child = None
                if idle_count:
                    argv = [sys.executable, __file__, "--child", transport, str(idle_count), "idle"]
                    idle_child = children.spawn("idle", argv)
                    idle = idle_child.expect_prefix("READY", 60)
                figures: list[float] = []
                outcomes: Counter[str] = Counter()
                held: list[float] = []
                for _ in range(args.runs):
                    cluster = f"death-{next(runs)}"
                    known, outcome, held_at = await one_run(
                        children, transport, idle, idle_count, keys, cluster
                    )
                    figures.append(known)
                    outcomes[outcome] += 1
                    held.append(held_at)
                if idle_child is not None:
                    children.stop(idle_child)
                label = f"{transport}, {idle_count + 2} nodes"
                results[label] = {
                    "median_s": statistics.median(figures),
                    "figures_s": figures,
                    "held_outcomes": dict(outcomes),
                    "held_median_s": statistics.median(held),
                }
                print(
                    f"{label:>16}: NoResponders after median {statistics.median(figures):.3f} s "
                    f"({', '.join(f'{x:.3f}' for x in figures)}); request in flight at the kill: "
                    f"{dict(outcomes)} after median {statistics.median(held):.3f} s",
                    flush=True,
                )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--transport", nargs="+", default=["tcp", "zmq"], choices=["tcp", "zmq"])
    parser.add_argument("--idle", nargs="+", type=int, default=[0, 20])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parse_args(parser)
    if args.child:
        transport, count, cluster, *seeds = args.child
        asyncio.run(child(transport, seeds, int(count), cluster))
        return 0
    if args.runs < 1 or min(args.idle) < 0:
        parser.error("need --runs >= 1 and --idle >= 0")
    os.environ.setdefault("IRISMESH_DISCOVERY", "0")  # nodes join by seed only
    keys = irismesh.Keyring.generate()
    with tempfile.TemporaryDirectory(prefix="irismesh-death-") as workdir:
        keyfile = Path(workdir) / "mesh.keys"
        keys.save(keyfile)
        os.environ["IRISMESH_KEYFILE"] = str(keyfile)
        os.environ.pop("IRISMESH_KEYS", None)
        results = asyncio.run(measure(args, keys))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
