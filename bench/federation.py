"""Request/reply and pub/sub through a gateway pair, next to the same traffic inside one mesh.

    python bench/federation.py [--requests 20000] [--outstanding 100] [--messages 50000]

Processes: a member of cluster "db" (`mesh node`, echo) in mesh a, a gateway of mesh a
exporting db and `bench.#`, and a gateway of mesh b linked to it (`mesh gateway`). This
process runs the callers, the publisher and the subscribers: in mesh a (direct) and in mesh b
(through the gateways), in the same run, one after the other. Printed: request/reply
throughput with --outstanding requests in flight, the p50 of one request at a time, pub/sub
messages per second to one subscriber (direct on `local.x`, which no gateway exports), tunnel
throughput (--tunnel-mb through one tunnel to the member, which echoes it back, in 64 KiB
messages; MB/s each way), and each figure through the gateways over direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import irismesh

os.environ.setdefault("IRISMESH_DISCOVERY", "0")  # nodes join by seed only
LOCAL = "tcp://127.0.0.1:0"


def start(procs: list[subprocess.Popen[str]], *argv: str) -> dict[str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "irismesh", *argv], stdout=subprocess.PIPE, text=True
    )
    procs.append(proc)
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())  # type: ignore[no-any-return]


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
    for name in ("a", "b", "link"):
        keys[name] = irismesh.Keyring.generate()
        keys[name].save(tmp / f"{name}.keys")
    procs: list[subprocess.Popen[str]] = []
    try:
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
        a = irismesh.Node(keyring=keys["a"], seeds=[member["endpoint"]], bind=LOCAL)
        b = irismesh.Node(keyring=keys["b"], seeds=[gw_b["node_endpoint"]], bind=LOCAL)
        a_reader = irismesh.Node(keyring=keys["a"], seeds=[member["endpoint"]], bind=LOCAL)
        async with a, b, a_reader:
            await a.wait_for_members("db", timeout=20)
            await b.wait_for_members("db", timeout=20)
            out: dict[str, float] = {}
            for label, node in (("direct", a), ("gateway", b)):
                await throughput(node, min(2000, args.requests), args.outstanding)  # warm up
                out[f"reqrep_{label}_per_s"] = await throughput(
                    node, args.requests, args.outstanding
                )
                out[f"p50_{label}_us"] = await p50_us(node, 2000)
            # Different topics: the gateway exports bench.*, not local.*.
            for label, reader, topic in (
                ("direct", a_reader, "local.x"),
                ("gateway", b, "bench.x"),
            ):
                out[f"pubsub_{label}_per_s"] = await pubsub_rate(a, reader, topic, args.messages)
            for label, node in (("direct", a), ("gateway", b)):
                await tunnel_rate(node, 4 << 20)  # warm up
                out[f"tunnel_{label}_mb_s"] = await tunnel_rate(node, args.tunnel_mb << 20)
            return out
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--outstanding", type=int, default=100)
    parser.add_argument("--messages", type=int, default=50000)
    parser.add_argument("--tunnel-mb", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    out = irismesh.run(main(args))
    rr = out["reqrep_gateway_per_s"] / out["reqrep_direct_per_s"]
    ps = out["pubsub_gateway_per_s"] / out["pubsub_direct_per_s"]
    tn = out["tunnel_gateway_mb_s"] / out["tunnel_direct_mb_s"]
    print("| 100 B | direct | through a gateway pair | ratio |")
    print("| --- | --- | --- | --- |")
    print(
        f"| request/reply, {args.outstanding} outstanding, req/s "
        f"| {out['reqrep_direct_per_s']:,.0f} | {out['reqrep_gateway_per_s']:,.0f} | {rr:.2f}x |"
    )
    print(
        f"| one request at a time, p50 | {out['p50_direct_us']:,.0f} us "
        f"| {out['p50_gateway_us']:,.0f} us "
        f"| +{out['p50_gateway_us'] - out['p50_direct_us']:,.0f} us |"
    )
    print(
        f"| pub/sub, one subscriber, msg/s | {out['pubsub_direct_per_s']:,.0f} "
        f"| {out['pubsub_gateway_per_s']:,.0f} | {ps:.2f}x |"
    )
    print(
        f"| tunnel, 64 KiB messages echoed, MB/s each way | {out['tunnel_direct_mb_s']:,.0f} "
        f"| {out['tunnel_gateway_mb_s']:,.0f} | {tn:.2f}x |"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    cli()
