"""What giving the event loop its turns costs a publisher: slices side by side, in one process.

    python bench/fairness_cost.py [--rounds 7] [--count 200000] [--slices 0.002,0.005,off]

A publisher whose every `publish` finds room never waits, so the node gives its loop a turn
every `irismesh._turns.SLICE` seconds (`Turns`): that is what keeps it alive to its peers. This
benchmark measures what that costs, with everything else held equal: one publisher node (this
process) and one subscriber node (a child process) on 127.0.0.1, 100-byte messages, and the
publisher's slice changed between runs of `--count` publishes, the slices interleaved round
after round ("off": a slice of 1e9 s, no turn ever given). Comparing builds
(`bench/builds_ab.py`) moves single runs by a fifth on a busy machine; here the subscriber,
the links and the process stay the same, so the only difference between rows is the slice.

For each slice it prints the median over rounds of the publish rate, the publisher's CPU per
message (its process time: steadier than rates on a busy machine) and the turns given per run,
and their ratio to "off". The machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _harness as harness

import irismesh
from irismesh import _turns

OFF = 1e9
TOPIC = "bench.fairness"


def parse_slices(text: str) -> list[float]:
    slices = []
    for part in text.split(","):
        part = part.strip()
        slices.append(OFF if part == "off" else float(part))
    if OFF not in slices:
        slices.append(OFF)  # the reference
    return slices


async def subscriber(keyring: str) -> None:
    node = await irismesh.Node(keyring=irismesh.Keyring.load(keyring)).start()
    received = 0

    def on(_msg: irismesh.Message) -> None:
        nonlocal received
        received += 1

    node.subscribe(TOPIC + ".#", callback=on)
    print(f"READY {node.endpoint}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print(f"RECEIVED {received}", flush=True)
    await node.close()


async def publisher(args: argparse.Namespace, endpoint: str, keys: irismesh.Keyring) -> None:
    slices = parse_slices(args.slices)
    payload = b"x" * 100
    rates: dict[float, list[float]] = {s: [] for s in slices}
    cpus: dict[float, list[float]] = {s: [] for s in slices}
    turns: dict[float, list[int]] = {s: [] for s in slices}
    kept = _turns.SLICE
    async with irismesh.Node(keyring=keys, seeds=[endpoint]) as node:
        await node.wait_for_subscribers(TOPIC + ".x", 1, timeout=10)
        for _ in range(2_000):  # links warm, credit flowing
            await node.publish(TOPIC + ".x", payload)
        try:
            for round_ in range(args.rounds):
                for slice_ in slices:
                    _turns.SLICE = slice_
                    given = node.stats.get("loop_turns_given", 0)
                    cpu, began = time.process_time(), time.monotonic()
                    for _ in range(args.count):
                        await node.publish(TOPIC + ".x", payload)
                    took = time.monotonic() - began
                    cpus[slice_].append((time.process_time() - cpu) / args.count * 1e6)
                    rates[slice_].append(args.count / took)
                    turns[slice_].append(node.stats.get("loop_turns_given", 0) - given)
                harness.progress(f"round {round_ + 1} of {args.rounds} done", clock=True)
        finally:
            _turns.SLICE = kept
    off_rate, off_cpu = statistics.median(rates[OFF]), statistics.median(cpus[OFF])
    header = f"{'slice':>8} {'publishes/s':>12} {'ratio':>6} {'CPU us/msg':>11} {'ratio':>6}"
    print(header + " turns/run")
    for slice_ in slices:
        rate, cpu = statistics.median(rates[slice_]), statistics.median(cpus[slice_])
        name = "off" if slice_ == OFF else f"{slice_ * 1e3:g} ms"
        print(
            f"{name:>8} {rate:>12,.0f} {rate / off_rate:>6.3f} {cpu:>11.3f} {cpu / off_cpu:>6.3f}"
            f" {statistics.median(turns[slice_]):>9.0f}"
        )


def main() -> int:
    parser = harness.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--count", type=int, default=200_000, help="publishes per run")
    parser.add_argument("--slices", default="0.002,0.005,off", help="seconds, or off")
    parser.add_argument("--role", choices=["sub"], help=argparse.SUPPRESS)
    parser.add_argument("--keyring", help=argparse.SUPPRESS)
    args = harness.parse_args(parser)
    if args.role == "sub":
        irismesh.run(subscriber(args.keyring))
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    keys = irismesh.Keyring.generate()
    with tempfile.TemporaryDirectory() as tmp, harness.ChildProcesses() as procs:
        keyring = Path(tmp) / "mesh.keys"
        keys.save(keyring)
        argv = [sys.executable, __file__, "--role", "sub", "--keyring", str(keyring)]
        if args.allow_pure:
            argv.append("--allow-pure")
        child = procs.spawn("subscriber", argv)
        endpoint = child.expect_prefix("READY ", 30)
        irismesh.run(publisher(args, endpoint, keys))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
