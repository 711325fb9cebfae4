"""Request/reply and pub/sub through a gateway pair, and through one gateway process joining
both meshes, next to the same traffic inside one mesh.

    python bench/federation.py [--requests 20000] [--outstanding 100] [--messages 50000]

Processes: a member of cluster "db" (`mesh node`, echo) in mesh a, a gateway of mesh a
exporting db and `bench.#`, and a gateway of mesh b linked to it (`mesh gateway`). This
process runs the callers, the publisher and the subscribers: in mesh a (direct) and in mesh b
(through the gateways), in the same run, one after the other. Then the same through one
gateway process of its own that joins mesh a and a third mesh c (`mesh gateway --join`),
exporting db and `bench1.#`, with callers and a subscriber in mesh c. Printed: request/reply
throughput with --outstanding requests in flight, the p50 of one request at a time, pub/sub
messages per second to one subscriber (direct on `local.x`, which no gateway exports), tunnel
throughput (--tunnel-mb through one tunnel to the member, which echoes it back, in 64 KiB
messages; MB/s each way), and each figure through the gateways over direct. Then the CPU time
(user + system) each process spent per request or message in the request/reply and pub/sub
throughput runs: this process (callers, publisher and subscribers), the member, each gateway
of the pair, and the one process joining a and c; and, for the request/reply throughput runs,
the share of the wall time each process's event loop spent running and runnable but waiting
for a CPU (the rest it slept, with requests in flight), and how often it went to sleep. On a
shared machine the throughputs measure the machine as much as the code; the CPU per request is
the figure to compare builds by.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as harness
import psutil

import irismesh

os.environ.setdefault("IRISMESH_DISCOVERY", "0")  # nodes join by seed only
LOCAL = "tcp://127.0.0.1:0"


def start(procs: harness.ChildProcesses, *argv: str) -> dict[str, Any]:
    """A `mesh` command in a child process; the JSON line it prints once it is up."""
    command = [sys.executable, "-m", "irismesh", *argv]
    return json.loads(procs.first_line(argv[0], command, stops_on_eof=False))  # type: ignore[no-any-return]


WHO = ("callers", "member", "gateway_a", "gateway_b", "gateway_ac")  # this, then the children


def cpu_seconds(procs: harness.ChildProcesses) -> list[float]:
    """User + system CPU seconds so far of this process and of each child, in WHO's order."""
    times = [psutil.Process(p.pid).cpu_times() for p in procs.children]
    return [sum(psutil.Process().cpu_times()[:2]), *(sum(t[:2]) for t in times)]


def cpu_per(
    out: dict[str, float], key: str, before: list[float], after: list[float], n: int
) -> None:
    for who, began, ended in zip(WHO, before, after, strict=True):
        out[f"cpu_{key}_{who}_us"] = (ended - began) / n * 1e6


def main_threads(procs: harness.ChildProcesses) -> list[tuple[float, float, int]]:
    """For the event loop's thread of this process and of each child, in WHO's order: seconds
    on a CPU, seconds runnable but waiting for one, and voluntary sleeps, so far (Linux's
    /proc; zeros elsewhere)."""
    figures = []
    for pid in [os.getpid(), *(p.pid for p in procs.children)]:
        try:
            run, wait, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
            status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
            sleeps = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            figures.append((0.0, 0.0, 0))
            continue
        figures.append((int(run) / 1e9, int(wait) / 1e9, sleeps))
    return figures


def time_shares(
    out: dict[str, float],
    key: str,
    before: list[tuple[float, float, int]],
    after: list[tuple[float, float, int]],
    seconds: float,
    n: int,
) -> None:
    """Each event loop's share of the wall time running and waiting for a CPU (asleep is the
    rest), and how often it slept, per 100 requests."""
    for who, began, ended in zip(WHO, before, after, strict=True):
        out[f"loop_{key}_{who}_running"] = (ended[0] - began[0]) / seconds
        out[f"loop_{key}_{who}_waiting"] = (ended[1] - began[1]) / seconds
        out[f"loop_{key}_{who}_sleeps_per_100"] = (ended[2] - began[2]) / n * 100


async def throughput(node: irismesh.Node, total: int, outstanding: int) -> float:
    payload = b"x" * 100
    left = total

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await node.request("db", payload, timeout=10)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(outstanding)))
    return total / (time.perf_counter() - started)


async def p50_us(node: irismesh.Node, count: int) -> float:
    samples = []
    for _ in range(count):
        began = time.perf_counter_ns()
        await node.request("db", b"x" * 100, timeout=10)
        samples.append((time.perf_counter_ns() - began) / 1000)
    return statistics.median(samples)


async def pubsub_rate(
    publisher: irismesh.Node, reader: irismesh.Node, topic: str, count: int
) -> float:
    done = asyncio.Event()
    got = 0

    def on_message(_msg: irismesh.Message) -> None:
        nonlocal got
        got += 1
        if got == count:
            done.set()

    sub = reader.subscribe(topic, callback=on_message)
    try:
        await publisher.wait_for_subscribers(topic, 1, timeout=10)  # the reader, or the gateway
        await asyncio.sleep(0.5)  # the other mesh's interest reaches the far gateway
        payload = b"m" * 100
        started = time.perf_counter()
        for _ in range(count):
            await publisher.publish(topic, payload, timeout=30)
        await asyncio.wait_for(done.wait(), 120)
        return count / (time.perf_counter() - started)
    finally:
        sub.close()


async def tunnel_rate(node: irismesh.Node, total: int, block: int = 64 << 10) -> float:
    """MB/s through one tunnel to "db" (`mesh node` echoes it back), one way."""
    message = os.urandom(block)
    count = max(1, total // block)
    async with node.tunnel("db", timeout=10) as tunnel:

        async def write() -> None:
            for _ in range(count):
                await tunnel.send(message)
            await tunnel.send_eof()

        started = time.perf_counter()
        writer = asyncio.create_task(write())
        got = 0
        async for reply in tunnel:
            got += len(reply)
        await writer
        elapsed = time.perf_counter() - started
    if got != count * block:
        raise RuntimeError(f"the tunnel echoed {got} bytes of {count * block}")
    return got / elapsed / 1e6


async def main(args: argparse.Namespace) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="irismesh-bench-federation-"))
    keys = {}
    for name in ("a", "b", "c", "link"):
        keys[name] = irismesh.Keyring.generate()
        keys[name].save(tmp / f"{name}.keys")
    with harness.ChildProcesses() as procs:
        common = ["--bind", LOCAL, "--no-discovery", "--json"]
        member = start(procs, "node", "--cluster", "db", "--keys", str(tmp / "a.keys"), *common)
        gw = ["gateway", "--link-keys", str(tmp / "link.keys"), *common]
        gw_a = start(
            procs, *gw, "--mesh", "a", "--keys", str(tmp / "a.keys"), "--seed",
            member["endpoint"], "--listen", LOCAL, "--export", "db", "--topics", "bench.#",
        )  # fmt: skip
        gw_b = start(
            procs, *gw, "--mesh", "b", "--keys", str(tmp / "b.keys"), "--peer", gw_a["endpoint"]
        )
        gw_ac = start(
            procs, "gateway", *common, "--mesh", "a", "--keys", str(tmp / "a.keys"), "--seed",
            member["endpoint"], "--export", "db", "--topics", "bench1.#",
            "--join", f"c;keys={tmp / 'c.keys'};discovery=off",
        )  # fmt: skip
        c_seed = gw_ac["joined"][0]["node_endpoint"]
        a = irismesh.Node(keyring=keys["a"], seeds=[member["endpoint"]], bind=LOCAL)
        b = irismesh.Node(keyring=keys["b"], seeds=[gw_b["node_endpoint"]], bind=LOCAL)
        c = irismesh.Node(keyring=keys["c"], seeds=[c_seed], bind=LOCAL)
        a_reader = irismesh.Node(keyring=keys["a"], seeds=[member["endpoint"]], bind=LOCAL)
        async with a, b, c, a_reader:
            await a.wait_for_members("db", timeout=20)
            await b.wait_for_members("db", timeout=20)
            await c.wait_for_members("db", timeout=20)
            out: dict[str, float] = {}
            for label, node in (("direct", a), ("gateway", b), ("one", c)):
                await throughput(node, min(2000, args.requests), args.outstanding)  # warm up
                before, loops, began = cpu_seconds(procs), main_threads(procs), time.monotonic()
                out[f"reqrep_{label}_per_s"] = await throughput(
                    node, args.requests, args.outstanding
                )
                cpu_per(out, f"reqrep_{label}", before, cpu_seconds(procs), args.requests)
                seconds = time.monotonic() - began
                time_shares(out, label, loops, main_threads(procs), seconds, args.requests)
                out[f"p50_{label}_us"] = await p50_us(node, 2000)
            # Different topics: the gateway exports bench.*, not local.*.
            for label, reader, topic in (
                ("direct", a_reader, "local.x"),
                ("gateway", b, "bench.x"),
                ("one", c, "bench1.x"),
            ):
                before = cpu_seconds(procs)
                out[f"pubsub_{label}_per_s"] = await pubsub_rate(a, reader, topic, args.messages)
                cpu_per(out, f"pubsub_{label}", before, cpu_seconds(procs), args.messages)
            for label, node in (("direct", a), ("gateway", b), ("one", c)):
                await tunnel_rate(node, 4 << 20)  # warm up
                out[f"tunnel_{label}_mb_s"] = await tunnel_rate(node, args.tunnel_mb << 20)
            return out


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--outstanding", type=int, default=100)
    parser.add_argument("--messages", type=int, default=50000)
    parser.add_argument("--tunnel-mb", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = harness.parse_args(parser)
    out = irismesh.run(main(args))
    direct = {
        "reqrep": out["reqrep_direct_per_s"],
        "pubsub": out["pubsub_direct_per_s"],
        "tunnel": out["tunnel_direct_mb_s"],
    }
    print("| 100 B | direct | through a gateway pair | ratio | through one process | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")

    def row(what: str, key: str, unit: str, base: float) -> None:
        pair, one = out[f"{key}_gateway_{unit}"], out[f"{key}_one_{unit}"]
        print(
            f"| {what} | {base:,.0f} | {pair:,.0f} | {pair / base:.2f}x "
            f"| {one:,.0f} | {one / base:.2f}x |"
        )

    row(
        f"request/reply, {args.outstanding} outstanding, req/s", "reqrep", "per_s", direct["reqrep"]
    )
    p50 = out["p50_direct_us"]
    print(
        f"| one request at a time, p50 | {p50:,.0f} us | {out['p50_gateway_us']:,.0f} us "
        f"| +{out['p50_gateway_us'] - p50:,.0f} us | {out['p50_one_us']:,.0f} us "
        f"| +{out['p50_one_us'] - p50:,.0f} us |"
    )
    row("pub/sub, one subscriber, msg/s", "pubsub", "per_s", direct["pubsub"])
    row("tunnel, 64 KiB messages echoed, MB/s each way", "tunnel", "mb_s", direct["tunnel"])
    print()
    print(
        "| CPU per request or message, us | callers | member | gateway a | gateway b "
        "| one gateway process (a, c) | total |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, what in (
        ("reqrep_direct", "request/reply, direct"),
        ("reqrep_gateway", "request/reply, through the pair"),
        ("reqrep_one", "request/reply, through one process"),
        ("pubsub_direct", "pub/sub, direct"),
        ("pubsub_gateway", "pub/sub, through the pair"),
        ("pubsub_one", "pub/sub, through one process"),
    ):
        figures = [out[f"cpu_{key}_{who}_us"] for who in WHO]
        cells = " | ".join(f"{f:.1f}" for f in figures)
        print(f"| {what} | {cells} | {sum(figures):.1f} |")
    print()
    print(
        "| request/reply throughput, each event loop: running, waiting for a CPU "
        "[sleeps per 100 requests] | callers | member | gateway a | gateway b "
        "| one gateway process (a, c) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for label, what in (
        ("direct", "direct"),
        ("gateway", "through the pair"),
        ("one", "through one process"),
    ):
        cells = " | ".join(
            f"{out[f'loop_{label}_{who}_running']:.2f}, {out[f'loop_{label}_{who}_waiting']:.2f}"
            f" [{out[f'loop_{label}_{who}_sleeps_per_100']:.1f}]"
            for who in WHO
        )
        print(f"| {what} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    cli()
