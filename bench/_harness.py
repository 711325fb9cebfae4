"""Child processes, RSS sampling and statistics shared by the benchmarks in this folder.

A benchmark is one parent that only orchestrates and a few children that do the work.
Children talk to the parent in lines on stdout (`READY <endpoint>`, then JSON events) and die
with it: stdin is a pipe the parent never writes to, so EOF on it means the parent is gone,
and on Linux the kernel also sends SIGKILL when the parent dies (PR_SET_PDEATHSIG). The parent
stops every child it started in a `finally`, first by closing stdin, then SIGTERM, then SIGKILL.
A parent may also write command lines to a child's stdin (see `on_stdin_lines`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import IO, TYPE_CHECKING, Any, Self

if TYPE_CHECKING:  # imported where used: children need not load it (memory, start-up time)
    import psutil

# Benchmarks say whom each node joins, as they did before discovery was on by default: so
# they measure the same thing, and two runs on one machine never meet. Children inherit it.
os.environ.setdefault("IRISMESH_DISCOVERY", "0")

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
        self, name: str, argv: Sequence[str], *, read_stdout: bool = True, stops_on_eof: bool = True
    ) -> None:
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()

    def spawn(
        self, name: str, argv: Sequence[str], *, read_stdout: bool = True, stops_on_eof: bool = True
    ) -> Child:
        """Start a child; `stops_on_eof=False` for programs that ignore stdin (SIGTERM at once)."""
        child = Child(name, argv, read_stdout=read_stdout, stops_on_eof=stops_on_eof)
        self._children.append(child)
        return child

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
