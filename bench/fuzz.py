"""Fuzz the core with mutations of captured real frames; print cases/s and why each was dropped.

    python bench/fuzz.py                 # 100,000 cases, seed 1
    python bench/fuzz.py -n 1000000 --seed 7

The cases are those of tests/core/test_hostile.py (its slow test runs 100,000 of them): a member,
a client and a rogue with another keyring are wired together in memory (tests/core/memnet.py),
every frame they exchanged is captured, and each case feeds one mutated, replayed, forged or
random frame straight to one core (`frame_fuzz.Scene`). A case passes when exactly one
`dropped_<reason>` counter moved and nothing else happened, or when a stranger's mutated HELLO
was still a valid handshake. Every 10,000 cases the real client must still get its reply and the
member's per-peer state must be within its limits. Exit status 1 at the first case that escapes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "core"))

from _harness import parse_args
from frame_fuzz import Escaped, Footprint, Scene

CHECK_EVERY = 10_000
IN_LINK_LIMIT = DIAL_RECORD_LIMIT = 4096  # the engine's caps


def run(cases: int, seed: int) -> int:
    scene = Scene(seed=seed)
    rng = random.Random(seed)
    verdicts: Counter[str] = Counter()
    feeding = 0.0
    done = 0
    while done < cases:
        batch = min(CHECK_EVERY, cases - done)
        start = time.perf_counter()
        try:
            for _ in range(batch):
                verdicts[scene.feed(*scene.case(rng))] += 1
        except Escaped as exc:
            print(f"case {sum(verdicts.values()) + 1}: ESCAPED: {exc}", file=sys.stderr)
            return 1
        feeding += time.perf_counter() - start
        done += batch
        payload = b"probe %d" % done
        if scene.round_trip(payload) != b"re:" + payload:
            print(f"after {done} cases the real client got a wrong reply", file=sys.stderr)
            return 1
        footprint = Footprint.of(scene.member.core)
        if (
            footprint.in_links > IN_LINK_LIMIT
            or footprint.dial_records > DIAL_RECORD_LIMIT
            or scene.losses()
        ):
            print(f"after {done} cases: {footprint}, {scene.losses()}", file=sys.stderr)
            return 1
        scene.net.advance(0.5)  # heartbeats flow, silent strangers age out
        print(f"  {done:>9,} cases  {done / feeding:>9,.0f} cases/s", file=sys.stderr)
    print(f"{cases:,} cases in {feeding:.1f} s: {cases / feeding:,.0f} cases/s (seed {seed})")
    print(f"member at the end: {Footprint.of(scene.member.core)}")
    width = max(map(len, verdicts))
    for verdict, count in verdicts.most_common():
        print(f"  {verdict:<{width}}  {count:>9,}  {100 * count / cases:5.1f}%")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--cases", type=int, default=100_000, help="default 100,000")
    parser.add_argument(
        "--seed", type=int, default=1, help="the same seed makes the same choices (default 1)"
    )
    args = parse_args(parser)
    return run(args.cases, args.seed)


if __name__ == "__main__":
    sys.exit(main())
