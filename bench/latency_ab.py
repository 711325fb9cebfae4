"""One request at a time, builds side by side: interleaved runs of `wakeups.py`, medians.

    python bench/latency_ab.py [--rounds 8] [--size 100] [--requests 3000]
                               NAME=PYTHON[:KEY=VALUE,...] ...

Each NAME=PYTHON is a build (the interpreter of its virtualenv, e.g. a worktree's
`.venv/bin/python`), optionally with `irismesh.Node` options for both nodes
(`fast=.venv/bin/python:sealing=false`). Every round runs `bench/wakeups.py --only mesh
--no-counters --no-syscalls` once per build, in turn, and every third round raw pyzmq too (with
the first build); then it prints, per build, the medians of the p50 and of the loop thread's CPU
per request on each side. A busy machine moves single runs by a fifth; alternating the builds
and taking medians is what makes a difference of a few microseconds visible. Run it from a
directory outside the worktrees, so each build imports its own irismesh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import parse_args

WAKEUPS = Path(__file__).resolve().parent / "wakeups.py"


def parse_build(text: str) -> tuple[str, str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"a build is NAME=PYTHON[:KEY=VALUE,...], got {text!r}")
    python, _, opts = rest.partition(":")
    extra = [arg for opt in opts.split(",") if opt for arg in ("--mesh-opt", opt)]
    return name, python, extra


def run_once(python: str, only: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """One run of wakeups.py; its figures (`--json`), by system."""
    with tempfile.TemporaryDirectory(prefix="latency-ab-") as tmp:
        out = Path(tmp) / "figures.json"
        argv = [python, str(WAKEUPS), "--only", only, "--size", str(args.size)]
        argv += ["--requests", str(args.requests), "--no-counters", "--no-syscalls"]
        argv += ["--json", str(out), *extra]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
        figures: dict[str, Any] = json.loads(out.read_text())
        return figures


def loop_cpu_us(side: dict[str, Any]) -> float:
    """CPU per request of a side's event-loop thread: its main thread, the lowest thread id
    among its `python/<tid>` threads (the others are helpers such as the executor's)."""
    threads = {
        int(name.split("/")[-1]): f
        for name, f in side["switches"].items()
        if name.startswith("python/")
    }
    return float(threads[min(threads)]["cpu_us"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="NAME=PYTHON[:KEY=VALUE,...]")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--requests", type=int, default=3000)
    args = parse_args(parser, refuse=False)
    if args.rounds < 1 or args.size < 1 or args.requests < 100:
        parser.error("--rounds and --size must be positive, --requests at least 100")
    builds = [parse_build(text) for text in args.builds]
    p50: dict[str, list[float]] = {name: [] for name, _, _ in builds}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in builds}
    raw: list[float] = []
    for round_ in range(args.rounds):
        for index, (name, python, extra) in enumerate(builds):
            only = "raw,mesh" if round_ % 3 == 0 and index == 0 else "mesh"
            figures = run_once(python, only, args, extra)
            if "raw" in figures:
                raw.append(float(figures["raw"]["p50_us"]))
            mesh = figures["mesh"]
            p50[name].append(float(mesh["p50_us"]))
            cpu[name].append((loop_cpu_us(mesh["caller"]), loop_cpu_us(mesh["member"])))
        latest = ", ".join(f"{name} {values[-1]:.0f} us" for name, values in p50.items() if values)
        print(f"round {round_ + 1}/{args.rounds}: p50 {latest}", file=sys.stderr, flush=True)
    med = statistics.median
    print(f"one outstanding, {args.size} B, medians of {args.rounds} interleaved runs:")
    if raw:
        print(f"  raw pyzmq: p50 {med(raw):.1f} us ({len(raw)} runs)")
    for name, _, _ in builds:
        line = f"  {name}: p50 {med(p50[name]):.1f} us"
        if raw:
            line += f" ({med(p50[name]) / med(raw):.2f}x raw pyzmq)"
        caller = med(c for c, _ in cpu[name])
        member = med(m for _, m in cpu[name])
        print(
            f"{line}; loop-thread CPU per request: caller {caller:.1f} us, member {member:.1f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
