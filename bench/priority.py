"""Priority benchmark: the latency of high-priority requests at a member overloaded with
low-priority ones, next to their latency unloaded and to the low-priority ones'.

    python bench/priority.py [--cost 5] [--load 3] [--seconds 5] [--probe-rate 20]
                             [--deadline 1] [--quick] [--json out.json]

One member process of cluster "work" answers each request with a plain (synchronous) handler
that burns `--cost` ms of CPU; a loader process sends it the low-priority load and a prober
process the probes (apart, so that generating the load does not delay the probes' replies in
their caller); all on 127.0.0.1. In order:

1. unloaded: high-priority probes alone, `--probe-rate` a second (open loop), for `--seconds`:
   their p50 and p99;
2. capacity C: replies/s with 8 normal-priority requests in flight, for 2 s;
3. overload: low-priority requests at `--load` x C (open loop, each with a `--deadline`
   timeout) and, at the same time, high-priority probes at `--probe-rate`: the probes' p50 and
   p99, the low-priority requests served (their p50 and p99, and as a share of C) and how the
   others failed;
4. control: the same overload with the probes at the low priority too (what they would see
   without priorities).

The table's ratios are the figures to track: high p99 under overload / high p99 unloaded (the
goal: at most 3x), high p99 / low p99 in the same run, control p99 / unloaded p99, and the low
priority's goodput / C (the goal: above 0, low-priority work still completes).

The parent only orchestrates (this same file is the children's program, `--role
member|caller`): it tells the children what to do on their stdin, they answer in JSON lines on
stdout, die with the parent, have a hard timeout, and the parent stops them in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import _harness as harness

import irismesh
from irismesh import Priority

CLUSTER = "work"
BIND = "tcp://127.0.0.1:0"
CAPACITY_S = 2.0
CAPACITY_IN_FLIGHT = 8
WARMUP_S = 0.5
STARTUP_S = 30.0


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def pct(values: list[float], q: float) -> float | None:
    return harness.percentile(sorted(values), q) if values else None


# ============================================================================================
# Child: member


async def member_main(args: argparse.Namespace) -> None:
    def on_line(node: irismesh.Node, line: str) -> None:
        if line == "stats":
            stats = {k: v for k, v in node.stats.items() if k.startswith("requests_")}
            harness.emit("stats", stats=stats)

    await harness.busy_member(args.keyring, args.cost / 1000.0, on_line, cluster=CLUSTER)


# ============================================================================================
# Children: loader and prober


class Calls:
    """Outcomes of one kind of request in one phase: latency of the served, failures by type."""

    def __init__(self) -> None:
        self.served: list[float] = []
        self.failed: Counter[str] = Counter()

    async def call(
        self, node: irismesh.Node, payload: bytes, timeout: float, priority: int
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            reply = await node.request(CLUSTER, payload, timeout=timeout, priority=priority)
        except irismesh.MeshError as exc:
            self.failed[type(exc).__name__] += 1
            return
        took = loop.time() - started
        if reply != payload:
            self.failed["WrongReply"] += 1
        else:
            self.served.append(took)

    def summary(self, seconds: float) -> dict[str, Any]:
        return {
            "requests": len(self.served) + sum(self.failed.values()),
            "ok": len(self.served),
            "ok_per_s": len(self.served) / seconds,
            "failures": dict(self.failed.most_common()),
            "p50_ms": ms(pct(self.served, 50)),
            "p99_ms": ms(pct(self.served, 99)),
            "max_ms": ms(max(self.served) if self.served else None),
        }


async def open_loop(
    node: irismesh.Node, tag: bytes, rate: float, args: argparse.Namespace, priority: int
) -> dict[str, Any]:
    """Requests started on a fixed schedule for `--seconds`, each its own task, whatever the
    earlier ones do; their outcomes once every one has one."""
    loop = asyncio.get_running_loop()
    calls = Calls()
    interval, count = 1.0 / rate, max(1, round(rate * args.seconds))
    start = loop.time() + 0.002
    tasks: list[asyncio.Task[None]] = []

    def launch(index: int, due: float) -> None:
        payload = tag + b":%d" % index
        tasks.append(loop.create_task(calls.call(node, payload, args.deadline, priority)))

    await harness.on_schedule(start, interval, count, launch)
    await asyncio.gather(*tasks)
    return calls.summary(args.seconds)


async def closed_loop(node: irismesh.Node, in_flight: int, seconds: float) -> float:
    """Replies/s with `in_flight` requests always outstanding (normal priority)."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    done = 0

    async def worker(n: int) -> None:
        nonlocal done
        i = 0
        while loop.time() < stop_at:
            await node.request(CLUSTER, b"C%d:%d" % (n, i), timeout=5.0)
            i += 1
            if loop.time() <= stop_at:
                done += 1

    await asyncio.gather(*(worker(n) for n in range(in_flight)))
    return done / seconds


async def caller_main(args: argparse.Namespace) -> None:
    """The loader (low-priority load, and the capacity) or the prober (the probes): each in
    a process of its own, so that generating the load does not delay the probes' replies
    in the caller. Commands on stdin: `capacity`, `load RATE TAG`, `probe PRIORITY TAG`."""
    keys = irismesh.Keyring.load(args.keyring)
    commands: asyncio.Queue[str] = harness.stdin_commands()
    async with irismesh.Node(keyring=keys, bind=BIND, seeds=[args.seeds], survey=False) as node:
        await node.wait_for_members(CLUSTER, timeout=STARTUP_S)
        await closed_loop(node, 1, WARMUP_S)
        print("READY", flush=True)
        while True:
            verb, *rest = (await commands.get()).split()
            if verb == "capacity":
                harness.emit(
                    "capacity", rps=await closed_loop(node, CAPACITY_IN_FLIGHT, CAPACITY_S)
                )
            elif verb == "load":
                rate, tag = float(rest[0]), rest[1]
                harness.emit("done", tag=tag, **await open_loop(node, tag.encode(), rate, args, -1))
            elif verb == "probe":
                priority, tag = int(rest[0]), rest[1]
                probes = await open_loop(node, tag.encode(), args.probe_rate, args, priority)
                harness.emit("done", tag=tag, **probes)


def run_child(args: argparse.Namespace) -> None:
    harness.exit_after(args.max_seconds)
    try:
        asyncio.run(member_main(args) if args.role == "member" else caller_main(args))
    except BaseException as exc:
        harness.emit("error", message=f"{type(exc).__name__}: {exc}")
        raise


# ============================================================================================
# Parent


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def report(result: dict[str, Any], args: argparse.Namespace, facts: dict[str, Any]) -> str:
    unloaded, c = result["unloaded"], result["capacity_rps"]
    loaded, control = result["overload"], result["control"]
    high, low = loaded["probes"], loaded["low"]
    lines = [
        f"priority benchmark: one member, handler {args.cost:g} ms of CPU, capacity C = "
        f"{c:,.0f} req/s; low priority offered at {args.load:g}x C for {args.seconds:g} s, "
        f"high-priority probes at {args.probe_rate:g}/s, deadline {args.deadline:g} s",
        f"machine: {facts['cpus']} CPUs, {facts['cpu_busy_percent_before']}% busy before "
        f"the run (shared: figures are noisy), python {facts['python']}",
        "",
        f"{'requests':<34}{'served':>8}{'failed':>8}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}",
    ]

    def row(name: str, s: dict[str, Any]) -> str:
        failed = s["requests"] - s["ok"]
        return (
            f"{name:<34}{s['ok']:>8,}{failed:>8,}{fmt(s['p50_ms']):>9}{fmt(s['p99_ms']):>9}"
            f"{fmt(s['max_ms']):>9}"
        )

    lines += [
        row("high, unloaded", unloaded),
        row("high, under overload", high),
        row("low, same run", low),
        row("control: probes at low, overload", control["probes"]),
        row("control: low, same run", control["low"]),
        "",
    ]
    high_vs_unloaded = ratio(high["p99_ms"], unloaded["p99_ms"])
    goodput = low["ok_per_s"] / c
    lines += [
        f"high p99 under overload / unloaded p99:  {fmt(high_vs_unloaded, '.2f')}x  (goal <= 3x)",
        "high p99 / low p99, same run:             "
        f"{fmt(ratio(high['p99_ms'], low['p99_ms']), '.2f')}x",
        "control p99 / unloaded p99 (no priority): "
        f"{fmt(ratio(control['probes']['p99_ms'], unloaded['p99_ms']), '.2f')}x",
        f"low goodput / C under overload:           {goodput:.2f}  (goal > 0: low work completes)",
        f"low failures: {low['failures'] or 'none'}; high failures: {high['failures'] or 'none'}",
        f"member counters (whole run): {result.get('member', {})}",
    ]
    done = high_vs_unloaded is not None and high_vs_unloaded <= 3.0 and low["ok"] > 0
    lines.append(f"done means met in this run: {'yes' if done else 'NO'}")
    return "\n".join(lines)


def expect(child: harness.Child, event: str, timeout: float) -> dict[str, Any]:
    """The next JSON line of `child` that is `event` (an "error" one raises)."""
    deadline = time.monotonic() + timeout
    while True:
        line = child.next_line(deadline)
        if line is None:
            raise harness.BenchError(f"{child.name}: no {event!r} within {timeout:.0f} s")
        found = json.loads(line) if line.startswith("{") else {}
        if found.get("event") == "error":
            raise harness.BenchError(f"{child.name}: {found['message']}\n{child.stderr_tail()}")
        if found.get("event") == event:
            return found


def tell(child: harness.Child, line: str) -> None:
    stdin = child.proc.stdin
    if stdin is None:
        raise harness.BenchError(f"{child.name}: no stdin")
    stdin.write(line.encode() + b"\n")
    stdin.flush()


def measure(args: argparse.Namespace, keyring: str, kids: harness.ChildProcesses) -> dict[str, Any]:
    me = [sys.executable, os.path.abspath(__file__), "--keyring", keyring]
    common = ["--cost", str(args.cost), "--max-seconds", str(args.max_seconds)]
    common += ["--seconds", str(args.seconds), "--deadline", str(args.deadline)]
    common += ["--probe-rate", str(args.probe_rate)]
    member = kids.spawn("member", [*me, "--role", "member", *common])
    endpoint = member.expect_prefix("READY", STARTUP_S)
    loader = kids.spawn("loader", [*me, "--role", "caller", "--seeds", endpoint, *common])
    prober = kids.spawn("prober", [*me, "--role", "caller", "--seeds", endpoint, *common])
    loader.expect_prefix("READY", STARTUP_S)
    prober.expect_prefix("READY", STARTUP_S)
    phase = args.seconds + 2 * args.deadline + 30.0

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    progress(f"unloaded: high-priority probes alone, {args.seconds:g} s")
    tell(prober, f"probe {int(Priority.HIGH)} U")
    unloaded = expect(prober, "done", phase)
    progress(f"capacity: {CAPACITY_IN_FLIGHT} in flight for {CAPACITY_S:g} s")
    tell(loader, "capacity")
    capacity = float(expect(loader, "capacity", CAPACITY_S + 30.0)["rps"])
    if capacity <= 0:
        raise harness.BenchError("no capacity measured")
    result: dict[str, Any] = {"unloaded": unloaded, "capacity_rps": capacity}
    for name, probe in (("overload", Priority.HIGH), ("control", Priority.LOW)):
        progress(
            f"{name}: low priority at {args.load:g} x {capacity:,.0f} req/s, probes at "
            f"priority {int(probe)}, {args.seconds:g} s"
        )
        tell(loader, f"load {args.load * capacity} L{name[0]}")
        tell(prober, f"probe {int(probe)} H{name[0]}")
        result[name] = {
            "low": expect(loader, "done", phase),
            "probes": expect(prober, "done", phase),
        }
        time.sleep(args.deadline)  # the member's backlog drains
    tell(member, "stats")
    stats = expect(member, "stats", 10.0)["stats"]
    result["member"] = {
        k: v
        for k, v in stats.items()
        if k.startswith(("requests_admitted", "requests_shed", "requests_queued"))
        and not k.endswith("_for_member")
    }
    return result


def main_parent(args: argparse.Namespace) -> int:
    harness.raise_keyboard_interrupt_on_sigterm()
    facts = harness.machine_facts(busy=True)
    with (
        tempfile.TemporaryDirectory(prefix="irismesh-priority-") as tmp,
        harness.ChildProcesses() as kids,
    ):
        keyring = os.path.join(tmp, "bench.keys")
        irismesh.Keyring.generate().save(keyring)
        try:
            result = measure(args, keyring, kids)
        except KeyboardInterrupt:
            print("interrupted; every child process has been stopped", file=sys.stderr)
            return 130
        except harness.BenchError as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
    print(report(result, args, facts))
    if args.json:
        harness.write_json(args.json, {"facts": facts, "settings": vars(args), "result": result})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__)
    positive = functools.partial(parser.add_argument, type=harness.positive_float)
    positive("--cost", default=5.0, help="handler CPU, ms")
    positive("--load", default=3.0, help="low-priority load, multiple of C")
    positive("--seconds", default=None, help="per phase")
    positive(
        "--probe-rate",
        default=20.0,
        help="high-priority probes a second",
    )
    positive("--deadline", default=1.0, help="request timeout")
    parser.add_argument("--quick", action="store_true", help="2 s phases: a smoke test")
    harness.add_child_arguments(parser, ("member", "caller"))
    parser.add_argument("--seeds", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    parser = build_parser()
    args = harness.parse_args(parser)
    if args.seconds is None:
        args.seconds = 2.0 if args.quick else 5.0
    if args.role:
        run_child(args)
        return 0
    if args.cost >= args.deadline * 1000.0:
        parser.error("--cost must be well below --deadline")
    if args.load > 50 or args.seconds > 120:
        parser.error("--load is limited to 50 and --seconds to 120")
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
