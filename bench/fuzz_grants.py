"""Fuzz the grant and revocation token parsers: mutated real tokens, seeded, counted verdicts.

    python bench/fuzz_grants.py [--cases 200000] [--seed 1]

Each case mutates a real token (`grant_fuzz.mutate`) and decodes it as a grant and as a
revocation; a case passes when both refuse it with GrantError, or it decodes to the very
token it came from. Anything else (another exception, a token that decodes to something new)
stops the run with the case's seed and bytes. Prints the verdicts and the rate.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "core"))

from grant_fuzz import mutate, sources, verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    tokens = sources(args.seed)
    rng = random.Random(args.seed)
    verdicts: Counter[str] = Counter()
    started = time.perf_counter()
    for _ in range(args.cases):
        verdicts[verdict(mutate(tokens, rng), tokens)] += 1
    seconds = time.perf_counter() - started
    shown = ", ".join(f"{name} {count}" for name, count in sorted(verdicts.items()))
    print(f"{args.cases} cases (seed {args.seed}) in {seconds:.1f} s: {shown}; none escaped")


if __name__ == "__main__":
    main()
