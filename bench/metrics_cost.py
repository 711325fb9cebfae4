"""What serving live metrics costs request/reply: counters alone against counters scraped.

    python bench/metrics_cost.py [--rounds 8] [--window 2] [--sizes 100] [--control] [--fresh]
                                 [--scrape 1] [--json out.json]

bench/telemetry_cost.py's rounds, with two variants: `counters` (the default node: exact
counters and histograms) and `scraped` (the same, and both nodes serving Prometheus metrics,
`Node(metrics="127.0.0.1:0")`, which the parent scrapes every `--scrape` seconds over HTTP as
a Prometheus server would). A server and a client process per variant, measured in
interleaved rounds whose order rotates; medians of the per-round ratios. The target: scraped /
counters >= 0.99 (scraping every second costs at most 1% of request/reply throughput).
Any other option is telemetry_cost.py's.
"""

from __future__ import annotations

import sys

import telemetry_cost

if __name__ == "__main__":
    given = sys.argv[1:]
    defaults = ["--variants", "counters,scraped", "--baseline", "counters", "--target", "0.99"]
    if not any(a == "--sizes" or a.startswith("--sizes=") for a in given):
        defaults += ["--sizes", "100"]
    sys.argv[1:] = [*defaults, *given]
    sys.exit(telemetry_cost.main())
