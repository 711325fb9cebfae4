"""A job queue that loses nothing: jobs outlive a worker's SIGKILL and a memory member's restart.

    python examples/job_queue.py               # 300 jobs, 2 memory members, 2 workers
    python examples/job_queue.py --jobs 1000 --json

One command starts every process on 127.0.0.1, on a keyring it makes in a temporary directory:
two memory members (`mesh memory`, each with its own database), two workers of the cluster
`resize` (this file with `--role worker`: each job takes 5 ms), and the producer (this
process), which queues every job with `node.enqueue("resize", ...)`: it returns once both
memory members hold the job. While the workers are busy, the producer SIGKILLs one worker
(and starts another) and stops and restarts a memory member on the same database. It waits
until every job has been handled, and prints how many ran twice (a job in hand when its
worker died runs again: delivery is at least once), or one JSON object. The exit status is 1
if a job was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import irismesh

MEMORY = [sys.executable, "-m", "irismesh", "memory"]


def start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if not first:
        raise SystemExit(f"{' '.join(args)} did not start")
    return proc, first


async def produce(jobs: int, seconds: float) -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(prefix="irismesh-jobs-"))
    keyfile = tmp / "mesh.keys"
    keys = irismesh.Keyring.generate()
    keys.save(keyfile)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile), IRISMESH_DISCOVERY="0")
    bind = ["--bind", "tcp://127.0.0.1:0", "--json"]
    first, line = start([*MEMORY, "--data", str(tmp / "m1"), *bind], env)
    seed = json.loads(line)["endpoint"]
    memory_two = [*MEMORY, "--data", str(tmp / "m2"), "--seed", seed, *bind]
    second, _ = start(memory_two, env)
    worker_args = [sys.executable, __file__, "--role", "worker", "--seed", seed]
    workers = [start(worker_args, env)[0] for _ in range(2)]
    done: Counter[str] = Counter()
    progress = asyncio.Event()  # a job was reported done
    readers: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()

    async def until(handled: int, limit: float) -> None:
        """Until `handled` distinct jobs are done, or `limit` seconds have passed."""
        deadline = loop.time() + limit
        while len(done) < handled and loop.time() < deadline:
            progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(progress.wait(), deadline - loop.time())

    def watch(proc: subprocess.Popen[str]) -> None:
        async def read() -> None:
            assert proc.stdout is not None
            while line := await loop.run_in_executor(None, proc.stdout.readline):
                if line.startswith("DONE "):
                    done[line.split()[1]] += 1
                    progress.set()

        readers.append(loop.create_task(read()))

    for proc in workers:
        watch(proc)
    try:
        async with irismesh.Node(keyring=keys, seeds=[seed], name="producer") as node:
            await node.wait_for_members("_memory", 2, timeout=20)
            started = time.perf_counter()
            for i in range(jobs):
                await node.enqueue("resize", f"job-{i}".encode())
            queued = time.perf_counter() - started
            await until(jobs // 3, seconds)
            workers[0].send_signal(signal.SIGKILL)  # a job or two in hand die with it
            replacement = start(worker_args, env)[0]
            workers.append(replacement)
            watch(replacement)
            second.terminate()  # a memory member goes away and comes back on its database
            second.wait(timeout=10)
            second, _ = start(memory_two, env)
            await until(jobs, seconds)
            handled_in = time.perf_counter() - started
    finally:
        for proc in [*workers, first, second]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [*workers, first, second]:
            proc.wait(timeout=10)
        for task in readers:
            task.cancel()
    lost = sorted(set(f"job-{i}" for i in range(jobs)) - set(done), key=lambda j: int(j[4:]))
    return {
        "jobs": jobs,
        "queued_seconds": round(queued, 3),
        "handled_seconds": round(handled_in, 3),
        "handled": len(done),
        "ran_twice": sum(1 for n in done.values() if n > 1),
        "lost": lost,
        "ok": not lost,
    }


async def work(seed: str) -> None:
    async with irismesh.Node("resize", seeds=[seed]) as node:

        @node.on_request
        async def resize(payload: bytes) -> bytes:
            await asyncio.sleep(0.005)  # the work
            print("DONE", payload.decode(), flush=True)
            return b"ok"

        print("READY", node.endpoint, flush=True)
        await asyncio.Event().wait()  # until the producer stops it


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=60.0, help="most time to wait")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=("producer", "worker"), default="producer")
    parser.add_argument("--seed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        irismesh.run(work(args.seed))
        sys.exit(0)
    result = irismesh.run(produce(args.jobs, args.seconds))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['jobs']} jobs queued in {result['queued_seconds']} s (each held by 2 "
            f"memory members); {result['handled']} handled in {result['handled_seconds']} s "
            f"across a worker's SIGKILL and a memory member's restart; "
            f"{result['ran_twice']} ran twice; lost: {len(result['lost'])}"  # type: ignore[arg-type]
        )
    sys.exit(0 if result["ok"] else 1)
