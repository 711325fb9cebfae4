"""Publish/subscribe benchmark: irismesh beside raw pyzmq (with credit) and NATS, one run.

    python bench/pubsub.py [--sizes 100,1024] [--fanouts 1,4] [--count N | --seconds S]
                           [--only raw,nats,mesh,mesh-iter,mesh-null,mesh-tel] [--json out.json]

One publisher process sends to 1 and to 4 subscriber processes (NATS adds nats-server), all on
127.0.0.1, and nothing may be lost: every payload carries a sequence number, every subscriber
checks that it got every message in order, and the run fails (exit status 1) if raw pyzmq or
irismesh lost or reordered one. NATS has no flow control: its losses are counted and the row
is marked instead. The parent only orchestrates: it starts the children, relays progress,
samples their CPU time and prints the table. bench/README.md says how to read it. The same
file is the children's program (`--role pub|sub`).
"""

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import struct
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import _harness as harness
import zmq

SYSTEMS = ("raw", "nats", "mesh", "mesh-iter", "mesh-null", "mesh-tel")
LABELS = {
    "raw": "raw pyzmq",
    "nats": "NATS",
    "mesh": "irismesh",
    "mesh-iter": "irismesh, async for",
    "mesh-null": "irismesh, null sealer",
    "mesh-tel": "irismesh, telemetry on",
}


# irismesh runs sealed with telemetry off, its subscribers taking messages in a callback (as the
# NATS subscribers do); the variants change one thing each, so what sealing, telemetry and a
# buffered `async for` subscription cost is the variant's figure beside irismesh's, same run.
@dataclass(frozen=True, slots=True)
class MeshOptions:
    sealing: bool
    telemetry: bool
    callback: bool = True


MESH_VARIANTS = {
    "mesh": MeshOptions(sealing=True, telemetry=False),
    "mesh-iter": MeshOptions(sealing=True, telemetry=False, callback=False),
    "mesh-null": MeshOptions(sealing=False, telemetry=False),
    "mesh-tel": MeshOptions(sealing=True, telemetry=True),
}
ALIASES = {"irismesh": "mesh", "pyzmq": "raw"}
TOPIC = "bench.data"  # NATS subject and irismesh topic alike
READY_SUBJECT = "bench.ready"
ACK_TOPIC = "ack.bench"  # subscribers confirm the warm-up here; outside the subscribed pattern
PATTERN = "bench.#"
# A count, not a duration, by default: NATS has no flow control, its publisher outruns the
# subscribers by far, and their backlog would grow with the time spent publishing.
DEFAULT_COUNT = 100_000

# Every payload starts with this header: sequence number, flags. The rest is filler.
HEADER = struct.Struct("<QB")
WARMUP, LAST, PROBE, SYNC = 1, 2, 4, 8
# SYNC marks the last warm-up message: every subscriber confirms it got the whole warm-up
# before the measured stream starts, so that no system starts measuring with a backlog (NATS,
# which has no flow control, would otherwise start with half a second of unread messages).
MIN_SIZE = HEADER.size


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What one publisher and its subscribers run: one payload size, one fan-out."""

    size: int
    fanout: int
    warmup_s: float
    seconds: float  # measured publishing time, unless count is set
    count: int  # measured messages; 0: publish for `seconds`
    window: int  # raw pyzmq: messages a subscriber may have unacknowledged
    credit_every: int  # raw pyzmq: a subscriber acknowledges every this many messages
    idle_timeout_s: float  # a subscriber that gets nothing for this long reports a stall
    join_timeout_s: float = 15.0

    def budget_s(self) -> float:
        """A hard ceiling on one case: generous, but finite."""
        publishing = self.count / 1000.0 if self.count else self.seconds
        return self.warmup_s + publishing + self.join_timeout_s + 2 * self.idle_timeout_s + 30.0


def filler(size: int) -> bytes:
    return bytes(i % 251 for i in range(size - HEADER.size))


# ============================================================================================
# Children: both sides


def schedule(plan: Plan, on_start: Callable[[int], None]) -> Iterator[tuple[int, int]]:
    """(sequence number, flags) of each message to publish: warm-up, measured, the last.

    The publisher waits for every subscriber's confirmation after sending the SYNC message;
    `on_start` runs after that, just before the first measured message.
    """
    clock = time.perf_counter
    seq = 0
    end = clock() + plan.warmup_s
    while clock() < end:
        for _ in range(64):
            yield seq, WARMUP
            seq += 1
    yield seq, WARMUP | SYNC
    seq += 1
    on_start(seq)
    if plan.count:
        for _ in range(plan.count - 1):
            yield seq, 0
            seq += 1
    else:
        end = clock() + plan.seconds
        while clock() < end:
            for _ in range(256):
                yield seq, 0
                seq += 1
    yield seq, LAST


class Publishing:
    """The publisher's record: when measuring started, what it sent, when it finished."""

    def __init__(self) -> None:
        self.t_start = 0.0
        self.first_measured = 0
        self.cpu_start = 0.0

    def start(self, seq: int) -> None:
        self.t_start = time.time()
        self.first_measured = seq
        self.cpu_start = time.process_time()
        harness.emit("start", seq=seq, t=self.t_start)

    def finish(self, last_seq: int, **extra: Any) -> None:
        harness.emit(
            "published",
            published=last_seq + 1,
            measured=last_seq + 1 - self.first_measured,
            t_start=self.t_start,
            t_end=time.time(),
            cpu_s=time.process_time() - self.cpu_start,
            **extra,
        )


class Tally:
    """A subscriber's count: every data message must come, once, in order."""

    __slots__ = (
        "done",
        "expected",
        "lost",
        "measured",
        "missed",
        "on_sync",
        "out_of_order",
        "problems",
        "received",
        "size",
        "t_first",
        "t_last",
        "wrong_size",
    )

    def __init__(self, size: int, on_sync: Callable[[int], object]) -> None:
        self.size = size
        self.on_sync = on_sync  # called with the count received when the warm-up ends
        self.expected = 0
        self.received = 0  # data messages, warm-up included
        self.measured = 0  # data messages after warm-up
        self.lost = 0  # sequence numbers skipped
        self.out_of_order = 0  # sequence numbers that came back or twice
        self.wrong_size = 0
        self.missed = 0  # irismesh: sum of Message.missed
        self.problems: list[str] = []
        self.t_first = 0.0  # first measured message
        self.t_last = 0.0
        self.done = False

    def take(self, payload: bytes) -> None:
        seq, flags = HEADER.unpack_from(payload)
        if flags & PROBE:
            return
        now = time.time()
        if seq != self.expected:
            self._wrong(seq)
        else:
            self.expected = seq + 1
        if len(payload) != self.size:
            self.wrong_size += 1
            self._note(f"message {seq} has {len(payload)} B, not {self.size} B")
        self.received += 1
        if not flags & WARMUP:
            if not self.measured:
                self.t_first = now
            self.measured += 1
        self.t_last = now
        if flags & LAST:
            self.done = True
        if flags & SYNC:
            self.on_sync(self.received)

    def _wrong(self, seq: int) -> None:
        if seq > self.expected:
            self.lost += seq - self.expected
            self._note(f"expected message {self.expected}, got {seq}: {seq - self.expected} lost")
            self.expected = seq + 1
        else:
            self.out_of_order += 1
            self._note(f"expected message {self.expected}, got {seq} (old or repeated)")

    def _note(self, problem: str) -> None:
        if len(self.problems) < 5:
            self.problems.append(problem)

    def report(self, stalled: bool, cpu_s: float, **extra: Any) -> None:
        if stalled:
            self._note(
                f"nothing for the idle timeout after {self.received} messages (last seen "
                f"{self.expected - 1}); the last message never came"
            )
        harness.emit(
            "result",
            received=self.received,
            measured=self.measured,
            lost=self.lost,
            out_of_order=self.out_of_order,
            wrong_size=self.wrong_size,
            missed=self.missed,
            complete=self.done,
            last_seq=self.expected - 1,
            t_first=self.t_first,
            t_last=self.t_last,
            cpu_s=cpu_s,
            problems=self.problems,
            **extra,
        )


class Confirmations:
    """An asyncio publisher's side of the warm-up barrier: one count from each subscriber."""

    def __init__(self, fanout: int) -> None:
        self.fanout = fanout
        self.counts: list[int] = []
        self._all = asyncio.Event()

    def add(self, count: int) -> None:
        self.counts.append(count)
        if len(self.counts) >= self.fanout:
            self._all.set()

    async def wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._all.wait(), timeout)
        except TimeoutError:
            raise harness.BenchError(
                f"{len(self.counts)} of {self.fanout} subscribers confirmed the warm-up "
                f"within {timeout:g} s"
            ) from None
        self._all.clear()


def confirm_soon(send: Callable[[bytes], Coroutine[Any, Any, None]]) -> Callable[[int], None]:
    """An asyncio subscriber's side: send the count received from a task (Tally is sync)."""
    tasks: set[asyncio.Task[None]] = set()

    def confirm(count: int) -> None:
        task = asyncio.get_running_loop().create_task(send(str(count).encode()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return confirm


# ============================================================================================
# Children: raw pyzmq, PUB/SUB with credit on DEALER -> ROUTER


def pub_raw(plan: Plan) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    credit = ctx.socket(zmq.ROUTER)
    for sock in (pub, credit):
        sock.linger = 0
        sock.sndhwm = 0  # credit bounds what is queued; a HWM would drop silently
        sock.rcvhwm = 0
    credit.rcvtimeo = int(plan.idle_timeout_s * 1000)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    credit_port = credit.bind_to_random_port("tcp://127.0.0.1")
    print(f"READY tcp://127.0.0.1:{pub_port},tcp://127.0.0.1:{credit_port}", flush=True)

    # Slow joiners: probe until every subscriber says a probe reached it, so its subscription
    # is in place before the first message that counts.
    acked: dict[bytes, int] = {}
    deadline = time.monotonic() + plan.join_timeout_s
    probe = HEADER.pack(0, PROBE) + filler(plan.size)
    while len(acked) < plan.fanout:
        if time.monotonic() >= deadline:
            raise harness.BenchError(f"{len(acked)} of {plan.fanout} subscribers joined in time")
        pub.send(probe)
        if credit.poll(20, zmq.POLLIN):
            while True:
                try:
                    who, _msg = credit.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                acked[who] = 0

    def wait_for_credit() -> int:
        try:
            frames = credit.recv_multipart()
        except zmq.Again:
            raise harness.BenchError(
                f"no credit from the subscribers for {plan.idle_timeout_s:g} s "
                f"(acknowledged: {acked})"
            ) from None
        while True:
            who, count = frames
            acked[who] = max(acked[who], int.from_bytes(count, "little"))
            try:
                frames = credit.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return min(acked.values())

    record = Publishing()
    body = filler(plan.size)
    pack, send, window = HEADER.pack, pub.send, plan.window
    floor = 0  # messages every subscriber has acknowledged
    seq = 0
    for seq, flags in schedule(plan, record.start):
        while seq - floor >= window:
            floor = wait_for_credit()
        send(pack(seq, flags) + body)
        if flags & SYNC:  # the warm-up ends: wait until every subscriber has all of it
            while floor <= seq:
                floor = wait_for_credit()
    record.finish(seq)
    harness.park()


def sub_raw(endpoint: str, plan: Plan, index: int) -> None:
    pub_endpoint, credit_endpoint = endpoint.split(",")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.rcvhwm = 0
    sub.rcvtimeo = int(plan.idle_timeout_s * 1000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_endpoint)
    credit = ctx.socket(zmq.DEALER)
    credit.linger = 0
    credit.setsockopt(zmq.ROUTING_ID, f"sub{index}".encode())
    credit.connect(credit_endpoint)
    print("READY", flush=True)

    tally = Tally(plan.size, lambda count: credit.send(count.to_bytes(8, "little")))
    recv = sub.recv
    msg = b""
    with contextlib.suppress(zmq.Again):
        while True:  # probes until the publisher knows we are here
            msg = recv()
            if HEADER.unpack_from(msg)[1] & PROBE:
                credit.send(b"\0" * 8)
                break
    cpu0 = time.process_time()
    take, every, send = tally.take, plan.credit_every, credit.send
    stalled = False
    while not tally.done:
        try:
            msg = recv()
        except zmq.Again:
            stalled = True
            break
        take(msg)
        if tally.received % every == 0:
            send(tally.received.to_bytes(8, "little"))
    tally.report(stalled, time.process_time() - cpu0)
    harness.park()


# ============================================================================================
# Children: NATS


async def pub_nats(url: str, plan: Plan) -> None:
    import nats

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    joined: set[bytes] = set()
    everyone = asyncio.Event()

    async def on_ready(msg: Any) -> None:
        joined.add(msg.data)
        if len(joined) >= plan.fanout:
            everyone.set()

    confirmations = Confirmations(plan.fanout)

    async def on_ack(msg: Any) -> None:
        confirmations.add(int(msg.data))

    await nc.subscribe(READY_SUBJECT, cb=on_ready)
    acks = await nc.subscribe(ACK_TOPIC, cb=on_ack)
    await nc.flush()
    print(f"READY {url}", flush=True)
    try:
        await asyncio.wait_for(everyone.wait(), plan.join_timeout_s)
    except TimeoutError:
        raise harness.BenchError(
            f"{len(joined)} of {plan.fanout} subscribers joined in time"
        ) from None

    record = Publishing()
    body = filler(plan.size)
    pack, publish = HEADER.pack, nc.publish
    seq = 0
    for seq, flags in schedule(plan, record.start):
        await publish(TOPIC, pack(seq, flags) + body)
        if flags & SYNC:
            await nc.flush(timeout=60)
            await confirmations.wait(plan.idle_timeout_s + 60)  # no flow control: a backlog
            await acks.unsubscribe()
    await nc.flush(timeout=60)  # everything is at the server
    record.finish(seq)
    await harness.park_async()


async def sub_nats(url: str, plan: Plan, index: int) -> None:
    import nats

    slow: list[str] = []

    async def on_error(exc: Exception) -> None:
        if len(slow) < 3:
            slow.append(f"{type(exc).__name__}: {exc}")

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False, error_cb=on_error)

    async def ack(data: bytes) -> None:
        await nc.publish(ACK_TOPIC, data)
        await nc.flush()

    tally = Tally(plan.size, confirm_soon(ack))
    done = asyncio.Event()

    async def on_message(msg: Any) -> None:
        tally.take(msg.data)
        if tally.done:
            done.set()

    await nc.subscribe(TOPIC, cb=on_message)
    await nc.flush()  # the server has our subscription before the publisher hears of us
    await nc.publish(READY_SUBJECT, str(index).encode())
    await nc.flush()
    print("READY", flush=True)
    cpu0 = time.process_time()
    stalled = await _wait_done(tally, done, plan.idle_timeout_s)
    tally.report(stalled, time.process_time() - cpu0, errors=slow)
    await harness.park_async()


async def _wait_done(tally: Tally, done: asyncio.Event, idle_s: float) -> bool:
    """Wait for the last message; True (stalled) once nothing arrived for `idle_s`."""
    seen = -1
    while not done.is_set():
        if tally.received == seen:
            return True
        seen = tally.received
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), idle_s)
    return False


# ============================================================================================
# Children: irismesh


async def pub_mesh(system: str, keyring_path: str, plan: Plan) -> None:
    import irismesh

    keys = irismesh.Keyring.load(keyring_path)
    opts = MESH_VARIANTS[system]
    node = irismesh.Node(keyring=keys, sealing=opts.sealing, telemetry=opts.telemetry)
    async with node:
        acks = node.subscribe(ACK_TOPIC)
        print("READY", node.endpoint, flush=True)
        await node.wait_for_subscribers(TOPIC, count=plan.fanout, timeout=plan.join_timeout_s)
        record = Publishing()
        body = filler(plan.size)
        pack, publish = HEADER.pack, node.publish
        seq = 0
        fanout = plan.fanout
        short = 0  # publishes that reached fewer nodes than there are subscribers
        for seq, flags in schedule(plan, record.start):
            if await publish(TOPIC, pack(seq, flags) + body) < fanout:
                short += 1
            if flags & SYNC:
                for got in range(fanout):
                    try:
                        await acks.get(timeout=plan.idle_timeout_s)
                    except TimeoutError:
                        raise harness.BenchError(
                            f"{got} of {fanout} subscribers confirmed the warm-up within "
                            f"{plan.idle_timeout_s:g} s"
                        ) from None
                acks.close()  # a publisher with no subscription of its own takes the fast path
        record.finish(seq, short=short)
        await harness.park_async()


async def sub_mesh(system: str, endpoint: str, keyring_path: str, plan: Plan) -> None:
    import irismesh

    keys = irismesh.Keyring.load(keyring_path)
    opts = MESH_VARIANTS[system]
    node = irismesh.Node(
        keyring=keys, seeds=[endpoint], sealing=opts.sealing, telemetry=opts.telemetry
    )
    async with node:

        async def ack(data: bytes) -> None:
            await node.publish(ACK_TOPIC, data)

        tally = Tally(plan.size, confirm_soon(ack))
        if opts.callback:
            done = asyncio.Event()
            cpu = [0.0]

            def on_message(msg: irismesh.Message) -> None:
                if not tally.received:
                    cpu[0] = time.process_time()
                if msg.missed:
                    tally.missed += msg.missed
                    tally._note(f"Message.missed = {msg.missed} before message {tally.expected}")
                tally.take(msg.payload)
                if tally.done:
                    done.set()

            sub = node.subscribe(PATTERN, callback=on_message)
            await node.wait_for_subscribers(ACK_TOPIC, count=1, timeout=plan.join_timeout_s)
            print("READY", flush=True)
            stalled = await _wait_done(tally, done, plan.idle_timeout_s)
            tally.report(stalled, time.process_time() - cpu[0], sub_missed=sub.missed)
            await harness.park_async()
            return
        sub = node.subscribe(PATTERN)
        await node.wait_for_subscribers(ACK_TOPIC, count=1, timeout=plan.join_timeout_s)
        print("READY", flush=True)
        take, get = tally.take, sub.get
        stalled = False
        cpu0 = 0.0
        while not tally.done:
            try:
                msg = await get(timeout=plan.idle_timeout_s)
            except TimeoutError:
                stalled = True
                break
            if not tally.received:
                cpu0 = time.process_time()
            if msg.missed:
                tally.missed += msg.missed
                tally._note(f"Message.missed = {msg.missed} before message {tally.expected}")
            take(msg.payload)
        tally.report(stalled, time.process_time() - cpu0, sub_missed=sub.missed)
        await harness.park_async()


def run_child(args: argparse.Namespace) -> None:
    plan = Plan(**json.loads(args.plan))
    system, index = args.system, args.index
    side: Callable[[], object] | Coroutine[Any, Any, None]
    if system == "raw":
        pub = functools.partial(pub_raw, plan)
        side = pub if args.role == "pub" else functools.partial(sub_raw, args.endpoint, plan, index)
    elif system == "nats":
        pub_side = args.role == "pub"
        side = pub_nats(args.endpoint, plan) if pub_side else sub_nats(args.endpoint, plan, index)
    elif args.role == "pub":
        side = pub_mesh(system, args.keyring, plan)
    else:
        side = sub_mesh(system, args.endpoint, args.keyring, plan)
    harness.child_main(args.max_seconds, side)


# ============================================================================================
# Parent: orchestration


@dataclass(kw_only=True, slots=True)
class PubsubRun(harness.Run):
    """Settings of one benchmark run; its results are system -> size -> fanout -> case."""


def child_argv(
    role: str, system: str, run: PubsubRun, plan: Plan, endpoint: str, index: int = 0
) -> list[str]:
    options = ["--plan", json.dumps(dataclasses.asdict(plan)), "--endpoint", endpoint]
    options += ["--index", str(index), "--max-seconds", f"{plan.budget_s() + 30:.0f}"]
    return run.child_argv(__file__, role, system, *options)


def describe(system: str, plan: Plan) -> str:
    what = f"{plan.count:,} messages" if plan.count else f"{plan.seconds:g} s"
    noun = "subscriber" if plan.fanout == 1 else "subscribers"
    return f"{LABELS[system]} {harness.size_label(plan.size)} to {plan.fanout} {noun}, {what} ..."


def collect(
    pub: harness.Child, subs: list[harness.Child], plan: Plan, pids: dict[str, int]
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Read every child's events until the publisher and all subscribers reported; CPU and RSS
    of every process from the start of the measured stream until then."""
    events = harness.Events([pub, *subs], plan.budget_s(), sample_every=None)
    published: dict[str, Any] | None = None
    results: dict[int, dict[str, Any]] = {}
    for child, kind, event in events:
        if kind == "start":
            events.sample(pids)
        elif kind == "published":
            published = event
        elif kind == "result":
            results[subs.index(child)] = event
        if published is not None and len(results) == len(subs):
            break
    assert published is not None
    return published, [results[i] for i in range(len(subs))], events.sampled()


def run_case(
    procs: harness.ChildProcesses,
    run: PubsubRun,
    system: str,
    plan: Plan,
    broker: dict[str, int],
    url: str,
) -> dict[str, Any]:
    """One publisher and `plan.fanout` subscribers, started fresh; returns what they measured."""
    tag = f"{system} {harness.size_label(plan.size)} x{plan.fanout}"
    pub = procs.spawn(f"{tag} publisher", child_argv("pub", system, run, plan, url))
    subs: list[harness.Child] = []
    try:
        endpoint = harness.check_local(
            f"{tag} publisher", pub.expect_prefix("READY ", timeout=30.0)
        )
        for index in range(plan.fanout):
            argv = child_argv("sub", system, run, plan, endpoint, index)
            subs.append(procs.spawn(f"{tag} subscriber {index}", argv))
        for sub in subs:
            sub.expect_prefix("READY", timeout=30.0)
        pids = {**broker, "publisher": pub.pid}
        pids.update({f"sub{i}": sub.pid for i, sub in enumerate(subs)})
        published, received, sampled = collect(pub, subs, plan, pids)
    finally:
        for child in reversed([pub, *subs]):
            procs.stop(child, grace=5.0)
    return summarise(plan, published, received, sampled)


def summarise(
    plan: Plan,
    published: dict[str, Any],
    received: list[dict[str, Any]],
    sampled: dict[str, Any],
) -> dict[str, Any]:
    total, measured = published["published"], published["measured"]
    t_start = published["t_start"]
    t_last = max(r["t_last"] for r in received)
    slowest = min(r["measured"] for r in received)
    seconds = max(t_last - t_start, 1e-9)
    problems: list[str] = []
    lost = 0
    for index, r in enumerate(received):
        missing = total - r["received"]
        lost += max(0, missing)
        bad = r["out_of_order"] + r["wrong_size"] + r["missed"]
        if missing or bad or not r["complete"]:
            detail = "; ".join(r["problems"]) or "no gap seen"
            problems.append(
                f"subscriber {index} got {r['received']:,} of {total:,} messages "
                f"({missing:,} missing, {r['out_of_order']} out of order, {r['missed']} "
                f"reported missed): {detail}"
            )
    if published.get("short"):
        problems.append(f"{published['short']:,} publishes reached fewer than {plan.fanout} nodes")
    case: dict[str, Any] = {
        "published": total,
        "measured": measured,
        "seconds": seconds,
        "rate": slowest / seconds,
        "publish_rate": measured / max(published["t_end"] - t_start, 1e-9),
        "lost": lost,
        "problems": problems,
        "publisher": published,
        "subscribers": received,
    }
    if sampled:
        summary = sampled["memory"]
        case["cpu_s"] = {
            "publisher": summary.get("publisher", {}).get("cpu_s", 0.0),
            "subscribers": sum(v["cpu_s"] for k, v in summary.items() if k.startswith("sub")),
            "broker": summary.get("broker", {}).get("cpu_s", 0.0),
        }
        case.update(sampled)
    return case


def run_system(run: PubsubRun, system: str) -> None:
    """Start the broker if the system has one, then every size and fan-out in turn."""
    with harness.ChildProcesses() as procs:
        broker: dict[str, int] = {}
        url = ""
        if system == "nats":
            server, url = harness.start_nats_server(procs)
            broker["broker"] = server.pid
        for plan in run.plans:
            run.announce(describe(system, plan))
            case = run_case(procs, run, system, plan, broker, url)
            cells = run.results.setdefault(system, {}).setdefault(str(plan.size), {})
            cells[str(plan.fanout)] = case
            cpu = case.get("cpu_s", {})
            harness.progress(
                f"  {case['rate']:,.0f} msg/s per subscriber, {case['measured']:,} measured "
                f"messages in {case['seconds']:.2f} s; CPU s: publisher "
                f"{cpu.get('publisher', 0):.2f}, subscribers {cpu.get('subscribers', 0):.2f}"
                + (f", broker {cpu['broker']:.2f}" if broker else "")
            )
            if case["problems"]:
                for problem in case["problems"]:
                    harness.progress(f"  {'LOSS' if system == 'nats' else 'FAILED'}: {problem}")
                if system != "nats":
                    where = f"{harness.size_label(plan.size)} to {plan.fanout}"
                    run.failed.setdefault(system, f"{where}: {case['problems'][0]}")


def parse_list(text: str, option: str, minimum: int) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"{option} wants comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise SystemExit(f"{option}: every value must be at least {minimum}, got {text!r}")
    return list(dict.fromkeys(values))


def make_plans(args: argparse.Namespace) -> list[Plan]:
    if args.credit_every > args.window:
        raise SystemExit("--credit-every must not exceed --window")
    return [
        Plan(
            size=size,
            fanout=fanout,
            warmup_s=args.warmup,
            seconds=args.seconds or 0.0,
            count=0 if args.seconds else args.count,
            window=args.window,
            credit_every=args.credit_every,
            idle_timeout_s=args.idle_timeout,
        )
        for size in parse_list(args.sizes, "--sizes", MIN_SIZE)
        for fanout in parse_list(args.fanouts, "--fanouts", 1)
    ]


def main_parent(args: argparse.Namespace) -> int:
    if args.count < 1 or (args.seconds is not None and args.seconds <= 0) or args.warmup < 0:
        raise SystemExit("--count must be at least 1, --seconds above 0 and --warmup >= 0")
    run = PubsubRun(
        systems=harness.parse_only(args.only, SYSTEMS, ALIASES),
        labels=LABELS,
        mesh_systems=MESH_VARIANTS,
        plans=make_plans(args),
    )
    measure = functools.partial(run.each_system, functools.partial(run_system, run))
    report, figures = functools.partial(print_table, run), functools.partial(ratios, run)
    return harness.run_parent(run, measure, report, figures, args.json)


# ============================================================================================
# Parent: report


def _case(run: PubsubRun, system: str, plan: Plan) -> dict[str, Any] | None:
    case: dict[str, Any] | None = (
        run.results.get(system, {}).get(str(plan.size), {}).get(str(plan.fanout))
    )
    return case


def _ratio(run: PubsubRun, system: str, baseline: str, plan: Plan) -> float | None:
    case, base = _case(run, system, plan), _case(run, baseline, plan)
    if case is None or base is None or not base["rate"]:
        return None
    ratio: float = case["rate"] / base["rate"]
    return ratio


def ratios(run: PubsubRun) -> dict[str, dict[str, dict[str, float]]]:
    """Every system's msg/s divided by raw pyzmq's and by NATS's, per size and fan-out."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for baseline in ("raw", "nats"):
        for system in SYSTEMS:
            for plan in run.plans:
                ratio = _ratio(run, system, baseline, plan)
                if ratio is not None and system != baseline:
                    per_size = out.setdefault(f"{system}/{baseline}", {})
                    per_size.setdefault(str(plan.size), {})[str(plan.fanout)] = ratio
    return out


def print_table(run: PubsubRun) -> None:
    out = harness.console(160)
    requested = run.requested
    plan0 = run.plans[0]
    what = f"{plan0.count:,} messages" if plan0.count else f"{plan0.seconds:g} s of publishing"
    table = harness.table(
        f"publish/subscribe on 127.0.0.1, one publisher process, each subscriber its own "
        f"process, {what} after {plan0.warmup_s:g} s warm-up ({run.elapsed_s:.0f} s run)",
        ["size", "subs", "system"],
        [
            "msg/s per sub",
            "/ raw pyzmq",
            "/ NATS",
            "lost",
            "CPU s pub",
            "CPU s subs",
            "CPU s broker",
            "CPU us/delivery",
            "others' CPU",
        ],
        "msg/s: messages of the measured stream / seconds from its first publish to its "
        "last arrival at the slowest subscriber; higher is better, so a ratio below 1 is slower. "
        "CPU: seconds each side used meanwhile, and all processes' CPU per delivered message. "
        "* = NATS lost messages (no flow control); the rate counts what arrived",
    )
    for plan in run.plans:
        for system in SYSTEMS:
            if system not in requested:
                continue
            case = _case(run, system, plan)
            label = [harness.size_label(plan.size), str(plan.fanout), LABELS[system]]
            if case is None:
                state = "skipped" if system in run.skipped else "failed"
                table.add_row(*label, state, *[""] * 8)
                continue
            mark = ""
            if case["problems"]:
                mark = "*" if system == "nats" else " LOSS"
            ratio_cells = [
                harness.ratio_cell(_ratio(run, system, b, plan)) for b in ("raw", "nats")
            ]
            cpu = case.get("cpu_s")
            if cpu is not None:
                deliveries = max(1, case["measured"] * plan.fanout)
                total_cpu = cpu["publisher"] + cpu["subscribers"] + cpu["broker"]
                cpu_cells = [
                    f"{cpu['publisher']:.2f}",
                    f"{cpu['subscribers']:.2f}",
                    f"{cpu['broker']:.2f}" if system == "nats" else "-",
                    f"{total_cpu / deliveries * 1e6:.1f}",
                    f"{case['others_cpu_percent']:.0f}%",
                ]
            else:
                cpu_cells = ["-"] * 5
            table.add_row(
                *label,
                f"{case['rate']:,.0f}{mark}",
                *ratio_cells,
                f"{case['lost']:,}",
                *cpu_cells,
            )
        table.add_section()
    out.print(table)
    variants = [v for v in ("mesh-iter", "mesh-null", "mesh-tel") if v in run.results]
    harness.print_costs(
        out,
        "what a buffered subscription, sealing and telemetry cost: irismesh msg/s / its "
        "variant's, same run",
        ["size", "subs"],
        [LABELS[variant] for variant in variants] if "mesh" in run.results else [],
        (
            [
                harness.size_label(plan.size),
                str(plan.fanout),
                *(harness.ratio_cell(_ratio(run, "mesh", v, plan)) for v in variants),
            ]
            for plan in run.plans
        ),
        "below 1.00x: irismesh (sealed, telemetry off) is slower than the variant",
    )
    harness.print_footnotes(out, run)


def build_parser() -> argparse.ArgumentParser:
    parser = harness.bench_parser(__doc__)
    parser.add_argument(
        "--sizes", default="100,1024", help="payload sizes in bytes (default: 100,1024)"
    )
    parser.add_argument(
        "--fanouts", default="1,4", help="numbers of subscriber processes (default: 1,4)"
    )
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument(
        "--count",
        type=int,
        default=DEFAULT_COUNT,
        help=f"measured messages per case, after warm-up (default {DEFAULT_COUNT:,})",
    )
    amount.add_argument(
        "--seconds",
        type=float,
        help="publish for this many seconds per case instead of a fixed --count",
    )
    parser.add_argument(
        "--warmup", type=float, default=0.5, help="seconds of warm-up messages (default 0.5)"
    )
    harness.add_only(
        parser,
        SYSTEMS,
        "mesh = irismesh sealed, telemetry off, callback subscribers; mesh-iter: `async for` "
        "subscribers; mesh-null: sealing off; mesh-tel: telemetry on",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=1000,
        help="raw pyzmq: messages a subscriber may have unacknowledged (default 1000)",
    )
    parser.add_argument(
        "--credit-every",
        type=int,
        default=250,
        help="raw pyzmq: a subscriber acknowledges every this many messages (default 250)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=10.0,
        help="a subscriber that receives nothing this long stops and reports (default 10)",
    )
    harness.add_child_arguments(parser, ("pub", "sub"), SYSTEMS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    sys.exit(harness.bench_main(build_parser(), run_child, main_parent))
