"""A load test whose members die, run as a process of its own by test_load_stall.py.

Starts two workers of examples/failover.py, keeps 16 requests in flight to them with
`RequestLoad`, SIGKILLs both once the load runs, and waits as the rotation test does. The
wait fails (exit status 1, the failure's message on stderr) as soon as the load has stalled;
the parent times that and reads this process's peak memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest
from helpers import RequestLoad, Workers

import irismesh

CLUSTER = "work"


async def main(keyfile: Path, stall: float) -> None:
    workers = Workers(keyfile)
    try:
        seed = workers.start("w1")
        workers.start("w2", seeds=[seed])
        keys = irismesh.Keyring.load(keyfile)
        async with irismesh.Node(keyring=keys, seeds=[seed], telemetry=False) as caller:
            await caller.wait_for_members(CLUSTER, 2, timeout=20)
            load = RequestLoad(caller, CLUSTER, workers=16, timeout=5, stall=stall)
            try:
                await load.wait_until(lambda: load.served >= 200, 20, "the load to start")
                for proc in workers.procs.values():
                    proc.kill()
                print("KILLED", flush=True)
                await load.wait_until(lambda: False, 60, "a reply that cannot come")
            finally:
                await load.stop()
    finally:
        workers.close()


def peak_rss_kb() -> int:
    """This process's peak RSS since its exec (getrusage's would count the parent it forked
    from: Linux keeps the larger of the two across exec)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


if __name__ == "__main__":
    try:
        irismesh.run(main(Path(sys.argv[1]), float(sys.argv[2])))
    except (AssertionError, pytest.fail.Exception) as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    finally:
        print("PEAK_RSS_KB", peak_rss_kb(), flush=True)
