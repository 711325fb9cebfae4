"""CPU time per request of irismesh's caller and member: a figure a busy machine barely moves.

    python bench/cpu_per_request.py [--requests 150000] [--outstanding 100] [--size 100]
                                    [--rounds 3] [--split VERSION=WEIGHT,...]

A member (a `Node` of cluster `echo` with a plain handler that returns the payload, sealed,
telemetry on) runs in a child process on 127.0.0.1; the caller, in this process, sends
--requests requests with --outstanding in flight after a warm-up, and each side reads its own
CPU time (`getrusage`: user + system) around exactly those requests. Wall-clock throughput on
a shared machine measures the machine; CPU per request measures the code, so before/after
comparisons interleave runs of two builds with this script and compare medians. With --split
the member serves as the first version named and the caller sets that traffic split first, so
every request draws a version (the member's the only one linked: the split's cheapest path).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import _harness as harness

import irismesh


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def member(keyfile: str, version: str) -> None:
    keys = irismesh.Keyring.load(keyfile)
    served_as = {"version": version} if version else {}  # a build without versions: none
    async with irismesh.Node("echo", keyring=keys, discovery=False, **served_as) as node:

        @node.on_request
        def echo(payload: bytes) -> bytes:
            return payload

        print(node.endpoint, flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # the measured requests begin
        began = cpu()
        await loop.run_in_executor(None, sys.stdin.readline)  # ... and end
        print(cpu() - began, flush=True)


async def caller(
    keys: irismesh.Keyring, child: subprocess.Popen[str], endpoint: str, args: argparse.Namespace
) -> tuple[float, float, float]:
    assert child.stdin is not None
    assert child.stdout is not None
    async with irismesh.Node(keyring=keys, seeds=[endpoint], discovery=False) as node:
        await node.wait_for_members("echo", 1, timeout=10)
        if args.split:
            await node.set_split("echo", split_weights(args.split))
        payload = os.urandom(args.size)
        left = 0

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await node.request("echo", payload)

        left = min(20_000, args.requests)  # warm-up
        await asyncio.gather(*(worker() for _ in range(args.outstanding)))
        child.stdin.write("begin\n")
        child.stdin.flush()
        began, started = cpu(), time.perf_counter()
        left = args.requests
        await asyncio.gather(*(worker() for _ in range(args.outstanding)))
        spent, wall = cpu() - began, time.perf_counter() - started
        child.stdin.write("end\n")
        child.stdin.flush()
        member_spent = float(child.stdout.readline())
    n = args.requests
    return spent / n * 1e6, member_spent / n * 1e6, n / wall


def split_weights(text: str) -> dict[str, int]:
    return {v: int(w) for v, _, w in (pair.partition("=") for pair in text.split(","))}


def one_round(keyfile: Path, keys: irismesh.Keyring, args: argparse.Namespace) -> tuple[float, ...]:
    version = next(iter(split_weights(args.split))) if args.split else ""
    child = subprocess.Popen(
        [sys.executable, __file__, "--member", str(keyfile), "--version", version],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        if not endpoint:
            raise SystemExit("the member did not start")
        return irismesh.run(caller(keys, child, endpoint, args))
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=30)


def main() -> int:
    parser = harness.rounds_parser(__doc__, rounds=3)
    parser.add_argument("--requests", type=int, default=150_000)
    parser.add_argument("--outstanding", type=int, default=100)
    parser.add_argument(
        "--split",
        default="",
        metavar="VERSION=WEIGHT,...",
        help="the caller sets this traffic split first; the member serves as its first version",
    )
    parser.add_argument("--member", metavar="KEYFILE", help=argparse.SUPPRESS)
    parser.add_argument("--version", default="", help=argparse.SUPPRESS)
    args = harness.parse_args(parser)
    harness.otel_from_env()  # IRISMESH_BENCH_OTEL=batch: tracing into the SDK (tracing_cost.py)
    if args.member:
        irismesh.run(member(args.member, args.version))
        return 0

    def measure(keys: irismesh.Keyring, keyfile: Path, last: bool) -> tuple[float, ...]:
        return one_round(keyfile, keys, args)

    what = f"{args.requests:,} requests"
    results = harness.keyed_rounds(args.rounds, what, measure, prefix="cpu")
    harness.print_medians(
        [
            ("caller", [r[0] for r in results], "{:,.2f}", " us"),
            ("member", [r[1] for r in results], "{:,.2f}", " us"),
            ("rate", [r[2] for r in results], "{:,.0f}", " /s"),
        ],
        width=6,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
