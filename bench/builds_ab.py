"""Throughput of builds side by side: interleaved runs of `reqrep.py` and `pubsub.py`, medians.

    python bench/builds_ab.py [--rounds 5] [--bench reqrep,pubsub] NAME=PYTHON ...

Each NAME=PYTHON is a build: the interpreter of a virtualenv holding that build (a worktree's
`.venv/bin/python`); each build runs the benchmark scripts of its own checkout (the `bench/`
beside its `irismesh`). Every round runs, for each build in turn, `reqrep.py --quick --only
mesh` (request/reply with 100 outstanding and sustained, 100 B and 1 KiB) and `pubsub.py
--only mesh --sizes 100 --fanouts 1,4`; then it prints, per row, each build's median rate (or
CPU per message, where a busy machine shows less: the publisher's, each side's of request/reply
sustained) and its ratio to the first build's. A busy machine moves single runs by a fifth or more:
alternating the builds and taking medians is what makes a difference of a few percent
visible. Run it from a directory outside the worktrees, so each build imports its own irismesh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import parse_args

BENCHES = {
    "reqrep": ["--quick", "--only", "mesh"],
    "pubsub": ["--only", "mesh", "--sizes", "100", "--fanouts", "1,4"],
}


def bench_dir(python: str) -> Path:
    """The bench/ of the checkout the interpreter's irismesh comes from."""
    found = subprocess.run(
        [python, "-c", "import irismesh, os; print(os.path.dirname(irismesh.__file__))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return Path(found.stdout.strip()).parent / "bench"


def rows(bench: str, results: dict[str, Any]) -> dict[str, float]:
    """The rates of one run, by row."""
    mesh = results["mesh"]
    found: dict[str, float] = {}
    if bench == "reqrep":
        for size, figures in mesh.items():
            found[f"reqrep {size} B, 100 outstanding"] = figures["throughput"]["rps"]
            sustained = figures["sustained"]
            found[f"reqrep {size} B, sustained"] = sustained["rps"]
            for side in ("client", "server"):
                cpu = sustained["memory"][side]["cpu_s"]
                found[f"reqrep {size} B, {side} CPU us/req"] = cpu / sustained["requests"] * 1e6
    else:
        for size, by_fanout in mesh.items():
            for fanout, figures in by_fanout.items():
                found[f"pubsub {size} B to {fanout}"] = figures["rate"]
                publisher = figures["publisher"]
                found[f"pubsub {size} B to {fanout}, publisher CPU us/msg"] = (
                    publisher["cpu_s"] / publisher["published"] * 1e6
                )
    return found


def run_once(python: str, bench: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """One run's rates by row (with `env` added to the environment); none (said on stderr)
    if the run failed."""
    script = bench_dir(python) / f"{bench}.py"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run(
            [python, str(script), *BENCHES[bench], "--json", out.name],
            stdout=subprocess.DEVNULL,
            cwd=tempfile.gettempdir(),
            env=None if env is None else {**os.environ, **env},
        )
        if done.returncode != 0:
            print(f"{bench} with {python} failed (status {done.returncode})", file=sys.stderr)
            return {}
        with open(out.name, encoding="utf-8") as document:
            return rows(bench, json.load(document)["results"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("builds", nargs="+", metavar="NAME=PYTHON")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bench", default="reqrep,pubsub", help="comma-separated: reqrep,pubsub")
    args = parse_args(parser, refuse=False)
    builds = []
    for text in args.builds:
        name, sep, python = text.partition("=")
        if not sep or not name or not python:
            parser.error(f"a build is NAME=PYTHON, got {text!r}")
        builds.append((name, python))
    benches = [b for b in args.bench.split(",") if b]
    for bench in benches:
        if bench not in BENCHES:
            parser.error(f"unknown bench {bench!r}: choose from {', '.join(BENCHES)}")
    figures: dict[str, dict[str, list[float]]] = {name: {} for name, _ in builds}
    for round_no in range(1, args.rounds + 1):
        for bench in benches:
            for name, python in builds:
                print(f"round {round_no}/{args.rounds}: {bench} with {name}", file=sys.stderr)
                for row, rate in run_once(python, bench).items():
                    figures[name].setdefault(row, []).append(rate)
    first = builds[0][0]
    print(f"medians of {args.rounds} interleaved rounds; ratio to {first}")
    for row in figures[first]:
        base = statistics.median(figures[first][row])
        cells = []
        for name, _ in builds:
            rates = figures[name].get(row)
            if not rates:
                continue
            median = statistics.median(rates)
            unit = "" if "CPU" in row else "/s"
            cells.append(f"{name} {median:,.1f}{unit} ({median / base:.3f}x, n={len(rates)})")
        print(f"{row:<44} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
