"""`mesh bench`: throughput and latency percentiles, of request/reply or of publish/subscribe.

`mesh bench CLUSTER` is a client of a running cluster. `mesh bench --pubsub [TOPIC]` brings its
own nodes: a publisher and --subscribers subscriber nodes in this one process, linked through
real sockets (each subscriber seeds from the publisher, besides the user's seeds), so it needs
no running node. Every message carries its send time (`perf_counter_ns`, the one clock of the
process) and a sequence number: the subscribers measure latency, losses and reordering.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

import irismesh
from irismesh._cli.base import (
    CommandError,
    Commands,
    UsageError,
    add_command,
    add_shared_options,
    add_timeout_option,
    byte_size,
    client_keyring,
    cluster_client,
    cluster_name,
    load_keyring,
    make_node,
    positive_int,
    positive_number,
    print_json,
    settle,
    stderr_console,
    stdout_console,
    topic_name,
    topic_scope,
    where,
)
from irismesh.errors import Closed, InterestTimeout, MeshError, SlowConsumer
from irismesh.patterns.pubsub import FLUSH_EVERY, Subscription

PERCENTILES = (50, 90, 99)
REQUESTS = 5000  # --requests, and the defaults below, when not given
CONCURRENCY = 64
MESSAGES = 50000
SUBSCRIBERS = 1
# A --pubsub message: its send time (perf_counter_ns) and sequence number, then padding.
HEADER = struct.Struct("<QQ")
PROBE = HEADER.pack(0, 2**64 - 1)  # sent before the messages until every subscriber got one
# At --rate, how far behind its schedule the publisher may be and still catch up (in bursts).
MAX_LAG = 10_000_000  # ns
_ANY_HOST = re.compile(r"tcp://(\*|0\.0\.0\.0|\[::\])(?=:)")


def register(commands: Commands) -> None:
    parser = add_command(
        commands,
        "bench",
        summary="measure request/reply or publish/subscribe throughput and latency",
        description=(
            "mesh bench CLUSTER joins the mesh as a client, waits for a member of CLUSTER,\n"
            "checks with one request that the cluster answers, then sends --requests requests\n"
            "of --size bytes keeping --concurrency in flight, with a progress bar on stderr.\n"
            "Prints requests per second and latency percentiles (p50, p90, p99, max;\n"
            "milliseconds, from send to reply). Failed requests are counted; any failure makes\n"
            "the exit status 1. The members do the work: `mesh node --cluster C` echoes, so it\n"
            "measures the mesh.\n"
            "\n"
            "mesh bench --pubsub [TOPIC] needs no running node: it runs a publisher and\n"
            "--subscribers subscriber nodes in its own process, linked over real sockets (each\n"
            "subscriber seeds from the publisher, and from --seed if given: they join that mesh\n"
            "too). The subscribers lose nothing (policy block: a slow one holds the publisher\n"
            "back). Once they subscribed (up to --wait seconds), the publisher publishes\n"
            "--messages messages of --size bytes (at least 16: a send time and a sequence\n"
            "number), as fast as they go or at --rate a second. Prints messages per second\n"
            "(first publish to last arrival), latency percentiles (publish to arrival, one clock)\n"
            "and how many messages were lost or came out of order: the exit status is 1 unless\n"
            "both are 0. TOPIC defaults to a new bench.<random> topic; its first segment names\n"
            "the keyring scope (else the default key '*'). --bind is the publisher's; the\n"
            "subscribers listen on the same host, on free ports."
        ),
        examples=(
            "  mesh node --cluster echo &\n"
            "  mesh bench echo\n"
            "  mesh bench echo -n 20000 -c 100 --size 1024 --json\n"
            "  mesh bench --pubsub\n"
            "  mesh bench --pubsub --messages 100000 --size 1024 --subscribers 4\n"
            "  mesh bench --pubsub feeds.bench --rate 2000 --json"
        ),
        run=run_bench,
    )
    parser.add_argument(
        "cluster",
        nargs="?",
        type=cluster_name,
        metavar="CLUSTER",
        help="the cluster to send requests to (request/reply)",
    )
    parser.add_argument(
        "-n",
        "--requests",
        type=positive_int,
        metavar="N",
        help=f"requests to send (default: {REQUESTS})",
    )
    parser.add_argument(
        "-c",
        "--concurrency",
        type=positive_int,
        metavar="C",
        help=f"requests in flight (default: {CONCURRENCY})",
    )
    parser.add_argument(
        "--size",
        type=byte_size,
        default=100,
        metavar="B",
        help="payload bytes (default: %(default)s)",
    )
    add_timeout_option(
        parser,
        "per request; with --pubsub, most seconds a publish waits for room and a subscriber "
        "for its next message",
    )
    pubsub = parser.add_argument_group("publish/subscribe")
    pubsub.add_argument(
        "--pubsub",
        nargs="?",
        const=f"bench.{os.urandom(6).hex()}",  # its own topic: runs side by side never mix
        type=topic_name,
        metavar="TOPIC",
        help="benchmark publish/subscribe on TOPIC (default: a new bench.<random> topic)",
    )
    pubsub.add_argument(
        "--messages",
        type=positive_int,
        metavar="N",
        help=f"messages to publish (default: {MESSAGES})",
    )
    pubsub.add_argument(
        "--subscribers",
        type=positive_int,
        metavar="K",
        help=f"subscriber nodes, each getting every message (default: {SUBSCRIBERS})",
    )
    pubsub.add_argument(
        "--rate",
        type=positive_number,
        metavar="PER_SECOND",
        help="publish at most this many messages a second (default: as fast as they go)",
    )
    add_shared_options(
        parser,
        joining=(
            3.0,
            "seconds to wait for a member of CLUSTER (with --pubsub: for the subscribers)",
        ),
        json="the results as one JSON object",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchResult:
    cluster: str
    members: int
    requests: int
    concurrency: int
    size: int
    seconds: float
    latencies_ms: list[float]  # sorted, one per successful request
    errors: Counter[str]

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    def percentile(self, p: float) -> float | None:
        """Nearest-rank percentile of the latencies."""
        return percentile(self.latencies_ms, p)

    def to_json(self) -> dict[str, object]:
        return {
            "cluster": self.cluster,
            "members": self.members,
            "requests": self.requests,
            "ok": self.ok,
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "concurrency": self.concurrency,
            "size": self.size,
            "seconds": round(self.seconds, 4),
            "requests_per_second": round(self.ok / self.seconds, 1) if self.seconds else 0.0,
            "latency_ms": _latency_json(self.latencies_ms),
        }


def percentile(ordered: list[float], p: float) -> float | None:
    """Nearest-rank percentile of sorted values; None when there are none."""
    if not ordered:
        return None
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def _latency_json(ordered_ms: list[float]) -> dict[str, float | None]:
    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    latency = {f"p{p}": rounded(percentile(ordered_ms, p)) for p in PERCENTILES}
    latency["max"] = rounded(ordered_ms[-1] if ordered_ms else None)
    latency["mean"] = rounded(sum(ordered_ms) / len(ordered_ms) if ordered_ms else None)
    return latency


async def run_bench(args: argparse.Namespace) -> int:
    check_mode(args)
    if args.pubsub is not None:
        return await bench_pubsub(args)
    return await bench_requests(args)


def check_mode(args: argparse.Namespace) -> None:
    """CLUSTER or --pubsub, each with its own options; fills in the defaults of the mode."""
    if args.pubsub is None:
        if args.cluster is None:
            raise UsageError(
                "pass CLUSTER to measure request/reply, or --pubsub to measure publish/subscribe"
            )
        _only_with(
            args, "--pubsub", messages="--messages", subscribers="--subscribers", rate="--rate"
        )
        args.requests = REQUESTS if args.requests is None else args.requests
        args.concurrency = CONCURRENCY if args.concurrency is None else args.concurrency
        return
    if args.cluster is not None:
        raise UsageError(
            f"CLUSTER ({args.cluster!r}) is for request/reply: --pubsub takes no CLUSTER "
            "(--pubsub TOPIC names the topic)"
        )
    _only_with(args, "CLUSTER", requests="--requests", concurrency="--concurrency")
    if args.size < HEADER.size:
        raise UsageError(
            f"--size: must be at least {HEADER.size} bytes with --pubsub (a send time and a "
            f"sequence number), got {args.size}"
        )
    args.messages = MESSAGES if args.messages is None else args.messages
    args.subscribers = SUBSCRIBERS if args.subscribers is None else args.subscribers


def _only_with(args: argparse.Namespace, mode: str, **options: str) -> None:
    for dest, option in options.items():
        if getattr(args, dest) is not None:
            raise UsageError(f"{option} goes with {mode} only")


# ----------------------------------------------------------------- request/reply


async def bench_requests(args: argparse.Namespace) -> int:
    keys = client_keyring(args, args.cluster)
    payload = bytes(args.size)
    async with cluster_client(args, keys, args.cluster) as node:
        await settle(node, args.wait)  # the whole cluster, not just its first member to answer
        members = len(node.members(args.cluster))
        # One request alone first: a cluster that cannot answer fails here with its own error.
        await node.request(args.cluster, payload, timeout=args.timeout)
        latencies: list[float] = []
        errors: Counter[str] = Counter()
        sent = 0

        async def caller() -> None:
            nonlocal sent
            while sent < args.requests:
                sent += 1
                started = time.perf_counter()
                try:
                    await node.request(args.cluster, payload, timeout=args.timeout)
                except MeshError as exc:
                    errors[type(exc).__name__] += 1
                else:
                    latencies.append(time.perf_counter() - started)

        with _progress() as progress:
            task = progress.add_task(args.cluster, total=args.requests)

            def update() -> None:
                progress.update(task, completed=len(latencies) + sum(errors.values()))

            reporter = asyncio.create_task(_report(update))
            started = time.perf_counter()
            try:
                await asyncio.gather(
                    *(caller() for _ in range(min(args.concurrency, args.requests)))
                )
            finally:
                elapsed = time.perf_counter() - started
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
    latencies.sort()
    result = BenchResult(
        cluster=args.cluster,
        members=members,
        requests=args.requests,
        concurrency=args.concurrency,
        size=args.size,
        seconds=elapsed,
        latencies_ms=[s * 1000 for s in latencies],
        errors=errors,
    )
    if args.json:
        print_json(result.to_json())
    else:
        stdout_console().print(result_table(result))
    if errors:
        kinds = ", ".join(f"{n} {kind}" for kind, n in errors.most_common())
        raise CommandError(f"{sum(errors.values())} of {args.requests} requests failed: {kinds}")
    return 0


def _progress() -> Progress:
    """The progress bar on stderr, gone when done; none (not even a blank line) off a terminal."""
    console = stderr_console()
    return Progress(
        TextColumn("[bold]bench[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


async def _report(update: Callable[[], None]) -> None:
    """Call `update` 10 times a second: cheaper than advancing the bar per message."""
    while True:
        update()
        await asyncio.sleep(0.1)


def result_table(result: BenchResult) -> Table:
    data = result.to_json()
    table = Table(
        title=(
            f"bench {result.cluster!r}: {result.requests} requests of {result.size} B, "
            f"{result.concurrency} in flight, {result.members} member(s)"
        ),
        title_justify="left",
    )
    for name in ("req/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors", "seconds"):
        table.add_column(name, justify="right")
    latency = data["latency_ms"]
    assert isinstance(latency, dict)
    table.add_row(
        f"{data['requests_per_second']:,.0f}",
        *(_ms(latency[key]) for key in ("p50", "p90", "p99", "max")),
        str(data["errors"]),
        f"{result.seconds:.2f}",
    )
    return table


def _ms(value: object) -> str:
    return "-" if value is None else f"{value:.3f}"


# ----------------------------------------------------------------- publish/subscribe


@dataclass(slots=True)
class Tally:
    """What one subscriber got of the `expected` messages."""

    expected: int
    seen: bytearray = field(init=False)  # 1 per sequence number received
    unique: int = 0
    received: int = 0  # duplicates included
    out_of_order: int = 0  # came after a message with a higher sequence number (or again)
    latencies_ns: list[int] = field(default_factory=list)
    last_arrival: int = 0  # perf_counter_ns
    ready: bool = False  # a probe came: the publisher knows this subscriber

    def __post_init__(self) -> None:
        self.seen = bytearray(self.expected)

    @property
    def lost(self) -> int:
        return self.expected - self.unique


@dataclass(frozen=True, slots=True, kw_only=True)
class PubSubResult:
    topic: str
    subscribers: int
    messages: int  # published; each subscriber should get every one
    size: int
    rate: float | None
    seconds: float  # first publish to last arrival
    received: int  # at all the subscribers
    lost: int
    out_of_order: int
    latencies_ms: list[float]  # sorted, one per message received

    def to_json(self) -> dict[str, object]:
        per_second = self.messages / self.seconds if self.seconds else 0.0
        return {
            "topic": self.topic,
            "subscribers": self.subscribers,
            "messages": self.messages,
            "size": self.size,
            "rate": self.rate,
            "received": self.received,
            "lost": self.lost,
            "out_of_order": self.out_of_order,
            "seconds": round(self.seconds, 4),
            "messages_per_second": round(per_second, 1),
            "deliveries_per_second": round(per_second * self.subscribers, 1),
            "latency_ms": _latency_json(self.latencies_ms),
        }


async def bench_pubsub(args: argparse.Namespace) -> int:
    keys = load_keyring(args.keys)
    topic: str = args.pubsub
    keys.require(topic_scope(topic) or "*")  # no key for it: say so now, not later
    async with contextlib.AsyncExitStack() as nodes:
        publisher = await nodes.enter_async_context(make_node(args, keys))
        joining = argparse.Namespace(**vars(args))
        joining.bind = _any_port(args.bind)
        joining.seed = [*args.seed, _dialable(publisher.endpoint)]
        subscriptions: list[Subscription] = []
        for _ in range(args.subscribers):
            node = await nodes.enter_async_context(make_node(joining, keys))
            subscriptions.append(node.subscribe(topic, policy="block"))
        tallies = [Tally(args.messages) for _ in subscriptions]
        publisher_id = publisher.node_id.hex()
        receivers = [
            asyncio.create_task(_receive(sub, tally, publisher_id, args.timeout))
            for sub, tally in zip(subscriptions, tallies, strict=True)
        ]
        try:
            await _wait_for_subscribers(publisher, topic, tallies, args)
            with _progress() as progress:
                task = progress.add_task(topic, total=args.messages * args.subscribers)

                def update() -> None:
                    progress.update(task, completed=sum(t.unique for t in tallies))

                reporter = asyncio.create_task(_report(update))
                try:
                    first, published_at = await _publish(publisher, topic, args)
                    await asyncio.gather(*receivers)
                finally:
                    reporter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reporter
        finally:
            for receiver in receivers:
                receiver.cancel()
            await asyncio.gather(*receivers, return_exceptions=True)
    arrivals = [t.last_arrival for t in tallies if t.received]
    result = PubSubResult(
        topic=topic,
        subscribers=args.subscribers,
        messages=args.messages,
        size=args.size,
        rate=args.rate,
        seconds=((max(arrivals) if arrivals else published_at) - first) / 1e9,
        received=sum(t.received for t in tallies),
        lost=sum(t.lost for t in tallies),
        out_of_order=sum(t.out_of_order for t in tallies),
        latencies_ms=sorted(ns / 1e6 for t in tallies for ns in t.latencies_ns),
    )
    if args.json:
        print_json(result.to_json())
    else:
        stdout_console().print(pubsub_table(result))
    if result.lost or result.out_of_order:
        expected = args.messages * args.subscribers
        raise CommandError(
            f"{result.lost} of {expected} message(s) lost, {result.out_of_order} out of order "
            f"(no subscriber may lose or reorder one)"
        )
    return 0


def _any_port(bind: str) -> str:
    """The subscribers' --bind: the publisher's host, any free port."""
    return f"{bind.rpartition(':')[0]}:0"


def _dialable(endpoint: str) -> str:
    """An endpoint to dial for one a node listens on: a wildcard host becomes loopback."""
    match = _ANY_HOST.match(endpoint)
    if match is None:
        return endpoint
    loopback = "[::1]" if match[1].startswith("[") else "127.0.0.1"
    return f"tcp://{loopback}{endpoint[match.end() :]}"


async def _wait_for_subscribers(
    publisher: irismesh.Node, topic: str, tallies: list[Tally], args: argparse.Namespace
) -> None:
    """Until every subscriber node is known to the publisher, at most --wait seconds.

    `wait_for_subscribers` counts any node subscribed to TOPIC (others may be, through
    --seed), so then the publisher sends probes until each of ours got one: what follows a
    probe on the same link arrives after it.
    """
    wanted = len(tallies)
    deadline = time.monotonic() + args.wait
    try:
        with stderr_console().status(f"waiting for {wanted} subscriber(s) of {topic!r}"):
            await publisher.wait_for_subscribers(topic, wanted, timeout=max(args.wait, 0.001))
            while not all(t.ready for t in tallies):
                if time.monotonic() >= deadline:
                    raise InterestTimeout(topic, wanted, sum(t.ready for t in tallies), args.wait)
                await publisher.publish(topic, PROBE, timeout=args.timeout)
                await asyncio.sleep(0.01)
    except InterestTimeout as exc:
        also = f", and {where(args)}" if args.seed or args.survey else ""
        raise CommandError(
            f"{exc.found} of {wanted} subscriber node(s) subscribed to {topic!r} after "
            f"{args.wait:g} s (they dial the publisher at {_dialable(publisher.endpoint)}{also})"
        ) from None


async def _publish(node: irismesh.Node, topic: str, args: argparse.Namespace) -> tuple[int, int]:
    """Publish --messages messages (at --rate); when the first was sent and the last, in ns."""
    clock, pack, publish = time.perf_counter_ns, HEADER.pack, node.publish
    padding = bytes(args.size - HEADER.size)
    interval = round(1e9 / args.rate) if args.rate else 0
    first = due = clock()
    for seq in range(args.messages):
        if interval:
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            due = max(due + interval, clock() - MAX_LAG)  # a stall: catch up, within reason
        try:
            await publish(topic, pack(clock(), seq) + padding, timeout=args.timeout)
        except SlowConsumer as exc:
            raise CommandError(f"{exc} ({seq} published before)") from None
        if seq % FLUSH_EVERY == FLUSH_EVERY - 1:
            # The library sends a batch of publishes every FLUSH_EVERY; let the subscribers,
            # in this event loop too, read it as they would in processes of their own.
            await asyncio.sleep(0)
    return first, clock()


async def _receive(sub: Subscription, tally: Tally, publisher: str, timeout: float) -> None:
    """Read until every message came, or none for `timeout` seconds."""
    clock, unpack, header = time.perf_counter_ns, HEADER.unpack_from, HEADER.size
    seen, expected, latencies = tally.seen, tally.expected, tally.latencies_ns
    highest = -1
    while tally.unique < expected:
        message = sub.get_nowait()
        if message is None:
            try:  # no time limit until the messages start (the publisher waits for them all)
                message = await sub.get(timeout if tally.ready else None)
            except (TimeoutError, Closed):
                return
        arrived = clock()
        payload = message.payload
        if message.publisher != publisher or len(payload) < header:
            continue  # another publisher's, on a TOPIC the user named
        sent, seq = unpack(payload)
        if seq >= expected:
            tally.ready = tally.ready or payload == PROBE
            continue
        tally.received += 1
        tally.last_arrival = arrived
        latencies.append(arrived - sent)
        if seq > highest:
            highest = seq
        else:
            tally.out_of_order += 1
        if not seen[seq]:
            seen[seq] = 1
            tally.unique += 1


def pubsub_table(result: PubSubResult) -> Table:
    data = result.to_json()
    paced = f" at {result.rate:g}/s" if result.rate else ""
    table = Table(
        title=(
            f"bench pubsub {result.topic!r}: {result.messages} messages of {result.size} B"
            f"{paced}, {result.subscribers} subscriber(s)"
        ),
        title_justify="left",
    )
    columns = ("msg/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "received", "lost", "out of order")
    for name in (*columns, "seconds"):
        table.add_column(name, justify="right")
    latency = data["latency_ms"]
    assert isinstance(latency, dict)
    table.add_row(
        f"{data['messages_per_second']:,.0f}",
        *(_ms(latency[key]) for key in ("p50", "p90", "p99", "max")),
        str(result.received),
        str(result.lost),
        str(result.out_of_order),
        f"{result.seconds:.2f}",
    )
    return table
