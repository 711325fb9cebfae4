"""Tunnel benchmark: one stream from a sender process to a receiver process, irismesh beside pyzmq.

    python bench/tunnel.py [--size 512M] [--blocks 64K,1M] [--only raw,mesh,mesh-null]
                           [--window 4M] [--checksum crc32|sha256] [--json out.json]

For each block size, a sender process streams `--size` bytes in blocks of that size to a
receiver process, both on 127.0.0.1, and nothing may be lost or changed: the receiver counts
the bytes and blocks and keeps a checksum of everything it got (zlib.crc32 chained over the
blocks by default, SHA-256 with `--checksum sha256`), the sender computes the same over what it
sends, and the run fails (exit status 1) if they differ. Memory must stay bounded whatever the
size: raw pyzmq gets credit from its receiver, irismesh's tunnel has its own byte window.
Every case starts fresh processes. The parent only orchestrates: it starts the children,
relays progress, samples their RSS and CPU time while they stream and prints the table.
bench/README.md says how to read it. The same file is the children's program (`--role`).
"""

import argparse
import dataclasses
import faulthandler
import functools
import hashlib
import json
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import _harness as harness
import zmq

SYSTEMS = ("raw", "mesh", "mesh-null")
LABELS = {"raw": "raw pyzmq", "mesh": "irismesh", "mesh-null": "irismesh, null sealer"}
# irismesh runs sealed (the default); mesh-null changes only that, so what sealing costs is
# irismesh's figure beside mesh-null's, measured in the same run.
MESH_SEALING = {"mesh": True, "mesh-null": False}
ALIASES = {"irismesh": "mesh", "pyzmq": "raw"}
CLUSTER = "sink"
CHECKSUMS = ("crc32", "sha256")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_BLOCK = 64 << 20  # irismesh's default max_message for a tunnel
POOL = 4  # distinct blocks the sender cycles through, so that reordering changes the checksum
SAMPLE_EVERY = 0.05  # seconds between RSS/CPU samples while a case streams
MB = 1_000_000  # MB/s are decimal, sizes binary (KiB, MiB, GiB)
ROLES = ("sender", "receiver")

# Raw pyzmq messages from the receiver to the sender: one kind byte, then the body.
CREDIT = b"C"  # + 8 bytes little-endian: the sender may send while it has sent less than this
REPORT = b"R"  # + the receiver's report, JSON


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What one sender and its receiver run: one block size."""

    block: int
    total: int
    window: int  # raw pyzmq: bytes the sender may have sent beyond what the receiver consumed
    checksum: str
    idle_timeout_s: float  # a child that moves no byte for this long reports a stall and exits
    join_timeout_s: float = 10.0

    @property
    def count(self) -> int:
        return -(-self.total // self.block)

    def budget_s(self) -> float:
        """A hard ceiling on one case: generous (4 MB/s), but finite."""
        return 2 * self.join_timeout_s + self.total / (4 * MB) + 2 * self.idle_timeout_s + 30.0


def size_label(size: int) -> str:
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size:,} B"


def parse_size(text: str, option: str) -> int:
    """`1048576`, `64K`, `1M`, `1.5G`, `512MiB`, `1GB`: binary units, B optional."""
    clean = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = clean[-1] if clean and clean[-1] in "KMGT" else ""
    try:
        value = int(float(clean[: len(clean) - len(unit)]) * UNITS[unit])
    except (ValueError, OverflowError):
        raise SystemExit(f"{option}: not a size: {text!r} (e.g. 64K, 1M, 512M, 1G)") from None
    if value < 1:
        raise SystemExit(f"{option}: a size must be at least 1 byte, got {text!r}")
    return value


# ============================================================================================
# Children: both sides


def block_pool(block: int) -> list[bytes]:
    """POOL different blocks of `block` bytes: rotations of 0..255, cheap and not all zeros."""
    pattern = bytes(range(256)) * (block // 256 + 2)
    return [pattern[k * 61 % 256 : k * 61 % 256 + block] for k in range(POOL)]


def blocks(plan: Plan) -> Iterator[bytes]:
    """The stream: `plan.total` bytes in blocks of `plan.block`, the last one shorter if need be."""
    pool = block_pool(plan.block)
    full, tail = divmod(plan.total, plan.block)
    for i in range(full):
        yield pool[i % POOL]
    if tail:
        yield pool[full % POOL][:tail]


def checksum(kind: str) -> tuple[Callable[[bytes], None], Callable[[], str]]:
    """(update, hex value) of a running checksum: zlib.crc32 chained over blocks, or SHA-256."""
    if kind == "sha256":
        digest = hashlib.sha256()
        return digest.update, digest.hexdigest
    crc = 0

    def update(data: bytes) -> None:
        nonlocal crc
        crc = zlib.crc32(data, crc)

    def value() -> str:
        return f"{crc:08x}"

    return update, value


def expected_checksum(plan: Plan) -> str:
    """What the receiver must report: the sender's own pass, before the measured stream."""
    update, value = checksum(plan.checksum)
    for block in blocks(plan):
        update(block)
    return value()


class Watchdog:
    """Ends a child whose stream stalls: an error event, every thread's stack, exit status 4.

    The streaming loop bumps `moved`; while armed, a thread checks that it changes at least once
    every `idle_s` seconds. A thread, not a task: it fires even if the event loop is stuck.
    """

    def __init__(self, who: str, idle_s: float) -> None:
        self.who = who
        self.idle_s = idle_s
        self.moved = 0  # bytes sent or received so far
        self.state = "starting"
        self._armed = False
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def arm(self, state: str) -> None:
        self.state = state
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def _watch(self) -> None:
        seen, since = -1, time.monotonic()
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            if not self._armed or self.moved != seen:
                seen, since = self.moved, now
                continue
            if now - since >= self.idle_s:
                harness.emit(
                    "error",
                    message=f"{self.who} stalled: nothing moved for {self.idle_s:g} s after "
                    f"{self.moved:,} bytes ({self.state})",
                )
                print(f"{self.who} stalled while {self.state}; thread stacks:", file=sys.stderr)
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(4)


class Sending:
    """The sender's record: when the measured stream started and what it cost."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.expected = expected_checksum(plan)
        self.t0 = 0.0
        self.cpu0 = 0.0

    def start(self) -> None:
        harness.emit("start")
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def finish(self, sent: int, count: int, report: dict[str, Any]) -> None:
        """Called once the receiver's report arrived: it had every byte by then."""
        seconds = time.perf_counter() - self.t0
        harness.emit(
            "done",
            sent=sent,
            blocks=count,
            seconds=seconds,
            cpu_s=time.process_time() - self.cpu0,
            expected=self.expected,
            report=report,
            peak_rss_mb=harness.peak_rss_mb(),
        )


class Receipt:
    """The receiver's count and checksum of what arrived."""

    __slots__ = ("blocks", "cpu0", "received", "t_first", "update", "value")

    def __init__(self, kind: str) -> None:
        self.update, self.value = checksum(kind)
        self.received = 0
        self.blocks = 0
        self.t_first = 0.0
        self.cpu0 = 0.0

    def first(self) -> None:
        self.t_first = time.time()
        self.cpu0 = time.process_time()

    def report(self) -> dict[str, Any]:
        report = {
            "received": self.received,
            "blocks": self.blocks,
            "checksum": self.value(),
            "t_first": self.t_first,
            "t_last": time.time(),
            "cpu_s": time.process_time() - self.cpu0,
            "peak_rss_mb": harness.peak_rss_mb(),
        }
        harness.emit("result", **report)
        return report


# ============================================================================================
# Children: raw pyzmq, DEALER -> ROUTER with credit in bytes on the same pair


def send_raw(endpoint: str, plan: Plan) -> None:
    record = Sending(plan)
    watch = Watchdog("sender", plan.idle_timeout_s)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = 0  # credit bounds what is queued
    sock.rcvhwm = 0
    sock.rcvtimeo = int(plan.join_timeout_s * 1000)
    sock.connect(endpoint)
    sock.send(b"H")  # hello: the receiver learns our routing id and grants the first window
    try:
        hello = sock.recv()
    except zmq.Again:
        raise harness.BenchError(
            f"no window from the receiver within {plan.join_timeout_s:g} s"
        ) from None
    if hello[:1] != CREDIT:
        raise harness.BenchError(f"expected the first window, got {hello[:40]!r}")
    allowed = int.from_bytes(hello[1:], "little")
    sock.rcvtimeo = -1  # the watchdog reports a stall
    print("READY", flush=True)

    send, recv = sock.send, sock.recv

    def wait_for_credit() -> int:
        grant = recv()
        while True:
            if grant[:1] != CREDIT:
                raise harness.BenchError(f"expected credit, got {grant[:40]!r}")
            newest = int.from_bytes(grant[1:], "little")
            try:
                grant = recv(zmq.NOBLOCK)
            except zmq.Again:
                return newest

    record.start()
    watch.arm("sending, or waiting for credit")
    sent = count = 0
    for block in blocks(plan):
        while sent >= allowed:  # may overdraw by one block, like the tunnel's last chunk
            allowed = max(allowed, wait_for_credit())
        send(block)
        sent += len(block)
        count += 1
        watch.moved = sent
    send(b"")  # the end of the stream
    watch.state = "waiting for the receiver's report"
    while (answer := recv())[:1] != REPORT:
        pass  # credit that came after the last block
    watch.disarm()
    record.finish(sent, count, json.loads(answer[1:]))
    harness.park()


def recv_raw(plan: Plan) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.sndhwm = 0
    sock.rcvhwm = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"READY tcp://127.0.0.1:{port}", flush=True)
    who, _hello = sock.recv_multipart()
    window = plan.window
    sock.send_multipart([who, CREDIT + window.to_bytes(8, "little")])

    watch = Watchdog("receiver", plan.idle_timeout_s)
    watch.arm("receiving")
    receipt = Receipt(plan.checksum)
    update = receipt.update
    recv, send = sock.recv_multipart, sock.send_multipart
    quarter = max(1, window // 4)  # credit goes back a quarter window at a time
    received = granted = count = 0
    while True:
        _who, data = recv()
        if not data:
            break
        if not count:
            receipt.first()
        update(data)
        received += len(data)
        count += 1
        if received - granted >= quarter:
            granted = received
            send([who, CREDIT + (received + window).to_bytes(8, "little")])
        watch.moved = received
    watch.disarm()
    receipt.received, receipt.blocks = received, count
    send([who, REPORT + json.dumps(receipt.report()).encode()])
    harness.park()


# ============================================================================================
# Children: irismesh, one tunnel


async def send_mesh(system: str, endpoint: str, keyring_path: str, plan: Plan) -> None:
    import irismesh

    record = Sending(plan)
    watch = Watchdog("sender", plan.idle_timeout_s)
    keys = irismesh.Keyring.load(keyring_path)
    node = irismesh.Node(
        keyring=keys, seeds=[endpoint], telemetry=False, sealing=MESH_SEALING[system]
    )
    async with node:
        await node.wait_for_members(CLUSTER, 1, timeout=plan.join_timeout_s)
        async with node.tunnel(CLUSTER, timeout=5) as tunnel:
            print("READY", flush=True)
            send = tunnel.send
            record.start()
            watch.arm("in tunnel.send")
            sent = count = 0
            for block in blocks(plan):
                await send(block)
                sent += len(block)
                count += 1
                watch.moved = sent
            watch.state = "in tunnel.send_eof"
            await tunnel.send_eof()
            watch.state = "in tunnel.recv, waiting for the receiver's report"
            answer = await tunnel.recv()
            watch.disarm()
            record.finish(sent, count, json.loads(answer))
        await harness.park_async()


async def recv_mesh(system: str, keyring_path: str, plan: Plan) -> None:
    import irismesh

    watch = Watchdog("receiver", plan.idle_timeout_s)
    keys = irismesh.Keyring.load(keyring_path)
    node = irismesh.Node(CLUSTER, keyring=keys, telemetry=False, sealing=MESH_SEALING[system])
    async with node:

        @node.on_tunnel
        async def sink(tunnel: irismesh.Tunnel) -> None:
            # irismesh logs a handler's exception and resets the tunnel; the parent wants it.
            try:
                watch.arm("in tunnel.recv")
                receipt = Receipt(plan.checksum)
                update = receipt.update
                received = count = 0
                async for block in tunnel:
                    if not count:
                        receipt.first()
                    update(block)
                    received += len(block)
                    count += 1
                    watch.moved = received
                receipt.received, receipt.blocks = received, count
                report = receipt.report()
                watch.state = "in tunnel.send, sending the report"
                await tunnel.send(json.dumps(report).encode())
                watch.disarm()
            except BaseException as exc:
                harness.emit("error", message=f"tunnel handler: {type(exc).__name__}: {exc}")
                raise

        print("READY", node.endpoint, flush=True)
        await harness.park_async()


def run_child(args: argparse.Namespace) -> None:
    plan = Plan(**json.loads(args.plan))
    side: Callable[[], object] | Coroutine[Any, Any, None]
    if args.system == "raw" and args.role == "send":
        side = functools.partial(send_raw, args.endpoint, plan)
    elif args.system == "raw":
        side = functools.partial(recv_raw, plan)
    elif args.role == "send":
        side = send_mesh(args.system, args.endpoint, args.keyring, plan)
    else:
        side = recv_mesh(args.system, args.keyring, plan)
    harness.child_main(args.max_seconds, side)


# ============================================================================================
# Parent: orchestration


@dataclass(kw_only=True, slots=True)
class TunnelRun(harness.Run):
    """Settings of one benchmark run; its results are system -> block size -> case."""

    # system -> block size -> why the case failed
    failures: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def extra_json(self) -> dict[str, Any]:
        return {"failures": self.failures}

    def fail(self, system: str, plan: Plan, reason: str) -> None:
        self.failures.setdefault(system, {})[str(plan.block)] = reason
        self.failed.setdefault(system, f"{size_label(plan.block)} blocks: {reason}")


def child_argv(role: str, system: str, run: TunnelRun, plan: Plan, endpoint: str = "") -> list[str]:
    options = ["--plan", json.dumps(dataclasses.asdict(plan)), "--endpoint", endpoint]
    options += ["--max-seconds", f"{plan.budget_s() + 30:.0f}"]
    return run.child_argv(__file__, role, system, *options)


def describe(system: str, plan: Plan) -> str:
    return (
        f"{LABELS[system]}: {size_label(plan.total)} in {plan.count:,} blocks of "
        f"{size_label(plan.block)} ..."
    )


def collect(
    sender: harness.Child, receiver: harness.Child, plan: Plan
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Read both children's events until both reported, sampling them while they stream."""
    events = harness.Events([sender, receiver], plan.budget_s(), sample_every=SAMPLE_EVERY)
    done: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    for _, kind, event in events:
        if kind == "start":
            events.sample({"sender": sender.pid, "receiver": receiver.pid})
        elif kind == "done":
            done = event
        elif kind == "result":
            result = event
        if done is not None and result is not None:
            return done, result, events.sampled()
    raise AssertionError("unreachable: Events ends by raising")


def run_case(
    procs: harness.ChildProcesses, run: TunnelRun, system: str, plan: Plan
) -> dict[str, Any]:
    """One receiver and one sender, started fresh; returns what they measured."""
    tag = f"{system} {size_label(plan.block)}"
    receiver = procs.spawn(f"{tag} receiver", child_argv("recv", system, run, plan))
    sender: harness.Child | None = None
    try:
        endpoint = harness.check_local(
            f"{tag} receiver", harness.expect_ready(receiver, timeout=30.0)
        )
        sender = procs.spawn(f"{tag} sender", child_argv("send", system, run, plan, endpoint))
        # The sender checksums the whole stream before it connects: allow 20 MB/s for that.
        harness.expect_ready(sender, timeout=30.0 + plan.total / (20 * MB))
        done, result, sampled = collect(sender, receiver, plan)
    finally:
        for child in (sender, receiver):
            if child is not None:
                procs.stop(child, grace=5.0)
    return summarise(plan, done, result, sampled)


def summarise(
    plan: Plan, done: dict[str, Any], result: dict[str, Any], sampled: dict[str, Any]
) -> dict[str, Any]:
    problems: list[str] = []
    if done["sent"] != plan.total or done["blocks"] != plan.count:
        problems.append(f"the sender sent {done['sent']:,} bytes in {done['blocks']:,} blocks")
    if result["received"] != plan.total or result["blocks"] != plan.count:
        problems.append(
            f"the receiver got {result['received']:,} of {plan.total:,} bytes in "
            f"{result['blocks']:,} of {plan.count:,} blocks"
        )
    if result["checksum"] != done["expected"]:
        problems.append(
            f"{plan.checksum} mismatch: the receiver got {result['checksum']}, "
            f"the sender sent {done['expected']}"
        )
    if done["report"] != result:
        problems.append("the report the sender got differs from the one the receiver emitted")
    seconds = max(done["seconds"], 1e-9)
    case: dict[str, Any] = {
        "bytes": plan.total,
        "blocks": plan.count,
        "seconds": seconds,
        "mb_per_s": plan.total / seconds / MB,
        # the receiver's own clock, first block to last: the time to set up and report excluded
        "receiver_mb_per_s": plan.total / max(result["t_last"] - result["t_first"], 1e-9) / MB,
        "checksum": plan.checksum,
        "verified": not problems,
        "problems": problems,
        "sender": done,
        "receiver": result,
    }
    if sampled:
        summary = sampled["memory"]
        case["cpu_s"] = {role: summary.get(role, {}).get("cpu_s", 0.0) for role in ROLES}
        case.update(sampled)
    return case


def report_case(case: dict[str, Any]) -> None:
    cpu = case.get("cpu_s", {})
    memory = case.get("memory", {})
    check = f"{case['checksum']} {'ok' if case['verified'] else 'FAILED'}"
    rss = ", ".join(
        f"{role} {memory[role]['peak_mb']:.1f} ({memory[role]['start_mb']:.1f} at start)"
        for role in ROLES
        if role in memory
    )
    harness.progress(
        f"  {case['mb_per_s']:,.1f} MB/s, {size_label(case['bytes'])} in {case['seconds']:.2f} s, "
        f"{check}; CPU s: sender {cpu.get('sender', 0):.2f}, receiver "
        f"{cpu.get('receiver', 0):.2f}; peak RSS MB: {rss or '-'}"
    )
    for problem in case["problems"]:
        harness.progress(f"  FAILED: {problem}")


def run_all(run: TunnelRun) -> None:
    """Block size by block size, every system in turn, so that ratios compare close runs."""
    with harness.ChildProcesses() as procs:
        for plan in run.plans:
            for system in run.systems:
                run.announce(describe(system, plan))
                try:
                    case = run_case(procs, run, system, plan)
                except harness.BenchError as exc:
                    run.fail(system, plan, str(exc))
                    harness.progress(f"  {LABELS[system]}: FAILED: {exc}")
                    continue
                run.results.setdefault(system, {})[str(plan.block)] = case
                report_case(case)
                if case["problems"]:
                    run.fail(system, plan, case["problems"][0])


def parse_blocks(text: str) -> list[int]:
    values = [parse_size(part, "--blocks") for part in text.split(",") if part.strip()]
    if not values:
        raise SystemExit(f"--blocks wants comma-separated sizes, got {text!r}")
    if max(values) > MAX_BLOCK:
        raise SystemExit(
            f"--blocks: at most {size_label(MAX_BLOCK)} (a tunnel's default max_message)"
        )
    return list(dict.fromkeys(values))


def make_plans(args: argparse.Namespace) -> list[Plan]:
    total = parse_size(args.size, "--size")
    window = parse_size(args.window, "--window")
    if args.idle_timeout <= 0:
        raise SystemExit("--idle-timeout must be above 0")
    return [
        Plan(
            block=block,
            total=total,
            window=window,
            checksum=args.checksum,
            idle_timeout_s=args.idle_timeout,
        )
        for block in parse_blocks(args.blocks)
    ]


def main_parent(args: argparse.Namespace) -> int:
    run = TunnelRun(
        systems=harness.parse_only(args.only, SYSTEMS, ALIASES),
        labels=LABELS,
        mesh_systems=MESH_SEALING,
        plans=make_plans(args),
    )
    measure, report = functools.partial(run_all, run), functools.partial(print_table, run)
    window = "irismesh's default tunnel window (1 MiB), each direction"
    figures = functools.partial(ratios, run)
    return harness.run_parent(run, measure, report, figures, args.json, mesh_window=window)


# ============================================================================================
# Parent: report


def _case(run: TunnelRun, system: str, plan: Plan) -> dict[str, Any] | None:
    case: dict[str, Any] | None = run.results.get(system, {}).get(str(plan.block))
    return case


def _ratio(run: TunnelRun, system: str, baseline: str, plan: Plan) -> float | None:
    case, base = _case(run, system, plan), _case(run, baseline, plan)
    if case is None or base is None or not base["mb_per_s"]:
        return None
    ratio: float = case["mb_per_s"] / base["mb_per_s"]
    return ratio


def ratios(run: TunnelRun) -> dict[str, dict[str, float]]:
    """MB/s of each system / raw pyzmq's, and irismesh's / mesh-null's, per block size."""
    out: dict[str, dict[str, float]] = {}
    pairs = [(system, "raw") for system in SYSTEMS if system != "raw"] + [("mesh", "mesh-null")]
    for system, baseline in pairs:
        for plan in run.plans:
            ratio = _ratio(run, system, baseline, plan)
            if ratio is not None:
                out.setdefault(f"{system}/{baseline}", {})[str(plan.block)] = ratio
    return out


def print_table(run: TunnelRun) -> None:
    out = harness.console(160)
    requested = run.requested
    plan0 = run.plans[0]
    table = harness.table(
        f"tunnel on 127.0.0.1: {size_label(plan0.total)} from one sender process to one "
        f"receiver process, per block size ({run.elapsed_s:.0f} s run)",
        ["block", "system"],
        [
            "MB/s",
            "/ raw pyzmq",
            "seconds",
            "CPU s sender",
            "CPU s receiver",
            "peak RSS MB sender",
            "peak RSS MB receiver",
            "check",
            "others' CPU",
        ],
        "MB/s: 10^6 bytes / s, from the sender's first block to the receiver's report "
        "arriving back; higher is better, so a ratio below 1 is slower. CPU s: each process "
        "meanwhile, libzmq's I/O threads included; the receiver's includes the checksum. Peak "
        f"RSS: sampled every {SAMPLE_EVERY * 1000:.0f} ms while streaming, (+ growth over the "
        f"first sample). Windows: raw pyzmq {size_label(plan0.window)} of credit, irismesh its "
        "default tunnel window (1 MiB). check: byte and block count and "
        f"{plan0.checksum} of every byte",
    )
    for plan in run.plans:
        for system in SYSTEMS:
            if system not in requested:
                continue
            label = [size_label(plan.block), LABELS[system]]
            case = _case(run, system, plan)
            if case is None:
                table.add_row(*label, "failed", *[""] * 8)
                continue
            ratio = _ratio(run, system, "raw", plan)
            cpu = case.get("cpu_s", {})
            memory = case.get("memory", {})
            rss_cells = []
            for role in ROLES:
                mem = memory.get(role)
                if mem is None:
                    rss_cells.append("-")
                else:
                    rss_cells.append(
                        f"{mem['peak_mb']:.1f} (+{mem['peak_mb'] - mem['start_mb']:.1f})"
                    )
            others = case.get("others_cpu_percent")
            table.add_row(
                *label,
                f"{case['mb_per_s']:,.1f}",
                harness.ratio_cell(ratio),
                f"{case['seconds']:.2f}",
                *(f"{cpu[role]:.2f}" if role in cpu else "-" for role in ROLES),
                *rss_cells,
                "ok" if case["verified"] else "FAILED",
                "-" if others is None else f"{others:.0f}%",
            )
        table.add_section()
    out.print(table)
    harness.print_costs(
        out,
        "what sealing costs (same run)",
        ["block"],
        [LABELS["mesh-null"]] if "mesh" in requested and "mesh-null" in requested else [],
        (
            [size_label(plan.block), harness.ratio_cell(_ratio(run, "mesh", "mesh-null", plan))]
            for plan in run.plans
        ),
        "irismesh MB/s / null sealer's; below 1.00x: sealing slows it down",
    )
    harness.print_footnotes(out, run)


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__)
    parser.add_argument(
        "--size", default="512M", help="bytes to stream per case, e.g. 64M, 1G (default 512M)"
    )
    parser.add_argument(
        "--blocks",
        default="64K,1M",
        help="block sizes, each a case; the sender sends one message per block (default 64K,1M)",
    )
    harness.add_only(parser, SYSTEMS, "mesh = irismesh sealed, mesh-null: sealing off")
    parser.add_argument(
        "--window",
        default="4M",
        help="raw pyzmq: bytes the receiver grants the sender, given back a quarter at a time "
        "(default 4M; irismesh's tunnel window is its own default, 1 MiB)",
    )
    parser.add_argument(
        "--checksum",
        choices=CHECKSUMS,
        default="crc32",
        help="checksum of every byte: zlib.crc32 chained over the blocks, or SHA-256 "
        "(default crc32)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=10.0,
        help="a child that moves no byte for this long reports a stall and exits (default 10)",
    )
    harness.add_child_arguments(parser, ("send", "recv"), SYSTEMS)
    return parser


if __name__ == "__main__":
    sys.exit(harness.bench_main(build_parser(), run_child, main_parent))
