"""The real Prometheus server scrapes three `mesh node` members and a client under load: its
rate() is the client's counted rate, its histogram_quantile the client's measured p99."""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from helpers import MESH, kill_all

import irismesh

PROMETHEUS = shutil.which("prometheus")
WINDOW = 8  # seconds of rate() and of the client's own count
LOAD = WINDOW + 6  # seconds of load: room to choose the steadiest window in it
LONGEST = 40  # seconds of load at most: a busy machine runs on until a window is steady
STEADY = 0.2  # a window is steady if near its ends no quarter second missed RATE by more
EDGE = 1.5  # seconds about each end of a window where the load must be steady
RATE = 500  # requests per second
MAX_IN_FLIGHT = 2000  # a stall of the machine's of up to 2.5 s is caught up, not lost

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus server is not installed (`.ci/setup` installs it when run as root)",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def query(base: str, promql: str, at: float) -> float:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    assert len(result) == 1, f"{promql}: {result}"
    return float(result[0]["value"][1])


def get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)  # type: ignore[no-any-return]


class Prometheus:
    """A Prometheus server of the test's own: on 127.0.0.1, its storage in a temp dir, ended by
    its PID."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: irismesh\n"
            f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n"
        )
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_scraping(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        up = 0
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited: see prometheus.log"
            try:
                targets = get_json(f"{self.base}/api/v1/targets")["data"]["activeTargets"]  # type: ignore[index]
                up = sum(1 for t in targets if t["health"] == "up")  # type: ignore[union-attr]
            except OSError:
                up = 0
            if up == count:
                return
            time.sleep(0.1)
        pytest.fail(f"prometheus scrapes {up} of {count} targets after {timeout} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


class Load:
    """Requests at a steady RATE per second (started on a schedule, at most MAX_IN_FLIGHT at
    once): rate() over a window is then the count over it, whatever else the machine runs.
    Counts replies (with when) and latencies per wall-clock second."""

    def __init__(self, node: irismesh.Node) -> None:
        self.node = node
        self.done = 0
        self.failed = 0
        self.behind = 0  # requests not started on time: MAX_IN_FLIGHT were outstanding
        self.marks: list[tuple[float, int]] = []  # (wall clock, replies so far), every tick
        self.latencies: dict[int, Counter[int]] = {}  # wall-clock second -> us -> count
        self._in_flight: set[asyncio.Task[None]] = set()

    async def run(self, seconds: float, longest: float) -> None:
        """The load for `seconds`, and on (looking once a second) until a window of it is
        steady or `longest` seconds have passed."""
        start = time.monotonic()
        began = time.time()
        started = 0
        look = start + seconds
        while (elapsed := time.monotonic() - start) < longest:
            if time.monotonic() >= look:
                if self.steadiest(began)[1] < STEADY:
                    break
                look += 1.0
            self.marks.append((time.time(), self.done))
            for _ in range(int(elapsed * RATE) - started):
                started += 1
                if len(self._in_flight) >= MAX_IN_FLIGHT:
                    self.behind += 1
                    continue
                task = asyncio.create_task(self._one())
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
            await asyncio.sleep(0.005)
        await asyncio.gather(*self._in_flight)

    async def _one(self) -> None:
        started = time.perf_counter()
        try:
            await self.node.request("echo", b"x" * 100, timeout=5)
        except irismesh.MeshError:
            self.failed += 1
            return
        us = int((time.perf_counter() - started) * 1e6)
        self.done += 1
        second = self.latencies.setdefault(int(time.time()), Counter())
        second[us] += 1

    def steadiest(self, began: float) -> tuple[float, float]:
        """The end of the steadiest window the load has run so far (it began at `began`), and
        its unsteadiness; (0, inf) while no window fits yet."""
        if not self.marks:
            return 0.0, math.inf
        last = self.marks[-1][0] - EDGE - 0.5  # the latest end with marks all around it
        ends = [began + WINDOW + 2 + 0.25 * i for i in range(int((last - began - WINDOW - 2) * 4))]
        if not ends:
            return 0.0, math.inf
        at = min(ends, key=self.unsteadiness)
        return at, self.unsteadiness(at)

    def unsteadiness(self, at: float) -> float:
        """How far from RATE the replies ran near the ends of the window ending at `at`: the
        largest relative miss over quarter seconds within EDGE of either end. rate()
        extrapolates from the samples nearest the ends, and a scrape served late (its process
        stalled by the machine) is stamped when Prometheus asked: near the ends the load must
        be steady for rate() and the count to measure the same thing."""
        worst = 0.0
        for end in (at - WINDOW, at):
            t = end - EDGE
            while t < end + EDGE:
                got = self.count_at(t + 0.25) - self.count_at(t)
                worst = max(worst, abs(got - RATE * 0.25) / (RATE * 0.25))
                t += 0.25
        return worst

    def count_at(self, at: float) -> float:
        """Replies by wall-clock time `at`, interpolated between marks."""
        i = bisect.bisect_left(self.marks, (at, -1))
        if not 0 < i < len(self.marks):
            pytest.fail(f"no mark around {at}")
        (t0, n0), (t1, n1) = self.marks[i - 1], self.marks[i]
        return n0 + (n1 - n0) * (at - t0) / (t1 - t0) if t1 > t0 else float(n1)

    def p99(self, start: float, end: float) -> float:
        """The 99th percentile in seconds of the replies in whole seconds [start, end)."""
        merged: Counter[int] = Counter()
        for second in range(math.ceil(start), int(end)):
            merged.update(self.latencies.get(second, Counter()))
        rank = 0.99 * sum(merged.values())
        seen = 0
        for us in sorted(merged):
            seen += merged[us]
            if seen >= rank:
                return us / 1e6
        raise AssertionError("no latencies in the window")


def bucket(seconds: float) -> int:
    """The power-of-two microsecond bucket of a latency."""
    return max(1, int(seconds * 1e6)).bit_length()


def test_prometheus_rate_and_p99_agree_with_the_client(tmp_path: Path) -> None:
    keyfile = tmp_path / "mesh.keys"
    keys = irismesh.Keyring.generate(["*"])
    keys.save(keyfile)
    env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile))
    env.pop("IRISMESH_KEYS", None)
    members: list[subprocess.Popen[str]] = []
    prometheus: Prometheus | None = None
    try:
        lines: list[dict[str, object]] = []
        for i in range(3):
            argv = [*MESH, "node", "--cluster", "echo", "--name", f"m{i + 1}", "--json"]
            argv += ["--bind", "tcp://127.0.0.1:0", "--metrics", "127.0.0.1:0"]
            argv += ["--seed", str(lines[0]["endpoint"])] if lines else []
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
            members.append(proc)
            assert proc.stdout is not None
            lines.append(json.loads(proc.stdout.readline()))
        seed = str(lines[0]["endpoint"])

        async def main() -> tuple[Load, float, float]:
            nonlocal prometheus
            async with irismesh.Node(
                keyring=keys, seeds=[seed], name="client", metrics="127.0.0.1:0"
            ) as client:
                assert await client.wait_for_members("echo", 3, timeout=15) == 3
                targets = [str(line["metrics"]) for line in lines] + [client.metrics_address]
                prometheus = Prometheus(tmp_path, targets)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, prometheus.wait_scraping, 4, 20)
                load = Load(client)
                started = time.time()
                await load.run(LOAD, LONGEST)
                # A scrape after the window's end, so that Prometheus holds the last samples.
                await asyncio.sleep(1.5)
                return load, started, time.time()

        load, started, _ended = asyncio.run(asyncio.wait_for(main(), 100))
        assert prometheus is not None
        # The window whose ends the load crossed most steadily (the machine is shared).
        at, unsteady = load.steadiest(started)
        assert unsteady < STEADY, (
            f"no steady window: the load missed its rate by {unsteady:.0%} near "
            "the ends of every window (the machine stalled the processes for seconds)"
        )
        counted = (load.count_at(at) - load.count_at(at - WINDOW)) / WINDOW
        assert counted > 0.5 * RATE, (
            f"the load ran at {counted:.0f}/s of {RATE} ({load.failed} failed, {load.behind} not "
            "started on time)"
        )
        caller = f'{{cluster="echo",side="caller",node="client",outcome="ok"}}[{WINDOW}s]'
        rate = query(prometheus.base, f"sum(rate(irismesh_requests_total{caller}))", at)
        assert abs(rate - counted) <= 0.05 * counted, (
            f"rate() {rate:.1f}/s, counted {counted:.1f}/s"
        )
        # The members' side of the same requests: every one served by one of the three. Three
        # processes, each scraped at its own moments on a shared machine: within 10%.
        served = f'{{cluster="echo",side="member"}}[{WINDOW}s]'
        member_rate = query(prometheus.base, f"sum(rate(irismesh_requests_total{served}))", at)
        assert abs(member_rate - counted) <= 0.1 * counted, (
            f"members served {member_rate:.1f}/s, the client counted {counted:.1f}/s"
        )
        buckets = (
            f'sum by (le) (rate(irismesh_request_duration_seconds_bucket{{node="client",'
            f'cluster="echo"}}[{WINDOW}s]))'
        )
        p99 = query(prometheus.base, f"histogram_quantile(0.99, {buckets})", at)
        measured = load.p99(at - WINDOW, at)
        print(  # the figures, for -s
            f"rate() {rate:.1f}/s, members {member_rate:.1f}/s, counted {counted:.1f}/s; p99 "
            f"{p99 * 1e6:.0f} us from histogram_quantile, {measured * 1e6:.0f} us measured"
        )
        assert abs(bucket(p99) - bucket(measured)) <= 1, (
            f"histogram_quantile p99 {p99 * 1e6:.0f} us, the client measured "
            f"{measured * 1e6:.0f} us"
        )
    finally:
        if prometheus is not None:
            prometheus.close()
        kill_all(members, drain=True)
