"""CPU time per message of an irismesh publisher and its subscribers: the pub/sub figure a busy
machine barely moves.

    python bench/cpu_per_message.py [--messages 200000] [--fanout 4] [--size 100] [--rounds 3]
                                    [--profile pub.prof] [--profile-sub sub.prof]

The publisher (a `Node`, sealed, telemetry off unless --telemetry) runs in this process and
publishes --messages messages of --size bytes on one topic to --fanout subscriber processes
(each a `Node` with a callback subscription, as in `pubsub.py`) on 127.0.0.1, after a warm-up.
Each side reads its own CPU time (`getrusage`: user + system) around exactly the measured
messages, and also its event loop's thread's alone (the rest is zmq's I/O thread and the
kernel's work charged to the process); every subscriber checks that it got all of them, in
order. The table shows the publisher's CPU per publish and, the median of the subscribers, the
CPU per message received; before/after comparisons interleave runs of two builds and compare
medians.

`--profile PATH` runs the measured publishes of the last round under cProfile (timed by thread
CPU time) and writes the statistics to PATH; `--profile-sub PATH` does the same for the first
subscriber. Print them with `python -m pstats PATH` (`sort tottime`, `stats 25`).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import resource
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import _harness as harness

import irismesh

TOPIC = "bench.data"
SEQ = struct.Struct("<Q")
WARMUP = 1 << 62  # warm-up messages are numbered from here: no subscriber counts them


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def subscriber(
    keyfile: str, endpoint: str, total: int, profile: str, telemetry: bool
) -> None:
    keys = irismesh.Keyring.load(keyfile)
    async with irismesh.Node(
        keyring=keys, seeds=[endpoint], discovery=False, telemetry=telemetry
    ) as node:
        done = asyncio.Event()
        state = {"next": 0, "bad": 0, "began": 0.0, "thread": 0.0}
        profiler = cProfile.Profile(time.thread_time) if profile else None
        unpack = SEQ.unpack_from

        def on_message(msg: irismesh.Message) -> None:
            seq = unpack(msg.payload)[0]
            if seq >= WARMUP:
                return
            expected = state["next"]
            if seq != expected or msg.missed:
                state["bad"] += 1
            state["next"] = seq + 1
            if seq == 0:
                state["began"], state["thread"] = cpu(), time.thread_time()
                if profiler is not None:
                    profiler.enable()
            if seq + 1 == total:
                if profiler is not None:
                    profiler.disable()
                done.set()

        node.subscribe(TOPIC, callback=on_message)
        print("READY", flush=True)
        await done.wait()
        spent, thread = cpu() - state["began"], time.thread_time() - state["thread"]
        if profiler is not None:
            profiler.dump_stats(profile)
        print(f"{spent} {thread} {state['bad']} {state['next']}", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # stay until told


# CPU us per publish (all threads, the loop's), per subscriber (all, loop's), messages/s.
Figures = tuple[float, float, list[tuple[float, float]], float]


async def publisher(
    keys: irismesh.Keyring, keyfile: Path, args: argparse.Namespace, profile: str, sub_prof: str
) -> Figures:
    async with irismesh.Node(keyring=keys, discovery=False, telemetry=args.telemetry) as node:
        endpoint = node.endpoint
        # Warm-up messages carry sequence numbers from -warmup; the subscribers count from 0.
        children = []
        for i in range(args.fanout):
            command = [
                sys.executable,
                __file__,
                "--subscriber",
                str(keyfile),
                endpoint,
                str(args.messages),
                sub_prof if i == 0 else "",
                "1" if args.telemetry else "",
            ]
            children.append(
                subprocess.Popen(  # noqa: ASYNC220 (started before anything is measured)
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
            )
        try:
            loop = asyncio.get_running_loop()
            for child in children:
                assert child.stdout is not None
                line = await loop.run_in_executor(None, child.stdout.readline)
                if line.strip() != "READY":
                    raise SystemExit("a subscriber did not start")
            await node.wait_for_subscribers(TOPIC, count=args.fanout, timeout=20)
            body = os.urandom(max(0, args.size - SEQ.size))
            publish, pack = node.publish, SEQ.pack
            # A warm-up that no subscriber counts (its sequence numbers are past the end).
            for i in range(20_000):
                await publish(TOPIC, pack(WARMUP | i) + body)
            await asyncio.sleep(0.5)
            profiler = cProfile.Profile(time.thread_time) if profile else None
            began, started, thread0 = cpu(), time.perf_counter(), time.thread_time()
            if profiler is not None:
                profiler.enable()
            for seq in range(args.messages):
                await publish(TOPIC, pack(seq) + body)
            if profiler is not None:
                profiler.disable()
            spent, thread = cpu() - began, time.thread_time() - thread0
            subs: list[tuple[float, float]] = []
            for child in children:
                assert child.stdout is not None
                line = await loop.run_in_executor(None, child.stdout.readline)
                sub_spent, sub_thread, bad, got = line.split()
                if int(bad) or int(got) != args.messages:
                    raise SystemExit(f"a subscriber got {got} messages, {bad} out of order")
                subs.append((float(sub_spent), float(sub_thread)))
            wall = time.perf_counter() - started
            if profiler is not None:
                profiler.dump_stats(profile)
        finally:
            for child in children:
                if child.stdin is not None:
                    child.stdin.close()
                child.wait(timeout=30)
    n = args.messages
    per_sub = [(s / n * 1e6, t / n * 1e6) for s, t in subs]
    return spent / n * 1e6, thread / n * 1e6, per_sub, n / wall


def main() -> int:
    parser = harness.rounds_parser(__doc__, rounds=3, size_help="payload bytes (8 at least)")
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--fanout", type=int, default=4)
    parser.add_argument("--profile", default="", metavar="PATH")
    parser.add_argument("--profile-sub", default="", metavar="PATH")
    parser.add_argument("--telemetry", action="store_true", help="telemetry on (off by default)")
    parser.add_argument("--subscriber", nargs=5, help=argparse.SUPPRESS)
    args = harness.parse_args(parser)
    harness.otel_from_env()  # IRISMESH_BENCH_OTEL=batch: tracing into the SDK (tracing_cost.py)
    if args.subscriber:
        keyfile, endpoint, total, profile, telemetry = args.subscriber
        irismesh.run(subscriber(keyfile, endpoint, int(total), profile, bool(telemetry)))
        return 0

    def measure(keys: irismesh.Keyring, keyfile: Path, last: bool) -> Figures:
        profile, sub_prof = (args.profile, args.profile_sub) if last else ("", "")
        return irismesh.run(publisher(keys, keyfile, args, profile, sub_prof))

    what = f"{args.messages:,} messages"
    results = harness.keyed_rounds(args.rounds, what, measure, prefix="cpu")
    subs = [statistics.median(s for s, _ in r[2]) for r in results]
    sub_loops = [statistics.median(t for _, t in r[2]) for r in results]
    harness.print_medians(
        [
            ("publisher us/msg", [r[0] for r in results], "{:,.2f}", ""),
            (" its loop's thread", [r[1] for r in results], "{:,.2f}", ""),
            ("subscriber us/msg", subs, "{:,.2f}", ""),
            (" its loop's thread", sub_loops, "{:,.2f}", ""),
            ("msg/s", [r[3] for r in results], "{:,.0f}", ""),
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
