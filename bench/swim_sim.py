"""SWIM membership at internet scale: the real `Membership` state machines of N nodes, simulated.

    python bench/swim_sim.py [--nodes 100,1000,10000] [--crashes 3] [--soak 30] [--loss 0.01]
                             [--soak-loss 0.05] [--stall 3] [--sealing on|per-node|off]
                             [--delay 0.2,2] [--seed 1] [--phases steady,join,...]
                             [--limit 60] [--json PATH | --json -]

No sockets and no event loop: every node is an `irismesh._core.membership.Membership`, and
`tests/core/swimnet.py` (`SwimNet`) plays the driver for all of them on one simulated clock,
delivering each datagram after a random delay (`--delay`, in ms) and losing a share of them
(`--loss`). Datagrams are really sealed with AES-GCM (`MeshDatagramSealer`) unless
`--sealing off`. Each size runs in a child process of its own, so that its wall time and peak
RSS are its own. Every figure is in simulated time; one *period* is the probe interval
(`MembershipConfig.probe_interval`, given in the table's caption), the unit SWIM's analysis
counts in.

Phases, in this order, for each N (a mesh of N nodes that all know each other, `seed_tables`):

1. steady state: after `--settle` periods (the nodes' start-up announcements drain), the
   datagrams and bytes each node sends per period over `--window` periods, by first message
   (PING, PING_REQ, ACK, NACK, gossip = ALIVE/SUSPECT/DEAD alone, STATE = table exchange).
   The table exchanges of anti-entropy come every 30 s (N=100) to 100 s (N=10,000), so they
   rarely fall in this window; the soak's cost includes them.
2. join: one new node joins through one existing node; the periods until *every* node has it
   as a member (the epidemic: should grow like log N), and until it knows all N (one table
   exchange: should not depend much on N). Median and p99 over the nodes, and "all".
3. soak: `--soak` seconds at `--soak-loss` (5%) with nothing failing. Every MemberDown "dead"
   is a false death; suspicions (one per node that suspected someone), refutations (by the
   suspected node itself) and revivals (a false death undone) are counted, and the worst local
   health score (Lifeguard's awareness, 0 is healthy) at the end.
4. stall: one node's event loop stops for `--stall` periods (datagrams to it wait, it neither
   probes nor answers), then runs again. It must refute the suspicions about it: false deaths
   of it should be 0. Also counted: what it suspected itself once it ran again, and how long
   until no node held it suspect. About one node probes a given node per period, so a stall
   of 3 periods goes unnoticed now and then (no node held it suspect: nothing to refute).
5. crashes: `--crashes` nodes are killed one after the other; for each, the time from the crash
   until each surviving node sees it DEAD (median and p99 over the nodes, and all of them),
   and until the first node suspected it. The table gives the median over the crashes. Then
   the cost again over `--window` periods, with the dead in every table (each node tells one
   of them, every `reconnect_interval`, that it is held dead). This phase is last so that the
   dead change nothing the other phases measure.

Then how each figure grows from one N to the next: datagrams per node per period should stay
flat, and the join's dissemination should grow like log N (the table prints log10 N beside the
periods, and their ratio, which should stay about constant).

`--sealing on` (the default) gives every node its own `MeshDatagramSealer` but lets them share
one cache of derived sender keys: each `AESGCM` key costs about 2.5 KB, and a node of a large
mesh hears from thousands of senders, so per-node caches (`--sealing per-node`, what each real
process holds: up to 4,096 keys, about 10 MB) would need tens of GB at N=10,000 in one process.
The AES-GCM work per datagram is the same; only key derivations are fewer.

`--phases` runs only some phases (the mesh is built and settled either way), and `--limit`
caps each wait in simulated seconds (a join or crash not seen by every node by then is shown
as how many saw it). A size whose child process fails still shows the phases it finished.

The simulation's own cost: wall time, wall seconds per simulated second, and peak RSS of the
child process (VmHWM). Wall figures depend on the machine; everything else is simulated and
replays exactly for a given `--seed`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "core"))

import _harness as harness
from swimnet import SwimNet, SwimNode, null_sealer

from irismesh._core.gossip import DatagramSealer
from irismesh._core.records import (
    MemberDown,
    MemberEvent,
    MembershipConfig,
    MemberState,
    MemberSuspect,
    MemberUp,
)
from irismesh._core.suspicion import suspicion_bounds
from irismesh.security.meshkey import MeshDatagramSealer

PHASES = ("steady", "join", "soak", "stall", "crash")
# The first message of a datagram's compound, by type (gossip: an update with nothing before it).
KINDS = ("other", "PING", "PING_REQ", "ACK", "NACK", "gossip", "gossip", "gossip", "STATE")
KIND_NAMES = ("PING", "PING_REQ", "ACK", "NACK", "gossip", "STATE", "other")


def memory() -> tuple[float, float]:
    """(RSS, peak RSS) of this process in MB."""
    rss = peak = 0.0
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
    except OSError:
        import resource

        peak = rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rss, peak


# ============================================================================================
# What goes over the wire


class Traffic:
    """Datagrams and bytes sent, by the type of the first message in each."""

    __slots__ = ("bytes", "datagrams")

    def __init__(self) -> None:
        self.datagrams: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def count(self, body: bytes, size: int) -> None:
        # A compound is a msgpack array (fixarray: 1 byte, array16: 3) of messages, each a
        # fixarray whose first element is its type.
        at = 2 if body[0] != 0xDC else 4
        kind = KINDS[body[at]] if at < len(body) and body[at] < len(KINDS) else "other"
        self.datagrams[kind] += 1
        self.bytes[kind] += size

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        return self.datagrams.copy(), self.bytes.copy()


class CountingSealer:
    """Seals with `inner`, counting each datagram's size and type from its plaintext."""

    __slots__ = ("_inner", "_traffic", "overhead")

    def __init__(self, inner: DatagramSealer, traffic: Traffic) -> None:
        self._inner = inner
        self._traffic = traffic
        self.overhead = inner.overhead

    def seal(self, header: bytes, counter: int, body: bytes) -> bytes:
        self._traffic.count(body, len(header) + len(body) + self.overhead)
        return self._inner.seal(header, counter, body)

    def open(self, sender: bytes, header: bytes, counter: int, sealed: bytes) -> bytes:
        return self._inner.open(sender, header, counter, sealed)


def sealer_factory(mode: str, seed: int, traffic: Traffic) -> Callable[[bytes], DatagramSealer]:
    secret = random.Random(seed).randbytes(32)
    shared: dict[Any, Any] = {}  # derived sender keys, one cache for the whole network

    def make(node_id: bytes) -> DatagramSealer:
        inner: DatagramSealer
        if mode == "off":
            inner = null_sealer(node_id)
        else:
            sealer = MeshDatagramSealer([secret], node_id)
            if mode == "on":
                sealer._cache = shared
            inner = sealer
        return CountingSealer(inner, traffic)

    return make


# ============================================================================================
# What the nodes see


class Recorder:
    """Takes every membership event as it happens; keeps counts and a few first times only."""

    def __init__(self, net: SwimNet) -> None:
        self.net = net
        self.counts: Counter[str] = Counter()
        self.watch = b""  # the node a phase times (the newcomer, the stalled node, a victim)
        self.up_at: dict[str, float] = {}  # observer -> when it first had `watch` as a member
        self.dead_at: dict[str, float] = {}  # observer -> when it first saw `watch` DEAD
        self.first_suspect_at: float | None = None  # when someone first suspected `watch`
        self.killed: set[bytes] = set()
        self.suspecting: set[str] = set()  # observers holding `watch` suspect now
        self.cleared_at: float | None = None  # when `suspecting` last became empty
        self.newcomer: SwimNode | None = None
        self.newcomer_knows: set[bytes] = set()
        self.newcomer_target = 0
        self.newcomer_all_at: float | None = None  # when it knew `newcomer_target` members

    def on_event(self, node: SwimNode, event: MemberEvent) -> None:
        kind = type(event)
        if kind is MemberSuspect:
            assert isinstance(event, MemberSuspect)
            watched = event.node_id == self.watch
            if event.suspect:
                self.counts["suspected"] += 1
                if watched:
                    self.counts["suspected_watched"] += 1
                    self.suspecting.add(node.name)
                    if self.first_suspect_at is None:
                        self.first_suspect_at = self.net.now
            else:
                self.counts["refuted"] += 1
                if watched:
                    self.unsuspect(node)
        elif kind is MemberDown:
            assert isinstance(event, MemberDown)
            node_id = event.record.node_id
            if node_id == self.watch:
                self.unsuspect(node)
            if event.reason != "dead":
                self.counts["left"] += 1
            elif node_id in self.killed:
                if node_id == self.watch:
                    self.dead_at.setdefault(node.name, self.net.now)
            else:
                self.counts["false_deaths"] += 1
                if node_id == self.watch:
                    self.counts["false_deaths_watched"] += 1
        elif kind is MemberUp:
            assert isinstance(event, MemberUp)
            node_id = event.record.node_id
            self.counts["up"] += 1
            if node_id == self.watch:
                self.up_at.setdefault(node.name, self.net.now)
            if node is self.newcomer:
                self.newcomer_knows.add(node_id)
                if len(self.newcomer_knows) == self.newcomer_target:
                    self.newcomer_all_at = self.net.now

    def unsuspect(self, node: SwimNode) -> None:
        if node.name in self.suspecting:
            self.suspecting.discard(node.name)
            if not self.suspecting:
                self.cleared_at = self.net.now

    def track(self, node_id: bytes) -> None:
        self.watch = node_id
        self.up_at, self.dead_at = {}, {}
        self.first_suspect_at = self.cleared_at = None
        self.suspecting = set()


def all_seen(seen: dict[str, float], count: int) -> bool:
    return len(seen) >= count


def stat_sum(nodes: Sequence[SwimNode], *keys: str) -> Counter[str]:
    total: Counter[str] = Counter()
    for node in nodes:
        stats = node.membership.stats
        for key in keys:
            total[key] += stats[key]
    return total


def spread(values: Sequence[float], period: float) -> dict[str, float]:
    """Median, p99 and max of `values` (seconds), also in periods."""
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    out = {"median_s": statistics.median(ordered), "p99_s": p99, "all_s": ordered[-1]}
    out.update({k.replace("_s", "_periods"): v / period for k, v in list(out.items())})
    return out


# ============================================================================================
# One size, in a child process


class Simulation:
    def __init__(self, n: int, args: argparse.Namespace) -> None:
        self.n = n
        self.args = args
        self.started = time.monotonic()
        self.config = MembershipConfig()
        self.period = self.config.probe_interval
        self.traffic = Traffic()
        self.net = SwimNet(
            seed=args.seed,
            loss=args.loss,
            delay=args.delay,
            config=self.config,
            sealer=sealer_factory(args.sealing, args.seed, self.traffic),
            keep_log=False,
        )
        self.recorder = Recorder(self.net)
        self.net.on_event = self.recorder.on_event
        self.rng = random.Random(args.seed + 1)  # picks victims; the network has its own
        self.nodes: list[SwimNode] = []
        self.result: dict[str, Any] = {"nodes": n, "limit_s": args.limit, "period_s": self.period}
        self.peak_rss = 0.0

    # ---------------------------------------------------------------- helpers

    def wall(self) -> float:
        return time.monotonic() - self.started

    def say(self, phase: str, message: str) -> None:
        rss, peak = memory()
        self.peak_rss = max(self.peak_rss, peak)
        harness.progress(
            f"[N={self.n}] {phase}: {message}  (sim {self.net.now:.1f} s, wall {self.wall():.0f} s,"
            f" RSS {rss:.0f} MB)"
        )

    def live(self) -> list[SwimNode]:
        return [node for node in self.nodes if node.alive]

    def wait(self, done: Callable[[], bool], limit: float) -> bool:
        """Advance half a period at a time until `done()`; False after `limit` seconds."""
        end = self.net.now + limit
        while not done():
            if self.net.now >= end:
                return False
            self.net.advance(self.period / 2)
        return True

    def cost(self, seconds: float) -> dict[str, Any]:
        """What the live nodes send per node per period over the next `seconds`."""
        net, nodes = self.net, len(self.live())
        sent, (datagrams, sizes) = net.sent, self.traffic.snapshot()
        wall = time.monotonic()
        net.advance(seconds)
        wall = time.monotonic() - wall
        periods = seconds / self.period
        d_datagrams = self.traffic.datagrams - datagrams
        d_bytes = self.traffic.bytes - sizes
        return {
            "datagrams_per_node_period": (net.sent - sent) / nodes / periods,
            "bytes_per_node_period": sum(d_bytes.values()) / nodes / periods,
            "by_kind_per_node_period": {
                kind: d_datagrams[kind] / nodes / periods for kind in KIND_NAMES
            },
            "bytes_by_kind_per_node_period": {
                kind: d_bytes[kind] / nodes / periods for kind in KIND_NAMES
            },
            "wall_per_sim_s": wall / seconds,
        }

    def queue_max(self) -> int | None:
        """The longest dissemination queue of any node (None if it cannot be seen)."""
        queues = [getattr(node.membership, "_queue", None) for node in self.live()]
        lengths = [len(queue) for queue in queues if queue is not None]
        return max(lengths) if lengths else None

    # ---------------------------------------------------------------- phases

    def run(self) -> None:
        """Each phase asked for, in order; the result so far on stdout after each."""
        self.build()
        self.net.advance(self.args.settle * self.period)
        self.result["phases"] = []
        for phase in PHASES:
            if phase in self.args.phases:
                getattr(self, phase)()
                self.result["phases"].append(phase)
                self.summarise()
                print(json.dumps(self.result), flush=True)

    def summarise(self) -> None:
        rss, peak = memory()
        self.result["wall_s"] = self.wall()
        self.result["sim_s"] = self.net.now
        self.result["rss_end_mb"] = rss
        self.result["peak_rss_mb"] = max(self.peak_rss, peak)
        self.result["lost"] = dict(self.net.lost)
        dropped: Counter[str] = Counter()
        for node in self.nodes:
            dropped.update(
                {k: v for k, v in node.membership.stats.items() if k.startswith("dropped_")}
            )
        # By the receivers, after the network's losses.
        self.result["dropped"] = {"dropped_replay": 0, **dropped}
        self.result["datagrams_sent"] = self.net.sent

    def build(self) -> None:
        before, _ = memory()
        self.nodes = [self.net.add(f"n{i}") for i in range(self.n)]
        self.net.seed_tables(self.nodes)
        after, _ = memory()
        self.result["build_wall_s"] = self.wall()
        self.result["tables_mb"] = after - before
        self.say("build", f"{self.n} nodes, every table full ({after - before:.0f} MB)")

    def steady(self) -> None:
        figures = self.cost(self.args.window * self.period)
        figures["queue_max"] = self.queue_max()
        self.result["steady"] = figures
        self.say(
            "steady",
            f"{figures['datagrams_per_node_period']:.2f} datagrams, "
            f"{figures['bytes_per_node_period']:.0f} B per node per period; "
            f"{figures['wall_per_sim_s']:.1f} wall s per simulated s",
        )

    def join(self) -> None:
        rec, net, n = self.recorder, self.net, self.n
        seed = self.nodes[0]
        start = net.now
        newcomer = net.add("newcomer", join=[seed])
        rec.newcomer, rec.newcomer_target = newcomer, n
        rec.track(newcomer.node_id)

        def done() -> bool:
            return len(rec.up_at) >= n and rec.newcomer_all_at is not None

        finished = self.wait(done, self.args.limit)
        self.nodes.append(newcomer)
        rec.newcomer = None
        times = [t - start for t in rec.up_at.values()]
        knows_all = None if rec.newcomer_all_at is None else rec.newcomer_all_at - start
        figures: dict[str, Any] = {
            "complete": finished,
            "nodes_knowing": len(rec.up_at),
            "newcomer_knows": len(rec.newcomer_knows),
            "known_by": spread(times, self.period) if times else None,
            "newcomer_knows_all_s": knows_all,
            "newcomer_knows_all_periods": None if knows_all is None else knows_all / self.period,
        }
        self.result["join"] = figures
        known = figures["known_by"]
        self.say(
            "join",
            (
                f"all {n} know the newcomer after {known['all_s']:.2f} s"
                if known and len(rec.up_at) >= n
                else f"{len(rec.up_at)}/{n} know the newcomer"
            )
            + (
                f"; it knows all after {knows_all:.3f} s"
                if knows_all is not None
                else f"; it knows {len(rec.newcomer_knows)}/{n}"
            )
            + ("" if finished else f" (limit of {self.args.limit:g} s reached)"),
        )

    def soak(self) -> None:
        rec, net, live = self.recorder, self.net, self.live()
        keys = ("refutations", "members_revived", "probes_failed", "members_suspected")
        rec.track(b"")
        counts, stats = rec.counts.copy(), stat_sum(live, *keys)
        net.loss = self.args.soak_loss
        figures = self.cost(self.args.soak)
        net.loss = self.args.loss
        events = rec.counts - counts
        stats = stat_sum(live, *keys) - stats
        health = [node.membership.health for node in live]
        figures.update(
            {
                "seconds": self.args.soak,
                "false_deaths": events["false_deaths"],
                "suspicions": events["suspected"],
                "suspicions_per_s": events["suspected"] / self.args.soak,
                "refuted": events["refuted"],
                "refutations": stats["refutations"],
                "revived": stats["members_revived"],
                "probes_failed": stats["probes_failed"],
                "health_max": max(health),
                "health_mean": statistics.fmean(health),
                "queue_max": self.queue_max(),
            }
        )
        self.result["soak"] = figures
        self.say(
            "soak",
            f"{self.args.soak:.0f} s at {self.args.soak_loss:.0%} loss: "
            f"{figures['false_deaths']} false deaths, {figures['suspicions']} suspicions, "
            f"{figures['refutations']} refutations",
        )

    def stall(self) -> None:
        rec, net = self.recorder, self.net
        candidates = [node for node in self.live()[1:-1]]  # not the seed nor the newcomer
        stalled = self.rng.choice(candidates)
        others = [node for node in self.live() if node is not stalled]
        rec.track(stalled.node_id)
        counts = rec.counts.copy()
        own = stalled.membership.stats.copy()
        health = stalled.membership.health
        net.pause(stalled)
        net.advance(self.args.stall * self.period)
        backlog = len(stalled.backlog)
        net.resume(stalled)
        resumed = net.now
        _, maximum = suspicion_bounds(
            self.config.suspicion_multiplier,
            self.config.suspicion_max_multiplier,
            len(others) + 1,
            self.period,
        )

        def done() -> bool:
            # Wait out the longest suspicion too: a late death would still count.
            return not rec.suspecting and net.now - resumed > maximum + self.period

        self.wait(done, self.args.limit)
        alive = sum(node.state_of(stalled) is MemberState.ALIVE for node in others)
        cleared = rec.cleared_at if not rec.suspecting else None
        events = rec.counts - counts
        own = stalled.membership.stats - own
        figures = {
            "stall_periods": self.args.stall,
            "backlog": backlog,
            "suspected_by": events["suspected_watched"],
            "false_deaths": events["false_deaths_watched"],
            "refutations": own["refutations"],
            "its_failed_probes": own["probes_failed"],
            "other_false_deaths": events["false_deaths"] - events["false_deaths_watched"],
            "clear_after_resume_s": None if cleared is None else max(0.0, cleared - resumed),
            "seen_alive_by": alive,
            "others": len(others),
            "health_before": health,
            "health_after": stalled.membership.health,
        }
        self.result["stall"] = figures
        self.say(
            "stall",
            f"{self.args.stall} periods: suspected by {figures['suspected_by']}, "
            f"{figures['false_deaths']} false deaths of it, {figures['refutations']} refutations",
        )

    def crash(self) -> None:
        rec, net = self.recorder, self.net
        runs: list[dict[str, Any]] = []
        start_sent, (start_datagrams, start_bytes) = net.sent, self.traffic.snapshot()
        phase_start, phase_wall = net.now, time.monotonic()
        for index in range(self.args.crashes):
            victim = self.rng.choice(self.live()[1:-1])
            survivors = len(self.live()) - 1
            rec.track(victim.node_id)
            rec.killed.add(victim.node_id)
            start = net.now
            net.kill(victim)
            finished = self.wait(partial(all_seen, rec.dead_at, survivors), self.args.limit)
            times = [t - start for t in rec.dead_at.values()]
            run: dict[str, Any] = {
                "complete": finished,
                "nodes_seeing_dead": len(rec.dead_at),
                "survivors": survivors,
                "first_suspect_s": (
                    rec.first_suspect_at - start if rec.first_suspect_at is not None else None
                ),
                "first_dead_s": min(times) if times else None,
                "dead_by": spread(times, self.period) if times else None,
            }
            runs.append(run)
            dead_by = run["dead_by"]
            self.say(
                f"crash {index + 1}/{self.args.crashes}",
                (
                    f"all {survivors} see it dead after {dead_by['all_s']:.2f} s"
                    f" (median {dead_by['median_s']:.2f} s)"
                    if finished
                    else f"NOT DONE: {len(rec.dead_at)}/{survivors}"
                ),
            )
        figures: dict[str, Any] = {"runs": runs}
        done = [r for r in runs if r["dead_by"]]
        if done:
            figures["median"] = {
                key: statistics.median(r["dead_by"][key] for r in done)
                for key in done[0]["dead_by"]
            }
            for key in ("first_suspect_s", "first_dead_s"):
                values = [r[key] for r in done if r[key] is not None]
                figures["median"][key] = statistics.median(values) if values else None
        if runs:
            seconds = net.now - phase_start
            live = len(self.live())
            datagrams, sizes = self.traffic.snapshot()
            figures["phase"] = {
                "seconds": seconds,
                "datagrams_per_node_period": (net.sent - start_sent) / live / seconds * self.period,
                "state_per_node_period": (datagrams["STATE"] - start_datagrams["STATE"])
                / live
                / seconds
                * self.period,
                "bytes_per_node_period": (sum(sizes.values()) - sum(start_bytes.values()))
                / live
                / seconds
                * self.period,
                "wall_per_sim_s": (time.monotonic() - phase_wall) / seconds,
            }
            after = self.cost(self.args.window * self.period)
            after["queue_max"] = self.queue_max()
            figures["after"] = after
            self.say(
                "after crashes",
                f"{after['datagrams_per_node_period']:.2f} datagrams "
                f"({after['by_kind_per_node_period']['STATE']:.2f} STATE), "
                f"{after['bytes_per_node_period']:.0f} B per node per period",
            )
        self.result["crash"] = figures


def run_child(n: int, args: argparse.Namespace) -> int:
    Simulation(n, args).run()
    return 0


# ============================================================================================
# The parent: one child per size, then the tables


def get(result: dict[str, Any], *path: str) -> Any:
    value: Any = result
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


PERIOD = MembershipConfig().probe_interval

Row = Callable[[dict[str, Any]], str]


def number(*path: str, digits: int = 2) -> Row:
    return lambda r: fmt(get(r, *path), digits)


def duration(*path: str) -> Row:
    """Seconds, and periods in brackets."""

    def show(r: dict[str, Any]) -> str:
        value = get(r, *path)
        if value is None:
            return "-"
        small = value < 0.1  # a round trip or so: show milliseconds
        periods = value / r.get("period_s", PERIOD)
        return f"{value:.{3 if small else 2}f} s ({periods:.{2 if small else 1}f})"

    return show


def both(first: Row, second: Row, brackets: bool = False) -> Row:
    if brackets:
        return lambda r: f"{first(r)} ({second(r)})"
    return lambda r: f"{first(r)} / {second(r)}"


def unless_short(show: Row, done: Callable[[dict[str, Any]], str | None]) -> Row:
    """`show`, or what was missing when the phase ran out of time."""

    def row(r: dict[str, Any]) -> str:
        missing = done(r)
        return show(r) if missing is None else missing

    return row


def join_missing(count: str) -> Callable[[dict[str, Any]], str | None]:
    """What a join row shows if not every node got there: how many did."""

    def missing(r: dict[str, Any]) -> str | None:
        known = get(r, "join", count)
        if known is None or known >= r["nodes"]:
            return None
        return f"not in {r['limit_s']:g} s: {known:,}/{r['nodes']:,}"

    return missing


def longest_queue(r: dict[str, Any]) -> str:
    lengths = [get(r, phase, "queue_max") for phase in ("steady", "soak")]
    return fmt(max((v for v in lengths if v is not None), default=None))


def steady_kinds(r: dict[str, Any]) -> str:
    return ", ".join(fmt(get(r, "steady", "by_kind_per_node_period", k)) for k in KIND_NAMES[:-1])


# The main table: a row per figure, a column per size; (n) = periods.
ROWS: list[tuple[str, Row]] = [
    ("steady: datagrams / node / period", number("steady", "datagrams_per_node_period")),
    ("  of which PING, PING_REQ, ACK, NACK, gossip, STATE", steady_kinds),
    ("steady: bytes / node / period", number("steady", "bytes_per_node_period", digits=0)),
    ("join: newcomer known by the median node", duration("join", "known_by", "median_s")),
    ("join: known by the p99 node", duration("join", "known_by", "p99_s")),
    (
        "join: known by all",
        unless_short(duration("join", "known_by", "all_s"), join_missing("nodes_knowing")),
    ),
    (
        "join: newcomer knows all N",
        unless_short(duration("join", "newcomer_knows_all_s"), join_missing("newcomer_knows")),
    ),
    ("soak: false deaths", number("soak", "false_deaths")),
    (
        "soak: suspicions / refutations",
        both(number("soak", "suspicions"), number("soak", "refutations")),
    ),
    ("soak: revived / worst health", both(number("soak", "revived"), number("soak", "health_max"))),
    ("soak: datagrams / node / period", number("soak", "datagrams_per_node_period")),
    (
        "soak: bytes / node / period (STATE)",
        both(
            number("soak", "bytes_per_node_period", digits=0),
            number("soak", "bytes_by_kind_per_node_period", "STATE", digits=0),
            brackets=True,
        ),
    ),
    ("stall: nodes that held it suspect", number("stall", "suspected_by")),
    (
        "stall: false deaths of it / of others",
        both(number("stall", "false_deaths"), number("stall", "other_false_deaths")),
    ),
    (
        "stall: its refutations / its failed probes",
        both(number("stall", "refutations"), number("stall", "its_failed_probes")),
    ),
    ("stall: no node suspects it, after resuming", duration("stall", "clear_after_resume_s")),
    ("crash: first suspicion", duration("crash", "median", "first_suspect_s")),
    ("crash: seen dead by the median node", duration("crash", "median", "median_s")),
    ("crash: seen dead by the p99 node", duration("crash", "median", "p99_s")),
    ("crash: seen dead by all", duration("crash", "median", "all_s")),
    (
        "crash phase: datagrams / node / period",
        number("crash", "phase", "datagrams_per_node_period"),
    ),
    (
        "after crashes: datagrams / node / period (STATE)",
        both(
            number("crash", "after", "datagrams_per_node_period"),
            number("crash", "after", "by_kind_per_node_period", "STATE"),
            brackets=True,
        ),
    ),
    (
        "after crashes: bytes / node / period",
        number("crash", "after", "bytes_per_node_period", digits=0),
    ),
    ("datagrams dropped as replays (whole run)", number("dropped", "dropped_replay")),
    ("longest dissemination queue", longest_queue),
    ("sim: wall s per simulated s (steady)", number("steady", "wall_per_sim_s")),
    (
        "sim: wall time (build)",
        both(number("wall_s", digits=0), number("build_wall_s", digits=0), brackets=True),
    ),
    (
        "sim: peak RSS MB (tables)",
        both(number("peak_rss_mb", digits=0), number("tables_mb", digits=0), brackets=True),
    ),
]

# Figures whose growth from one size to the next is shown: label -> path in a result.
GROWTH: dict[str, tuple[str, ...]] = {
    "datagrams / node / period (steady)": ("steady", "datagrams_per_node_period"),
    "bytes / node / period (steady)": ("steady", "bytes_per_node_period"),
    "join: known by all (periods)": ("join", "known_by", "all_periods"),
    "join: known by median (periods)": ("join", "known_by", "median_periods"),
    "join: newcomer knows all (periods)": ("join", "newcomer_knows_all_periods"),
    "crash: seen dead by all (periods)": ("crash", "median", "all_periods"),
    "crash: seen dead, median (periods)": ("crash", "median", "median_periods"),
    "soak: false deaths": ("soak", "false_deaths"),
    "soak: suspicions per second": ("soak", "suspicions_per_s"),
    "wall s per simulated s": ("steady", "wall_per_sim_s"),
    "peak RSS (MB)": ("peak_rss_mb",),
}


def growth(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each growth figure per size, log10 N and join periods / log10 N, and the ratios b/a."""
    per_size: dict[str, list[float | None]] = {label: [] for label in GROWTH}
    for r in results:
        for label, path in GROWTH.items():
            value = get(r, *path)
            per_size[label].append(float(value) if isinstance(value, int | float) else None)
    logs = [math.log10(r["nodes"]) for r in results]
    per_size["log10 N"] = list(logs)
    for label in ("join: known by all (periods)", "join: known by median (periods)"):
        per_size[label + " / log10 N"] = [
            v / lg if v is not None else None for v, lg in zip(per_size[label], logs, strict=True)
        ]
    ratios: dict[str, dict[str, float | None]] = {}
    for (i, a), (j, b) in itertools.pairwise(enumerate(results)):
        step = f"{b['nodes']}/{a['nodes']}"
        ratios[step] = {}
        for label, values in per_size.items():
            x, y = values[i], values[j]
            ratios[step][label] = y / x if x and y is not None else None
    return {"sizes": [r["nodes"] for r in results], "values": per_size, "ratios": ratios}


def print_report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    out = sys.stderr if args.json == "-" else sys.stdout  # stdout then carries the JSON
    console = Console(file=out) if out.isatty() else Console(file=out, width=160)
    period = results[0].get("period_s", PERIOD)
    table = Table(
        title=f"SWIM membership, simulated: base loss {args.loss:.0%}, delay "
        f"{args.delay[0] * 1000:g}-{args.delay[1] * 1000:g} ms, sealing {args.sealing}, "
        f"seed {args.seed}",
        caption=f"1 period = probe interval = {period:g} s; times are simulated, from the event "
        "(join, crash, resume); (n) = periods; median/p99 over the nodes, crash figures the "
        f"median of {args.crashes} crash(es); soak: {args.soak:g} s at {args.soak_loss:.0%} loss; "
        f"stall: {args.stall} periods",
    )
    table.add_column("figure")
    for r in results:
        table.add_column(f"N={r['nodes']:,}", justify="right")
    for label, show in ROWS:
        table.add_row(Text(label), *(Text(show(r)) for r in results))
    console.print(table)

    grown = growth(results)
    if len(results) > 1:
        grow = Table(
            title="growth with N: flat figures should stay ~1.00x; dissemination should grow "
            "like log10 N (its ratio to log10 N about constant)"
        )
        grow.add_column("figure")
        for r in results:
            grow.add_column(f"N={r['nodes']:,}", justify="right")
        for step in grown["ratios"]:
            grow.add_column(step, justify="right")
        for label, values in grown["values"].items():
            cells = [fmt(v) for v in values]
            cells += [
                "-" if (v := grown["ratios"][step][label]) is None else f"{v:.2f}x"
                for step in grown["ratios"]
            ]
            grow.add_row(Text(label), *(Text(c) for c in cells))
        console.print(grow)


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not sizes or any(n < 10 for n in sizes):
        raise argparse.ArgumentTypeError("every size must be at least 10 nodes")
    return sizes


def parse_phases(text: str) -> tuple[str, ...]:
    phases = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [phase for phase in phases if phase not in PHASES]
    if unknown or not phases:
        raise argparse.ArgumentTypeError(f"phases are {','.join(PHASES)}; got {text!r}")
    return phases


def parse_delay(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) / 1000 for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want MIN,MAX in ms, got {text!r}") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError("want 0 <= MIN <= MAX")
    return low, high


def main_parent(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    failed: list[int] = []
    started = time.monotonic()
    try:
        for index, n in enumerate(args.nodes):
            harness.progress(f"[{index + 1}/{len(args.nodes)}] {n} nodes")
            command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", str(n)]
            child = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
            lines = child.stdout.strip().splitlines()
            if child.returncode != 0:
                harness.progress(
                    f"  FAILED: the simulation of {n} nodes exited with {child.returncode}"
                )
                failed.append(n)
            if lines:  # the phases it finished, even if a later one failed
                result = json.loads(lines[-1])
                result["complete"] = child.returncode == 0
                results.append(result)
    except KeyboardInterrupt:
        harness.progress("interrupted")
        return 130
    if results:
        print_report(results, args)
    if args.json:
        document = {
            "facts": harness.machine_facts(),
            "settings": {
                "nodes": args.nodes,
                "loss": args.loss,
                "soak_loss": args.soak_loss,
                "delay_s": list(args.delay),
                "sealing": args.sealing,
                "seed": args.seed,
                "soak_s": args.soak,
                "stall_periods": args.stall,
                "crashes": args.crashes,
                "phases": list(args.phases),
                "settle_periods": args.settle,
                "window_periods": args.window,
                "limit_s": args.limit,
                "probe_interval_s": results[0].get("period_s", PERIOD) if results else PERIOD,
            },
            "results": results,
            "growth": growth(results),
            "failed": failed,
            "elapsed_s": time.monotonic() - started,
        }
        harness.write_json(args.json, document)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__, "also write every number to PATH ('-': stdout)")
    add = parser.add_argument
    add("--nodes", type=parse_sizes, default=[100, 1000], help="sizes (default 100,1000)")
    add("--crashes", type=int, default=3, help="nodes killed one by one (default 3)")
    add("--soak", type=float, default=30.0, help="simulated seconds at --soak-loss (default 30)")
    add("--loss", type=float, default=0.01, help="datagram loss, except the soak (default 0.01)")
    add("--soak-loss", type=float, default=0.05, help="datagram loss of the soak (default 0.05)")
    add("--stall", type=int, default=3, help="periods one node's loop stalls (default 3)")
    add("--delay", type=parse_delay, default=(0.0002, 0.002), help="MIN,MAX ms (default 0.2,2)")
    add("--sealing", choices=("on", "per-node", "off"), default="on")
    add("--seed", type=int, default=1, help="of every random choice (default 1)")
    add("--settle", type=int, default=5, help="periods before measuring (default 5)")
    add("--window", type=int, default=10, help="periods of each cost window (default 10)")
    add("--limit", type=float, default=60.0, help="simulated seconds allowed per wait")
    add("--phases", type=parse_phases, default=PHASES, help="default all: " + ",".join(PHASES))
    add("--child", type=int, help=argparse.SUPPRESS)
    return parser


def main() -> int:
    parser = build_parser()
    args = harness.parse_args(parser)
    if not 0 <= args.loss < 1 or not 0 <= args.soak_loss < 1:
        parser.error("--loss and --soak-loss must be in [0, 1)")
    if args.crashes < 0 or args.stall < 0 or args.settle < 0 or args.window < 1:
        parser.error("--crashes, --stall and --settle must be >= 0, --window >= 1")
    if args.soak <= 0 or args.limit <= 0:
        parser.error("--soak and --limit must be positive")
    if args.crashes + 3 > min(args.nodes):
        parser.error("--crashes: need at least crashes + 3 nodes in every size")
    if args.child is not None:
        return run_child(args.child, args)
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
