"""What tracing costs request/reply and pub/sub: a build without it, this one with tracing off,
and this one with tracing on into OpenTelemetry's SDK.

    python bench/tracing_cost.py [--rounds 3] [--bench reqrep,pubsub] [--builds main,off,on]
                                 [--order rotate|fixed] [--json PATH] --main PYTHON

Three builds, measured as bench/builds_ab.py measures builds (`reqrep.py --quick --only mesh`
and `pubsub.py --only mesh --sizes 100 --fanouts 1,4`, each build running the benchmark
scripts of its own checkout), in interleaved rounds:

* main: the interpreter `--main` names, a build without trace context (its own checkout);
* off: this build, `IRISMESH_TRACING=0`: a message carries nothing more, and each costs one
  check more (`Node.tracing is None`);
* on: this build, `IRISMESH_TRACING=1`, every node tracing into the SDK's TracerProvider with a
  BatchSpanProcessor whose exporter drops the batches (`_harness.otel_from_env`): every request
  a CLIENT and a SERVER span, every publish a PRODUCER span and every delivery a CONSUMER one,
  their context on the wire.

Each round runs every build once per bench; `--order rotate` (the default) starts each round
with the next build, so no build always runs first (or right after the same one). It prints
each round's figures for every row and build, with that round's ratios and the machine's load
average as the round began and ended (an outlier round shows as one), then the table: each
row's median per build and, from the same run, off / main (the target: at least 0.99) and on /
off (what tracing every call costs), each twice: the ratio of the medians, and the median of
the rounds' ratios (each round's pair of figures divided, then the median: a round the machine
was busier for moves both of its figures, not the ratio). The target is judged by the median
of the rounds' ratios. `--builds main,off` leaves out the `on` build (a round in two thirds of
the time); `--json` writes every round's figures and loads. Run it from outside the worktrees,
with this build's interpreter.

`--instructions` counts instead of timing: main and off (tracing off) each run
`request_loop.py --steady` (a member and a caller in one process, `--outstanding` requests in
flight, no time-based turns) under valgrind in interleaved rounds (bench/instructions_ab.py),
and the target holds when off costs at most 1/0.99 of main's instructions a request. A count
repeats within about 0.1% (one in flight) to 0.5% (100) from run to run, where a timed round
on a shared machine moves tens of percent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from _harness import find_executable, parse_args
from builds_ab import BENCHES, run_once
from instructions_ab import STEADY, RunFailed, measure, report

TARGET = 0.99
BUILDS = ("main", "off", "on")
# Each ratio: (name, numerator build, denominator build), of throughput.
RATIOS = (("off/main", "off", "main"), ("on/off", "on", "off"))


def cell(row: str, value: float | None) -> str:
    """A figure as the tables show it: CPU per message (a few us) to hundredths."""
    if value is None:
        return f"{'-':>12}"
    return f"{value:>12,.2f}" if "CPU" in row else f"{value:>12,.1f}"


def ratio(row: str, top: float, bottom: float) -> float:
    """`top` over `bottom` as throughput: a CPU row (CPU per message: lower is better) inverts."""
    return bottom / top if "CPU" in row else top / bottom


def by_instructions(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """main against off counted in instructions: 1 if off keeps less than TARGET."""
    valgrind = find_executable("valgrind")
    if valgrind is None:
        parser.error("--instructions needs valgrind (Debian: apt-get install valgrind)")
    builds = [("main", args.main, {}), ("off", sys.executable, {"IRISMESH_TRACING": "0"})]
    try:
        figures = measure(valgrind, STEADY, builds, args.rounds, (1000, 4000), args.outstanding)
    except RunFailed as exc:
        print(f"tracing_cost: {exc}", file=sys.stderr)
        return 2
    summary = report(STEADY, builds, figures, args.outstanding)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"main": args.main, "figures": figures, "summary": summary}, out, indent=1)
    kept = summary["off"]["both ratio"]
    print(f"off keeps {kept:.4f} of main's throughput in instructions (target {TARGET})")
    return 1 if kept < TARGET else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--main", required=True, metavar="PYTHON", help="the build to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench", default="reqrep,pubsub", help="comma-separated: reqrep,pubsub")
    parser.add_argument(
        "--builds", default=",".join(BUILDS), help="comma-separated: main,off,on (main and off)"
    )
    parser.add_argument(
        "--order",
        choices=("rotate", "fixed"),
        default="rotate",
        help="each round starts with the next build (rotate), or always main, off, on (fixed)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every round's figures there")
    counting = "count main's and off's instructions a request under valgrind instead of timing"
    parser.add_argument("--instructions", action="store_true", help=counting)
    parser.add_argument(
        "--outstanding", type=int, default=1, help="with --instructions: requests in flight"
    )
    args = parse_args(parser, refuse=False)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.instructions:
        return by_instructions(parser, args)
    benches = [b for b in args.bench.split(",") if b]
    for bench in benches:
        if bench not in BENCHES:
            parser.error(f"unknown bench {bench!r}: choose from {', '.join(BENCHES)}")
    chosen = [b for b in args.builds.split(",") if b]
    if not {"main", "off"} <= set(chosen) or not set(chosen) <= set(BUILDS):
        parser.error("--builds takes main and off, and on if wanted")
    every = {
        "main": (args.main, {}),
        "off": (sys.executable, {"IRISMESH_TRACING": "0"}),
        "on": (sys.executable, {"IRISMESH_TRACING": "1", "IRISMESH_BENCH_OTEL": "batch"}),
    }
    names = [name for name in BUILDS if name in chosen]
    ratios = [r for r in RATIOS if r[1] in names and r[2] in names]
    load_before = os.getloadavg()
    # figures[name][row][round - 1]: None where that round's run failed.
    figures: dict[str, dict[str, list[float | None]]] = {name: {} for name in names}
    loads: list[tuple[tuple[float, float, float], tuple[float, float, float]]] = []
    for round_no in range(1, args.rounds + 1):
        began = os.getloadavg()
        shift = (round_no - 1) % len(names) if args.order == "rotate" else 0
        order = names[shift:] + names[:shift]
        for bench in benches:
            for name in order:
                python, env = every[name]
                print(f"round {round_no}/{args.rounds}: {bench} with {name}", file=sys.stderr)
                for row, rate in run_once(python, bench, env).items():
                    series = figures[name].setdefault(row, [])
                    series.extend([None] * (round_no - 1 - len(series)))
                    series.append(rate)
        loads.append((began, os.getloadavg()))
        print(
            f"round {round_no}/{args.rounds} done, load {began[0]:.2f} -> {os.getloadavg()[0]:.2f}",
            file=sys.stderr,
        )
    load_after = os.getloadavg()
    for by_row in figures.values():
        for series in by_row.values():
            series.extend([None] * (args.rounds - len(series)))
    rows = list(figures["main"])

    print(f"{args.rounds} interleaved rounds (order {args.order}; main = {args.main})")
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*load_before))
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*load_after))
    print()
    print("per round (load: 1-minute average as the round began -> ended)")
    head = f"{'row':<44} {'round':>5} " + " ".join(f"{n:>12}" for n in names)
    head += "".join(f" {r[0]:>9}" for r in ratios) + "  load"
    print(head)
    for row in rows:
        for index in range(args.rounds):
            cells = [figures[name].get(row, [None] * args.rounds)[index] for name in names]
            text = " ".join(cell(row, c) for c in cells)
            got = dict(zip(names, cells, strict=True))
            for _label, top, bottom in ratios:
                a, b = got[top], got[bottom]
                text += f" {'-':>9}" if a is None or b is None else f" {ratio(row, a, b):>8.3f}x"
            began, ended = loads[index]
            print(f"{row:<44} {index + 1:>5} {text}  {began[0]:.2f}->{ended[0]:.2f}")
    print()
    print(f"medians of {args.rounds} rounds; each ratio as the ratio of the medians (of med) and")
    print("as the median of the rounds' ratios (per rnd; the target's measure)")
    head = f"{'row':<44} " + " ".join(f"{n:>12}" for n in names)
    for label, _top, _bottom in ratios:
        head += f" {label + ' of med':>16} {label + ' per rnd':>17}"
    print(head)
    failed = False
    summary: dict[str, dict[str, float]] = {}
    for row in rows:
        medians: dict[str, float] = {}
        for name in names:
            rates = [r for r in figures[name].get(row, []) if r is not None]
            if rates:
                medians[name] = statistics.median(rates)
        if len(medians) < len(names):
            continue
        text = " ".join(cell(row, medians[name]) for name in names)
        summary[row] = dict(medians)
        mark = ""
        for label, top, bottom in ratios:
            of_medians = ratio(row, medians[top], medians[bottom])
            paired = [
                ratio(row, a, b)
                for a, b in zip(figures[top][row], figures[bottom][row], strict=True)
                if a is not None and b is not None
            ]
            per_round = statistics.median(paired)
            summary[row][label + " of medians"] = of_medians
            summary[row][label + " per round"] = per_round
            text += f" {of_medians:>15.3f}x {per_round:>16.3f}x"
            if label == "off/main" and "CPU" not in row and per_round < TARGET:
                mark = f"  below {TARGET}"
                failed = True
        print(f"{row:<44} {text}{mark}")
    print("ratios are of throughput (for CPU rows, of messages per CPU second): higher is better")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(
                {
                    "main": args.main,
                    "rounds": args.rounds,
                    "order": args.order,
                    "builds": names,
                    "loads": loads,
                    "figures": figures,
                    "summary": summary,
                },
                out,
                indent=1,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
