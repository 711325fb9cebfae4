"""A cluster of workers and a client; one worker is killed mid-run and the client sees no failure.

    python examples/failover.py                  # 3 workers, 2000 requests, 64 in flight
    python examples/failover.py --workers 4 --requests 5000 --concurrency 100 --json

The script starts worker processes (this same file with `--worker`), each a member of the
cluster "work" that answers `worker-name:payload`. The client sends requests with many in flight,
SIGKILLs one worker once a third of them are done, and checks that every request got its own
correct reply. It prints how the requests spread over the workers and exits non-zero if any
request failed or got a wrong answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import irismesh

CLUSTER = "work"


async def run_worker(name: str, seeds: list[str], delay: float) -> None:
    keys = irismesh.Keyring.from_env()
    async with irismesh.Node(CLUSTER, keyring=keys, seeds=seeds, name=name) as node:
        prefix = name.encode() + b":"

        @node.on_request
        async def handle(payload: bytes) -> bytes:
            if delay:
                await asyncio.sleep(delay)
            return prefix + payload

        print("READY", node.endpoint, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await stop.wait()


def start_worker(
    name: str, seeds: list[str], env: dict[str, str], delay: float = 0.0
) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, __file__, "--worker", name, "--delay", str(delay)]
    for seed in seeds:
        cmd += ["--seed", seed]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if len(line) != 2 or line[0] != "READY":
        proc.kill()
        raise RuntimeError(f"worker {name} did not start (said {line!r})")
    return proc, line[1]


async def run_client(args: argparse.Namespace) -> int:
    keys = irismesh.Keyring.generate()
    workdir = Path(tempfile.mkdtemp(prefix="irismesh-failover-"))
    keyfile = workdir / "mesh.keys"
    keys.save(keyfile)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    env.pop("IRISMESH_KEYS", None)
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        first_proc, first = start_worker("w1", [], env, args.delay)
        procs["w1"] = first_proc
        for i in range(2, args.workers + 1):
            procs[f"w{i}"], _ = start_worker(f"w{i}", [first], env, args.delay)
        async with irismesh.Node(keyring=keys, seeds=[first], name="client") as client:
            await client.wait_for_members(CLUSTER, args.workers, timeout=10)
            say(
                args,
                f"{args.workers} workers up; sending {args.requests} requests, "
                f"{args.concurrency} in flight",
            )
            served: Counter[str] = Counter()
            failures: list[str] = []
            done = 0
            victim = f"w{args.workers}"
            killed_at: float | None = None
            next_id = 0
            started = time.perf_counter()

            async def one_worker() -> None:
                nonlocal done, next_id, killed_at
                while next_id < args.requests:
                    i = next_id
                    next_id += 1
                    payload = b"%d" % i
                    try:
                        reply = await client.request(CLUSTER, payload, timeout=args.timeout)
                    except irismesh.MeshError as exc:
                        failures.append(f"request {i}: {exc}")
                        continue
                    name, _, echoed = reply.partition(b":")
                    if echoed != payload:
                        failures.append(f"request {i}: wrong reply {reply!r}")
                    served[name.decode()] += 1
                    done += 1
                    if killed_at is None and done >= args.requests // 3:
                        killed_at = time.perf_counter()
                        procs[victim].send_signal(signal.SIGKILL)
                        say(
                            args,
                            f"killed {victim} (SIGKILL) after {done} replies, "
                            f"{client.stats.get('requests_pending', 0)} in flight",
                        )

            await asyncio.gather(*(one_worker() for _ in range(args.concurrency)))
            elapsed = time.perf_counter() - started
            stats = dict(client.stats)
        result = {
            "requests": args.requests,
            "replies_ok": done - len([f for f in failures if "wrong reply" in f]),
            "failures": failures[:20],
            "failed": len(failures),
            "served_by": dict(sorted(served.items())),
            "killed": victim,
            "resent": stats.get("requests_resent", 0),
            "seconds": round(elapsed, 3),
            "requests_per_second": round(args.requests / elapsed),
        }
        if args.json:
            print(json.dumps(result))
        else:
            say(
                args,
                f"{done} replies in {elapsed:.2f} s ({result['requests_per_second']} req/s), "
                f"{result['resent']} resent after the kill, {len(failures)} failed",
            )
            for name, count in sorted(served.items()):
                say(args, f"  {name}: {count} replies" + ("  (killed)" if name == victim else ""))
        return 1 if failures else 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--delay", type=float, default=0.002, help="seconds each request takes")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--seed", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        irismesh.run(run_worker(args.worker, args.seed, args.delay))
        return 0
    if args.workers < 2:
        parser.error("--workers must be at least 2 (one of them is killed)")
    return irismesh.run(run_client(args))


if __name__ == "__main__":
    sys.exit(main())
