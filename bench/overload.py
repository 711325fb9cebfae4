"""Overload benchmark: what a cluster serves, wastes and how it recovers when offered 2-10x
what it can handle.

    python bench/overload.py [--scenarios one,three] [--loads 2,5,10] [--seconds 4]
                             [--deadline 0.5] [--cost 2] [--capacity-seconds 3]
                             [--quick] [--json out.json]

Member processes of cluster "work" answer each request with a plain (synchronous) handler that
burns `--cost` ms of CPU and echoes the payload; a caller process calls them; all on 127.0.0.1.
Scenario "one" has one member, "three" has three, one of them three times slower. The caller
first measures the capacity C (replies/s with 8 requests in flight) and the unloaded p50 (1 in
flight), then for each multiple m of `--loads` offers m x C requests/s as an open loop (each
request its own task, started on a fixed schedule whatever happened to the earlier ones),
each with a `--deadline` timeout, for `--seconds`; then, right after the overload, a light
closed loop (1 in flight) measures how long p50 takes to come back within 1.5x of unloaded.

Per load: goodput / C, the handler runs wasted (their reply came too late or never), the
median time to a failure, p99 of served requests, failures by type, whether the caller saw a
member suspected or dead, the recovery time, how closely the caller kept to its schedule, and
the members' request/handler counters. bench/README.md says how to read the table.

The parent only orchestrates (this same file is the children's program, `--role
member|caller`); children talk in lines (READY, then JSON events on stdout; commands on
stdin), die with the parent and have a hard timeout, and the parent stops them in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import _harness as harness

import irismesh

CLUSTER = "work"
BIND = "tcp://127.0.0.1:0"
# Scenario name -> each member's cost as a multiple of --cost.
SCENARIOS: dict[str, tuple[float, ...]] = {"one": (1.0,), "three": (1.0, 1.0, 3.0)}
OK = "ok"
LATE = "LateReply"  # a reply the caller got, but later than the deadline by its own clock
WRONG = "WrongReply"  # a reply that is not the payload sent
NO_OUTCOME = "NoOutcome"  # still pending long after its deadline; cancelled by the bench
# Counters reported from node.stats (before/after deltas; whichever of them exist).
SUSPICION_PREFIXES = ("peers_suspected", "members_suspected", "peers_down_")
MEMBER_PREFIXES = ("requests_", "handlers_")
MEMBER_EXTRA_PREFIXES = (*SUSPICION_PREFIXES, "suspicions_")  # JSON only
# How long the parent waits for the members to finish their backlog after a load: the time
# every request offered would take on the slowest member, plus DRAIN_SLACK_S, at most DRAIN_CAP_S.
DRAIN_SLACK_S = 10.0
DRAIN_CAP_S = 180.0
STARTUP_S = 30.0
# Timeout of the baseline's requests: far above any latency at 8 in flight, short enough that
# a request lost or turned away silently does not hold a worker for long.
BASELINE_TIMEOUT_S = 1.0
POLL_S = 0.25  # how often the parent asks the members for their counts after a load
REJOIN_S = 15.0  # how long a load waits for every member to be live again before it starts


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What the caller runs in one scenario."""

    members: int
    cost_ms: float
    loads: tuple[float, ...]
    seconds: float
    deadline: float
    capacity_seconds: float
    capacity_in_flight: int = 8
    warmup_s: float = 0.5
    unloaded_s: float = 1.0
    recovery_s: float = 3.0
    recovery_step_s: float = 0.25
    recovery_factor: float = 1.5
    peers_every_s: float = 0.1

    def load_budget_s(self) -> float:
        """Longest a load phase may take: launches (catching up), recovery, the last deadline."""
        return REJOIN_S + self.launch_limit_s() + self.recovery_s + self.deadline + 10.0

    def launch_limit_s(self) -> float:
        """Launches still behind schedule after this long are given up (and reported)."""
        return 2.0 * self.seconds + 1.0

    def baseline_budget_s(self) -> float:
        closed_loops = self.warmup_s + self.unloaded_s + self.capacity_seconds
        return closed_loops + 3 * (BASELINE_TIMEOUT_S + 5.0) + 5.0

    def budget_s(self) -> float:
        """A hard ceiling on a child's whole run: generous, but finite."""
        per_load = self.load_budget_s() + DRAIN_CAP_S + 10.0
        return STARTUP_S + 20.0 + self.baseline_budget_s() + len(self.loads) * per_load + 60.0


def pick(stats: Mapping[str, int], prefixes: Sequence[str]) -> dict[str, int]:
    return {k: int(v) for k, v in stats.items() if k.startswith(tuple(prefixes))}


def delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """after - before for every key in either (a key absent on one side counts as 0)."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted({*before, *after})}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def pct(sorted_values: Sequence[float], q: float) -> float | None:
    return harness.percentile(sorted_values, q) if sorted_values else None


# ============================================================================================
# Child: member


async def member_main(args: argparse.Namespace) -> None:
    runs: dict[bytes, int] = {}  # handler runs by the payload's tag (the caller's phase)

    def count(payload: bytes) -> None:
        tag = payload.partition(b":")[0]
        runs[tag] = runs.get(tag, 0) + 1

    def on_line(node: irismesh.Node, line: str) -> None:
        verb, _, seq = line.partition(" ")
        if verb == "counts":
            harness.emit(
                "counts",
                seq=seq,
                runs={tag.decode(): n for tag, n in runs.items()},
                stats=pick(node.stats, (*MEMBER_PREFIXES, *MEMBER_EXTRA_PREFIXES)),
            )

    await harness.busy_member(
        args.keyring,
        args.cost_ms / 1000.0,
        on_line,
        count=count,
        cluster=CLUSTER,
        ready=lambda node: f"{node.endpoint} {node.node_id.hex()}",
    )


# ============================================================================================
# Child: caller


class Outcomes:
    """Outcome type and time to outcome (s) of each request of one phase."""

    def __init__(self) -> None:
        self.codes: list[str] = []
        self.times: list[float] = []
        self.details: Counter[str] = Counter()  # failures whose exception says why (`reason`)

    def add(self, code: str, seconds: float, detail: str | None = None) -> None:
        self.codes.append(code)
        self.times.append(seconds)
        if detail is not None:
            self.details[detail] += 1

    def summary(self, deadline: float) -> dict[str, Any]:
        served = sorted(t for c, t in zip(self.codes, self.times, strict=True) if c == OK)
        failed = sorted(
            t for c, t in zip(self.codes, self.times, strict=True) if c != OK and not math.isnan(t)
        )
        by_type = Counter(c for c in self.codes if c != OK)
        return {
            "requests": len(self.codes),
            "ok": len(served),
            "failures": dict(by_type.most_common()),
            "failure_reasons": dict(self.details.most_common()),
            "served_p50_ms": ms(pct(served, 50)),
            "served_p99_ms": ms(pct(served, 99)),
            "served_max_ms": ms(served[-1] if served else None),
            "failure_median_ms": ms(pct(failed, 50)),
            "deadline_s": deadline,
        }


Outcome = tuple[str, float, str | None]  # type, seconds to the outcome, why (if it says)


async def call(node: irismesh.Node, payload: bytes, timeout: float) -> Outcome:
    """One request: its outcome type, time to outcome and, for an exception that carries a
    `reason`, "Type: reason (detail)"; never raises but for cancellation."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        reply = await node.request(CLUSTER, payload, timeout=timeout)
    except Exception as exc:
        name = type(exc).__name__
        reason = getattr(exc, "reason", None)
        detail = f"{name}: {reason}" if isinstance(reason, str) and reason else None
        more = getattr(exc, "detail", None)
        if detail is not None and isinstance(more, str) and more:
            detail += f" ({more})"
        return name, loop.time() - started, detail
    took = loop.time() - started
    if reply != payload:
        return WRONG, took, None
    return (OK if took <= timeout else LATE), took, None


async def closed_loop(
    node: irismesh.Node, tag: str, in_flight: int, seconds: float, timeout: float
) -> dict[str, Any]:
    """`in_flight` workers each calling in turn for `seconds`; latency of every request, and
    replies/s over the window alone (a straggler that times out after it does not stretch it)."""
    loop = asyncio.get_running_loop()
    outcomes = Outcomes()
    prefix = tag.encode() + b":"
    counter = itertools.count()
    started = loop.time()
    stop_at = started + seconds
    in_window = 0

    async def worker() -> None:
        nonlocal in_window
        while loop.time() < stop_at:
            code, took, detail = await call(node, prefix + str(next(counter)).encode(), timeout)
            outcomes.add(code, took, detail)
            if code == OK and loop.time() <= stop_at:
                in_window += 1
            elif code != OK:
                await asyncio.sleep(0.01)  # a failure raised at once must not spin

    await asyncio.wait_for(
        asyncio.gather(*(worker() for _ in range(in_flight))), seconds + timeout + 5.0
    )
    result = outcomes.summary(timeout)
    result.update(
        in_flight=in_flight,
        seconds=seconds,
        tail_s=loop.time() - stop_at,
        replies_in_window=in_window,
        replies_per_s=in_window / seconds,
    )
    return result


class OpenLoop:
    """Requests started on a fixed schedule, each its own task, whatever the earlier ones do.

    A single task launches them: it sleeps until the next is due and then starts every request
    that is due by now, so when it falls behind it catches up at once. Each request records
    how late it actually started (its first step on the loop) against its schedule.
    """

    def __init__(self, node: irismesh.Node, tag: str, rate: float, plan: Plan) -> None:
        self._node = node
        self._prefix = tag.encode() + b":"
        self._rate = rate
        self._plan = plan
        self.planned = max(1, round(rate * plan.seconds))
        self.outcomes = Outcomes()
        self.lags: list[float] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.start = 0.0
        self.last_started = 0.0
        self.worst_lag = 0.0
        self.worst_lag_at = 0.0  # when it happened, s from the schedule's start
        self.launched = 0
        self.gave_up = 0  # launches abandoned: the caller was too far behind
        self.loop_cpu_s = 0.0
        self.runqueue_wait_s: float | None = None  # the loop thread, runnable but not running
        self.process_cpu_s = 0.0
        self.launch_seconds = 0.0

    async def _one(self, index: int, scheduled: float) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        lag = now - scheduled
        self.lags.append(lag)
        if lag > self.worst_lag:
            self.worst_lag, self.worst_lag_at = lag, now - self.start
        self.last_started = max(self.last_started, now)
        payload = self._prefix + str(index).encode()
        code, took, detail = await call(self._node, payload, self._plan.deadline)
        self.outcomes.add(code, took, detail)

    async def launch(self) -> None:
        """Start every request on schedule; returns once the last one was started."""
        loop = asyncio.get_running_loop()
        interval = 1.0 / self._rate
        thread0, process0 = time.thread_time(), time.process_time()
        waited0 = runqueue_wait_s()
        start = self.start = loop.time() + 0.002
        give_up_at = start + self._plan.launch_limit_s()
        tasks = self.tasks

        def launch(index: int, due: float) -> None:
            task = loop.create_task(self._one(index, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        planned = self.planned
        index = await harness.on_schedule(start, interval, planned, launch, give_up_at)
        await asyncio.sleep(0)  # let the last ones take their first step
        self.launched = index
        self.gave_up = planned - index
        self.launch_seconds = loop.time() - start
        self.loop_cpu_s = time.thread_time() - thread0
        waited = runqueue_wait_s()
        if waited is not None and waited0 is not None:
            self.runqueue_wait_s = waited - waited0
        self.process_cpu_s = time.process_time() - process0

    async def finish(self) -> int:
        """Wait for the requests still in flight (bounded); returns how many had to be cancelled."""
        pending = set(self.tasks)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self._plan.deadline + 5.0)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for _ in pending:
            self.outcomes.add(NO_OUTCOME, math.nan)
        return len(pending)

    def summary(self, capacity: float) -> dict[str, Any]:
        plan = self._plan
        result = self.outcomes.summary(plan.deadline)
        lags = sorted(self.lags)
        started = len(lags)
        # Achieved rate: requests actually started over the time from the schedule's start
        # to the last start (plus one interval, so that on schedule it equals the target).
        span = (self.last_started - self.start) + 1.0 / self._rate if started else 0.0
        achieved = started / span if span > 0 else 0.0
        lag_p99 = pct(lags, 99) or 0.0
        # Kept up: started (nearly) the whole schedule, and late by little against the deadline.
        kept_up = (
            achieved >= 0.95 * self._rate and lag_p99 <= plan.deadline / 10.0 and not self.gave_up
        )
        result.update(
            target_rps=self._rate,
            planned=self.planned,
            launched=self.launched,
            gave_up=self.gave_up,
            achieved_rps=achieved,
            lag_ms={
                "p50": ms(pct(lags, 50)),
                "p99": ms(pct(lags, 99)),
                "max": ms(lags[-1] if lags else None),
                "max_at_s": self.worst_lag_at,
            },
            caller_kept_up=kept_up,
            caller_loop_cpu_percent=100.0 * self.loop_cpu_s / max(self.launch_seconds, 1e-9),
            caller_loop_runqueue_percent=(
                None
                if self.runqueue_wait_s is None
                else 100.0 * self.runqueue_wait_s / max(self.launch_seconds, 1e-9)
            ),
            caller_process_cpu_percent=100.0 * self.process_cpu_s / max(self.launch_seconds, 1e-9),
            goodput_rps=result["ok"] / plan.seconds,
            goodput_over_c=result["ok"] / plan.seconds / capacity,
        )
        return result


def runqueue_wait_s() -> float | None:
    """How long this thread has waited, runnable, for a CPU (Linux schedstat), or None."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class GcPauses:
    """The caller's garbage collections while in force (a long one delays every request)."""

    def __init__(self) -> None:
        self.collections = 0
        self.full = 0  # of the oldest generation
        self.total_s = 0.0
        self.max_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.collections += 1
        self.full += info.get("generation") == 2
        self.total_s += took
        self.max_s = max(self.max_s, took)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict[str, float]:
        return {
            "collections": self.collections,
            "full": self.full,
            "total_ms": self.total_s * 1000.0,
            "max_ms": self.max_s * 1000.0,
        }


class PeerWatch:
    """Samples the caller's view of the members (`peers(departed=True)`) every 100 ms."""

    def __init__(self, node: irismesh.Node, every: float) -> None:
        self._node = node
        self._every = every
        self.first_seen: dict[str, dict[str, float]] = {}  # state -> node id -> seconds
        self.samples = 0
        self._stop = asyncio.Event()

    async def run(self, start: float) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            now = loop.time() - start
            for peer in self._node.peers(departed=True):
                if peer.state in ("suspect", "dead"):
                    self.first_seen.setdefault(peer.state, {}).setdefault(peer.node_id, now)
            self.samples += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._every)

    def stop(self) -> None:
        self._stop.set()


async def recovery(
    node: irismesh.Node, tag: str, plan: Plan, start: float, unloaded_p50: float
) -> dict[str, Any]:
    """1 request in flight for `recovery_s` from `start`; p50 in steps of `recovery_step_s`."""
    loop = asyncio.get_running_loop()
    steps = max(1, round(plan.recovery_s / plan.recovery_step_s))
    served: list[list[float]] = [[] for _ in range(steps)]
    failed: list[Counter[str]] = [Counter() for _ in range(steps)]
    prefix = tag.encode() + b":"
    index = 0
    while loop.time() < start + plan.recovery_s:
        code, took, _ = await call(node, prefix + str(index).encode(), plan.deadline)
        index += 1
        step = int((loop.time() - start) / plan.recovery_step_s)
        if step >= steps:
            break
        if code == OK:
            served[step].append(took)
        else:
            failed[step][code] += 1
            await asyncio.sleep(0.01)
    threshold = plan.recovery_factor * unloaded_p50
    series = []
    first: int | None = None  # the first step whose p50 (of served requests) is within
    for step in range(steps):
        ordered = sorted(served[step])
        p50 = pct(ordered, 50)
        within = p50 is not None and p50 <= threshold
        if within and first is None:
            first = step
        series.append(
            {
                "until_s": (step + 1) * plan.recovery_step_s,
                "served": len(ordered),
                "p50_ms": ms(p50),
                "failures": dict(failed[step]),
                "within": within,
            }
        )
    # Failures from the first step within on: p50 of served requests says nothing of them.
    after = range(first if first is not None else steps, steps)
    failed_after = sum(sum(failed[step].values()) for step in after)
    served_after = sum(len(served[step]) for step in after)
    # Settled: every step from then on within the threshold and without a failure.
    settled_after: float | None = None
    for step in range(steps - 1, -1, -1):
        if not series[step]["within"] or failed[step]:
            break
        settled_after = step * plan.recovery_step_s
    return {
        "threshold_ms": threshold * 1000.0,
        "recovered_after_s": None if first is None else (first + 1) * plan.recovery_step_s,
        "failed_after_recovered": failed_after,
        "failed_after_recovered_percent": (
            100.0 * failed_after / (failed_after + served_after) if failed_after else 0.0
        ),
        "settled_after_s": settled_after,
        "steps": series,
    }


async def rejoin(node: irismesh.Node, count: int) -> tuple[int, float]:
    """Wait (bounded) until `count` members are live and linked; how many are, and how long."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    with contextlib.suppress(irismesh.MembershipTimeout):
        await node.wait_for_members(CLUSTER, count=count, timeout=REJOIN_S)
    return len(node.members(CLUSTER)), loop.time() - started


async def caller_main(args: argparse.Namespace, plan: Plan) -> None:
    keys = irismesh.Keyring.load(args.keyring)
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str] = harness.stdin_commands()
    seeds = args.seeds.split(",")

    async def checkpoint(name: str) -> None:
        harness.emit("checkpoint", name=name)
        line = await asyncio.wait_for(commands.get(), DRAIN_CAP_S + 30.0)
        if line != "go":
            raise harness.BenchError(f"unexpected command {line!r} at checkpoint {name}")

    async with irismesh.Node(keyring=keys, bind=BIND, seeds=seeds, survey=False) as node:
        harness.emit("progress", message=f"caller: waiting for {plan.members} member(s)")
        await node.wait_for_members(CLUSTER, count=plan.members, timeout=STARTUP_S)

        harness.emit("progress", message="baseline: unloaded p50 (1 in flight), then capacity")
        await closed_loop(node, "W", 1, plan.warmup_s, BASELINE_TIMEOUT_S)
        unloaded = await closed_loop(node, "U", 1, plan.unloaded_s, BASELINE_TIMEOUT_S)
        capacity = await closed_loop(
            node, "C", plan.capacity_in_flight, plan.capacity_seconds, BASELINE_TIMEOUT_S
        )
        c = capacity["replies_per_s"]
        unloaded_p50 = (unloaded["served_p50_ms"] or 0.0) / 1000.0
        harness.emit("baseline", unloaded=unloaded, capacity=capacity)
        if c <= 0 or unloaded_p50 <= 0:
            raise harness.BenchError(f"no capacity measured: {capacity['failures']}")

        await checkpoint("baseline")
        for index, multiple in enumerate(plan.loads):
            rate = multiple * c
            harness.emit(
                "progress",
                message=f"load {multiple:g}x C: {rate:,.0f} req/s for {plan.seconds:g} s, "
                f"then {plan.recovery_s:g} s of recovery",
            )
            # Each load starts from the whole cluster: a member declared dead by the load
            # before may take a while to be back.
            members_back, rejoin_s = await rejoin(node, plan.members)
            # The caller generates the load and must keep to its schedule: a full collection
            # of everything alive since start-up (irismesh, zmq, cryptography, ...) took over
            # 100 ms here. Collect now and move the survivors out of the collector's sight.
            gc.collect()
            gc.freeze()
            tag = f"L{index}"
            counters_before = pick(node.stats, SUSPICION_PREFIXES)
            watch = PeerWatch(node, plan.peers_every_s)
            opened = OpenLoop(node, tag, rate, plan)
            harness.emit("mark", index=index)
            watching = loop.create_task(watch.run(loop.time()))
            with GcPauses() as gc_pauses:
                await opened.launch()
                harness.emit("mark_end", index=index)
                recovered = await recovery(node, f"R{index}", plan, loop.time(), unloaded_p50)
                unfinished = await opened.finish()
            watch.stop()
            await asyncio.wait_for(watching, 5.0)
            counters = delta(counters_before, pick(node.stats, SUSPICION_PREFIXES))
            result = opened.summary(c)
            result.update(
                index=index,
                tag=tag,
                members_at_start=members_back,
                rejoin_s=rejoin_s,
                multiple=multiple,
                unfinished=unfinished,
                recovery=recovered,
                caller_gc=gc_pauses.summary(),
                peers_seen=watch.first_seen,
                peer_samples=watch.samples,
                caller_counters={k: v for k, v in counters.items() if v},
            )
            harness.emit("load", **result)
            await checkpoint(f"after {tag}")
    harness.emit("done")


def run_child(args: argparse.Namespace) -> None:
    harness.exit_after(args.max_seconds)
    if args.role == "member":
        asyncio.run(member_main(args))
        return
    fields = json.loads(args.plan)
    plan = Plan(**{**fields, "loads": tuple(fields["loads"])})
    try:
        asyncio.run(caller_main(args, plan))
    except BaseException as exc:
        harness.emit("error", message=f"{type(exc).__name__}: {exc}")
        raise


# ============================================================================================
# Parent: orchestration


@dataclass(kw_only=True, slots=True)
class Member:
    name: str
    child: harness.Child
    cost_ms: float
    endpoint: str = ""
    node_id: str = ""
    seq: int = 0

    def tell(self, line: str) -> None:
        stdin = self.child.proc.stdin
        if stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            stdin.write(line.encode() + b"\n")
            stdin.flush()


def tell(child: harness.Child, line: str) -> None:
    stdin = child.proc.stdin
    if stdin is None:
        raise harness.ChildFailed(child.name, "no stdin to write to")
    try:
        stdin.write(line.encode() + b"\n")
        stdin.flush()
    except (OSError, ValueError) as exc:
        raise harness.ChildFailed(
            child.name, f"cannot write to it: {exc}", child.stderr_tail()
        ) from exc


class MemberCounts:
    """The members' handler runs by tag and counters, asked for on stdin (`counts SEQ`).

    A member answers on its event loop, so one whose loop is busy with a backlog answers only
    once it gets a turn; at most one question is outstanding per member. Every answer is kept
    with the time it arrived, and for each (member, tag) the arrival of the first answer that
    showed its latest run count: after the member stops running a tag's handlers, that is when
    it was seen idle for that tag.
    """

    def __init__(self, members: Sequence[Member]) -> None:
        self.members = members
        self.latest: dict[str, dict[str, Any] | None] = {m.name: None for m in members}
        self._answered = {m.name: 0 for m in members}
        self._runs_seen: dict[tuple[str, str], int] = {}
        self.changed_at: dict[tuple[str, str], float] = {}
        self.history: list[tuple[float, str, dict[str, int]]] = []  # (arrival, member, runs)

    def ask(self) -> None:
        for member in self.members:
            if self._answered[member.name] >= member.seq:
                member.seq += 1
                member.tell(f"counts {member.seq}")

    def _read(self, member: Member, until: float) -> bool:
        """Read its answers until the latest question is answered (True) or `until` (False)."""
        while self._answered[member.name] < member.seq:
            line = member.child.next_line(until)
            if line is None:
                return False
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") != "counts":
                continue
            at = time.monotonic()
            self.history.append((at, member.name, event["runs"]))
            for tag, runs in event["runs"].items():
                key = (member.name, tag)
                if self._runs_seen.get(key) != runs:
                    self._runs_seen[key] = runs
                    self.changed_at[key] = at
            self.latest[member.name] = event
            self._answered[member.name] = int(event["seq"])
        return True

    def poll(self) -> None:
        """Take the answers already there, and ask again whoever has answered; never waits."""
        for member in self.members:
            self._read(member, 0.0)
        self.ask()

    def fresh(self, timeout: float) -> bool:
        """Ask, and wait up to `timeout` s for every member's answer; whether all came."""
        self.ask()
        deadline = time.monotonic() + timeout
        return all([self._read(member, deadline) for member in self.members])

    def totals(self) -> tuple[int, ...]:
        return tuple(
            sum(answer["runs"].values()) if answer is not None else -1
            for answer in self.latest.values()
        )

    def idle_since(self, tag: str) -> float | None:
        """When the last member running `tag`'s handlers was first seen with its final count."""
        times = [at for (_, t), at in self.changed_at.items() if t == tag]
        return max(times) if times else None


@dataclass(kw_only=True, slots=True)
class Drained:
    counts: dict[str, dict[str, Any] | None]  # by member; None: it never answered
    settled: bool  # every member answered twice, 0.3 s apart, with the same total
    took_s: float


def drain(counts: MemberCounts, limit: float) -> Drained:
    """Wait (at most `limit` s) until no member runs handlers any more: a backlog of requests
    the caller gave up on long ago may still be running."""
    started = time.monotonic()
    deadline = started + limit
    previous: tuple[int, ...] | None = None
    while True:
        answered = counts.fresh(max(0.5, min(5.0, deadline - time.monotonic())))
        totals = counts.totals()
        now = time.monotonic()
        if answered and totals == previous:
            return Drained(counts=dict(counts.latest), settled=True, took_s=now - started)
        if now >= deadline:
            return Drained(counts=dict(counts.latest), settled=False, took_s=now - started)
        previous = totals if answered else None
        time.sleep(0.3)


def child_argv(role: str, keyring: str, budget: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--role",
        role,
        "--keyring",
        keyring,
        "--max-seconds",
        f"{budget:.0f}",
        *extra,
    ]


def run_scenario(name: str, plan: Plan, keyring: str) -> dict[str, Any]:
    costs = [plan.cost_ms * factor for factor in SCENARIOS[name]]
    result: dict[str, Any] = {"scenario": name, "loads": []}
    began = time.monotonic()
    budget = plan.budget_s()
    # The longest the caller may stay silent: start-up, baseline, or one load and recovery.
    silence = max(STARTUP_S + 15.0, plan.baseline_budget_s(), plan.load_budget_s()) + 5.0
    with harness.ChildProcesses() as procs:
        members = [
            Member(
                name=f"m{k + 1}",
                cost_ms=cost,
                child=procs.spawn(
                    f"member m{k + 1}",
                    child_argv("member", keyring, budget + 30.0, "--cost-ms", repr(cost)),
                ),
            )
            for k, cost in enumerate(costs)
        ]
        for member in members:
            ready = member.child.expect_prefix("READY ", STARTUP_S)
            member.endpoint, member.node_id = ready.split()
        result["members"] = [
            {"name": m.name, "cost_ms": m.cost_ms, "node_id": m.node_id, "endpoint": m.endpoint}
            for m in members
        ]
        plan_json = json.dumps(dataclasses.asdict(plan))
        argv = child_argv("caller", keyring, budget, "--plan", plan_json)
        seeds = ",".join(m.endpoint for m in members)
        caller = procs.spawn("caller", [*argv, "--seeds", seeds])
        pids = {m.name: m.child.pid for m in members} | {"caller": caller.pid}
        sampler: harness.RssSampler | None = None
        cpu: dict[int, dict[str, Any]] = {}
        ended_at: dict[int, float] = {}  # time.monotonic() at the end of each load's launches
        drain_limit = DRAIN_SLACK_S
        checkpoints: list[dict[str, Any]] = []
        counts = MemberCounts(members)
        polling = False  # from the end of a load to its checkpoint: when do members go idle?
        heard = time.monotonic()
        while True:
            until = heard + silence
            if polling:
                until = min(until, time.monotonic() + POLL_S)
            line = caller.next_line(until)
            if line is None:
                if time.monotonic() >= heard + silence:
                    raise harness.ChildFailed(
                        "caller", f"silent for {silence:.0f} s", caller.stderr_tail()
                    )
                counts.poll()
                continue
            heard = time.monotonic()
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                harness.progress(f"  caller: {line}")
                continue
            kind = event.pop("event", None)
            if kind == "progress":
                harness.progress(f"[{name}] {event['message']}")
            elif kind == "baseline":
                result["baseline"] = event
                cap, unl = event["capacity"], event["unloaded"]
                harness.progress(
                    f"[{name}] C = {cap['replies_per_s']:,.0f} replies/s "
                    f"(8 in flight, p50 {cap['served_p50_ms']:.2f} ms); "
                    f"unloaded p50 {unl['served_p50_ms']:.2f} ms"
                )
            elif kind == "mark":
                sampler = harness.RssSampler(pids)
                sampler.sample()
            elif kind == "mark_end" and sampler is not None:
                ended_at[event["index"]] = time.monotonic()
                polling = True
                counts.poll()
                sampler.sample()
                cpu[event["index"]] = {
                    "cpu_percent": {
                        role: 100.0 * s["cpu_s"] / max(s["seconds"], 1e-9)
                        for role, s in sampler.summary().items()
                    },
                    "others_cpu_percent": sampler.others_cpu_percent(),
                }
                sampler = None
            elif kind == "load":
                event.update(cpu.get(event["index"], {}))
                result["loads"].append(event)
                backlog_s = event["planned"] * max(costs) / 1000.0
                drain_limit = min(DRAIN_CAP_S, backlog_s + DRAIN_SLACK_S)
                harness.progress(
                    f"[{name}] {event['multiple']:g}x: goodput/C "
                    f"{event['goodput_over_c']:.2f}, failures {event['failures'] or 0}"
                )
            elif kind == "checkpoint":
                harness.progress(
                    f"[{name}] waiting (at most {drain_limit:.0f} s) for the members to finish "
                    "their backlog ..."
                )
                polling = False
                drained = drain(counts, drain_limit)
                checkpoints.append(
                    {
                        "name": event["name"],
                        "counts": drained.counts,
                        "settled": drained.settled,
                        "took_s": drained.took_s,
                        "limit_s": drain_limit,
                    }
                )
                if result["loads"]:
                    load = result["loads"][-1]
                    end = ended_at.get(load["index"])
                    idle = counts.idle_since(load["tag"])
                    settled = drained.settled
                    busy = idle - end if settled and idle is not None and end else None
                    load["busy_after_s"] = busy
                    load["drain_settled"] = settled
                if not drained.settled:
                    harness.progress(
                        f"[{name}] members still busy after {drain_limit:.0f} s; going on"
                    )
                drain_limit = DRAIN_SLACK_S
                tell(caller, "go")
            elif kind == "error":
                with contextlib.suppress(Exception):
                    caller.proc.wait(timeout=5.0)
                raise harness.ChildFailed(
                    "caller", event.get("message", "failed"), caller.stderr_tail()
                )
            elif kind == "done":
                break
    result["checkpoints"] = checkpoints
    # When each load ended and every answer the members gave, in s from the scenario's start.
    result["timeline"] = {
        "loads_ended_at_s": {str(i): at - began for i, at in ended_at.items()},
        "member_runs": [[at - began, m, runs] for at, m, runs in counts.history],
    }
    account(result, members, checkpoints)
    return result


def account(
    result: dict[str, Any], members: Sequence[Member], checkpoints: list[dict[str, Any]]
) -> None:
    """Per load: handler runs (from each member's latest counts: a backlog may run on into
    later phases), wasted runs, and the members' counter deltas between the checkpoints around
    the load."""
    latest: dict[str, dict[str, int]] = {}  # runs are cumulative: the last answer has them all
    for checkpoint in checkpoints:
        for m in members:
            answer = checkpoint["counts"].get(m.name)
            if answer is not None:
                latest[m.name] = answer["runs"]
    last = checkpoints[-1] if checkpoints else None
    result["counts_complete"] = (
        last is not None
        and bool(last["settled"])
        and all(last["counts"].get(m.name) is not None for m in members)
    )
    for load in result["loads"]:
        tag, index = load["tag"], load["index"]
        runs = {m.name: int(latest.get(m.name, {}).get(tag, 0)) for m in members}
        total = sum(runs.values())
        load["handler_runs"] = runs
        load["handler_runs_total"] = total
        load["wasted_percent"] = 100.0 * (total - load["ok"]) / total if total else None
        member_counters: dict[str, dict[str, dict[str, int]]] = {}
        if index + 1 < len(checkpoints):
            before, after = checkpoints[index]["counts"], checkpoints[index + 1]["counts"]
            for m in members:
                b, a = before.get(m.name), after.get(m.name)
                if a is None or b is None:
                    continue
                member_counters[m.name] = {
                    "before": b["stats"],
                    "after": a["stats"],
                    "delta": delta(b["stats"], a["stats"]),
                }
        load["member_counters"] = member_counters


# ============================================================================================
# Parent: report


def fmt(value: float | None, spec: str = ".1f", absent: str = "-") -> str:
    return absent if value is None else format(value, spec)


def failures_cell(failures: Mapping[str, int]) -> str:
    if not failures:
        return "none"
    return ", ".join(f"{name} {count:,}" for name, count in failures.items())


def peers_cell(load: Mapping[str, Any], ids: Mapping[str, str]) -> str:
    parts = []
    for state in ("suspect", "dead"):
        seen: dict[str, float] = load["peers_seen"].get(state, {})
        if seen:
            who = ",".join(ids.get(node, node[:8]) for node in sorted(seen, key=seen.__getitem__))
            parts.append(f"{state} {who} @{min(seen.values()):.1f}s")
    counters = load["caller_counters"]
    if counters:
        parts.append(" ".join(f"{k} +{v}" for k, v in counters.items()))
    return "; ".join(parts) if parts else "no"


def recovery_cell(recovery: Mapping[str, Any], window: float) -> str:
    after = recovery["recovered_after_s"]
    if after is None:
        return f"> {window:g}"
    failed = recovery["failed_after_recovered_percent"]
    return f"{after:.2f} ({failed:.0f}% failed)" if failed else f"{after:.2f}"


def busy_cell(load: Mapping[str, Any]) -> str:
    busy = load.get("busy_after_s")
    if busy is not None:
        return f"{max(busy, 0.0):.1f}"
    return "?" if load.get("drain_settled") is None else "not idle"


def print_scenario(result: Mapping[str, Any], plan: Plan, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    name = result["scenario"]
    ids = {m["node_id"]: m["name"] for m in result["members"]}
    members = ", ".join(f"{m['name']} {m['cost_ms']:g} ms" for m in result["members"])
    base = result.get("baseline")
    if base is None:
        return
    cap, unl = base["capacity"], base["unloaded"]
    baseline_failures = {
        phase: failures_cell(base[phase]["failures"])
        for phase in ("unloaded", "capacity")
        if base[phase]["failures"]
    }
    failed_text = "".join(
        f"; {what} failed while measuring {p}" for p, what in baseline_failures.items()
    )
    table = Table(
        title=f"scenario {name}: {members}; C = {cap['replies_per_s']:,.0f} replies/s "
        f"({plan.capacity_in_flight} in flight, p50 {fmt(cap['served_p50_ms'], '.2f')} ms), "
        f"unloaded p50 {fmt(unl['served_p50_ms'], '.2f')} ms; deadline {plan.deadline:g} s, "
        f"{plan.seconds:g} s per load{failed_text}",
    )
    for column, justify in (
        ("load", "right"),
        ("offered req/s (achieved)", "right"),
        ("goodput / C", "right"),
        ("wasted runs", "right"),
        ("failure median ms", "right"),
        ("served p99 ms", "right"),
        ("failures", "left"),
        ("suspected / dead", "left"),
        ("recovery s", "right"),
        ("busy after s", "right"),
        ("caller lag p99 ms", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for load in result["loads"]:
        wasted = load.get("wasted_percent")
        lag = fmt(load["lag_ms"]["p99"], ".1f")
        row = [
            f"{load['multiple']:g}x",
            f"{load['target_rps']:,.0f} ({load['achieved_rps']:,.0f})",
            f"{load['goodput_over_c']:.2f}",
            f"{wasted:.0f}%" if wasted is not None else "-",
            fmt(load["failure_median_ms"], ".0f"),
            fmt(load["served_p99_ms"], ".1f"),
            failures_cell(load["failures"]),
            peers_cell(load, ids),
            recovery_cell(load["recovery"], plan.recovery_s),
            busy_cell(load),
            lag if load["caller_kept_up"] else f"{lag} BEHIND",
        ]
        table.add_row(*(Text(cell) for cell in row))
    console.print(table)
    for load in result["loads"]:
        head = f"  {load['multiple']:g}x"
        cpu = load.get("cpu_percent", {})
        if not load["caller_kept_up"]:
            queued = load.get("caller_loop_runqueue_percent")
            waited = "" if queued is None else f" and waited for a CPU {queued:.0f}% of the time"
            console.print(
                f"{head}: the caller could not keep up: it started "
                f"{load['achieved_rps']:,.0f} of {load['target_rps']:,.0f} req/s, lag p99 "
                f"{fmt(load['lag_ms']['p99'])} ms, max {fmt(load['lag_ms']['max'])} ms, "
                f"{load['gave_up']:,} never started; its loop used "
                f"{load['caller_loop_cpu_percent']:.0f}% of a core{waited}; its longest "
                f"garbage collection took {load['caller_gc']['max_ms']:.0f} ms",
                markup=False,
                highlight=False,
            )
        total = len(result["members"])
        if load["members_at_start"] < total or load["rejoin_s"] >= 0.5:
            console.print(
                f"{head}: {load['members_at_start']} of {total} member(s) live at its start, "
                f"after waiting {load['rejoin_s']:.1f} s for them",
                markup=False,
                highlight=False,
            )
        for member in result["members"]:
            m = member["name"]
            runs = load["handler_runs"].get(m, 0)
            counters = load["member_counters"].get(m)
            if counters is None:
                shown = "counters not available (member did not answer)"
            else:
                moved = {
                    k: v for k, v in counters["delta"].items() if k.startswith(MEMBER_PREFIXES)
                }
                changed = [f"{k} {v:+,}" for k, v in moved.items() if v]
                unchanged = ", ".join(k for k, v in moved.items() if not v) or "none"
                shown = ", ".join(changed) if changed else f"counters unchanged ({unchanged})"
            member_cpu = cpu.get(m)
            cpu_text = f"CPU {member_cpu:.0f}%, " if member_cpu is not None else ""
            console.print(
                f"{head} {m} ({member['cost_ms']:g} ms): {cpu_text}{runs:,} handler runs; {shown}",
                markup=False,
                highlight=False,
            )
        others = load.get("others_cpu_percent")
        if others is not None:
            console.print(
                f"{head} caller CPU {cpu.get('caller', 0.0):.0f}% (loop thread "
                f"{load['caller_loop_cpu_percent']:.0f}%), others' CPU {others:.0f}% of the "
                "machine",
                markup=False,
                highlight=False,
            )
    if not result.get("counts_complete", False):
        console.print(
            "  note: the members had not finished their backlog (or did not answer) at the "
            "end, so handler runs and wasted runs are lower bounds",
            markup=False,
            highlight=False,
        )


# ============================================================================================
# Parent: main


def main_parent(args: argparse.Namespace) -> int:
    harness.raise_keyboard_interrupt_on_sigterm()
    facts = harness.machine_facts(busy=True)
    results: dict[str, Any] = {}
    failed: dict[str, str] = {}
    plans: dict[str, Plan] = {}
    started = time.monotonic()
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=180)
    with tempfile.TemporaryDirectory(prefix="irismesh-overload-") as tmp:
        keyring = os.path.join(tmp, "bench.keys")
        irismesh.Keyring.generate().save(keyring)
        try:
            for name in args.scenarios:
                plan = plans[name] = Plan(
                    members=len(SCENARIOS[name]),
                    cost_ms=args.cost,
                    loads=tuple(args.loads),
                    seconds=args.seconds,
                    deadline=args.deadline,
                    capacity_seconds=args.capacity_seconds,
                )
                harness.progress(f"scenario {name}: {len(SCENARIOS[name])} member(s) ...")
                try:
                    results[name] = run_scenario(name, plan, keyring)
                except harness.BenchError as exc:
                    failed[name] = str(exc)
                    harness.progress(f"scenario {name}: FAILED: {exc}")
        except KeyboardInterrupt:
            harness.progress("interrupted; every child process has been stopped")
            return 130
    elapsed = time.monotonic() - started
    for name, result in results.items():
        print_scenario(result, plans[name], console)
    for name, reason in failed.items():
        console.print(
            f"scenario {name}: FAILED: {reason.splitlines()[0]}", markup=False, highlight=False
        )
    if args.json:
        document = {
            "facts": facts,
            "settings": {
                "scenarios": list(args.scenarios),
                "plans": {name: dataclasses.asdict(plan) for name, plan in plans.items()},
                "drain_slack_s": DRAIN_SLACK_S,
                "drain_cap_s": DRAIN_CAP_S,
            },
            "results": results,
            "failed": failed,
            "elapsed_s": elapsed,
        }
        harness.write_json(args.json, document)
    return 1 if failed else 0


def load_list(text: str) -> list[float]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("give at least one multiple of C, e.g. 2,5,10")
    loads = [harness.positive_float(part) for part in parts]
    if any(load > 100 for load in loads):
        raise argparse.ArgumentTypeError("multiples above 100x C are not supported")
    return loads


def scenario_list(text: str) -> list[str]:
    chosen = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or '(none)'}; choose from {', '.join(SCENARIOS)}"
        )
    return [name for name in SCENARIOS if name in chosen]


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__)
    positive = functools.partial(parser.add_argument, type=harness.positive_float)
    parser.add_argument(
        "--scenarios",
        type=scenario_list,
        default=list(SCENARIOS),
        help="comma-separated: one, three (default both)",
    )
    parser.add_argument(
        "--loads",
        type=load_list,
        default=None,
        help="offered load as multiples of the capacity C, comma-separated (default 2,5,10; "
        "5 with --quick)",
    )
    positive(
        "--seconds",
        default=None,
        help="length of each overload (default 4; 2 with --quick)",
    )
    positive(
        "--deadline",
        default=0.5,
        help="timeout of each request, s (default 0.5)",
    )
    positive(
        "--cost",
        default=2.0,
        help="CPU each handler run burns, ms (default 2)",
    )
    positive(
        "--capacity-seconds",
        default=None,
        help="length of the capacity measurement (default 3; 2 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="one load (5x), 2 s: a smoke test")
    # The children's side of this file.
    harness.add_child_arguments(parser, ("member", "caller"))
    parser.add_argument("--cost-ms", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seeds", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    parser = build_parser()
    args = harness.parse_args(parser)
    if args.role:
        run_child(args)
        return 0
    if args.loads is None:
        args.loads = [5.0] if args.quick else [2.0, 5.0, 10.0]
    if args.seconds is None:
        args.seconds = 2.0 if args.quick else 4.0
    if args.capacity_seconds is None:
        args.capacity_seconds = 2.0 if args.quick else 3.0
    slowest = args.cost * max(max(SCENARIOS[name]) for name in args.scenarios)
    if slowest >= args.deadline * 1000.0:
        parser.error(
            f"--cost {args.cost:g} ms makes the slowest member's handler ({slowest:g} ms) "
            f"take longer than --deadline ({args.deadline:g} s)"
        )
    if args.seconds > 600 or args.capacity_seconds > 600:
        parser.error("--seconds and --capacity-seconds are limited to 600")
    if args.capacity_seconds < 0.5:
        parser.error("--capacity-seconds must be at least 0.5")
    if args.deadline > 30:
        parser.error("--deadline is limited to 30 s")
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
