"""A member and a caller in one process, on one event loop: requests and nothing else.

    python bench/request_loop.py [--requests 4000] [--outstanding 1] [--size 100] [--steady]

The member (a `Node` of cluster `echo`, a plain handler returning the payload) and a caller
(`Node` seeded with the member's endpoint, discovery off) share a keyring and this process's
loop and talk over a real link on 127.0.0.1, sealed, telemetry on. The caller warms up with
--requests requests, then sends --requests more, --outstanding in flight. On one thread the
two sides run in an order the loop fixes, not the scheduler: the work of a run is the same
from run to run, which is what `instructions_ab.py --one-process` counts. It uses only the
public API, so any build can run it. `--steady` also takes out the slices of time after which
the handlers and the callers give the loop a turn (a clock's reading, so how often depends on
how fast the run goes, under valgrind on how busy the machine is).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import irismesh
from irismesh._core.records import MembershipConfig


async def requests(node: irismesh.Node, payload: bytes, count: int, flight: int) -> None:
    left = count

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if await node.request("echo", payload) != payload:
                raise SystemExit("a reply differed from its request")

    await asyncio.gather(*(worker() for _ in range(flight)))


# Timers are what a run's count depends on beyond its requests: under valgrind a run is 30-60
# times slower, so the links' heartbeats (every 0.2 s while requests are in flight) and
# membership's probes and gossip (every 0.4 and 0.2 s) come every few requests, and how many
# depends on how busy the machine is. Every 10 s instead (with the deadlines that go with
# them), they cost a run almost nothing per request.
QUIET = {"heartbeat_interval": 10.0, "dead_after": 30.0, "max_silence": 60.0}
QUIET_MEMBERSHIP = {"probe_interval": 10.0, "probe_timeout": 5.0, "gossip_interval": 10.0}


def steady() -> None:
    """No time-based turns: the handlers' slice (`patterns.reqrep.SLICE`) and the callers'
    (`irismesh._turns.SLICE`) never run out, in every build that has them."""
    from irismesh import _turns
    from irismesh.patterns import reqrep

    reqrep.SLICE = _turns.SLICE = float("inf")


async def run(count: int, flight: int, size: int) -> None:
    keys = irismesh.Keyring.generate()
    membership = MembershipConfig(**QUIET_MEMBERSHIP)
    config = irismesh.CoreConfig(**QUIET, membership=membership)
    async with irismesh.Node("echo", keyring=keys, discovery=False, config=config) as member:

        @member.on_request
        def echo(payload: bytes) -> bytes:
            return payload

        seeds = [member.endpoint]
        async with irismesh.Node(
            keyring=keys, seeds=seeds, discovery=False, config=config
        ) as caller:
            await caller.wait_for_members("echo", 1, timeout=60)
            payload = os.urandom(size)
            await requests(caller, payload, count, flight)  # warm-up
            await requests(caller, payload, count, flight)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--outstanding", type=int, default=1)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--steady", action="store_true", help="no time-based turns (see above)")
    args = parser.parse_args()
    if args.requests < 1 or args.outstanding < 1 or args.size < 0:
        parser.error("--requests and --outstanding at least 1, --size at least 0")
    if args.steady:
        steady()
    irismesh.run(run(args.requests, args.outstanding, args.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
