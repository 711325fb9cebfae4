"""Priorities (the silver class of service): a member buried in background work still answers
the requests a person waits on at once, and the background work still gets done.

    python examples/priorities.py              # 300 background jobs, 20 urgent requests
    python examples/priorities.py --background 1000 --json

One process, two nodes on 127.0.0.1 and a keyring made on the spot: a member of cluster
"reports" whose handler takes 5 ms in a thread (two threads, so it serves about 400 requests a
second), and a client. The client first queues a burst of background requests at
`Priority.LOW` (seconds of work for the member), then, while the member works through them,
sends urgent requests at `Priority.HIGH`, one every 20 ms. Each urgent request overtakes the
background work queued at the member and is answered in a few handler runs; every background
request is answered too. It prints the latencies of both (or a JSON object); the exit status is
1 if an urgent request waited as long as the typical background one, or background work was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import irismesh
from irismesh import Priority

COST = 0.005  # seconds each request takes at the member


async def main(background: int, urgent: int) -> dict[str, object]:
    keys = irismesh.Keyring.generate()
    member = irismesh.Node("reports", keyring=keys, handler_threads=2, name="member")

    @member.on_request(blocking=True)
    def render(payload: bytes) -> bytes:
        time.sleep(COST)  # the work: a database, a renderer, ...
        return b"done " + payload

    async with member:
        client = irismesh.Node(keyring=keys, seeds=[member.endpoint], name="client")
        async with client:
            await client.wait_for_members("reports", timeout=10)
            await client.request("reports", b"warm-up", timeout=5)
            loop = asyncio.get_running_loop()

            async def timed(payload: bytes, priority: int) -> float:
                started = loop.time()
                reply = await client.request("reports", payload, timeout=30, priority=priority)
                assert reply == b"done " + payload
                return loop.time() - started

            low = [
                asyncio.ensure_future(timed(b"background %d" % i, Priority.LOW))
                for i in range(background)
            ]
            await asyncio.sleep(0.1)  # the member has a queue of background work now
            high = []
            for i in range(urgent):
                high.append(await timed(b"urgent %d" % i, Priority.HIGH))
                await asyncio.sleep(0.02)
            low_times = await asyncio.gather(*low)
            stats = member.stats
    high_ms = sorted(t * 1000 for t in high)
    low_ms = sorted(t * 1000 for t in low_times)
    return {
        "urgent": len(high_ms),
        "urgent_median_ms": round(statistics.median(high_ms), 1),
        "urgent_max_ms": round(high_ms[-1], 1),
        "background": len(low_ms),
        "background_median_ms": round(statistics.median(low_ms), 1),
        "background_max_ms": round(low_ms[-1], 1),
        "member_admitted_high": stats.get("requests_admitted_high", 0),
        "member_admitted_low": stats.get("requests_admitted_low", 0),
        "ok": high_ms[-1] < statistics.median(low_ms) and len(low_ms) == background,
    }


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--background", type=int, default=300, help="low-priority requests")
    parser.add_argument("--urgent", type=int, default=20, help="high-priority requests")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.background < 1 or args.urgent < 1:
        parser.error("--background and --urgent must be at least 1")
    report = irismesh.run(main(args.background, args.urgent))
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['urgent']} urgent requests (HIGH): median {report['urgent_median_ms']} ms, "
            f"max {report['urgent_max_ms']} ms"
        )
        print(
            f"{report['background']} background requests (LOW), all answered: median "
            f"{report['background_median_ms']} ms, max {report['background_max_ms']} ms"
        )
        print("urgent work overtook the background work" if report["ok"] else "NOT as expected")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(run())
