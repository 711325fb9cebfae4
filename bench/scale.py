"""Scale benchmark: N node processes on 127.0.0.1 in several clusters; time to full membership,
idle CPU and RSS per node, false deaths, and how fast a crashed member is known dead.

    python bench/scale.py [--sizes 10,20,40] [--clusters K] [--clients 2] [--hold 10]
                          [--kills 3] [--discovery seeds|survey|both] [--seeds 2] [--window 5]
                          [--json out.json | --json -]

For each size N the parent starts N node processes (this same file with `--role node`), all
bound to 127.0.0.1: N - `--clients` members, member i serving the cluster `bench-{i % K}`
(K = `--clusters`, by default about N/10), and `--clients` pure clients that call every
cluster. With `--discovery seeds` (the default) the first `--seeds` members start first and
every other node is given their endpoints, so the rest of the mesh is learnt by gossip; with
`--discovery survey` no node has a seed and they find each other by SURVEY multicast pinned to
127.0.0.1 (a random group and port per run, the default timings: the default discovery alone).
`--discovery both` measures each size both ways, seeded first, and sets the two side by side:
convergence after the last start, and the ratio of their idle CPU per node (zero configuration's
over the seeded). Processes start a few at a time (`--spawn-batch` still importing at once), so
that N Python start-ups do not thrash the machine.

Figures per size:
- startup: from the first spawn until the last node printed READY;
- full membership: until every node knows all N-1 others as peers, counted from the last READY
  (the mesh's own convergence) and from the first spawn;
- idle: after convergence and `--settle` seconds, the CPU each node used over `--window`
  seconds (utime + stime from /proc/PID/stat, in % of one core), the whole mesh's CPU, RSS per
  node, how busy the whole machine was meanwhile (/proc/stat), and the false deaths over a
  `--hold` seconds idle period (peers declared dead or gone while nothing failed);
- crash detection (`--kills` times, a different victim each): a client calls one cluster at
  `--rate` requests/s in a closed loop, every node watches that cluster at 20 Hz, the parent
  SIGKILLs one of its members; how long until the client stops choosing it (it leaves the
  client's `members()`), whether a request failed, and when each surviving node knew it dead
  (median, p90, max: known dead by every node).
Then how each figure grows from one size to the next (20/10, 40/20) and to each size from the
first one.

Children die with the parent: stdin EOF, PR_SET_PDEATHSIG, a hard timeout; the parent stops
them all in a `finally`, on Ctrl-C too. A child reports on stdout in lines; the parent sends it
commands on stdin (`probe`, `mark`, `check`, `call`, `stopcall`, `watch`, `unwatch`). Nothing
looks at membership often unless told to: at most 4 times a second until a node is converged
(waiting inside `wait_for_members` in between), never after that but for the parent's checks,
20 times a second only between `watch` and `unwatch`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import _harness as harness

CLUSTER_PREFIX = "bench-"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
SATURATED = 90.0  # % of the whole machine busy: CPU figures are capped, not measured
CPU_GROWTH_TARGET = 1.3  # per-node idle CPU, largest size over smallest: the aim of the design
ZERO_CONFIG_CPU_TARGET = 1.2  # idle CPU per node with no seeds over that with seeds
ZERO_CONFIG_CONVERGENCE_TARGET = 2.0  # seconds from the last start, with no seeds
WATCH_HZ = 20.0  # how often a node looks for the victim while told to watch
# What an idle mesh still does, counted over the idle hold: links opened, and discovery's
# questions, answers and candidates passed on to be dialled.
ACTIVITY = (
    "dials",
    "links_idle_closed",
    "survey_questions_sent",
    "survey_answers_sent",
    "survey_answers_withheld",
    "survey_candidates_passed",
)
CHECK_EVERY = 10.0  # seconds between the parent's progress checks during the hold
PAYLOAD = b"x" * 100


# ============================================================================================
# Child: one node (a member of one cluster, or a pure client)


def cluster_name(index: int) -> str:
    return f"{CLUSTER_PREFIX}{index}"


def layout(members: int, clusters: int) -> list[int]:
    """How many members each cluster has: member i serves cluster i % clusters."""
    return [len(range(c, members, clusters)) for c in range(clusters)]


class Agent:
    """A node's side of the protocol with the parent: convergence, then commands."""

    def __init__(self, node: Any, irismesh: Any, args: argparse.Namespace) -> None:
        self.node = node
        self.irismesh = irismesh
        self.args = args
        sizes = layout(args.members, args.clusters)
        own = args.cluster
        # Members of each cluster this node must see (itself excluded).
        self.expected = {
            cluster_name(c): n - (cluster_name(c) == own) for c, n in enumerate(sizes) if n
        }
        self.mark: dict[str, int] = {}
        self.watch_task: asyncio.Task[None] | None = None
        self.call_stop: asyncio.Event | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def counters(self) -> dict[str, int]:
        keep = (
            "members_suspected",
            "suspicions_refuted",
            "requests_resent",
            "requests_migrated",
            "requests_parked",
            "requests_unparked",
            "links_down_disconnected",
            *ACTIVITY,
        )
        return {
            k: int(v)
            for k, v in self.node.stats.items()
            if v and (k.startswith("peers_down_") or k in keep)
        }

    async def converge(self) -> None:
        """Until membership knows all N-1 others; nothing once converged.

        Convergence is membership's alone: the node waits on membership changes and opens no
        link (a node links only to the members it calls), so the idle mesh measured next holds
        the links an idle mesh holds: none but the few its joins left.
        """
        node, target = self.node, self.args.expect
        last = -1
        while True:
            live = len(node.peers())
            if live >= target:
                harness.emit("full", at=time.monotonic(), peers=live)
                return
            if live != last:
                harness.emit("count", peers=live)
                last = live
            with contextlib.suppress(self.irismesh.MembershipTimeout):
                await node.wait_for_peers(live + 1, timeout=1.0)

    def command(self, line: str) -> None:
        words = line.split()
        if not words:
            return
        verb, rest = words[0], words[1:]
        if verb == "probe":
            self.spawn(self.probe())
        elif verb == "mark":
            self.mark = self.counters()
        elif verb == "check":
            self.check(int(rest[0]))
        elif verb == "call":
            if self.call_stop is not None:
                self.call_stop.set()  # one loop at a time: an earlier one ends and reports
            self.call_stop = stop = asyncio.Event()
            self.spawn(self.call(int(rest[0]), rest[1], float(rest[2]), stop))
        elif verb == "stopcall" and self.call_stop is not None:
            self.call_stop.set()  # the loop ends after the request in flight and reports
            self.call_stop = None
        elif verb == "watch":
            if self.watch_task is not None:
                self.watch_task.cancel()
            self.watch_task = self.spawn(self.watch(int(rest[0]), rest[1], rest[2]))
        elif verb == "unwatch" and self.watch_task is not None:
            self.watch_task.cancel()
            self.watch_task = None

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def probe(self) -> None:
        """One request to every cluster: each has a member that answers."""
        ok, errors = 0, Counter[str]()
        for cluster in self.expected:
            try:
                await self.node.request(cluster, PAYLOAD, timeout=self.args.request_timeout)
                ok += 1
            except self.irismesh.MeshError as exc:
                errors[type(exc).__name__] += 1
        harness.emit("probed", ok=ok, failed=sum(errors.values()), errors=dict(errors))

    def check(self, seq: int) -> None:
        live = self.node.peers()
        departed = [p for p in self.node.peers(departed=True) if p.state in ("dead", "left")]
        now = self.counters()
        delta = {k: v - self.mark.get(k, 0) for k, v in now.items() if v != self.mark.get(k, 0)}
        harness.emit(
            "check",
            seq=seq,
            peers=len(live),
            suspect=sum(p.state == "suspect" for p in live),
            departed=len(departed),
            delta=delta,
        )

    async def call(self, seq: int, cluster: str, rate: float, stop: asyncio.Event) -> None:
        """A steady closed loop: one request at a time, paced at `rate` a second."""
        node, errors = self.node, Counter[str]()
        before = self.counters()
        latencies: list[float] = []
        interval = 1.0 / rate
        began_calls = next_at = time.monotonic()
        while not stop.is_set():
            began = time.monotonic()
            try:
                await node.request(cluster, PAYLOAD, timeout=self.args.request_timeout)
                latencies.append(time.monotonic() - began)
                if len(latencies) == 1:
                    harness.emit("calling", seq=seq)
            except self.irismesh.MeshError as exc:
                errors[type(exc).__name__] += 1
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:  # behind (a slow request): carry on from now, no burst to catch up
                next_at = time.monotonic()
        after = self.counters()
        ordered = sorted(latencies)
        harness.emit(
            "calls",
            seq=seq,
            ok=len(latencies),
            failed=sum(errors.values()),
            seconds=time.monotonic() - began_calls,
            errors=dict(errors),
            p50_ms=harness.percentile(ordered, 50) * 1000 if ordered else None,
            max_ms=ordered[-1] * 1000 if ordered else None,
            over_100ms=sum(v > 0.1 for v in ordered),
            resent=after.get("requests_resent", 0) - before.get("requests_resent", 0),
            migrated=after.get("requests_migrated", 0) - before.get("requests_migrated", 0),
            # Parked: no member linked when a request was sent or had to move; unparked when
            # a link to one came up.
            parked=after.get("requests_parked", 0) - before.get("requests_parked", 0),
            unparked=after.get("requests_unparked", 0) - before.get("requests_unparked", 0),
        )

    def alive(self, victim: str) -> str | None:
        """None while `victim` is alive (or suspect) for this node; else how it looks ("dead",
        "left", or "absent": forgotten). One lookup: watching costs little in a big mesh."""
        state = self.node.peer_state(victim)
        if state in ("alive", "suspect"):
            return None
        return state or "absent"

    async def watch(self, seq: int, cluster: str, victim: str) -> None:
        before = self.counters()
        harness.emit("watching", seq=seq)
        # Every node looks at its own phase: the times are late by 0 to one period each, not
        # all by the same amount.
        await asyncio.sleep(random.uniform(0.0, 1.0 / WATCH_HZ))
        # Only the node calling the cluster routes to it: the others watch membership alone
        # (asking the others for the cluster's members would link them all to it).
        routed = self.call_stop is not None
        while True:
            if routed and victim not in self.node.members(cluster):
                # Out of this node's routing for the cluster: no request goes to it any more.
                routed = False
                harness.emit("unrouted", seq=seq, at=time.monotonic())
            state = self.alive(victim)
            if state is not None:
                at = time.monotonic()
                # How it learnt: the peers_down_<reason> counters that moved meanwhile.
                how = [
                    k.removeprefix("peers_down_")
                    for k, v in self.counters().items()
                    if k.startswith("peers_down_") and v > before.get(k, 0)
                ]
                harness.emit("gone", seq=seq, at=at, state=state, how=how)
                return
            await asyncio.sleep(1.0 / WATCH_HZ)


async def run_node(args: argparse.Namespace) -> None:
    import irismesh

    keys = irismesh.Keyring.load(args.keyring)
    survey: bool | irismesh.SurveyConfig = False
    if args.survey:
        group, port, realm = args.survey.split(",")
        survey = irismesh.SurveyConfig(
            group=group, port=int(port), interface="127.0.0.1", realm=bytes.fromhex(realm)
        )
    node = irismesh.Node(
        args.cluster, keyring=keys, bind="tcp://127.0.0.1:0", seeds=args.seed, survey=survey
    )
    async with node:
        if args.cluster:

            @node.on_request
            def echo(payload: bytes) -> bytes:
                return payload

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        agent = Agent(node, irismesh, args)
        harness.on_stdin_lines(
            lambda line: loop.call_soon_threadsafe(agent.command, line),
            lambda: loop.call_soon_threadsafe(stop.set),
        )
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print(f"READY {node.endpoint} {node.node_id.hex()} {time.monotonic()!r}", flush=True)
        converging = agent.spawn(agent.converge())
        await stop.wait()
        for task in (converging, *agent.tasks):
            task.cancel()


# ============================================================================================
# Parent


def proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds used, RSS bytes) of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; fields[0] is state
    utime, stime, rss_pages = int(fields[11]), int(fields[12]), int(fields[21])
    return (utime + stime) / CLK_TCK, rss_pages * PAGE


def rss_anon(pid: int) -> int:
    """Private (anonymous) resident bytes of a process: RSS without the shared libraries and
    files, which every node maps and the kernel keeps once."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user
    return (total - idle) / CLK_TCK, total / CLK_TCK


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "total": sum(values),
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": ordered[0],
        "median": harness.percentile(ordered, 50),
        "p90": harness.percentile(ordered, 90),
        "max": ordered[-1],
    }


@dataclass(kw_only=True, slots=True)
class Node:
    name: str
    child: harness.Child
    cluster: str | None  # None: a pure client
    seed: bool = False
    node_id: str = ""
    endpoint: str = ""
    ready_at: float | None = None
    full_at: float | None = None
    peers: int = 0
    killed: bool = False
    events: dict[str, dict[str, Any]] = field(default_factory=dict)  # the latest of each kind

    def tell(self, line: str) -> None:
        """Send a command line; a node that is gone is skipped (its own line says so)."""
        stdin = self.child.proc.stdin
        if self.killed or stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            stdin.write(line.encode() + b"\n")
            stdin.flush()

    def got(self, kind: str, seq: int | None = None) -> dict[str, Any] | None:
        event = self.events.get(kind)
        if event is None or (seq is not None and event.get("seq") != seq):
            return None
        return event


def drain(nodes: Sequence[Node]) -> None:
    """Take every line the nodes have printed so far, without blocking."""
    for node in nodes:
        if node.killed:
            continue
        while True:
            line = node.child.next_line(0.0)
            if line is None:
                break
            if line.startswith("READY "):
                endpoint, node_id, at = line.split()[1:4]
                node.endpoint, node.node_id, node.ready_at = endpoint, node_id, float(at)
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event")
            if kind == "full":
                node.full_at = float(event["at"])
                node.peers = int(event["peers"])
            elif kind == "count":
                node.peers = int(event["peers"])
            elif isinstance(kind, str):
                node.events[kind] = event


def every(seconds: float, show: Callable[[float], None]) -> Callable[[float], None]:
    """`show(now)` at most once per `seconds`, however often the result is called."""
    last = time.monotonic()

    def tick(now: float) -> None:
        nonlocal last
        if now - last >= seconds:
            last = now
            show(now)

    return tick


def wait_for(
    nodes: Sequence[Node],
    done: Callable[[], bool],
    deadline: float,
    *,
    poll: float = 0.05,
    tick: Callable[[float], None] | None = None,
) -> bool:
    """Drain the nodes' lines until `done()` or `deadline`, calling `tick(now)` meanwhile."""
    while True:
        drain(nodes)
        if done():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if tick is not None:
            tick(now)
        time.sleep(min(poll, max(0.0, deadline - now)))


class Run:
    """One size: its processes, in phases, filling `result`."""

    def __init__(
        self,
        procs: harness.ChildProcesses,
        size: int,
        args: argparse.Namespace,
        keyring: str,
        discovery: str,
    ) -> None:
        self.procs = procs
        self.size = size
        self.args = args
        self.clients = args.clients
        self.members = size - self.clients
        self.clusters = clusters_for(size, args)
        self.n_seeds = 0 if discovery == "survey" else min(args.seeds, self.members)
        self.timeout = float(args.timeout) if args.timeout else default_timeout(size)
        self.nodes: list[Node] = []
        self.rng = random.Random(size)
        self.base = [sys.executable, os.path.abspath(__file__), "--role", "node"]
        self.base += ["--keyring", keyring, "--expect", str(size - 1)]
        self.base += ["--members", str(self.members), "--clusters", str(self.clusters)]
        self.base += ["--request-timeout", str(args.request_timeout)]
        self.base += ["--max-seconds", f"{self.child_lifetime():.0f}"]
        if discovery == "survey":
            group = f"239.255.{random.randint(74, 250)}.{random.randint(1, 254)}"
            realm = os.urandom(16).hex()
            self.base += ["--survey", f"{group},{free_udp_port()},{realm}"]
        self.result: dict[str, Any] = {
            "nodes": size,
            "members": self.members,
            "clients": self.clients,
            "clusters": self.clusters,
            "cluster_sizes": layout(self.members, self.clusters),
            "seeds": self.n_seeds,
            "discovery": discovery,
            "timeout_s": self.timeout,
            "converged": False,
        }
        self.seq = itertools.count(1)

    def child_lifetime(self) -> float:
        """The children's hard timeout: every phase at its longest, and a margin."""
        a = self.args
        per_kill = float(a.lead + 10 + a.detect_timeout + a.request_timeout + 10 + a.gap)
        idle = float(a.settle + max(a.hold, a.window))
        return self.timeout + 15 + idle + 30 + int(a.kills) * per_kill + 120

    def live(self) -> list[Node]:
        return [n for n in self.nodes if not n.killed]

    # ------------------------------------------------------------------ phases

    def run(self) -> dict[str, Any]:
        self.start()
        if self.result.get("started"):
            self.converge()
        if not self.result.get("started"):
            return self.result
        if self.result["converged"]:
            self.probe()
        self.idle()
        if not self.result["converged"]:
            harness.progress("  crash detection skipped: the mesh never converged")
        elif self.args.kills:
            self.crashes()
        return self.result

    def spawn(self, index: int, seeds: Sequence[str]) -> Node:
        if index < self.members:
            name, cluster = f"node{index + 1}", cluster_name(index % self.clusters)
        else:
            name, cluster = f"client{index - self.members + 1}", None
        argv = [*self.base, *(["--cluster", cluster] if cluster else [])]
        argv += [arg for seed in seeds for arg in ("--seed", seed)]
        node = Node(name=name, child=self.procs.spawn(name, argv), cluster=cluster)
        node.seed = index < self.n_seeds
        self.nodes.append(node)
        return node

    def start(self) -> None:
        """Seeds first; then the clients and the other members, never more than --spawn-batch
        importing at once."""
        size, batch = self.size, max(1, self.args.spawn_batch)
        self.spawned = spawned = time.monotonic()
        self.deadline = spawned + self.timeout
        busy0, total0 = machine_busy()

        def ready() -> int:
            return sum(n.ready_at is not None for n in self.nodes)

        @functools.partial(every, 2.0)
        def tick(now: float) -> None:
            harness.progress(
                f"  {now - spawned:5.1f} s: {len(self.nodes)}/{size} spawned, {ready()} ready"
            )

        for i in range(self.n_seeds):
            self.spawn(i, ())
        wait_for(self.nodes, lambda: ready() == self.n_seeds, self.deadline, tick=tick)
        seeds = [n.endpoint for n in self.nodes if n.ready_at is not None]
        # Clients next, members last: a member's arrival ends the others' wait_for_members at
        # once, a client's only at their next look (up to 0.25 s), so "full" is timed closer.
        order = [*range(self.members, size), *range(self.n_seeds, self.members)]
        for i in order:
            if time.monotonic() >= self.deadline:
                break
            wait_for(
                self.nodes,
                lambda: len(self.nodes) - ready() < batch,
                self.deadline,
                poll=0.02,
                tick=tick,
            )
            self.spawn(i, seeds)
        wait_for(self.nodes, lambda: ready() == size, self.deadline, tick=tick)
        n_ready = ready()
        self.result["nodes_ready"] = n_ready
        busy1, total1 = machine_busy()
        busy = 100.0 * (busy1 - busy0) / max(1e-9, total1 - total0)
        self.result["startup_machine_busy_percent"] = busy
        if n_ready < size:
            harness.progress(
                f"  NOT started within {self.timeout:.0f} s: {len(self.nodes)}/{size} spawned, "
                f"{n_ready} ready, the machine {busy:.0f}% busy meanwhile: it cannot start this "
                "many nodes in time"
            )
            self.result["started"] = False
            return
        self.result["started"] = True
        self.last_ready = max(n.ready_at or 0.0 for n in self.nodes)
        self.result["startup_s"] = self.last_ready - spawned
        harness.progress(
            f"  {size} nodes ready {self.result['startup_s']:.1f} s after the first spawn (machine "
            f"{busy:.0f}% busy meanwhile)"
        )

    def converge(self) -> None:
        size, spawned = self.size, self.spawned

        @functools.partial(every, 2.0)
        def tick(now: float) -> None:
            full = sum(n.full_at is not None for n in self.nodes)
            fewest = min(n.peers for n in self.nodes)
            harness.progress(
                f"  {now - spawned:5.1f} s: {full}/{size} nodes know all {size - 1} others "
                f"(fewest peers known by a node: {fewest})"
            )

        def done() -> bool:
            return all(n.full_at is not None for n in self.nodes)

        wait_for(self.nodes, done, self.deadline, poll=0.1, tick=tick)
        full_at = [n.full_at for n in self.nodes if n.full_at is not None]
        self.result["nodes_full"] = len(full_at)
        if len(full_at) < size:
            fewest = min(n.peers for n in self.nodes)
            harness.progress(
                f"  NOT converged within {self.timeout:.0f} s of the first spawn: "
                f"{len(full_at)}/{size} nodes know all others, fewest peers known {fewest}"
            )
            return
        self.result["converged"] = True
        self.result["full_after_ready_s"] = max(0.0, max(full_at) - self.last_ready)
        self.result["full_after_spawn_s"] = max(full_at) - spawned
        harness.progress(
            f"  full membership {self.result['full_after_ready_s']:.2f} s after the last node "
            f"was ready ({self.result['full_after_spawn_s']:.2f} s after the first spawn)"
        )

    def probe(self) -> None:
        """Each client calls every cluster once: every cluster answers."""
        clients = [n for n in self.nodes if n.cluster is None]
        for n in clients:
            n.tell("probe")
        wait_for(
            self.nodes,
            lambda: all(n.got("probed") for n in clients),
            time.monotonic() + self.args.request_timeout * self.clusters + 5,
        )
        probes = [n.got("probed") or {"ok": 0, "failed": 0, "missing": True} for n in clients]
        self.result["probe"] = {
            "ok": sum(p["ok"] for p in probes),
            "failed": sum(p["failed"] for p in probes),
            "unanswered": sum("missing" in p for p in probes),
        }
        if clients:
            p = self.result["probe"]
            harness.progress(
                f"  {len(clients)} client(s) called each of {self.clusters} cluster(s) once: "
                f"{p['ok']} ok, {p['failed']} failed"
                + (f", {p['unanswered']} client(s) did not answer" if p["unanswered"] else "")
            )

    def checks(self, timeout: float) -> dict[str, Any]:
        """Ask every live node for its membership counters since `mark`; sum them up."""
        seq = next(self.seq)
        nodes = self.live()
        for n in nodes:
            n.tell(f"check {seq}")
        wait_for(
            self.nodes, lambda: all(n.got("check", seq) for n in nodes), time.monotonic() + timeout
        )
        down: Counter[str] = Counter()
        activity: Counter[str] = Counter()
        suspected = missing = affected = unanswered = 0
        for n in nodes:
            event = n.got("check", seq)
            if event is None:
                unanswered += 1
                continue
            delta = event["delta"]
            lost = 0
            for key, value in delta.items():
                if key.startswith("peers_down_"):
                    down[key.removeprefix("peers_down_")] += value
                    lost += value
            suspected += delta.get("members_suspected", 0)
            activity.update({key: delta.get(key, 0) for key in ACTIVITY})
            missing += max(0, self.size - 1 - event["peers"])
            affected += lost > 0 or event["peers"] < self.size - 1
        return {
            "false_deaths": sum(down.values()),
            "by_reason": dict(down),
            "missing_at_check": missing,
            "nodes_affected": affected,
            "suspicions": suspected,
            "unanswered": unanswered,
            "activity": dict(activity),
        }

    def idle(self) -> None:
        """Idle: CPU and RSS over --window, false deaths over --hold (the window included)."""
        args, size = self.args, self.size
        hold = max(args.hold, args.window) if self.result["converged"] else args.window
        if args.settle:
            wait_for(self.nodes, lambda: False, time.monotonic() + args.settle, poll=0.2)
        for n in self.nodes:
            n.tell("mark")
        pids = {n.name: n.child.pid for n in self.nodes}
        first = {name: proc_stat(pid) for name, pid in pids.items()}
        busy0, total0 = machine_busy()
        began = time.monotonic()
        harness.progress(
            f"  idle: CPU and RSS of {size} nodes over {args.window:.0f} s, false deaths over "
            f"{hold:.0f} s"
        )
        wait_for(self.nodes, lambda: False, began + args.window, poll=0.2)
        last = {name: proc_stat(pid) for name, pid in pids.items()}
        busy1, total1 = machine_busy()
        seconds = time.monotonic() - began
        cpu = [100.0 * (last[n][0] - first[n][0]) / seconds for n in pids]
        rss = [last[n][1] / harness.MB for n in pids]
        anon = [rss_anon(pid) / harness.MB for pid in pids.values()]
        r = self.result
        r["window_s"] = seconds
        r["cpu_percent_per_node"] = summary(cpu)
        r["rss_mb_per_node"] = summary(rss)
        r["rss_anon_mb_per_node"] = summary(anon)
        r["rss_anon_mb_total"] = sum(anon)
        r["mesh_cpu_cores"] = sum(cpu) / 100.0
        r["machine_busy_percent"] = 100.0 * (busy1 - busy0) / max(1e-9, total1 - total0)
        # The rest of the machine's work meanwhile, in % of the whole machine: well above zero
        # means something else ran (a test suite, another benchmark) and disturbed the figures.
        ours = r["cpu_percent_per_node"]["total"] / (os.cpu_count() or 1)
        r["others_busy_percent"] = max(0.0, r["machine_busy_percent"] - ours)
        r["saturated"] = r["machine_busy_percent"] >= SATURATED
        c, m = r["cpu_percent_per_node"], r["rss_mb_per_node"]
        if r["saturated"]:
            whose = (
                "mostly by other processes: the nodes may have got less CPU than they wanted"
                if r["others_busy_percent"] > ours
                else "the nodes wanted more CPU than there is"
            )
            harness.progress(
                f"  warning: the machine was {r['machine_busy_percent']:.0f}% busy, {whose}, so "
                "their CPU figures may be capped by the machine"
            )
        harness.progress(
            f"  CPU per node {c['mean']:.1f}% of a core (max {c['max']:.1f}%), whole mesh "
            f"{r['mesh_cpu_cores']:.2f} cores; RSS per node {m['mean']:.1f} MB (max "
            f"{m['max']:.1f}, private {r['rss_anon_mb_per_node']['mean']:.1f}, all nodes' "
            f"private {r['rss_anon_mb_total'] / 1024:.2f} GB); machine "
            f"{r['machine_busy_percent']:.0f}% busy "
            f"({r['others_busy_percent']:.0f}% by others)"
        )
        answer_within = 10.0 + size * 0.05
        while time.monotonic() < began + hold - 0.5:
            wait_for(
                self.nodes,
                lambda: False,
                min(began + hold, time.monotonic() + CHECK_EVERY),
                poll=0.2,
            )
            if time.monotonic() >= began + hold - 0.5:
                break
            so_far = self.checks(answer_within)
            harness.progress(
                f"  idle {time.monotonic() - began:4.0f}/{hold:.0f} s: false deaths so far "
                f"{so_far['false_deaths']}, suspicions {so_far['suspicions']}"
            )
        final = self.checks(answer_within)
        final["hold_s"] = time.monotonic() - began
        r["idle"] = final
        harness.progress(
            f"  false deaths in {final['hold_s']:.0f} s idle: {final['false_deaths']}"
            + (f" {final['by_reason']}" if final["by_reason"] else "")
            + f" ({final['nodes_affected']} nodes affected, {final['missing_at_check']} peers "
            f"missing at the end), suspicions {final['suspicions']}"
            + (f", {final['unanswered']} nodes did not answer" if final["unanswered"] else "")
        )
        harness.progress(
            "  meanwhile, all nodes together: "
            + ", ".join(f"{key} {value}" for key, value in final["activity"].items())
        )

    def pick_victim(self, k: int) -> Node | None:
        """A live non-seed member of cluster k % K (or the next cluster) with a live partner."""
        for step in range(self.clusters):
            cluster = cluster_name((k + step) % self.clusters)
            members = [n for n in self.live() if n.cluster == cluster]
            candidates = [n for n in members if not n.seed]
            if len(members) >= 2 and candidates:
                return self.rng.choice(candidates)
        return None

    def crashes(self) -> None:
        kills: list[dict[str, Any]] = []
        clients = [n for n in self.nodes if n.cluster is None]
        for k in range(self.args.kills):
            victim = self.pick_victim(k)
            if victim is None:
                harness.progress("  no member left to kill whose cluster keeps another member")
                break
            harness.progress(f"  kill {k + 1}/{self.args.kills}:")
            kills.append(self.crash(victim, clients[k % len(clients)]))
            wait_for(self.nodes, lambda: False, time.monotonic() + self.args.gap, poll=0.2)
        self.result["kills"] = kills
        if kills:
            self.result["crash"] = crash_summary(kills)

    def crash(self, victim: Node, caller: Node) -> dict[str, Any]:
        args = self.args
        seq = next(self.seq)
        cluster = victim.cluster
        assert cluster is not None
        out: dict[str, Any] = {"victim": victim.name, "cluster": cluster, "caller": caller.name}
        caller.tell(f"call {seq} {cluster} {args.rate:g}")
        if not wait_for(
            self.nodes, lambda: caller.got("calling", seq) is not None, time.monotonic() + 10
        ):
            harness.progress(f"    {caller.name} could not call {cluster}; the kill goes ahead")
        # A steady load before the kill.
        wait_for(self.nodes, lambda: False, time.monotonic() + args.lead, poll=0.1)
        survivors = [n for n in self.live() if n is not victim]
        for n in survivors:
            n.tell(f"watch {seq} {cluster} {victim.node_id}")
        wait_for(
            self.nodes,
            lambda: all(n.got("watching", seq) for n in survivors),
            time.monotonic() + 10 + 0.05 * len(survivors),
        )
        killed_at = time.monotonic()
        victim.child.proc.kill()
        victim.killed = True
        harness.progress(
            f"    SIGKILL {victim.name} ({cluster}) while {caller.name} calls it at "
            f"{args.rate:g}/s; {len(survivors)} survivors watching at {WATCH_HZ:.0f} Hz"
        )

        def seen() -> int:
            return sum(n.got("gone", seq) is not None for n in survivors)

        @functools.partial(every, 1.0)
        def tick(now: float) -> None:
            harness.progress(
                f"    {now - killed_at:4.1f} s: {seen()}/{len(survivors)} know it is dead"
            )

        wait_for(
            self.nodes,
            lambda: seen() == len(survivors),
            killed_at + args.detect_timeout,
            poll=0.05,
            tick=tick,
        )
        caller.tell(f"stopcall {seq}")
        for n in survivors:
            n.tell("unwatch")
        wait_for(
            self.nodes,
            lambda: caller.got("calls", seq) is not None,
            time.monotonic() + args.request_timeout + 5,
        )
        with contextlib.suppress(Exception):
            victim.child.proc.wait(timeout=5)
        times = [
            float(event["at"]) - killed_at
            for n in survivors
            if (event := n.got("gone", seq)) is not None
        ]
        states = Counter(str(e["state"]) for n in survivors if (e := n.got("gone", seq)))
        how = Counter(
            "+".join(e["how"]) or "unknown" for n in survivors if (e := n.got("gone", seq))
        )
        gone = caller.got("unrouted", seq) or caller.got("gone", seq)
        out.update(
            {
                "survivors": len(survivors),
                "detected": len(times),
                "undetected": len(survivors) - len(times),
                "states": dict(states),
                "learnt_by": dict(how),  # peers_down reasons counted as each node learnt it
                "known_dead_s": spread(times) if times else None,
                "caller_drops_it_s": float(gone["at"]) - killed_at if gone else None,
                "calls": caller.got("calls", seq),
            }
        )
        known = out["known_dead_s"]
        calls = out["calls"] or {}
        harness.progress(
            "    "
            + (
                f"{caller.name} stopped choosing it after {out['caller_drops_it_s']:.2f} s"
                if gone
                else f"{caller.name} still listed it after {args.detect_timeout:.0f} s"
            )
            + (
                f"; requests {calls['ok']} ok, {calls['failed']} failed "
                f"({(calls['ok'] + calls['failed']) / calls['seconds']:.0f}/s achieved), "
                f"slowest {calls['max_ms']:.0f} ms, {calls['resent']} resent, "
                f"{calls.get('unparked', 0)} waited for a link"
                if calls and calls.get("max_ms") is not None
                else "; no report of its requests"
            )
        )
        if known is not None:
            harness.progress(
                f"    known dead: median {known['median']:.2f} s, p90 {known['p90']:.2f} s, "
                + (
                    f"by every node {known['max']:.2f} s"
                    if not out["undetected"]
                    else f"{out['undetected']} nodes still not after {args.detect_timeout:.0f} s"
                )
                + f" (learnt by: {', '.join(f'{k} {v}' for k, v in how.items())})"
            )
        return out


def crash_summary(kills: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the kills of each kill's figures; request counts are summed."""

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    known = [k["known_dead_s"] for k in kills]
    calls = [k["calls"] or {} for k in kills]
    every = [None if k["undetected"] else (k["known_dead_s"] or {}).get("max") for k in kills]
    slowest = [float(c["max_ms"]) for c in calls if c.get("max_ms") is not None]
    return {
        "kills": len(kills),
        "caller_drops_it_s": med([k["caller_drops_it_s"] for k in kills]),
        "caller_drops_it_max_s": max(
            (k["caller_drops_it_s"] for k in kills if k["caller_drops_it_s"] is not None),
            default=None,
        ),
        "detect_median_s": med([k["median"] if k else None for k in known]),
        "detect_p90_s": med([k["p90"] if k else None for k in known]),
        "detect_max_s": med([k["max"] if k else None for k in known]),
        "known_dead_by_every_node_s": med(every),
        "undetected": sum(k["undetected"] for k in kills),
        "requests_ok": sum(c.get("ok", 0) for c in calls),
        "requests_failed": sum(c.get("failed", 0) for c in calls),
        "requests_unreported": sum(not c for c in calls),
        "slowest_request_ms": max(slowest) if slowest else None,
        "requests_resent": sum(c.get("resent", 0) for c in calls),
        "requests_per_s": med(
            [(c["ok"] + c["failed"]) / c["seconds"] if c.get("seconds") else None for c in calls]
        ),
    }


def clusters_for(size: int, args: argparse.Namespace) -> int:
    members = size - int(args.clients)
    wanted = int(args.clusters) if args.clusters else round(size / 10)
    return max(1, min(wanted, members))


def default_timeout(size: int) -> float:
    """Startup + convergence allowance: 60 s, more for big meshes (staggered start-ups)."""
    return max(60.0, 0.8 * size)


def measure(size: int, args: argparse.Namespace, keyring: str, discovery: str) -> dict[str, Any]:
    with harness.ChildProcesses() as procs:
        run = Run(procs, size, args, keyring, discovery)
        try:
            return run.run()
        finally:
            stop_all_at_once(run.nodes)


def stop_all_at_once(nodes: Sequence[Node], grace: float = 10.0) -> None:
    """Close every stdin (each node leaves), give them `grace` seconds together, then SIGTERM
    and SIGKILL whoever is left, all at once: one by one, a saturated machine would take
    minutes. ChildProcesses then reaps them."""
    started = time.monotonic()
    harness.progress(f"  stopping {len(nodes)} nodes")
    for node in nodes:
        with contextlib.suppress(OSError, ValueError):
            if node.child.proc.stdin is not None:
                node.child.proc.stdin.close()
    for sig, wait in ((None, grace), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        running = [n for n in nodes if n.child.proc.poll() is None]
        if not running:
            break
        if sig is not None:
            for n in running:
                with contextlib.suppress(ProcessLookupError):
                    n.child.proc.send_signal(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(n.child.proc.poll() is None for n in running):
            time.sleep(0.05)
    left = sum(n.child.proc.poll() is None for n in nodes)
    harness.progress(
        f"  stopped in {time.monotonic() - started:.1f} s"
        + (f"; {left} still running, killed one by one next" if left else "")
    )


GROWTH = {
    "full membership after last READY (s)": ("full_after_ready_s", None),
    "startup (s)": ("startup_s", None),
    "CPU per node (% of a core)": ("cpu_percent_per_node", "mean"),
    "CPU of the whole mesh (cores)": ("mesh_cpu_cores", None),
    "RSS per node (MB)": ("rss_mb_per_node", "mean"),
    "private RSS per node (MB)": ("rss_anon_mb_per_node", "mean"),
    "known dead by every node (s)": ("crash", "known_dead_by_every_node_s"),
}


# Figures set side by side in the comparison: (label, key in a result, sub-key).
COMPARED = (
    ("startup_s", "startup_s", None),
    ("full_after_ready_s", "full_after_ready_s", None),
    ("cpu_percent_per_node", "cpu_percent_per_node", "mean"),
    ("mesh_cpu_cores", "mesh_cpu_cores", None),
    ("false_deaths", "idle", "false_deaths"),
    ("known_dead_s", "crash", "known_dead_by_every_node_s"),
    ("machine_busy_percent", "machine_busy_percent", None),
)


def figure(result: dict[str, Any], key: str, sub: str | None) -> float | None:
    value = result.get(key)
    if isinstance(value, dict) and sub is not None:
        value = value.get(sub)
    return float(value) if isinstance(value, int | float) else None


def growth(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each figure at size b over the same figure at size a, as 'b/a': from one size to the
    next, then from the first size to each size beyond the second."""
    pairs = list(itertools.pairwise(results))
    pairs += [(results[0], b) for b in results[2:]]
    out: dict[str, dict[str, float | None]] = {}
    for a, b in pairs:
        step = f"{b['nodes']}/{a['nodes']}"
        out[step] = {}
        for label, (key, sub) in GROWTH.items():
            x, y = figure(a, key, sub), figure(b, key, sub)
            out[step][label] = y / x if x and y is not None else None
    return out


def fmt(value: Any, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def modes(discovery: str) -> tuple[str, ...]:
    """The ways of joining a `--discovery` choice measures, in the order they run per size."""
    return ("seeds", "survey") if discovery == "both" else (discovery,)


def print_report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console

    out = sys.stderr if args.json == "-" else sys.stdout  # stdout then carries the JSON
    console = Console(file=out) if out.isatty() else Console(file=out, width=160)
    for mode in modes(args.discovery):
        print_mode(console, [r for r in results if r.get("discovery") == mode], args, mode)
    if args.discovery == "both":
        print_comparison(console, results)


def print_mode(
    console: Any, results: list[dict[str, Any]], args: argparse.Namespace, mode: str
) -> None:
    """The tables of one way of joining: each size, its crashes, the growth between sizes."""
    from rich.table import Table
    from rich.text import Text

    how = "no seeds, survey on 127.0.0.1" if mode == "survey" else f"{args.seeds} seed(s) + gossip"
    table = Table(
        title=f"irismesh at scale: N node processes on 127.0.0.1, {how}, {os.cpu_count()} CPUs",
        caption="K/C: clusters / pure clients among the N; full: every node knows all N-1 "
        f"others; CPU and RSS per node over {args.window:.0f} s idle (mean \\[max]), CPU in % "
        "of one core, the whole mesh's in cores; (private): mean RSS without shared libraries "
        "and files; machine busy: % of all CPUs, (others): used "
        "by other processes meanwhile; false deaths: peers declared down while nothing failed "
        "(nodes affected), over the idle hold",
    )
    for column in (
        "N",
        "K/C",
        "startup s",
        "full after last READY s",
        "full after spawn s",
        "CPU/node %",
        "mesh CPU cores",
        "RSS/node MB (private)",
        "machine busy (others)",
        "false deaths (nodes) in hold",
        "suspicions",
    ):
        table.add_column(column, justify="right")
    for r in results:
        if r.get("failed"):
            table.add_row(str(r["nodes"]), "-", Text(r["failed"]))
            continue
        if not r.get("started"):
            table.add_row(
                str(r["nodes"]),
                f"{r['clusters']}/{r['clients']}",
                Text(f"> {r['timeout_s']:.0f} ({r.get('nodes_ready', 0)} ready)"),
                *["-"] * 5,
                Text(f"{r['startup_machine_busy_percent']:.0f}% at startup"),
            )
            continue
        if not r.get("converged"):
            full = f"not in {r['timeout_s']:.0f} s ({r.get('nodes_full', 0)}/{r['nodes']})"
            after_spawn = "-"
        else:
            full = f"{r['full_after_ready_s']:.2f}"
            after_spawn = f"{r['full_after_spawn_s']:.2f}"
        c, m, idle = r.get("cpu_percent_per_node"), r.get("rss_mb_per_node"), r.get("idle")
        row = [
            str(r["nodes"]),
            f"{r['clusters']}/{r['clients']}",
            fmt(r.get("startup_s"), ".1f"),
            full,
            after_spawn,
            f"{c['mean']:.1f} [{c['max']:.1f}]" if c else "-",
            fmt(r.get("mesh_cpu_cores")),
            f"{m['mean']:.1f} [{m['max']:.1f}] ({r['rss_anon_mb_per_node']['mean']:.1f})"
            if m
            else "-",
            (
                f"{r['machine_busy_percent']:.0f}% ({r['others_busy_percent']:.0f}%)"
                + (" saturated" if r["saturated"] else "")
            )
            if c
            else "-",
            f"{idle['false_deaths']} ({idle['nodes_affected']}) in {idle['hold_s']:.0f} s"
            if idle
            else "-",
            str(idle["suspicions"]) if idle else "-",
        ]
        table.add_row(*(Text(cell) for cell in row))  # Text: "[max]" is not markup
    console.print(table)

    crashed = [r for r in results if r.get("crash")]
    if crashed:
        crash = Table(
            title=f"crash detection: SIGKILL of a member while a client calls its cluster at "
            f"{args.rate:g} requests/s (medians over the kills)",
            caption="caller drops it: until the victim left the calling client's members() "
            "(median \\[max]); requests: the client's over the episodes, at the rate it achieved "
            "(a closed loop falls behind when the machine is saturated); known dead: from the "
            "kill until each surviving node saw the victim dead or gone; by every node: the last "
            "of them",
        )
        for column in (
            "N",
            "kills",
            "caller drops it s",
            "requests ok / failed",
            "slowest request ms",
            "resent",
            "known dead median s",
            "p90 s",
            "by every node s",
            "undetected",
        ):
            crash.add_column(column, justify="right")
        for r in crashed:
            s = r["crash"]
            row = [
                str(r["nodes"]),
                str(s["kills"]),
                f"{fmt(s['caller_drops_it_s'])} [{fmt(s['caller_drops_it_max_s'])}]",
                f"{s['requests_ok']} / {s['requests_failed']} at "
                f"{fmt(s['requests_per_s'], '.0f')}/s"
                + (f" ({s['requests_unreported']} unreported)" if s["requests_unreported"] else ""),
                fmt(s["slowest_request_ms"], ".0f"),
                str(s["requests_resent"]),
                fmt(s["detect_median_s"]),
                fmt(s["detect_p90_s"]),
                fmt(s["known_dead_by_every_node_s"], ".2f", "not all"),
                str(s["undetected"]),
            ]
            crash.add_row(*(Text(cell) for cell in row))
        console.print(crash)

    ratios = growth([r for r in results if r.get("cpu_percent_per_node")])
    if ratios:
        grow = Table(title="growth: figure at N_b / at N_a")
        grow.add_column("figure")
        for step in ratios:
            grow.add_column(step, justify="right")
        for label in GROWTH:
            cells = [ratios[step][label] for step in ratios]
            grow.add_row(label, *("-" if v is None else f"{v:.2f}x" for v in cells))
        console.print(grow)
        measured = [r for r in results if r.get("cpu_percent_per_node")]
        first = measured[0]
        for r in measured[1:]:
            ratio = figure(r, "cpu_percent_per_node", "mean") or 0.0
            base = figure(first, "cpu_percent_per_node", "mean") or 0.0
            if base:
                verdict = "within" if ratio / base <= CPU_GROWTH_TARGET else "above"
                capped = " (saturated: may be understated)" if r["saturated"] else ""
                console.print(
                    f"idle CPU per node at {r['nodes']} nodes is {ratio / base:.2f}x that at "
                    f"{first['nodes']}{capped}: {verdict} the design's target of at most "
                    f"{CPU_GROWTH_TARGET:.1f}x"
                )
    if any(r.get("saturated") for r in results):
        console.print(
            "saturated: the whole machine was busy during that window (by the nodes, or by "
            "others), so the nodes may have got less CPU than they wanted; per-node CPU there "
            "(and ratios to it) may understate the cost"
        )


def comparison(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size measured both ways: the zero-configuration run's figures beside the seeded
    one's, and the ratio of their idle CPU per node."""
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_size.setdefault(int(r["nodes"]), {})[str(r.get("discovery"))] = r
    rows = []
    for size, runs in sorted(by_size.items()):
        seeded, zero = runs.get("seeds", {}), runs.get("survey", {})
        row: dict[str, Any] = {"nodes": size}
        for label, key, sub in COMPARED:
            row[label] = {"seeds": figure(seeded, key, sub), "survey": figure(zero, key, sub)}
        cpu = row["cpu_percent_per_node"]
        row["cpu_ratio"] = cpu["survey"] / cpu["seeds"] if cpu["seeds"] and cpu["survey"] else None
        row["saturated"] = bool(seeded.get("saturated") or zero.get("saturated"))
        row["unfinished"] = {"seeds": unfinished(seeded), "survey": unfinished(zero)}
        rows.append(row)
    return rows


def unfinished(result: dict[str, Any]) -> str | None:
    """Why a run has no convergence figure, in a few words; None if it has one."""
    if not result:
        return "not run"
    if result.get("failed"):
        return "failed"
    if not result.get("started"):
        return f"not started in {result['timeout_s']:.0f} s ({result.get('nodes_ready', 0)} ready)"
    if not result.get("converged"):
        return f"not converged in {result['timeout_s']:.0f} s"
    return None


def print_comparison(console: Any, results: list[dict[str, Any]]) -> None:
    from rich.table import Table
    from rich.text import Text

    rows = comparison(results)
    table = Table(
        title="zero configuration against seeds: the same N, one after the other in this run",
        caption="each cell: seeded / zero-configuration (no seeds, survey discovery alone); "
        "startup: first spawn to the last node ready (the nodes already running compete with "
        "those starting); full: every node knows all N-1 others, after the last node was ready; "
        "idle CPU per "
        "node in % of one core (mean); ratio: zero-configuration's idle CPU per node over the "
        "seeded run's",
    )
    for column in (
        "N",
        "startup s",
        "full after last READY s",
        "CPU/node %",
        "ratio",
        "mesh CPU cores",
        "false deaths in hold",
        "known dead by every node s",
        "machine busy %",
    ):
        table.add_column(column, justify="right")

    def pair(values: dict[str, float | None], spec: str) -> str:
        return f"{fmt(values['seeds'], spec)} / {fmt(values['survey'], spec)}"

    def full(row: dict[str, Any]) -> str:
        figures, why = row["full_after_ready_s"], row["unfinished"]
        return " / ".join(why[mode] or fmt(figures[mode], ".2f") for mode in ("seeds", "survey"))

    for row in rows:
        table.add_row(
            *(
                Text(cell)
                for cell in (
                    str(row["nodes"]),
                    pair(row["startup_s"], ".0f"),
                    full(row),
                    pair(row["cpu_percent_per_node"], ".2f"),
                    fmt(row["cpu_ratio"], ".2f") + "x" * (row["cpu_ratio"] is not None),
                    pair(row["mesh_cpu_cores"], ".2f"),
                    pair(row["false_deaths"], ".0f"),
                    pair(row["known_dead_s"], ".2f"),
                    pair(row["machine_busy_percent"], ".0f"),
                )
            )
        )
    console.print(table)
    for row in rows:
        converged, ratio = row["full_after_ready_s"]["survey"], row["cpu_ratio"]
        if converged is not None:
            verdict = "within" if converged <= ZERO_CONFIG_CONVERGENCE_TARGET else "above"
            console.print(
                f"{row['nodes']} nodes with no seeds knew each other {converged:.2f} s after the "
                f"last start: {verdict} the target of {ZERO_CONFIG_CONVERGENCE_TARGET:.0f} s"
            )
        elif row["unfinished"]["survey"]:
            console.print(f"{row['nodes']} nodes with no seeds: {row['unfinished']['survey']}")
        if ratio is not None:
            verdict = "within" if ratio <= ZERO_CONFIG_CPU_TARGET else "above"
            capped = " (saturated: may be understated)" if row["saturated"] else ""
            console.print(
                f"{row['nodes']} nodes idle with no seeds cost {ratio:.2f}x the seeded run's CPU "
                f"per node{capped}: {verdict} the target of at most {ZERO_CONFIG_CPU_TARGET:.1f}x"
            )


def parse_sizes(text: str, clients: int) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--sizes wants comma-separated integers, got {text!r}") from None
    if not sizes or any(n < clients + 2 for n in sizes):
        raise SystemExit(f"--sizes: every size must be at least --clients + 2 = {clients + 2}")
    return sizes


def measure_size(
    i: int,
    sizes: list[int],
    mode: str,
    failed_at: int | None,
    args: argparse.Namespace,
    keyring: str,
) -> dict[str, Any]:
    """One size joined one way; skipped when a smaller size joined that way did not converge."""
    size = sizes[i]
    if failed_at is not None and size >= failed_at:
        harness.progress(
            f"[{i + 1}/{len(sizes)}] {size} nodes ({mode}): skipped, {failed_at} did not "
            "converge and a bigger mesh on this machine will not either"
        )
        return {
            "nodes": size,
            "discovery": mode,
            "failed": f"skipped: {failed_at} nodes did not converge",
        }
    k = clusters_for(size, args)
    harness.progress(
        f"[{i + 1}/{len(sizes)}] {size} nodes: {size - args.clients} members in {k} "
        f"cluster(s), {args.clients} client(s) ({mode})"
    )
    try:
        return measure(size, args, keyring, mode)
    except harness.ChildFailed as exc:
        harness.progress(f"  FAILED: {exc}")
        return {"nodes": size, "discovery": mode, "failed": f"{exc.name}: {exc.reason}"}
    except harness.BenchError as exc:
        harness.progress(f"  FAILED: {exc}")
        return {"nodes": size, "discovery": mode, "failed": str(exc)}


def main_parent(args: argparse.Namespace) -> int:
    import irismesh

    harness.raise_keyboard_interrupt_on_sigterm()
    limit = harness.raise_fd_limit()  # the children inherit it; each raises it again for itself
    sizes = parse_sizes(args.sizes, args.clients)
    if args.kills and not args.clients:
        raise SystemExit("--kills needs a client to call the victim's cluster: --clients 1 or more")
    if limit < 3 * max(sizes) + 64:
        harness.progress(
            f"warning: only {limit} open files allowed; {max(sizes)} nodes may run out"
        )
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    status = 0
    with tempfile.TemporaryDirectory(prefix="irismesh-scale-") as tmp:
        keyring = os.path.join(tmp, "scale.keys")
        irismesh.Keyring.generate().save(keyring)
        try:
            failed_at: dict[str, int] = {}  # per way of joining: the smallest size that failed
            for i, size in enumerate(sizes):
                for mode in modes(args.discovery):
                    result = measure_size(i, sizes, mode, failed_at.get(mode), args, keyring)
                    results.append(result)
                    if not result.get("converged"):
                        status = 1
                        failed_at[mode] = min(size, failed_at.get(mode, size))
        except KeyboardInterrupt:
            harness.progress("interrupted; every node process has been stopped")
            return 130
    elapsed = time.monotonic() - started
    print_report(results, args)
    if args.json:
        document = {
            "facts": {**harness.machine_facts(), "open_files_limit": limit},
            "settings": {
                "sizes": sizes,
                "clusters": args.clusters or "auto (N/10)",
                "clients": args.clients,
                "discovery": args.discovery,
                "seeds": args.seeds,
                "spawn_batch": args.spawn_batch,
                "settle_s": args.settle,
                "window_s": args.window,
                "hold_s": args.hold,
                "kills": args.kills,
                "rate": args.rate,
                "lead_s": args.lead,
                "detect_timeout_s": args.detect_timeout,
                "request_timeout_s": args.request_timeout,
                "timeout_s": args.timeout or "auto",
            },
            "results": results,
            "growth": growth([r for r in results if r.get("cpu_percent_per_node")])
            if args.discovery != "both"
            else {
                mode: growth(
                    [r for r in results if r.get("cpu_percent_per_node") and r["discovery"] == mode]
                )
                for mode in modes(args.discovery)
            },
            "elapsed_s": elapsed,
        }
        if args.discovery == "both":
            document["comparison"] = comparison(results)
        harness.write_json(args.json, document)
    if any(r.get("crash", {}).get("requests_failed") for r in results):
        status = 1
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__, "also write every number to PATH ('-': stdout)")
    parser.add_argument("--sizes", default="10,20,40", help="node counts (default 10,20,40)")
    parser.add_argument(
        "--clusters", type=int, default=0, help="clusters the members serve (default: N/10, >= 1)"
    )
    parser.add_argument(
        "--clients", type=int, default=2, help="pure clients among the N nodes (default 2)"
    )
    parser.add_argument(
        "--discovery",
        choices=("seeds", "survey", "both"),
        default="seeds",
        help="how nodes join: seeds (default), survey (no seeds: the default discovery alone), "
        "or both, one after the other for each size, compared side by side",
    )
    parser.add_argument("--seeds", type=int, default=2, help="seed nodes (default 2)")
    parser.add_argument(
        "--spawn-batch",
        type=int,
        default=2 * (os.cpu_count() or 1),
        help="nodes starting (importing) at once (default: 2 per CPU)",
    )
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--window", type=float, default=5.0, help="CPU window in seconds")
    parser.add_argument(
        "--hold", type=float, default=10.0, help="idle seconds counting false deaths (default 10)"
    )
    parser.add_argument(
        "--kills", type=int, default=3, help="members SIGKILLed one after another (default 3)"
    )
    parser.add_argument(
        "--rate", type=float, default=50.0, help="requests/s of the calling client (default 50)"
    )
    parser.add_argument(
        "--lead", type=float, default=1.0, help="seconds of calls before each kill (default 1)"
    )
    parser.add_argument(
        "--detect-timeout",
        type=float,
        default=30.0,
        help="seconds allowed for every node to know a victim dead (default 30)",
    )
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between kills (default 2)")
    parser.add_argument(
        "--request-timeout", type=float, default=5.0, help="timeout of each request (default 5)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="seconds allowed for startup + convergence (default: 60, or 0.8 s a node if more)",
    )
    # The children's side of this file.
    parser.add_argument("--role", choices=("node",), help=argparse.SUPPRESS)
    parser.add_argument("--keyring", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--members", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--seed", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--survey", help=argparse.SUPPRESS)
    parser.add_argument("--expect", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--max-seconds", type=float, default=600.0, help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = harness.parse_args(build_parser())
    if args.role == "node":
        harness.exit_after(args.max_seconds)
        harness.raise_fd_limit()
        asyncio.run(run_node(args))
        return 0
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
