"""What tracing costs request/reply and pub/sub: a build without it, this one with tracing off,
and this one with tracing on into OpenTelemetry's SDK.

    python bench/tracing_cost.py [--rounds 3] [--bench reqrep,pubsub] --main PYTHON

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

The table gives each row's median per build and two ratios from the same run: off / main
(the target: at least 0.99) and on / off (what tracing every call costs), with the machine's
load average before and after. Run it from outside the worktrees, with this build's
interpreter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _harness import parse_args
from builds_ab import BENCHES, run_once

TARGET = 0.99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--main", required=True, metavar="PYTHON", help="the build to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench", default="reqrep,pubsub", help="comma-separated: reqrep,pubsub")
    args = parse_args(parser, refuse=False)
    benches = [b for b in args.bench.split(",") if b]
    for bench in benches:
        if bench not in BENCHES:
            parser.error(f"unknown bench {bench!r}: choose from {', '.join(BENCHES)}")
    builds = [
        ("main", args.main, {}),
        ("off", sys.executable, {"IRISMESH_TRACING": "0"}),
        ("on", sys.executable, {"IRISMESH_TRACING": "1", "IRISMESH_BENCH_OTEL": "batch"}),
    ]
    load_before = os.getloadavg()
    figures: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in builds}
    for round_no in range(1, args.rounds + 1):
        for bench in benches:
            for name, python, env in builds:
                print(f"round {round_no}/{args.rounds}: {bench} with {name}", file=sys.stderr)
                for row, rate in run_once(python, bench, env).items():
                    figures[name].setdefault(row, []).append(rate)
    load_after = os.getloadavg()
    print(f"medians of {args.rounds} interleaved rounds (main = {args.main})")
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*load_before))
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*load_after))
    header = f"{'row':<44} {'main':>12} {'off':>12} {'on':>12} {'off/main':>9} {'on/off':>8}"
    print(header)
    failed = False
    for row in figures["main"]:
        medians = {}
        for name, _, _ in builds:
            rates = figures[name].get(row)
            if rates:
                medians[name] = statistics.median(rates)
        if len(medians) < 3:
            continue
        cpu = "CPU" in row  # CPU per message: lower is better, so the ratios invert
        off_main = medians["main"] / medians["off"] if cpu else medians["off"] / medians["main"]
        on_off = medians["off"] / medians["on"] if cpu else medians["on"] / medians["off"]
        mark = ""
        if not cpu and off_main < TARGET:
            mark = f"  below {TARGET}"
            failed = True
        print(
            f"{row:<44} {medians['main']:>12,.1f} {medians['off']:>12,.1f} "
            f"{medians['on']:>12,.1f} {off_main:>8.3f}x {on_off:>7.3f}x{mark}"
        )
    print("ratios are of throughput (for CPU rows, of messages per CPU second): higher is better")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
