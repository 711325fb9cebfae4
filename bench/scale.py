"""Scale benchmark: N member processes on 127.0.0.1, time to full membership, CPU and RSS per node.

    python bench/scale.py [--sizes 10,20,40] [--discovery seeds|survey] [--seeds 2]
                          [--window 5] [--json out.json | --json -]

For each size N the parent starts N node processes (this same file with `--role node`), all
members of the cluster "bench" bound to 127.0.0.1. With `--discovery seeds` (the default) the
first `--seeds` nodes start first and every other node is given their endpoints, so the rest of
the mesh is learnt by gossip; with `--discovery survey` no node has a seed and they find each
other by SURVEY multicast pinned to 127.0.0.1 (a random group and port per run).

Figures per size:
- startup: from the first spawn until the last node printed READY (mostly Python importing
  irismesh, N processes on this machine's cores);
- full membership: until every node saw all N-1 others as members, counted from the last
  READY (the mesh's own convergence) and from the first spawn;
- steady state: after convergence and `--settle` seconds, the CPU each node used over
  `--window` seconds (utime + stime from /proc/PID/stat, in % of one core) and its RSS, with
  how busy the whole machine was meanwhile (/proc/stat);
- membership drops: members lost after convergence (there should be none: nothing fails).
Then how each figure grows from one size to the next (20/10, 40/20).

Children die with the parent: stdin EOF, PR_SET_PDEATHSIG, a hard timeout; the parent stops
them all in a `finally`, on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _harness import (
    MB,
    BenchError,
    Child,
    ChildProcesses,
    emit,
    exit_after,
    on_stdin_eof,
    raise_keyboard_interrupt_on_sigterm,
)

CLUSTER = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
SATURATED = 90.0  # % of the whole machine busy: CPU figures are capped, not measured


# ============================================================================================
# Child: one node


async def run_node(args: argparse.Namespace) -> None:
    import irismesh

    keys = irismesh.Keyring.load(args.keyring)
    survey: bool | irismesh.SurveyConfig = False
    if args.survey:
        group, port, realm = args.survey.split(",")
        survey = irismesh.SurveyConfig(
            group=group, port=int(port), interface="127.0.0.1", realm=bytes.fromhex(realm)
        )
    node = irismesh.Node(
        CLUSTER, keyring=keys, bind="tcp://127.0.0.1:0", seeds=args.seed, survey=survey
    )
    async with node:

        @node.on_request
        def echo(payload: bytes) -> bytes:
            return payload

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        on_stdin_eof(lambda: loop.call_soon_threadsafe(stop.set))
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print(f"READY {node.endpoint} {node.node_id.hex()} {time.monotonic()!r}", flush=True)
        target = args.expect
        last = -1
        # Until full: woken by every membership change (no polling), progress at most 4/s.
        while not stop.is_set():
            with contextlib.suppress(irismesh.MembershipTimeout):
                await node.wait_for_members(CLUSTER, target, timeout=0.25)
            count = len(node.members(CLUSTER))
            if count >= target:
                emit("full", at=time.monotonic(), members=count)
                last = count
                break
            if count != last:
                emit("count", members=count)
                last = count
        # Steady state: a cheap look twice a second for members lost and peers declared down.
        downs: dict[str, int] = {}
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            count = len(node.members(CLUSTER))
            if count != last:
                emit("count", members=count, at=time.monotonic())
                last = count
            now = {k: v for k, v in node.stats.items() if k.startswith("peers_down") and v}
            if now != downs:
                emit("down", stats=now, at=time.monotonic())
                downs = now


# ============================================================================================
# Parent


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds used, RSS bytes) of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; fields[0] is state
    utime, stime, rss_pages = int(fields[11]), int(fields[12]), int(fields[21])
    return (utime + stime) / CLK_TCK, rss_pages * PAGE


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user
    return (total - idle) / CLK_TCK, total / CLK_TCK


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "total": sum(values),
    }


@dataclass(kw_only=True, slots=True)
class Node:
    name: str
    child: Child
    ready_at: float = 0.0
    full_at: float | None = None
    members: int = 0
    drops: int = 0  # times its member count fell after it was full
    downs: dict[str, int] = field(default_factory=dict)


def drain(nodes: Sequence[Node]) -> None:
    """Take every line the nodes have printed so far, without blocking."""
    for node in nodes:
        while True:
            line = node.child.next_line(0.0)
            if line is None:
                break
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event")
            if kind == "full":
                node.full_at = float(event["at"])
                node.members = int(event["members"])
            elif kind == "count":
                if node.full_at is not None and int(event["members"]) < node.members:
                    node.drops += 1
                node.members = int(event["members"])
            elif kind == "down":
                node.downs = {k: int(v) for k, v in event["stats"].items()}


def measure(size: int, args: argparse.Namespace, keyring: str) -> dict[str, Any]:
    n_seeds = 0 if args.discovery == "survey" else min(args.seeds, size)
    base = [sys.executable, os.path.abspath(__file__), "--role", "node", "--keyring", keyring]
    base += ["--expect", str(size - 1), "--max-seconds", str(args.timeout * 3 + 120)]
    if args.discovery == "survey":
        group = f"239.255.{random.randint(74, 250)}.{random.randint(1, 254)}"
        realm = os.urandom(16).hex()
        base += ["--survey", f"{group},{free_udp_port()},{realm}"]
    nodes: list[Node] = []
    with ChildProcesses() as procs:
        try:
            return _measure(procs, nodes, size, n_seeds, base, args)
        finally:
            # All at once: close every stdin (each node leaves), then the `with` reaps them.
            for node in nodes:
                with contextlib.suppress(OSError):
                    if node.child.proc.stdin is not None:
                        node.child.proc.stdin.close()


def _measure(
    procs: ChildProcesses,
    nodes: list[Node],
    size: int,
    n_seeds: int,
    base: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    spawned = time.monotonic()
    deadline = spawned + args.timeout
    seeds: list[str] = []

    def ready(node: Node) -> str:
        rest = node.child.expect_prefix("READY", max(0.1, deadline - time.monotonic()))
        endpoint, _node_id, at = rest.split()
        node.ready_at = float(at)
        return endpoint

    for i in range(n_seeds):
        nodes.append(Node(name=f"node{i + 1}", child=procs.spawn(f"node{i + 1}", base)))
    for node in nodes:
        seeds.append(ready(node))
    seed_args = [arg for seed in seeds for arg in ("--seed", seed)]
    for i in range(n_seeds, size):
        name = f"node{i + 1}"
        nodes.append(Node(name=name, child=procs.spawn(name, [*base, *seed_args])))
    for node in nodes[n_seeds:]:
        ready(node)
    last_ready = max(node.ready_at for node in nodes)
    progress(f"  {size} nodes ready {last_ready - spawned:.1f} s after the first spawn")

    shown = time.monotonic()
    while True:
        drain(nodes)
        full = [n for n in nodes if n.full_at is not None]
        now = time.monotonic()
        if len(full) == size or now > deadline:
            break
        if now - shown >= 1.0:
            shown = now
            fewest = min(n.members for n in nodes)
            progress(
                f"  {now - spawned:5.1f} s: {len(full)}/{size} nodes see all {size - 1} others "
                f"(fewest members seen by a node: {fewest})"
            )
        time.sleep(0.02)
    full_at = [n.full_at for n in nodes if n.full_at is not None]
    result: dict[str, Any] = {
        "nodes": size,
        "seeds": n_seeds,
        "discovery": args.discovery,
        "startup_s": last_ready - spawned,
        "nodes_full": len(full_at),
    }
    if len(full_at) < size:
        fewest = min(n.members for n in nodes)
        progress(
            f"  NOT converged within {args.timeout:.0f} s: {len(full_at)}/{size} nodes full, "
            f"fewest members seen {fewest}"
        )
        result["converged"] = False
    else:
        result["converged"] = True
        result["full_after_ready_s"] = max(0.0, max(full_at) - last_ready)
        result["full_after_spawn_s"] = max(full_at) - spawned
        progress(
            f"  full membership {result['full_after_ready_s']:.2f} s after the last node was "
            f"ready ({result['full_after_spawn_s']:.2f} s after the first spawn)"
        )

    # Steady state: nothing happens but heartbeats and gossip.
    time.sleep(args.settle)
    drain(nodes)
    pids = {n.name: n.child.pid for n in nodes}
    first = {name: proc_stat(pid) for name, pid in pids.items()}
    busy0, total0 = machine_busy()
    began = time.monotonic()
    progress(f"  measuring CPU and RSS of {size} idle nodes for {args.window:.0f} s")
    while time.monotonic() < began + args.window:
        time.sleep(0.1)
        drain(nodes)
    last = {name: proc_stat(pid) for name, pid in pids.items()}
    busy1, total1 = machine_busy()
    seconds = time.monotonic() - began
    cpu = [100.0 * (last[n][0] - first[n][0]) / seconds for n in pids]
    rss = [last[n][1] / MB for n in pids]
    drain(nodes)
    downs: dict[str, int] = {}
    for node in nodes:
        for key, value in node.downs.items():
            downs[key] = downs.get(key, 0) + value
    result.update(
        {
            "window_s": seconds,
            "cpu_percent_per_node": summary(cpu),
            "rss_mb_per_node": summary(rss),
            "machine_busy_percent": 100.0 * (busy1 - busy0) / max(1e-9, total1 - total0),
            "membership_drops": sum(n.drops for n in nodes),
            "peers_down": downs,
        }
    )
    # The rest of the machine's work meanwhile, in % of the whole machine: well above zero
    # means something else ran (a test suite, another benchmark) and disturbed the figures.
    ours = result["cpu_percent_per_node"]["total"] / (os.cpu_count() or 1)
    result["others_busy_percent"] = max(0.0, result["machine_busy_percent"] - ours)
    result["saturated"] = result["machine_busy_percent"] >= SATURATED
    c, r = result["cpu_percent_per_node"], result["rss_mb_per_node"]
    if result["saturated"]:
        progress(
            f"  warning: the machine was {result['machine_busy_percent']:.0f}% busy: the nodes "
            "wanted more CPU than there is, so their CPU figures are capped by the machine"
        )
    progress(
        f"  CPU per node {c['mean']:.1f}% of a core (max {c['max']:.1f}%, all nodes "
        f"{c['total']:.0f}%), RSS per node {r['mean']:.1f} MB (max {r['max']:.1f}), machine "
        f"{result['machine_busy_percent']:.0f}% busy ({result['others_busy_percent']:.0f}% by "
        f"others); drops after convergence: {result['membership_drops']}"
        + (f", peers down: {downs}" if downs else "")
    )
    return result


GROWTH = {
    "full membership after last READY (s)": ("full_after_ready_s", None),
    "startup (s)": ("startup_s", None),
    "CPU per node (% of a core)": ("cpu_percent_per_node", "mean"),
    "CPU of all nodes (% of a core)": ("cpu_percent_per_node", "total"),
    "RSS per node (MB)": ("rss_mb_per_node", "mean"),
}


def figure(result: dict[str, Any], key: str, sub: str | None) -> float | None:
    value = result.get(key)
    if isinstance(value, dict) and sub is not None:
        value = value.get(sub)
    return float(value) if isinstance(value, int | float) else None


def growth(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each figure at size b divided by the same figure at the previous size a, as 'b/a'."""
    out: dict[str, dict[str, float | None]] = {}
    for a, b in itertools.pairwise(results):
        step = f"{b['nodes']}/{a['nodes']}"
        out[step] = {}
        for label, (key, sub) in GROWTH.items():
            x, y = figure(a, key, sub), figure(b, key, sub)
            out[step][label] = y / x if x and y is not None else None
    return out


def print_report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    out = sys.stderr if args.json == "-" else sys.stdout  # stdout then carries the JSON
    console = Console(file=out) if out.isatty() else Console(file=out, width=140)
    how = "survey on 127.0.0.1" if args.discovery == "survey" else f"{args.seeds} seed(s) + gossip"
    table = Table(
        title=f"irismesh at scale: N member processes on 127.0.0.1, {how}, {os.cpu_count()} CPUs",
        caption="full: every node sees all N-1 others; CPU and RSS per node over "
        f"{args.window:.0f} s of steady state (mean \\[max]); CPU in % of one core; machine "
        "busy: % of all CPUs, (others): used by other processes meanwhile; drops: members lost "
        "after convergence",
    )
    for column in (
        "N",
        "startup s",
        "full after last READY s",
        "full after spawn s",
        "CPU/node %",
        "CPU all nodes %",
        "RSS/node MB",
        "machine busy (others)",
        "drops, peers down",
    ):
        table.add_column(column, justify="right")
    for r in results:
        if not r.get("converged"):
            full = f"not in {args.timeout:.0f} s ({r['nodes_full']}/{r['nodes']})"
            after_spawn = "-"
        else:
            full = f"{r['full_after_ready_s']:.2f}"
            after_spawn = f"{r['full_after_spawn_s']:.2f}"
        c, m = r["cpu_percent_per_node"], r["rss_mb_per_node"]
        row = (
            str(r["nodes"]),
            f"{r['startup_s']:.1f}",
            full,
            after_spawn,
            f"{c['mean']:.1f} [{c['max']:.1f}]",
            f"{c['total']:.0f}",
            f"{m['mean']:.1f} [{m['max']:.1f}]",
            f"{r['machine_busy_percent']:.0f}% ({r['others_busy_percent']:.0f}%)"
            + (" saturated" if r["saturated"] else ""),
            f"{r['membership_drops']}"
            + "".join(f", {v} {k.removeprefix('peers_down_')}" for k, v in r["peers_down"].items()),
        )
        table.add_row(*(Text(cell) for cell in row))  # Text: "[max]" is not markup
    console.print(table)
    ratios = growth(results)
    if ratios:
        grow = Table(title="growth from one size to the next (figure at N_b / figure at N_a)")
        grow.add_column("figure")
        for step in ratios:
            grow.add_column(step, justify="right")
        for label in GROWTH:
            cells = [ratios[step][label] for step in ratios]
            grow.add_row(label, *("-" if v is None else f"{v:.2f}x" for v in cells))
        console.print(grow)
    if any(r["saturated"] for r in results):
        console.print(
            "saturated: the whole machine was busy during that window, so the nodes got less "
            "CPU than they asked for; per-node CPU there (and ratios to it) understate the cost"
        )


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--sizes wants comma-separated integers, got {text!r}") from None
    if not sizes or any(n < 2 for n in sizes):
        raise SystemExit("--sizes: every size must be at least 2")
    return sizes


def main_parent(args: argparse.Namespace) -> int:
    import irismesh

    raise_keyboard_interrupt_on_sigterm()
    sizes = parse_sizes(args.sizes)
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="irismesh-scale-") as tmp:
        keyring = os.path.join(tmp, "scale.keys")
        irismesh.Keyring.generate().save(keyring)
        try:
            for size in sizes:
                progress(f"[{len(results) + 1}/{len(sizes)}] {size} nodes ({args.discovery})")
                try:
                    results.append(measure(size, args, keyring))
                except BenchError as exc:
                    progress(f"  FAILED: {exc}")
                    return 1
        except KeyboardInterrupt:
            progress("interrupted; every node process has been stopped")
            return 130
    elapsed = time.monotonic() - started
    print_report(results, args)
    if args.json:
        document = {
            "facts": {
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            "settings": {
                "sizes": sizes,
                "discovery": args.discovery,
                "seeds": args.seeds,
                "settle_s": args.settle,
                "window_s": args.window,
                "timeout_s": args.timeout,
            },
            "results": results,
            "growth": growth(results),
            "elapsed_s": elapsed,
        }
        if args.json == "-":
            json.dump(document, sys.stdout, indent=2)
            print()
        else:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump(document, out, indent=2)
            progress(f"wrote {args.json}")
    return 0 if all(r.get("converged") for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="10,20,40", help="node counts (default 10,20,40)")
    parser.add_argument("--discovery", choices=("seeds", "survey"), default="seeds")
    parser.add_argument("--seeds", type=int, default=2, help="seed nodes (default 2)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--window", type=float, default=5.0, help="CPU window in seconds")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds allowed for startup + convergence"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write every number to PATH ('-': stdout)"
    )
    # The children's side of this file.
    parser.add_argument("--role", choices=("node",), help=argparse.SUPPRESS)
    parser.add_argument("--keyring", help=argparse.SUPPRESS)
    parser.add_argument("--seed", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--survey", help=argparse.SUPPRESS)
    parser.add_argument("--expect", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--max-seconds", type=float, default=600.0, help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.role == "node":
        exit_after(args.max_seconds)
        asyncio.run(run_node(args))
        return 0
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
