"""Instructions per request of builds side by side, counted under valgrind: a figure the
machine's load barely moves, for differences of a percent that timed rounds cannot resolve.

    python bench/instructions_ab.py [--rounds 3] [--requests 1000,4000] [--outstanding 1]
                                    [--processes] [--json PATH] NAME=PYTHON[:VAR=VALUE,...] ...

Each build is an interpreter (a worktree's `.venv/bin/python`), with environment variables
of its own after a colon (`off=.venv/bin/python:IRISMESH_TRACING=0`). valgrind's cachegrind
(`--cache-sim=no`) counts every instruction a run executes. By default a run is
`request_loop.py`: a member and a caller in one process, on one loop, over a real sealed link,
`--outstanding` requests in flight; one thread runs both sides in an order the loop fixes, so
a build's count repeats within about 0.1% from run to run. `--processes` runs the build's own
`cpu_per_request.py` instead (the member a child process, `--trace-children=yes`) and counts
each side apart; two processes batch as the scheduler lets them, which moves a count a percent
or two between runs.

A run of N requests also starts, imports and warms up (N requests more; up to 20,000 for
`cpu_per_request.py`); two runs of N1 and N2 requests differ only in requests, so
(I(N2) - I(N1)) / (the requests between them) is what one request costs, start, import and
warm-up subtracted. PYTHONHASHSEED is fixed. Timers still move a count a little (a run 30-60
times slower under valgrind fires more heartbeats and flushes per request). The rounds
interleave the builds; each ratio is the first build's instructions over the build's, the
median of the rounds' ratios: what share of the first build's throughput the build keeps where
CPU bounds it (above 1, the build is cheaper).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _harness import find_executable, parse_args, progress
from builds_ab import bench_dir

WARM_UP_CAP = 20_000  # cpu_per_request.py warms up with min(this, --requests) requests
TOTAL = re.compile(r"I\s+refs:\s+([\d,]+)")
SIDES = ("caller", "member")
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Workload:
    """What a counted run runs, and how its figures read."""

    one_process: bool
    steady: bool = False  # request_loop.py --steady: no time-based turns

    @property
    def sides(self) -> tuple[str, ...]:
        """What a run counts apart: the one process, or caller and member."""
        return ("both",) if self.one_process else SIDES

    def script(self, python: str) -> Path:
        """request_loop.py (public API only) from here; cpu_per_request.py from the build's."""
        if self.one_process:
            return HERE / "request_loop.py"
        return bench_dir(python) / "cpu_per_request.py"

    def requests_run(self, requests: int) -> int:
        """The requests a run of `requests` makes, its warm-up included."""
        return 2 * requests if self.one_process else requests + min(WARM_UP_CAP, requests)

    def side_of(self, command_line: str) -> str | None:
        """Which side a process whose valgrind log says `command_line` is (None: not one)."""
        if self.one_process:
            return "both" if "request_loop.py" in command_line else None
        if "cpu_per_request.py" not in command_line:
            return None
        return "member" if "--member" in command_line else "caller"


ONE_PROCESS = Workload(one_process=True)
STEADY = Workload(one_process=True, steady=True)
TWO_PROCESSES = Workload(one_process=False)


class RunFailed(Exception):
    """A counted run did not complete: the figures of this build cannot be had."""


def parse_build(text: str) -> tuple[str, str, dict[str, str]]:
    """NAME=PYTHON[:VAR=VALUE,...] as (name, python, environment)."""
    name, sep, rest = text.partition("=")
    python, _, settings = rest.partition(":")
    if not sep or not name or not python:
        raise ValueError(f"a build is NAME=PYTHON[:VAR=VALUE,...], got {text!r}")
    env = {}
    for setting in filter(None, settings.split(",")):
        var, eq, value = setting.partition("=")
        if not eq or not var:
            raise ValueError(f"an environment setting is VAR=VALUE, got {setting!r}")
        env[var] = value
    return name, python, env


def count(
    valgrind: str, work: Workload, python: str, env: dict[str, str], requests: int, flight: int
) -> dict[str, int]:
    """Instructions each side of one run executed, by side."""
    script = work.script(python)
    with tempfile.TemporaryDirectory() as logs:
        command = [
            valgrind,
            "--tool=cachegrind",
            "--cache-sim=no",
            "--trace-children=yes",
            "--cachegrind-out-file=/dev/null",
            f"--log-file={logs}/valgrind.%p",
            python,
            str(script),
            *("--requests", str(requests), "--outstanding", str(flight)),
            *(() if work.one_process else ("--rounds", "1")),
            *(("--steady",) if work.steady else ()),
        ]
        done = subprocess.run(
            command,
            stdout=subprocess.DEVNULL,
            cwd=tempfile.gettempdir(),
            env={**os.environ, "PYTHONHASHSEED": "0", **env},
            timeout=1800,
        )
        if done.returncode != 0:
            raise RunFailed(
                f"{script} of {python} failed under valgrind (status {done.returncode}); with "
                "many requests in flight the member, 30-60 times slower there, may shed them "
                "(Overloaded): try fewer --outstanding"
            )
        found: dict[str, int] = {}
        for log in Path(logs).iterdir():
            text = log.read_text(errors="replace")
            command_line = next((ln for ln in text.splitlines() if "Command:" in ln), "")
            total = TOTAL.search(text)
            side = work.side_of(command_line)
            if total is None or side is None:
                continue  # another program the run started, or a process that died early
            found[side] = int(total.group(1).replace(",", ""))
        if set(found) != set(work.sides):
            raise RunFailed(f"valgrind counted {sorted(found)} of {python}'s run, not both sides")
        return found


def per_request(
    work: Workload, low: dict[str, int], high: dict[str, int], n_low: int, n_high: int
) -> dict[str, float]:
    """Instructions a request costs each side, from runs of n_low and n_high requests."""
    between = work.requests_run(n_high) - work.requests_run(n_low)
    return {side: (high[side] - low[side]) / between for side in work.sides}


Build = tuple[str, str, dict[str, str]]


def measure(
    valgrind: str,
    work: Workload,
    builds: list[Build],
    rounds: int,
    runs: tuple[int, int],
    flight: int,
) -> dict[str, list[dict[str, float]]]:
    """Each build's instructions a request, per side, in each of `rounds` interleaved rounds."""
    n_low, n_high = runs
    figures: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in builds}
    for round_no in range(1, rounds + 1):
        shift = (round_no - 1) % len(builds)  # each round starts with the next build
        for name, python, env in builds[shift:] + builds[:shift]:
            progress(f"round {round_no}/{rounds}: {name}, {n_low:,} and {n_high:,} requests")
            low = count(valgrind, work, python, env, n_low, flight)
            high = count(valgrind, work, python, env, n_high, flight)
            figures[name].append(per_request(work, low, high, n_low, n_high))
        line = "  ".join(
            f"{name} " + "/".join(f"{figures[name][-1][s]:,.0f}" for s in work.sides)
            for name, _, _ in builds
        )
        print(f"round {round_no}: instructions a request ({'/'.join(work.sides)}): {line}")
    return figures


def report(
    work: Workload, builds: list[Build], figures: dict[str, list[dict[str, float]]], flight: int
) -> dict[str, dict[str, float]]:
    """Print each build's medians and ratios to the first build; return them by build."""
    first = builds[0][0]
    rounds = len(figures[first])
    print(f"\nmedians of {rounds} rounds, {flight} in flight; ratio = {first}'s")
    print("instructions over the build's, the median of the rounds' ratios (above 1: cheaper)")
    summary: dict[str, dict[str, float]] = {}
    for name, _, _ in builds:
        cells, summary[name] = [], {}
        for side in work.sides:
            mine = [r[side] for r in figures[name]]
            ratios = [b[side] / r[side] for b, r in zip(figures[first], figures[name], strict=True)]
            summary[name][side] = statistics.median(mine)
            summary[name][f"{side} ratio"] = statistics.median(ratios)
            cells.append(
                f"{side} {statistics.median(mine):>9,.0f} ({statistics.median(ratios):.4f}x, "
                f"rounds {min(ratios):.4f}-{max(ratios):.4f})"
            )
        print(f"{name:<10} " + "   ".join(cells))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("builds", nargs="+", metavar="NAME=PYTHON[:VAR=VALUE,...]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", default="1000,4000", help="N1,N2: the two runs' requests")
    parser.add_argument("--outstanding", type=int, default=1)
    parser.add_argument(
        "--processes",
        action="store_true",
        help="count cpu_per_request.py's two processes (per side) instead of request_loop.py's one",
    )
    parser.add_argument(
        "--steady",
        action="store_true",
        help="request_loop.py --steady: no time-based turns (less spread under load)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every round's figures there")
    args = parse_args(parser, refuse=False)
    try:
        builds = [parse_build(text) for text in args.builds]
        n_low, n_high = (int(n) for n in args.requests.split(","))
    except ValueError as exc:
        parser.error(str(exc))
    for name, python, _ in builds:
        if not os.access(python, os.X_OK):
            parser.error(f"build {name}: {python} is not an executable interpreter")
    if not 0 < n_low < n_high or args.rounds < 1 or args.outstanding < 1:
        parser.error("--requests takes N1,N2 with 0 < N1 < N2; --rounds and --outstanding >= 1")
    valgrind = find_executable("valgrind")
    if valgrind is None:
        parser.error("valgrind is not installed (Debian: apt-get install valgrind)")
    try:
        work = TWO_PROCESSES if args.processes else ONE_PROCESS
        if args.steady:
            if args.processes:
                parser.error("--steady counts request_loop.py: not with --processes")
            work = STEADY
        figures = measure(valgrind, work, builds, args.rounds, (n_low, n_high), args.outstanding)
    except RunFailed as exc:
        print(f"instructions_ab: {exc}", file=sys.stderr)
        return 1
    summary = report(work, builds, figures, args.outstanding)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(
                {"builds": args.builds, "figures": figures, "summary": summary}, out, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
