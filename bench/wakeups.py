"""What one request at a time costs each side in wake-ups: counts a busy machine does not blur.

    python bench/wakeups.py [--only raw,raw-asyncio,raw-asyncio-uv,mesh] [--requests 3000]
                            [--size 100] [--no-counters] [--no-syscalls] [--json OUT]
                            [--mesh-opt KEY=VALUE ...] [--caller-opt KEY=VALUE ...]

For each system a member (the echo servers of `bench/reqrep.py`) and a caller run in child
processes on 127.0.0.1; the caller sends --requests requests one at a time after a warm-up.
`raw-asyncio` runs on asyncio's own loop (as in `bench/reqrep.py`), `raw-asyncio-uv` and
irismesh on irismesh's (uvloop where installed). Around exactly those requests, for each side
and divided by the number of requests:

- system calls by kind, per thread (`perf trace -s` attached to the process; without perf,
  or with --no-syscalls, none), so the loop thread and zmq's I/O thread are told apart;
- voluntary and involuntary context switches and CPU time per thread
  (`/proc/PID/task/*/status` and `schedstat`);
- event loop work, counted by a subclass of the loop: callbacks queued (`call_soon`), timers
  set (`call_at`/`call_later`) and cancelled, futures and tasks created;
- zmq socket calls, counted by a subclass of `zmq.Socket`: recvs and the failing ones
  (`Again`), sends, `EVENTS` queries;
- irismesh's driver passes: `_drain_*`, `process`, `_send`, `_recheck_input`, `arm`, ...
  (`ns.driver.*`: wall time inside them, inclusive).

The counting costs time (it wraps hot calls) and perf trace slows every system call, so the
p50 and CPU it prints with either on mean little; `--no-counters --no-syscalls` measures
latency and CPU per thread only. An epoll_wait is one turn of the loop. Compare counts, not
times, between builds; `--mesh-opt` goes to both irismesh nodes, `--caller-opt` to the
caller's only (`--caller-opt busy_poll=0.0005`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reqrep  # bench/reqrep.py: the same servers and the same asyncio client
from _harness import parse_args

COUNTS: collections.Counter[str] = collections.Counter()
_EVENTS = int(zmq.EVENTS)


# ============================================================================================
# Counting (in the children, before anything is built)


class CountingSocket(zmq.Socket):  # type: ignore[type-arg]
    def recv(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        COUNTS["zmq.recv"] += 1
        try:
            return super().recv(flags, copy=copy, track=track)
        except zmq.Again:
            COUNTS["zmq.recv_again"] += 1
            raise

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        COUNTS["zmq.send"] += 1
        return super().send(data, flags, copy=copy, track=track)

    def getsockopt(self, option: int) -> Any:
        COUNTS["zmq.EVENTS" if option == _EVENTS else "zmq.getsockopt"] += 1
        return super().getsockopt(option)

    def get(self, option: int) -> Any:
        COUNTS["zmq.EVENTS" if option == _EVENTS else "zmq.getsockopt"] += 1
        return super().get(option)


def counting_loop_class(base: type[asyncio.AbstractEventLoop]) -> type[asyncio.AbstractEventLoop]:
    class CountingLoop(base):  # type: ignore[valid-type,misc]
        def call_soon(self, *args: Any, **kwargs: Any) -> Any:
            COUNTS["loop.call_soon"] += 1
            return super().call_soon(*args, **kwargs)

        def call_at(self, *args: Any, **kwargs: Any) -> Any:
            COUNTS["loop.call_at"] += 1
            handle = super().call_at(*args, **kwargs)
            return _CountedTimer(handle)

        def call_later(self, *args: Any, **kwargs: Any) -> Any:
            COUNTS["loop.call_later"] += 1
            return _CountedTimer(super().call_later(*args, **kwargs))

        def create_future(self) -> Any:
            COUNTS["loop.create_future"] += 1
            return super().create_future()

        def create_task(self, *args: Any, **kwargs: Any) -> Any:
            COUNTS["loop.create_task"] += 1
            return super().create_task(*args, **kwargs)

    return CountingLoop


class _CountedTimer:
    """A TimerHandle whose cancel is counted."""

    __slots__ = ("_handle",)

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def cancel(self) -> None:
        COUNTS["timer.cancel"] += 1
        self._handle.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def count_driver() -> None:
    from irismesh import _driver

    if not str(_driver.__file__).endswith(".py"):
        # Compiled with the core (mypyc): its methods cannot be wrapped. Its passes are the
        # same on the pure core, which IRISMESH_PURE=1 runs.
        print("driver passes not counted: the driver is compiled (IRISMESH_PURE=1 counts them)")
        return
    names = [
        "_drain_router",
        "_drain_dealer",
        "drain_all",
        "process",
        "_send",
        "flush_soon",
        "_recheck_input",
        "arm",
        "_on_timer",
        "spin",
        "_spin_router",
    ]
    for name in names:
        original = getattr(_driver.Driver, name, None)
        if original is None:
            continue

        def wrapped(*args: Any, __f: Callable[..., Any] = original, __k: str = name) -> Any:
            COUNTS["driver." + __k] += 1
            began = time.perf_counter_ns()
            try:
                return __f(*args)
            finally:  # inclusive: process() within a drain counts in both
                COUNTS["ns.driver." + __k] += time.perf_counter_ns() - began

        setattr(_driver.Driver, name, wrapped)


def plain_loop_factory(system: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop each system runs on: raw-asyncio on asyncio's own (as in bench/reqrep.py),
    raw-asyncio-uv and irismesh on irismesh's (uvloop where installed)."""
    if system == "raw-asyncio":
        return asyncio.new_event_loop
    from irismesh._loop import loop_factory

    return loop_factory()


def install_counters(system: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """Count socket and loop calls in this process; the loop factory to run on."""
    zmq.Context._socket_class = CountingSocket  # type: ignore[misc]
    if system == "mesh":
        count_driver()
    plain = plain_loop_factory(system)
    assert plain is not None
    return counting_loop_class(type(plain()))


def snapshot_on_signal(path: str) -> None:
    """SIGUSR1 writes the counters, as JSON lines, to `path` (the parent's window marks)."""

    def dump(_signum: int, _frame: Any) -> None:
        with open(path, "a") as out:
            out.write(json.dumps(dict(COUNTS)) + "\n")

    signal.signal(signal.SIGUSR1, dump)


# ============================================================================================
# Children


def run_server(args: argparse.Namespace) -> None:
    factory = install_counters(args.system) if args.counters else None
    factory = factory or plain_loop_factory(args.system)
    snapshot_on_signal(args.counts_file)
    if args.system == "raw":
        reqrep.serve_raw()
        return
    with asyncio.Runner(loop_factory=factory) as runner:
        if args.system == "mesh":
            runner.run(reqrep.serve_mesh(args.keyring, reqrep.parse_mesh_opts(args.mesh_opt)))
        else:
            runner.run(reqrep.serve_raw_asyncio())


def run_client(args: argparse.Namespace) -> None:
    factory = install_counters(args.system) if args.counters else None
    payload = reqrep.payload_of(args.size)
    if args.system == "raw":
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = 5000
        sock.connect(args.endpoint)

        def one() -> None:
            sock.send(payload)
            reqrep._raw_recv(sock, payload)

        for _ in range(args.warmup):
            one()
        samples = measure_sync(one, args.requests)
        sock.close()
        ctx.term()
        return finish(samples)

    async def main() -> None:
        if args.system != "mesh":
            requester = reqrep.raw_asyncio_requester(args.endpoint)
        else:
            opts = reqrep.parse_mesh_opts(args.mesh_opt + args.caller_opt)
            requester = reqrep.mesh_requester(args.endpoint, args.keyring, opts, 5.0)
        async with requester as request:
            for _ in range(args.warmup):
                await request(payload)
            print("WARM", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            before = dict(COUNTS)
            samples = []
            clock = time.perf_counter_ns
            for _ in range(args.requests):
                t = clock()
                await request(payload)
                samples.append(clock() - t)
            after = dict(COUNTS)
            print("DONE " + json.dumps(_diff(before, after)), flush=True)
            print("P50 " + str(statistics.median(samples) / 1000), flush=True)

    with asyncio.Runner(loop_factory=factory or plain_loop_factory(args.system)) as runner:
        runner.run(main())
    finish(None)


def measure_sync(one: Callable[[], None], n: int) -> list[int]:
    print("WARM", flush=True)
    sys.stdin.readline()
    before = dict(COUNTS)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t = clock()
        one()
        samples.append(clock() - t)
    print("DONE " + json.dumps(_diff(before, dict(COUNTS))), flush=True)
    print("P50 " + str(statistics.median(samples) / 1000), flush=True)
    return samples


def finish(_samples: list[int] | None) -> None:
    sys.stdin.readline()  # the parent has read everything


def _diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


# ============================================================================================
# Parent


def thread_switches(pid: int) -> dict[str, tuple[int, int, int]]:
    """thread name/id -> (voluntary, involuntary) context switches and ns on a CPU so far."""
    out: dict[str, tuple[int, int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
            comm = (task / "comm").read_text().strip()
            on_cpu = int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue
        vol = int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
        inv = int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
        out[f"{comm}/{task.name}"] = (vol, inv, on_cpu)
    return out


def parse_perf_summary(text: str) -> dict[str, dict[str, int]]:
    """`perf trace -s` output -> thread -> syscall -> calls."""
    threads: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in text.splitlines():
        head = re.match(r"\s*(\S.*?) \((\d+)\), (\d+) events", line)
        if head:
            current = threads.setdefault(f"{head.group(1)}/{head.group(2)}", {})
            continue
        row = re.match(r"\s+([a-z_0-9]+)\s+(\d+)\s+\d+\s+[\d.]+", line)
        if row and current is not None and row.group(1) != "syscall":
            current[row.group(1)] = current.get(row.group(1), 0) + int(row.group(2))
    return threads


def start_perf(pid: int, out: Path, wanted: bool) -> subprocess.Popen[bytes] | None:
    if not wanted or shutil.which("perf") is None:
        return None
    return subprocess.Popen(
        ["perf", "trace", "-s", "-p", str(pid), "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_perf(proc: subprocess.Popen[bytes] | None, out: Path) -> dict[str, dict[str, int]]:
    if proc is None:
        return {}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return parse_perf_summary(out.read_text()) if out.exists() else {}


def measure(system: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    base = [sys.executable, os.path.abspath(__file__), "--system", system, "--size", str(args.size)]
    base += ["--keyring", str(tmp / "bench.keys")]
    if not args.counters:
        base.append("--no-counters")
    for opt in args.mesh_opt:
        base += ["--mesh-opt", opt]
    for opt in args.caller_opt:
        base += ["--caller-opt", opt]
    server_counts = tmp / f"{system}.server.counts"
    server = subprocess.Popen(
        [*base, "--role", "server", "--counts-file", str(server_counts)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    assert server.stdin is not None
    ready = server.stdout.readline().split()
    if not ready or ready[0] != "READY":
        raise SystemExit(f"{system}: the server did not start")
    client = subprocess.Popen(
        [*base, "--role", "client", "--endpoint", ready[1], "--requests", str(args.requests)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdout is not None
    assert client.stdin is not None
    try:
        if client.stdout.readline().strip() != "WARM":
            raise SystemExit(f"{system}: the client did not warm up")
        perfs = {
            side: (
                start_perf(proc.pid, tmp / f"{system}.{side}.perf", args.syscalls),
                tmp / f"{system}.{side}.perf",
            )
            for side, proc in (("caller", client), ("member", server))
        }
        time.sleep(1.0 if args.syscalls else 0.1)  # perf attaches
        switches0 = {"caller": thread_switches(client.pid), "member": thread_switches(server.pid)}
        server.send_signal(signal.SIGUSR1)
        time.sleep(0.05)
        client.stdin.write("go\n")
        client.stdin.flush()
        done = client.stdout.readline()
        p50 = float(client.stdout.readline().split()[1])
        server.send_signal(signal.SIGUSR1)
        switches1 = {"caller": thread_switches(client.pid), "member": thread_switches(server.pid)}
        syscalls = {side: stop_perf(*perfs[side]) for side in perfs}
        client.stdin.write("end\n")
        client.stdin.flush()
        client.wait(timeout=20)
    finally:
        for proc in (client, server):
            if proc.poll() is None:
                proc.stdin.close()  # type: ignore[union-attr]
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    caller_counts = json.loads(done.split(" ", 1)[1])
    marks = (
        [json.loads(line) for line in server_counts.read_text().splitlines()]
        if server_counts.exists()
        else []
    )
    member_counts = _diff(marks[0], marks[1]) if len(marks) >= 2 else {}
    n = args.requests
    result: dict[str, Any] = {"p50_us": p50}
    for side, counts in (("caller", caller_counts), ("member", member_counts)):
        per = {k: v / n for k, v in sorted(counts.items())}
        threads = {}
        for name, (v1, i1, c1) in switches1[side].items():
            v0, i0, c0 = switches0[side].get(name, (0, 0, 0))
            if v1 - v0 or i1 - i0:
                threads[name] = {
                    "voluntary": (v1 - v0) / n,
                    "involuntary": (i1 - i0) / n,
                    "cpu_us": (c1 - c0) / n / 1000,
                }
        calls = {
            thread: {k: c / n for k, c in sorted(kinds.items(), key=lambda kv: -kv[1])}
            for thread, kinds in syscalls[side].items()
        }
        result[side] = {"counts": per, "switches": threads, "syscalls": calls}
    return result


def show(system: str, result: dict[str, Any]) -> None:
    print(f"\n== {system}: p50 {result['p50_us']:.0f} us")
    for side in ("caller", "member"):
        r = result[side]
        print(f"  {side}, per request:")
        for thread, kinds in r["syscalls"].items():
            total = sum(kinds.values())
            shown = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items() if v >= 0.005)
            print(f"    syscalls {thread}: {total:.2f} ({shown})")
        for thread, s in r["switches"].items():
            print(
                f"    {thread}: {s['cpu_us']:.1f} us CPU, switches {s['voluntary']:.2f} "
                f"voluntary, {s['involuntary']:.2f} involuntary"
            )
        if r["counts"]:
            print("    " + ", ".join(f"{k} {v:.2f}" for k, v in r["counts"].items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default="raw,raw-asyncio,raw-asyncio-uv,mesh",
        help="raw, raw-asyncio (asyncio's loop), raw-asyncio-uv (uvloop), mesh",
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--no-counters", dest="counters", action="store_false")
    parser.add_argument(
        "--no-syscalls", dest="syscalls", action="store_false", help="no perf trace (faster)"
    )
    parser.add_argument("--mesh-opt", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--caller-opt", action="append", default=[], metavar="KEY=VALUE", help="the caller's only"
    )
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--keyring", help=argparse.SUPPRESS)
    parser.add_argument("--counts-file", help=argparse.SUPPRESS)
    args = parse_args(parser)
    if args.role == "server":
        run_server(args)
        return 0
    if args.role == "client":
        run_client(args)
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="irismesh-wakeups-") as name:
        tmp = Path(name)
        systems = [s.strip() for s in args.only.split(",") if s.strip()]
        if "mesh" in systems:
            import irismesh

            irismesh.Keyring.generate().save(tmp / "bench.keys")
        for system in systems:
            print(f"[{system}] {args.requests} requests of {args.size} B", file=sys.stderr)
            results[system] = measure(system, args, tmp)
            show(system, results[system])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
