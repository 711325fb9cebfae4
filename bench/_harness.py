"""Everything the benchmarks in this folder share: one harness, so no benchmark has a run loop
of its own.

A benchmark is one parent that only orchestrates and a few children that do the work.
Children talk to the parent in lines on stdout (`READY <endpoint>`, then JSON events) and die
with it: stdin is a pipe the parent never writes to, so EOF on it means the parent is gone,
and on Linux the kernel also sends SIGKILL when the parent dies (PR_SET_PDEATHSIG). The parent
stops every child it started in a `finally`, first by closing stdin, then SIGTERM, then SIGKILL.
A parent may also write command lines to a child's stdin (`on_stdin_lines`, `stdin_commands`).

The sections below, in order:

- command line: `bench_parser` (`--json`), `add_only`, `parse_args` and `bench_main`, which
  refuse the pure Python core unless `--allow-pure` is given (a stale compiled build falls
  back to it silently, and its figures are several times slower);
- statistics, ports and resource sampling (`RssSampler`: RSS and CPU of named processes);
- the parent's side: `ChildProcesses` starts and stops children, `start_nats_server` and
  `start_redis_server` the baselines' brokers, `Events` reads the children's events under a
  deadline and samples them over a timed window, and `Run` with `run_parent` is the whole life
  of a benchmark that sets irismesh beside other systems (reqrep.py, pubsub.py, tunnel.py):
  preflight (skip what this machine cannot run, saying why), measure, print the tables (`table`,
  `print_costs`), write the JSON document (`write_json`: facts, settings, results, ratios);
- rounds of one measurement in the parent's own process (`keyed_rounds`, `print_medians`);
- the child's side: `emit` an event, `child_main` (hard timeout, stop at stdin EOF, an
  exception becomes an error event), `busy_member` (a member burning CPU per request) and
  `on_schedule` (an open loop of requests).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import (
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, Self, TypeVar

if TYPE_CHECKING:  # imported where used: children need not load it (memory, start-up time)
    import psutil

# Benchmarks say whom each node joins, as they did before discovery was on by default: so
# they measure the same thing, and two runs on one machine never meet. Children inherit it.
os.environ.setdefault("IRISMESH_DISCOVERY", "0")

_T = TypeVar("_T")
MB = 1024 * 1024
_PR_SET_PDEATHSIG = 1
# IRISMESH_BENCH_OTEL=batch: a child traces into OpenTelemetry's SDK with its batch span
# processor, whose exporter drops what it is given (bench/tracing_cost.py's "on" build).
BENCH_OTEL = "IRISMESH_BENCH_OTEL"


def otel_from_env() -> None:
    """Set the SDK up as IRISMESH_BENCH_OTEL asks (a child calls it before its nodes start)."""
    if os.environ.get(BENCH_OTEL, "") != "batch":
        return
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Dropped(SpanExporter):
        """Takes every batch and keeps nothing: the cost measured is the node's and the SDK's,
        not a collector's."""

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)


# --------------------------------------------------------------------------------------------
# Command line


def progress(message: str, *, clock: bool = False) -> None:
    """A progress line for the person watching (`clock`: after the time of day), on stderr, so
    that stdout stays the report."""
    print(
        f"[{time.strftime('%H:%M:%S')}] {message}" if clock else message,
        file=sys.stderr,
        flush=True,
    )


def bench_parser(
    doc: str | None, json_help: str = "also write every number to this file"
) -> argparse.ArgumentParser:
    """A benchmark's parser: the first paragraph of its docstring, and `--json PATH`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    parser.add_argument("--json", metavar="PATH", help=json_help)
    return parser


def rounds_parser(
    doc: str | None, *, rounds: int, size_help: str = "payload bytes"
) -> argparse.ArgumentParser:
    """The parser of a benchmark that repeats its measurement and quotes medians: the first
    paragraph of its docstring, `--size` (payload bytes, 100) and `--rounds`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    parser.add_argument("--size", type=int, default=100, help=size_help)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser


def add_only(parser: argparse.ArgumentParser, default: Sequence[str], explain: str) -> None:
    """`--only`: the systems to measure (`parse_only` reads it)."""
    listed = ",".join(default)
    parser.add_argument(
        "--only", default=listed, help=f"comma-separated systems (default: {listed}; {explain})"
    )


def add_allow_pure(parser: argparse.ArgumentParser) -> None:
    """The `--allow-pure` flag `refuse_pure_core` reads (once, however often it is asked)."""
    if "--allow-pure" in parser._option_string_actions:
        return
    parser.add_argument(
        "--allow-pure",
        action="store_true",
        help="measure even if irismesh runs its pure Python core (a stale or missing compiled "
        "build; the figures are then the pure core's)",
    )


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, *, refuse: bool = True
) -> argparse.Namespace:
    """`parser`'s arguments, `--allow-pure` added; exits (status 2) on the pure core unless it
    is given. A benchmark that only runs others (`refuse=False`) passes the permission on."""
    add_allow_pure(parser)
    args = parser.parse_args(argv)
    if refuse:
        refuse_pure_core(args.allow_pure)
    else:
        allow_pure(args.allow_pure)
    return args


def add_child_arguments(
    parser: argparse.ArgumentParser, roles: Sequence[str], systems: Sequence[str] | None = None
) -> None:
    """`--allow-pure`, and the hidden flags with which the parent starts this same script as
    one of its children."""
    add_allow_pure(parser)
    parser.add_argument("--role", choices=roles, help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=systems, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--keyring", help=argparse.SUPPRESS)
    parser.add_argument("--max-seconds", type=float, default=600.0, help=argparse.SUPPRESS)


def bench_main(
    parser: argparse.ArgumentParser,
    run_child: Callable[[argparse.Namespace], object],
    main_parent: Callable[[argparse.Namespace], int],
) -> int:
    """A parent refuses the pure core, then runs; a child (`--role`) does its part."""
    args = parser.parse_args()
    refuse_pure_core(args.allow_pure)
    if args.role:
        otel_from_env()
        run_child(args)
        return 0
    return main_parent(args)


# Set by a parent given --allow-pure; its children (and benchmarks it runs) inherit it.
ALLOW_PURE = "IRISMESH_BENCH_ALLOW_PURE"


def allow_pure(allowed: bool) -> None:
    """For a benchmark that runs others: let them measure the pure core if `allowed`."""
    if allowed:
        os.environ[ALLOW_PURE] = "1"


def refuse_pure_core(allowed: bool) -> None:
    """Exit with status 2 unless irismesh runs its compiled core, or `allowed` (or a parent
    that was given --allow-pure) says the pure core will do."""
    allow_pure(allowed)
    if os.environ.get(ALLOW_PURE) == "1":
        return
    from irismesh import _core

    if _core.COMPILED:
        return
    why = (
        "IRISMESH_PURE is set"
        if os.environ.get("IRISMESH_PURE")
        else "the compiled core is missing or older than its source"
    )
    print(
        f"{os.path.basename(sys.argv[0])}: irismesh runs its pure Python core ({why}), whose "
        "figures are several times slower than the compiled core's; rebuild it (bash .ci/setup) "
        "or pass --allow-pure to measure the pure core",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(2)


class BenchError(Exception):
    """A benchmark step failed; the message says which and why."""


class ChildFailed(BenchError):
    """A child process exited, hung or reported an error; carries the tail of its stderr."""

    def __init__(self, name: str, reason: str, stderr_tail: str = "") -> None:
        self.name = name
        self.reason = reason
        self.stderr_tail = stderr_tail
        detail = f"\n--- last lines of {name} stderr ---\n{stderr_tail}" if stderr_tail else ""
        super().__init__(f"{name}: {reason}{detail}")


# --------------------------------------------------------------------------------------------
# Statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values, q in [0, 100]."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def latency_summary_us(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50/p90/p99/mean/max in microseconds of per-request round trips given in nanoseconds."""
    ordered = sorted(samples_ns)
    return {
        "n": float(len(ordered)),
        "p50_us": percentile(ordered, 50) / 1000.0,
        "p90_us": percentile(ordered, 90) / 1000.0,
        "p99_us": percentile(ordered, 99) / 1000.0,
        "mean_us": sum(ordered) / len(ordered) / 1000.0,
        "max_us": ordered[-1] / 1000.0,
    }


# --------------------------------------------------------------------------------------------
# Ports


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers that cannot bind :0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for_tcp(port: int, timeout: float) -> None:
    """Block until something accepts connections on 127.0.0.1:port, or raise BenchError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise BenchError(f"nothing listens on 127.0.0.1:{port} after {timeout} s") from exc
            time.sleep(0.05)


def find_executable(name: str, *fallbacks: str) -> str | None:
    """`name` on PATH, else the first of `fallbacks` that is an executable file."""
    found = shutil.which(name)
    if found:
        return found
    for path in fallbacks:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


# --------------------------------------------------------------------------------------------
# Resource sampling


@dataclass(kw_only=True, slots=True)
class _Trace:
    process: psutil.Process
    rss: list[int] = field(default_factory=list)
    cpu_first: float | None = None
    cpu_last: float | None = None


class RssSampler:
    """Samples RSS and CPU time of named processes; the first sample is the start."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        import psutil

        self._traces = {role: _Trace(process=psutil.Process(pid)) for role, pid in pids.items()}
        self._me = _Trace(process=psutil.Process())
        self._system_busy: list[float] = []
        self._started = time.monotonic()
        self._ended = self._started

    def sample(self) -> None:
        import psutil

        self._ended = time.monotonic()
        times = psutil.cpu_times()
        # Interrupt time is left out: loopback traffic of the measured processes lands there.
        self._system_busy.append(times.user + times.nice + times.system)
        self._sample_one(self._me)
        for trace in self._traces.values():
            self._sample_one(trace)

    @staticmethod
    def _sample_one(trace: _Trace) -> None:
        import psutil

        try:
            with trace.process.oneshot():
                rss = trace.process.memory_info().rss
                times = trace.process.cpu_times()
        except psutil.Error:
            return  # the process is gone; the summary shows the samples it did give
        cpu = times.user + times.system
        trace.rss.append(rss)
        if trace.cpu_first is None:
            trace.cpu_first = cpu
        trace.cpu_last = cpu

    def others_cpu_percent(self) -> float:
        """CPU used by processes other than ours while sampling, in % of the whole machine.

        Anything well above zero means the figures of this window were disturbed.
        """
        seconds = self._ended - self._started
        if len(self._system_busy) < 2 or seconds <= 0:
            return 0.0
        ours = sum(
            (t.cpu_last or 0.0) - (t.cpu_first or 0.0) for t in (self._me, *self._traces.values())
        )
        others = self._system_busy[-1] - self._system_busy[0] - ours
        return max(0.0, 100.0 * others / (seconds * (os.cpu_count() or 1)))

    def summary(self) -> dict[str, dict[str, float]]:
        """Per role: start/peak/end/growth RSS in MB, CPU seconds used and sample count."""
        out: dict[str, dict[str, float]] = {}
        for role, trace in self._traces.items():
            if not trace.rss:
                continue
            cpu = (trace.cpu_last or 0.0) - (trace.cpu_first or 0.0)
            out[role] = {
                "start_mb": trace.rss[0] / MB,
                "peak_mb": max(trace.rss) / MB,
                "end_mb": trace.rss[-1] / MB,
                "growth_mb": (trace.rss[-1] - trace.rss[0]) / MB,
                "cpu_s": cpu,
                "samples": float(len(trace.rss)),
                "seconds": self._ended - self._started,
            }
        return out


# --------------------------------------------------------------------------------------------
# Parent side: child processes


def _pdeathsig_preexec() -> Callable[[], None] | None:
    # The kernel ties PDEATHSIG to the thread that forked, so children are spawned from the
    # main thread only. The libc lookup happens here, before fork, not in the child.
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return preexec


class Child:
    """One child process whose stdout is read line by line on a background thread."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        read_stdout: bool = True,
        stops_on_eof: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`read_stdout=False` sends its stdout to /dev/null; `stops_on_eof=False` for programs
        that ignore stdin (`stop` sends SIGTERM at once); `env`: its whole environment."""
        self.name = name
        self.stops_on_eof = stops_on_eof
        # Lives as long as the child; stop() closes it.
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if read_stdout else subprocess.DEVNULL,
            stderr=self._stderr,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the parent only; the parent stops us
            preexec_fn=_pdeathsig_preexec(),  # safe: spawned from the main thread only
        )
        if read_stdout:
            threading.Thread(target=self._pump, name=f"{name}-stdout", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
        self._lines.put(None)

    def next_line(self, until: float) -> str | None:
        """The next stdout line, or None once time.monotonic() reaches `until`.

        Raises ChildFailed if the child closed stdout (it exited) before printing one.
        """
        try:
            line = self._lines.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            self._lines.put(None)  # keep reporting EOF to later calls
            code = self.proc.wait(timeout=5)
            raise ChildFailed(self.name, f"exited with status {code}", self.stderr_tail())
        return line

    def expect_prefix(self, prefix: str, timeout: float) -> str:
        """Skip lines until one starts with `prefix`; return the rest of it."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(deadline)
            if line is None:
                raise ChildFailed(
                    self.name, f"no {prefix.strip()!r} line within {timeout} s", self.stderr_tail()
                )
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def stderr_tail(self, lines: int = 25) -> str:
        try:
            self._stderr.seek(0)
            text = self._stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def stop(self, grace: float = 3.0) -> None:
        """Close stdin (the polite stop, if it listens), then SIGTERM, then SIGKILL; reaps."""
        proc = self.proc
        if self.stops_on_eof and proc.poll() is None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._stderr.close()


class ChildProcesses:
    """Every child started inside the `with` block is stopped when it ends, however it ends."""

    def __init__(self) -> None:
        self._children: list[Child] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    @property
    def children(self) -> list[Child]:
        """The children still running, in the order they were started."""
        return list(self._children)

    def spawn(self, name: str, argv: Sequence[str], **options: Any) -> Child:
        """Start a child (`options`: Child's)."""
        child = Child(name, argv, **options)
        self._children.append(child)
        return child

    def first_line(
        self, name: str, argv: Sequence[str], timeout: float = 30.0, **options: Any
    ) -> str:
        """Start a child (as `spawn` does) and return the first line it prints."""
        child = self.spawn(name, argv, **options)
        line = child.next_line(time.monotonic() + timeout)
        if line is None:
            raise ChildFailed(name, f"printed nothing within {timeout} s", child.stderr_tail())
        return line

    def stop(self, child: Child, grace: float = 3.0) -> None:
        if child in self._children:
            self._children.remove(child)
        child.stop(grace)

    def stop_all(self) -> None:
        # Reverse order: clients before servers, servers before the broker they use.
        while self._children:
            child = self._children.pop()
            # A second Ctrl-C must not leave the rest running.
            with contextlib.suppress(KeyboardInterrupt):
                child.stop()


def raise_keyboard_interrupt_on_sigterm() -> None:
    """Make SIGTERM unwind the parent like Ctrl-C, so its `finally` blocks stop the children."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


# --------------------------------------------------------------------------------------------
# Parent side: brokers the baselines need

NATS_SERVER_INSTALL = "apt-get install -y nats-server"


def find_nats_server() -> str | None:
    return find_executable("nats-server", "/usr/sbin/nats-server", "/usr/bin/nats-server")


def nats_missing() -> str | None:
    """Why NATS cannot be measured here (None: it can): its server or its client is missing."""
    if find_nats_server() is None:
        return f"nats-server not installed: {NATS_SERVER_INSTALL}"
    if importlib.util.find_spec("nats") is None:
        return "its client, nats-py, is not installed: pip install -e '.[bench]'"
    return None


def start_nats_server(procs: ChildProcesses, *options: str) -> tuple[Child, str]:
    """A nats-server on a free port of 127.0.0.1 (with `options`, e.g. -js); (child, its URL)."""
    executable = find_nats_server()
    if executable is None:
        raise BenchError(f"nats-server not installed: {NATS_SERVER_INSTALL}")
    port = free_tcp_port()
    argv = [executable, "-a", "127.0.0.1", "-p", str(port), *options]
    child = procs.spawn("nats-server", argv, read_stdout=False, stops_on_eof=False)
    wait_for_tcp(port, timeout=15.0)
    return child, f"nats://127.0.0.1:{port}"


def nats_server_version() -> str | None:
    executable = find_nats_server()
    if executable is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=5)
        return done.stdout.strip()
    return None


def start_redis_server(procs: ChildProcesses) -> int | None:
    """A redis-server on a free port of 127.0.0.1, nothing saved to disk; its port, or None
    where redis-server is not installed."""
    executable = shutil.which("redis-server")
    if executable is None:
        return None
    port = free_tcp_port()
    argv = [executable, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly"]
    procs.spawn("redis-server", [*argv, "no"], read_stdout=False, stops_on_eof=False)
    wait_for_tcp(port, timeout=15.0)
    return port


# --------------------------------------------------------------------------------------------
# Parent side: reading children's events


def child_failure(child: Child, event: Mapping[str, Any]) -> ChildFailed:
    """The ChildFailed for a child's error event, with the traceback it writes as it exits."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(timeout=5.0)
    return ChildFailed(child.name, str(event.get("message", "failed")), child.stderr_tail())


def parse_event(child: Child, line: str) -> tuple[str | None, dict[str, Any]]:
    """(kind, fields) of a child's JSON event line; (None, {}) for any other line, relayed to
    stderr. An error event raises ChildFailed."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        event = None
    if not isinstance(event, dict):
        progress(f"  {child.name}: {line}")
        return None, {}
    kind = event.pop("event", None)
    if kind == "error":
        raise child_failure(child, event)
    return kind, event


def expect_ready(child: Child, timeout: float) -> str:
    """The rest of the child's READY line; its error (with stderr) if it failed before."""
    deadline = time.monotonic() + timeout
    while True:
        line = child.next_line(deadline)
        if line is None:
            raise ChildFailed(child.name, f"no READY line within {timeout} s", child.stderr_tail())
        if line.startswith("READY"):
            return line[len("READY") :].strip()
        parse_event(child, line)


def check_local(name: str, endpoint: str) -> str:
    """`endpoint` (comma-separated endpoints) if every one is on 127.0.0.1, else BenchError."""
    if not all(
        part.startswith(("tcp://127.0.0.1:", "nats://127.0.0.1:")) for part in endpoint.split(",")
    ):
        raise BenchError(f"{name} is not on 127.0.0.1: {endpoint}")
    return endpoint


class Events:
    """The JSON events of some children, in the order they come, until a deadline.

    `for child, kind, event in Events(...)`: the caller breaks out once it has what it waits
    for. Lines that are not events are relayed; an error event, a child that exits, and the
    deadline raise ChildFailed (with the stderr of every child still awaited). Between
    `sample(pids)` and `sampled()` the processes in `pids` are sampled every `sample_every`
    seconds: the timed window over which RSS and CPU are reported.
    """

    def __init__(
        self, children: Sequence[Child], budget_s: float, *, sample_every: float | None = 1.0
    ) -> None:
        self.children = list(children)
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.sample_every = sample_every
        self.sampler: RssSampler | None = None
        self._next_sample = math.inf

    def sample(self, pids: Mapping[str, int]) -> None:
        """Start the window: a first sample of every process in `pids` now."""
        self.sampler = RssSampler(pids)
        self.sampler.sample()
        if self.sample_every is not None:
            self._next_sample = time.monotonic() + self.sample_every

    def sampled(self) -> dict[str, Any]:
        """End the window: a last sample; per process RSS/CPU ("memory") and others' CPU."""
        sampler, self.sampler, self._next_sample = self.sampler, None, math.inf
        if sampler is None:
            return {}
        sampler.sample()
        return {"memory": sampler.summary(), "others_cpu_percent": sampler.others_cpu_percent()}

    def _tick(self, now: float) -> None:
        if self.sampler is not None and now >= self._next_sample:
            self.sampler.sample()
            assert self.sample_every is not None
            self._next_sample = max(self._next_sample + self.sample_every, now)

    def __iter__(self) -> Iterator[tuple[Child, str, dict[str, Any]]]:
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                names = ", ".join(child.name for child in self.children)
                tails = "\n".join(f"[{c.name}] {c.stderr_tail(10)}" for c in self.children)
                raise ChildFailed(names, f"no result within {self.budget_s:.0f} s", tails)
            self._tick(now)
            if len(self.children) == 1:  # one child: block on it until the next sample is due
                lines = [(self.children[0], min(self.deadline, self._next_sample))]
            else:
                lines = [(child, now) for child in self.children]
            idle = True
            for child, until in lines:
                line = child.next_line(until)
                if line is None:
                    continue
                idle = False
                kind, event = parse_event(child, line)
                if kind is not None:
                    yield child, kind, event
            if idle and len(self.children) > 1:
                time.sleep(min(0.005, max(0.0, self._next_sample - time.monotonic())))


# --------------------------------------------------------------------------------------------
# Parent side: one run of a benchmark


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def parse_only(text: str, systems: Sequence[str], aliases: Mapping[str, str]) -> list[str]:
    """The systems `--only` names (aliases allowed), in the order of `systems`."""
    chosen = []
    for item in (part.strip().lower() for part in text.split(",") if part.strip()):
        system = aliases.get(item, item)
        if system not in systems:
            raise SystemExit(f"--only: unknown system {item!r}; choose from {', '.join(systems)}")
        chosen.append(system)
    return [s for s in systems if s in chosen]


def size_label(size: int) -> str:
    return f"{size // 1024} KB" if size % 1024 == 0 else f"{size} B"


def ratio_cell(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def warn_if_busy() -> float:
    """CPU use by others just before the run: on 2 cores, other work skews every figure."""
    import psutil

    busy: float = psutil.cpu_percent(interval=0.5)
    if busy > 20.0:
        progress(f"warning: the CPUs are {busy:.0f}% busy before starting; figures will be noisy")
    return busy


def machine_facts(nats: bool = False, busy: bool = False) -> dict[str, Any]:
    """The machine and the versions a run's figures hold for; `busy`: how busy its CPUs were
    just before (`warn_if_busy`), `nats`: nats-server's version too."""
    import platform

    import zmq

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with contextlib.suppress(Exception):
        import irismesh

        facts["irismesh"] = irismesh.__version__
    if nats and (version := nats_server_version()):
        facts["nats_server"] = version
    if busy:
        facts["cpu_busy_percent_before"] = warn_if_busy()
    return facts


def write_json(path: str | os.PathLike[str], document: Mapping[str, Any]) -> None:
    """`document` as indented JSON into the file `path`; `-`: on stdout."""
    if str(path) == "-":
        json.dump(document, sys.stdout, indent=2)
        print()
        return
    with open(path, "w", encoding="utf-8") as out:
        json.dump(document, out, indent=2)
    progress(f"wrote {path}")


@dataclass(kw_only=True, slots=True)
class Run:
    """One run of a benchmark that sets irismesh beside other systems: what it measures, and
    what it measured. A benchmark's own Run adds its plans."""

    systems: list[str]
    labels: Mapping[str, str]
    mesh_systems: Collection[str]  # the systems whose children load the keyring
    plans: Sequence[Any]  # dataclasses: one a case (or a client) of each system
    steps_per_plan: int = 1
    requested: list[str] = field(default_factory=list)
    keyring_path: str = ""
    results: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    step: int = 0
    busy_before: float = 0.0
    elapsed_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.systems) * len(self.plans) * self.steps_per_plan

    def announce(self, what: str) -> None:
        self.step += 1
        progress(f"[{self.step}/{self.steps}] {what}")

    def preflight(self) -> None:
        """Drop the systems this machine cannot run, saying why; make the irismesh keyring."""
        if "nats" in self.systems and (missing := nats_missing()):
            self.skipped["nats"] = missing
        if any(system in self.mesh_systems for system in self.systems):
            try:
                import irismesh

                irismesh.Keyring.generate().save(self.keyring_path)
            except Exception as exc:
                for system in self.mesh_systems:
                    if system in self.systems:
                        self.failed[system] = f"{type(exc).__name__}: {exc}"
        for system, reason in self.skipped.items():
            progress(f"{self.labels[system]}: skipped ({reason})")
        for system, reason in self.failed.items():
            progress(f"{self.labels[system]}: FAILED before starting: {reason}")
        self.systems = [s for s in self.systems if s not in self.skipped and s not in self.failed]

    def each_system(self, measure: Callable[[str], object]) -> None:
        """`measure(system)` for every system in turn; a BenchError fails that system only."""
        for system in list(self.systems):
            try:
                measure(system)
            except BenchError as exc:
                self.failed[system] = str(exc)
                progress(f"{self.labels[system]}: FAILED: {exc}")

    def child_argv(self, script: str, role: str, system: str, *options: str) -> list[str]:
        """This same script as a child: `--role`, `--system`, the keyring if it needs one."""
        argv = [sys.executable, os.path.abspath(script), "--role", role, "--system", system]
        if system in self.mesh_systems:
            argv += ["--keyring", self.keyring_path]
        return [*argv, *options]

    def extra_json(self) -> dict[str, Any]:
        """What a benchmark's own Run adds to the JSON document."""
        return {}

    def footnotes(self) -> list[str]:
        """One line per system skipped or failed, for under the tables."""
        lines = []
        for system, reason in {**self.skipped, **self.failed}.items():
            state = "skipped" if system in self.skipped else "FAILED (details above)"
            lines.append(f"{self.labels[system]}: {state}: {reason.splitlines()[0]}")
        return lines


def run_parent(
    run: Run,
    measure: Callable[[], object],
    report: Callable[[], object],
    ratios: Callable[[], Mapping[str, Any]],
    json_path: str | None,
    **settings: Any,
) -> int:
    """The parent's whole life: measure, report, write every number to `json_path` (the
    machine, the plans and `settings`, the results, `ratios()`, what was skipped or failed).
    Exit status 1 if a system failed, 130 if interrupted: every child is stopped either way."""
    raise_keyboard_interrupt_on_sigterm()
    run.busy_before = warn_if_busy()
    run.requested = list(run.systems)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="irismesh-bench-") as tmp:
        run.keyring_path = os.path.join(tmp, "bench.keys")
        run.preflight()
        try:
            measure()
        except KeyboardInterrupt:
            progress("interrupted; every child process has been stopped")
            return 130
    run.elapsed_s = time.monotonic() - started
    report()
    if json_path:
        facts = machine_facts(nats="nats" in run.requested)
        facts["cpu_busy_percent_before"] = run.busy_before
        plans = [dataclasses.asdict(plan) for plan in run.plans]
        document = {
            "facts": facts,
            "settings": {"plans": plans, "systems": run.requested, **settings},
            "results": run.results,
            "ratios": ratios(),
            "skipped": run.skipped,
            "failed": run.failed,
            **run.extra_json(),
            "elapsed_s": run.elapsed_s,
        }
        write_json(json_path, document)
    return 1 if run.failed else 0


def console(width: int) -> Any:
    """A rich Console: the terminal's width on a terminal, `width` when piped (a file)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=width)


def table(title: str, labels: Sequence[str], figures: Sequence[str], caption: str = "") -> Any:
    """A rich Table: `labels` columns, then `figures` columns (right-justified)."""
    from rich.table import Table

    made = Table(title=title, caption=caption or None)
    for column in labels:
        made.add_column(column, no_wrap=True)
    for column in figures:
        made.add_column(column, justify="right")
    return made


def print_costs(
    out: Any,
    title: str,
    labels: Sequence[str],
    variants: Sequence[str],
    rows: Iterable[Sequence[str]],
    caption: str = "",
) -> None:
    """What each variant of irismesh changes, if any ran: per row its labels, then irismesh's
    figure divided by each variant's."""
    if variants:
        costs = table(title, labels, [f"irismesh / {variant}" for variant in variants], caption)
        for row in rows:
            costs.add_row(*row)
        out.print(costs)


def print_footnotes(out: Any, run: Run) -> None:
    for line in run.footnotes():
        out.print(line, markup=False, highlight=False)


# --------------------------------------------------------------------------------------------
# Parent side: rounds of one measurement, in this process


def keyed_rounds(
    rounds: int, what: str, measure: Callable[[Any, Path, bool], _T], *, prefix: str = "bench"
) -> list[_T]:
    """`measure(keys, keyfile, last)` `rounds` times, with one new keyring saved to a file
    (children load it from there); `last` is True in the last round."""
    import irismesh

    keys = irismesh.Keyring.generate()
    results = []
    with tempfile.TemporaryDirectory(prefix=f"irismesh-{prefix}-") as tmp:
        keyfile = Path(tmp) / "mesh.keys"
        keys.save(keyfile)
        for i in range(rounds):
            progress(f"[{i + 1}/{rounds}] {what}")
            results.append(measure(keys, keyfile, i == rounds - 1))
    return results


def print_medians(rows: Sequence[tuple[str, Sequence[float], str, str]], width: int = 18) -> None:
    """Per row (label, values, format, unit): the median of its values, its unit, and every
    value."""
    for label, values, form, unit in rows:
        shown = ", ".join(form.format(v) for v in values)
        print(f"{label:{width}} median {form.format(statistics.median(values))}{unit}  ({shown})")


# --------------------------------------------------------------------------------------------
# Child side


def emit(event: str, **fields: Any) -> None:
    """One JSON event line on stdout for the parent."""
    print(json.dumps({"event": event, **fields}), flush=True)


def on_stdin_eof(callback: Callable[[], object]) -> None:
    """Call `callback` from a daemon thread once stdin reaches EOF (the parent stopped us)."""
    on_stdin_lines(lambda _line: None, callback)


def on_stdin_lines(on_line: Callable[[str], object], on_eof: Callable[[], object]) -> None:
    """From a daemon thread: `on_line(line)` for every line the parent writes to stdin (without
    its newline), then `on_eof()` once stdin reaches EOF (the parent stopped us, or died).

    Both run on that thread: an asyncio child hands them over with `loop.call_soon_threadsafe`.
    """

    def watch() -> None:
        # os.read on the raw descriptor: a daemon thread blocked inside sys.stdin.buffer
        # holds its lock, and interpreter shutdown then aborts with a fatal error.
        pending = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(fd, 4096):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    on_line(line.decode("utf-8", "replace"))
        on_eof()

    fd = sys.stdin.fileno()

    threading.Thread(target=watch, name="stdin", daemon=True).start()


def peak_rss_mb() -> float:
    """The kernel's high-water mark of this process's RSS, start-up included (MiB).

    VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, from the parent's peak.
    """
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        status = Path("/proc/self/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return int(fields["VmHWM"].split()[0]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def raise_fd_limit(wanted: int = 65536) -> int:
    """Raise this process's soft limit on open descriptors towards `wanted` (never above the
    hard limit); returns the soft limit now in force. Children inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return int(soft)


def exit_after(seconds: float, status: int = 3) -> None:
    """Hard timeout for a child: leave at once after `seconds`, whatever it is doing."""

    def expire() -> None:
        print(f"hard timeout of {seconds:.0f} s reached, exiting", file=sys.stderr, flush=True)
        os._exit(status)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def park() -> None:
    """A sync child's last step: its sockets stay up until the parent stops it (stdin EOF)."""
    while True:
        time.sleep(3600)


async def park_async() -> None:
    """An asyncio child's last step: its connections stay up until the parent stops it."""
    import asyncio

    await asyncio.Event().wait()


def child_main(
    max_seconds: float,
    body: Callable[[], object] | Coroutine[Any, Any, object],
    *,
    eof_status: int = 0,
) -> None:
    """A child's life: `body()` (a coroutine: on asyncio's loop), ended by the hard timeout or
    by EOF on stdin (the parent stopping us, or gone; exit status `eof_status`); an exception
    is also an error event for the parent."""
    exit_after(max_seconds)
    on_stdin_eof(lambda: os._exit(eof_status))
    try:
        if inspect.iscoroutine(body):
            import asyncio

            asyncio.run(body)
        else:
            assert callable(body)
            body()
    except BaseException as exc:
        emit("error", message=f"{type(exc).__name__}: {exc}")
        raise


def stdin_commands() -> Any:
    """An asyncio child's commands from its parent: an asyncio.Queue of the lines the parent
    writes to stdin. At EOF (the parent is gone) the child exits at once, with status 1."""
    import asyncio

    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str] = asyncio.Queue()
    on_stdin_lines(lambda line: loop.call_soon_threadsafe(commands.put_nowait, line), _gone)
    return commands


def _gone() -> None:
    os._exit(1)


async def on_schedule(
    start: float,
    interval: float,
    count: int,
    launch: Callable[[int, float], object],
    give_up_at: float = math.inf,
) -> int:
    """An open loop: `launch(index, due)` for index 0 to count - 1, each at its due time
    start + index * interval on the event loop's clock, whatever the earlier ones do (those
    overdue at once, in a burst), until `give_up_at`. Returns how many were launched."""
    import asyncio

    loop = asyncio.get_running_loop()
    index = 0
    while index < count:
        now = loop.time()
        due = start + index * interval
        if due > now:
            await asyncio.sleep(due - now)
            now = loop.time()
        if now > give_up_at:
            break
        while index < count and (due := start + index * interval) <= now:
            launch(index, due)
            index += 1
    return index


async def busy_member(
    keyring_path: str,
    cost_s: float,
    on_line: Callable[[Any, str], object],
    *,
    count: Callable[[bytes], object] | None = None,
    cluster: str = "work",
    ready: Callable[[Any], str] = lambda node: str(node.endpoint),
) -> None:
    """A member of `cluster` on 127.0.0.1 whose plain handler burns `cost_s` of CPU per
    request, as real work would (it never sleeps), then echoes the payload; `count(payload)`
    first, if given. `on_line(node, line)` runs on the event loop for each line the parent
    writes; stdin EOF or SIGTERM stops it. Its READY line ends with `ready(node)`."""
    import asyncio
    import signal

    import irismesh

    keys = irismesh.Keyring.load(keyring_path)
    clock = time.perf_counter

    def handle(payload: bytes) -> bytes:
        if count is not None:
            count(payload)
        end = clock() + cost_s
        while clock() < end:
            pass
        return payload

    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    node = irismesh.Node(cluster, keyring=keys, bind="tcp://127.0.0.1:0", survey=False)
    async with node:
        node.on_request(handle)
        on_stdin_lines(
            lambda line: loop.call_soon_threadsafe(on_line, node, line),
            lambda: loop.call_soon_threadsafe(stopped.set),
        )
        loop.add_signal_handler(signal.SIGTERM, stopped.set)
        print("READY", ready(node), flush=True)
        await stopped.wait()
