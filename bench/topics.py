"""Publish-side cost of topic matching with 1, 1,000 and 100,000 subscriptions.

    python bench/topics.py                       # about 50 s on a busy 2-core machine
    python bench/topics.py --sizes 1,1000,10000,100000 --seconds 2 --json out.json

One process, no network: what `TopicTrie.match` costs a publisher, per published topic. The
subscriptions are a newsroom's mix over topics `feeds.<desk>.<story>`: story-level literals
(70%), desk-level `feeds.<desk>.*` (15%) and `feeds.<desk>.#` (8%), `*.<desk>.<story>` across
feed kinds (5%) and `feeds.<desk>.#.corrections` with `#` in the middle (2%). The number of
desks grows with the number of subscriptions (one desk per 100), so a published topic has about
as many matching subscribers at every size: the cost per match should stay flat, and the ratios
between sizes show whether it does. The published topics are story topics (90%), their
`.corrections` (5%) and `wires.<desk>.<story>` (5%), uniform over the desks. The single
subscription of the smallest size is `feeds.<desk>.*`, which cannot have as many hits.

The walk does the same work at every size, but a 100,000-subscription trie no longer fits in
the CPU's caches, so a walk over random topics waits for memory more often. The `warm` column
cycles over only 100 topics, whose nodes stay cached, and shows what is left: the algorithm.

The baseline, measured in the same run, is the obvious alternative: a linear scan testing every
subscription's pattern, compiled once to a regular expression, against the topic (C speed per
pattern, but one test per subscription). Each rate is the best of five rounds that take the
sizes in turn, so the machine's other work, which moves absolute figures a lot, weighs on every
size alike: compare the ratios.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import re
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import _harness as harness

from irismesh._core.topics import TopicTrie, validate_topic

STORIES_PER_DESK = 100
TOPICS = 20_000  # distinct published topics cycled through by each timing loop
ROUNDS = 5
WARM = 100  # topics few enough for their nodes to stay in the CPU's caches

Rates = dict[int, float]  # calls per second by number of subscriptions


def desks_for(size: int) -> int:
    return max(1, size // STORIES_PER_DESK)


def draw(desks: int, rng: random.Random) -> tuple[str, int, float]:
    """A desk, one of its stories, and a number in [0, 1) that picks the kind (in this order)."""
    return f"desk{rng.randrange(desks)}", rng.randrange(STORIES_PER_DESK), rng.random()


def subscriptions(size: int, rng: random.Random) -> list[tuple[str, int]]:
    """`size` (pattern, subscriber id) pairs in the newsroom mix of the module docstring."""
    if size == 1:
        return [("feeds.desk0.*", 0)]
    desks = desks_for(size)
    pairs = []
    for subscriber in range(size):
        desk, story, kind = draw(desks, rng)
        if kind < 0.70:
            pattern = f"feeds.{desk}.{story}"
        elif kind < 0.85:
            pattern = f"feeds.{desk}.*"
        elif kind < 0.93:
            pattern = f"feeds.{desk}.#"
        elif kind < 0.98:
            pattern = f"*.{desk}.{story}"
        else:
            pattern = f"feeds.{desk}.#.corrections"
        pairs.append((pattern, subscriber))
    return pairs


def published(size: int, rng: random.Random) -> list[str]:
    desks = desks_for(size)
    topics = []
    for _ in range(TOPICS):
        desk, story, kind = draw(desks, rng)
        if kind < 0.90:
            topics.append(f"feeds.{desk}.{story}")
        elif kind < 0.95:
            topics.append(f"feeds.{desk}.{story}.corrections")
        else:
            topics.append(f"wires.{desk}.{story}")
    return topics


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The pattern as a regular expression over '.' + topic: the linear scan's matcher."""
    parts = {"*": r"\.[^.]+", "#": r"(?:\.[^.]+)*"}
    return re.compile("".join(parts.get(s, re.escape("." + s)) for s in pattern.split(".")))


@dataclass
class Workload:
    size: int
    pairs: list[tuple[str, int]]
    topics: list[str]
    trie: TopicTrie[int]

    def publish(self, topic: str) -> set[int]:
        """What a node does with a caller's topic: check it once, then match."""
        return self.trie.match(validate_topic(topic))


def workload(size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    pairs = subscriptions(size, rng)
    trie: TopicTrie[int] = TopicTrie()
    for pattern, subscriber in pairs:
        trie.add(pattern, subscriber)
    return Workload(size, pairs, published(size, rng), trie)


def linear_scan(pairs: list[tuple[str, int]]) -> Callable[[str], set[int]]:
    compiled = [(pattern_regex(pattern).fullmatch, subscriber) for pattern, subscriber in pairs]

    def scan(topic: str) -> set[int]:
        dotted = "." + topic
        return {subscriber for fullmatch, subscriber in compiled if fullmatch(dotted)}

    return scan


def rate(call: Callable[[str], object], topics: Sequence[str], seconds: float) -> float:
    """Calls per second over at least `seconds`, cycling through `topics`."""
    calls = 0
    start = time.perf_counter()
    while True:
        for topic in topics:
            call(topic)
        calls += len(topics)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls / elapsed


def interleaved(
    name: str,
    workloads: list[Workload],
    calls: Mapping[int, tuple[Callable[[str], object], Sequence[str]]],
    seconds: float,
) -> Rates:
    """The best rate of each size over ROUNDS rounds that take the sizes in turn.

    Taking turns spreads the machine's other work over every size alike, so the ratios between
    sizes stay meaningful when the absolute figures do not.
    """
    best = dict.fromkeys(calls, 0.0)
    for round_ in range(ROUNDS):
        print(f"  {name}: round {round_ + 1} of {ROUNDS}", file=sys.stderr)
        for work in workloads:
            call, topics = calls[work.size]
            best[work.size] = max(best[work.size], rate(call, topics, seconds / ROUNDS))
    return best


def add_remove_rates(pairs: list[tuple[str, int]], seconds: float) -> tuple[float, float]:
    """Adds and removes per second, cycling an empty trie through all of `pairs`."""
    removal = pairs[:]
    random.Random(0).shuffle(removal)
    adding = removing = 0.0
    cycles = 0
    while adding + removing < seconds or not cycles:
        trie: TopicTrie[int] = TopicTrie()
        start = time.perf_counter()
        for pattern, subscriber in pairs:
            trie.add(pattern, subscriber)
        middle = time.perf_counter()
        for pattern, subscriber in removal:
            trie.remove(pattern, subscriber)
        adding += middle - start
        removing += time.perf_counter() - middle
        cycles += 1
        assert len(trie) == 0
        assert trie.node_count() == 1
    return len(pairs) * cycles / adding, len(pairs) * cycles / removing


def memory_of(pairs: list[tuple[str, int]]) -> int:
    """Bytes allocated for a trie of `pairs`, as tracemalloc counts them."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    trie: TopicTrie[int] = TopicTrie()
    for pattern, subscriber in pairs:
        trie.add(pattern, subscriber)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(trie) == len(set(pairs))
    return size


def measure(sizes: list[int], seconds: float, seed: int) -> list[dict[str, Any]]:
    workloads = []
    for size in sizes:
        print(f"  building the {size:,}-subscription trie", file=sys.stderr)
        workloads.append(workload(size, seed))
    scans = {}
    for work in workloads:
        scan = linear_scan(work.pairs)
        for topic in work.topics[: max(5, 20_000 // work.size)]:  # the two matchers agree
            assert scan(topic) == work.trie.match(topic), topic
        scans[work.size] = (scan, work.topics[: max(5, 2_000_000 // work.size)])

    def timed(
        name: str, call: Callable[[Workload], Callable[[str], object]], share: float
    ) -> Rates:
        calls = {work.size: (call(work), work.topics) for work in workloads}
        return interleaved(name, workloads, calls, seconds * share)

    match = timed("match", lambda work: work.trie.match, 1)
    warm = interleaved(
        "match, 100 topics",
        workloads,
        {work.size: (work.trie.match, work.topics[:WARM]) for work in workloads},
        seconds / 2,
    )
    any_ = timed("matches_any", lambda work: work.trie.matches_any, 1 / 2)
    publish = timed("validate_topic + match", lambda work: work.publish, 1 / 2)
    scanned = interleaved("linear scan", workloads, scans, seconds / 2)
    del scans

    rows = []
    for work in workloads:
        size = work.size
        print(f"  {size:,} subscriptions: add/remove rates and memory", file=sys.stderr)
        adds, removes = add_remove_rates(work.pairs, seconds / 3)
        hits = sum(len(work.trie.match(topic)) for topic in work.topics) / len(work.topics)
        rows.append(
            {
                "subscriptions": size,
                "distinct_pairs": len(set(work.pairs)),
                "trie_nodes": work.trie.node_count(),
                "matches_per_publish": hits,
                "match_per_s": match[size],
                "match_us": 1e6 / match[size],
                "match_warm_us": 1e6 / warm[size],
                "matches_any_us": 1e6 / any_[size],
                "validate_and_match_us": 1e6 / publish[size],
                "linear_scan_us": 1e6 / scanned[size],
                "add_per_s": adds,
                "remove_per_s": removes,
                "memory_bytes": memory_of(work.pairs),
            }
        )
    return rows


def times(ratio: float) -> str:
    return f"{ratio:,.2f}x" if ratio < 100 else f"{ratio:,.0f}x"


def report(rows: list[dict[str, Any]]) -> None:
    print("Matching one published topic (µs per call; hits = matching subscribers per topic)")
    print(
        f"{'subscriptions':>13} {'hits':>6} {'match':>8} {'matches/s':>10} {'warm':>7}"
        f" {'any':>7} {'checked':>8} {'linear scan':>12} {'scan/trie':>10}"
    )
    for row in rows:
        print(
            f"{row['subscriptions']:>13,} {row['matches_per_publish']:>6.1f}"
            f" {row['match_us']:>8.2f} {row['match_per_s']:>10,.0f} {row['match_warm_us']:>7.2f}"
            f" {row['matches_any_us']:>7.2f} {row['validate_and_match_us']:>8.2f}"
            f" {row['linear_scan_us']:>12,.1f} {times(row['linear_scan_us'] / row['match_us']):>10}"
        )
    print(
        "  match: TopicTrie.match over 20,000 topics; warm: over 100 topics, whose nodes stay in\n"
        "  the CPU caches; any: matches_any; checked: validate_topic + match, as a publish does;\n"
        "  linear scan: one compiled regular expression per subscription"
    )
    print()
    print("Ratios of µs per call, larger size / smaller (1.00x = flat; a linear cost follows")
    print("the sizes' ratio). One subscription has fewer hits: x / 1 includes a larger answer.")
    print(f"{'sizes':>21} {'match':>7} {'warm':>7} {'any':>7} {'linear scan':>12}")
    pairs = list(itertools.pairwise(rows))
    if len(rows) > 2:
        pairs.append((rows[0], rows[-1]))
    for small, large in pairs:
        sizes = f"{large['subscriptions']:,} / {small['subscriptions']:,}"
        print(
            f"{sizes:>21}"
            + "".join(
                f" {times(large[key] / small[key]):>{width}}"
                for key, width in (
                    ("match_us", 7),
                    ("match_warm_us", 7),
                    ("matches_any_us", 7),
                    ("linear_scan_us", 12),
                )
            )
        )
    print()
    print("Maintaining the trie")
    columns = [("subscriptions", 13), ("nodes", 8), ("adds/s", 9), ("removes/s", 10)]
    columns += [("memory", 9), ("per sub", 8)]
    print(" ".join(f"{name:>{width}}" for name, width in columns))
    for row in rows:
        print(
            f"{row['subscriptions']:>13,} {row['trie_nodes']:>8,} {row['add_per_s']:>9,.0f}"
            f" {row['remove_per_s']:>10,.0f} {row['memory_bytes'] / 1e6:>7.2f}MB"
            f" {row['memory_bytes'] / row['subscriptions']:>7.0f}B"
        )
    print("  memory: what tracemalloc counts for building the trie (the patterns' own strings not")
    print("  included); removes leave one root node")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="1,1000,100000", help="subscription counts (default 1,1000,100000)"
    )
    parser.add_argument(
        "--seconds", type=float, default=1.5, help="timing per matcher and size (default 1.5)"
    )
    parser.add_argument("--seed", type=int, default=1, help="default 1")
    parser.add_argument("--json", metavar="PATH", help="also write every figure here")
    args = harness.parse_args(parser)
    sizes = [int(size) for size in args.sizes.split(",")]
    started = time.perf_counter()
    rows = measure(sizes, args.seconds, args.seed)
    print(f"  done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    report(rows)
    if args.json:
        harness.write_json(args.json, {"seed": args.seed, "seconds": args.seconds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
