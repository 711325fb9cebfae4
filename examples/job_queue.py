"""A job queue that loses nothing: jobs outlive SIGKILLs of workers and of a memory member.

    python examples/job_queue.py               # 300 jobs, 2 memory members, 2 workers
    python examples/job_queue.py --jobs 1000 --json

One command starts every process on 127.0.0.1, on a keyring it makes in a temporary directory
(removed at the end): two memory members (`mesh memory`, each with its own database), two
workers of the cluster `resize` (this file with `--role worker`: each job takes 5 ms in its
`@node.on_queued` handler), and the producer (this process), which queues every job with
`node.enqueue("resize", ...)`: it returns once the memory members hold the job. A third of the
way through queueing, the producer SIGKILLs the memory member that hands the jobs out (the
other takes over) and starts it again on its database; while the workers are busy it SIGKILLs
each worker in turn and starts a new one. It waits until every job has been handled and
prints how many ran twice (a job in hand when its worker died runs again: delivery is at least
once) and how many repeats the workers answered without running them again (a job handed out
again to the member that had answered it), or one JSON object; what it is doing goes to stderr
as it happens. The exit status is 1 if a job was lost.
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


_BEGAN = time.perf_counter()


def say(message: str) -> None:
    """Progress on stderr (stdout carries the result), with the time since the start."""
    print(f"[{time.perf_counter() - _BEGAN:6.2f} s] {message}", file=sys.stderr, flush=True)


async def produce(jobs: int, seconds: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="irismesh-jobs-") as tmp:
        return await run_all(Path(tmp), jobs, seconds)


async def run_all(tmp: Path, jobs: int, seconds: float) -> dict[str, object]:
    keyfile = tmp / "mesh.keys"
    keys = irismesh.Keyring.generate()
    keys.save(keyfile)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile), IRISMESH_DISCOVERY="0")
    bind = ["--bind", "tcp://127.0.0.1:0", "--json"]
    first, line = start([*MEMORY, "--data", str(tmp / "m1"), *bind], env)
    one = json.loads(line)
    second, line = start(
        [*MEMORY, "--data", str(tmp / "m2"), "--seed", one["endpoint"], *bind], env
    )
    two = json.loads(line)
    # The memory member with the lowest id hands the jobs out: the one to kill. The other
    # lives throughout, the seed of everything started later.
    if one["node_id"] < two["node_id"]:
        dispatcher, data, seed = first, tmp / "m1", two["endpoint"]
    else:
        dispatcher, data, seed = second, tmp / "m2", one["endpoint"]
    restart_args = [*MEMORY, "--data", str(data), "--seed", seed, *bind]
    worker_args = [sys.executable, __file__, "--role", "worker", "--seed", seed]
    workers = [start(worker_args, env)[0] for _ in range(2)]
    say("2 memory members and 2 workers started")
    done: Counter[str] = Counter()
    absorbed: list[int] = []
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
        if len(done) < handled:
            say(f"gave up waiting after {limit:.0f} s: {len(done)} of {handled} jobs handled")

    def watch(proc: subprocess.Popen[str]) -> None:
        async def read() -> None:
            assert proc.stdout is not None
            while line := await loop.run_in_executor(None, proc.stdout.readline):
                if line.startswith("DONE "):
                    done[line.split()[1]] += 1
                    progress.set()
                elif line.startswith("ABSORBED "):
                    absorbed.append(int(line.split()[1]))

        readers.append(loop.create_task(read()))

    for proc in workers:
        watch(proc)
    restarted: list[subprocess.Popen[str]] = []
    try:
        async with irismesh.Node(keyring=keys, seeds=[seed], name="producer") as node:
            await node.wait_for_members("_memory", 2, timeout=20)
            say(f"queueing {jobs} jobs")
            started = time.perf_counter()
            restart: asyncio.Future[tuple[subprocess.Popen[str], str]] | None = None
            for i in range(jobs):
                if i == jobs // 3:  # the dispatcher dies mid-stream; it comes back
                    dispatcher.kill()
                    dispatcher.wait(timeout=10)
                    say(f"SIGKILLed the dispatching memory member after {i} jobs; restarting it")
                    restart = loop.run_in_executor(None, start, restart_args, env)
                await node.enqueue("resize", f"job-{i}".encode())
            queued = time.perf_counter() - started
            say(f"all {jobs} jobs queued in {queued:.2f} s; {len(done)} handled so far")
            if restart is not None:
                restarted.append((await restart)[0])
            for n, victim in enumerate(list(workers)):  # each worker dies mid-job in turn
                await until(jobs * (n + 2) // 4, seconds)
                say(f"{len(done)} of {jobs} handled; SIGKILLing worker {n + 1}")
                victim.send_signal(signal.SIGKILL)
                replacement = start(worker_args, env)[0]
                workers.append(replacement)
                watch(replacement)
            await until(jobs, seconds)
            handled_in = time.perf_counter() - started
            say(f"{len(done)} of {jobs} handled in {handled_in:.2f} s")
    finally:
        procs = [*workers, *restarted, first, second]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        await asyncio.wait(readers, timeout=5)  # the workers' last words (ABSORBED n)
        for task in readers:
            task.cancel()
    lost = sorted(set(f"job-{i}" for i in range(jobs)) - set(done), key=lambda j: int(j[4:]))
    return {
        "jobs": jobs,
        "queued_seconds": round(queued, 3),
        "handled_seconds": round(handled_in, 3),
        "handled": len(done),
        "ran_twice": sum(1 for n in done.values() if n > 1),
        "repeats_absorbed": sum(absorbed),
        "lost": lost,
        "ok": not lost,
    }


async def work(seed: str) -> None:
    async with irismesh.Node("resize", seeds=[seed]) as node:

        @node.on_queued
        async def resize(payload: bytes) -> bytes:
            await asyncio.sleep(0.005)  # the work
            print("DONE", payload.decode(), flush=True)
            return b"ok"

        print("READY", node.endpoint, flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()  # until the producer stops it
        print("ABSORBED", node.stats.get("jobs_absorbed", 0), flush=True)


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
            f"across SIGKILLs of the dispatching memory member and of each worker; "
            f"{result['ran_twice']} ran twice, {result['repeats_absorbed']} repeats answered "
            f"unrun; lost: {len(result['lost'])}"  # type: ignore[arg-type]
        )
    sys.exit(0 if result["ok"] else 1)
